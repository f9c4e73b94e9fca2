"""A byte ledger: count calls and bytes per collective and per group.

Every wrapper in :mod:`polyshard.collectives.ops` (and so every autograd
collective and p2p helper) reports to the ledgers that are open on this
process. Two figures are kept per (op, group):

* ``bytes``: the buffer size nccl-tests calls "size" — the tensor for
  all-reduce/broadcast/send/recv, the *output* for all-gather, the *input*
  for reduce-scatter and all-to-all.
* ``wire_bytes``: what this rank sends under the ring algorithm —
  all-reduce 2(n-1)/n x size, all-gather and reduce-scatter (n-1)/n x size,
  all-to-all the exact bytes addressed to other ranks, send the tensor.

Usage::

    with CommLedger() as ledger:
        loss.backward()
    ledger.total("all_reduce")            # bytes over every group
    ledger.summary()                      # printable table
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from polyshard.collectives.flight import group_ranks, note

__all__ = ["CommLedger", "LedgerEntry", "bus_factor", "group_ranks", "record", "ring_wire_bytes"]

_ACTIVE: list[CommLedger] = []

GroupFilter = dist.ProcessGroup | tuple[int, ...] | None
"""Which entries a query sums: those of a group, of a tuple of global ranks, or of every group (None)."""


@dataclass
class LedgerEntry:
    calls: int = 0
    bytes: int = 0
    wire_bytes: float = 0.0


class CommLedger:
    """Context manager that records communication while it is open."""

    def __init__(self) -> None:
        self.entries: dict[tuple[str, tuple[int, ...]], LedgerEntry] = {}

    def __enter__(self) -> CommLedger:
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _ACTIVE.remove(self)

    def _add(self, op: str, ranks: tuple[int, ...], nbytes: int, wire_bytes: float) -> None:
        entry = self.entries.setdefault((op, ranks), LedgerEntry())
        entry.calls += 1
        entry.bytes += nbytes
        entry.wire_bytes += wire_bytes

    def _select(self, op: str | None, group: GroupFilter) -> list[LedgerEntry]:
        ranks = None if group is None else (group if isinstance(group, tuple) else group_ranks(group))
        return [e for (o, r), e in self.entries.items() if (op is None or o == op) and (ranks is None or r == ranks)]

    def calls(self, op: str | None = None, group: GroupFilter = None) -> int:
        return sum(e.calls for e in self._select(op, group))

    def total(self, op: str | None = None, group: GroupFilter = None) -> int:
        """Sum of ``bytes`` for ``op`` (all ops when None) on ``group`` (all groups when None)."""
        return sum(e.bytes for e in self._select(op, group))

    def wire(self, op: str | None = None, group: GroupFilter = None) -> float:
        """Sum of ``wire_bytes`` (bytes this rank sends under the ring algorithm)."""
        return sum(e.wire_bytes for e in self._select(op, group))

    def summary(self) -> str:
        lines = [f"{'op':<16}{'group':<24}{'calls':>7}{'bytes':>14}{'wire bytes':>14}"]
        for (op, ranks), e in sorted(self.entries.items()):
            lines.append(f"{op:<16}{str(list(ranks)):<24}{e.calls:>7}{e.bytes:>14}{e.wire_bytes:>14.0f}")
        return "\n".join(lines)


def bus_factor(op: str, n: int) -> float:
    """Bytes one rank sends per byte of buffer for ``op`` on ``n`` ranks with ring algorithms: 2(n-1)/n
    for all-reduce, (n-1)/n for all-gather, reduce-scatter and an even all-to-all, 1 otherwise. The
    same factor turns a benchmark's algorithm bandwidth into bus bandwidth (as nccl-tests report it)."""
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0


def ring_wire_bytes(op: str, nbytes: int, n: int) -> float:
    """Bytes one rank sends for ``op`` of buffer size ``nbytes`` on ``n`` ranks (ring)."""
    return bus_factor(op, n) * nbytes


def record(
    op: str, group: dist.ProcessGroup | None, nbytes: int, wire_bytes: float | None = None, peer: int | None = None
) -> None:
    """Report one call to every open ledger (cheap when none is open) and to the flight recorder."""
    note(op, group, peer)
    if not _ACTIVE:
        return
    ranks = group_ranks(group)
    if wire_bytes is None:
        wire_bytes = ring_wire_bytes(op, nbytes, len(ranks))
    for ledger in _ACTIVE:
        ledger._add(op, ranks, nbytes, wire_bytes)
