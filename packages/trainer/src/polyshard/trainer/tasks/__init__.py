"""What a model learns to do: its data, how a batch splits into inputs and targets, and its loss.

A :class:`~polyshard.models.spec.ModelSpec` names one task. Two exist, and a third a config picks
(``training.task``, :func:`task_for`):

* :data:`LANGUAGE`: next-token prediction on tokenized text, or on prompt/response pairs for
  fine-tuning (a ``.jsonl`` source). A row of ``context_length + 1`` tokens gives the inputs (all
  but the last) and the targets (all but the first; a fine-tuning row takes them from its
  ``labels``, IGNORE_INDEX on prompt and padding). The loss is cross-entropy over the vocabulary,
  vocabulary-parallel under tp, averaged over the counted tokens of the global batch
  (:mod:`polyshard.trainer.tasks.loss`).
* :data:`IMAGES`: image classification (the built-in digits). Inputs are images, targets labels;
  evaluation also reports accuracy.
* :data:`PREFERENCES` (``training.task = "dpo"``): a language model trained on preference pairs, each
  pair two adjacent rows of a batch (:mod:`polyshard.trainer.data.preferences`), with DPO's loss against
  a frozen reference (:mod:`polyshard.trainer.tasks.dpo`, :mod:`polyshard.trainer.loop.reference`).
* :data:`ROLLOUTS` (``training.task = "grpo"``): a language model trained on its own completions of
  prompts (:mod:`polyshard.trainer.data.prompts`), scored by reward functions, with GRPO's clipped loss
  (:mod:`polyshard.trainer.tasks.grpo`); the rows come from generation on the training mesh
  (:mod:`polyshard.trainer.loop.rollouts`), not from the loader, which serves prompt numbers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from polyshard.models import ModelConfig, output_width, spec_of
from polyshard.tp import chunked_linear_cross_entropy, head_input, vocab_parallel_cross_entropy
from polyshard.trainer.config import Config
from polyshard.trainer.config.dpo import DPOConfig
from polyshard.trainer.data import RunData, check_language_data, digits_splits, language_data
from polyshard.trainer.data.language import is_prepared
from polyshard.trainer.data.preferences import check_preference_data, preference_data
from polyshard.trainer.data.prompts import check_prompt_data, prompt_data
from polyshard.trainer.errors import ConfigError
from polyshard.trainer.tasks.dpo import PreferenceLoss
from polyshard.trainer.tasks.grpo import GRPOLoss
from polyshard.trainer.tasks.loss import IGNORE_INDEX, TokenMeanLoss
from polyshard.trainer.tasks.rewards import load_rewards

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Task:
    name: str
    splits: Callable[[Config], RunData]
    """The training sources and validation examples, read on every rank (rank 0 first: it may write caches)."""
    check_config: Callable[[Config], None]
    """Checks of the data settings against the task (no file is read): part of ``validate``."""
    check_data: Callable[[Config], None]
    """Checks of the data itself before any process starts (a missing file, too few examples)."""
    split_batch: Callable[[dict[str, torch.Tensor]], tuple[torch.Tensor, torch.Tensor]]
    """A loader batch -> (inputs, targets)."""
    loss: Callable[[Config, dist.ProcessGroup | None, nn.Module | None], LossFn]
    """The last stage's loss on (outputs, targets); the tp group when tp > 1; the model's last layer on the
    rank holding it (a chunked loss projects with its weight), else None."""
    reports_accuracy: bool = False
    """Evaluation also counts outputs whose argmax is the target."""
    generates_text: bool = False
    """A model of this task samples text (the end-of-run sample, ``polyshard generate``)."""
    input_segments: Callable[[dict[str, torch.Tensor]], torch.Tensor] | None = None
    """A loader batch -> its inputs' document ids (document masking); None: the task has no documents."""


def _text_splits(config: Config) -> RunData:
    return language_data(config)


def _text_settings(config: Config) -> None:
    if config.data.source == "digits":
        raise ConfigError(
            f"data.source='digits' is an image dataset and model.kind={config.model.kind!r} reads text; "
            "it needs model.kind='vit', or give a text source"
        )


def _check_text(config: Config) -> None:
    check_language_data(config)


def _next_tokens(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens shifted by one; fine-tuning rows take their targets from ``labels``."""
    tokens = batch["tokens"]
    return tokens[:, :-1].contiguous(), batch.get("labels", tokens)[:, 1:].contiguous()


def _input_segments(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The inputs' document ids: the batch's ``segments`` cut as the inputs are (all but the last). The
    last token of a document (its end-of-text) still has the next document's first token as its target,
    as in Megatron-LM and torchtitan: only attention and positions stop at document boundaries."""
    if "segments" not in batch:
        raise ConfigError(
            f"data.document_mask = true needs each batch's document ids (a 'segments' column) but the batch "
            f"holds only {sorted(batch)}; use a data source that marks documents, or set data.document_mask = false"
        )
    return batch["segments"][:, :-1].contiguous()


def _token_loss(config: Config, tp_group: dist.ProcessGroup | None, head: nn.Module | None) -> LossFn:
    """Cross-entropy of (B, S, V) logits against (B, S) token ids, summed over the targets that are not
    IGNORE_INDEX and divided by the global batch's count of them: vocabulary-parallel under tp. With
    ``training.loss_chunks`` > 1 the outputs are the head's normed (B, S, H) hidden states instead
    (``LMHead(logits=False)``) and the loss projects them with ``head.proj``, a chunk of tokens at a time."""
    if config.training.loss_chunks > 1:
        return TokenMeanLoss(_chunked_token_sum(config, tp_group, head))
    if tp_group is not None:
        vocab = output_width(config.model)
        return TokenMeanLoss(
            lambda logits, targets: vocab_parallel_cross_entropy(
                logits.float(), targets, tp_group, vocab_size=vocab, ignore_index=IGNORE_INDEX, reduction="sum"
            )
        )
    return TokenMeanLoss(
        lambda logits, targets: F.cross_entropy(
            logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
        )
    )


def _chunked_token_sum(
    config: Config, tp_group: dist.ProcessGroup | None, head: nn.Module | None
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    chunks, vocab = config.training.loss_chunks, output_width(config.model)

    def token_sum(hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if head is None:  # only the last stage computes the loss, and it holds the head
            raise RuntimeError("the chunked loss was called on a rank that holds no output head")
        projection = cast(nn.Module, head.proj)
        entered = head_input(projection, hidden)  # (B, S, H): under sequence parallelism, gathered
        return chunked_linear_cross_entropy(
            entered.flatten(0, 1),
            cast(torch.Tensor, projection.weight),
            targets.flatten(),
            tp_group,
            chunks=chunks,
            bias=cast(torch.Tensor | None, projection.bias),
            vocab_size=vocab,
            ignore_index=IGNORE_INDEX,
        )

    return token_sum


def _image_splits(config: Config) -> RunData:
    return digits_splits(config.data.val_fraction, seed=config.training.seed)


def _image_settings(config: Config) -> None:
    if config.data.source != "digits":
        raise ConfigError(
            f"model.kind={config.model.kind!r} trains on images; set data.source='digits' (got {config.data.source!r})"
        )


def _labels(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return batch["image"], batch["label"]


def _class_loss(config: Config, tp_group: dist.ProcessGroup | None, head: nn.Module | None) -> LossFn:
    """Cross-entropy of (B, classes) logits; the classifier head is replicated over tp."""
    return lambda logits, labels: F.cross_entropy(logits.float(), labels)


def _no_check(config: Config) -> None:
    """The built-in digits need no reading ahead."""


LANGUAGE = Task(
    "language",
    _text_splits,
    _text_settings,
    _check_text,
    _next_tokens,
    _token_loss,
    generates_text=True,
    input_segments=_input_segments,
)
IMAGES = Task("images", _image_splits, _image_settings, _no_check, _labels, _class_loss, reports_accuracy=True)


def _aligned_settings(config: Config, task: str, data: str) -> None:
    """What DPO and GRPO share: a language model, one .jsonl of ``data``, none of the token-stream features."""
    if spec_of(config.model).task != LANGUAGE.name:
        raise ConfigError(
            f"training.task = {task!r} trains a language model; model.kind={config.model.kind!r} is not one "
            "(use a GPT or Llama family)"
        )
    # DPO also reads a folder that `polyshard prepare --kind preferences` wrote (its kind is checked on reading)
    prepared = task == "dpo" and is_prepared(config.data.source)
    if not (config.data.source.endswith(".jsonl") or prepared) or config.data.sources is not None:
        also = " or a prepared folder of them" if task == "dpo" else ""
        raise ConfigError(
            f"training.task = {task!r} reads one .jsonl of {data}{also}; data.source={config.data.source!r} is not "
            "one (and no [[data.sources]])"
        )
    for what, on in (
        ("training.loss_chunks > 1", config.training.loss_chunks > 1),
        ("model.mtp_depth > 0", config.model.prediction_depth > 0),
        ("data.document_mask", config.data.document_mask),
        ("data.packing", config.data.packing),
    ):
        if on:
            raise ConfigError(f"training.task = {task!r} does not run with {what} yet; turn it off for this run")


def _preference_settings(config: Config) -> None:
    _aligned_settings(config, "dpo", 'preference pairs {"prompt", "chosen", "rejected"}')


def _pairs_as_rows(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(b, 2, width) pairs -> 2b adjacent rows (chosen, rejected), cut into inputs and targets as text is."""
    tokens, labels = batch["tokens"].flatten(0, 1), batch["labels"].flatten(0, 1)
    return tokens[:, :-1].contiguous(), labels[:, 1:].contiguous()


def _preference_loss(config: Config, tp_group: dist.ProcessGroup | None, head: nn.Module | None) -> LossFn:
    return PreferenceLoss(config.dpo or DPOConfig(), tp_group, output_width(config.model))


PREFERENCES = Task(
    "dpo",
    preference_data,
    _preference_settings,
    check_preference_data,
    _pairs_as_rows,
    _preference_loss,
    generates_text=True,
)


def _rollout_settings(config: Config) -> None:
    _aligned_settings(config, "grpo", 'prompts {"prompt": ...} with the columns the rewards read')
    if config.grpo is None:
        raise ConfigError("training.task = 'grpo' needs a [grpo] section with at least one [[grpo.rewards]]")
    # Generation runs the stages one token at a time on every rank of a replica: no pipeline schedule,
    # no experts exchanged between ranks, no sequence cut into cp chunks (loop.generation; a compiled run
    # generates uncompiled).
    for what, on in (
        ("parallel.pp > 1", config.parallel.pp > 1),
        ("parallel.cp > 1", config.parallel.cp > 1),
        ("parallel.ep > 1", config.parallel.ep > 1),
        ("parallel.sequence_parallel", config.parallel.sequence_parallel),  # one new token splits no further
    ):
        if on:
            raise ConfigError(
                f"training.task = 'grpo' generates on the training mesh, which does not run with {what} yet; "
                "turn it off (dp, ZeRO and tp generate)"
            )
    if config.training.global_batch_size % config.parallel.data_ranks:
        raise ConfigError(
            f"training.global_batch_size={config.training.global_batch_size} prompts must split evenly over the "
            f"{config.parallel.data_ranks} data ranks (each generates for whole prompts)"
        )


def _check_rollout_data(config: Config) -> None:
    """Before any process starts: the prompts read and fit, and every reward function imports."""
    check_prompt_data(config)
    if config.grpo is not None:
        load_rewards(config.grpo.rewards)


def _generated_rows(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """A GRPO loader batch holds prompt numbers; its rows are made by generation (loop.rollouts)."""
    raise RuntimeError("a GRPO batch is made by generation (polyshard.trainer.loop.rollouts), not cut from the loader")


def _rollout_loss(config: Config, tp_group: dist.ProcessGroup | None, head: nn.Module | None) -> LossFn:
    if config.grpo is None:
        raise ConfigError("training.task = 'grpo' needs a [grpo] section")
    return GRPOLoss(config.grpo, tp_group, output_width(config.model))


ROLLOUTS = Task(
    "grpo",
    prompt_data,
    _rollout_settings,
    _check_rollout_data,
    _generated_rows,
    _rollout_loss,
    generates_text=True,
)

TASKS: dict[str, Task] = {task.name: task for task in (LANGUAGE, IMAGES)}
"""Every task by the name a family's spec gives (``ModelSpec.task``)."""


def task_of(model: ModelConfig) -> Task:
    """What ``model``'s family learns: its data, batches and loss."""
    name = spec_of(model).task
    if name not in TASKS:
        raise ConfigError(f"model.kind={model.kind!r} names task {name!r}; the trainer knows {list(TASKS)}")
    return TASKS[name]


ALIGNMENT: dict[str, Task] = {task.name: task for task in (PREFERENCES, ROLLOUTS)}
"""The tasks ``training.task`` names: trained on a language model's own data formats."""


def task_for(config: Config) -> Task:
    """What this run trains: ``training.task`` when it names one (``"dpo"``, ``"grpo"``), else the family's."""
    named = ALIGNMENT.get(config.training.task or "")
    for section, value in (("dpo", config.dpo), ("grpo", config.grpo)):
        if value is not None and (named is None or named.name != section):
            raise ConfigError(
                f"a [{section}] section is set but training.task is not {section!r}; set training.task = "
                f"{section!r} or drop [{section}]"
            )
    return named or task_of(config.model)
