"""Reading the peers' event logs (``peer-<rank>.jsonl``, ``server.jsonl``), whole or incrementally while they
grow, trusting none of what they hold.

A log is written by a peer, but what it says may come from anywhere: a forged message the peer believed, a
file cut off by a full disk or a killed process, a file copied badly from another host. So every reader of
the launcher (the live progress, the summary, the plot) gets events through ``parse_event``, which returns
only what the launcher can use without another check:

- an event is a JSON object with a string ``event``; a line that is not one (a torn line, binary bytes,
  NaN or Infinity, which the peers never write, nesting too deep to parse) is left out;
- each field the launcher computes with (``FIELDS``: counts, finite numbers, the test metrics, histograms,
  rank lists) has its type, or is removed from its event; any other field passes through untouched.

Each finding is one line naming the file, the line number and what was wrong (``EventTail.problems``, the
first ``MAX_PROBLEMS`` of a log and then a count), which the summary lists in summary.json.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

MAX_PROBLEMS = 5  # findings kept per log; the rest are counted
MAX_INT = 2**63 - 1  # no counter of a peer's is larger; a larger int would not even convert to a float


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_INT


def _is_number(value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return -MAX_INT <= value <= MAX_INT if isinstance(value, int) else math.isfinite(value)


def _number_or_null(value: Any) -> bool:  # null: a non-finite value, as gossip/metrics.py logs it
    return value is None or _is_number(value)


def _weight(value: Any) -> bool:  # a push-sum weight: > 0, or null (non-finite)
    return value is None or (_is_number(value) and value > 0)


def _metrics(value: Any) -> bool:
    return isinstance(value, dict) and all(isinstance(k, str) and _number_or_null(v) for k, v in value.items())


def _histogram(value: Any) -> bool:  # staleness: {"0": count, "3": count}
    return isinstance(value, dict) and all(k.isascii() and k.isdigit() and _is_count(v) for k, v in value.items())


def _ranks(value: Any) -> bool:
    return isinstance(value, list) and all(_is_count(v) for v in value)


def _dataset(value: Any) -> bool:
    kinds = {"name": lambda v: isinstance(v, str), "sha256": lambda v: isinstance(v, str), "files": _is_count,
             "bytes": _is_count}
    return isinstance(value, dict) and all(check(value[k]) for k, check in kinds.items() if k in value)


def _optimizer(value: Any) -> bool:  # the server's: shown as "NAME lr L, momentum M (RULE)"; null: it steps none
    return value is None or (isinstance(value, dict) and isinstance(value.get("name"), str)
                              and isinstance(value.get("rule"), str) and _is_number(value.get("lr"))
                              and _is_number(value.get("momentum")))


# check, and what a valid value is, in words
COUNT = (_is_count, "a count from 0 to 2^63 - 1")
TIME = (_is_number, "a time in seconds")
NUMBER = (_number_or_null, "a finite number or null")
WEIGHT = (_weight, "a push-sum weight > 0 or null")
METRICS = (_metrics, "an object of metric names to numbers")
HISTOGRAM = (_histogram, "an object of staleness to counts")
RANKS = (_ranks, "a list of ranks")
DICT = (lambda v: isinstance(v, dict), "an object")
TEXT = (lambda v: isinstance(v, str), "a string")
DATASET = (_dataset, "an object with a string name and sha256 and counts of files and bytes")
OPTIMIZER = (_optimizer, "an object with a string name and rule and numbers lr and momentum, or null")

# the fields the launcher reads, by event; each present one must pass its check
FIELDS: dict[str, dict[str, tuple[Callable[[Any], bool], str]]] = {
    "start": {"time": TIME},
    "ready": {"time": TIME, "step": COUNT, "round": COUNT, "dataset": DATASET, "optimizer": OPTIMIZER},
    "step": {"time": TIME, "step": COUNT, "round": COUNT, "loss": NUMBER, "bytes_sent": COUNT, "speed": NUMBER,
             "wait_seconds": NUMBER},
    "eval": {"time": TIME, "step": COUNT, "round": COUNT, "accuracy": NUMBER, "loss": NUMBER,
             "bits_per_char": NUMBER},
    "end": {"time": TIME, "step": COUNT, "rounds": COUNT, "test": METRICS, "wall_seconds": NUMBER,
            "bytes_sent": COUNT, "bytes_received": COUNT, "wait_seconds": NUMBER, "speed": NUMBER,
            "step_seconds": NUMBER, "staleness": HISTOGRAM, "weight": WEIGHT, "stragglers": RANKS,
            "max_rss_mb": NUMBER, "dropped": DICT, "versions": COUNT, "updates": COUNT},
    "error": {"message": TEXT},
    "stopped": {"message": TEXT},
}


def shown(value: Any, limit: int = 40) -> str:
    """``value`` as a short, printable quote for a message (``ascii`` escapes control and non-ASCII characters)."""
    text = ascii(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def parse_event(line: bytes) -> tuple[dict[str, Any] | None, list[str]]:
    """One log line: (the event, or None when the line is not one; what was wrong, one phrase each)."""
    try:
        event = json.loads(line, parse_constant=_refuse_constant)
    except (ValueError, RecursionError):  # not JSON, not UTF-8, NaN/Infinity, or nested too deep
        return None, [f"not a JSON event ({shown(line.decode('utf-8', 'replace'))})"]
    if not isinstance(event, dict) or not isinstance(event.get("event"), str):
        return None, [f"not an event: {shown(event)}"]
    problems = []
    for name, (check, valid) in FIELDS.get(event["event"], {}).items():
        if name in event and not check(event[name]):
            problems.append(f"the {shown(event['event'], 20)} event's {name!r} is {shown(event.pop(name))}, "
                            f"not {valid}")
    return event, problems


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


class EventTail:
    """Yields the complete lines appended to one log since the last call (a torn last line waits), as
    checked events (``parse_event``); ``problems`` lists what was left out or removed, and why."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self._partial = b""
        self._lines = 0
        self.problems: list[str] = []
        self.problem_count = 0

    def read_new(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as file:
                file.seek(self._offset)
                data = file.read()
        except FileNotFoundError:
            return []
        except OSError as exc:  # a directory in its place, no permission: named once, read as empty
            if not self.problem_count:
                self._note(f"{self.path.name} cannot be read ({exc.strerror})")
            return []
        self._offset += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        events = []
        for line in lines:
            self._lines += 1
            if not line.strip():
                continue
            event, problems = parse_event(line)
            for problem in problems:
                self._note(f"{self.path.name} line {self._lines}: {problem}")
            if event is not None:
                events.append(event)
        return events

    def cut_off(self) -> bool:
        """Does the log end in a line without its newline (a file cut short, or a peer killed mid-line)?"""
        return bool(self._partial.strip())

    def _note(self, problem: str) -> None:
        self.problem_count += 1
        if self.problem_count <= MAX_PROBLEMS:
            self.problems.append(problem)


def read_events(path: Path) -> list[dict[str, Any]]:
    return read_log(path)[0]


def read_log(path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """A whole log, once its writer is gone: its checked events and what was wrong with it (a missing file
    reads as no events, and is named)."""
    if not path.exists():
        return [], [f"{path.name} is missing"]
    tail = EventTail(path)
    events = tail.read_new()
    problems = tail.problems
    if tail.problem_count > MAX_PROBLEMS:
        problems.append(f"{path.name}: {tail.problem_count - MAX_PROBLEMS} more such lines")
    if tail.cut_off():
        problems.append(f"{path.name} ends in a cut-off line (the file was cut short)")
    return events, problems
