"""Typed errors of polyshard.dp: each message says what was wrong and what would work."""


class DataParallelError(ValueError):
    """A wrapper or optimizer was asked for something it cannot do (bad arguments, mismatched models)."""


class ParameterMismatchError(DataParallelError):
    """Ranks of one group hold different parameters (names, shapes or dtypes) at wrap time."""


class UnownedParameterError(DataParallelError):
    """An optimizer holds a parameter that the data-parallel wrapper does not manage."""


class GradSyncError(RuntimeError):
    """Gradient synchronisation was used out of order (e.g. stepping before grads exist)."""
