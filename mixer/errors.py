"""The exception hierarchy. Every error names the thing (source, shard, key, config path) and the rule."""

from __future__ import annotations


class MixerError(Exception):
    """Base class of every error this library raises on purpose."""


class ConfigError(MixerError, ValueError):
    """Invalid configuration, raised at construction time (validate at the door)."""


class ShardError(MixerError):
    """A shard cannot be listed, opened or parsed (missing, truncated, corrupt header)."""


class SampleError(MixerError):
    """A sample inside a readable shard is unusable (no token member, undecodable member)."""


class StateError(MixerError):
    """A saved state does not fit this mixture or this version."""
