"""The inbound guard's limits as the transport sets them, against the bound RELIABILITY.md states: per
connection, 32 x ((4 + 2) largest messages + 64 KiB handshake + 64 B per heartbeat interval), and for our
DEALERs' connections the handshake and heartbeats alone. Pure: the transport is built, never started; the
descriptor check runs on plain loopback sockets."""

from __future__ import annotations

import socket

import pytest

from gossip.connect import inbound_limits
from gossip.net.address import dials
from gossip.net.inbound import InboundGuard
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
    outbound = Transport(0, endpoints[0], endpoints, lambda *a: None, TransportConfig(heartbeat_timeout=3.0)).outbound
    assert outbound.allowed(0) == (64 << 10) + 64  # a neighbour's ROUTER sends our DEALER ZMTP commands only


def test_a_reused_descriptor_is_watched_only_if_it_is_the_connection_meant():
    # libzmq's monitor names a DEALER's descriptor after the fact: by then the number may belong to another
    # connection, such as one our ROUTER accepted, which must not be judged by the DEALER's limit
    with socket.create_server(("127.0.0.1", 0)) as server:
        address = f"tcp://127.0.0.1:{server.getsockname()[1]}"
        with socket.create_connection(server.getsockname()) as dealer_side:
            accepted, _ = server.accept()
            with accepted:
                assert dials(dealer_side, address) and not dials(accepted, address)
                assert not dials(dealer_side, "tcp://127.0.0.2:" + address.rsplit(":", 1)[1])
                guard = InboundGuard(0, 16)
                guard.accepted(accepted.fileno(), lambda sock: dials(sock, address))
                assert guard.connections == {}
                guard.accepted(dealer_side.fileno(), lambda sock: dials(sock, address))
                assert list(guard.connections) == [dealer_side.fileno()]
                guard.close()
