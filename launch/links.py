"""Heterogeneous links for local runs: per-peer bandwidth through the kernel's own network path.

With ``--link-mbit`` every peer runs in a network namespace of its own, joined by a veth pair to one
bridge in a hub namespace; all of them are created here for the run and deleted when it ends, and nothing
is added to the host's own namespace. Peer r listens on ``tcp://10.77.0.(r + 1):(BASE_PORT + r)``. A peer
with a rate R > 0 gets a ``tc`` token-bucket filter (``tbf``) of R Mbit/s on both ends of its veth, so its
upload and its download each pass through the kernel's queueing at that rate: TCP, ZeroMQ and our
transport see a real slow link (segmentation, congestion control, backlog), not a sleep.

Latency is not added here: this kernel has no ``netem`` qdisc, and ``tbf`` only delays packets that queue
behind others (its ``latency`` is a queue bound, not a delay). ``--link-latency-ms`` is therefore emulated by
the sending transport, which holds each message for the sender's plus the receiver's latency before it
enters the socket (see ``gossip/net/transport.py``); TCP's own round trip stays that of the veth.

Needs root and the ``ip`` and ``tc`` commands (iproute2); anything else is one ConfigError line.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from collections.abc import Sequence

from gossip.errors import ConfigError

SUBNET = "10.77"
CLONE_NEWNET = 0x40000000
BURST_SECONDS = 0.01  # token bucket depth: 10 ms at the rate, so bursts stay short against the rate
QUEUE_SECONDS = 0.2  # tbf "latency": how long a packet may queue before it is dropped (TCP then backs off)


def check_link_support() -> None:
    """ConfigError unless this process may create namespaces and qdiscs."""
    if os.geteuid() != 0:
        raise ConfigError("--link-mbit needs root (it creates network namespaces and tc qdiscs); "
                          "run as root, or leave --link-mbit out")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise ConfigError(f"--link-mbit needs the {' and '.join(missing)} command(s) (package iproute2)")


def address(rank: int) -> str:
    return f"{SUBNET}.{rank // 250}.{rank % 250 + 1}"


class Links:
    """One namespace per peer behind a shared bridge, with tbf rate limits; a context manager that removes
    every namespace (and with it every veth, bridge and qdisc) on exit, also after a failure."""

    def __init__(self, rates_mbit: Sequence[float], tag: str) -> None:
        self.rates_mbit = list(rates_mbit)
        self.tag = tag  # distinguishes concurrent runs; namespace and device names derive from it
        self.hub = f"{tag}-hub"
        self.created: list[str] = []

    def namespace(self, rank: int) -> str:
        return f"{self.tag}-{rank}"

    def endpoints(self, base_port: int) -> tuple[str, ...]:
        return tuple(f"tcp://{address(r)}:{base_port + r}" for r in range(len(self.rates_mbit)))

    def __enter__(self) -> Links:
        check_link_support()
        try:
            self._namespace(self.hub)
            _run("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
            _run("ip", "-n", self.hub, "link", "set", "br0", "up")
            for rank, rate in enumerate(self.rates_mbit):
                self._peer(rank, rate)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _namespace(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self.created.append(name)
        _run("ip", "-n", name, "link", "set", "lo", "up")

    def _peer(self, rank: int, rate_mbit: float) -> None:
        name, hub_end = self.namespace(rank), f"v{rank}"
        self._namespace(name)
        _run("ip", "-n", self.hub, "link", "add", hub_end, "type", "veth", "peer", "name", "eth0", "netns", name)
        _run("ip", "-n", self.hub, "link", "set", hub_end, "master", "br0", "up")
        _run("ip", "-n", name, "addr", "add", f"{address(rank)}/16", "dev", "eth0")
        _run("ip", "-n", name, "link", "set", "eth0", "up")
        if rate_mbit > 0:
            for namespace, device in ((name, "eth0"), (self.hub, hub_end)):  # upload, download
                _run("tc", "-n", namespace, "qdisc", "add", "dev", device, "root", *tbf_args(rate_mbit))

    def close(self) -> None:
        """Delete every namespace this object created (idempotent)."""
        while self.created:
            name = self.created.pop()
            subprocess.run(["ip", "netns", "delete", name], capture_output=True, check=False)


def tbf_args(rate_mbit: float) -> list[str]:
    bytes_per_second = rate_mbit * 1e6 / 8
    burst = max(16_384, int(bytes_per_second * BURST_SECONDS))
    return ["tbf", "rate", f"{rate_mbit}mbit", "burst", str(burst), "latency", f"{int(QUEUE_SECONDS * 1000)}ms"]


def enter_namespace(name: str) -> None:
    """Move this (single-threaded, freshly forked) process into network namespace ``name``."""
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if ctypes.CDLL("libc.so.6", use_errno=True).setns(fd, CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"setns into network namespace {name}: {os.strerror(errno)}")
    finally:
        os.close(fd)


def _run(*command: str) -> None:
    proc = subprocess.run(command, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise ConfigError(f"cannot set up the emulated links: '{' '.join(command)}' failed: "
                          f"{proc.stderr.strip() or proc.returncode}")
