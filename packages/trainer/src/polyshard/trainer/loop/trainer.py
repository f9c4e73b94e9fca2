"""One training run on this rank: a :class:`Trainer` with :meth:`~Trainer.step`,
:meth:`~Trainer.evaluate` and :meth:`~Trainer.save`, and hooks beside the step (:mod:`.hooks`).

Read one step from top to bottom in :meth:`Trainer.step`: the learning rate, this data rank's
batch, the optimizer step (:func:`~polyshard.trainer.loop.step.train_step`), the metrics record,
evaluation when due, logging, the non-finite policy, a checkpoint when due. Every rank runs the
same steps and the same collectives in the same order, hooks included.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from polyshard.checkpoint import TOKENIZER, Checkpoint, LocalTensor, latest_checkpoint, save_checkpoint, step_dir
from polyshard.checkpoint.background import BackgroundSaver
from polyshard.collectives import ops
from polyshard.data.examples import Examples
from polyshard.data.loader import ShardedLoader
from polyshard.data.tokenizer import FileTokenizer, load_tokenizer
from polyshard.mesh import Mesh
from polyshard.models import sequence_length
from polyshard.trainer.checkpointing import hugging_face as hf
from polyshard.trainer.checkpointing.hugging_face import write_hf
from polyshard.trainer.checkpointing.lora_base import BASE_KEY
from polyshard.trainer.checkpointing.peft import merged_weights
from polyshard.trainer.checkpointing.run_export import consolidate
from polyshard.trainer.checkpointing.run_reshard import load_into
from polyshard.trainer.checkpointing.state import state_tensors
from polyshard.trainer.config import Config
from polyshard.trainer.engine import compiling
from polyshard.trainer.engine.balance import load_metrics
from polyshard.trainer.engine.builder import build_engine
from polyshard.trainer.engine.schedule import schedule_of
from polyshard.trainer.errors import ConfigError, NonFiniteError
from polyshard.trainer.loop.evaluate import evaluate_batches
from polyshard.trainer.loop.hooks import CompileLog, FaultInjection, Hook, ReplicaCheck
from polyshard.trainer.loop.integrity import weights_finite
from polyshard.trainer.loop.metrics import (
    MetricsLog,
    Progress,
    model_flops_per_token,
    peak_memory_bytes,
    plot_expert_load,
    plot_losses,
    plot_rewards,
)
from polyshard.trainer.loop.mfu import Utilisation, resolve_peak
from polyshard.trainer.loop.plan_check import PlanCheck, PlannedStep
from polyshard.trainer.loop.preferences import PreferenceRun
from polyshard.trainer.loop.profiling import StepProfiler
from polyshard.trainer.loop.reference_start import REFERENCE_KEY, rebuilt_reference, reference_record
from polyshard.trainer.loop.resume import checkpoint_to_load, continue_from, job_id, lora_base_of
from polyshard.trainer.loop.rollouts import RolloutRun
from polyshard.trainer.loop.sample import sample_text
from polyshard.trainer.loop.step import TrainStepResult, batch_segments, split_batch, train_step
from polyshard.trainer.loop.wandb_run import WandbRun
from polyshard.trainer.tasks import PREFERENCES, ROLLOUTS, task_for, task_of

T = TypeVar("T")


@dataclass
class RunResult:
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    val_loss: float | None = None
    accuracy: float | None = None
    sample: str | None = None
    speed: dict[str, float | str] = field(default_factory=dict)
    """The median step's tokens/s, model FLOPs per token, achieved TFLOP/s per rank, MFU and its peak."""
    compiled: str | None = None  # training.compile: what dynamo did (engine.compiling.summary)

    def summary(self, step: int) -> str:
        parts = [f"final step={step}", f"loss={self.losses[-1]:.4f}"]
        if "tokens_per_s" in self.speed:
            parts.append(f"tokens_per_s={self.speed['tokens_per_s']:,.0f}")
        if "mfu" in self.speed:
            parts.append(f"mfu={self.speed['mfu']:.1%} of {self.speed['peak_tflops']:.3g} TFLOP/s per rank")
        if self.val_loss is not None:
            parts.append(f"val_loss={self.val_loss:.4f}")
        if self.accuracy is not None:
            parts.append(f"accuracy={self.accuracy:.4f}")
        if self.compiled is not None:
            parts.append(self.compiled)
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
    data = _first_then_rest(lambda: task_for(config).splits(config))
    data_rank, data_ranks = mesh.group_rank(par.batch_axes), par.data_ranks
    batch = train.global_batch_size // data_ranks
    weights = data.weights if len(data.train) > 1 else None

    def loader(sources: Examples | list[Examples], shuffle: bool, **mixture: Any) -> ShardedLoader:
        return ShardedLoader(
            sources,
            batch_size=batch,
            rank=data_rank,
            world_size=data_ranks,
            seed=train.seed,
            shuffle=shuffle,
            **mixture,
        )

    return loader(data.train, config.data.shuffle, weights=weights, names=data.names), loader(data.val, False)


class Trainer:
    """Train ``config`` on ``mesh``, writing metrics and checkpoints under ``out``.

    With ``resume`` the run continues from the latest complete checkpoint in ``out/checkpoints``;
    with ``init_from`` from the given checkpoint (or ``hf:DIR``). Either may have been saved on
    another mesh. With ``prediction`` (the planner's, for this layout) the run logs predicted against
    measured after its first steps. ``hooks`` run after the trainer's own (profiler, plan check,
    replica check, fault injection).
    """

    def __init__(
        self,
        config: Config,
        mesh: Mesh,
        out: Path,
        *,
        log: bool = True,
        resume: bool = False,
        init_from: str | Path | None = None,
        prediction: PlannedStep | None = None,
        hooks: Sequence[Hook] = (),
    ):
        self.config, self.mesh, self.out = config, mesh, out
        train = config.training
        self.rank0 = dist.get_rank() == 0
        self.verbose = log and self.rank0
        torch.manual_seed(train.seed)  # dropout; the weights have their own per-layer generators
        self.engine = build_engine(config, mesh, device=_device())
        self.train_data, self.val_data = make_loaders(config, mesh)
        self.result = RunResult()
        self.start = self._start(resume, init_from)
        task = task_for(config)
        # training.task = "dpo": the reference (the weights just built or loaded) and its per-step work
        loaders = (self.train_data, self.val_data)  # a precomputed reference runs over every pair before step 1
        self.preferences = (
            PreferenceRun(self.engine, self.start, loaders, out, self.reference) if task is PREFERENCES else None
        )
        self.tokenizer = load_tokenizer(config.data.tokenizer)
        # training.task = "grpo": the rows of each step are generated, scored and packed (loop.rollouts)
        self.rollouts = (
            RolloutRun(self.engine, self.tokenizer, self.start, self.reference) if task is ROLLOUTS else None
        )
        self.end = train.last_step  # `stop_at` ends the run early; the schedule still spans `steps`
        if train.stop_at and train.stop_at <= self.start:
            raise ConfigError(
                f"training.stop_at={train.stop_at}, but the run continues from step {self.start}; "
                f"give a later step or drop --stop-at"
            )
        self.metrics = MetricsLog(
            out,
            enabled=self.verbose,
            resume_from=self.start if resume else None,
            tensorboard=config.logging.tensorboard,
            wandb=WandbRun(config, out, resume=resume) if self.verbose and config.logging.wandb else None,
        )
        self.progress = Progress(
            train.steps, enabled=self.verbose and config.logging.progress_bar, start_step=self.start
        )
        tokens = sequence_length(config.model)
        rows = train.global_batch_size * (config.grpo.generations if self.rollouts and config.grpo else 1)
        self.tokens_per_step = rows * tokens
        flops_per_token = model_flops_per_token(config.model)  # an MoE's token runs top_k of its experts
        # Measuring the peak is collective and takes ~0.2 s: only runs that log (every rank has the same `log`).
        peak = resolve_peak(config.logging.peak_tflops, train.precision, self.engine.device) if log else None
        self.utilisation = Utilisation(flops_per_token, self.tokens_per_step, dist.get_world_size(), peak)
        # The run's tokenizer is saved with every checkpoint, so the weights keep their meaning.
        self.assets = {TOKENIZER: self.tokenizer.path} if isinstance(self.tokenizer, FileTokenizer) else {}
        self.learning_rate = schedule_of(config)  # of the step alone: a resumed run continues it exactly
        self.nonfinite = 0  # non-finite steps in a row
        self.saver = BackgroundSaver() if config.checkpoint.async_save else None  # collective: a group of its own
        self.hooks: list[Hook] = [
            StepProfiler(config, self.engine, out, self.end),  # logging.profile_steps
            PlanCheck(prediction, self.engine, self.start, verbose=self.verbose),  # a planned run
            ReplicaCheck(self.engine, train.consistency_every),
            FaultInjection(mesh.rank),  # POLYSHARD_FAULT
            *([CompileLog()] if train.compile else []),  # training.compile: compiles and recompiles
            *hooks,
        ]

    def _start(self, resume: bool, init_from: str | Path | None) -> int:
        """Load what the run starts from; returns the number of steps already done."""
        source = checkpoint_to_load(self.config, self.out, resume, init_from)
        # DPO and GRPO's frozen starting model: named by every checkpoint, rebuilt from it before a resumed
        # run loads its trained weights (None: copied from the weights the run starts with, once loaded).
        self.reference_record = reference_record(self.config, source, resume, self.out)
        self.reference = (
            rebuilt_reference(self.engine, self.reference_record, source) if self.reference_record else None
        )
        step = self._load(source)
        # The base a LoRA run's checkpoints name instead of holding it (a loaded checkpoint's was checked).
        self.lora_base = lora_base_of(self.config, source, resume, self.out)
        return step

    def _load(self, source: Checkpoint | hf.HFSource | None) -> int:
        if isinstance(source, hf.HFSource):
            load_into(self.engine, source)  # weights only: the optimizer, data and step start fresh
            if self.verbose:
                print(f"initialised from the Hugging Face model in {source.folder}", flush=True)
            return 0
        if source is None:
            return 0
        step, self.result.losses = continue_from(self.engine, self.config, source, self.train_data, self.verbose)
        return step

    def run(self) -> RunResult:
        """Every remaining step, then the sample; every rank returns the same losses."""
        for step in range(self.start + 1, self.end + 1):
            self.step(step)
        return self.finish()

    def step(self, step: int) -> dict[str, Any]:
        """Step number ``step`` (counted from 1) and all that is due after it; returns its record."""
        train = self.config.training
        for hook in self.hooks:
            hook.begin_step(step)
        started = time.perf_counter()  # the step's time: data, update, and the hooks at its points
        lr = self.learning_rate(step - 1)
        generation: dict[str, float] = {}
        segments = None
        if self.rollouts is not None:  # GRPO: rows generated from the loader's prompts, scored and packed
            inputs, targets, generation = self.rollouts.batch(step, self.train_data.next_batch)
        else:
            batch = self.train_data.next_batch()
            inputs, targets = (t.to(self.engine.device) for t in split_batch(self.config, batch))
            if self.preferences is not None:  # the reference's log-probs ride with the labels
                targets = self.preferences.targets(inputs, targets, batch.get("pair"))
            segments = batch_segments(self.config, batch)  # None without data.document_mask
        with contextlib.ExitStack() as around:
            for hook in self.hooks:
                around.enter_context(hook.around_update(step))
            measured = train_step(
                self.engine, inputs, targets, lr, lambda: self._call("before_zero_grad", step), segments
            )
        self.nonfinite = 0 if measured.finite else self.nonfinite + 1
        self.result.losses.append(measured.loss)
        self.result.grad_norms.append(measured.grad_norm)
        self._call("after_update", step, measured)
        record, hooked = self._record(step, measured, lr, time.perf_counter() - started, generation)
        every = self.config.eval.every
        if every and (step % every == 0 or step == train.steps):
            record.update(self.evaluate())
        self._log(step, record, always=hooked)
        self._stop_if_nonfinite(step, measured)
        every = self.config.checkpoint.every
        saving = step == self.end or bool(every and step % every == 0)
        self._call("before_save", step, saving)  # a drifted replica stops the run before it is saved
        if saving:
            self.save(step)
        self._call("end_step", step)
        return record

    def _call(self, point: str, *args: Any) -> None:
        for hook in self.hooks:
            getattr(hook, point)(*args)

    def _record(
        self, step: int, measured: TrainStepResult, lr: float, seconds: float, generation: dict[str, float]
    ) -> tuple[dict[str, Any], bool]:
        """The step's metrics, and whether a hook added to them (what a hook adds is always logged)."""
        record: dict[str, Any] = {
            "step": step,
            "loss": measured.loss,
            "grad_norm": measured.grad_norm,
            "lr": lr,
            "tokens_per_s": self.tokens_per_step / seconds,
        }
        if self.preferences is not None:  # DPO: TRL's rewards/chosen, rejected, margins, accuracies
            record.update(self.preferences.step_metrics())
        if self.rollouts is not None:  # GRPO: the loss's KL and clip fractions; a generating step's rewards
            record.update(self.rollouts.step_metrics())
            record.update(generation)
            if "generation_s" in generation:
                record["training_s"] = seconds - generation["generation_s"]
        record.update(load_metrics(measured.expert_load))  # MoE: each layer's load over the global step
        mtp = measured.mtp_losses
        if mtp:  # multi-token prediction: the depths' mean loss (unweighted), and each
            record["mtp_loss"] = sum(mtp) / len(mtp)
            if len(mtp) > 1:
                record.update({f"mtp_loss/depth{k + 1}": v for k, v in enumerate(mtp)})
        if len(self.train_data.sources) > 1:  # a mixture: the share of each source in the batches so far
            record["data_shares"] = self.train_data.shares()
        if self.nonfinite:
            record["skipped"] = "non-finite loss or gradient norm: no rank updated"
        before = len(record)
        self._call("after_step", step, seconds, record)
        hooked = len(record) > before
        record.update(self.utilisation.fields(seconds))
        return record, hooked

    def evaluate(self) -> dict[str, float]:
        """The validation loss (and accuracy) over ``eval.batches`` batches (0: all of them)."""
        config = self.config
        parts = self.val_data.in_order(config.eval.batches or None)
        if self.rollouts is not None:
            return self.rollouts.evaluate(parts)
        if self.preferences is not None:
            preference_figures = self.preferences.evaluate(parts)
            self.result.val_loss = preference_figures["val_loss"]
            return preference_figures
        batches = ((*split_batch(config, part), batch_segments(config, part)) for part in parts)
        val_loss, accuracy = evaluate_batches(self.engine, batches)
        self.result.val_loss = val_loss
        figures = {"val_loss": val_loss, "val_perplexity": math.exp(min(val_loss, 50.0))}
        if accuracy is not None:
            self.result.accuracy = figures["accuracy"] = accuracy
        return figures

    def _log(self, step: int, record: dict[str, Any], always: bool) -> None:
        last = step == self.config.training.steps
        if step % self.config.logging.every == 0 or last or always:
            peak = torch.tensor([peak_memory_bytes()], dtype=torch.int64, device=self.engine.device)
            record["peak_memory_bytes_per_rank"] = ops.all_gather(peak, 0).tolist()  # collective: every rank's
            self.metrics.write(record)
        elif self.nonfinite:
            self.metrics.write(record)  # a skipped step is always on record
        self.progress.update(step - 1, record["loss"], record["tokens_per_s"], record.get("mfu"))

    def _stop_if_nonfinite(self, step: int, measured: TrainStepResult) -> None:
        train = self.config.training
        if self.nonfinite and (train.on_nonfinite == "stop" or self.nonfinite >= train.nonfinite_patience):
            raise NonFiniteError(
                f"step {step}: loss {measured.loss} and gradient norm {measured.grad_norm}, non-finite for "
                f"{self.nonfinite} step(s) in a row; no rank updated in them and no checkpoint holds them. "
                f"Lower optimizer.lr (now {self.config.optimizer.lr}) or warm up longer, then resume from the last "
                "checkpoint"
            )

    def save(self, step: int) -> Path:
        """A checkpoint of step ``step`` under ``out/checkpoints`` (collective: every rank writes its file)."""
        if not weights_finite(self.engine):  # finite gradients can still step weights to inf (lr=1e30)
            raise NonFiniteError(
                f"step {step}: the weights hold NaN or infinite values; the checkpoint was not written "
                f"and the earlier ones are kept. Lower optimizer.lr (now {self.config.optimizer.lr}) and resume"
            )
        extra: dict[str, Any] = {
            "data": self.train_data.state_dict(),
            "losses": list(self.result.losses),
            "job": job_id(),
        }
        if self.lora_base is not None:  # a LoRA run saves its adapters and names its frozen base
            extra[BASE_KEY] = self.lora_base.to_json()
        if self.reference_record is not None:  # DPO, GRPO: where the reference's starting weights come from
            extra[REFERENCE_KEY] = self.reference_record.to_json()
        options: dict[str, Any] = {
            "mesh_axes": self.config.parallel.mesh_axes,
            "extra": extra,
            "config": dataclasses.asdict(self.config),
            "keep": self.config.checkpoint.keep,
            "assets": self.assets,
            "after_write": lambda: self._call("during_save", step),
        }
        root = self.out / "checkpoints"
        if self.saver is not None:  # copied now, written by a thread while the next steps run
            self.saver.save(root, step, self._tensors(), after_publish=lambda f: self._published(f, step), **options)
            return step_dir(root, step)
        folder = save_checkpoint(root, step, self._tensors(), **options)
        self._published(folder, step)
        return folder

    def _tensors(self) -> dict[str, LocalTensor]:
        return state_tensors(self.engine, base=self.lora_base is None)

    def _published(self, folder: Path, step: int) -> None:
        """What follows a published checkpoint: its Hugging Face folder when due, the hooks' after_save."""
        hf_every = self.config.checkpoint.hf_every
        if hf_every and step % hf_every == 0 and self.rank0:
            self._write_hf(folder)
        self._call("after_save", step)

    def _write_hf(self, folder: Path) -> None:
        """The checkpoint ``folder`` as a Hugging Face folder ``out/hf/<its step>`` (rank 0; streamed from
        the files just written). A resumed run that saved the same step before finds it there, equal."""
        destination = self.out / "hf" / folder.name
        if destination.exists():
            return
        destination.parent.mkdir(parents=True, exist_ok=True)
        tokenizer = self.assets.get(TOKENIZER)
        saved = Checkpoint(folder)
        # A LoRA run's folder is its model with the adapters folded in, as `export --format hf --merge` writes it.
        weights = merged_weights(saved) if self.config.lora is not None else saved
        write_hf(weights, self.config.model, destination, tokenizer=tokenizer)

    def finish(self) -> RunResult:
        """Wait for a checkpoint still being written, close the metrics; a run that reached training.steps
        samples text from its last checkpoint."""
        if self.saver is not None:
            self.saver.wait()
        self.metrics.close()
        self.result.speed = self.utilisation.summary()
        train = self.config.training
        if train.compile:
            self.result.compiled = compiling.summary()
        generates = task_of(self.config.model).generates_text
        tokens = self.config.eval.sample_tokens
        if self.end == train.steps and generates and tokens and self.rank0:
            # The final checkpoint was just written (save_checkpoint ends with a barrier): rebuild the
            # unsharded weights from it with the same placement-driven code `polyshard export` uses.
            latest = latest_checkpoint(self.out / "checkpoints")
            if latest is not None:
                state = consolidate(latest)
                self.result.sample = sample_text(self.config, state, tokens, tokenizer=self.tokenizer)
        if self.verbose:
            records = self.metrics.records()
            plot_losses(records, self.out / "loss.png")
            if self.rollouts is not None:  # GRPO: the reward curve beside the loss's
                plot_rewards(records, self.out / "rewards.png")
            if any(key.startswith("moe/") for record in records for key in record):  # an MoE run's load
                plot_expert_load(records, self.out / "expert_load.png")
        return self.result


def train(
    config: Config,
    mesh: Mesh,
    out: Path,
    *,
    log: bool = True,
    resume: bool = False,
    init_from: str | Path | None = None,
    prediction: PlannedStep | None = None,
    hooks: Sequence[Hook] = (),
) -> RunResult:
    """Build a :class:`Trainer` and run it (the arguments are its)."""
    trainer = Trainer(
        config, mesh, out, log=log, resume=resume, init_from=init_from, prediction=prediction, hooks=hooks
    )
    return trainer.run()
