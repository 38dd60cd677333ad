"""Start N peer processes on this machine, watch them, stop them all cleanly, and summarise.

Peers run in their own sessions, so Ctrl+C reaches only the launcher, which forwards SIGTERM to every
peer, waits ``shutdown_timeout`` and then kills what is left. A peer that fails stops the run: the
launcher names the peer and its last error line, stops the others and exits non-zero. Peers also get
SIGTERM if the launcher itself dies (PR_SET_PDEATHSIG), so no process outlives a run. With
``--link-mbit`` each peer runs in a network namespace of its own behind a rate limit
(``launch/links.py``); the namespaces are removed after the peers stopped, on every way out.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

from gossip.config import RunConfig
from gossip.errors import ConfigError
from gossip.tasks import load_task
from launch.links import Links, check_link_support
from launch.procs import START_METHODS, start_peer, stop_all
from launch.progress import Progress

POLL_SECONDS = 0.25


class Interrupted(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def prepare_out(cfg: RunConfig) -> Path:
    out = Path(cfg.out)
    if (out / "peers.json").exists():
        raise ConfigError(f"{out} already holds a run (peers.json); choose another --out or remove it")
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(cfg.to_json())
    except OSError as exc:
        raise ConfigError(f"cannot write to the output directory {out}: {exc.strerror}; choose another --out") from exc
    return out


def check_ports(cfg: RunConfig) -> None:
    """Fail before spawning anything when a peer's port is taken (a leftover run, another program)."""
    for rank in range(cfg.nodes):
        port = cfg.gossip.base_port + rank
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as libzmq does: TIME_WAIT is no conflict
            try:
                probe.bind((cfg.gossip.host, port))
            except OSError as exc:
                raise ConfigError(f"port {port} for peer {rank} on {cfg.gossip.host} is unavailable ({exc.strerror}); "
                                  f"choose another --base-port") from exc


def spawn(cfg: RunConfig, out: Path, method: str, links: Links | None = None) -> list:
    env = {"GOSSIP_LAUNCHER_PID": str(os.getpid()), "OMP_NUM_THREADS": str(cfg.threads_per_peer),
           "PYTHONUNBUFFERED": "1"}
    procs = [start_peer(method, rank, out / "config.json", out / f"peer-{rank}.log", env,
                        links.namespace(rank) if links else None) for rank in range(cfg.nodes)]
    peers = [{"rank": r, "pid": p.pid, "endpoint": cfg.gossip.endpoint(r)} for r, p in enumerate(procs)]
    (out / "peers.json").write_text(json.dumps(peers, indent=2))
    return procs


def last_error_line(log_path: Path) -> str:
    try:
        lines = [line.strip() for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "no log"
    return lines[-1] if lines else "no output"


def watch(procs: list, progress: Progress, out: Path) -> str | None:
    """Wait for every peer; returns None on success, else the failure to report."""
    while True:
        progress.update()
        codes = [p.poll() for p in procs]
        failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            rank, code = failed[0]
            return (f"peer {rank} failed (exit {code}): {last_error_line(out / f'peer-{rank}.log')} "
                    f"[full log: {out / f'peer-{rank}.log'}]")
        if all(c == 0 for c in codes):
            return None
        time.sleep(POLL_SECONDS)


def with_links(cfg: RunConfig) -> tuple[RunConfig, Links | None]:
    """With --link-mbit: the run's namespaces (not yet created) and a config whose endpoints are in them."""
    if not cfg.link_mbit:
        return cfg, None
    check_link_support()
    links = Links(cfg.link_mbit, tag=f"gossip{os.getpid()}")
    return dataclasses.replace(cfg, gossip=dataclasses.replace(cfg.gossip, endpoints=links.endpoints(
        cfg.gossip.base_port))), links


def run_local(cfg: RunConfig, progress: str = "auto", start_method: str = START_METHODS[0]) -> int:
    load_task(cfg.task)  # an unknown task fails here, in one line, not in N peers
    cfg, links = with_links(cfg)
    if links is None:
        check_ports(cfg)  # in fresh namespaces every port is free
    out = prepare_out(cfg)

    def on_signal(signum: int, frame: object) -> None:
        raise Interrupted(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    procs: list = []
    started = time.time()
    namespaces = links if links is not None else contextlib.nullcontext()
    rounds = cfg.rounds if cfg.gossip.schedule == "time" else 0
    try:
        with namespaces:  # removed after the peers are stopped, whichever way we leave
            try:
                procs = spawn(cfg, out, start_method, links)
                with Progress(out, cfg.nodes, cfg.steps, progress, rounds) as display:
                    failure = watch(procs, display, out)
            except Interrupted as exc:
                print(f"\ngossip-launch: {exc}, stopping {len(procs)} peers...", file=sys.stderr)
                stop_all(procs, cfg.gossip.shutdown_timeout)
                print(f"gossip-launch: stopped; partial results in {out}", file=sys.stderr)
                return 128 + exc.signum
            finally:
                stop_all(procs, cfg.gossip.shutdown_timeout)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if failure:
        print(f"gossip-launch: error: {failure}", file=sys.stderr)
        return 1
    from launch.summary import summarise

    summarise(cfg, out, wall_seconds=time.time() - started)
    return 0
