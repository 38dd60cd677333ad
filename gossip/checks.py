"""The checks every configuration dataclass runs on its fields: each refuses a bad value with one
``ConfigError`` line that names the flag the user typed (``flag_of``) and what would be valid."""

from __future__ import annotations

import math
from typing import Any

from gossip.errors import ConfigError

# The longest wait a flag may ask for. Timeouts and sleeps end in threading, asyncio, time.sleep and
# ZeroMQ, which refuse waits beyond their own limits (about 9.2e9 s, or 2^31 ms) with an OverflowError.
MAX_WAIT_SECONDS = 604800.0  # one week


def flag_of(name: str) -> str:
    """The launcher flag that sets field ``name`` (messages name what the user typed)."""
    return {"world_size": "--nodes", "peer_speeds": "--speeds"}.get(name, "--" + name.replace("_", "-"))


def check_int(obj: Any, name: str, *, minimum: int, maximum: int | None = None, flag: str = "") -> None:
    value = getattr(obj, name)
    flag = flag or flag_of(name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{flag} must be an integer, got {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"in {minimum}..{maximum}"
        raise ConfigError(f"{flag} must be {bound}, got {value}")


def check_bool(obj: Any, *names: str) -> None:
    for name in names:
        if not isinstance(getattr(obj, name), bool):
            raise ConfigError(f"{name} must be True or False, got {getattr(obj, name)!r}")


def check_choice(obj: Any, name: str, choices: tuple[str, ...]) -> None:
    value = getattr(obj, name)
    if value not in choices:
        raise ConfigError(f"{flag_of(name)} {value!r} is not valid; choose one of: {', '.join(choices)}")


def check_per_peer(obj: Any, name: str, peers: int, valid: Any, what: str) -> None:
    """A per-peer list: empty, or one value per peer of ``peers``, each passing ``valid``."""
    values = getattr(obj, name)
    if not values:
        return
    if len(values) != peers:
        raise ConfigError(f"{flag_of(name)} lists {len(values)} values for {peers} peers; give one per peer")
    bad = [v for v in values if not (is_real(v) and valid(v))]
    if bad:
        raise ConfigError(f"{flag_of(name)} must be {what}; got {bad[0]!r}")


def check_auto_number(obj: Any, name: str, valid: Any, what: str) -> None:
    """A field that is "auto" or a number (a numeric string, as a flag gives it, becomes a float)."""
    value = getattr(obj, name)
    if isinstance(value, str) and value.strip().lower() != "auto":
        try:
            value = float(value)
        except ValueError:
            pass
    elif isinstance(value, str):
        value = "auto"
    elif isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if value != "auto" and not (is_real(value) and valid(value)):
        raise ConfigError(f"{flag_of(name)} must be auto or a number {what}, got {getattr(obj, name)!r}")
    object.__setattr__(obj, name, value)


def check_positive(obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not (is_real(value) and value > 0):
            raise ConfigError(f"{flag_of(name)} must be a positive number, got {value!r}")


def check_seconds(obj: Any, *names: str, limit: float = MAX_WAIT_SECONDS, why: str = "one week") -> None:
    """Fields that become a timeout or a sleep: finite, > 0 and at most ``limit`` seconds."""
    for name in names:
        value = getattr(obj, name)
        if not (is_real(value) and 0 < value <= limit):
            raise ConfigError(f"{flag_of(name)} must be a positive number of seconds up to {limit:g} ({why}), "
                              f"got {value!r}")


def is_real(value: Any) -> bool:
    # Comparing a str raises TypeError instead of a ConfigError; bool is an int to Python but no sensible size.
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
