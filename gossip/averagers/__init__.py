"""Averagers by mode name."""

from gossip.averagers.asynchronous import AsyncGossip
from gossip.averagers.base import Averager
from gossip.averagers.sync import SyncGossip

AVERAGERS: dict[str, type[Averager]] = {"gossip-sync": SyncGossip, "gossip-async": AsyncGossip}

__all__ = ["AVERAGERS", "Averager", "AsyncGossip", "SyncGossip"]
