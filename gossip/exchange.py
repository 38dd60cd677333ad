"""Meeting the other peers through a ``torch.distributed.TCPStore``: torchrun's own, or one that rank 0
(or the first peer started by hand) serves. Every peer writes the endpoint it announces and reads all.

Keys, under the plan's namespace:

    world_size     the first writer's; every peer that knows one checks that it agrees
    run            the run-wide flags as JSON; every peer checks that they equal its own
    name           the first writer's run name (the output directory's, unless --out is given)
    rank/R         claimed with compare_set by the one peer that takes rank R
    next           a counter that gives ranks out to peers that join without one
    claimed        set by the peer serving the store once it holds its rank; a peer that joins without a
                   rank takes one only then, so that it cannot take the first peer's
    endpoint/R     peer R's announced endpoint; ``endpoint/server`` the parameter server's
    read, done     the last reader sets ``done``, and the peer serving the store may then close it

torch logs every failed connection attempt and every timed-out ``wait`` with a C++ stack trace, so the
port is probed before connecting and keys are polled with ``check``: a rendezvous that goes well prints
nothing, and one that fails ends in one line of ours.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from gossip.address import is_loopback
from gossip.errors import ConfigError, PeerTimeout, PeerUnreachable
from gossip.rendezvous import Plan

log = logging.getLogger("gossip.exchange")
POLL_SECONDS = 0.05


@dataclass(frozen=True)
class Assignment:
    rank: int | None  # None for the parameter server
    world_size: int
    endpoints: tuple[str, ...]
    server_endpoint: str = ""
    run_name: str = ""  # the first peer's proposal, so that every host names its output directory alike


def route_address(toward: str) -> str:
    """The local address that packets to ``toward`` leave from (a UDP connect sends nothing)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((toward, 9))
            return probe.getsockname()[0]
    except OSError as exc:
        raise ConfigError(f"cannot find a route to {toward} ({exc}); pass --announce ADDRESS") from exc


def announce_address(announce: str, bind: str, toward: str | None) -> str:
    """Where other peers reach this one: ``--announce``; else a specific ``--bind`` address; else the
    address that routes to the store's host ``toward`` (or that host's own name, when it names this very
    machine: others reach us by it); else, for the first peer, this host's name as it resolves."""
    if announce:
        return announce
    if bind and bind != "0.0.0.0":
        return bind
    if toward:
        address = route_address(toward)
        return toward if is_loopback(address) and not is_loopback(toward) else address
    try:
        address = socket.gethostbyname(socket.getfqdn())
    except OSError:
        address = "127.0.0.1"
    if is_loopback(address):
        raise ConfigError(f"this host's name resolves to {address}, which other machines cannot reach; pass "
                          "--announce ADDRESS (the address they reach this one at)")
    return address


class StoreRendezvous:
    """One peer's side of the exchange described in the module docstring."""

    def __init__(self, plan: Plan, timeout: float) -> None:
        self.plan = plan
        self.deadline = time.monotonic() + timeout
        self.timeout = timeout
        self.store: dist.TCPStore | None = None
        self.joined = False

    def open(self) -> None:
        host, port = self.plan.store
        try:
            if self.plan.host_store:
                self.store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                                           timeout=timedelta(seconds=self.timeout))
            else:
                self._wait_for_port(host, port)
                self.store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=self._left()))
        except dist.DistError as exc:
            first = str(exc).splitlines()[0]
            if self.plan.host_store:
                raise PeerUnreachable(f"cannot serve the rendezvous store on port {port} ({first}); choose another "
                                      "--rendezvous-port") from exc
            raise PeerUnreachable(f"cannot join the rendezvous store at {host}:{port} ({first})") from exc

    def _wait_for_port(self, host: str, port: int) -> None:
        while True:
            try:
                socket.create_connection((host, port), timeout=min(2.0, max(0.1, self._left()))).close()
                return
            except socket.gaierror as exc:
                raise ConfigError(f"cannot resolve the rendezvous host {host!r}: {exc.strerror}") from exc
            except OSError:
                if self._left() <= 0:
                    raise PeerTimeout(f"nothing answered at {host}:{port} within {self.timeout:g} s "
                                      "(--rendezvous-timeout); is the first peer (or rank 0) running there?") from None
                time.sleep(0.2)

    def join(self, endpoint_of: Callable[[int | None], str], run: dict[str, Any], world_size: int | None,
             rank: int | None, server: bool, parameter_server: bool, run_name: str = "") -> Assignment:
        """Agree on the world size, run flags and run name, take a rank, publish ``endpoint_of(rank)``, and
        read everyone's endpoint."""
        if world_size is None:  # a joiner: the world size comes from a peer that published its flags first
            world_size = self._agree_world_size(world_size)
            self._agree_run(run)
            run_name = self._compare_set("name", run_name)
        else:  # flags and name before the world size, so a joiner waiting for the latter finds ours
            self._agree_run(run)
            run_name = self._compare_set("name", run_name)
            world_size = self._agree_world_size(world_size)
        if not server:
            if rank is None and self.plan.source == "join":  # after the first peer took the rank it wants
                self._wait_keys(["claimed"], "the first peer did not take its rank")
            rank = self._claim(rank, world_size)
        if self.plan.host_store:
            self._set("claimed", "1")
        me = "server" if server else str(rank)
        self._set(f"endpoint/{me}", endpoint_of(rank))
        names = [str(r) for r in range(world_size)] + (["server"] if parameter_server else [])
        self._wait_keys([f"endpoint/{n}" for n in names], "peer(s) {missing} did not check in")
        values = {n: self._get(f"endpoint/{n}") for n in names}
        if self._add("read", 1) == len(names):
            self._set("done", "1")
        self.joined = True
        return Assignment(rank, world_size, tuple(values[str(r)] for r in range(world_size)), values.get("server", ""),
                          run_name)

    def close(self) -> None:
        """Drop the store; the peer serving it first waits (briefly) until every peer has read."""
        if self.store is not None and self.plan.host_store and self.joined:
            try:
                self._wait_keys(["done"], "not every peer read the endpoints", limit=10.0)
            except PeerTimeout as exc:
                log.warning("%s; closing the rendezvous store anyway", exc)
        self.store = None

    # -- the steps -------------------------------------------------------------------------------------
    def _agree_world_size(self, world_size: int | None) -> int:
        if world_size is None:
            self._wait_keys(["world_size"], "no peer said how many peers the swarm has (start the first one with "
                            "--world-size N)")
            return int(self._get("world_size"))
        held = int(self._compare_set("world_size", str(world_size)))
        if held != world_size:
            raise ConfigError(f"this peer was started for a world of {world_size}, the swarm has {held}; "
                              "give every peer the same --world-size")
        return world_size

    def _agree_run(self, run: dict[str, Any]) -> None:
        mine = json.dumps(run, sort_keys=True)
        run = json.loads(mine)  # compared as JSON holds them: tuples come back as lists
        held = json.loads(self._compare_set("run", mine))
        differences = [f"{name} {run.get(name)!r} here, {held.get(name)!r} there"
                       for name in sorted(set(run) | set(held)) if run.get(name) != held.get(name)]
        if differences:
            raise ConfigError(f"this peer's run flags differ from the swarm's ({'; '.join(differences)}); start "
                              "every peer with the same run flags")

    def _claim(self, rank: int | None, world_size: int) -> int:
        token = f"{socket.gethostname()} pid {os.getpid()} ({os.urandom(4).hex()})"  # unique even per thread
        if rank is not None:
            if rank >= world_size:
                raise ConfigError(f"rank {rank} is outside 0..{world_size - 1}: the swarm has {world_size} peers")
            holder = self._compare_set(f"rank/{rank}", token)
            if holder != token:
                raise ConfigError(f"rank {rank} is already taken by {holder}; give every peer its own --rank")
            return rank
        while (candidate := self._add("next", 1) - 1) < world_size:
            if self._compare_set(f"rank/{candidate}", token) == token:
                return candidate
        raise ConfigError(f"the swarm already has its {world_size} peers; this one is one too many (a swarm "
                          "takes peers only while it forms)")

    # -- store access, errors translated ---------------------------------------------------------------
    def _key(self, name: str) -> str:
        return f"{self.plan.namespace}/{name}"

    def _left(self) -> float:
        return self.deadline - time.monotonic()

    def _wait_keys(self, names: list[str], problem: str, limit: float | None = None) -> None:
        """Poll until every key exists; PeerTimeout with ``problem`` ({missing}: the names still absent)."""
        deadline = self.deadline if limit is None else time.monotonic() + limit
        keys = [self._key(n) for n in names]
        while not self._call(self.store.check, keys):
            if time.monotonic() > deadline:
                missing = [n.split("/")[-1] for n, k in zip(names, keys) if not self._call(self.store.check, [k])]
                raise PeerTimeout(problem.format(missing=", ".join(missing)) +
                                  (f" within {limit:g} s" if limit else f" within {self.timeout:g} s (--rendezvous-timeout)"))
            time.sleep(POLL_SECONDS)

    def _set(self, name: str, value: str) -> None:
        self._call(self.store.set, self._key(name), value)

    def _get(self, name: str) -> str:
        return self._call(self.store.get, self._key(name)).decode()

    def _add(self, name: str, amount: int) -> int:
        return self._call(self.store.add, self._key(name), amount)

    def _compare_set(self, name: str, value: str) -> str:
        """Set ``name`` unless it is set; returns what it holds now."""
        return self._call(self.store.compare_set, self._key(name), "", value).decode()

    def _call(self, operation: Callable[..., Any], *args: Any) -> Any:
        try:
            return operation(*args)
        except dist.DistError as exc:
            raise PeerUnreachable(f"the rendezvous store went away: {str(exc).splitlines()[0]}") from exc
