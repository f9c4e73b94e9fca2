"""Typed errors of polyshard.trainer."""


class ConfigError(ValueError):
    """A config that cannot run; the message names the field and says what would work."""


class DataError(ValueError):
    """Data that cannot be loaded or split as asked; the message says what to use instead."""


class TiedWeightError(RuntimeError):
    """A tied weight whose copies cannot be kept equal (one copy got no gradient in a step)."""


class NonFiniteError(RuntimeError):
    """Training met NaN or infinite losses, gradients or weights and stopped; the message says at which
    step and what to change. No checkpoint holds the non-finite values."""


class ReplicaMismatchError(RuntimeError):
    """Data-parallel replicas hold different parameters (silent data corruption); the message names
    the ranks. Raised on every rank of the group at the same step, before anything is saved."""
