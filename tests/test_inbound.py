"""The inbound guard's limits as the transport sets them, against the bound RELIABILITY.md states: per
connection, 32 x ((4 + 2) largest messages + 64 KiB handshake + 64 B per heartbeat interval). Pure: the
transport is built, never started."""

from __future__ import annotations

import pytest

from gossip.connect import inbound_limits
from gossip.net.transport import Transport, TransportConfig
from gossip.net.wire import MAX_HEADER_BYTES
from tests.hostile import victim_layout


def test_the_stated_memory_bound_for_the_digits_model():
    layout = victim_layout(world_size=4)
    assert layout.total_bytes == 38_440
    endpoints = [f"tcp://127.0.0.1:{30000 + r}" for r in range(4)]
    guard = Transport(0, endpoints[0], endpoints, lambda *a: None,
                      TransportConfig(heartbeat_timeout=3.0, **inbound_limits(layout, 4))).guard
    wire = (4 + 2) * (38_440 + MAX_HEADER_BYTES) + (64 << 10) + 64
    assert guard.allowed(0) == wire
    assert guard.memory_bound(0) == 32 * wire == pytest.approx(10.27e6, rel=1e-3)  # "10.3 MB per connection"
    assert guard.allowed(3600) - guard.allowed(0) == 64 * 3600  # a heartbeat a second, 64 bytes each
    assert guard.max_connections == 2 * 4 + 16
