"""The rendezvous store as ``StoreRendezvous`` (``gossip/rendezvous_store.py``) uses it: a
``torch.distributed.TCPStore`` that this peer serves or dials, and its keys under the plan's namespace, with
torch's errors translated into ours.

The store one of our peers serves listens only where that peer binds (``--bind``, else the address it
announces), not on every interface as torch's own server socket does.

torch logs every failed connection attempt and every timed-out ``wait`` with a C++ stack trace, so the
port is probed before connecting and keys are polled with ``check``: a rendezvous that goes well prints
nothing, and one that fails ends in one line of ours. While it waits for keys, a peer stops at once with
the line another peer left under ``abort``. Before it stops, each peer that saw the line counts itself under
``abort-seen`` and waits (at most ``ABORT_GRACE_SECONDS``) until every other peer still joining (``inside``)
has too, as the peer that left it does: a launcher that ends the other processes once one exits (torchrun
does within 0.1 s) would otherwise end a peer that had not yet read why, and it would stop without a word.
"""

from __future__ import annotations

import errno
import os
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from gossip.errors import ConfigError, PeerFailed, PeerTimeout, PeerUnreachable
from gossip.rendezvous import Plan

POLL_SECONDS = 0.05
ABORT_GRACE_SECONDS = 2.0  # how long the peers that stop on an abort wait for each other to have read it


def shown(value: str) -> str:
    """A value read from the store, fit for one line of ours: as it is when short and printable, else
    quoted and cut (someone else may have written it: none of their newlines or terminal escapes)."""
    if len(value) <= 80 and value.isascii() and value.isprintable():
        return value
    return repr(value[:80]) + ("..." if len(value) > 80 else "")


class StoreKeys:
    """One peer's connection to the rendezvous store and its operations on the plan's keys."""

    def __init__(self, plan: Plan, timeout: float, bind: str) -> None:
        """``bind``: where the store this peer serves (``plan.host_store``) listens; 0.0.0.0: every interface."""
        self.plan = plan
        self.deadline = time.monotonic() + timeout
        self.timeout = timeout
        self.bind = bind
        self.store: dist.TCPStore | None = None
        host, port = plan.store or ("", 0)
        if plan.host_store:
            host = "127.0.0.1" if self.bind == "0.0.0.0" else self.bind
        self.where = f"{host}:{port}"  # how this peer reaches the store, for error lines

    def open(self) -> None:
        host, port = self.plan.store
        try:
            if self.plan.host_store:
                self.store = self._serve(port)
            else:
                self._wait_for_port(host, port)
                self.store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=self._left()))
        except dist.DistError as exc:
            first = str(exc).splitlines()[0]
            if self.plan.host_store:
                raise PeerUnreachable(f"cannot serve the rendezvous store on port {port} ({first}); choose another "
                                      "--rendezvous-port") from exc
            raise PeerUnreachable(f"cannot join the rendezvous store at {host}:{port} ({first})") from exc

    def close(self) -> None:
        """Let go of the store."""
        self.store = None

    def _serve(self, port: int) -> dist.TCPStore:
        """The store's server on a socket of ours, bound to ``self.bind``: torch's own binds every interface
        whatever host it is given (its ``master_listen_fd`` takes a socket bound elsewhere)."""
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((self.bind, port))
            listener.listen(socket.SOMAXCONN)
        except OSError as exc:
            listener.close()
            hint = ("choose another --rendezvous-port" if exc.errno == errno.EADDRINUSE else
                    f"{self.bind} is not an address of this host: check --bind and --announce")
            raise PeerUnreachable(f"cannot serve the rendezvous store on {self.bind}:{port} ({exc.strerror}); "
                                  f"{hint}") from exc
        with listener:  # torch owns the duplicate and closes it with the store; ours closes here
            return dist.TCPStore(self.where.rsplit(":", 1)[0], port, is_master=True, wait_for_workers=False,
                                 timeout=timedelta(seconds=self.timeout), master_listen_fd=os.dup(listener.fileno()))

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

    def _left(self) -> float:
        return self.deadline - time.monotonic()

    def wait(self, names: list[str], problem: str, limit: float | None = None) -> None:
        """Poll until every key exists; PeerTimeout with ``problem`` ({missing}: the names still absent)."""
        deadline = self.deadline if limit is None else time.monotonic() + limit
        keys = [self._key(n) for n in names]
        while not self._call(self.store.check, keys):
            if self.has("abort"):
                reason = self.get("abort")  # (someone else may have written it: shown whole only if plain)
                self.settle_abort(seen=True)
                raise PeerFailed(reason if reason.isascii() and reason.isprintable() and len(reason) <= 400
                                 else shown(reason))
            if time.monotonic() > deadline:
                missing = [n.split("/")[-1] for n, k in zip(names, keys) if not self._call(self.store.check, [k])]
                raise PeerTimeout(problem.format(missing=", ".join(missing)) +
                                  (f" within {limit:g} s" if limit else f" within {self.timeout:g} s (--rendezvous-timeout)"))
            time.sleep(POLL_SECONDS)

    def settle_abort(self, seen: bool) -> None:
        """Wait until every peer joining but the one that left the abort has read it (``seen``: count us among
        them), at most ``ABORT_GRACE_SECONDS``; a store already gone ends the wait (its peer read it)."""
        deadline = time.monotonic() + ABORT_GRACE_SECONDS
        try:
            count = self.add("abort-seen", 1 if seen else 0)
            while count < self.add("inside", 0) - 1 and time.monotonic() < deadline:
                time.sleep(POLL_SECONDS)
                count = self.add("abort-seen", 0)
        except PeerUnreachable:
            pass

    def has(self, name: str) -> bool:
        return self._call(self.store.check, [self._key(name)])

    def set(self, name: str, value: str) -> None:
        self._call(self.store.set, self._key(name), value)

    def get(self, name: str) -> str:
        return self._call(self.store.get, self._key(name)).decode(errors="replace")

    def add(self, name: str, amount: int) -> int:
        return self._call(self.store.add, self._key(name), amount)

    def compare_set(self, name: str, value: str) -> str:
        """Set ``name`` unless it is set; returns what it holds now."""
        return self._call(self.store.compare_set, self._key(name), "", value).decode(errors="replace")

    def _key(self, name: str) -> str:
        return f"{self.plan.namespace}/{name}"

    def _call(self, operation: Callable[..., Any], *args: Any) -> Any:
        try:
            return operation(*args)
        except dist.DistError as exc:
            raise PeerUnreachable(f"the rendezvous store went away: {str(exc).splitlines()[0]}") from exc
