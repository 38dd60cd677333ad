"""Meeting the other peers through a ``torch.distributed.TCPStore``: torchrun's own, or one that rank 0
(or the first peer started by hand) serves. Every peer writes the endpoint it announces and reads all.

Keys, under the plan's namespace:

    world_size     the first writer's; every peer that knows one checks that it agrees
    run            the run-wide flags as JSON; every peer checks that they equal its own
    name           the first writer's run name (the output directory's, unless --out is given); a plain
                   file name or the peers refuse it
    rank/R         claimed with compare_set by the one peer that takes rank R
    next           a counter that gives ranks out to peers that join without one
    claimed        set by the peer serving the store once it holds its rank; a peer that joins without a
                   rank takes one only then, so that it cannot take the first peer's
    nonce/R        --secure only: peer R's fresh random challenge, which every tag for R covers
    tag/R/Q        --secure only: peer R's tag on its endpoint entry for reader Q (written before it)
    endpoint/R     peer R's announced endpoint (with --secure, and the digest of what it agreed on);
                   ``endpoint/server`` the parameter server's
    read, done     the last reader sets ``done``, and the peer serving the store may then close it
    abort          set by a peer that cannot go on (its settings differ, its port is taken, ...): one line
                   naming it and why; every peer still waiting stops with that line at once
    inside         how many peers are joining now (each adds 1 as it starts and takes it back once it joined)
    abort-seen     how many of the others read ``abort``; they and the one that set it stop once every peer
                   inside has (or after 2 s), so that no launcher ends a peer before it read why

Anyone who reaches the store can write to it: a TCPStore has no access control. So:

* the store one of our peers serves listens only where that peer binds (``--bind``, else the address it
  announces), not on every interface as torch's own server socket does;
* every entry is written once, with ``compare_set``: a peer that finds its own ``endpoint/R`` (or
  ``nonce/R``) holding something else stops with one line, and never binds an address it read back for
  itself: it binds what it announced;
* what is read is checked before use: a world size is a number, the run flags are JSON, the run name is a
  plain file name (it names a directory);
* with ``--secure KEYDIR``, peer R writes for every reader Q a tag ``tag/R/Q`` on ``endpoint/R``:
  HMAC-SHA256 keyed by the X25519 secret that only R's and Q's CURVE keys give, over the key, R, Q, Q's
  fresh ``nonce/Q`` and the entry, which holds the endpoint and a digest of the world size, run flags and
  run name R agreed on. A reader refuses an entry whose tag for it is missing or wrong (someone without
  R's secret key wrote it, or replayed an old run's), and one whose writer agreed on other flags. Each
  reader reads only its own tags: the store carries O(N^2) small entries, not N tags in each of N^2
  reads. A joiner without ``--rank`` takes only a rank whose secret key it holds.

What someone who reaches the store can still do is stop the rendezvous (delete or squat keys, flood the
store): the peers then stop with one line rather than train in a swarm they did not mean to join.
Without ``--secure`` they can also change an endpoint between a peer's write and another's read (a
TCPStore has no access control); the peer whose endpoint it is notices if it happens before it reads.

The rendezvous is one sequence of store operations (agree, claim, sign, write once, read, check) whose
order is the protocol; it reads best whole. The store itself (serving or dialling it, its keys, polling
them, torch's errors translated into ours) is ``gossip/rendezvous_keys.py``'s.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import json
import logging
import os
import re
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from gossip.errors import ConfigError, PeerTimeout, PeerUnreachable
from gossip.net.address import is_loopback, split_endpoint
from gossip.net.security import CurveKeys, key_name, load_keys, shared_secret
from gossip.rendezvous import Plan
from gossip.rendezvous_keys import StoreKeys, shown

log = logging.getLogger("gossip.rendezvous_store")
MAX_WORLD_SIZE = 1 << 16
_RUN_NAME = re.compile(r"[A-Za-z0-9._-]{1,100}")


class SwarmFull(ConfigError):
    """Every rank is taken: this peer is not one the swarm waits for."""


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


def check_port(host: str, port: int, who: str) -> None:
    """Fail before announcing a port that another process holds (ZeroMQ binds it moments later): an
    ``endpoint_of`` for ``join`` calls it, so that the others learn of it in the store."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZeroMQ's own listener does
        try:
            probe.bind((host, port))
        except OSError as exc:
            hint = "another process holds it: choose another --base-port" if exc.errno == errno.EADDRINUSE else \
                f"{host} is not an address of this host: check --bind and --announce"
            raise PeerUnreachable(f"{who} cannot listen on tcp://{host}:{port} ({exc.strerror}); {hint}") from exc


def check_run_name(name: str) -> str:
    """``name`` when it is a plain file name (it names the output directory): letters, digits and ``._-``,
    at most 100 characters, not ``.`` or ``..``; empty means none. ConfigError otherwise."""
    if name and (not _RUN_NAME.fullmatch(name) or name in (".", "..")):
        raise ConfigError(f"the run name in the rendezvous store, {shown(name)}, is not a plain file name (letters, "
                          "digits and ._- only, at most 100 characters); someone else wrote it: restart the swarm, "
                          "or give every peer --out DIR")
    return name


def _who(name: str) -> str:
    return "the server" if name == "server" else f"peer {name}"


class Tags:
    """``--secure``: pairwise tags on the entries a peer writes. The tag for reader Q of an entry that R
    writes is HMAC-SHA256, keyed by the X25519 secret of R's and Q's CURVE keys, over the entry's key, R, Q,
    Q's nonce and the entry's text: only R (or Q itself) can make it, and only for this rendezvous."""

    def __init__(self, keys: CurveKeys, me: str, world_size: int) -> None:
        self.keys, self.me, self.world_size = keys, me, world_size
        self._secrets: dict[str, bytes] = {}

    def _secret(self, name: str) -> bytes:
        if name not in self._secrets:
            rank = self.world_size if name == "server" else int(name)
            public = self.keys.peers.get(rank)
            if public is None:
                raise ConfigError(f"no public key {key_name(rank, self.world_size)}.key in {self.keys.public_dir}; "
                                  "every peer needs everyone's")
            secret = shared_secret(self.keys.secret, public)
            self._secrets[name] = hashlib.sha256(b"gossip-train rendezvous tag\0" + secret).digest()
        return self._secrets[name]

    def tag(self, key: str, writer: str, reader: str, nonce: str, text: str) -> str:
        """The tag for ``reader`` on ``writer``'s entry; either of the two computes the same one."""
        other = reader if writer == self.me else writer
        message = "\0".join((key, writer, reader, nonce, text)).encode()
        return hmac.new(self._secret(other), message, hashlib.sha256).hexdigest()

    def seal(self, key: str, text: str, nonces: dict[str, str]) -> dict[str, str]:
        """This peer's tags on its entry ``key`` holding ``text``: one for every other reader."""
        return {reader: self.tag(key, self.me, reader, nonce, text) for reader, nonce in nonces.items()
                if reader != self.me}

    def check(self, key: str, writer: str, text: str, tag: str | None, nonce: str) -> None:
        """ConfigError unless ``tag`` is ``writer``'s tag for this peer on ``key`` holding ``text``."""
        if tag is None or not hmac.compare_digest(tag.encode(), self.tag(key, writer, self.me, nonce, text).encode()):
            raise ConfigError(f"{key} in the rendezvous store is not signed by {_who(writer)}'s key; someone else "
                              "wrote it (the run stops: restart it, and keep the store's port off untrusted networks)")


class StoreRendezvous:
    """One peer's side of the exchange described in the module docstring, over ``StoreKeys``."""

    def __init__(self, plan: Plan, timeout: float, bind: str = "", keydir: str = "") -> None:
        """``bind``: where the store this peer serves (``plan.host_store``) listens, which is where the peer
        binds; empty or 0.0.0.0: every interface. ``keydir``: ``--secure``'s, to sign and check entries."""
        self.plan = plan
        self.keydir = keydir
        self.keys = StoreKeys(plan, timeout, bind or "0.0.0.0")
        self.where = self.keys.where  # how this peer reaches the store, for error lines
        self.joined = False

    def open(self) -> None:
        self.keys.open()

    def join(self, endpoint_of: Callable[[int], str], run: dict[str, Any], world_size: int | None,
             rank: int | None, server: bool, parameter_server: bool, run_name: str = "") -> Assignment:
        """Agree on the world size, run flags and run name, take a rank, publish ``endpoint_of(rank)`` (the
        server's rank: the world size, known only now to a server that joins without one), and read
        everyone's endpoint. This peer's own endpoint in the result is the one it announced. A peer that
        cannot join says why in the store (``abort``), and the others stop with its reason."""
        self.keys.add("inside", 1)
        try:
            assignment = self._join(endpoint_of, run, world_size, rank, server, parameter_server, run_name)
        except (ConfigError, PeerTimeout, PeerUnreachable) as exc:
            if isinstance(exc, SwarmFull):  # a peer the swarm never counted on: the others go on without it
                self._leave()
                raise
            who = "the server" if server else f"peer {rank}" if rank is not None else "a peer without a rank"
            self.abort(f"{who} could not join: {exc}")
            raise
        self._leave()
        return assignment

    def _leave(self) -> None:
        """No longer joining: an abort from now on need not wait for us to read it (best effort)."""
        try:
            self.keys.add("inside", -1)
        except PeerUnreachable:
            pass

    def _join(self, endpoint_of: Callable[[int], str], run: dict[str, Any], world_size: int | None,
              rank: int | None, server: bool, parameter_server: bool, run_name: str) -> Assignment:
        if world_size is None:  # a joiner: the world size comes from a peer that published its flags first
            world_size = self._agree_world_size(world_size)
            held_run = self._agree_run(run)
            run_name = check_run_name(self.keys.compare_set("name", run_name))
        else:  # flags and name before the world size, so a joiner waiting for the latter finds ours
            held_run = self._agree_run(run)
            run_name = check_run_name(self.keys.compare_set("name", run_name))
            world_size = self._agree_world_size(world_size)
        tags = None
        if not server:
            if rank is None and self.plan.source == "join":  # after the first peer took the rank it wants
                self.keys.wait(["claimed"], "the first peer did not take its rank")
            if rank is not None and rank >= world_size:
                raise ConfigError(f"rank {rank} is outside 0..{world_size - 1}: the swarm has {world_size} peers")
            if self.keydir and rank is not None:  # no key for the rank: fail before claiming it
                tags = Tags(load_keys(self.keydir, rank, world_size, parameter_server), str(rank), world_size)
            rank = self._claim(rank, world_size)
        if self.plan.host_store:
            self.keys.set("claimed", "1")
        me = "server" if server else str(rank)
        if self.keydir and tags is None:
            tags = Tags(load_keys(self.keydir, world_size if server else rank, world_size, parameter_server), me,
                        world_size)
        names = [str(r) for r in range(world_size)] + (["server"] if parameter_server else [])
        announced = endpoint_of(world_size if server else rank)
        if tags is None:
            entry = self._write_once(f"endpoint/{me}", announced)
        else:
            nonces = self._nonces(me, names)
            agreed = hashlib.sha256(json.dumps([world_size, held_run, run_name]).encode()).hexdigest()
            text = json.dumps({"endpoint": announced, "agreed": agreed}, sort_keys=True)
            for reader, tag in tags.seal(f"endpoint/{me}", text, nonces).items():  # before the entry they sign
                self._write_once(f"tag/{me}/{reader}", tag)
            entry = self._write_once(f"endpoint/{me}", text)
        self.keys.wait([f"endpoint/{n}" for n in names], "peer(s) {missing} did not check in")
        values = {n: self.keys.get(f"endpoint/{n}") for n in names}
        if values[me] != entry:
            raise ConfigError(f"endpoint/{me} in the store at {self.where} was overwritten by someone else (it now "
                              f"holds {shown(values[me])}; this peer announced {announced})")
        if tags is not None:
            values = {n: self._read_signed(tags, n, values[n], nonces[me], agreed) for n in names if n != me}
        for n, endpoint in values.items():  # an endpoint is dialled: tcp://HOST:PORT and nothing else
            try:
                split_endpoint(endpoint if isinstance(endpoint, str) else "")
            except ConfigError:
                raise ConfigError(f"endpoint/{n} in the store at {self.where} holds {shown(str(endpoint))}, not "
                                  "tcp://HOST:PORT; someone else wrote it") from None
        values[me] = announced
        if self.keys.add("read", 1) == len(names):
            self.keys.set("done", "1")
        self.joined = True
        return Assignment(rank, world_size, tuple(values[str(r)] for r in range(world_size)), values.get("server", ""),
                          run_name)

    def abort(self, reason: str) -> None:
        """This peer cannot go on: tell every peer still waiting here why (the first reason stays). Best
        effort: a store that is gone already has nobody waiting on it."""
        if self.keys.store is None:
            return
        line = " ".join(reason.split())[:400]
        try:
            held = self.keys.compare_set("abort", line)
        except (PeerUnreachable, dist.DistError):
            return
        self.keys.settle_abort(seen=held != line)  # (another peer's line came first: we read it, as the rest)

    def close(self) -> None:
        """Drop the store; the peer serving it first waits (briefly) until every peer has read."""
        if self.keys.store is not None and self.plan.host_store and self.joined:
            try:
                self.keys.wait(["done"], "not every peer read the endpoints", limit=10.0)
            except PeerTimeout as exc:
                log.warning("%s; closing the rendezvous store anyway", exc)
        self.keys.close()

    # -- the steps -------------------------------------------------------------------------------------
    def _agree_world_size(self, world_size: int | None) -> int:
        if world_size is None:
            self.keys.wait(["world_size"], "no peer said how many peers the swarm has (start the first one with "
                           "--world-size N)")
            return self._world_size(self.keys.get("world_size"))
        held = self._world_size(self.keys.compare_set("world_size", str(world_size)))
        if held != world_size:
            raise ConfigError(f"this peer was started for a world of {world_size}, the swarm has {held}; "
                              "give every peer the same --world-size")
        return world_size

    def _world_size(self, text: str) -> int:
        if not (text.isascii() and text.isdigit() and 0 < int(text) <= MAX_WORLD_SIZE):
            raise ConfigError(f"world_size in the store at {self.where} holds {shown(text)}, not a world size; "
                              "someone else wrote it")
        return int(text)

    def _agree_run(self, run: dict[str, Any]) -> str:
        """Check our run flags against the swarm's; returns the swarm's as the store holds them."""
        mine = json.dumps(run, sort_keys=True)
        run = json.loads(mine)  # compared as JSON holds them: tuples come back as lists
        text = self.keys.compare_set("run", mine)
        try:
            held = json.loads(text)
        except ValueError:
            held = None
        if not isinstance(held, dict):
            raise ConfigError(f"run in the store at {self.where} holds {shown(text)}, not run flags; someone else "
                              "wrote it")
        differences = [f"{name} {run.get(name)!r} here, {held.get(name)!r} there"
                       for name in sorted(set(run) | set(held)) if run.get(name) != held.get(name)]
        if differences:
            raise ConfigError(f"this peer's run flags differ from the swarm's ({shown('; '.join(differences))}); "
                              "start every peer with the same run flags")
        return text

    def _claim(self, rank: int | None, world_size: int) -> int:
        token = f"{socket.gethostname()} pid {os.getpid()} ({os.urandom(4).hex()})"  # unique even per thread
        if rank is not None:
            holder = self.keys.compare_set(f"rank/{rank}", token)
            if holder != token:
                raise ConfigError(f"rank {rank} is already taken by {shown(holder)}; give every peer its own --rank")
            return rank
        if self.keydir:  # only a rank whose secret key this host holds; the counter would skip others' ranks
            private = os.path.join(self.keydir, "private")
            mine = [r for r in range(world_size)
                    if os.path.isfile(os.path.join(private, f"{key_name(r, world_size)}.key_secret"))]
            for candidate in mine:
                if self.keys.compare_set(f"rank/{candidate}", token) == token:
                    return candidate
            raise ConfigError(f"no free rank whose secret key is in {private} (this host holds the keys of "
                              f"rank(s) {', '.join(map(str, mine)) or 'none'}, and those are taken); with --secure "
                              "a peer takes a rank whose key it has")
        while (candidate := self.keys.add("next", 1) - 1) < world_size:
            if self.keys.compare_set(f"rank/{candidate}", token) == token:
                return candidate
        raise SwarmFull(f"the swarm already has its {world_size} peers; this one is one too many (a swarm "
                          "takes peers only while it forms)")

    def _nonces(self, me: str, names: list[str]) -> dict[str, str]:
        """--secure: publish our fresh challenge and read everyone's."""
        self._write_once(f"nonce/{me}", os.urandom(16).hex())
        self.keys.wait([f"nonce/{n}" for n in names], "peer(s) {missing} did not check in")
        return {n: self.keys.get(f"nonce/{n}") for n in names}

    def _read_signed(self, tags: Tags, writer: str, entry: str, nonce: str, agreed: str) -> str:
        """The endpoint in ``writer``'s signed entry, once its tag for us and its agreement are checked."""
        tag_key = f"tag/{writer}/{tags.me}"
        tag = self.keys.get(tag_key) if self.keys.has(tag_key) else None
        tags.check(f"endpoint/{writer}", writer, entry, tag, nonce)
        try:
            held = json.loads(entry)
            endpoint, theirs = held["endpoint"], held["agreed"]
        except (ValueError, TypeError, KeyError):
            endpoint, theirs = entry, None
        if theirs != agreed:
            raise ConfigError(f"{_who(writer)} agreed on another world size, run flags or run name than this peer: "
                              "someone changed them in the rendezvous store while the swarm formed")
        return endpoint

    def _write_once(self, name: str, value: str) -> str:
        """Write ``name`` unless it is written; ConfigError when someone else's value is there."""
        held = self.keys.compare_set(name, value)
        if held != value:
            raise ConfigError(f"{name} in the store at {self.where} was already written by someone else (it holds "
                              f"{shown(held)}): another peer took the same rank, or someone squats it")
        return value
