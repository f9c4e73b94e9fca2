"""A candidate layout: how many ranks on each axis, the ZeRO stage, microbatches and schedule.

A :class:`Layout` is the part of a config the planner chooses; :meth:`Layout.apply` writes it into
a :class:`~polyshard.trainer.config.Config`, :meth:`Layout.of` reads it back. Context parallelism
(``cp``) is one more axis: it splits every sequence, so it divides activations and adds K/V ring
traffic, and its ranks replicate the parameters. Configs without a ``cp`` field only take cp = 1.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from polyshard.trainer.config import Config


@dataclass(kw_only=True, frozen=True)
class Layout:
    dp: int = 1
    """Data-parallel replicas (ZeRO shards over them)."""
    tp: int = 1
    """Tensor-parallel ranks (inside a node)."""
    pp: int = 1
    """Pipeline ranks."""
    ep: int = 1
    """Expert-parallel ranks (mixture-of-experts models)."""
    cp: int = 1
    """Context-parallel ranks: each holds 1/cp of every sequence."""
    zero_stage: int = 0
    """0 plain data parallel, 1 optimizer state, 2 + gradients, 3 + parameters sharded."""
    microbatches: int = 1
    """Microbatches per step (pipeline microbatches and gradient accumulation)."""
    schedule: str = "1f1b"
    """Pipeline schedule."""
    virtual_stages: int = 1
    """Stages per pipeline rank (interleaved)."""
    sequence_parallel: bool = False
    """Activations between tp regions sharded along the sequence."""
    activation_checkpointing: bool = False
    """Blocks keep only their input and recompute the rest in backward."""

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.ep * self.cp

    @property
    def data_ranks(self) -> int:
        """Ranks that take different examples: dp x ep (cp ranks share examples, split sequences)."""
        return self.dp * self.ep

    @property
    def replicas(self) -> int:
        """Ranks holding the same (non-expert) parameters: what gradients average and ZeRO shards over."""
        return self.dp * self.ep * self.cp

    @property
    def sizes(self) -> dict[str, int]:
        return {"pp": self.pp, "dp": self.dp, "ep": self.ep, "cp": self.cp, "tp": self.tp}

    def label(self) -> str:
        """``dp2 tp2 pp2 1f1b m4 z1``: the axes above 1, then the rest that matters."""
        axes = " ".join(f"{a}{n}" for a, n in self.sizes.items() if n > 1) or "1 rank"
        parts = [axes]
        if self.pp > 1:
            parts.append(self.schedule + (f" v{self.virtual_stages}" if self.virtual_stages > 1 else ""))
        parts.append(f"m{self.microbatches}")
        parts.append(f"z{self.zero_stage}")
        if self.sequence_parallel:
            parts.append("sp")
        if self.activation_checkpointing:
            parts.append("ac")
        return " ".join(parts)

    def as_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)

    @classmethod
    def of(cls, config: Config) -> Layout:
        par = config.parallel
        return cls(
            dp=par.dp,
            tp=par.tp,
            pp=par.pp,
            ep=par.ep,
            cp=par.cp,
            zero_stage=par.zero_stage,
            microbatches=par.microbatches,
            schedule=par.schedule,
            virtual_stages=par.virtual_stages,
            sequence_parallel=par.sequence_parallel,
            activation_checkpointing=config.training.activation_checkpointing,
        )

    def apply(self, config: Config) -> Config:
        """``config`` with this layout (its pipeline split left to balance by size)."""
        fields = {f.name for f in dataclasses.fields(config.parallel)}
        changes = {k: v for k, v in self.as_dict().items() if k in fields and k != "activation_checkpointing"}
        if config.parallel.stage_layers is not None and self.pp * self.virtual_stages != len(
            config.parallel.stage_layers
        ):
            changes["stage_layers"] = None
        parallel = dataclasses.replace(config.parallel, **changes)
        training = dataclasses.replace(config.training, activation_checkpointing=self.activation_checkpointing)
        return dataclasses.replace(config, parallel=parallel, training=training)

    def micro_batch_size(self, global_batch: int) -> int:
        """Examples per microbatch on one data rank."""
        return global_batch // (self.data_ranks * self.microbatches)
