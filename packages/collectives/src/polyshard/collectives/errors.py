"""Typed errors of polyshard.collectives."""


class CollectiveError(ValueError):
    """A collective asked for with shapes or sizes that cannot work; the message says what would."""
