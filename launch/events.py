"""Reading the peers' ``peer-<rank>.jsonl`` event logs, whole or incrementally while they grow."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class EventTail:
    """Yields the complete lines appended to one log since the last call (a torn last line waits)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self._partial = b""

    def read_new(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as file:
                file.seek(self._offset)
                data = file.read()
        except FileNotFoundError:
            return []
        self._offset += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        return [_parse(line) for line in lines if line.strip()]


def read_events(path: Path) -> list[dict[str, Any]]:
    return EventTail(path).read_new()


def _parse(line: bytes) -> dict[str, Any]:
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        return {"event": "unreadable", "line": line[:200].decode("utf-8", "replace")}
