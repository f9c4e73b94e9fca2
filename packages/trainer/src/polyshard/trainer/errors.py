"""Typed errors of polyshard.trainer (DataError is polyshard.data's and ConfigError polyshard.models',
one class for each)."""

from polyshard.data.errors import DataError
from polyshard.models.errors import ConfigError

__all__ = ["ConfigError", "DataError", "NonFiniteError", "ReplicaMismatchError", "RewardError", "TiedWeightError"]


class TiedWeightError(RuntimeError):
    """A tied weight whose copies cannot be kept equal (one copy got no gradient in a step)."""


class NonFiniteError(RuntimeError):
    """Training met NaN or infinite losses, gradients or weights and stopped; the message says at which
    step and what to change. No checkpoint holds the non-finite values."""


class ReplicaMismatchError(RuntimeError):
    """Data-parallel replicas hold different parameters (silent data corruption); the message names
    the ranks. Raised on every rank of the group at the same step, before anything is saved."""


class RewardError(ConfigError):
    """A reward function named in ``[[grpo.rewards]]`` failed during training: it raised, returned another
    count of values than completions, a non-number or NaN. The message names the function, the step and the
    prompt concerned. A ConfigError (the user's code, not the run's): the run stops with one line, exit 2,
    and the checkpoints already written stay."""
