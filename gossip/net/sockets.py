"""Opening a ZeroMQ socket for the transport, with an error that says what to do when the process has run out
of descriptors."""

from __future__ import annotations

import zmq
import zmq.asyncio

from gossip.errors import PeerUnreachable


def open_socket(context: zmq.asyncio.Context, kind: int, rank: int, purpose: str) -> zmq.asyncio.Socket:
    """A socket of ``kind`` for peer ``rank``; ``purpose`` completes "cannot open a socket to ..."."""
    try:
        return context.socket(kind)
    except zmq.ZMQError as exc:  # EMFILE above all: every descriptor of the process is in use
        raise PeerUnreachable(f"peer {rank} cannot open a socket to {purpose}: {exc.strerror} "
                              "(raise the open-file limit, ulimit -n)") from exc
