"""Name -> Topology class registry, and ``build`` for specs such as ``ring`` or ``torus:2x4``.

Spec grammar: ``name`` or ``name:args``, where args are a shape ``RxC`` (torus) or comma-separated
``key=value`` pairs with integer values (``random:degree=4,seed=1``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TypeVar

from .base import Topology
from .errors import ConfigError

TopologyClass = TypeVar("TopologyClass", bound=type[Topology])

_NAME = re.compile(r"[a-z][a-z0-9_-]*")  # lowercase, no ':' or ',' so specs stay unambiguous
_TOPOLOGIES: dict[str, type[Topology]] = {}
_SPEC_EXAMPLES = "e.g. ring, torus:2x4 or random:degree=3,seed=0"


def register(name: str) -> Callable[[TopologyClass], TopologyClass]:
    """Class decorator: make ``cls`` buildable as ``name`` (and set ``cls.name``)."""
    if not _NAME.fullmatch(name):
        raise ValueError(f"topology name {name!r} must be lowercase letters, digits, '-' or '_'")

    def decorate(cls: TopologyClass) -> TopologyClass:
        taken = _TOPOLOGIES.get(name)
        # Re-registering the same class (a module reload) is fine; two classes sharing a name is not.
        if taken is not None and (taken.__module__, taken.__qualname__) != (cls.__module__, cls.__qualname__):
            raise ValueError(f"topology name {name!r} is already taken by {taken.__module__}.{taken.__qualname__}")
        cls.name = name
        _TOPOLOGIES[name] = cls
        return cls

    return decorate


def names() -> list[str]:
    """Registered topology names, sorted."""
    return sorted(_TOPOLOGIES)


def build(spec: str, world_size: int) -> Topology:
    """The topology that ``spec`` describes over ``world_size`` ranks; ConfigError when invalid."""
    if not isinstance(spec, str):
        raise ConfigError(f"a topology spec must be a string, {_SPEC_EXAMPLES}; got {spec!r}")
    name, sep, args = (part.strip() for part in spec.partition(":"))
    if not name or (sep and not args):
        raise ConfigError(f"malformed topology spec {spec!r}; write name or name:args, {_SPEC_EXAMPLES}")
    topology_class = _TOPOLOGIES.get(name)
    if topology_class is None:
        raise ConfigError(f"unknown topology '{name}'; choose one of: {', '.join(names())}")
    return topology_class.from_spec(args, world_size)
