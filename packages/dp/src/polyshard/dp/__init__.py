"""polyshard.dp: bucketed overlapped data parallelism, ZeRO-1/2/3, mixed precision and the Muon optimizer."""

from polyshard.dp.data_parallel import DataParallel, ParamSet
from polyshard.dp.errors import DataParallelError, GradSyncError, ParameterMismatchError, UnownedParameterError
from polyshard.dp.flat import ShardSpec, shard_record
from polyshard.dp.fully_sharded import FullyShardedDataParallel
from polyshard.dp.memory import MemoryReport, bytes_held, storage_bytes
from polyshard.dp.mixed_precision import MixedPrecision
from polyshard.dp.muon import MOMENTUM, Muon, matrix_axes
from polyshard.dp.newton_schulz import orthogonalise, shape_scale
from polyshard.dp.wrapper import DataParallelWrapper
from polyshard.dp.zero_optimizer import ZeroOptimizer

__all__ = [
    "DataParallel",
    "DataParallelError",
    "DataParallelWrapper",
    "FullyShardedDataParallel",
    "GradSyncError",
    "MOMENTUM",
    "MemoryReport",
    "MixedPrecision",
    "Muon",
    "ParamSet",
    "ParameterMismatchError",
    "ShardSpec",
    "UnownedParameterError",
    "ZeroOptimizer",
    "bytes_held",
    "matrix_axes",
    "orthogonalise",
    "shape_scale",
    "shard_record",
    "storage_bytes",
]
