"""Log-likelihoods and greedy generation on the mesh: the two things an evaluation harness asks of a model.

Every rank holds the same list of requests (token ids). Requests are dealt to the data ranks (``dp``);
the ranks of one data rank (its pipeline stages, tp, ep ranks: the *model group*) run the same batches
in the same order, since their collectives pair up. The last stage turns its output into a few numbers
per row (a continuation's log-probability, the greedy token), which the model group shares with one
all-reduce, so the first stage can feed generated tokens back in. At the end each data rank's answers
are summed into every rank's copy of the whole list.

Shapes: B rows, S positions (right-padded), V the vocabulary (V/tp columns of it per tp rank).

Right padding is exact here: attention is causal, so a position never sees the padding after it.
Generation recomputes the whole prefix at each new token (no KV cache across the pipeline yet): cheap
for the tens of tokens evaluation tasks generate, quadratic for long answers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from polyshard.collectives import ops
from polyshard.models import output_width, sequence_length
from polyshard.tp import vocab_parallel_cross_entropy
from polyshard.trainer.engine.engine import Engine
from polyshard.trainer.tasks.loss import IGNORE_INDEX

MODEL_AXES = ("pp", "ep", "cp", "tp")  # every axis but dp: the ranks that run one data rank's batches together


@dataclass(frozen=True)
class Scored:
    """One continuation: its summed log-probability and whether greedy decoding gives every one of its tokens."""

    logprob: float
    greedy: bool


class MeshScorer:
    """Scores and generates with ``engine``'s model, laid out on any dp x tp x pp x ep mesh (no cp)."""

    def __init__(self, engine: Engine, batch_size: int = 1):
        self.engine, self.batch_size = engine, batch_size
        self.mesh = engine.mesh
        self.max_length = sequence_length(engine.config.model)
        self.vocab = output_width(engine.config.model)
        self.tp_group = self.mesh.group("tp") if engine.config.parallel.tp > 1 else None
        self.model_group = self.mesh.group(MODEL_AXES)
        # One rank of each model group reports what the last stage computed (its tp ranks hold equal copies).
        self.reports = engine.holds_last_stage and all(self.mesh.coord(a) == 0 for a in ("tp", "ep", "cp"))
        for stage in engine.stages.values():
            stage.eval()  # no dropout

    # -- scoring ---------------------------------------------------------------------------------------

    def score(self, rows: Sequence[tuple[Sequence[int], int]]) -> list[Scored]:
        """Each row is (tokens, n): the model reads ``tokens[:-1]`` and the last ``n`` tokens are the
        continuation scored. Rows are at most ``max_length + 1`` tokens (the caller truncates)."""
        results = torch.zeros(len(rows), 2, dtype=torch.float64)  # (logprob, greedy) per row
        for batch in self._my_batches([len(tokens) for tokens, _ in rows]):
            results[batch] = self._score_batch([rows[i] for i in batch])
        self._sum_over_data_ranks(results)
        return [Scored(float(lp), bool(g)) for lp, g in results.tolist()]

    def _score_batch(self, rows: Sequence[tuple[Sequence[int], int]]) -> torch.Tensor:
        width = max(len(tokens) - 1 for tokens, _ in rows)
        inputs = torch.zeros(len(rows), width, dtype=torch.long)
        targets = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
        for r, (tokens, n) in enumerate(rows):
            length = len(tokens) - 1
            inputs[r, :length] = torch.tensor(tokens[:-1])
            targets[r, length - n : length] = torch.tensor(tokens[-n:])  # position p predicts token p + 1

        def on_output(logits: torch.Tensor) -> torch.Tensor:  # (B, S, V or V/tp)
            targets_here = targets.to(logits.device)
            token_logprob = -self._cross_entropy(logits, targets_here)  # (B, S); 0 where ignored
            hits = (self._argmax(logits) == targets_here) | (targets_here == IGNORE_INDEX)
            return torch.stack([token_logprob.sum(1).double(), hits.all(1).double()], dim=1).cpu()

        return self._forward(inputs, on_output, (len(rows), 2))

    # -- generation ------------------------------------------------------------------------------------

    def generate(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int, done: Callable[[list[int]], bool]
    ) -> list[list[int]]:
        """Greedy continuations of ``prompts``: at most ``max_new_tokens`` each, a row stopping as soon as
        ``done(its new tokens)`` holds. Each prompt must leave room: ``len(prompt) + max_new_tokens <=
        max_length``."""
        answers = torch.zeros(len(prompts), max_new_tokens, dtype=torch.long)  # token id + 1; 0: none
        for batch in self._my_batches([len(p) for p in prompts]):
            for i, tokens in zip(batch, self._generate_batch([prompts[i] for i in batch], max_new_tokens, done)):
                answers[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.long) + 1
        self._sum_over_data_ranks(answers)
        return [[t - 1 for t in row if t > 0] for row in answers.tolist()]

    def _generate_batch(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int, done: Callable[[list[int]], bool]
    ) -> list[list[int]]:
        new: list[list[int]] = [[] for _ in prompts]
        running = list(range(len(prompts)))
        for _ in range(max_new_tokens):
            if not running:
                break
            rows = [list(prompts[i]) + new[i] for i in running]
            inputs = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.long)
            for r, tokens in enumerate(rows):
                inputs[r, : len(tokens)] = torch.tensor(tokens)
            last = torch.tensor([len(tokens) - 1 for tokens in rows])

            def on_output(logits: torch.Tensor, last: torch.Tensor = last) -> torch.Tensor:
                at_end = logits[torch.arange(logits.shape[0], device=logits.device), last.to(logits.device)]
                return self._argmax(at_end).double().cpu()  # (B,)

            chosen = self._forward(inputs, on_output, (len(rows),)).long().tolist()
            for i, token in zip(running, chosen):
                new[i].append(token)
            # Every rank of the model group sees the same tokens, so all decide alike who is done.
            running = [i for i in running if not done(new[i])]
        return new

    # -- on the mesh -----------------------------------------------------------------------------------

    def _my_batches(self, lengths: Sequence[int]) -> list[list[int]]:
        """This data rank's batches of request indices: longest first (rows of a batch pad to like lengths),
        dealt round-robin over the data ranks."""
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        mine = order[self.mesh.coord("dp") :: self.mesh.size("dp")]
        return [mine[k : k + self.batch_size] for k in range(0, len(mine), self.batch_size)]

    def _forward(
        self, inputs: torch.Tensor, on_output: Callable[[torch.Tensor], torch.Tensor], shape: tuple[int, ...]
    ) -> torch.Tensor:
        """``on_output`` of the last stage's output for ``inputs``, on every rank of the model group."""
        device = self.engine.device
        result = self.engine.forward_only(inputs.to(device), on_output)
        shared = result if result is not None and self.reports else torch.zeros(shape, dtype=torch.float64)
        shared = shared.to(device)  # NCCL reduces GPU tensors only
        ops.all_reduce(shared, self.model_group)
        return shared.cpu()

    def _sum_over_data_ranks(self, results: torch.Tensor) -> None:
        """Each data rank filled its own rows (zeros elsewhere): after this every rank holds them all."""
        summed = results.to(self.engine.device)
        ops.all_reduce(summed, self.mesh.group("dp"))
        results.copy_(summed)

    def _cross_entropy(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """(B, S) -log p(target), 0 at IGNORE_INDEX, over the whole vocabulary (vocabulary-parallel under tp)."""
        if self.tp_group is not None:
            return vocab_parallel_cross_entropy(
                logits.float(),
                targets,
                self.tp_group,
                vocab_size=self.vocab,
                ignore_index=IGNORE_INDEX,
                reduction="none",
            )
        flat = F.cross_entropy(
            logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
        )
        return flat.view(targets.shape)

    def _argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """The greedy token at each position, over the whole vocabulary. Under tp each rank takes the best
        of its columns (padding past the vocabulary excluded), and the best of those wins; a tie goes to the
        lower id, as ``torch.argmax`` on the whole row would have it."""
        if self.tp_group is None:
            return logits[..., : self.vocab].argmax(-1)
        local = logits.shape[-1]
        start = dist.get_rank(self.tp_group) * local
        usable = logits.float()[..., : self.vocab - start]  # padding is fewer than tp columns, all on the last
        best, index = usable.max(-1)
        tp = dist.get_world_size(self.tp_group)
        values = [torch.empty_like(best) for _ in range(tp)]
        ids = [torch.empty_like(index) for _ in range(tp)]
        dist.all_gather(values, best.contiguous(), group=self.tp_group)
        dist.all_gather(ids, (index + start).contiguous(), group=self.tp_group)
        winner = torch.stack(values).argmax(0, keepdim=True)  # the first shard holding the maximum
        return torch.stack(ids).gather(0, winner).squeeze(0)
