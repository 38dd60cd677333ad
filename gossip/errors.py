"""The project's exception tree, in one place.

    GossipError
    ├── ConfigError (also a topologies.ConfigError, hence a ValueError)  bad flags, specs, config values
    ├── ProtocolError                                                      a malformed or hostile message
    ├── TaskError                                                          a task that cannot be built or run
    ├── Stopped                                                            SIGINT or SIGTERM asked us to stop
    ├── Diverged                                                           a model went NaN/Inf or blew up
    ├── PeerFailed                                                         another peer stopped the run
    ├── CheckpointError                                                    a checkpoint not written or not readable
    └── TransportError                                                     the network failed us
        ├── PeerTimeout                                                    a named wait ran out
        └── PeerUnreachable                                                a socket could not bind/connect/send

Lower-level errors (``zmq.ZMQError``, ``msgpack`` exceptions, ``OSError``) are translated into this tree
at the boundary where they happen (``raise ... from exc``), so callers never handle library exceptions.
``topologies`` sits below ``gossip`` and cannot import it; it raises its own ``topologies.ConfigError``,
which this ``ConfigError`` subclasses, so ``except topologies.ConfigError`` catches both.
"""

from __future__ import annotations

import signal

import topologies


class GossipError(Exception):
    """Base of every error this project raises on purpose."""


class ConfigError(GossipError, topologies.ConfigError):
    """A configuration value, flag or spec is invalid; the message says what would be valid."""


class TaskError(GossipError):
    """A task (built-in or ``package.module:function``) could not be loaded or run."""


class Stopped(GossipError):
    """SIGINT or SIGTERM arrived; ``signum`` gives the exit status 128 + signum."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Diverged(GossipError):
    """The model a run trains holds NaN or Inf, or has blown up (``gossip/health.py``); the message says
    where it was found and what to lower."""


class PeerFailed(GossipError):
    """Another peer stopped on an error and told us why (an "abort" message, or a model layout unlike
    ours); the message is that reason, which names the peer."""


class CheckpointError(GossipError):
    """A checkpoint could not be written or read; the message says which file and why."""


class ProtocolError(GossipError):
    """A message failed validation. ``reason`` is a short machine-readable kind used for drop counts;
    ``sender`` and ``layout``: the rank and the model layout fingerprint the message claims, where the check
    that failed is that its model's layout is unlike ours."""

    def __init__(self, reason: str, message: str, sender: int | None = None, layout: str = "") -> None:
        super().__init__(message)
        self.reason = reason
        self.sender = sender
        self.layout = layout


class TransportError(GossipError):
    """A network operation failed."""


class PeerTimeout(TransportError):
    """A named wait (``round_timeout``, ``startup_timeout``, ...) ran out."""


class PeerUnreachable(TransportError):
    """A socket could not bind, connect or deliver."""
