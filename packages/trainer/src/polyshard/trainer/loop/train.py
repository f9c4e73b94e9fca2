"""One training run: data -> engine -> optimizer, with logging, evaluation and sampling.

Read one step from top to bottom in :func:`train`:

    lr for this step -> this data rank's batch -> pipeline forward/backward over
    microbatches (dp reduces once, overlapped with the last backward) ->
    finish gradient reductions -> one global norm clip -> optimizer step.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist

from polyshard.checkpoint import (
    TOKENIZER,
    Checkpoint,
    CheckpointError,
    latest_checkpoint,
    open_checkpoint,
    save_checkpoint,
)
from polyshard.collectives import ops
from polyshard.mesh import Mesh
from polyshard.trainer.checkpointing.export import consolidate, saved_config
from polyshard.trainer.checkpointing.reshard import load_into
from polyshard.trainer.checkpointing.state import state_tensors
from polyshard.trainer.config import Config
from polyshard.trainer.data import ShardedLoader
from polyshard.trainer.data.tokenizer import FileTokenizer, Tokenizer, load_tokenizer
from polyshard.trainer.engine.experts import keep_idle_experts
from polyshard.trainer.engine.optim import clip_grad_norm, lr_at
from polyshard.trainer.engine.parallelize import Engine, build_engine
from polyshard.trainer.errors import ConfigError, NonFiniteError
from polyshard.trainer.loop.faults import inject
from polyshard.trainer.loop.integrity import check_replicas, weights_finite
from polyshard.trainer.loop.metrics import MetricsLog, Progress, model_flops_per_token, peak_memory_bytes, plot_losses
from polyshard.trainer.loop.plan_check import PlanCheck, Prediction, plan_check_line
from polyshard.trainer.loop.profiling import StepProfiler
from polyshard.trainer.models import GPT, build_model, hf, parameter_count, sequence_length, spec_of
from polyshard.trainer.models.loss import IGNORE_INDEX, global_token_mean

T = TypeVar("T")


@dataclass
class RunResult:
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    val_loss: float | None = None
    accuracy: float | None = None
    sample: str | None = None

    def summary(self, step: int) -> str:
        parts = [f"final step={step}", f"loss={self.losses[-1]:.4f}"]
        if self.val_loss is not None:
            parts.append(f"val_loss={self.val_loss:.4f}")
        if self.accuracy is not None:
            parts.append(f"accuracy={self.accuracy:.4f}")
        return " ".join(parts)


def _device() -> torch.device:
    """This rank's GPU under NCCL (init_distributed set it from LOCAL_RANK), else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def _first_then_rest(fn: Callable[[], T]) -> T:
    """Run ``fn`` on rank 0 first (it may download or write caches), then on the others."""
    if dist.get_rank() == 0:
        value = fn()
        dist.barrier()
    else:
        dist.barrier()
        value = fn()
    return value


def make_loaders(config: Config, mesh: Mesh) -> tuple[ShardedLoader, ShardedLoader]:
    par, train = config.parallel, config.training
    splits = _first_then_rest(lambda: spec_of(config.model).task.splits(config))
    data_rank, data_ranks = mesh.group_rank(par.batch_axes), par.data_ranks
    batch = train.global_batch_size // data_ranks
    common = {"batch_size": batch, "rank": data_rank, "world_size": data_ranks, "seed": train.seed}
    return ShardedLoader(splits[0], shuffle=config.data.shuffle, **common), ShardedLoader(
        splits[1], shuffle=False, **common
    )


def split_batch(config: Config, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """A loader batch -> (inputs, targets), as the model's task cuts it."""
    return spec_of(config.model).task.split_batch(batch)


def data_rank_mean(engine: Engine, value: torch.Tensor | None) -> float:
    """Average a per-replica value (a data rank's, or under cp its chunks') that only last-stage ranks
    hold (tp ranks hold equal copies)."""
    mesh, par = engine.mesh, engine.config.parallel
    holder = engine.holds_last_stage and mesh.coord("tp") == 0
    total = torch.tensor(
        [float(value) if holder and value is not None else 0.0], dtype=torch.float64, device=engine.device
    )
    ops.all_reduce(total)
    return float(total) / par.replicas


def evaluate(engine: Engine, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[float, float | None]:
    """One batch (each data rank passes its own, of equal size), forward only in eval mode: (mean loss, accuracy)."""
    return evaluate_batches(engine, [(inputs, targets)])


def evaluate_batches(
    engine: Engine, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]
) -> tuple[float, float | None]:
    """Forward only, in eval mode (no dropout), stage by stage across the pipeline, over this data rank's
    ``(inputs, targets)`` batches (which may hold no examples). Returns the mean loss over every counted
    target (image, or token not IGNORE_INDEX) of every data rank, and the accuracy (ViT)."""
    for stage in engine.stages.values():
        stage.eval()
    totals = torch.zeros(3, dtype=torch.float64)  # loss sum, correct, counted targets
    try:
        for batch in batches:
            totals += _evaluate(engine, *(t.to(engine.device) for t in batch))
    finally:
        for stage in engine.stages.values():
            stage.train()
    # Only the last stage's tp-rank-0 holds results (tp ranks hold equal copies); one all-reduce adds them up.
    if not (engine.holds_last_stage and engine.mesh.coord("tp") == 0):
        totals.zero_()
    totals = totals.to(engine.device)
    ops.all_reduce(totals)
    loss, correct, count = totals.tolist()
    return loss / count, (correct / count if spec_of(engine.config.model).task.reports_accuracy else None)


def _evaluate(engine: Engine, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(loss sum, correct, counted targets) of one batch on the last stage; zeros elsewhere. The
    pipeline's forward-only program runs it, so any batch size works (an empty part still runs the
    stages, whose collectives its peers need, but scores nothing). Under cp each rank scores its chunks."""
    inputs, targets = engine.local_tokens(inputs), engine.local_tokens(targets)
    n, accuracy = int((targets != IGNORE_INDEX).sum()), spec_of(engine.config.model).task.reports_accuracy

    def score(output: torch.Tensor) -> torch.Tensor:
        totals = torch.zeros(3, dtype=torch.float64)
        if n:  # the loss is the batch's mean over its counted targets
            totals[0] = float(engine.executor.loss_fn(output, targets)) * n
            totals[1] = float((output.argmax(-1) == targets).sum()) if accuracy else 0.0
            totals[2] = n
        return totals

    result = engine.executor.forward_only(inputs if engine.holds_first_stage else None, score)
    return result if result is not None else torch.zeros(3, dtype=torch.float64)


def _load(
    engine: Engine, config: Config, source: Checkpoint, train_data: ShardedLoader, result: RunResult, log: bool
) -> int:
    """Continue from the checkpoint ``source``, saved on this mesh or any other; returns its step."""
    folder = source.folder
    load_into(engine, source)
    extra = source.extra()
    train_data.load_state_dict(extra["data"])
    result.losses = list(extra["losses"])
    saved_batch = saved_config(source).training.global_batch_size
    if log and dist.get_rank() == 0:
        last = f", last loss {result.losses[-1]:.4f}" if result.losses else ""
        origin = source.index.get("resharded_from", {}).get("mesh")
        mesh = f"mesh {source.index['mesh']}" + (f" (resharded from {origin})" if origin else "")
        print(f"continuing from {folder}: step {source.step}, {mesh}{last}", flush=True)
    if dist.get_rank() == 0 and saved_batch != config.training.global_batch_size:
        print(
            f"note: {folder} was trained with global_batch_size={saved_batch}; the data position "
            f"(epoch {extra['data']['epoch']}, example {extra['data']['position']}) carries over, later batches "
            f"hold {config.training.global_batch_size} examples",
            flush=True,
        )
    return source.step


def checkpoint_to_load(
    config: Config, out: Path, resume: bool, init_from: str | Path | None
) -> Checkpoint | hf.HFSource | None:
    """The checkpoint a run starts from, opened and verified: ``init_from`` (a step folder or a folder
    of them, or ``hf:DIR``, a Hugging Face model folder: weights only, from step 0), or with
    ``resume`` the newest valid one under ``out/checkpoints`` (newer ones that fail verification
    are named and passed over); None for a fresh start."""

    def skipped(folder: Path, err: Exception) -> None:
        if dist.get_rank() == 0:
            print(f"skipping {folder}: {err}", flush=True)

    if init_from is not None and str(init_from).startswith(hf.PREFIX):
        return hf.HFSource(str(init_from)[len(hf.PREFIX) :], config)
    if init_from is not None:
        return open_checkpoint(init_from, skipped)
    if resume:
        if latest_checkpoint(out / "checkpoints") is None:
            raise CheckpointError(f"--resume: no complete checkpoint under {out / 'checkpoints'}")
        return open_checkpoint(out / "checkpoints", skipped)
    return None


def job_id() -> str | None:
    """The torchrun job this process belongs to (its rendezvous id; every restart of the job keeps it)."""
    return os.environ.get("TORCHELASTIC_RUN_ID")


def saved_by_this_job(out: Path) -> bool:
    """Whether the newest complete checkpoint under ``out`` was written by this torchrun job: a
    restarted worker group (after a crash, or an elastic change of nodes) continues from it."""
    latest = latest_checkpoint(out / "checkpoints")
    if latest is None or job_id() is None:
        return False
    try:
        ranks = json.loads((latest / "index.json").read_text()).get("ranks", [])
        return bool(ranks) and ranks[0].get("extra", {}).get("job") == job_id()
    except (OSError, ValueError, AttributeError, TypeError):
        return False  # an unreadable index: the normal resume path reports it


def train_step(
    engine: Engine,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    lr: float,
    before_zero_grad: Callable[[], None] | None = None,
) -> tuple[float, float]:
    """One optimizer step on this data rank's batch: pipeline forward/backward over the microbatches,
    gradient reductions, one global-norm clip, AdamW. Returns (the loss of the global batch: the mean
    over its counted target tokens, whichever rank and microbatch holds them (polyshard.trainer.models.loss);
    the gradient norm before clipping), the same on every rank.

    Both numbers come out of all-reduces, so every rank sees the same ones: when either is NaN or
    infinite, no rank updates (the step is skipped, as Megatron-LM does with an overflowing loss
    scale) and the caller decides whether to go on. No extra collective is needed to agree.
    ``before_zero_grad`` runs after the optimizer step while the gradients are still held (to measure them).
    """
    for optimizer in engine.optimizers:
        for group in optimizer.param_groups:
            group["lr"] = lr
    inputs, targets = engine.local_tokens(inputs), engine.local_tokens(targets)  # this cp rank's chunks
    replica_group = engine.mesh.group(engine.config.parallel.replica_axes)  # every holder of a loss part
    microbatches = engine.executor.schedule.num_microbatches
    with global_token_mean(engine.executor.loss_fn, targets, replica_group, microbatches):
        loss = data_rank_mean(engine, engine.forward_backward(inputs, targets))
    engine.finish_gradients()
    gradients, tied_copies = engine.gradients()
    axis_sizes = engine.mesh.layout.as_dict()
    grad_norm = clip_grad_norm(gradients, engine.config.training.grad_clip, axis_sizes, tied_copies)
    if math.isfinite(loss) and math.isfinite(grad_norm):
        with keep_idle_experts(engine):
            for optimizer in engine.optimizers:
                optimizer.step()
    if before_zero_grad is not None:
        before_zero_grad()
    engine.zero_grad()
    return loss, grad_norm


def train(
    config: Config,
    mesh: Mesh,
    out: Path,
    *,
    log: bool = True,
    resume: bool = False,
    init_from: str | Path | None = None,
    prediction: Prediction | None = None,
) -> RunResult:
    """Train ``config`` on ``mesh``, writing metrics and checkpoints under ``out``.

    Every rank returns the same losses. With ``resume`` the run continues from
    the latest complete checkpoint in ``out/checkpoints``; with ``init_from``
    from the given checkpoint. Either may have been saved on another mesh. With ``prediction`` (the
    planner's, for this layout) the run logs predicted against measured after its first steps.
    """
    train_cfg = config.training
    rank0 = dist.get_rank() == 0
    torch.manual_seed(train_cfg.seed)  # dropout; the weights have their own per-layer generators
    engine = build_engine(config, mesh, device=_device())
    num_params = parameter_count(config.model)
    train_data, val_data = make_loaders(config, mesh)
    result = RunResult()
    checkpoints = out / "checkpoints"
    source = checkpoint_to_load(config, out, resume, init_from)
    start = 0
    if isinstance(source, hf.HFSource):
        load_into(engine, source)  # weights only: the optimizer, data and step start fresh
        if log and rank0:
            print(f"initialised from the Hugging Face model in {source.folder}", flush=True)
    elif source is not None:
        start = _load(engine, config, source, train_data, result, log)
    metrics = MetricsLog(
        out, enabled=rank0 and log, resume_from=start if resume else None, tensorboard=config.logging.tensorboard
    )
    progress = Progress(train_cfg.steps, enabled=rank0 and log and config.logging.progress_bar, start_step=start)
    tokens_per_step = train_cfg.global_batch_size * sequence_length(config.model)
    flops_per_step = tokens_per_step * model_flops_per_token(
        num_params, config.model.num_layers, config.model.hidden, sequence_length(config.model)
    )
    tokenizer = load_tokenizer(config.data.tokenizer)
    assets = {TOKENIZER: tokenizer.path} if isinstance(tokenizer, FileTokenizer) else {}  # saved with every checkpoint
    nonfinite = 0  # non-finite steps in a row
    plan_check = PlanCheck(
        prediction, engine, start
    )  # a planned run: predicted against measured, after its first steps
    end = train_cfg.last_step  # `stop_at` ends the run early; the schedule below still spans `steps`
    profiler = StepProfiler(config, engine, out, end)  # logging.profile_steps: traces and the pipeline timeline
    if train_cfg.stop_at and train_cfg.stop_at <= start:
        raise ConfigError(
            f"training.stop_at={train_cfg.stop_at}, but the run continues from step {start}; "
            f"give a later step or drop --stop-at"
        )
    for step in range(start, end):
        profiler.begin(step + 1)  # the whole step: data, forward/backward, evaluation, checkpoint
        started = time.perf_counter()
        lr = lr_at(
            step,
            lr=train_cfg.lr,
            min_lr=train_cfg.min_lr,
            warmup_steps=train_cfg.warmup_steps,
            total_steps=train_cfg.steps,
        )
        inputs, targets = (t.to(engine.device) for t in split_batch(config, train_data.next_batch()))
        inject("step", step + 1, mesh.rank)
        with plan_check.measuring(step):
            loss_value, grad_norm = train_step(engine, inputs, targets, lr, plan_check.before_zero_grad(step))
        nonfinite = 0 if math.isfinite(loss_value) and math.isfinite(grad_norm) else nonfinite + 1
        result.losses.append(loss_value)
        result.grad_norms.append(grad_norm)
        seconds = time.perf_counter() - started
        record: dict[str, Any] = {
            "step": step + 1,
            "loss": loss_value,
            "grad_norm": grad_norm,
            "lr": lr,
            "tokens_per_s": tokens_per_step / seconds,
        }
        if nonfinite:
            record["skipped"] = "non-finite loss or gradient norm: no rank updated"
        planned = plan_check.after(step, seconds)
        if planned is not None:
            record.update(planned)
            if rank0 and log:
                print(plan_check_line(planned), flush=True)
        if config.logging.peak_tflops:
            record["mfu"] = flops_per_step / seconds / (config.logging.peak_tflops * 1e12 * dist.get_world_size())
        last = step + 1 == train_cfg.steps
        if train_cfg.eval_every and ((step + 1) % train_cfg.eval_every == 0 or last):
            batches = (split_batch(config, part) for part in val_data.in_order(train_cfg.eval_batches or None))
            val_loss, accuracy = evaluate_batches(engine, batches)
            result.val_loss = record["val_loss"] = val_loss
            record["val_perplexity"] = math.exp(min(result.val_loss, 50.0))
            if accuracy is not None:
                result.accuracy = record["accuracy"] = accuracy
        if (step + 1) % config.logging.every == 0 or last or planned is not None:
            peak = torch.tensor([peak_memory_bytes()], dtype=torch.int64, device=engine.device)
            peaks = ops.all_gather(peak, 0)  # collective: every rank's peak
            record["peak_memory_bytes_per_rank"] = peaks.tolist()
            metrics.write(record)
        elif nonfinite:
            metrics.write(record)  # a skipped step is always on record
        progress.update(step, loss_value, record["tokens_per_s"])
        if nonfinite and (train_cfg.on_nonfinite == "stop" or nonfinite >= train_cfg.nonfinite_patience):
            raise NonFiniteError(
                f"step {step + 1}: loss {loss_value} and gradient norm {grad_norm}, non-finite for {nonfinite} "
                f"step(s) in a row; no rank updated in them and no checkpoint holds them. Lower training.lr "
                f"(now {train_cfg.lr}) or warm up longer, then resume from the last checkpoint"
            )
        every, saving = config.checkpoint.every, step + 1 == end
        saving = saving or bool(every and (step + 1) % every == 0)
        check = train_cfg.consistency_every
        if saving or (check and (step + 1) % check == 0):
            check_replicas(engine, step + 1)  # a drifted replica stops the run before it is saved
        if saving:
            if not weights_finite(engine):  # finite gradients can still step weights to inf (lr=1e30)
                raise NonFiniteError(
                    f"step {step + 1}: the weights hold NaN or infinite values; the checkpoint was not written "
                    f"and the earlier ones are kept. Lower training.lr (now {train_cfg.lr}) and resume"
                )
            extra = {"data": train_data.state_dict(), "losses": result.losses, "job": job_id()}
            save_checkpoint(
                checkpoints,
                step + 1,
                state_tensors(engine),
                mesh_axes=config.parallel.mesh_axes,
                extra=extra,
                config=dataclasses.asdict(config),
                keep=config.checkpoint.keep,
                assets=assets,
                after_write=functools.partial(inject, "save", step + 1, mesh.rank),
            )
            inject("saved", step + 1, mesh.rank)
        profiler.end(step + 1)

    metrics.close()
    finished = end == train_cfg.steps
    if finished and spec_of(config.model).task.generates_text and train_cfg.sample_tokens and rank0:
        # The final checkpoint was just written (save_checkpoint ends with a barrier): rebuild the
        # unsharded weights from it with the same placement-driven code `polyshard export` uses.
        state = consolidate(cast(Path, latest_checkpoint(checkpoints)))
        result.sample = sample_text(config, state, train_cfg.sample_tokens, tokenizer=tokenizer)
    if rank0 and log:
        plot_losses(metrics.records(), out / "loss.png")
    return result


def sample_text(
    config: Config,
    state: dict[str, torch.Tensor],
    new_tokens: int,
    prompt: str = "ROMEO:",
    *,
    temperature: float = 0.8,
    top_k: int = 0,
    seed: int = 0,
    tokenizer: Tokenizer | None = None,
) -> str:
    """Generate from the unsharded weights on one process, with ``tokenizer`` (default: the config's)."""
    model = build_model(config.model)
    model.load_state_dict(state, strict=True)
    model.eval()
    tokenizer = tokenizer or load_tokenizer(config.data.tokenizer)
    tokens = torch.tensor([tokenizer.encode(prompt)], dtype=torch.long)
    generator = torch.Generator().manual_seed(seed)
    # Only language models generate, and every one of them is a GPT (models.gpt, models.moe).
    out = cast(GPT, model).generate(tokens, new_tokens, temperature=temperature, top_k=top_k, generator=generator)
    return tokenizer.decode(out[0].tolist())
