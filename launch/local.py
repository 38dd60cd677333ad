"""Start N peer processes on this machine, watch them, stop them all cleanly, and summarise.

Peers run in their own sessions, so Ctrl+C reaches only the launcher, which forwards SIGTERM to every
peer, waits ``shutdown_timeout`` and then kills what is left. A peer that fails stops the run: the
launcher names the peer and its last error line, stops the others and exits non-zero. Peers also get
SIGTERM if the launcher itself dies (PR_SET_PDEATHSIG), so no process outlives a run.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

from gossip.address import split_endpoint
from gossip.config import RunConfig
from gossip.errors import ConfigError
from gossip.tasks import load_task
from launch.procs import START_METHODS, start_peer, stop_all, warm_up_for_fork
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


def check_ports(cfg: RunConfig, ranks: list[int] | None = None) -> None:
    """Fail before spawning anything when a local peer's port is taken (a leftover run, another program)."""
    everyone = range(cfg.nodes + (1 if cfg.gossip.parameter_server else 0))
    for rank in everyone if ranks is None else ranks:
        host, port = split_endpoint(cfg.gossip.bind_endpoint(rank))
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as libzmq does: TIME_WAIT is no conflict
            try:
                probe.bind((host, port))
            except OSError as exc:
                who = "the server" if rank == cfg.nodes else f"peer {rank}"
                raise ConfigError(f"port {port} for {who} on {host} is unavailable ({exc.strerror}); "
                                  f"choose another --base-port") from exc


def spawn(cfg: RunConfig, out: Path, method: str) -> list:
    """Start the peers (and, in the ps-* modes, the server last, as rank ``nodes``)."""
    env = {"GOSSIP_LAUNCHER_PID": str(os.getpid()), "OMP_NUM_THREADS": str(cfg.threads_per_peer),
           "PYTHONUNBUFFERED": "1"}
    config = str(out / "config.json")
    if method == "fork":
        warm_up_for_fork()
    # the server starts first, so that workers find it bound; it still comes last in the lists
    server = start_peer(method, [config, "--server"], out / "server.log", env) if cfg.gossip.parameter_server else None
    procs = [start_peer(method, [config, "--rank", str(rank)], out / f"peer-{rank}.log", env)
             for rank in range(cfg.nodes)]
    peers = [{"rank": r, "role": "worker" if server else "peer", "pid": p.pid, "endpoint": cfg.gossip.endpoint(r)}
             for r, p in enumerate(procs)]
    if server:
        procs.append(server)
        peers.append({"rank": cfg.nodes, "role": "server", "pid": server.pid,
                      "endpoint": cfg.gossip.endpoint(cfg.gossip.server_rank)})
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
            name, log = ("server", out / "server.log") if rank == len(progress.peers) else \
                (f"peer {rank}", out / f"peer-{rank}.log")
            return f"{name} failed (exit {code}): {last_error_line(log)} [full log: {log}]"
        if all(c == 0 for c in codes):
            return None
        time.sleep(POLL_SECONDS)


def run_local(cfg: RunConfig, progress: str = "auto", start_method: str = START_METHODS[0], plot: bool = True) -> int:
    load_task(cfg.task)  # an unknown task fails here, in one line, not in N peers
    check_ports(cfg)
    out = prepare_out(cfg)
    return supervise(cfg, out, lambda: spawn(cfg, out, start_method), progress, plot)


def supervise(cfg: RunConfig, out: Path, start: Callable[[], list], progress: str, plot: bool,
              summarise_ready: Callable[[], bool] = lambda: True) -> int:
    """Start the peers with ``start``, show their progress, stop them all on a failure or a signal, and
    summarise (when ``summarise_ready`` says every peer's files are here). Returns the exit status."""

    def on_signal(signum: int, frame: object) -> None:
        raise Interrupted(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    procs: list = []
    started = time.time()
    try:
        procs = start()
        with Progress(out, cfg.nodes, cfg.steps, progress) as display:
            failure = watch(procs, display, out)
    except Interrupted as exc:
        print(f"\ngossip-launch: {exc}, stopping {len(procs)} peers...", file=sys.stderr)
        stop_all(procs, cfg.gossip.shutdown_timeout)
        print(f"gossip-launch: stopped; partial results in {out}", file=sys.stderr)
        return 128 + exc.signum
    finally:
        stop_all(procs, cfg.gossip.shutdown_timeout)
        for s, handler in previous.items():
            signal.signal(s, handler)
    if failure:
        print(f"gossip-launch: error: {failure}", file=sys.stderr)
        return 1
    if summarise_ready():
        from launch.summary import summarise

        summarise(cfg, out, wall_seconds=time.time() - started, plot=plot)
    return 0
