"""GRPO's rewards: the built-ins, functions named "module:function" or "file.py:function" and called TRL's
way, each way a reward can fail as one line naming the function, the step and the prompt, and the
[[grpo.rewards]] entries' errors."""

import dataclasses
import math
import statistics
import textwrap

import numpy as np
import pytest
import torch

from polyshard.trainer.config import from_dict
from polyshard.trainer.config.grpo import BUILTIN_REWARDS, GRPOConfig, RewardSpec
from polyshard.trainer.errors import ConfigError, RewardError
from polyshard.trainer.tasks.rewards import (
    BUILTINS,
    DEFAULT_FORMAT,
    Reward,
    answer_of,
    exact_answer,
    format_regex,
    load_rewards,
    reward_metrics,
    score,
    total_rewards,
)

PROMPTS = ["What is 2 + 3?", "Reverse abc."]


def _reward(function, name: str = "custom", weight: float = 1.0) -> Reward:
    return Reward(name, function, weight)


# -- built-ins ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("completion", "answer"),
    [
        ("2 + 3 makes 5.\nAnswer: 5", "5"),  # the marker in any case
        ("answer: 4, no wait... answer: 5\nsince 2 + 3 = 5", "5"),  # the last marker, up to the end of its line
        ("#### 5", "5"),  # GSM8K's marker
        ("  5 \n", "5"),  # no marker: the whole completion, stripped
        ("answer:", ""),
    ],
)
def test_the_answer_is_the_rest_of_the_line_after_the_last_marker(completion, answer):
    assert answer_of(completion) == answer


def test_exact_answer_compares_with_the_rows_answer_as_text():
    completions = ["Answer: 5", "answer: cba", "Answer: 5.0", "6"]
    got = exact_answer(PROMPTS * 2, completions, answer=[5, "cba ", "5", "5"])
    assert got == [1.0, 1.0, 0.0, 0.0]  # an int field matches its text; "5.0" is not "5"


def test_format_regex_matches_the_whole_completion_against_the_rows_or_the_default_pattern():
    completions = ["thinking...\nanswer: 12", "no marker here", "<a>x</a>", "<a>x</a> and more"]
    assert format_regex(PROMPTS * 2, completions) == [1.0, 0.0, 0.0, 0.0]
    assert format_regex(PROMPTS * 2, completions, format=[DEFAULT_FORMAT] * 2 + [r"<a>.*</a>"] * 2) == [1, 0, 1, 0]
    assert format_regex(["p"], ["line one\nanswer: 3"], format=[r"line.*\d"]) == [1.0]  # . spans lines


def test_the_builtins_are_the_ones_the_settings_accept():
    assert set(BUILTINS) == set(BUILTIN_REWARDS)
    assert [r.function for r in load_rewards([RewardSpec(name) for name in BUILTIN_REWARDS])] == list(BUILTINS.values())


# -- calling -------------------------------------------------------------------------------------------------
def test_scores_are_per_function_columns_with_none_as_nan_and_the_rows_fields_passed():
    seen = {}

    def trl_style(prompts, completions, completion_ids, **kwargs):  # a TRL reward function, unchanged
        seen.update(kwargs, completion_ids=completion_ids)
        return [float(len(c)) for c in completions]

    rewards = [
        _reward(trl_style, "length", 0.5),
        _reward(lambda prompts, completions, **_: [None, 1], "sometimes"),
        _reward(lambda prompts, completions, **_: np.array([0.25, 0.75]), "array"),
    ]
    got = score(rewards, PROMPTS, ["abc", "de"], {"answer": ["5", "cba"]}, step=4, completion_ids=[[1, 2], [3]])
    assert got.dtype == torch.float32 and got.shape == (2, 3)
    assert got[:, 0].tolist() == [3.0, 2.0] and math.isnan(got[0, 1]) and got[:, 2].tolist() == [0.25, 0.75]
    assert seen == {"answer": ["5", "cba"], "completion_ids": [[1, 2], [3]]}
    totals = total_rewards(got, [r.weight for r in rewards])
    assert totals.tolist() == [1.5 + 0.25, 1.0 + 1.0 + 0.75]  # the None counts nothing (TRL's nansum)


def test_a_completion_no_function_scores_has_a_nan_total():
    scores = torch.tensor([[math.nan, math.nan], [1.0, math.nan]])
    totals = total_rewards(scores, [1.0, 2.0])
    assert math.isnan(totals[0]) and totals[1] == 1.0


def test_reward_metrics_are_trls_means_and_unbiased_stds_over_the_scored_completions():
    scores = torch.tensor([[1.0, 0.0], [0.0, math.nan], [1.0, 1.0], [1.0, 0.0]])
    rewards = [_reward(None, "right", 1.0), _reward(None, "short", 0.5)]
    got = reward_metrics(scores, rewards)
    assert got["rewards/right/mean"] == 0.75 and got["rewards/short/mean"] == pytest.approx(1 / 3)
    assert got["rewards/right/std"] == pytest.approx(statistics.stdev([1, 0, 1, 1]))
    assert got["rewards/short/std"] == pytest.approx(statistics.stdev([0, 1, 0]))
    totals = [1.0, 0.0, 1.5, 1.0]
    assert got["reward"] == pytest.approx(statistics.fmean(totals))
    assert got["reward_std"] == pytest.approx(statistics.stdev(totals))


def _boom(prompts, completions, **_):
    raise ZeroDivisionError("division by zero\nin the user's code")


@pytest.mark.parametrize(
    ("function", "message"),
    [
        (_boom, r"'custom' raised ZeroDivisionError: division by zero in the user's code at step 7"),
        (lambda prompts, completions, **_: [1.0], r"'custom' returned 1 values for 2 completions at step 7"),
        (lambda prompts, completions, **_: 1.0, r"'custom' returned a float for 2 completions at step 7"),
        (lambda prompts, completions, **_: [1.0, "high"], r"returned 'high' for completion 1, not a number or None"),
        (lambda prompts, completions, **_: [1.0, math.nan], r"returned nan for completion 1; return None to skip one"),
        (lambda prompts, completions, **_: [math.inf, 0], r"returned inf for completion 0; return None to skip one"),
        (exact_answer, r"'custom' raised ValueError: it needs an 'answer' field in every data row"),
    ],
)
def test_a_failing_reward_is_one_line_naming_the_function_the_step_and_the_prompt(function, message):
    with pytest.raises(RewardError, match=message) as caught:
        score([_reward(function)], PROMPTS, ["x", "y"], {}, step=7)
    text = str(caught.value)
    assert "\n" not in text and "at step 7" in text
    bad_row = 1 if "completion 1" in text else 0
    assert f"(prompt {PROMPTS[bad_row]!r})" in text
    assert isinstance(caught.value, ConfigError)  # a user's mistake: the worker reports it in one line, exit 2


def test_a_long_prompt_is_shortened_in_the_message():
    with pytest.raises(RewardError, match=r"\(prompt 'x{57}\.\.\.'\)"):
        score([_reward(_boom)], ["x" * 500], ["y"], {}, step=1)


def test_a_row_with_a_bad_format_pattern_is_named():
    with pytest.raises(RewardError, match=r"'format_regex' raised ValueError: the row's format '\(' is no regular"):
        score(load_rewards([RewardSpec("format_regex")]), ["p"], ["c"], {"format": ["("]}, step=2)


# -- loading -------------------------------------------------------------------------------------------------
@pytest.fixture
def module_dir(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        textwrap.dedent(
            """
            LIMIT = 3

            def brevity(prompts, completions, **kwargs):
                return [1.0 if len(c) <= LIMIT else 0.0 for c in completions]
            """
        )
    )
    (tmp_path / "broken_rewards.py").write_text("import not_a_module_anywhere\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_module_and_file_functions_load_once_and_score(module_dir):
    rewards = load_rewards([RewardSpec("my_rewards:brevity", 2.0), RewardSpec("my_rewards.py:brevity")])
    assert [(r.name, r.weight) for r in rewards] == [("brevity", 2.0), ("brevity", 1.0)]
    assert score(rewards, PROMPTS, ["abc", "abcd"], {}, step=1).tolist() == [[1.0, 1.0], [0.0, 0.0]]


@pytest.mark.parametrize(
    ("function", "message"),
    [
        ("no_such_module_xyz:f", r"no_such_module_xyz does not import \(ModuleNotFoundError: No module named"),
        ("broken_rewards:f", r"broken_rewards does not import \(ModuleNotFoundError: .*not_a_module_anywhere"),
        ("missing.py:f", r"missing.py does not import \(FileNotFoundError: no file .*missing.py\)"),
        ("my_rewards:nothing", r"nothing in my_rewards is missing; name a function of the module"),
        ("my_rewards:LIMIT", r"LIMIT in my_rewards is not a function \(int\)"),
    ],
)
def test_a_reward_that_cannot_be_found_is_a_config_error_naming_the_spec(module_dir, function, message):
    with pytest.raises(ConfigError, match=rf"grpo.rewards\[1\].function='{function}': {message}") as caught:
        load_rewards([RewardSpec("exact_answer"), RewardSpec(function)])
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (
            {"function": "exact"},
            r"grpo.rewards\[0\].function='exact' is no built-in \['exact_answer', 'format_regex'\]",
        ),
        ({"function": ":f"}, r"grpo.rewards\[0\].function=':f' must be \"module:function\""),
        ({"function": "m:not-a-name"}, r"grpo.rewards\[0\].function='m:not-a-name' must be \"module:function\""),
        ({"function": ""}, r"grpo.rewards\[0\].function='' must name a reward"),
        ({"weight": 1.0}, r"grpo.rewards\[0\].function=None must name a reward"),
        ({"function": "m:f", "weight": "high"}, r"grpo.rewards\[0\].weight='high' must be a finite number"),
        ({"function": "m:f", "weight": math.inf}, r"grpo.rewards\[0\].weight=inf must be a finite number"),
        ({"function": "m:f", "scale": 2}, r"grpo.rewards\[0\] has unknown key\(s\) \['scale'\]"),
        ("m:f", r"grpo.rewards\[0\] is 'm:f'; each entry is a table with function and weight"),
    ],
)
def test_bad_reward_entries_are_one_line_errors(entry, message):
    with pytest.raises(ConfigError, match=message):
        GRPOConfig(rewards=[entry])


def test_a_saved_config_reads_back_the_same_rewards():
    """A run folder and a checkpoint record the settings as plain data (dataclasses.asdict): they read back."""
    config = from_dict({"grpo": {"beta": 0.04, "rewards": [{"function": "pkg.mod:f", "weight": -0.5}]}})
    saved = dataclasses.asdict(config)
    assert saved["grpo"]["rewards"] == [{"function": "pkg.mod:f", "weight": -0.5}]
    assert from_dict(saved, saved=True) == config
    assert from_dict({**saved, "grpo": None}, saved=True).grpo is None
