"""Generation on the training mesh with a KV cache: GRPO's completions, drawn by the model being trained,
laid out as it trains (dp, tp, ZeRO-1/2/3, LoRA adapters).

Every rank calls :func:`generate` with its data rank's prompts. Each prompt is one group: its samples
share the prompt, so the prompt is run once (prefill, batch 1), its cache copied to each sample's row, and
then every sample advances one token per forward (decode) over the cache
(:mod:`polyshard.models.common.kv_cache`). No padding is ever needed, and one prompt's work has the same
shapes on every layout, so dp and ZeRO draw bit for bit what one process draws; tp's sums in another
order move logits by ~1e-7, which the draw below almost never notices.

The draw: temperature, then top-k, then top-p (nucleus; the order transformers applies them in), then
one uniform number u per (row, sample, position) from a generator seeded by (seed, row, sample): the
token is the first, in token-id order, whose cumulative probability passes u x the kept mass (the
inverse CDF). Token-id order, not probability order, keeps a draw where it is under tiny changes of the
logits: only a u within that change of a boundary moves. Temperature 0 takes the likeliest token.

Collectives: under tp each rank's head gives its vocabulary columns; they are gathered over tp, and the
columns past the vocabulary (tp pads it to a multiple of tp) are cut before anything is drawn. ZeRO-3
gathers parameters in every forward, and the dp wrapper syncs buffers in it: every rank of the world must
make the same forward calls. So the prompts are walked in rounds (the most any rank holds; a rank out of
prompts runs a one-token stand-in), and each round ends only when every rank's samples are done (one
small all-reduce per token).

Refused by name (:class:`~polyshard.trainer.errors.ConfigError`): pipeline, context and expert
parallelism (pp, cp, ep > 1), sequence parallelism (one new token cannot be split over tp) and models
with multi-head latent attention (DeepSeek-V3). With ``training.compile`` the blocks run uncompiled here
(a cache that grows every step would recompile them every step), compiled again after.

Shapes: R rows (a prompt's samples), S tokens, V vocabulary (Vp padded, this rank's V/tp under tp).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import cast

import torch
import torch.distributed as dist
from torch import nn

from polyshard.collectives import ops
from polyshard.models import output_width, sequence_length, spec_of
from polyshard.models.anatomy import transformer_blocks
from polyshard.models.common import caching
from polyshard.trainer.config import Config
from polyshard.trainer.engine.engine import Engine
from polyshard.trainer.errors import ConfigError, DataError


@dataclass(frozen=True)
class Sampling:
    """How completions are drawn."""

    max_new_tokens: int
    """Most tokens a completion has (fewer when it draws a stop id)."""
    temperature: float = 1.0
    """Logits are divided by it; 0 takes the likeliest token."""
    top_p: float = 1.0
    """Nucleus: draw among the likeliest tokens whose probabilities first reach top_p (1: all)."""
    top_k: int = 0
    """Draw among the k likeliest tokens only (0: all)."""
    stop_ids: tuple[int, ...] = ()
    """A completion ends after the first of these it draws, which it keeps (as TRL keeps EOS)."""

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ConfigError(f"generation max_new_tokens={self.max_new_tokens!r} must be an integer >= 1")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ConfigError(f"generation temperature={self.temperature!r} must be >= 0 (0: the likeliest token)")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"generation top_p={self.top_p!r} must be in (0, 1] (1: no nucleus cut)")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ConfigError(f"generation top_k={self.top_k!r} must be an integer >= 0 (0: no cut)")


def check_generation(config: Config, sampling: Sampling) -> None:
    """Refuse, on every rank alike, what :func:`generate` cannot run (see the module's docstring)."""
    par = config.parallel
    for axis in ("pp", "cp", "ep"):
        if getattr(par, axis) > 1:
            raise ConfigError(
                f"parallel.{axis}={getattr(par, axis)}: generation runs on dp, tp and ZeRO layouts only; "
                f"set {axis} = 1 for a run that generates (GRPO)"
            )
    if par.tp > 1 and par.sequence_parallel:
        raise ConfigError(
            "parallel.sequence_parallel: generation feeds one token at a time, which cannot be split over tp; "
            "set sequence_parallel = false for a run that generates (GRPO)"
        )
    if spec_of(config.model).task != "language":
        raise ConfigError(f"model.kind={config.model.kind!r} is no language model: it cannot generate text")
    context = sequence_length(config.model)
    if sampling.max_new_tokens > context:
        raise ConfigError(
            f"generation max_new_tokens={sampling.max_new_tokens} is more than the context of {context} tokens"
        )


def stream_seed(seed: int, row: int, sample: int) -> int:
    """The seed of one (row, sample)'s uniform numbers: a hash of the three, the same on every layout."""
    digest = hashlib.blake2b(f"{seed}:{row}:{sample}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")  # below 2^64, as torch.Generator.manual_seed takes


def uniforms(seed: int, row: int, samples: int, length: int) -> torch.Tensor:
    """(samples, length) float64: sample j's uniform number at each position of row ``row``'s completions."""
    return torch.stack(
        [
            torch.rand(length, generator=torch.Generator().manual_seed(stream_seed(seed, row, j)), dtype=torch.float64)
            for j in range(samples)
        ]
    )


def choose_tokens(logits: torch.Tensor, u: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """(R, V) logits (the real vocabulary only) and (R,) uniforms -> (R,) token ids (see the module)."""
    if sampling.temperature == 0:
        return logits.argmax(dim=-1)
    scaled = logits.double() / sampling.temperature
    if 0 < sampling.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, sampling.top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if sampling.top_p < 1:
        ranked, order = probs.sort(dim=-1, descending=True)
        before = ranked.cumsum(dim=-1) - ranked  # the mass of the likelier tokens
        probs = probs.scatter(-1, order, ranked.masked_fill(before >= sampling.top_p, 0.0))  # keeps the likeliest
    cdf = probs.cumsum(dim=-1)  # in token-id order
    chosen = torch.searchsorted(cdf, (u.to(cdf) * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
    # u x mass rounded up to the mass would pass the end: take the last token with any probability then.
    last = torch.where(probs > 0, torch.arange(probs.shape[-1], device=probs.device), -1).amax(dim=-1)
    return torch.minimum(chosen, last)


def generate(
    engine: Engine, prompts: list[list[int]], samples: int, sampling: Sampling, *, seed: int, first_row: int
) -> list[list[int]]:
    """Every rank of the mesh calls it (collective). ``prompts``: this data rank's prompts (token ids); returns
    len(prompts) * samples completions (token ids after the prompt, at most max_new_tokens, ending at a stop id
    if one was drawn), prompt i's samples at i*samples .. i*samples+samples-1. Sampling is seeded per
    (seed, first_row + i, sample j, position), so the same prompts draw the same completions on any layout."""
    check_generation(engine.config, sampling)
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise ConfigError(f"generation samples={samples!r} must be an integer >= 1 (completions per prompt)")
    problem = _prompt_problem(prompts, engine.config, sampling, first_row)
    agreed = torch.tensor([len(prompts), problem is not None], device=engine.device)
    ops.all_reduce(agreed, op=dist.ReduceOp.MAX)  # over the world: rounds, and whether any rank refused
    if problem is not None:
        raise DataError(problem)
    if agreed[1]:
        raise DataError("another rank's generation prompts were refused (its error names the row)")
    completions: list[list[int]] = []
    with _generating(engine.stages.values()):
        for i in range(int(agreed[0])):
            if i < len(prompts):
                draws = uniforms(seed, first_row + i, samples, sampling.max_new_tokens)
                completions += _complete(engine, prompts[i], draws, sampling)
            else:  # out of prompts: a stand-in keeps this rank's forwards in step with the others'
                _complete(
                    engine, [0], torch.zeros(1, sampling.max_new_tokens, dtype=torch.float64), sampling, idle=True
                )
    return completions


def _prompt_problem(prompts: list[list[int]], config: Config, sampling: Sampling, first_row: int) -> str | None:
    vocab, context = output_width(config.model), sequence_length(config.model)
    for i, prompt in enumerate(prompts):
        where = f"generation prompt of row {first_row + i}"
        if not prompt:
            return f"{where} is empty; give every prompt at least one token"
        if any(not 0 <= t < vocab for t in prompt):
            return f"{where} holds token ids outside the vocabulary [0, {vocab})"
        if len(prompt) + sampling.max_new_tokens - 1 > context:
            return (
                f"{where} has {len(prompt)} tokens: with max_new_tokens={sampling.max_new_tokens} it needs "
                f"{len(prompt) + sampling.max_new_tokens - 1} positions, past the context of {context}; "
                "shorten the prompt or generate fewer tokens"
            )
    return None


@contextlib.contextmanager
def _generating(stages: Iterable[nn.Module]) -> Iterator[None]:
    """Eval mode (no dropout), no gradients, uncompiled blocks (``training.compile`` replaced each block's
    forward on the instance: the class's is the eager one); everything as it was after."""
    stages = list(stages)
    modules = [m for stage in stages for m in stage.modules()]
    modes = [m.training for m in modules]
    blocks = [block for stage in stages for block in transformer_blocks(stage)]
    compiled = {block: block.__dict__.pop("forward") for block in blocks if "forward" in block.__dict__}
    for module in modules:
        module.training = False
    try:
        with torch.no_grad():
            yield
    finally:
        for module, mode in zip(modules, modes):
            module.training = mode
        for block, forward in compiled.items():
            block.forward = forward  # type: ignore[method-assign]


def _complete(
    engine: Engine, prompt: list[int], draws: torch.Tensor, sampling: Sampling, *, idle: bool = False
) -> list[list[int]]:
    """One prompt's completions, one per row of ``draws`` (samples, max_new_tokens)."""
    device, rows = engine.device, draws.shape[0]
    stop = torch.tensor(sampling.stop_ids, dtype=torch.long, device=device)
    tokens: list[torch.Tensor] = []
    with caching(engine.stages[0]) as caches:
        logits = _next_logits(engine, torch.tensor([prompt], device=device), start=0)  # (1, V): prefill
        for cache in caches:
            cache.repeat_rows(rows)
        logits = logits.expand(rows, -1)
        done = torch.zeros(rows, dtype=torch.bool, device=device)
        for position in range(sampling.max_new_tokens):
            drawn = choose_tokens(logits, draws[:, position].to(device), sampling)
            tokens.append(drawn)
            done |= torch.isin(drawn, stop)
            busy = not idle and not bool(done.all())
            if position + 1 == sampling.max_new_tokens or not _anyone_busy(busy, device):
                break
            logits = _next_logits(engine, drawn.unsqueeze(1), start=len(prompt) + position)
    return [] if idle else _cut_at_stops(torch.stack(tokens, dim=1), stop)


def _next_logits(engine: Engine, tokens: torch.Tensor, start: int) -> torch.Tensor:
    """The stage forward (through its dp wrapper: ZeRO-3's gathers) of (R, S) ``tokens`` at positions
    start.. over the caches; (R, V) float32 logits of the last position, the whole real vocabulary."""
    positions = torch.arange(start, start + tokens.shape[1], device=tokens.device)
    out: torch.Tensor = engine.wrappers[0](tokens, positions=positions)[:, -1]
    head = engine.stages[0][-1]
    if not getattr(head, "logits", True):  # chunked loss: the head gave normed hidden states
        out = cast(nn.Module, head.proj)(out)
    if engine.tp_group is not None:  # this rank's vocabulary columns -> all of them, padding included
        out = ops.all_gather(out.contiguous(), dim=-1, group=engine.tp_group)
    return out[:, : engine.vocab_width].float()


def _anyone_busy(busy: bool, device: torch.device) -> bool:
    """Whether any rank of the world still has a sample to draw (every rank calls it at every token)."""
    flag = torch.tensor([float(busy)], device=device)
    ops.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _cut_at_stops(tokens: torch.Tensor, stop: torch.Tensor) -> list[list[int]]:
    """(R, T) drawn tokens -> each row up to and including its first stop id."""
    out, stops = [], set(stop.tolist())
    for row in tokens.tolist():
        end = next((k + 1 for k, t in enumerate(row) if t in stops), len(row))
        out.append(row[:end])
    return out
