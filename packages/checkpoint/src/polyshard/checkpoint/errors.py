"""The one error of polyshard.checkpoint (here so that every module can raise it without import cycles)."""


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete or corrupt, or a destination we refuse to write; the
    message names the file."""
