"""Shared fixtures and helpers: free loopback ports, the launcher's command line and running it as users
do, bounded in time; polling for a condition (``wait_until``); and in-process peers on loopback
(``endpoints``, ``vector_model``, ``run_peers``, one thread per peer).

Every multi-process test goes through ``launch_run`` or ``start_launcher``: the launcher runs as a
process of its own, under a timeout; its peers receive SIGTERM if it dies (PR_SET_PDEATHSIG), and
afterwards any peer PID listed in peers.json that is still alive is killed, so a hang fails the test
instead of freezing CI. The launchers are forked from one warmed process (``tests/launcher.py`` says why
and what that leaves out); a few tests run ``python -m launch`` itself.

Tests that start processes are marked ``slow`` by the hook below, which reads their code (and that of the
helpers and fixtures of tests/ they use) for the names that start one; tests that wait on real sockets for
seconds carry the mark by hand. ``python -m pytest -m "not slow"`` is the quick subset (pure tests and
in-process sockets), and an autouse fixture makes any process a quick test starts fail it.
"""

from __future__ import annotations

import inspect
import json
import os
import random
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from gossip.net.sendbuffer import SEND_BUFFER_BYTES
from tests.launcher import Launched, LauncherServer

ROOT = Path(__file__).resolve().parent.parent


def ports_free(base: int, count: int) -> bool:
    for port in range(base, base + count):
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                return False
    return True


def free_base_port(count: int) -> int:
    """A base port with ``count`` consecutive free ports, outside the kernel's ephemeral range."""
    for _ in range(200):
        base = random.randrange(20000, 32000 - count)
        if ports_free(base, count):
            return base
    raise RuntimeError("no free port range found")


def granted_send_buffer() -> int:
    """The send buffer Linux grants a Unix connection for our request: capped at net.core.wmem_max, doubled."""
    return 2 * min(SEND_BUFFER_BYTES, int(Path("/proc/sys/net/core/wmem_max").read_text()))


def endpoints(count: int) -> list[str]:
    base = free_base_port(count)
    return [f"tcp://127.0.0.1:{base + r}" for r in range(count)]


def vector_model(values: torch.Tensor) -> torch.nn.Module:
    model = torch.nn.Module()
    model.value = torch.nn.Parameter(values.clone(), requires_grad=False)
    return model


def run_peers(count: int, target) -> list:
    """Run ``target(rank)`` in one thread per peer; returns the results, re-raising the first error."""
    results: list = [None] * count
    errors: list = []

    def body(rank: int) -> None:
        try:
            results[rank] = target(rank)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(45)
    assert not any(t.is_alive() for t in threads), "a peer thread hung"
    if errors:
        raise errors[0]
    return results


def wait_until(condition: Callable[[], object], timeout: float, what: str | Callable[[], str]) -> None:
    """Poll ``condition()`` (every 10 ms at first, backing off to 50 ms) until it is true; fail the test
    naming ``what`` (a string, or a function that describes the state at that moment) once ``timeout``
    seconds have passed. An exception from ``condition`` propagates: a condition may assert that what it
    waits for can still happen (a process it waits on is alive) to fail at once instead of at the timeout."""
    deadline = time.monotonic() + timeout
    pause = 0.01
    while not condition():
        if time.monotonic() >= deadline:
            pytest.fail(f"timed out after {timeout:g} s waiting for {what() if callable(what) else what}")
        time.sleep(pause)
        pause = min(2 * pause, 0.05)


def launcher_command(out: Path, nodes: int, *args: str, base_port: int | None = None, progress: str = "off",
                     plot: bool | None = False) -> list[str]:
    """``python -m launch --nodes NODES --out OUT --base-port ... --progress PROGRESS --no-plot ARGS``: the
    launcher's command line for a run of ``nodes`` local peers (``launch_run`` and the tests that start it
    themselves). ``base_port`` defaults to a free range for the
    peers and a server; ``plot`` None passes neither --plot nor --no-plot (the launcher's default)."""
    base = free_base_port(nodes + 1) if base_port is None else base_port
    plotting = [] if plot is None else ["--plot" if plot else "--no-plot"]
    return [sys.executable, "-m", "launch", "--nodes", str(nodes), "--out", str(out), "--base-port", str(base),
            "--progress", progress, *plotting, *args]


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    out: Path

    @property
    def summary(self) -> dict:
        return json.loads((self.out / "summary.json").read_text())

    def events(self, rank: int) -> list[dict]:
        lines = (self.out / f"peer-{rank}.jsonl").read_text().splitlines()
        return [json.loads(line) for line in lines if line.strip()]


def peer_pids(out: Path) -> list[int]:
    try:
        return [peer["pid"] for peer in json.loads((out / "peers.json").read_text())]
    except (OSError, ValueError):
        return []


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie child of a dead launcher is gone for our purposes
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def reap_peers(out: Path, grace: float) -> list[int]:
    """Wait up to ``grace`` s for the run's peers (PIDs from peers.json) to exit, SIGKILL the rest."""
    deadline = time.monotonic() + grace
    while (left := [pid for pid in peer_pids(out) if alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return left


def load_traces(out: Path, nodes: int) -> tuple[np.ndarray, np.ndarray]:
    """(rounds, values[round, peer, coordinate]) from every peer's consensus trace (``trace-<rank>.npz``)."""
    traces = [np.load(out / f"trace-{rank}.npz") for rank in range(nodes)]
    rounds = traces[0]["rounds"]
    for trace in traces:
        np.testing.assert_array_equal(trace["rounds"], rounds)
    return rounds, np.stack([t["values"] for t in traces], axis=1)


def consensus_distance(x: np.ndarray) -> float:
    """Root mean square distance of the peers' vectors ``x[peer]`` from their mean."""
    return float(np.sqrt(((x - x.mean(0)) ** 2).sum(1).mean()))


_server: list[LauncherServer] = []  # started by the first launcher a session needs


def start_launcher(out: Path, nodes: int, *args: str, base_port: int | None = None, progress: str = "off",
                   plot: bool | None = False, env: dict[str, str] | None = None) -> Launched:
    """Start the launcher of ``launcher_command(out, nodes, *args, ...)``, forked from the session's warmed
    process, with ``env`` added to its environment; stdout and stderr go to files beside ``out``."""
    if _server and not _server[0].alive():  # (a server that died fails the test that saw it, not the rest)
        _server.pop()
    if not _server:
        _server.append(LauncherServer(ROOT))
    argv = launcher_command(out, nodes, *args, base_port=base_port, progress=progress, plot=plot)[3:]
    return _server[0].start(argv, ROOT, out.with_name(out.name + ".stdout"), out.with_name(out.name + ".stderr"),
                            env)


def pytest_sessionfinish(session: pytest.Session) -> None:
    while _server:
        _server.pop().close()


@pytest.fixture
def launch_run(tmp_path):
    """Run the launcher (``start_launcher``) with free ports and a fresh --out; returns a ``Run``."""
    outs: list[tuple[Path, bool]] = []

    def run(*args: str, nodes: int = 4, timeout: float = 150, expect_ok: bool = True, name: str = "run",
            plot: bool = False) -> Run:
        out = tmp_path / name
        launcher = start_launcher(out, nodes, *args, progress="plain", plot=plot)
        outs.append((out, False))
        try:
            stdout, stderr = launcher.communicate(timeout=timeout)
        finally:
            if launcher.poll() is None:
                launcher.kill()
        outs[-1] = (out, True)
        result = Run(launcher.returncode, stdout, stderr, out)
        if expect_ok and result.returncode != 0:
            pytest.fail(f"launcher exited {result.returncode}\nstdout:\n{stdout[-3000:]}\nstderr:\n{stderr[-3000:]}")
        if expect_ok:  # what our own peers and server write reads back whole
            assert not result.summary.get("problems"), result.summary["problems"]
        return result

    yield run
    for out, finished in outs:
        leftovers = reap_peers(out, grace=5.0)
        assert not (finished and leftovers), f"peers {leftovers} outlived the launcher"


# A name a test's code (or a helper or fixture of tests/ it uses) refers to that starts a process.
STARTS_A_PROCESS = {"subprocess", "Popen", "multiprocessing", "Process", "fork", "forkpty", "posix_spawn",
                    "posix_spawnp", "start_launcher", "launch_run"}


def _code_of(obj: object) -> list:
    """The code objects of a function, or of every function in a class's body, nested ones included."""
    obj = getattr(obj, "__func__", obj)
    funcs = [obj] if inspect.isfunction(obj) else \
        [getattr(v, "__func__", getattr(v, "fget", v)) for v in vars(obj).values()] if inspect.isclass(obj) else []
    todo = [f.__code__ for f in funcs if inspect.isfunction(f)]
    found = []
    while todo:
        code = todo.pop()
        found.append(code)
        todo += [c for c in code.co_consts if inspect.iscode(c)]
    return found


def _ours(obj: object) -> bool:
    try:
        return Path(inspect.getsourcefile(getattr(obj, "__func__", obj)) or "").is_relative_to(ROOT / "tests")
    except TypeError:
        return False


def starts_processes(item: pytest.Item) -> str | None:
    """The name by which ``item`` starts a process, or None: read from the code of the test, of its fixtures
    and of every function and class of tests/ they use, followed by name."""
    fixtures = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
    if "launch_run" in getattr(item, "fixturenames", ()):
        return "launch_run"
    todo = [getattr(item, "obj", None)] + [defs[-1].func for name, defs in fixtures.items() if name != GUARD]
    seen: set[int] = set()
    while todo:
        obj = todo.pop()
        if obj is None or id(obj) in seen or not _ours(obj):
            continue
        seen.add(id(obj))
        namespace = getattr(getattr(obj, "__func__", obj), "__globals__", None) or \
            vars(sys.modules.get(getattr(obj, "__module__", ""), object))
        for code in _code_of(obj):
            if hit := STARTS_A_PROCESS & set(code.co_names):
                return min(hit)
            todo += [namespace[name] for name in code.co_names if name in namespace]
    return None


GUARD = "_quick_tests_start_no_process"  # (the guard below names what it refuses)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark ``slow`` every test that starts a process (``starts_processes``); a test that only waits on
    sockets for seconds carries the mark by hand."""
    for item in items:
        if item.get_closest_marker("slow") is None and starts_processes(item):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def _quick_tests_start_no_process(request, monkeypatch):
    """A test without the slow marker may not start a process (the quick subset, ``-m "not slow"``, runs
    none): every way this interpreter starts one raises, naming the marker to add."""
    if request.node.get_closest_marker("slow") is not None:
        return

    def refuse(*args, **kwargs):
        raise AssertionError(f"{request.node.nodeid} starts a process, which the quick subset must not: add what "
                             "starts it to STARTS_A_PROCESS, or mark the test @pytest.mark.slow")

    import multiprocessing.process
    import subprocess

    monkeypatch.setattr(subprocess.Popen, "_execute_child", refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)  # (spawn does not go through fork)
    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "execv", "execve"):
        if hasattr(os, name):
            monkeypatch.setattr(os, name, refuse)
