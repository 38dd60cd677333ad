"""Starting and stopping local peer processes.

Two start methods, both real processes in their own session (so Ctrl+C reaches only the launcher):

- ``fork`` (default on Linux): the launcher, which has already imported torch, forks each peer, which
  then runs ``gossip.peer.main``. A peer is up in milliseconds instead of the seconds a fresh interpreter
  spends importing torch, which matters when 8 peers share 2 cores. Safe because the launcher has run no
  torch operation (no OpenMP pool exists yet), opened no socket and started no thread before forking.
- ``exec``: ``python -m gossip.peer CONFIG --rank R``, exactly as a user starts a peer by hand.

Both give the peer ``GOSSIP_LAUNCHER_PID`` so it asks for SIGTERM when the launcher dies, and send its
stdout and stderr to ``peer-<rank>.log``. With emulated links (``launch/links.py``) a peer starts inside
its network namespace: a forked one enters it first thing, an exec'd one runs under ``ip netns exec``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

from gossip.exit import exit_now

START_METHODS = ("fork", "exec") if hasattr(os, "fork") else ("exec",)


def warm_up_for_fork() -> None:
    """Import, once in the launcher, what every forked peer would otherwise import on its own: the peer
    modules, and the ~2 s that torch spends on its first optimizer (it imports torch._dynamo). Starts no
    thread and runs no parallel torch operation, so forking afterwards stays safe."""
    import torch

    import gossip.coordinator.server  # noqa: F401
    import gossip.peer  # noqa: F401 - the imports are the point

    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)


class ForkedPeer:
    """A forked peer with the part of ``subprocess.Popen``'s interface the launcher uses."""

    def __init__(self, argv: list[str], log_path: Path, env: dict[str, str], append: bool = False,
                 netns: str | None = None) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child never returns from here
            _run_forked_peer(argv, log_path, env, append, netns)
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"peer {self.pid}", timeout)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _run_forked_peer(argv: list[str], log_path: Path, env: dict[str, str], append: bool, netns: str | None) -> None:
    code = 1
    try:
        os.setsid()
        if netns is not None:
            from launch.links import enter_namespace

            enter_namespace(netns)
        log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC), 0o644)
        null_fd = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null_fd, 0)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.environ.update(env)
        from gossip.peer import main

        code = main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except Exception:  # a bug: print it into the peer's log; ``finally`` still ends the child
        traceback.print_exc()
    finally:
        exit_now(code)


def start_peer(method: str, argv: list[str], log_path: Path, env: dict[str, str], append: bool = False,
               netns: str | None = None):
    """Start ``gossip.peer`` with ``argv`` (the config path, then ``--rank R`` or ``--server``), inside network
    namespace ``netns`` when given (``--link-mbit``)."""
    if method == "fork":
        return ForkedPeer(argv, log_path, env, append, netns)
    prefix = ["ip", "netns", "exec", netns] if netns is not None else []
    with open(log_path, "ab" if append else "wb") as log_file:
        return subprocess.Popen([*prefix, sys.executable, "-m", "gossip.peer", *argv],
                                stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                                env={**os.environ, **env}, start_new_session=True)


def stop_all(procs: list, grace: float) -> None:
    """SIGTERM every live peer, wait up to ``grace`` seconds, SIGKILL the rest; only our own children. A peer
    on another host (started through ssh, with a pipe as its stdin) stops when that pipe closes."""
    for proc in procs:
        if getattr(proc, "stdin", None) is not None and not proc.stdin.closed:
            proc.stdin.close()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
