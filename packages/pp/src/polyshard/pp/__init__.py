"""polyshard.pp: pipeline parallelism - partitioning, schedules as data, a simulator and one executor.

stages = build_stages(layer_builders, num_stages=p, stages=[rank])   # only this rank's layers
schedule = make_schedule("1f1b", p, num_microbatches=8)     # or "zb-v", "dualpipev": two stages per rank in a V
print(simulate(schedule).bubble_fraction)   # (p-1)/(m+p-1) = 3/11 for p=4, m=8, before any tensor moves
result = PipelineExecutor(stages, schedule, loss_fn, pp_group).step(inputs, targets)
"""

from polyshard.pp.actions import Action, Exchange, Kind, Schedule, Wait, loop_placement, v_placement
from polyshard.pp.dualpipe import dualpipe_v
from polyshard.pp.errors import DeadlockError, PartitionError, ScheduleError, StageShapeError
from polyshard.pp.executor import PipelineExecutor, SideInputs, StepResult, gather_timeline
from polyshard.pp.lowering import format_program, lower
from polyshard.pp.partition import balanced_partition, build_stages, parameter_counts
from polyshard.pp.schedules import SCHEDULES, gpipe, interleaved_1f1b, make_schedule, one_f_one_b
from polyshard.pp.simulator import DEFAULT_COSTS, SimResult, measured_costs, simulate
from polyshard.pp.stage import Stage, accepted_inputs
from polyshard.pp.timeline import Span, Timeline
from polyshard.pp.zero_bubble import zb_h1, zb_v

__all__ = [
    "DEFAULT_COSTS",
    "SCHEDULES",
    "CostFn",
    "Action",
    "DeadlockError",
    "Exchange",
    "Kind",
    "PartitionError",
    "PipelineExecutor",
    "Schedule",
    "ScheduleError",
    "SideInputs",
    "SimResult",
    "Span",
    "Stage",
    "StageShapeError",
    "StepResult",
    "Timeline",
    "Wait",
    "accepted_inputs",
    "balanced_partition",
    "build_stages",
    "dualpipe_v",
    "format_program",
    "gather_timeline",
    "gpipe",
    "interleaved_1f1b",
    "loop_placement",
    "lower",
    "make_schedule",
    "measured_costs",
    "one_f_one_b",
    "parameter_counts",
    "simulate",
    "v_placement",
    "zb_h1",
    "zb_v",
]
