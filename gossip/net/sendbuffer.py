"""A send buffer for same-host connections that holds a whole message of a small model.

Peers on one host talk over Unix sockets (``gossip/net/address.py``). Linux gives a Unix socket the send
buffer ``net.core.wmem_default`` (208 KiB on most systems), and a stream socket's sender can have no more
than that in flight, so a 1 MiB message crosses in five pieces: five wake-ups of ZeroMQ's I/O thread in
the sender (waiting to write the next piece) and five in the receiver (reading each), per message. With
a buffer larger than the message it goes in one write and one read: in ``bench/exchange.py``'s 1 MiB
ring the I/O thread's voluntary context switches fell from 10.7 to 3.7 per round and the round's wall
time by about 15%; at 100 MiB they fell from about 540 to 27 per round and the round's time by about 8%.

libzmq's ``SNDBUF`` option applies to TCP only (TCP's own buffers grow by themselves), so the transport
sets the option on each Unix connection's descriptor, which its monitor names when the connection is
made. The kernel caps the request at ``net.core.wmem_max`` and doubles what it grants (bookkeeping);
where ``wmem_max`` is the common 208 KiB the grant is 416 KiB, twice the default but still short of a
1 MiB message, and raising it (``sysctl -w net.core.wmem_max=4194304``) is what lets this work fully. A
larger buffer costs kernel memory only for the bytes actually in flight.
"""

from __future__ import annotations

import os
import socket

SEND_BUFFER_BYTES = 4 << 20  # asked for; the kernel grants at most twice net.core.wmem_max


def enlarge_send_buffer(fd: int) -> int | None:
    """Ask for a ``SEND_BUFFER_BYTES`` send buffer on the Unix stream socket ``fd`` (a descriptor libzmq
    owns: we set the option through a duplicate). Returns the buffer the kernel granted, or None when the
    descriptor is gone already or is not a Unix socket (its number reused meanwhile)."""
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return None
    try:
        if sock.family != socket.AF_UNIX:
            return None
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        return sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
    except OSError:
        return None
    finally:
        sock.close()
