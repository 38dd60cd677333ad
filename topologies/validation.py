"""Checking what callers hand the topology layer: spec arguments, sizes, ranks, rounds.

Shape-style spec arguments (``torus:2x4``) are parsed by the topology that takes them.
"""

from __future__ import annotations

import numbers
import operator
import re

from .errors import ConfigError

# Plain decimal integers only: int() would also accept "1_000" or " 3", which are more likely typos.
_INTEGER = re.compile(r"[+-]?\d+")


def parse_int_args(name: str, args: str, allowed: tuple[str, ...]) -> dict[str, int]:
    """Parse ``args`` (the text after ``name:``) into integers, accepting only the keys in ``allowed``."""
    if not args.strip():
        return {}
    if not allowed:
        raise ConfigError(f"{name} takes no arguments, got '{name}:{args}'; write just '{name}'")
    example = f"{name}:" + ",".join(f"{key}=<int>" for key in allowed)
    parsed: dict[str, int] = {}
    for item in args.split(","):
        key, sep, value = (part.strip() for part in item.partition("="))
        if not sep or not key:
            raise ConfigError(f"malformed topology spec '{name}:{args}': '{item.strip()}' is not key=value; "
                              f"write {example}")
        if key not in allowed:
            raise ConfigError(f"{name} does not take '{key}'; it takes {', '.join(allowed)}")
        if key in parsed:
            raise ConfigError(f"{name}:{key} is given twice in '{name}:{args}'; give each key once")
        if not _INTEGER.fullmatch(value):
            raise ConfigError(f"{name}:{key}={value}: '{value}' is not an integer; write {example}")
        parsed[key] = int(value)
    return parsed


def check_world_size(name: str, world_size: object) -> int:
    if isinstance(world_size, bool) or not isinstance(world_size, numbers.Integral):
        raise ConfigError(f"{name} needs an integer number of nodes, got {world_size!r}")
    if world_size < 2:
        raise ConfigError(f"{name} needs at least 2 nodes, got {world_size}")
    return int(world_size)


def check_rank(rank: object, spec: str, world_size: int) -> int:
    if type(rank) is int and 0 <= rank < world_size:  # the common case, without the ABC check
        return rank
    if isinstance(rank, bool) or not isinstance(rank, numbers.Integral) or not 0 <= rank < world_size:
        raise ConfigError(f"rank {rank!r} is out of range for {spec} with {world_size} nodes; use 0..{world_size - 1}")
    return int(rank)


def check_round(round: object) -> int:
    if type(round) is int and round >= 0:
        return round
    try:
        index = operator.index(round)  # accepts numpy integers, rejects floats and strings
    except TypeError:
        raise ConfigError(f"round must be a non-negative integer, got {round!r}") from None
    if isinstance(round, bool) or index < 0:
        raise ConfigError(f"round must be a non-negative integer, got {round!r}")
    return index
