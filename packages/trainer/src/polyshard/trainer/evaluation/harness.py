"""lm-evaluation-harness's ``LM`` for a polyshard model on the mesh.

:class:`MeshLM` subclasses lm_eval's ``TemplateLM``, so a request is tokenized exactly as lm_eval's
Hugging Face backend does it (a context's trailing spaces moved into the continuation, an empty context
replaced by the end-of-text token, documents cut into rolling windows), and truncated as that backend
truncates (from the left, to the model's context length). The tokens are then scored or continued by
:class:`~polyshard.trainer.evaluation.scoring.MeshScorer` on whatever layout the engine has.

Every rank runs the same ``simple_evaluate`` over the same requests (lm_eval sees one process:
``rank`` 0, ``world_size`` 1); the scorer deals the requests to the data ranks and hands every rank
all the answers, so lm_eval's metrics come out alike everywhere and rank 0 reports them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import lm_eval
import torch
import torch.distributed as dist
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import (
    handle_stop_sequences,
    normalize_gen_kwargs,
    postprocess_generated_text,
)

from polyshard.checkpoint import TOKENIZER, Checkpoint
from polyshard.data.tokenizer import Tokenizer, load_tokenizer
from polyshard.mesh import Mesh
from polyshard.trainer.checkpointing.run_reshard import load_into
from polyshard.trainer.config import Config
from polyshard.trainer.engine.builder import build_engine
from polyshard.trainer.evaluation import EvaluationError
from polyshard.trainer.evaluation.scoring import MeshScorer

DEFAULT_MAX_GEN_TOKS = 256  # what lm_eval's Hugging Face backend generates when a task does not say


def evaluate_checkpoint(
    source: Checkpoint,
    config: Config,
    mesh: Mesh,
    tasks: Sequence[str],
    task_manager: Any,
    *,
    batch_size: int = 1,
    **options: Any,
) -> dict[str, Any] | None:
    """lm_eval's ``simple_evaluate`` of ``tasks`` (which ``task_manager`` knows) on ``source``'s weights, laid out
    as ``config`` (:func:`~polyshard.trainer.evaluation.layout.evaluation_config`) says on ``mesh``. Every rank
    calls it; ``options`` go to ``simple_evaluate`` (``limit``, ``num_fewshot``, ``log_samples``...). Returns
    lm_eval's results on the first local process (lm_eval returns None elsewhere)."""
    # This rank's GPU under NCCL (init_distributed set it from LOCAL_RANK), else the CPU: as training places it.
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    engine = build_engine(config, mesh, device=device)
    load_into(engine, source, weights_only=True)
    saved = source.asset(TOKENIZER)  # the run's own tokenizer, saved with its checkpoints
    tokenizer = load_tokenizer(str(saved) if saved else config.data.tokenizer)
    model = MeshLM(MeshScorer(engine, batch_size), tokenizer)
    results: dict[str, Any] | None = lm_eval.simple_evaluate(
        model=model, tasks=list(tasks), task_manager=task_manager, **options
    )
    return results


class MeshLM(TemplateLM):  # type: ignore[misc]  # lm_eval is untyped
    """``loglikelihood``, ``loglikelihood_rolling`` and ``generate_until`` (greedy) on the mesh."""

    def __init__(self, scorer: MeshScorer, tokenizer: Tokenizer):
        super().__init__()
        self.scorer, self.text = scorer, tokenizer

    @property
    def eot_token_id(self) -> int:
        if self.text.end_of_text is None:
            raise EvaluationError(
                "this task needs an end-of-text token (lm_eval puts it before an empty context and a rolling "
                "window, and stops generation at it) but the run's tokenizer has none; train with a "
                "tokenizer that has one (e.g. `polyshard tokenizer` with an end-of-text token)"
            )
        return self.text.end_of_text

    @property
    def max_length(self) -> int:
        return self.scorer.max_length

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        return self.text.encode(string)

    def _loglikelihood_tokens(
        self, requests: Sequence[tuple[Any, list[int], list[int]]], disable_tqdm: bool = False, **kwargs: Any
    ) -> list[tuple[float, bool]]:
        rows = []
        for _, context, continuation in requests:
            if len(continuation) > self.max_length:
                raise EvaluationError(
                    f"a continuation of {len(continuation)} tokens is longer than the model's context of "
                    f"{self.max_length} positions (model.context_length); choose a task with shorter answers"
                )
            # As lm_eval's HF backend: the last max_length + 1 tokens, the model reading all but the last.
            rows.append(((context + continuation)[-(self.max_length + 1) :], len(continuation)))
        return [(scored.logprob, scored.greedy) for scored in self.scorer.score(rows)]

    def loglikelihood_rolling(self, requests: Sequence[Any], disable_tqdm: bool = False) -> list[float]:
        windows: list[tuple[Any, list[int], list[int]]] = []
        counts = []
        for (text,) in (request.args for request in requests):
            mine = [
                lm_utils.make_disjoint_window(window)
                for window in lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(text),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                )
            ]
            windows += [(None, context, continuation) for context, continuation in mine]
            counts.append(len(mine))
        scores = self._loglikelihood_tokens(windows)
        totals, start = [], 0
        for count in counts:
            totals.append(sum(logprob for logprob, _ in scores[start : start + count]))
            start += count
        return totals

    def generate_until(self, requests: Sequence[Any], disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations, each cut at its first stop string; requests with the same generation
        settings run together."""
        answers: list[str] = [""] * len(requests)
        groups: dict[str, list[int]] = {}
        for i, request in enumerate(requests):
            groups.setdefault(json.dumps(request.args[1], sort_keys=True, default=str), []).append(i)
        for indices in groups.values():
            settings = requests[indices[0]].args[1]
            texts = self._generate([requests[i].args[0] for i in indices], settings)
            for i, text in zip(indices, texts):
                answers[i] = text
        return answers

    def _generate(self, contexts: Sequence[str], settings: dict[str, Any]) -> list[str]:
        kwargs = normalize_gen_kwargs(settings, DEFAULT_MAX_GEN_TOKS)
        if kwargs.get("do_sample") or float(kwargs.get("temperature") or 0.0) > 0.0:
            raise EvaluationError(
                f"the task samples (generation_kwargs {settings}); polyshard eval generates greedily only: "
                "choose a task whose generation_kwargs say do_sample: false"
            )
        end = self.text.end_of_text
        until = handle_stop_sequences(kwargs.pop("until", None), eos=None if end is None else self.text.decode([end]))
        max_new = int(kwargs.pop("max_gen_toks"))
        room = self.max_length - max_new
        if room <= 0:
            raise EvaluationError(
                f"the task asks for up to {max_new} new tokens (max_gen_toks) and the model reads "
                f"{self.max_length} positions (model.context_length); give the task a smaller max_gen_toks"
            )
        prompts = [self.tok_encode(context)[-room:] for context in contexts]  # left-truncated, as lm_eval's HF

        def done(new: list[int]) -> bool:
            return new[-1] == end or any(stop and stop in self.text.decode(new) for stop in until)

        continuations = self.scorer.generate(prompts, max_new, done)
        # The end-of-text token is special: Hugging Face decodes without it (skip_special_tokens).
        texts = [self.text.decode([t for t in tokens if t != end]) for tokens in continuations]
        return [postprocess_generated_text(generation=text, stop=until, think_end_token=None) for text in texts]
