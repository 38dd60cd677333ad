"""Averagers by mode name (and, for gossip-async, by ``async_rule``; for gossip-sync, by ``compress``)."""

from gossip.averagers.base import Averager
from gossip.averagers.compressed import CompressedGossip
from gossip.averagers.latest import LatestGossip
from gossip.averagers.pushsum import AsyncPushSum
from gossip.averagers.sync import SyncGossip
from gossip.config import GossipConfig


def averager_class(config: GossipConfig) -> type[Averager]:
    """The averager of a gossip mode: gossip-async is push-sum unless ``async_rule`` is "latest"."""
    if config.mode == "gossip-async":
        return LatestGossip if config.asynchronous.async_rule == "latest" else AsyncPushSum
    return SyncGossip if config.compression.compress == "none" else CompressedGossip


__all__ = ["AsyncPushSum", "Averager", "CompressedGossip", "LatestGossip", "SyncGossip", "averager_class"]
