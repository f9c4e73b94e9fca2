"""Per-data-rank batches with a seeded shuffle and a position that can be saved.

The *global* batch of each step does not depend on the layout: every epoch
the whole training set is permuted with ``seed + epoch`` and cut into global
batches of ``batch_size x world_size`` examples. Each data rank (a dp x ep
coordinate) then takes its own contiguous part of that global batch with
``datasets.distributed.split_dataset_by_node``. So one process and eight see
the same examples in each step, which is what makes their losses comparable.
``state_dict()`` records (epoch, position) so a resumed run continues with
exactly the batches it would have seen.
"""

from __future__ import annotations

from collections.abc import Iterator

import datasets
import torch
from datasets.distributed import split_dataset_by_node

from polyshard.trainer.errors import DataError


class ShardedLoader:
    def __init__(
        self, dataset: datasets.Dataset, *, batch_size: int, rank: int, world_size: int, seed: int, shuffle: bool
    ):
        self.dataset = dataset
        self.global_batch = batch_size * world_size
        if len(dataset) < self.global_batch:
            raise DataError(
                f"the dataset holds {len(dataset)} examples, fewer than one global batch of {self.global_batch} "
                f"({world_size} data ranks x {batch_size}); use more data or a smaller batch"
            )
        self.rank, self.world_size, self.seed, self.shuffle = rank, world_size, seed, shuffle
        self.epoch, self.position = 0, 0
        self._order = self._permutation()

    def _permutation(self) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(len(self.dataset))
        return torch.randperm(len(self.dataset), generator=torch.Generator().manual_seed(self.seed + self.epoch))

    def next_batch(self) -> dict[str, torch.Tensor]:
        """This data rank's part of the next global batch; an epoch ends when less than a global batch remains."""
        if self.position + self.global_batch > len(self._order):
            self.epoch, self.position = self.epoch + 1, 0
            self._order = self._permutation()
        indices = self._order[self.position : self.position + self.global_batch].tolist()
        self.position += self.global_batch
        part = split_dataset_by_node(self.dataset.select(indices), rank=self.rank, world_size=self.world_size)
        return part.with_format("torch")[:]  # type: ignore[no-any-return]  # datasets is untyped

    def in_order(self, limit: int | None = None) -> Iterator[dict[str, torch.Tensor]]:
        """This data rank's part of each global batch of the dataset, unshuffled, the last batch partial;
        at most ``limit`` batches (None: the whole dataset). A part may hold no examples (zero rows):
        its rank still runs, so collectives inside the model (expert all-to-alls) stay matched."""
        for number, start in enumerate(range(0, len(self.dataset), self.global_batch)):
            if limit is not None and number >= limit:
                return
            size = min(self.global_batch, len(self.dataset) - start)
            # split_dataset_by_node's contiguous split, which it refuses when ranks outnumber examples
            base, extra = divmod(size, self.world_size)
            first = start + base * self.rank + min(self.rank, extra)
            count = base + (1 if self.rank < extra else 0)
            rows = self.dataset.select(range(first, first + count) if count else [0]).with_format("torch")[:]
            yield {k: v[:count] for k, v in rows.items()}

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._permutation()
