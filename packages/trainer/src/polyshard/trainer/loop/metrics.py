"""What a run writes next to its checkpoints: metrics.jsonl, loss.png (and expert_load.png for an MoE
model), and the progress line.

Rank 0 alone writes; every line of ``metrics.jsonl`` is one JSON object
(step, loss, grad_norm, lr, tokens_per_s, model_flops_per_token,
achieved_tflops_per_rank, mfu with its peak_tflops and peak_source (:mod:`.mfu`), peak memory per
rank, and val_loss/accuracy when evaluated; for an MoE model each layer's ``moe/layer{i}/...`` load
over the global step: tokens_per_expert, tokens_max, tokens_mean, max_over_mean, dropped_tokens, and
bias_min/bias_max of a sigmoid router, see :mod:`polyshard.trainer.engine.balance`). With
``logging.tensorboard`` the same
records go to ``tensorboard/`` as scalars too, and with ``logging.wandb`` to Weights & Biases
(:mod:`.wandb_run`).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from polyshard.models import ModelConfig
from polyshard.models.flops import flops_per_token

if TYPE_CHECKING:
    from polyshard.trainer.loop.wandb_run import WandbRun


def model_flops_per_token(model: ModelConfig) -> float:
    """Training FLOPs per token: 6N for the matmuls plus attention's scores and weighted sums (PaLM appendix
    B, causal attention's masked half left out), counted as the planner counts them
    (:mod:`polyshard.models.flops`)."""
    return flops_per_token(model)


def peak_memory_bytes() -> int:
    """Peak memory of this process: the CUDA allocator's peak, or the process's max RSS on CPU."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated()
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


class MetricsLog:
    """``metrics.jsonl``: one JSON record a line. ``resume_from=K`` keeps the records of steps up to K
    and drops later ones, written after the checkpoint the run resumes from, so the log of a run that
    crashed and resumed equals the log of one that did not; None starts a new log. With ``tensorboard``
    each record also goes to :class:`TensorBoardScalars`, and to ``wandb`` when given (it is closed here)."""

    def __init__(
        self,
        out_dir: Path,
        *,
        enabled: bool,
        resume_from: int | None = None,
        tensorboard: bool = False,
        wandb: WandbRun | None = None,
    ):
        self.path = Path(out_dir) / "metrics.jsonl"
        self.enabled = enabled
        self.wandb = wandb
        self.scalars = TensorBoardScalars(out_dir, enabled=enabled and tensorboard, resume_from=resume_from)
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            kept = [] if resume_from is None or not self.path.exists() else self.records()
            lines = [json.dumps(r) + "\n" for r in kept if r.get("step", 0) <= (resume_from or 0)]
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text("".join(lines))
            tmp.replace(self.path)  # atomic: a crash here leaves the old log whole

    def write(self, record: dict[str, Any]) -> None:
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
            self.scalars.write(record)
            if self.wandb is not None:
                self.wandb.write(record)

    def close(self) -> None:
        self.scalars.close()
        if self.wandb is not None:
            self.wandb.close()
            self.wandb = None

    def records(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]


class TensorBoardScalars:
    """``tensorboard/``: each metrics record as TensorBoard scalars at its step, tagged with the record's
    keys (``loss``, ``lr``, ``grad_norm``, ``tokens_per_s``, ...); a list of numbers (peak memory per
    rank) gives one tag per entry (``peak_memory_bytes_per_rank/rank1``), text is left out. TensorBoard
    stores float32. ``resume_from=K`` hides the events of steps after K that an earlier run wrote, as
    :class:`MetricsLog` drops its lines (TensorBoard's purge_step); a fresh run hides all earlier ones."""

    def __init__(self, out_dir: Path, *, enabled: bool, resume_from: int | None = None):
        self.writer = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter  # the optional tensorboard package

            self.writer = SummaryWriter(str(Path(out_dir) / "tensorboard"), purge_step=(resume_from or 0) + 1)

    def write(self, record: dict[str, Any]) -> None:
        if self.writer is None:
            return
        step = record["step"]
        for key, value in record.items():
            if key == "step" or isinstance(value, (bool, str)):
                continue
            if isinstance(value, (int, float)):
                self.writer.add_scalar(key, value, step)
            elif isinstance(value, list):
                for i, item in enumerate(value):
                    self.writer.add_scalar(f"{key}/rank{i}", item, step)
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


class Progress:
    """A one-line progress bar on rank 0: step, loss, tokens/s, MFU and ETA."""

    def __init__(self, total_steps: int, *, enabled: bool, start_step: int = 0, interactive: bool | None = None):
        self.total, self.enabled, self.start_step = total_steps, enabled, start_step
        self.started = time.perf_counter()
        # On a terminal the line redraws itself; in a pipe or a CI log that would make one line of
        # thousands of characters, so there a plain line is printed every twentieth of the run.
        self.interactive = sys.stdout.isatty() if interactive is None else interactive
        self.every = max(1, total_steps // 20)

    def update(self, step: int, loss: float, tokens_per_s: float, mfu: float | None = None) -> None:
        if not self.enabled:
            return
        done = step + 1 - self.start_step
        elapsed = time.perf_counter() - self.started
        eta = elapsed / max(done, 1) * (self.total - step - 1)
        last = step + 1 == self.total
        utilisation = f" mfu {mfu:.1%}" if mfu is not None else ""
        text = f"step {step + 1}/{self.total} loss {loss:.4f} {tokens_per_s:,.0f} tok/s{utilisation} eta {eta:5.0f}s"
        if not self.interactive:
            if last or (step + 1) % self.every == 0:
                print(text, flush=True)
            return
        width = 24
        filled = int(width * (step + 1) / self.total)
        bar = "#" * filled + "-" * (width - filled)
        print(f"\r[{bar}] {text}", end="\n" if last else "", flush=True)


def plot_losses(records: list[dict[str, Any]], path: Path) -> None:
    """Training (and validation) loss against step, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    steps = [r["step"] for r in records if "loss" in r]
    ax.plot(steps, [r["loss"] for r in records if "loss" in r], label="train loss")
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_expert_load(records: list[dict[str, Any]], path: Path) -> None:
    """An MoE run's load per expert, as a PNG: left, each layer's busiest expert over the mean (1 is
    balanced) against step; right, each layer's share of the tokens per expert in the last logged step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = sorted({k.split("/")[1] for r in records for k in r if k.startswith("moe/")}, key=lambda n: int(n[5:]))
    fig, (curve, bars) = plt.subplots(1, 2, figsize=(10, 4), dpi=100)
    last: dict[str, Any] = next((r for r in reversed(records) if any(k.startswith("moe/") for k in r)), {})
    for j, layer in enumerate(layers):
        points = [(r["step"], r[f"moe/{layer}/max_over_mean"]) for r in records if f"moe/{layer}/max_over_mean" in r]
        curve.plot(*zip(*points), label=layer)
        counts = last.get(f"moe/{layer}/tokens_per_expert", [])
        total = sum(counts) or 1
        width = 0.8 / len(layers)
        bars.bar([e + j * width for e in range(len(counts))], [c / total for c in counts], width, label=layer)
    curve.axhline(1.0, color="grey", lw=0.8)
    curve.set_xlabel("step")
    curve.set_ylabel("tokens of the busiest expert / mean")
    bars.set_xlabel("expert")
    bars.set_ylabel(f"share of assignments, step {last.get('step', '?')}")
    for ax in (curve, bars):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_rewards(records: list[dict[str, Any]], path: Path) -> None:
    """A GRPO run's mean reward of each generation batch (and of the validation prompts) against step,
    as a PNG beside loss.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    train = [(r["step"], r["reward"]) for r in records if "reward" in r]
    if train:
        ax.plot(*zip(*train), label="reward (generation batch)")
    val = [(r["step"], r["val_reward"]) for r in records if "val_reward" in r]
    if val:
        ax.plot(*zip(*val), "o-", label="reward (validation prompts)")
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
