"""The one error the topology layer raises.

``gossip.errors.ConfigError`` subclasses this class, so ``except topologies.ConfigError`` catches
configuration errors from both layers while ``topologies`` stays free of any ``gossip`` import.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A topology spec or size is invalid; the message says what would be valid."""
