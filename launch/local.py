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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gossip.config import RunConfig
from gossip.errors import ConfigError, Diverged
from gossip.net.address import split_endpoint
from gossip.net.security import load_keys
from gossip.recipes import recipe
from gossip.tasks import check_task, load_task
from launch.links import Links, check_link_support
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


@dataclass
class Member:
    """One process of the run, and how to start it again."""

    name: str  # "peer 3", or "server"
    argv: list[str]
    log: Path
    proc: Any = None
    restarts: int = 0
    given_up: bool = False  # died for good, and --keep-going lets the others finish
    netns: str | None = None  # its network namespace under --link-mbit


def spawn(cfg: RunConfig, out: Path, method: str, env: dict[str, str], links: Links | None) -> list[Member]:
    """Start the peers (and, in the ps-* modes, the server, as rank ``nodes``), each in its own network
    namespace when the run has ``links``."""
    config = str(out / "config.json")
    if method == "fork":
        warm_up_for_fork()
    members = [Member(f"peer {rank}", [config, "--rank", str(rank)], out / f"peer-{rank}.log",
                      netns=links.namespace(rank) if links else None) for rank in range(cfg.nodes)]
    if cfg.gossip.parameter_server:
        members.append(Member("server", [config, "--server"], out / "server.log",
                              netns=links.namespace(cfg.nodes) if links else None))
    for member in sorted(members, key=lambda m: m.name != "server"):  # the server first: workers find it bound
        member.proc = start_peer(method, member.argv, member.log, env, netns=member.netns)
    write_peers(cfg, out, members)
    return members


def write_peers(cfg: RunConfig, out: Path, members: list[Member]) -> None:
    role = "worker" if cfg.gossip.parameter_server else "peer"
    peers = [{"rank": r, "role": "server" if m.name == "server" else role, "pid": m.proc.pid,
              "endpoint": cfg.gossip.endpoint(r)} for r, m in enumerate(members)]
    (out / "peers.json").write_text(json.dumps(peers, indent=2))


LAST_LINE_CHARS = 300  # of a peer's last log line in the launcher's error


def last_error_line(log_path: Path) -> str:
    """The last line of a peer's log (its error, as a rule), printable and at most ``LAST_LINE_CHARS`` long:
    what a peer logged may quote what others sent it."""
    try:
        with open(log_path, "rb") as log:
            log.seek(max(0, log.seek(0, os.SEEK_END) - 16 * LAST_LINE_CHARS))
            text = log.read().decode("utf-8", "replace")
    except OSError:
        return "no log"
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return "no output"
    line = "".join(c if c.isprintable() else "?" for c in lines[-1])
    return line if len(line) <= LAST_LINE_CHARS else line[:LAST_LINE_CHARS - 3] + "..."


def watch(cfg: RunConfig, members: list[Member], progress: Progress, out: Path, restart) -> str | None:
    """Wait for every process; restart a dead one with ``--resume`` while ``--max-restarts`` allows.
    Returns None on success, else the failure to report."""
    while True:
        progress.update()
        for member in members:
            code = member.proc.poll()
            if code in (None, 0) or member.given_up:
                continue
            reason = f"{member.name} failed (exit {code}): {last_error_line(member.log)}"
            if restart(member):
                print(f"gossip-launch: {reason}; restarted it with --resume ({member.restarts} of "
                      f"{cfg.max_restarts})", file=sys.stderr, flush=True)
                write_peers(cfg, out, members)
            elif cfg.keep_going and member.name != "server":
                member.given_up = True
                print(f"gossip-launch: {reason}; going on without it (--keep-going)", file=sys.stderr, flush=True)
            else:
                return f"{reason} [full log: {member.log}]"
        if all(m.given_up or m.proc.poll() == 0 for m in members):
            return None
        time.sleep(POLL_SECONDS)


def with_links(cfg: RunConfig) -> tuple[RunConfig, Links | None]:
    """With --link-mbit: the run's namespaces (not yet created) and a config whose endpoints are in them.
    The parameter server, when there is one, gets a namespace of its own with an unlimited link."""
    if not cfg.link_mbit:
        return cfg, None
    check_link_support()
    server = (0.0,) if cfg.gossip.parameter_server else ()
    links = Links(cfg.link_mbit + server, tag=f"gossip{os.getpid()}")
    endpoints = links.endpoints(cfg.gossip.network.base_port)
    gossip = cfg.gossip.replace(endpoints=endpoints[:cfg.nodes],
                                server_endpoint=endpoints[cfg.nodes] if server else cfg.gossip.network.server_endpoint)
    return dataclasses.replace(cfg, gossip=gossip), links


def run_local(cfg: RunConfig, progress: str = "auto", start_method: str = START_METHODS[0], plot: bool = True) -> int:
    load_task(cfg.task)  # an unknown task fails here, in one line, not in N peers
    check_task(cfg)  # so does data a built-in task cannot deal out
    if cfg.gossip.network.secure:  # so do missing keys
        for rank in range(cfg.nodes + (1 if cfg.gossip.parameter_server else 0)):
            load_keys(cfg.gossip.network.secure, rank, cfg.nodes, cfg.gossip.parameter_server)
    cfg, links = with_links(cfg)
    if links is None:
        check_ports(cfg)  # in fresh namespaces every port is free
    out = prepare_out(cfg)
    env = {"GOSSIP_LAUNCHER_PID": str(os.getpid()), "OMP_NUM_THREADS": str(cfg.threads_per_peer),
           "PYTHONUNBUFFERED": "1"}

    def restart(member: Member) -> bool:
        if member.restarts >= cfg.max_restarts:
            return False
        member.restarts += 1
        member.proc = start_peer(start_method, [*member.argv, "--resume"], member.log, env, append=True,
                                 netns=member.netns)
        return True

    return supervise(cfg, out, lambda: spawn(cfg, out, start_method, env, links), progress, plot, restart=restart,
                     context=links)


def supervise(cfg: RunConfig, out: Path, start: Callable[[], list[Member]], progress: str, plot: bool,
              restart: Callable[[Member], bool] = lambda member: False,
              summarise_ready: Callable[[], bool] = lambda: True, context: Any = None) -> int:
    """Start the processes with ``start``, show their progress, restart one that died (``restart``), stop
    them all on a failure or a signal, and summarise (when ``summarise_ready`` says every peer's files are
    here). ``context`` (the network namespaces of --link-mbit) is left only after every process stopped.
    Returns the exit status."""

    def on_signal(signum: int, frame: object) -> None:
        raise Interrupted(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    members: list[Member] = []
    started = time.time()
    rounds = cfg.rounds if cfg.gossip.graph.schedule == "time" else 0
    try:
        with context if context is not None else contextlib.nullcontext():
            try:
                members = start()
                with Progress(out, cfg.nodes, cfg.steps, progress, rounds, recipe(cfg.task).headline) as display:
                    failure = watch(cfg, members, display, out, restart)
            except Interrupted as exc:
                print(f"\ngossip-launch: {exc}, stopping {len(members)} peers...", file=sys.stderr)
                stop_all([m.proc for m in members], cfg.gossip.timeouts.shutdown_timeout)
                print(f"gossip-launch: stopped; partial results in {out}", file=sys.stderr)
                return 128 + exc.signum
            finally:
                stop_all([m.proc for m in members], cfg.gossip.timeouts.shutdown_timeout)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if failure:
        print(f"gossip-launch: error: {failure}", file=sys.stderr)
        return 1
    if summarise_ready():
        from launch.summary import RunFailed, summarise

        failed = [m.name for m in members if m.given_up]
        try:
            summarise(cfg, out, wall_seconds=time.time() - started, plot=plot, failed=failed)
        except (Diverged, RunFailed) as exc:  # the run ended, but what it made is not a result
            print(f"gossip-launch: error: {exc} [details: {out / 'summary.json'}]", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print(f"\ngossip-launch: interrupted while summarising; python -m launch.summary {out} does it again",
                  file=sys.stderr)
            return 128 + signal.SIGINT
    return 0
