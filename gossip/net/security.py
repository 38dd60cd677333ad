"""CurveZMQ for every socket (``--secure KEYDIR``): encryption, and an allow-list of public keys.

Part of the network layer (``gossip/net/``, the only package that imports zmq). Key layout, as
``gossip-keys KEYDIR --nodes N [--server]`` (or ``python -m gossip.net.security``) writes it::

    KEYDIR/public/peer-0.key ... peer-<N-1>.key [server.key]      everyone's public key: the allow-list
    KEYDIR/private/peer-0.key_secret ...                          each process needs only its own

Every ROUTER is a CURVE server with its own key pair, and a ZAP authenticator admits only clients whose
public key is in ``public/``; every DEALER is a CURVE client that knows the public key of the peer it
dials, so it never talks to an impostor bound on that peer's address. Only the keys of this run's ranks are
admitted (``peer-0`` .. ``peer-<N-1>``, and ``server`` in the parameter-server modes): any other file in
``public/`` admits no one. A received message's ``User-Id`` is the sender's authenticated public key,
which the transport maps back to its rank: a peer with a valid key cannot pose as another rank either. Copy ``public/`` and each host's own secret keys to every host.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
import zmq.utils.z85
from zmq.auth.asyncio import AsyncioAuthenticator

from gossip.errors import ConfigError


def key_name(rank: int, world_size: int) -> str:
    """Whose key: ``peer-<rank>``, or ``server`` for the parameter server's rank (``world_size``)."""
    return "server" if rank == world_size else f"peer-{rank}"


@dataclass(frozen=True)
class CurveKeys:
    public: bytes
    secret: bytes
    peers: dict[int, bytes]  # rank -> public key, for every rank with a key in public/
    public_dir: Path

    def rank_of(self, user_id: str) -> int | None:
        """The rank whose public key authenticated a connection (ZeroMQ's ``User-Id``), if any."""
        key = user_id.encode()
        return next((rank for rank, public in self.peers.items() if public == key), None)


def load_keys(keydir: str | Path, rank: int, world_size: int, server: bool = False) -> CurveKeys:
    """Our key pair and the public keys of this run's ranks: ``peer-0`` .. ``peer-<N-1>``, and ``server``
    when the run has a parameter server. Any other file in ``public/`` is ignored: it admits no one."""
    keydir = Path(keydir)
    own = keydir / "private" / f"{key_name(rank, world_size)}.key_secret"
    if not own.is_file():
        raise ConfigError(f"no secret key {own}; create the keys with: gossip-keys {keydir} --nodes {world_size}"
                          + (" --server" if rank == world_size else ""))
    try:
        public, secret = zmq.auth.load_certificate(own)
        peers = {rank: zmq.auth.load_certificate(path)[0]
                 for rank in range(world_size + (1 if server else 0))
                 if (path := keydir / "public" / f"{key_name(rank, world_size)}.key").is_file()}
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the keys in {keydir}: {exc}") from exc
    return CurveKeys(public, secret, peers, keydir / "public")


def shared_secret(secret: bytes, public: bytes) -> bytes:
    """X25519 (RFC 7748) of our CURVE secret key and another's public key, both Z85 as ``load_keys`` gives
    them: the same 32 bytes on both sides, and no one without one of the two secret keys can compute them.
    CURVE keys are Curve25519 keys, so no new key material is needed. Pure Python, to need no extra
    dependency: a millisecond or two each, and not constant-time (used a few times per rendezvous, never on
    anything a remote party chooses: both keys come from KEYDIR)."""
    p = 2**255 - 19
    scalar = bytearray(zmq.utils.z85.decode(secret))
    scalar[0] &= 248
    scalar[31] = (scalar[31] & 127) | 64
    k = int.from_bytes(scalar, "little")
    x1 = int.from_bytes(zmq.utils.z85.decode(public), "little") & ((1 << 255) - 1)
    x2, z2, x3, z3, swap = 1, 0, x1, 1, 0
    for t in reversed(range(255)):  # the Montgomery ladder of RFC 7748, section 5
        bit = (k >> t) & 1
        if swap ^ bit:
            x2, x3, z2, z3 = x3, x2, z3, z2
        swap = bit
        a, b, c, d = x2 + z2, x2 - z2, x3 + z3, x3 - z3
        aa, bb, da, cb = a * a % p, b * b % p, d * a % p, c * b % p
        e = aa - bb
        x3, z3 = (da + cb) ** 2 % p, x1 * (da - cb) ** 2 % p
        x2, z2 = aa * bb % p, e * (aa + 121665 * e) % p
    if swap:
        x2, z2 = x3, z3
    shared = (x2 * pow(z2, p - 2, p) % p).to_bytes(32, "little")
    if shared == bytes(32):
        raise ConfigError("a public key in KEYDIR is a point of low order; recreate the keys with gossip-keys")
    return shared


def generate_keys(keydir: str | Path, world_size: int, server: bool = False) -> list[str]:
    """Create a key pair per peer (and the server): public keys in public/, secret keys in private/."""
    keydir = Path(keydir)
    public, private = keydir / "public", keydir / "private"
    public.mkdir(parents=True, exist_ok=True)
    private.mkdir(parents=True, exist_ok=True)
    private.chmod(0o700)
    names = [key_name(rank, world_size) for rank in range(world_size + (1 if server else 0))]
    for name in names:
        public_file, _ = zmq.auth.create_certificates(private, name)
        shutil.move(public_file, public / f"{name}.key")
    return names


def secure_router(socket: zmq.Socket, keys: CurveKeys) -> None:
    socket.curve_secretkey = keys.secret
    socket.curve_publickey = keys.public
    socket.curve_server = True


def secure_dealer(socket: zmq.Socket, keys: CurveKeys, dest: int) -> None:
    if dest not in keys.peers:
        raise ConfigError(f"no public key for rank {dest} in {keys.public_dir}; every peer needs everyone's")
    socket.curve_secretkey = keys.secret
    socket.curve_publickey = keys.public
    socket.curve_serverkey = keys.peers[dest]


def start_authenticator(context: zmq.asyncio.Context, keys: CurveKeys) -> AsyncioAuthenticator:
    """ZAP handler on the running loop: admit only the public keys of this run's ranks (``keys.peers``), so
    a stray key in ``public/`` (one made for a larger run, say) is refused at the handshake."""
    authenticator = AsyncioAuthenticator(context)
    authenticator.start()
    authenticator.configure_curve_callback(domain="*", credentials_provider=_RunKeys(keys))
    return authenticator


class _RunKeys:
    """The ZAP credentials provider: a client key is admitted when it is one of the run's ranks."""

    def __init__(self, keys: CurveKeys) -> None:
        self.allowed = frozenset(keys.peers.values())
        self.refused = 0

    def callback(self, domain: str, key: bytes) -> bool:
        admitted = key in self.allowed
        self.refused += not admitted
        return admitted


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gossip-keys", description="Create CurveZMQ key pairs for --secure.")
    parser.add_argument("keydir", help="directory to create public/ and private/ in")
    parser.add_argument("--nodes", type=int, required=True, help="number of peers (or workers)")
    parser.add_argument("--server", action="store_true", help="also a key pair for the parameter server")
    args = parser.parse_args(argv)
    if args.nodes < 1:
        parser.error("--nodes must be >= 1")
    names = generate_keys(args.keydir, args.nodes, args.server)
    print(f"wrote {len(names)} key pairs to {args.keydir}: public/*.key (copy to every host), "
          f"private/*.key_secret (each host needs only its own)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
