"""Per-data-rank batches of a global order that does not depend on the layout, with a position that
can be saved.

Every step draws one *global* batch of ``batch_size x world_size`` examples; each data rank (a dp x ep
coordinate) takes its own contiguous part of it and reads only those rows. So one process and eight
see the same examples in each step, which is what makes their losses comparable, and a checkpoint's
data position means the same on any layout.

One source: every epoch visits the examples in the order of a seeded :class:`~polyshard.data.order.Permutation`
(``seed``, epoch) and cuts it into global batches; an epoch ends when less than a global batch remains.
The state is (epoch, position).

Several sources with weights (a mixture): the slots of the global batches are dealt to the sources
by smooth weighted round robin (slot ``t`` goes to the source furthest behind its share ``(t + 1) w_i``),
so every global batch holds each source in proportion, within one example, and the realised shares
converge to the weights. Each source is an endless stream of its own epochs, each in its own seeded
order; the state is how many examples each source has given.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from polyshard.data.errors import DataError
from polyshard.data.examples import Examples, Rows, merge
from polyshard.data.order import Permutation


def _rank_part(size: int, rank: int, world_size: int) -> tuple[int, int]:
    """``[lo, hi)`` of a batch of ``size`` examples that data rank ``rank`` takes: contiguous, the first
    ``size % world_size`` ranks one more."""
    base, extra = divmod(size, world_size)
    lo = base * rank + min(rank, extra)
    return lo, lo + base + (1 if rank < extra else 0)


class ShardedLoader:
    def __init__(
        self,
        sources: Examples | Sequence[Examples],
        *,
        batch_size: int,
        rank: int,
        world_size: int,
        seed: int,
        shuffle: bool,
        weights: Sequence[float] | None = None,
        names: Sequence[str] | None = None,
    ):
        self.sources = list(sources) if isinstance(sources, Sequence) else [sources]
        raw = np.asarray(weights if weights is not None else [1.0] * len(self.sources), dtype=np.float64)
        if len(raw) != len(self.sources) or not (np.isfinite(raw).all() and (raw > 0).all()):
            raise DataError(f"mixture weights {raw.tolist()}: give one positive finite weight per source")
        self.weights = raw / raw.max() / (raw / raw.max()).sum()  # divided by the largest first: no sum overflows
        self.names = list(names) if names is not None else [str(i) for i in range(len(self.sources))]
        self.global_batch = batch_size * world_size
        self.rank, self.world_size, self.seed, self.shuffle = rank, world_size, seed, shuffle
        for name, source in zip(self.names, self.sources):
            if not len(source):
                raise DataError(f"the dataset {name} holds no examples; use more data or a shorter context")
        self.epoch, self.position = 0, 0
        self.consumed = [0] * len(self.sources)  # a mixture's state: examples each source has given
        self.drawn = np.zeros(len(self.sources), dtype=np.int64)  # since this loader started, for the log

    def _order(self, source: int, epoch: int, positions: np.ndarray) -> np.ndarray:
        if not self.shuffle:
            return positions
        seed = self.seed if len(self.sources) == 1 else self.seed + (source << 32)
        return Permutation(len(self.sources[source]), seed, epoch)[positions]

    def _global_batch(self) -> list[tuple[int, int]]:
        """(source, example) of each slot of the next global batch, advancing the state."""
        if len(self.sources) == 1:
            n = len(self.sources[0])
            if n < self.global_batch:  # evaluation (in_order) takes any number; training needs a whole batch
                raise DataError(
                    f"the dataset holds {n} examples, fewer than one global batch of {self.global_batch} "
                    f"({self.world_size} data ranks x {self.global_batch // self.world_size}); use more data or "
                    "a smaller batch"
                )
            if self.position + self.global_batch > n:
                self.epoch, self.position = self.epoch + 1, 0
            ids = self._order(0, self.epoch, np.arange(self.position, self.position + self.global_batch))
            self.position += self.global_batch
            return [(0, int(i)) for i in ids]
        weights, consumed = self.weights.tolist(), list(self.consumed)
        owners = []
        for t in range(sum(consumed), sum(consumed) + self.global_batch):
            behind = [(t + 1) * w - c for w, c in zip(weights, consumed)]
            source = behind.index(max(behind))  # the first of equals: deterministic
            owners.append(source)
            consumed[source] += 1
        slots: list[tuple[int, int]] = [(s, 0) for s in owners]
        for source in set(owners):
            where = [j for j, s in enumerate(owners) if s == source]
            stream = np.arange(self.consumed[source], consumed[source])  # this source's next examples
            n = len(self.sources[source])
            ids = np.empty(len(stream), np.int64)
            for epoch in np.unique(stream // n):  # one order per epoch the batch touches
                inside = stream // n == epoch
                ids[inside] = self._order(source, int(epoch), stream[inside] % n)
            for j, example in zip(where, ids.tolist()):
                slots[j] = (source, example)
        self.consumed = consumed
        return slots

    def next_batch(self) -> Rows:
        """This data rank's part of the next global batch."""
        slots = self._global_batch()
        for source, _ in slots:
            self.drawn[source] += 1
        lo, hi = _rank_part(len(slots), self.rank, self.world_size)
        return self._read(slots[lo:hi])

    def _read(self, slots: list[tuple[int, int]]) -> Rows:
        if len(self.sources) == 1:
            return self.sources[0].rows(np.asarray([i for _, i in slots], dtype=np.int64))
        parts: list[tuple[np.ndarray | list[int], Rows]] = []
        for source in sorted({s for s, _ in slots}):
            where = [j for j, (s, _) in enumerate(slots) if s == source]
            parts.append((where, self.sources[source].rows(np.asarray([slots[j][1] for j in where], np.int64))))
        return merge(parts, len(slots))

    def in_order(self, limit: int | None = None) -> Iterator[Rows]:
        """This data rank's part of each global batch of the (first) source, unshuffled, the last batch
        partial; at most ``limit`` batches (None: all). A part may hold no examples (zero rows): its rank
        still runs, so collectives inside the model (expert all-to-alls) stay matched."""
        examples = self.sources[0]
        for number, start in enumerate(range(0, len(examples), self.global_batch)):
            if limit is not None and number >= limit:
                return
            size = min(self.global_batch, len(examples) - start)
            lo, hi = _rank_part(size, self.rank, self.world_size)
            if hi > lo:
                yield examples.rows(np.arange(start + lo, start + hi, dtype=np.int64))
            else:
                rows = examples.rows(np.arange(start, start + 1, dtype=np.int64))
                yield {k: v[:0] for k, v in rows.items()}

    def shares(self) -> dict[str, float]:
        """The share of the examples drawn since start that came from each source."""
        total = max(int(self.drawn.sum()), 1)
        return {name: float(d) / total for name, d in zip(self.names, self.drawn)}

    def state_dict(self) -> dict[str, int | list[int]]:
        if len(self.sources) == 1:
            return {"epoch": self.epoch, "position": self.position}
        return {"consumed": list(self.consumed)}

    def load_state_dict(self, state: dict[str, int | list[int]]) -> None:
        if len(self.sources) == 1:
            if "epoch" not in state:
                raise DataError("the checkpoint's data position is a mixture's; the run reads one source")
            self.epoch, self.position = int(state["epoch"]), int(state["position"])  # type: ignore[arg-type]
            return
        consumed = state.get("consumed")
        if not isinstance(consumed, list) or len(consumed) != len(self.sources):
            raise DataError(
                f"the checkpoint's data position is for {len(consumed) if isinstance(consumed, list) else 1} "
                f"source(s), the run mixes {len(self.sources)}; resume with the same data.sources"
            )
        self.consumed = [int(c) for c in consumed]
