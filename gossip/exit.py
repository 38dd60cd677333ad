"""Ending a program without the interpreter's teardown."""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn


def exit_now(code: int | None) -> NoReturn:
    """``sys.exit(code)`` without Python's finalisation. Once torch is imported (and with it, from the first
    optimizer on, its compiler stack), tearing the interpreter down takes about 0.9 s of CPU, which every
    run paid after its last line was printed. The programs that end here have closed their sockets and
    files by then; the log handlers, stdout and stderr are flushed first. ``None`` is status 0, as for
    ``sys.exit``."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more can reach it anyway
            pass
    os._exit(0 if code is None else code)
