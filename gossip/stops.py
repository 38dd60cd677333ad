"""Peers that stopped the run, and why: their "abort", or their model layout unlike ours (gossip modes).

A stop is believed at once when it came over the connection of the sender's latest accepted message (or,
with CURVE, from the sender's key); otherwise it is held, and counts only while we wait for its sender, have
heard nothing from it since, have no live link to it (a peer that could not even listen never completes a
handshake; one that is up was named by someone else), and ``peer_timeout`` has passed.

Pure state: the owning mailbox holds its lock around every call and passes the time in.
"""

from __future__ import annotations

from collections.abc import Callable


class Stops:
    """The stops a mailbox heard: believed ones, and held ones with when they came (module docstring)."""

    def __init__(self) -> None:
        self._believed: dict[int, str] = {}  # sender -> reason
        self._held: dict[int, tuple[str, float]] = {}  # sender -> (reason, since)

    def note(self, sender: int, reason: str, believed: bool, now: float) -> None:
        if believed:
            self._believed.setdefault(sender, reason)
        else:
            self._held.setdefault(sender, (reason, now))

    def spoke(self, sender: int) -> None:
        """``sender`` spoke: whoever said it stopped was not it."""
        self._held.pop(sender, None)

    def reason(self, waiting_for: set[int], linked: Callable[[int], bool], now: float, peer_timeout: float
               ) -> str | None:
        """Why the run is stopped, or None: a believed stop; a held one of a sender in ``waiting_for`` that is
        not ``linked`` and has held for ``peer_timeout``."""
        if self._believed:
            return next(iter(self._believed.values()))
        for sender in waiting_for & self._held.keys():
            reason, since = self._held[sender]
            if not linked(sender) and now - since >= peer_timeout:
                return reason
        return None
