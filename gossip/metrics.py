"""Measurements a peer keeps about itself, and the JSON-lines event log the launcher reads.

The log is strict JSON, which has no NaN or Infinity: a non-finite number (a diverged loss, an infinite
weight, in any field, however deeply nested) is written as ``null``, like a missing value, and the readers
(``launch/summary.py``, ``launch/progress.py``, ``launch/plot.py``) show it as no value. Logging never
fails because a number went non-finite; a model that did is refused by the health check
(``gossip/health.py``) with its own message, not by the log.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import IO, Any


class SpeedMeter:
    """Exponential moving averages of this peer's own pace: seconds per step, samples per second, and busy
    seconds per round (from the end of one mixing point to the start of the next). Time spent waiting for
    neighbours is left out, so the numbers describe this peer, not the slowest of its neighbours."""

    def __init__(self, smoothing: float = 0.1) -> None:
        self.smoothing = smoothing
        self.step_seconds = 0.0
        self.samples_per_second = 0.0
        self.round_seconds = 0.0
        self._last: float | None = None

    def round_done(self, busy_seconds: float) -> None:
        self.round_seconds = _ema(self.round_seconds, max(busy_seconds, 1e-9), self.smoothing)

    def tick(self, samples: int, waited: float = 0.0) -> None:
        """One step done, ``waited`` seconds of which were spent waiting for neighbours."""
        now = time.perf_counter()
        if self._last is not None:
            elapsed = max(now - self._last - waited, 1e-9)
            self.step_seconds = _ema(self.step_seconds, elapsed, self.smoothing)
            self.samples_per_second = _ema(self.samples_per_second, samples / elapsed, self.smoothing)
        self._last = now


def _ema(previous: float, value: float, smoothing: float) -> float:
    return value if previous == 0.0 else (1 - smoothing) * previous + smoothing * value


class EventLog:
    """Appends one JSON object per line; every line is flushed so a reader sees it at once."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: IO[str] = open(path, "a", buffering=1, encoding="utf-8")

    def write(self, event: str, **fields: Any) -> None:
        record = {"event": event, "time": time.time(), **fields}
        try:
            line = json.dumps(record, default=_jsonable, allow_nan=False)
        except ValueError:  # a NaN or an infinity somewhere (rare): the same record with null in its place
            line = json.dumps(_finite(record), default=_jsonable, allow_nan=False)
        self._file.write(line + "\n")

    def close(self) -> None:
        self._file.close()


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):  # numpy and torch scalars
        return _finite(value.item())
    raise TypeError(f"cannot log {type(value).__name__}")


def _finite(value: Any) -> Any:
    """``value`` with every non-finite float in it (in dicts, lists and tuples) replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value  # numpy and torch scalars are made finite by _jsonable as they are encoded


def finite_or_none(value: float) -> float | None:
    """JSON has no NaN: a diverged loss is logged as null."""
    return value if math.isfinite(value) else None
