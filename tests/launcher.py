"""Launchers for the tests, forked from one warmed process instead of started with ``python -m launch``.

Every launcher first imports torch and creates an optimizer (which imports torch's compiler stack), about
3 s of one core before its peers start; the launcher then forks its peers from that warmed state
(``launch/procs.py``). With about a hundred launcher runs in the suite, that start was close to half of
the suite's time (654 s before, 375 s after, on the same 2-core machine). So the tests start one process
per session that does the same warm-up once (``serve``) and forks a launcher for every run. Each launcher
is still its own process with its own PID, working directory, stdout and stderr, and the environment the
test process has at that moment; it runs ``launch.cli.main(argv)`` exactly as ``python -m launch ARGV``
does after its imports, forks its peers as usual, takes signals and exits with its own status. What this
skips is the interpreter's start and the imports, which the tests that run ``python -m launch`` itself
(Ctrl-C, the command of the README, the launcher across two hosts) still cover.

The server is single-threaded and has run no torch operation in parallel, the premise under which the
launcher forks its peers. It reads one request per line on stdin (JSON: argv, cwd, env, the stdout and
stderr paths, and the path where it writes the exit status once it reaps the launcher), answers the PID
on stdout, and ends when stdin closes.
"""

from __future__ import annotations

import json
import os
import random
import select
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path


class Launched:
    """A launcher forked by the server: the part of ``subprocess.Popen``'s interface the tests use, with
    stdout and stderr in files (read by ``communicate``)."""

    def __init__(self, pid: int, stdout: Path, stderr: Path, status: Path) -> None:
        self.pid, self._stdout, self._stderr, self._status = pid, stdout, stderr, status
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and self._status.exists():
            self.returncode = int(self._status.read_text())
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = 0.01
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"launcher {self.pid}", timeout)
            time.sleep(pause)
            pause = min(2 * pause, 0.05)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        return self._stdout.read_text(), self._stderr.read_text()

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:  # not yet reaped, so the PID is still this launcher's
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class LauncherServer:
    """The test side of ``serve``: ``start`` forks a launcher with the test's environment as it is now, plus
    ``env``; ``close`` ends the server (not its launchers)."""

    def __init__(self, root: Path) -> None:
        self._proc = subprocess.Popen([sys.executable, "-m", "tests.launcher"], cwd=root, stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True)
        if self._proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the launcher server did not start (exit {self._proc.wait(30)})")

    def start(self, argv: list[str], cwd: Path, stdout: Path, stderr: Path,
              env: dict[str, str] | None = None) -> Launched:
        status = stdout.with_name(stdout.name + ".status")
        request = {"argv": argv, "cwd": str(cwd), "env": {**os.environ, **(env or {})}, "stdout": str(stdout),
                   "stderr": str(stderr), "status": str(status)}
        self._proc.stdin.write(json.dumps(request) + "\n")
        self._proc.stdin.flush()
        answer = self._proc.stdout.readline()
        if not answer:
            raise RuntimeError(f"the launcher server ended (exit {self._proc.wait(30)})")
        return Launched(int(answer), stdout, stderr, status)

    def alive(self) -> bool:
        return self._proc.poll() is None

    def close(self) -> None:
        self._proc.stdin.close()
        self._proc.wait(30)


def _warm_up() -> None:
    from launch.cli import main  # noqa: F401 - the imports are the point
    from launch.local import run_local  # noqa: F401
    from launch.procs import warm_up_for_fork
    from launch.summary import summarise  # noqa: F401

    warm_up_for_fork()


def _run_launcher(request: dict) -> None:
    """In the forked child: become ``python -m launch ARGV`` and never return."""
    code = 1
    try:
        os.chdir(request["cwd"])
        os.environ.clear()  # the test's environment now, as a subprocess would inherit it
        os.environ.update(request["env"])
        for fd, opened in ((0, os.open(os.devnull, os.O_RDONLY)),
                           (1, os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)),
                           (2, os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644))):
            os.dup2(opened, fd)
            os.close(opened)  # (the launcher and its peers inherit only 0, 1 and 2)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a fresh interpreter
        random.seed()  # what a fresh interpreter would draw, not the server's state
        sys.argv = ["launch", *request["argv"]]
        from launch.cli import main

        code = main(request["argv"])
    except SystemExit as exc:  # argparse: a bad flag
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - a bug or a stray KeyboardInterrupt: into stderr, as Python would
        traceback.print_exc()
    finally:
        from gossip.exit import exit_now

        exit_now(code)


def _write_status(path: str, code: int) -> None:
    temporary = f"{path}.partial"
    Path(temporary).write_text(str(code))
    os.replace(temporary, path)  # a reader sees the whole status or none


def serve() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C of pytest is pytest's; the launchers get theirs
    _warm_up()
    print("ready", flush=True)
    statuses: dict[int, str] = {}
    while True:
        readable, _, _ = select.select([sys.stdin], [], [], 0.02)
        while statuses:  # reap every launcher that ended, and say how
            pid, status = os.waitpid(-1, os.WNOHANG)
            if not pid:
                break
            if pid in statuses:
                _write_status(statuses.pop(pid), os.waitstatus_to_exitcode(status))
        if not readable:
            continue
        line = sys.stdin.readline()
        if not line:
            return  # the tests are over; launchers still running are theirs to stop
        request = json.loads(line)
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            _run_launcher(request)
        statuses[pid] = request["status"]
        print(pid, flush=True)


if __name__ == "__main__":
    serve()
