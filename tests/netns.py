"""Two hosts made of Linux network namespaces, for tests and benchmarks across a real network boundary.

The namespaces are joined by two veth links: ``wan`` (10.77.1.0/24), limited on both ends by a token
bucket (``tc qdisc ... tbf``; this kernel has no ``netem``), and ``lan`` (10.77.2.0/24), unlimited. Host i
has address ``wan[i]`` and ``lan[i]``. ``shell`` is a script used like ssh (``shell HOST COMMAND``): it
runs COMMAND in the namespace that owns HOST, without exec, so that, as with ssh, a signal to it does not
reach the command. Needs root, ``ip`` and ``tc``; ``unavailable()`` says why not, for a skip.

``python -m tests.netns recv|send ADDRESS PORT [BYTES]`` is a TCP sink and source for measuring a link.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import count
from pathlib import Path

_names = count()


@dataclass(frozen=True)
class TwoHosts:
    namespaces: tuple[str, str]
    wan: tuple[str, str] = ("10.77.1.1", "10.77.1.2")
    lan: tuple[str, str] = ("10.77.2.1", "10.77.2.2")
    wan_devices: tuple[str, str] = ("gw6wan0", "gw6wan1")
    lan_devices: tuple[str, str] = ("gw6lan0", "gw6lan1")
    shell: Path = Path()

    def exec(self, host: int, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespaces[host], *argv]

    def tx_bytes(self, host: int, device: str) -> int:
        shown = _ip("-n", self.namespaces[host], "-j", "-s", "link", "show", "dev", device)
        return int(json.loads(shown)[0]["stats64"]["tx"]["bytes"])


@functools.cache
def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None (probed once per process)."""
    if sys.platform != "linux" or os.geteuid() != 0:
        return "network namespaces need root on Linux"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the {tool!r} command (iproute2) is missing"
    probe = f"gw6probe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


@contextmanager
def two_hosts(directory: Path, rate: str = "100mbit") -> Iterator[TwoHosts]:
    """Make the namespaces and links, yield them, and delete them (and the links with them) however we leave."""
    tag = f"gw6-{os.getpid()}-{next(_names)}"
    hosts = TwoHosts((f"{tag}a", f"{tag}b"), shell=directory / f"{tag}-shell")
    try:
        for name in hosts.namespaces:
            _ip("netns", "add", name)
            _ip("-n", name, "link", "set", "lo", "up")
        for devices, addresses in ((hosts.wan_devices, hosts.wan), (hosts.lan_devices, hosts.lan)):
            _ip("link", "add", devices[0], "netns", hosts.namespaces[0], "type", "veth", "peer", "name", devices[1],
                "netns", hosts.namespaces[1])
            for side in (0, 1):
                _ip("-n", hosts.namespaces[side], "addr", "add", f"{addresses[side]}/24", "dev", devices[side])
                _ip("-n", hosts.namespaces[side], "link", "set", devices[side], "up")
        for side in (0, 1):  # both directions of the wan link
            _run(hosts.exec(side, ["tc", "qdisc", "add", "dev", hosts.wan_devices[side], "root", "tbf", "rate", rate,
                                   "burst", "32kbit", "latency", "50ms"]))
        _write_shell(hosts)
        yield hosts
    finally:
        for name in hosts.namespaces:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        hosts.shell.unlink(missing_ok=True)


def _write_shell(hosts: TwoHosts) -> None:
    cases = "\n".join(f"  {hosts.wan[i]}|{hosts.lan[i]}) ns={hosts.namespaces[i]} ;;" for i in (0, 1))
    hosts.shell.write_text(f'#!/bin/sh\nhost=$1; shift\ncase "$host" in\n{cases}\n'
                           f'  *) echo "no test host $host" >&2; exit 255 ;;\nesac\nip netns exec "$ns" sh -c "$*"\n')
    hosts.shell.chmod(0o755)


def _ip(*args: str) -> str:
    return _run(["ip", *args])


def _run(argv: list[str]) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip()}")
    return done.stdout


def throughput(hosts: TwoHosts, address: str, size: int, port: int) -> float:
    """Bytes per second of one TCP stream of ``size`` bytes from host 0 to ``address`` on host 1."""
    root = Path(__file__).resolve().parent.parent
    sink = subprocess.Popen(hosts.exec(1, [sys.executable, "-m", "tests.netns", "recv", address, str(port)]),
                            cwd=root, stdout=subprocess.PIPE, text=True)
    try:
        if sink.stdout.readline().strip() != "listening":
            raise RuntimeError(f"the TCP sink on {address} did not start")
        subprocess.run(hosts.exec(0, [sys.executable, "-m", "tests.netns", "send", address, str(port), str(size)]),
                       cwd=root, check=True, timeout=60)
        total, seconds = sink.communicate(timeout=60)[0].split()
    finally:
        if sink.poll() is None:
            sink.kill()
            sink.wait(10)
    if int(total) != size:
        raise RuntimeError(f"the sink received {total} of {size} bytes")
    return int(total) / float(seconds)


def receive(address: str, port: int) -> None:
    """Accept one connection, read it to the end, print 'bytes seconds' from the first byte to the last."""
    with socket.create_server((address, port)) as server:
        print("listening", flush=True)
        connection, _ = server.accept()
        total, first = 0, None
        while data := connection.recv(1 << 20):
            first = first or time.perf_counter()
            total += len(data)
        print(total, time.perf_counter() - first, flush=True)


def send(address: str, port: int, size: int) -> None:
    block = b"\0" * (1 << 20)
    with socket.create_connection((address, port), timeout=30) as connection:
        for _ in range(size // len(block)):
            connection.sendall(block)


if __name__ == "__main__":
    role, address, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    receive(address, port) if role == "recv" else send(address, port, int(sys.argv[4]))
