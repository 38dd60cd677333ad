"""SIGINT and SIGTERM stop a peer, a worker or the server with ``Stopped``, even where the raise is lost.

The handler raises ``Stopped`` wherever the main thread is when the signal is handled. Python handles a
signal between bytecodes, and also inside C code that checks for signals, such as pyzmq freeing a
received ZeroMQ frame (``Frame.__dealloc__``) when the mix lets go of a message: an exception there is
printed ("Exception ignored in ...") and dropped, and the process would train on as if no signal had come
until the launcher killed it. So the handler also remembers the signal, and the main loops call
``raise_if_signalled`` between steps, which raises it again.
"""

from __future__ import annotations

import signal

from gossip.errors import Stopped

_received: list[int] = []  # the signals handled so far, in order


def _stop(signum: int, frame: object) -> None:
    _received.append(signum)
    raise Stopped(signum)


def stop_on_signals() -> None:
    """From now on SIGINT and SIGTERM raise ``Stopped`` (call from the main thread)."""
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _stop)


def raise_if_signalled() -> None:
    """Raise ``Stopped`` for a signal whose handler's raise was lost."""
    if _received:
        raise Stopped(_received[0])
