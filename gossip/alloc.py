"""Keep freed message buffers in the heap, so a gossip round does not page-fault 100s of MB anew.

Every received ZeroMQ frame is a fresh malloc (libzmq allocates per message) and every snapshot is a
fresh tensor. With glibc's defaults, blocks of several MiB are mapped with mmap and unmapped on free, or
returned to the kernel when the heap top is trimmed, and each new block costs a page fault per 4 KiB
(the kernel zeroes every page). Measured on the 3-peer 100 MiB exchange: about 27,000 page faults and
0.4 s per round with the defaults, a few hundred and 0.2-0.3 s with these settings.
"""

from __future__ import annotations

import ctypes
import logging
import sys

log = logging.getLogger("gossip.alloc")
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_applied = False


def keep_freed_memory() -> None:
    """glibc only, once per process: serve blocks up to 32 MiB from the heap (not mmap), never trim the
    heap top below 2 GiB, and grow the heap 256 MiB at a time. Other platforms are left alone."""
    global _applied
    if _applied or not sys.platform.startswith("linux"):
        return
    _applied = True
    try:
        # the process's own symbols, libc's among them (find_library would run ldconfig: a process per start)
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return
    for option, value in ((_M_MMAP_THRESHOLD, 32 << 20), (_M_TRIM_THRESHOLD, 2 << 30), (_M_TOP_PAD, 256 << 20)):
        if mallopt(option, value) != 1:
            log.debug("mallopt(%d, %d) refused", option, value)
