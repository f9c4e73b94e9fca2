"""Typed errors of polyshard.cp. Each message says what was wrong and what would work."""

from polyshard.mesh import divisors


class ContextParallelError(ValueError):
    """Context parallelism asked for with a sequence, shapes or options it cannot split."""


def check_sequence_length(seq_len: int, cp: int) -> None:
    """Raise :class:`ContextParallelError` unless ``seq_len`` splits into ``2 * cp`` equal chunks."""
    if cp < 1:
        raise ContextParallelError(f"cp={cp} must be a positive number of ranks")
    chunks = 2 * cp
    if seq_len < 1 or seq_len % chunks:
        padded = max(1, -(-seq_len // chunks)) * chunks
        fits = divisors(seq_len // 2) if seq_len > 0 and seq_len % 2 == 0 else []
        other = f", or choose cp in {{{', '.join(map(str, fits))}}}" if fits else ""
        raise ContextParallelError(
            f"seq_len={seq_len} is not divisible by 2*cp={chunks}: the load-balanced layout cuts the sequence "
            f"into {chunks} equal chunks; pad the sequence to {padded} tokens{other}"
        )
