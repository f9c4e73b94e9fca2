"""GRPO's rewards: the functions ``[[grpo.rewards]]`` names, called TRL's way, and two built-ins.

A reward function has TRL's signature, so one written for ``trl.GRPOTrainer`` carries over::

    def reward(prompts: list[str], completions: list[str], **columns) -> list[float | None]

``columns`` are the data rows' other fields (e.g. ``answer``), each a list aligned with ``completions``
(a prompt's row repeated for each of its completions); ``completion_ids`` (the token ids) is passed too
when the caller has them. TRL's ``trainer_state``, ``log_extra`` and ``log_metric`` are not. ``None``
means "does not apply to this completion" (TRL's convention): it counts as NaN, which the weighted sum
over functions skips (:func:`total_rewards`, TRL's ``nansum``); a completion no function scores gets
advantage 0. A function that raises, returns another length, a non-number or NaN stops the run with a
:class:`RewardError` naming the function, the step and the prompt concerned.

Shapes: B completions (rows), F reward functions.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import numbers
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from polyshard.trainer.config.grpo import BUILTIN_REWARDS, RewardSpec
from polyshard.trainer.errors import ConfigError, RewardError

RewardFunction = Callable[..., Sequence[Any]]

ANSWER_MARKERS = re.compile(r"answer:|####", re.IGNORECASE)
DEFAULT_FORMAT = r"(?is).*(?:answer:|####)[ \t]*\S.*"
"""format_regex's pattern for rows without a ``format`` field: an answer marker followed by some text."""


def answer_of(completion: str) -> str:
    """The answer a completion gives: the rest of the line after its last ``answer:`` (any case) or
    ``####`` (GSM8K's marker), stripped; without a marker, the whole completion stripped."""
    found = list(ANSWER_MARKERS.finditer(completion))
    if not found:
        return completion.strip()
    return completion[found[-1].end() :].split("\n", 1)[0].strip()


def exact_answer(prompts: list[str], completions: list[str], answer: list[Any] | None = None, **_: Any) -> list[float]:
    """1.0 where the completion's answer (:func:`answer_of`) equals the row's ``answer`` field (as text,
    stripped), else 0.0. Case and spacing inside the answer count: ``"12"`` is not ``"12.0"``."""
    if answer is None:
        raise ValueError("it needs an 'answer' field in every data row (the text a completion must give)")
    return [float(answer_of(text) == str(expected).strip()) for text, expected in zip(completions, answer)]


def format_regex(prompts: list[str], completions: list[str], format: list[Any] | None = None, **_: Any) -> list[float]:
    """1.0 where the whole completion matches the row's ``format`` field (a Python regular expression;
    ``.`` also matches newlines), or :data:`DEFAULT_FORMAT` (an ``answer:``/``####`` marker followed by
    text) when the rows have none, else 0.0."""
    patterns = format if format is not None else [DEFAULT_FORMAT] * len(completions)
    scores = []
    for text, pattern in zip(completions, patterns):
        try:
            compiled = re.compile(str(pattern), re.DOTALL)
        except re.error as err:
            raise ValueError(f"the row's format {pattern!r} is no regular expression ({err})") from err
        scores.append(float(compiled.fullmatch(text) is not None))
    return scores


BUILTINS: dict[str, RewardFunction] = {"exact_answer": exact_answer, "format_regex": format_regex}


@dataclass(frozen=True)
class Reward:
    """A reward function ready to call: its name (TRL's: the function's), the callable and its weight."""

    name: str
    function: RewardFunction
    weight: float


def load_rewards(specs: Sequence[RewardSpec]) -> list[Reward]:
    """The functions ``specs`` name, imported once (call it before any process starts, so a module that does
    not import is one line at launch): a built-in's name, ``module:function`` or ``file.py:function``."""
    return [Reward(*_resolve(i, spec), spec.weight) for i, spec in enumerate(specs)]


def _resolve(index: int, spec: RewardSpec) -> tuple[str, RewardFunction]:
    where = f"grpo.rewards[{index}].function={spec.function!r}"
    if ":" not in spec.function:
        if spec.function not in BUILTINS:
            raise ConfigError(f"{where} is no built-in {list(BUILTIN_REWARDS)}; give one, or module:function")
        return spec.function, BUILTINS[spec.function]
    module_name, _, name = spec.function.rpartition(":")
    try:
        module = _load_file(module_name) if module_name.endswith(".py") else importlib.import_module(module_name)
    except Exception as err:  # the user's module may fail in any way while it runs its top level
        raise ConfigError(f"{where}: {module_name} does not import ({type(err).__name__}: {_one_line(err)})") from err
    function = getattr(module, name, None)
    if not callable(function):
        found = "is missing" if function is None else f"is not a function ({type(function).__name__})"
        raise ConfigError(f"{where}: {name} in {module_name} {found}; name a function of the module")
    return name, function


def _load_file(path: str) -> Any:
    """A module from a .py file (relative to the working directory), registered under its stem so that
    pickling and tracebacks can find it."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"no file {file.resolve()}")
    spec = importlib.util.spec_from_file_location(file.stem, file)
    if spec is None or spec.loader is None:
        raise ImportError(f"{file} cannot be loaded as a module")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(file.stem, module)
    spec.loader.exec_module(module)
    return module


def score(
    rewards: Sequence[Reward],
    prompts: list[str],
    completions: list[str],
    columns: dict[str, list[Any]],
    *,
    step: int,
    completion_ids: list[list[int]] | None = None,
) -> torch.Tensor:
    """(B, F) float32: each function's score of each completion, NaN where it returned None. ``columns``:
    the rows' other fields, each a list of B. A :class:`RewardError` (one line) when a function fails."""
    extra = dict(columns) if completion_ids is None else {**columns, "completion_ids": completion_ids}
    out = torch.empty(len(completions), len(rewards), dtype=torch.float32)
    for k, reward in enumerate(rewards):
        try:
            values = reward.function(prompts=prompts, completions=completions, **extra)
        except Exception as err:  # the user's function may fail in any way: name it, the step and the prompt
            raise _error(reward, step, prompts, 0, f"raised {type(err).__name__}: {_one_line(err)}") from err
        if isinstance(values, torch.Tensor | np.ndarray):
            values = values.tolist()
        if not isinstance(values, Sequence) or isinstance(values, str) or len(values) != len(completions):
            size = f"{len(values)} values" if isinstance(values, Sequence) else f"a {type(values).__name__}"
            raise _error(reward, step, prompts, 0, f"returned {size} for {len(completions)} completions")
        for row, value in enumerate(values):
            out[row, k] = _number(value, reward, step, prompts, row)
    return out


def _number(value: Any, reward: Reward, step: int, prompts: list[str], row: int) -> float:
    if value is None:
        return math.nan  # TRL: "not applicable", skipped by the weighted sum
    if not isinstance(value, numbers.Real):
        raise _error(reward, step, prompts, row, f"returned {value!r} for completion {row}, not a number or None")
    if not math.isfinite(value):
        raise _error(reward, step, prompts, row, f"returned {value} for completion {row}; return None to skip one")
    return float(value)


def total_rewards(scores: torch.Tensor, weights: Sequence[float]) -> torch.Tensor:
    """(B,) the weighted sum of (B, F) ``scores`` over the functions, NaN scores skipped (TRL's nansum),
    and NaN where no function scored the completion (TRL then gives it advantage 0)."""
    weighted = (scores * torch.tensor(weights, dtype=scores.dtype).unsqueeze(0)).nansum(dim=1)
    return weighted.masked_fill(scores.isnan().all(dim=1), math.nan)


def nanstd(values: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The unbiased (Bessel-corrected) standard deviation of the values that are not NaN, as TRL's
    ``nanstd``: NaN where fewer than two are."""
    mean = torch.nanmean(values, dim=dim, keepdim=True)
    variance = torch.nanmean((values - mean) ** 2, dim=dim, keepdim=True)
    count = (~values.isnan()).sum(dim=dim, keepdim=True)
    correction = torch.where(count > 1, count / (count - 1), torch.full_like(variance, math.nan))
    std = torch.sqrt(variance * correction)
    return std.squeeze() if dim is None else std.squeeze(dim)


def reward_metrics(scores: torch.Tensor, rewards: Sequence[Reward]) -> dict[str, float]:
    """TRL's reward metrics of a generation batch's (B, F) scores: each function's mean and std over the
    completions it scored, and the weighted reward's mean and std."""
    figures: dict[str, float] = {}
    for k, reward in enumerate(rewards):
        figures[f"rewards/{reward.name}/mean"] = float(torch.nanmean(scores[:, k]))
        figures[f"rewards/{reward.name}/std"] = float(nanstd(scores[:, k]))
    total = total_rewards(scores, [r.weight for r in rewards])
    figures["reward"], figures["reward_std"] = float(torch.nanmean(total)), float(nanstd(total))
    return figures


def _error(reward: Reward, step: int, prompts: list[str], row: int, what: str) -> RewardError:
    prompt = prompts[row] if row < len(prompts) else ""
    shown = prompt if len(prompt) <= 60 else prompt[:57] + "..."
    return RewardError(f"reward function {reward.name!r} {what} at step {step} (prompt {shown!r})")


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or "(no message)"
