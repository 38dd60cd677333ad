"""CurveZMQ (--secure): training works; a client without an allowed key can neither read weights nor
inject updates; a peer with a valid key cannot pose as another rank."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
import torch
import zmq
import zmq.auth
from zmq.utils.monitor import parse_monitor_message

import gossip
from gossip.errors import ConfigError, PeerTimeout
from gossip.net.address import ipc_endpoint
from gossip.net.security import generate_keys, load_keys
from gossip.net.transport import Transport, TransportConfig
from gossip.net.wire import encode, params_header
from tests.conftest import ROOT, free_base_port, run_peers, vector_model, wait_until

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def keydir(tmp_path):
    generate_keys(tmp_path / "keys", world_size=3)
    return tmp_path / "keys"


def endpoints(count: int) -> tuple[str, ...]:
    base = free_base_port(count)
    return tuple(f"tcp://127.0.0.1:{base + r}" for r in range(count))


def test_gossip_keys_command_writes_public_and_private_keys(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "gossip.net.security", str(tmp_path / "k"), "--nodes", "2",
                           "--server"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in (tmp_path / "k" / "public").iterdir()) == ["peer-0.key", "peer-1.key", "server.key"]
    assert sorted(p.name for p in (tmp_path / "k" / "private").iterdir()) == [
        "peer-0.key_secret", "peer-1.key_secret", "server.key_secret"]
    keys = load_keys(tmp_path / "k", rank=2, world_size=2, server=True)  # the server's
    assert set(keys.peers) == {0, 1, 2}
    assert set(load_keys(tmp_path / "k", rank=0, world_size=2).peers) == {0, 1}  # no server: its key admits no one
    with pytest.raises(ConfigError, match="create the keys with: gossip-keys"):
        load_keys(tmp_path / "nowhere", rank=0, world_size=2)


def secure_ring(keydir, eps, values):
    """Three secure sync-gossip peers in threads; returns their final vectors."""
    def peer(rank: int):
        model = vector_model(values[rank])
        with gossip.attach(model, rank=rank, world_size=3, endpoints=eps, topology="full", secure=str(keydir)) as av:
            for _ in range(3):
                av.step()
        return model.value.detach().clone(), av.statistics()

    return run_peers(3, peer)


def test_secure_gossip_averages_exactly(keydir):
    values = [torch.full((5,), float(r), dtype=torch.float64) for r in range(3)]
    results = secure_ring(keydir, endpoints(3), values)
    for vector, stats in results:
        torch.testing.assert_close(vector, torch.full((5,), 1.0, dtype=torch.float64), rtol=0, atol=1e-12)
        assert stats["dropped"] == {}


def stranger_keys(directory) -> tuple[bytes, bytes]:
    """A key pair that is on nobody's allow-list."""
    directory.mkdir(parents=True)
    _, secret_file = zmq.auth.create_certificates(directory, "stranger")
    return zmq.auth.load_certificate(secret_file)


def rogue_messages(rank_claimed: int, layout) -> list[list]:
    header = params_header("params", rank_claimed, layout, 8 << 20, round=0)
    poison = [torch.full((hi - lo,), 1e6, dtype=torch.float64) for _, lo, hi in layout.frame_plan(8 << 20)]
    return [encode(header, poison) for _ in range(20)]


def test_a_client_without_an_allowed_key_changes_nothing(keydir, tmp_path):
    eps = endpoints(3)
    stranger_public, stranger_secret = stranger_keys(tmp_path / "stranger")
    peer0_public = load_keys(keydir, 0, 3).public
    context = zmq.Context()
    sockets = []
    try:
        signed = context.socket(zmq.DEALER)  # a valid CURVE client, but its key is not on the allow-list
        signed.curve_secretkey, signed.curve_publickey, signed.curve_serverkey = (stranger_secret, stranger_public,
                                                                                  peer0_public)
        plain = context.socket(zmq.DEALER)  # no CURVE at all
        for sock in (signed, plain):
            sock.setsockopt(zmq.ROUTING_ID, b"1")
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(eps[0])
            sockets.append(sock)
        values = [torch.full((5,), float(r), dtype=torch.float64) for r in range(3)]
        stop = threading.Event()

        def attack() -> None:
            layout = gossip.flat.FlatParams(vector_model(values[0]), 8 << 20).layout
            while not stop.is_set():
                for message in rogue_messages(1, layout)[:2]:
                    for sock in sockets:
                        try:
                            sock.send_multipart(message, flags=zmq.NOBLOCK)
                        except zmq.Again:
                            pass
                time.sleep(0.01)

        attacker = threading.Thread(target=attack, daemon=True)
        attacker.start()
        results = secure_ring(keydir, eps, values)
        stop.set()
        attacker.join(5)
    finally:
        for sock in sockets:
            sock.close(0)
        context.term()
    vector, stats = results[0]
    torch.testing.assert_close(vector, torch.full((5,), 1.0, dtype=torch.float64), rtol=0, atol=1e-12)
    assert stats["dropped"] == {}  # nothing from the strangers even reached validation


def test_a_key_that_is_no_rank_of_the_run_is_refused_at_the_handshake(keydir, tmp_path):
    """A key file in public/ made for a larger run (``peer-3`` of a 3-peer run) admits no one."""
    stranger_public, stranger_secret = stranger_keys(tmp_path / "stranger")
    (keydir / "public" / "peer-3.key").write_bytes((tmp_path / "stranger" / "stranger.key").read_bytes())
    eps = endpoints(3)
    keys = load_keys(keydir, 0, 3)
    transport = Transport(0, eps[0], eps, lambda sender, frames, connection: None, TransportConfig(keys=keys))
    transport.start()
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.curve_secretkey, sock.curve_publickey, sock.curve_serverkey = stranger_secret, stranger_public, keys.public
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
    try:
        sock.connect(eps[0])
        assert monitor.poll(10_000), "no handshake outcome within 10 s"
        assert parse_monitor_message(monitor.recv_multipart())["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH
    finally:
        sock.disable_monitor()
        monitor.close(0)
        sock.close(0)
        context.term()
        transport.close(0)


@pytest.mark.slow
def test_no_peer_talks_to_an_impostor_on_its_neighbours_address(keydir, tmp_path):
    eps = endpoints(3)
    public, secret = stranger_keys(tmp_path / "impostor")
    context = zmq.Context()
    impostor = context.socket(zmq.ROUTER)  # sits on peer 1's address with its own key pair
    impostor.curve_secretkey, impostor.curve_publickey, impostor.curve_server = secret, public, True
    impostor.setsockopt(zmq.LINGER, 0)
    impostor.bind(eps[1])
    impostor.bind(ipc_endpoint(eps[1]))  # and on its same-host Unix socket, which peer 0 dials here
    monitor = impostor.get_monitor_socket(zmq.EVENT_ACCEPTED)
    try:
        model = vector_model(torch.zeros(4, dtype=torch.float64))
        with pytest.raises(PeerTimeout, match="heard nothing from peer"):
            gossip.attach(model, rank=0, world_size=3, endpoints=eps, topology="full", secure=str(keydir),
                          startup_timeout=1.5)
        assert monitor.poll(200)  # peer 0 did dial the impostor ...
        assert impostor.poll(200) == 0  # ... but its hello never reached it: the CURVE handshake failed
    finally:
        monitor.close(0)
        impostor.close(0)
        context.term()


def test_a_valid_key_cannot_pose_as_another_rank(keydir):
    """Peer 2's key, claiming rank 1 in its routing id and its headers: dropped as sender-mismatch, and the
    real peer 1 is not cut off by the claimed routing id."""
    eps = endpoints(3)
    keys2 = load_keys(keydir, 2, 3)
    context = zmq.Context()
    liar = context.socket(zmq.DEALER)
    liar.curve_secretkey, liar.curve_publickey, liar.curve_serverkey = keys2.secret, keys2.public, keys2.peers[0]
    liar.setsockopt(zmq.ROUTING_ID, b"1")
    liar.setsockopt(zmq.LINGER, 0)
    liar.connect(eps[0])
    model = vector_model(torch.zeros(4, dtype=torch.float64))
    ready = threading.Event()

    def neighbour(rank: int):
        other = vector_model(torch.zeros(4, dtype=torch.float64))
        with gossip.attach(other, rank=rank, world_size=3, endpoints=eps, topology="ring", secure=str(keydir)) as av:
            ready.wait(20)
            av.step()

    threads = [threading.Thread(target=neighbour, args=(r,), daemon=True) for r in (1, 2)]
    for thread in threads:
        thread.start()
    try:
        averager = gossip.attach(model, rank=0, world_size=3, endpoints=eps, topology="ring", secure=str(keydir))
        for message in rogue_messages(1, averager.flat.layout)[:5]:
            liar.send_multipart(message)
        wait_until(lambda: averager.statistics()["dropped"].get("sender-mismatch", 0) >= 5, 10,
                   "5 sender-mismatch drops")
        assert averager.statistics()["dropped"].get("sender-mismatch") == 5
        ready.set()
        averager.step()
        averager.close()
        assert float(model.value.abs().max()) == 0.0  # the poison never reached the weights
    finally:
        ready.set()
        for thread in threads:
            thread.join(20)
        liar.close(0)
        context.term()


def test_secure_launcher_run_trains(launch_run, tmp_path):
    generate_keys(tmp_path / "keys", world_size=3)
    run = launch_run("--secure", str(tmp_path / "keys"), "--steps", "120", nodes=3)
    assert run.summary["mean_test_accuracy"] >= 0.88
