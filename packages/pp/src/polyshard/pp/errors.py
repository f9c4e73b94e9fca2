"""Typed errors of polyshard.pp; each message says what was wrong and what would work."""


class PartitionError(ValueError):
    """Layers cannot be split into the requested stages (e.g. more stages than layers)."""


class ScheduleError(ValueError):
    """A schedule was asked for with arguments it cannot honour (e.g. m not a multiple of p)."""


class DeadlockError(RuntimeError):
    """The simulator found ranks that wait forever; the message names rank and action and shows the grid."""

    def __init__(self, message: str, rank: int, action: str, grid: str):
        super().__init__(f"{message}\n{grid}")
        self.rank = rank
        self.action = action
        self.grid = grid


class StageShapeError(ValueError):
    """A stage cannot take the output of the stage before it (or the microbatch cannot be split)."""
