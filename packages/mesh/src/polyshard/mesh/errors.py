"""Typed errors of polyshard.mesh. Each message says what was expected."""


class MeshError(ValueError):
    """A mesh, axis or group request that cannot be satisfied."""


class DistributedInitError(RuntimeError):
    """torch.distributed could not be started as asked."""


class PlacementError(ValueError):
    """A placement record that does not fit the tensor or mesh it describes."""
