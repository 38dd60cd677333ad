"""The connection guard's limits as the transport sets them, against the bound RELIABILITY.md states: per
connection, 32 x ((4 + 2) largest messages + 64 KiB handshake + 64 B per heartbeat interval), and for our
DEALERs' connections the handshake and heartbeats alone; a connection cut for descriptor headroom, through a
descriptor held for it. Pure: the transport is built, never started; the descriptor checks run on plain
loopback sockets."""

from __future__ import annotations

import os
import socket

import pytest

from gossip.connect import inbound_limits
from gossip.net.address import dials
from gossip.net.guard import ConnectionGuard, DescriptorPool
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
                guard = ConnectionGuard(0, 16)
                guard.accepted(accepted.fileno(), lambda sock: dials(sock, address))
                assert guard.connections == {}
                guard.accepted(dealer_side.fileno(), lambda sock: dials(sock, address))
                assert list(guard.connections) == [dealer_side.fileno()]
                guard.close()


def test_a_connection_that_would_eat_into_the_reserve_is_cut_at_once_through_a_held_descriptor():
    pool = DescriptorPool(2)
    guard = ConnectionGuard(1 << 20, 8, pool=pool, reserve=1 << 40)  # more than any process has: always short
    with socket.create_server(("127.0.0.1", 0)) as server, socket.create_connection(server.getsockname()) as client:
        accepted, _ = server.accept()
        with accepted:
            guard.accepted(accepted.fileno())
            assert guard.cut == {"descriptors": 1} and pool.free == 2  # its duplicate went back to the pool
            client.settimeout(5)
            assert client.recv(1) == b""  # cut: the other end sees the end of the stream
    guard.close()
    pool.close()


def test_the_guards_duplicates_live_in_held_descriptors():
    pool = DescriptorPool(1)
    guard = ConnectionGuard(1 << 20, 8, pool=pool)
    with socket.create_server(("127.0.0.1", 0)) as server, socket.create_connection(server.getsockname()):
        accepted, _ = server.accept()
        with accepted:
            guard.accepted(accepted.fileno())
            watched = guard.connections[accepted.fileno()].socket
            assert pool.free == 0 and watched.getsockname() == accepted.getsockname()
            number = watched.fileno()
            guard.closed(accepted.fileno())
            assert pool.free == 1 and os.readlink(f"/proc/self/fd/{number}") == os.devnull  # held again
            guard.accepted(accepted.fileno())  # watched again, in the held descriptor
            assert pool.free == 0 and guard.connections[accepted.fileno()].socket.fileno() == number
            with socket.create_connection(server.getsockname()):
                second, _ = server.accept()
                with second:
                    guard.accepted(second.fileno())  # none held is left: a new duplicate (os.dup), as before
                    assert guard.connections[second.fileno()].socket.fileno() != number
    guard.close()
    pool.close()
