"""The connection guard under the names ``tests/test_inbound.py`` imports: ``gossip/net/guard.py`` is the
module, ``ConnectionGuard`` the class (it guards accepted and outbound connections alike)."""

from gossip.net.guard import ConnectionGuard as InboundGuard
from gossip.net.guard import DescriptorPool

__all__ = ["DescriptorPool", "InboundGuard"]
