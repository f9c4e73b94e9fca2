"""Typed errors of polyshard.ep. Each message says what was wrong and what would work."""

from polyshard.mesh import divisors


class ExpertParallelError(ValueError):
    """Expert parallelism asked for on a group or module it cannot shard."""


def check_ep_size(num_experts: int, ep: int) -> None:
    """Raise :class:`ExpertParallelError` unless ``ep`` ranks can own equal slices of ``num_experts``."""
    if ep < 1 or num_experts % ep:
        choices = ", ".join(str(d) for d in divisors(num_experts))
        raise ExpertParallelError(
            f"ep={ep} does not divide num_experts={num_experts}; each rank must own the same number "
            f"of experts, so choose ep in {{{choices}}} (or change num_experts to a multiple of {ep})"
        )
