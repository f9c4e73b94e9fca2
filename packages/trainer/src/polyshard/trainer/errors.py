"""Typed errors of polyshard.trainer."""


class ConfigError(ValueError):
    """A config that cannot run; the message names the field and says what would work."""
