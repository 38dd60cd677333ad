"""Network addresses, pure: ``tcp://HOST:PORT`` endpoints, what can be bound, and host lists.

ZeroMQ connects to names or addresses but binds only addresses (or an interface name, or ``*``), so a
peer announced under a host name listens on every interface unless ``--bind`` says otherwise. Only IPv4
and host names are supported.

Same-host shortcut (``--ipc``, the default): a peer announced on a loopback address also listens on the
Unix socket ``ipc_endpoint(its endpoint)``, and a neighbour announced on a loopback address is reached
there rather than over TCP loopback (less kernel work per byte: ``bench/exchange.py``). The name is in
Linux's abstract namespace (``ipc://@...``): it vanishes with its process (a restarted peer rebinds it at
once, no file is left behind) and, like loopback itself, it is private to a network namespace, so peers
in namespaces of their own (``--link-mbit``, containers) never reach each other through it and keep the
TCP links they announce. Only loopback counts: a neighbour announced on a routable address may be behind
a port mapping into another namespace, where its Unix socket cannot be reached.
"""

from __future__ import annotations

import ipaddress
import re
import socket
import sys

from gossip.errors import ConfigError

_ENDPOINT = re.compile(r"tcp://([A-Za-z0-9_.\-]+):(\d{1,5})")
_HOST = re.compile(r"[A-Za-z0-9_.\-]+")
_NODE_RANGE = re.compile(r"([^\[,]*)\[([^\]]+)\]([^,\[]*)")


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """(host, port) of ``tcp://HOST:PORT``; ConfigError naming the expected form otherwise."""
    match = _ENDPOINT.fullmatch(endpoint)
    if match is None or not 0 < int(match.group(2)) < 65536:
        raise ConfigError(f"{endpoint!r} is not an endpoint; write tcp://HOST:PORT, e.g. tcp://10.0.0.1:47000")
    return match.group(1), int(match.group(2))


def check_host(host: str, flag: str) -> None:
    if not _HOST.fullmatch(host):
        raise ConfigError(f"{flag} {host!r} is not a host name or IPv4 address, e.g. 10.0.0.1 or node07")


def is_ip(host: str) -> bool:
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        return False
    return True


def bindable(host: str) -> str:
    """The address to listen on for a peer others reach at ``host``: the host itself when it is an IP
    address; 127.0.0.1 for localhost; every interface (0.0.0.0) for any other name."""
    if host == "localhost":
        return "127.0.0.1"
    return host if is_ip(host) else "0.0.0.0"


def dials(sock: socket.socket, address: str) -> bool:
    """Whether the connected socket ``sock`` is a connection to ``address`` (``tcp://HOST:PORT``, or the
    ``ipc://@...`` name ``ipc_endpoint`` gives): the peer's port (and its address, when HOST is one), or
    the Unix socket's name. OSError when ``sock`` is not connected."""
    peer = sock.getpeername()
    if address.startswith("ipc://@"):
        name = address.removeprefix("ipc://@").encode()
        return sock.family == socket.AF_UNIX and peer in (b"\0" + name, "\0" + name.decode())
    match = _ENDPOINT.fullmatch(address)
    if match is None or sock.family != socket.AF_INET:
        return False
    host, port = match.group(1), int(match.group(2))
    return peer[1] == port and (not is_ip(host) or peer[0] == host)


def is_loopback(host: str) -> bool:
    return host == "localhost" or (is_ip(host) and ipaddress.IPv4Address(host).is_loopback)


def ipc_endpoint(endpoint: str) -> str | None:
    """The Unix socket a peer announced at ``endpoint`` also listens on, or None when it listens on TCP
    alone (an endpoint that is not ``tcp://`` on a loopback address, or a system without abstract Unix
    sockets)."""
    match = _ENDPOINT.fullmatch(endpoint)
    if match is None or not is_loopback(match.group(1)) or not sys.platform.startswith("linux"):
        return None
    return f"ipc://@gossip-train/{match.group(1)}:{match.group(2)}"


def parse_hosts(spec: str) -> list[tuple[str, int]]:
    """``a:4,b:2`` -> [("a", 4), ("b", 2)]; a host without ``:N`` has one slot. The same host may not
    appear twice (its ranks would not be contiguous)."""
    hosts: list[tuple[str, int]] = []
    for part in spec.split(","):
        host, _, slots = part.strip().partition(":")
        check_host(host, "--hosts entry")
        if slots and not (slots.isdigit() and int(slots) > 0):
            raise ConfigError(f"--hosts entry {part.strip()!r}: the count after ':' must be a positive integer, "
                              "e.g. a:4,b:2")
        if host in (h for h, _ in hosts):
            raise ConfigError(f"--hosts names {host} twice; give each host once with its count, e.g. {host}:2")
        hosts.append((host, int(slots) if slots else 1))
    return hosts


def host_of_rank(hosts: list[tuple[str, int]], rank: int) -> str:
    """Ranks are dealt out in order: the first host's slots get ranks 0.., then the next host's."""
    first = 0
    for host, slots in hosts:
        if rank < first + slots:
            return host
        first += slots
    raise ConfigError(f"rank {rank} is beyond the {first} slots of --hosts")


def parse_hostfile(text: str) -> str:
    """A hostfile as ``--hosts`` spec. One host per line: ``host``, ``host:N``, ``host slots=N`` (Open MPI)
    or ``host:N`` (MPICH); ``#`` starts a comment."""
    parts = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        host, *options = line.split()
        slots = next((o.partition("=")[2] for o in options if o.startswith("slots=")), "")
        if options and not slots:
            raise ConfigError(f"hostfile line {number} {line!r}: write 'host', 'host:N' or 'host slots=N'")
        parts.append(f"{host}:{slots}" if slots else host)
    if not parts:
        raise ConfigError("the hostfile names no hosts; write one host per line, e.g. 'node01 slots=4'")
    return ",".join(parts)


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compressed node list: ``node[01-03,07],gpu5`` -> node01, node02, node03, node07, gpu5
    (zero padding kept; also a suffix after the brackets)."""
    nodes: list[str] = []
    position = 0
    while position < len(nodelist):
        match = _NODE_RANGE.match(nodelist, position)
        if match:
            prefix, ranges, suffix = match.groups()
            nodes += [prefix + index + suffix for index in _expand_ranges(ranges, nodelist)]
            position = match.end()
        else:
            end = nodelist.find(",", position)
            end = len(nodelist) if end < 0 else end
            nodes.append(nodelist[position:end])
            position = end
        if position < len(nodelist) and nodelist[position] == ",":
            position += 1
    if not nodes or not all(nodes):
        raise ConfigError(f"cannot read the SLURM node list {nodelist!r}")
    return nodes


def _expand_ranges(ranges: str, nodelist: str) -> list[str]:
    indices = []
    for part in ranges.split(","):
        first, _, last = part.partition("-")
        if not first.isdigit() or (last and not last.isdigit()):
            raise ConfigError(f"cannot read the SLURM node list {nodelist!r} (range {part!r})")
        width = len(first)
        indices += [str(i).zfill(width) for i in range(int(first), int(last or first) + 1)]
    return indices
