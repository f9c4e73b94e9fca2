"""Per-data-rank batches with a seeded shuffle and a position that can be saved.

Every data rank (a dp x ep coordinate) takes its own shard of the training
set with ``datasets.distributed.split_dataset_by_node``. Each epoch the shard
is permuted with ``seed + epoch``; ``state_dict()`` records (epoch, position)
so a resumed run continues with exactly the batches it would have seen.
"""

from __future__ import annotations

import datasets
import torch
from datasets.distributed import split_dataset_by_node

from polyshard.trainer.errors import DataError


class ShardedLoader:
    def __init__(
        self, dataset: datasets.Dataset, *, batch_size: int, rank: int, world_size: int, seed: int, shuffle: bool
    ):
        self.shard = split_dataset_by_node(dataset, rank=rank, world_size=world_size).with_format("torch")
        if len(self.shard) < batch_size:
            raise DataError(
                f"data rank {rank} holds {len(self.shard)} examples, fewer than one batch of {batch_size}; "
                "use more data, fewer data ranks or a smaller batch"
            )
        self.batch_size, self.seed, self.shuffle = batch_size, seed, shuffle
        self.epoch, self.position = 0, 0
        self._order = self._permutation()

    def _permutation(self) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(len(self.shard))
        return torch.randperm(len(self.shard), generator=torch.Generator().manual_seed(self.seed + self.epoch))

    def next_batch(self) -> dict[str, torch.Tensor]:
        """The next ``batch_size`` examples; an epoch ends when fewer than a batch remain."""
        if self.position + self.batch_size > len(self._order):
            self.epoch, self.position = self.epoch + 1, 0
            self._order = self._permutation()
        indices = self._order[self.position : self.position + self.batch_size]
        self.position += self.batch_size
        return self.shard[indices.tolist()]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._permutation()
