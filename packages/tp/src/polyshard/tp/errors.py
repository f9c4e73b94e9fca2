"""Typed errors of polyshard.tp. Each message says what was wrong and what would work."""


class TPError(ValueError):
    """A tensor-parallel request that cannot be satisfied (shapes, sizes, options)."""


class TPShapeError(TPError):
    """A dim or head count that the tensor-parallel size does not divide."""


class PlanError(TPError):
    """A ``parallelize`` plan that does not fit the model it is applied to."""
