"""polyshard.pp: pipeline parallelism - partitioning, schedules as data, a simulator and one executor.

stages = build_stages(layer_builders, num_stages=p, stages=[rank])   # only this rank's layers
schedule = make_schedule("1f1b", p, num_microbatches=8)
print(simulate(schedule).bubble_fraction)   # (p-1)/(m+p-1) = 3/11 for p=4, m=8, before any tensor moves
result = PipelineExecutor(stages, schedule, loss_fn, pp_group).step(inputs, targets)
"""

from polyshard.pp.actions import Action, Exchange, Schedule
from polyshard.pp.errors import DeadlockError, PartitionError, ScheduleError, StageShapeError
from polyshard.pp.executor import PipelineExecutor, StepResult, gather_timeline
from polyshard.pp.lowering import format_program, lower
from polyshard.pp.partition import balanced_partition, build_stages, parameter_counts
from polyshard.pp.schedules import SCHEDULES, gpipe, interleaved_1f1b, make_schedule, one_f_one_b, zb_h1
from polyshard.pp.simulator import DEFAULT_COSTS, CostFn, SimResult, measured_costs, simulate
from polyshard.pp.timeline import Span, Timeline

__all__ = [
    "DEFAULT_COSTS",
    "SCHEDULES",
    "CostFn",
    "Action",
    "DeadlockError",
    "Exchange",
    "PartitionError",
    "PipelineExecutor",
    "Schedule",
    "ScheduleError",
    "SimResult",
    "Span",
    "StageShapeError",
    "StepResult",
    "Timeline",
    "balanced_partition",
    "build_stages",
    "format_program",
    "gather_timeline",
    "gpipe",
    "interleaved_1f1b",
    "lower",
    "make_schedule",
    "measured_costs",
    "one_f_one_b",
    "parameter_counts",
    "simulate",
    "zb_h1",
]
