"""What a GRPO run adds to the training loop (:class:`~polyshard.trainer.loop.Trainer` calls it), read
top to bottom in :meth:`RolloutRun.batch`:

this data rank's prompts -> ``grpo.generations`` completions of each, sampled on the training mesh
(:mod:`polyshard.trainer.loop.generation`) -> cut at a stop string -> the rewards of each completion
(:mod:`polyshard.trainer.tasks.rewards`) -> group advantages -> rows of prompt + completion whose
labels are the completion's tokens -> the generating policy's and the reference's per-token log-probs
where the loss needs them -> packed with the labels into the targets, which the pipeline executor cuts
into microbatches (:mod:`polyshard.trainer.tasks.grpo`).

One generation batch serves ``grpo.iterations`` optimizer steps (TRL's num_iterations): the first step
of each generates, the next ones reuse its rows, and their importance ratios are taken against the
log-probs the policy had when it generated. A training step counts one optimizer step, as TRL's.

A prompt's samples are seeded by (run seed, generation step, the prompt's place in the global batch,
sample), so every layout draws the same completions from the same weights.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from polyshard.collectives import ops
from polyshard.data.tokenizer import Tokenizer
from polyshard.models import output_width, sequence_length
from polyshard.trainer.data.prompts import Prompt, prompt_sets
from polyshard.trainer.engine.engine import Engine
from polyshard.trainer.errors import ConfigError
from polyshard.trainer.loop.generation import Sampling, generate
from polyshard.trainer.loop.reference import Reference
from polyshard.trainer.tasks.grpo import GRPOLoss, group_advantages, loss_normaliser, pack_targets, zero_std_fraction
from polyshard.trainer.tasks.loss import IGNORE_INDEX, token_logps
from polyshard.trainer.tasks.rewards import load_rewards, reward_metrics, score, total_rewards

EVAL_SEEDS = 1_000_000  # the evaluation's draws: past any run's generation steps, so never the training's


def cut_at_stop(ids: list[int], tokenizer: Tokenizer, stops: list[str]) -> list[int]:
    """The shortest start of ``ids`` whose text holds one of ``stops`` (all of ``ids`` if none does):
    the completion ends with the token that completes the stop string, as a server stopping on it."""
    if not stops or not any(stop in tokenizer.decode(ids) for stop in stops):
        return ids
    for end in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:end])
        if any(stop in text for stop in stops):
            return ids[:end]
    return ids


class Rollouts:
    """One generation batch of this data rank: the packed rows and what is logged about them."""

    def __init__(self, inputs: torch.Tensor, labels: torch.Tensor, advantages: torch.Tensor, figures: dict[str, float]):
        self.inputs, self.labels, self.advantages, self.figures = inputs, labels, advantages, figures
        self.targets: torch.Tensor | None = None


class RolloutRun:
    """GRPO's part of a run on ``engine``, whose weights are the starting ones (built before any step)."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer, start: int, reference: Reference | None = None):
        config = engine.config
        if config.grpo is None:
            raise ConfigError("training.task = 'grpo' needs a [grpo] section with at least one [[grpo.rewards]]")
        self.engine, self.config, self.grpo, self.tokenizer = engine, config, config.grpo, tokenizer
        self.prompts = prompt_sets(config)
        self.rewards = load_rewards(self.grpo.rewards)
        self.weights = [spec.weight for spec in self.grpo.rewards]
        # A resumed run's reference was rebuilt from the starting weights its checkpoint names (loop.reference_start).
        self.reference = (reference or Reference(engine)) if self.grpo.beta > 0 else None
        end = tokenizer.end_of_text
        self.sampling = Sampling(
            max_new_tokens=self.grpo.max_completion_length,
            temperature=self.grpo.temperature,
            top_p=self.grpo.top_p,
            top_k=self.grpo.top_k,
            stop_ids=() if end is None else (end,),
        )
        self.loss = engine.loss_fn
        self.data_group = engine.mesh.group(config.parallel.batch_axes)
        self.data_rank = engine.mesh.group_rank(config.parallel.batch_axes)
        self.current: Rollouts | None = None

    # -- a step's rows -------------------------------------------------------------------------------

    def batch(self, step: int, next_rows: Any) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        """(inputs, targets) of step ``step`` and the figures of its generation batch; ``next_rows()`` gives
        the loader's next prompt numbers when a new generation batch starts (every ``grpo.iterations``)."""
        fresh = self.current is None or (step - 1) % self.grpo.iterations == 0
        if fresh:
            rows = np.asarray(next_rows()["row"]).reshape(-1)
            self.current = self._rollout(step, [self.prompts.train[int(r)] for r in rows])
        assert self.current is not None and self.current.targets is not None
        figures = self.current.figures if fresh else {}
        return self.current.inputs, self.current.targets, figures

    def _sample(
        self, prompts: list[Prompt], seed: int, step: int
    ) -> tuple[list[Prompt], list[list[int]], torch.Tensor]:
        """``grpo.generations`` completions of each of ``prompts``, cut at a stop string, and their (R, F)
        rewards: (each row's prompt, each row's completion, the scores)."""
        completions = generate(
            self.engine,
            [prompt.ids for prompt in prompts],
            self.grpo.generations,
            self.sampling,
            seed=seed,
            first_row=self.data_rank * len(prompts),  # the prompt's place in the global batch
        )
        completions = [cut_at_stop(ids, self.tokenizer, self.grpo.stop) for ids in completions]
        per_prompt = [prompt for prompt in prompts for _ in range(self.grpo.generations)]
        texts = [self.tokenizer.decode(ids) for ids in completions]
        names = sorted({name for prompt in prompts for name in prompt.columns})
        columns = {name: [prompt.columns.get(name) for prompt in per_prompt] for name in names}
        scores = score(
            self.rewards, [p.text for p in per_prompt], texts, columns, step=step, completion_ids=completions
        )
        return per_prompt, completions, scores

    def _gathered(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` of every data rank, in global batch order (on the CPU)."""
        return ops.all_gather(rows.to(self.engine.device), 0, self.data_group).cpu()

    def _rollout(self, step: int, prompts: list[Prompt]) -> Rollouts:
        grpo = self.grpo
        started = time.perf_counter()
        # The generation step's number keeps the draws of one prompt apart across steps.
        generation = (step - 1) // grpo.iterations
        per_prompt, completions, scores = self._sample(
            prompts, self.config.training.seed * 1_000_003 + generation, step
        )
        generated = time.perf_counter() - started
        rewards = total_rewards(scores, self.weights)  # NaN where no function scored a completion
        every = self._gathered(scores)  # the global batch's scores, in its order
        advantages = group_advantages(
            rewards, grpo.generations, grpo.scale_rewards, batch_rewards=total_rewards(every, self.weights)
        )
        inputs, labels = self._rows(per_prompt, completions)
        device = self.engine.device
        rollouts = Rollouts(inputs.to(device), labels.to(device), advantages.to(device), {})
        rollouts.targets = self._targets(rollouts)
        lengths = self._gathered(torch.tensor([float(len(ids)) for ids in completions], dtype=torch.float64))
        rollouts.figures = {
            **reward_metrics(every, self.rewards),
            "frac_reward_zero_std": zero_std_fraction(
                total_rewards(every, self.weights), grpo.generations, grpo.scale_rewards
            ),
            "completions/max_length": float(lengths.max()),
            "completions/min_length": float(lengths.min()),
            "generation_s": generated,
        }
        return rollouts

    def evaluate(self, parts: Any) -> dict[str, float]:
        """The validation prompts' mean reward: ``grpo.generations`` samples of each, drawn with a seed of
        their own (the same at every evaluation, so the figures compare), no update."""
        totals = []
        for number, part in enumerate(parts):
            prompts = [self.prompts.val[int(r)] for r in np.asarray(part["row"]).reshape(-1)]
            seed = self.config.training.seed * 1_000_003 + EVAL_SEEDS + number
            _, _, scores = self._sample(prompts, seed, step=0)
            totals.append(self._gathered(total_rewards(scores, self.weights)))
        every = torch.cat(totals) if totals else torch.zeros(0)
        return {"val_reward": float(torch.nanmean(every)) if len(every) else float("nan")}

    def _rows(self, prompts: list[Prompt], completions: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(R, S) inputs and labels: each row the prompt then its completion, padded; only the completion's
        tokens are targets."""
        width = sequence_length(self.config.model) + 1
        pad = self.tokenizer.end_of_text or 0
        tokens = torch.full((len(prompts), width), pad, dtype=torch.long)
        labels = torch.full((len(prompts), width), IGNORE_INDEX, dtype=torch.long)
        for row, (prompt, completion) in enumerate(zip(prompts, completions)):
            whole = prompt.ids + completion
            tokens[row, : len(whole)] = torch.tensor(whole, dtype=torch.long)
            labels[row, len(prompt.ids) : len(whole)] = torch.tensor(completion, dtype=torch.long)
        return tokens[:, :-1].contiguous(), labels[:, 1:].contiguous()

    def _targets(self, rollouts: Rollouts) -> torch.Tensor:
        """The labels with what the loss needs beside them: the generating policy's per-token log-probs
        (only when a batch serves several steps: with one, the ratio is 1 and its own detached log-probs
        stand in, as TRL), the reference's (with grpo.beta > 0), the advantages and the normaliser."""
        inputs, labels = rollouts.inputs, rollouts.labels
        vocab, tp = (
            output_width(self.config.model),
            self.engine.mesh.group("tp") if self.config.parallel.tp > 1 else None,
        )

        def per_token(logits: torch.Tensor) -> torch.Tensor:
            return token_logps(logits, labels, tp, vocab, temperature=self.grpo.temperature)

        old = None
        if self.grpo.iterations > 1:
            stages = self.engine.stages.values()
            for stage in stages:
                stage.eval()
            try:
                old = self.engine.forward_only(inputs, per_token)
            finally:
                for stage in stages:
                    stage.train()
        reference = None
        if self.reference is not None:
            reference = self.reference.token_logps(inputs, labels, temperature=self.grpo.temperature)
        replicas = self.engine.replica_group if self.engine.replicas > 1 else None
        microbatches = self.engine.num_microbatches
        normaliser = loss_normaliser(self.grpo, labels, replicas, microbatches)
        return pack_targets(labels, old, reference, rollouts.advantages, normaliser)

    def step_metrics(self) -> dict[str, float]:
        """The last step's loss figures over the global batch (KL, clip fractions): collective."""
        if not isinstance(self.loss, GRPOLoss):
            return {}
        sums = self.loss.take_sums()
        holder = self.engine.holds_last_stage and self.engine.mesh.coord("tp") == 0
        return self.loss.metrics_of(self._reduced(sums if holder else None, self.loss.sums_size))

    def _reduced(self, sums: torch.Tensor | None, size: int) -> torch.Tensor:
        part = torch.zeros(size, dtype=torch.float64) if sums is None else sums.detach().double().cpu()
        part = part.to(self.engine.device)
        ops.all_reduce(part)
        return part.cpu()
