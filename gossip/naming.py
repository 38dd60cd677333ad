"""Errors name what the user typed: the launcher's flags (``--base-port``) on the command line, the keyword
arguments of ``gossip.attach`` (``base_port``) in a library user's program. Messages are written with the
flags; ``as_keywords`` rewrites one for a library user."""

from __future__ import annotations

import dataclasses
import re

from gossip.config import GOSSIP_FIELDS, CoordinatorConfig

_FLAG = re.compile(r"(?<![\w-])--(no-)?([a-z][a-z0-9-]*)")
# flags whose setting a library user makes under another name
_RENAMED = {"nodes": "world_size", "rendezvous_timeout": "startup_timeout"}
_FIELDS = frozenset(GOSSIP_FIELDS) | frozenset(f.name for f in dataclasses.fields(CoordinatorConfig))


def as_keywords(text: str) -> str:
    """``text`` with every flag that is a keyword argument of ``attach`` written as one (``--no-overlap``:
    ``overlap=False``); other flags, which a library user has no equivalent of, are left as they are."""

    def keyword(match: re.Match[str]) -> str:
        negated, name = match.group(1), match.group(2).replace("-", "_")
        name = _RENAMED.get(name, name)
        if name not in _FIELDS:
            return match.group(0)
        return f"{name}=False" if negated else name

    return _FLAG.sub(keyword, text)
