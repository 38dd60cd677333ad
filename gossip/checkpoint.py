"""Checkpoints that a crash never leaves half-written.

``save`` writes to a temporary file beside the target, flushes and fsyncs it, renames it over the target
(atomic on POSIX) and fsyncs the directory, so at every instant the target is either the previous complete
checkpoint or the new complete one. A failed write (a full disk, say) leaves the previous checkpoint in
place, removes the temporary file and reports ``CheckpointError``; the caller decides whether to go on.
``load`` reads with ``weights_only=True``: a checkpoint holds tensors and plain values, never code.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from gossip.errors import CheckpointError


def save(state: dict[str, Any], path: str | Path) -> None:
    path = Path(path)
    temporary = path.with_name(f".{path.name}.tmp")
    try:
        with open(temporary, "wb") as file:
            torch.save(state, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
        _fsync_directory(path.parent)
    except (OSError, RuntimeError) as exc:  # torch's zip writer reports a full disk as RuntimeError
        temporary.unlink(missing_ok=True)
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc).splitlines()[0]
        raise CheckpointError(f"checkpoint {path} not written ({reason}); the previous one is kept") from exc


def load(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        return torch.load(path, weights_only=True)
    except Exception as exc:  # a damaged file can fail in any of torch's or pickle's ways: translate them all
        raise CheckpointError(f"cannot read checkpoint {path}: {str(exc).splitlines()[0]}") from exc


def _fsync_directory(directory: Path) -> None:
    """Make the rename itself durable (the directory entry lives in the directory's own blocks)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
