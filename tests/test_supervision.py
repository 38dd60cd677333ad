"""Every transport task is supervised: one that dies of a bug fails the transport with its reason, wakes a
post waiting for room and every mailbox wait, instead of leaving them to time out. Real sockets on
loopback; the bug is injected into the send path."""

from __future__ import annotations

import asyncio
import threading

import pytest

from gossip.averagers.mailboxes import PushSumMailbox
from gossip.errors import PeerTimeout, TransportError
from gossip.net import outbox as outbox_module
from gossip.net.transport import Transport, TransportConfig
from gossip.net.wire import Layout
from tests.conftest import free_base_port

pytestmark = pytest.mark.timeout(60)


def test_a_send_task_that_dies_fails_the_transport_and_wakes_a_waiting_post(monkeypatch):
    release = threading.Event()

    async def broken_send(*args, **kwargs):
        while not release.is_set():  # held until the test has filled the queue behind it
            await asyncio.sleep(0.005)
        raise RuntimeError("a bug in the send path")

    monkeypatch.setattr(outbox_module, "_send", broken_send)
    base = free_base_port(2)
    endpoints = [f"tcp://127.0.0.1:{base + r}" for r in range(2)]
    failures: list[BaseException] = []
    transport = Transport(0, endpoints[0], endpoints, lambda *a: None, TransportConfig(queue_depth=1),
                          on_failure=failures.append)
    transport.start()
    outcome: list[BaseException] = []

    def post_and_wait() -> None:
        try:
            transport.post([1], [b"third"], latest_only=False, timeout=20)
        except BaseException as exc:  # noqa: BLE001 - examined by the test
            outcome.append(exc)

    try:
        transport.post([1], [b"first"], latest_only=False, timeout=5)  # taken by the send task, which hangs
        transport.post([1], [b"second"], latest_only=False, timeout=5)  # fills the queue (depth 1)
        waiter = threading.Thread(target=post_and_wait)
        waiter.start()
        release.set()
        waiter.join(30)
        assert not waiter.is_alive()
        # before supervision: PeerTimeout after 20 s, the send task's death unnoticed
        assert len(outcome) == 1 and isinstance(outcome[0], TransportError), outcome
        assert not isinstance(outcome[0], PeerTimeout) and "a bug in the send path" in str(outcome[0])
        assert [str(f) for f in failures] == ["a bug in the send path"]
    finally:
        transport.close(flush_timeout=0)


def test_a_failed_transport_makes_every_mailbox_wait_raise_with_its_reason():
    layout = Layout.describe([("w", (4,), "float32")], ["float32"], [4], 256)
    box = PushSumMailbox(0, 3, layout, lambda sender, round: True, lambda sender, round: 0.5)
    box.fail(RuntimeError("the receive task died"))
    with pytest.raises(TransportError, match="the receive task died"):
        box.wait_hellos({1, 2}, timeout=30)
    with pytest.raises(TransportError, match="the receive task died"):
        box.wait_drained({1}, idle_timeout=30)
