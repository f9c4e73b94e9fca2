"""polyshard.mesh: N-D device mesh, process groups, placements and launch."""

from polyshard.mesh.errors import DistributedInitError, MeshError, PlacementError
from polyshard.mesh.init import DistributedContext, default_backend, init_distributed
from polyshard.mesh.layout import MeshLayout, divisors
from polyshard.mesh.mesh import Mesh, SubMesh
from polyshard.mesh.placement import (
    Placement,
    Replicate,
    Shard,
    TensorPlacement,
    get_placement,
    set_placement,
    shard_tensor,
)

__all__ = [
    "DistributedContext",
    "DistributedInitError",
    "Mesh",
    "MeshError",
    "MeshLayout",
    "Placement",
    "PlacementError",
    "Replicate",
    "Shard",
    "SubMesh",
    "TensorPlacement",
    "default_backend",
    "divisors",
    "get_placement",
    "init_distributed",
    "set_placement",
    "shard_tensor",
]
