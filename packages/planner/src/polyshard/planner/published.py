"""Published large runs (``published_runs.toml``) and the planner's prediction of each at its own layout.

A row's reported speed becomes a step time in the paper's own convention: TFLOP/s per GPU with the
paper's FLOPs per token (:func:`reported_flops_per_token`), or tokens/s per GPU. The planner's step
time for the same layout comes from :func:`polyshard.planner.search.search` with every axis fixed, the
code ``polyshard plan --tp .. --pp .. --dp .. --cp ..`` runs, so the two compare as seconds per step::

    published step  = tokens per step x FLOPs per token / (TFLOP/s per GPU x GPUs)
    error           = predicted step / published step - 1
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomllib

from polyshard.models.flops import layer_flops
from polyshard.planner.profile import BUILTIN, Profile
from polyshard.planner.search import CHOSEN, Candidate, Request, search
from polyshard.trainer.config import Config, ParallelConfig
from polyshard.trainer.config.parse import from_dict
from polyshard.trainer.errors import ConfigError

TABLE = Path(__file__).with_name("published_runs.toml")
ROLES = ("fit", "check", "unmodeled")
"""fit: the profile constants are fitted on it; check: held out; unmodeled: listed, not predicted (Float8)."""
CONVENTIONS = ("megatron", "palm")
DEVICES_PER_NODE = 8


@dataclass(frozen=True, kw_only=True)
class PublishedRun:
    name: str
    source: str
    """The paper and its table."""
    model: str | dict[str, Any]
    """A preset name, or a [model] section (with ``preset`` for a preset resized)."""
    gpu: str
    """h100, h100-96gb or a100: the built-in profile ``<gpu>-nvlink-ib`` (its memory is the run's budget)."""
    gpus: int
    layout: dict[str, Any]
    """Fields of the config's ``parallel`` section, as the paper ran them."""
    global_batch: int
    """Sequences per step."""
    seq_len: int
    precision: str
    recompute: str
    """none, selective, full, or search (the paper does not say: the least that fits, as the planner takes)."""
    role: str
    uncertain: str = ""
    tflops_per_gpu: float | None = None
    tokens_per_s_per_gpu: float | None = None
    convention: str | None = None
    """How the paper counts a token's FLOPs (:data:`CONVENTIONS`); with ``tflops_per_gpu`` only."""

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    def config(self) -> Config:
        """The run's model, batch and precision (its layout is applied by :func:`predict`)."""
        model: dict[str, Any] = {"preset": self.model} if isinstance(self.model, str) else dict(self.model)
        model["context_length"] = self.seq_len
        training = {"global_batch_size": self.global_batch, "precision": self.precision}
        return from_dict({"model": model, "training": training, "data": {"source": "synthetic"}})

    def fixed(self) -> dict[str, object]:
        """The axes ``polyshard plan`` is given: every field the search chooses (:data:`CHOSEN`), the row's or
        else the config's default (no ZeRO, no sequence parallelism, no hybrid sharding), with one sequence a
        microbatch (Megatron's and Llama 3's choice at these sizes), and the recompute where the paper says it."""
        defaults = ParallelConfig()
        fixed: dict[str, object] = {name: getattr(defaults, name) for name in CHOSEN}
        data_ranks = self.layout.get("dp", 1) * self.layout.get("ep", 1)
        fixed |= {"dp_shard": self.layout.get("dp", 1), "microbatches": self.global_batch // data_ranks}
        fixed |= self.layout
        if self.recompute != "search":
            fixed["activation_checkpointing"] = False if self.recompute == "none" else self.recompute
        return fixed

    def profile(self) -> Profile:
        return BUILTIN[f"{self.gpu}-nvlink-ib"]

    def published_step_s(self) -> float:
        """The paper's speed as seconds per step."""
        if self.tokens_per_s_per_gpu is not None:
            return self.tokens_per_step / (self.tokens_per_s_per_gpu * self.gpus)
        assert self.tflops_per_gpu is not None  # load_runs checked one of them is there
        flops = self.tokens_per_step * reported_flops_per_token(self)
        return flops / (self.tflops_per_gpu * 1e12 * self.gpus)


def reported_flops_per_token(run: PublishedRun) -> float:
    """Training FLOPs per token as the row's paper counts them.

    megatron (2104.04473 eq. 3, full recompute): 96·l·h²(1 + s/6h + V/16lh), V the row's vocab_size;
    palm (2204.02311 app. B): 6N + 12·l·h·s, N the matmul weights (the output head's, not the embedding
    lookup's: :func:`polyshard.models.flops.layer_flops` ÷ 2)."""
    model = run.config().model
    layers, hidden, s = model.num_layers, model.hidden, run.seq_len
    if run.convention == "megatron":
        vocab = float(run.model["vocab_size"]) if isinstance(run.model, dict) else 0.0  # load_runs checked it
        return 96 * layers * hidden**2 * (1 + s / (6 * hidden) + vocab / (16 * layers * hidden))
    weights = sum(layer.matmul for layer in layer_flops(model)) / 2
    return 6 * weights + 12 * layers * hidden * s


def load_runs(path: Path = TABLE) -> list[PublishedRun]:
    """The rows of ``path``, each checked: a wrong or missing field is a ConfigError naming the row."""
    raw = tomllib.loads(path.read_text())
    runs = []
    for i, row in enumerate(raw.get("run", [])):
        where = f"{path.name} run {i + 1} ({row.get('name', '?')})"
        try:
            run = PublishedRun(**row)
        except TypeError as err:
            raise ConfigError(f"{where}: {err}; the fields are in the file's header") from err
        if run.role not in ROLES:
            raise ConfigError(f"{where}: role {run.role!r}; choose one of {ROLES}")
        if (run.tflops_per_gpu is None) == (run.tokens_per_s_per_gpu is None):
            raise ConfigError(f"{where}: give one of tflops_per_gpu or tokens_per_s_per_gpu")
        if run.tflops_per_gpu is not None and run.convention not in CONVENTIONS:
            raise ConfigError(f"{where}: convention {run.convention!r}; choose one of {CONVENTIONS}")
        if run.convention == "megatron" and not (isinstance(run.model, dict) and "vocab_size" in run.model):
            raise ConfigError(f"{where}: the megatron convention counts the vocabulary: give model.vocab_size")
        if f"{run.gpu}-nvlink-ib" not in BUILTIN:
            raise ConfigError(f"{where}: gpu {run.gpu!r} has no built-in profile; choose h100, h100-96gb or a100")
        runs.append(run)
    return runs


def predict(run: PublishedRun, profile: Profile | None = None) -> Candidate:
    """The planner's best candidate for ``run`` with its layout fixed (the one `polyshard plan` prints first)."""
    profile = profile or run.profile()
    request = Request(
        devices=run.gpus, devices_per_node=DEVICES_PER_NODE, memory_gb=profile.memory_gb, fixed=run.fixed()
    )
    plan = search(run.config(), request, profile)
    if not plan.ranked:
        raise ConfigError(
            f"{run.name}: the published layout does not fit {profile.memory_gb:g} GB in the planner's count"
        )
    return plan.ranked[0]


def auto_choice(run: PublishedRun, profile: Profile | None = None) -> Candidate:
    """What ``--layout auto`` picks for ``run``'s model, batch and GPUs with no axis fixed (its recompute is
    the planner's choice too): the fastest predicted layout that fits."""
    profile = profile or run.profile()
    request = Request(devices=run.gpus, devices_per_node=DEVICES_PER_NODE, memory_gb=profile.memory_gb)
    plan = search(run.config(), request, profile)
    if not plan.ranked:
        raise ConfigError(f"{run.name}: no layout fits {profile.memory_gb:g} GB in the planner's count")
    return plan.ranked[0]
