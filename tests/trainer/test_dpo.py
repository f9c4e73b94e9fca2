"""DPO (training.task = "dpo"): the loss and metrics against TRL's formulas on hand-made log-probs, the
[dpo] settings' one-line errors, and the preference pairs' rows (adjacent sides, truncation, bad rows).

The formulas below are written out from TRL 1.16's ``DPOTrainer._compute_loss`` (loss_type "sigmoid"
and "ipo"; the label-smoothed sigmoid is its conservative-DPO form, which 1.16 keeps for "aot" and
earlier versions used for "sigmoid") in plain Python floats, independently of the tensor code.
"""

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from polyshard.data.examples import IGNORE_INDEX
from polyshard.data.tokenizer import ByteTokenizer
from polyshard.trainer.config import from_dict
from polyshard.trainer.config.dpo import DPOConfig
from polyshard.trainer.data.preferences import read_pairs, truncate
from polyshard.trainer.engine.constraints import validate
from polyshard.trainer.errors import ConfigError, DataError
from polyshard.trainer.tasks import PREFERENCES, task_for
from polyshard.trainer.tasks.dpo import (
    PreferenceLoss,
    metric_sums,
    metrics_of,
    pack_targets,
    preference_losses,
    sequence_logps,
    unpack_targets,
)

# Two pairs: (policy chosen, policy rejected, reference chosen, reference rejected, chosen tokens, rejected tokens)
PAIRS = [(-12.5, -14.0, -13.0, -13.5, 5, 7), (-8.0, -6.5, -7.0, -7.25, 3, 2)]


def _logsigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x))


def _trl(beta: float, loss: str, smoothing: float = 0.0) -> tuple[list[float], list[float], list[float]]:
    """(losses, chosen rewards, rejected rewards) of PAIRS, TRL's way, one float at a time."""
    losses, chosen, rejected = [], [], []
    for pc, pr, rc, rr, nc, nr in PAIRS:
        chosen_ratio, rejected_ratio = pc - rc, pr - rr
        if loss == "ipo":
            losses.append((chosen_ratio / nc - rejected_ratio / nr - 1 / (2 * beta)) ** 2)
        else:
            delta = chosen_ratio - rejected_ratio
            losses.append(-_logsigmoid(beta * delta) * (1 - smoothing) - _logsigmoid(-beta * delta) * smoothing)
        chosen.append(beta * chosen_ratio)
        rejected.append(beta * rejected_ratio)
    return losses, chosen, rejected


def _rows() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PAIRS as (B,) rows in (chosen, rejected) order: policy, reference, completion tokens."""
    policy = torch.tensor([v for p in PAIRS for v in p[0:2]], dtype=torch.float64)
    reference = torch.tensor([v for p in PAIRS for v in p[2:4]], dtype=torch.float64)
    tokens = torch.tensor([v for p in PAIRS for v in p[4:6]])
    return policy, reference, tokens


@pytest.mark.parametrize(
    ("beta", "loss", "smoothing"), [(0.1, "sigmoid", 0.0), (0.5, "sigmoid", 0.2), (0.1, "ipo", 0.0), (2.0, "ipo", 0.0)]
)
def test_losses_and_rewards_are_trls(beta, loss, smoothing):
    config = DPOConfig(beta=beta, loss=loss, label_smoothing=smoothing)
    got = preference_losses(*_rows(), config)
    losses, chosen, rejected = _trl(beta, loss, smoothing)
    assert got.losses.tolist() == pytest.approx(losses, rel=1e-12)
    assert got.chosen_rewards.tolist() == pytest.approx(chosen, rel=1e-12)
    assert got.rejected_rewards.tolist() == pytest.approx(rejected, rel=1e-12)
    metrics = metrics_of(metric_sums(got))
    assert metrics["rewards/chosen"] == pytest.approx(sum(chosen) / 2)
    assert metrics["rewards/rejected"] == pytest.approx(sum(rejected) / 2)
    assert metrics["rewards/margins"] == pytest.approx((sum(chosen) - sum(rejected)) / 2)
    # pair 0: 0.1 beta > -0.05 beta (accurate); pair 1: -0.1 beta < 0.075 beta (not)
    assert metrics["rewards/accuracies"] == 0.5


def test_the_first_step_costs_log_two_and_pushes_chosen_up():
    """Policy = reference: the sigmoid loss is log 2 for every pair, and its gradient raises the chosen
    row's log-prob and lowers the rejected one's by beta / 2 each (TRL's first step)."""
    policy, _, tokens = _rows()
    policy.requires_grad_(True)
    got = preference_losses(policy, policy.detach().clone(), tokens, DPOConfig(beta=0.1))
    assert got.losses.tolist() == pytest.approx([math.log(2)] * 2)
    got.losses.mean().backward()
    assert policy.grad.tolist() == pytest.approx([-0.025, 0.025, -0.025, 0.025])  # mean over 2 pairs: 0.05 / 2


def test_sequence_logps_sum_the_completion_tokens_only():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11)
    labels = torch.tensor([[IGNORE_INDEX, IGNORE_INDEX, 3, 4, IGNORE_INDEX], [IGNORE_INDEX, 7, 1, 0, 10]])
    log_probs = F.log_softmax(logits, dim=-1)
    expected = [
        float(log_probs[0, 2, 3] + log_probs[0, 3, 4]),
        float(log_probs[1, 1, 7] + log_probs[1, 2, 1] + log_probs[1, 3, 0] + log_probs[1, 4, 10]),
    ]
    assert sequence_logps(logits, labels, None, 11).tolist() == pytest.approx(expected, rel=1e-6)


def test_packed_targets_carry_labels_exactly_and_the_loss_keeps_its_sums():
    labels = torch.tensor([[IGNORE_INDEX, 5, 250_000], [IGNORE_INDEX, IGNORE_INDEX, 9]])
    reference = torch.tensor([-1.25, -3.5])
    got_labels, got_reference = unpack_targets(pack_targets(labels, reference))
    assert torch.equal(got_labels, labels) and torch.equal(got_reference, reference.double())
    loss_fn = PreferenceLoss(DPOConfig(), None, 300_000)
    logits = torch.zeros(2, 3, 300_000)  # uniform: every row's log-prob is count x -log V
    loss = loss_fn(logits, pack_targets(labels, reference))
    policy = [-2 * math.log(300_000), -math.log(300_000)]
    assert float(loss) == pytest.approx(-_logsigmoid(0.1 * ((policy[0] + 1.25) - (policy[1] + 3.5))), rel=1e-6)
    assert loss_fn.take_sums()[4] == 1.0 and loss_fn.take_sums() is None  # one pair, then reset


def _config(**sections):
    base = {
        "model": {"kind": "gpt", "hidden": 32, "num_layers": 2, "num_heads": 4, "context_length": 16},
        "training": {"task": "dpo", "global_batch_size": 4},
        "data": {"source": "pairs.jsonl"},
    }
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values}
    return from_dict(base)


@pytest.mark.parametrize(
    ("values", "named"),
    [
        ({"beta": 0}, "dpo.beta=0.0 must be > 0"),
        ({"beta": "high"}, "dpo.beta='high' must be a finite number"),
        ({"loss": "hinge"}, "dpo.loss='hinge' must be one of"),
        ({"label_smoothing": 0.5}, "dpo.label_smoothing=0.5 must be in [0, 0.5)"),
        ({"loss": "ipo", "label_smoothing": 0.1}, "applies to loss = 'sigmoid' only"),
        ({"reference": "other"}, "dpo.reference='other' must be one of"),
    ],
)
def test_bad_dpo_settings_are_one_line_errors(values, named):
    with pytest.raises(ConfigError) as error:
        _config(dpo=values)
    assert named in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize(
    ("sections", "named"),
    [
        ({"data": {"document_mask": True}}, "data.document_mask"),
        ({"data": {"source": "shakespeare"}}, "data.source='shakespeare'"),
        ({"training": {"loss_chunks": 2}}, "training.loss_chunks > 1"),
    ],
)
def test_layouts_and_sources_dpo_does_not_run_are_refused_by_name(sections, named):
    config = _config(**sections)
    with pytest.raises(ConfigError) as error:
        validate(config, world_size=config.parallel.world_size)
    assert named in str(error.value)


def test_a_dpo_section_without_the_task_is_refused():
    config = _config(training={"task": "auto"}, dpo={"beta": 0.2})
    with pytest.raises(ConfigError, match=r"\[dpo\] section is set but training.task is not 'dpo'"):
        task_for(config)
    assert task_for(_config()) is PREFERENCES


def test_truncation_keeps_the_prompts_end_and_the_responses_start():
    prompt, chosen, rejected = list(range(10)), [100, 101, 102, 103, 104, 105], [200, 201]
    assert truncate(prompt[:3], chosen[:2], rejected, 8) == (prompt[:3], chosen[:2], rejected)  # fits: as is
    # 10 + 6 > 8: the prompt keeps its last max(8 // 2, 8 - 6) = 4 tokens, the responses their first 4
    assert truncate(prompt, chosen, rejected, 8) == ([6, 7, 8, 9], [100, 101, 102, 103], [200, 201])
    # a short response leaves the prompt more: max(4, 8 - 2) = 6
    assert truncate(prompt, [100], rejected, 8) == ([4, 5, 6, 7, 8, 9], [100], [200, 201])


def _write(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_pairs_become_adjacent_rows_with_the_prompt_masked(tmp_path):
    path = _write(
        tmp_path / "p.jsonl",
        [
            {"prompt": "ab", "chosen": "c", "rejected": "de"},
            {"prompt_ids": [1], "chosen_ids": [2, 3], "rejected_ids": [4]},
        ],
    )
    examples = read_pairs(path, ByteTokenizer(), 5, "data.source")
    rows = examples.rows(np.arange(2))
    assert rows["tokens"].shape == (2, 2, 5)  # pairs, (chosen, rejected), width
    assert rows["tokens"][0].tolist() == [[97, 98, 99, 0, 0], [97, 98, 100, 101, 0]]  # bytes: no end-of-text
    assert rows["labels"][0].tolist() == [[-100, -100, 99, -100, -100], [-100, -100, 100, 101, -100]]
    assert rows["tokens"][1].tolist() == [[1, 2, 3, 0, 0], [1, 4, 0, 0, 0]]  # ids as given
    inputs, targets = PREFERENCES.split_batch({k: torch.as_tensor(v) for k, v in rows.items()})
    assert inputs.shape == (4, 4) and targets[1].tolist() == [-100, 100, 101, -100]  # row 1: pair 0's rejected


@pytest.mark.parametrize(
    ("row", "named"),
    [
        ({"prompt": "a", "chosen": "", "rejected": "b"}, "line 2: chosen is empty"),
        ({"prompt_ids": [1], "chosen_ids": [], "rejected_ids": [2]}, "line 2: a response is empty"),
        ({"prompt": "", "chosen": "x", "rejected": "y"}, "line 2: the prompt is empty"),
        ({"prompt": "a", "chosen": "b"}, 'line 2: expected {"prompt", "chosen", "rejected"}'),
        ({"prompt_ids": [1], "chosen_ids": [-3], "rejected_ids": [2]}, "line 2: chosen_ids holds a negative"),
    ],
)
def test_a_bad_pair_is_named_by_its_line(tmp_path, row, named):
    path = _write(tmp_path / "p.jsonl", [{"prompt": "q", "chosen": "a", "rejected": "b"}, row])
    with pytest.raises(DataError) as error:
        read_pairs(path, ByteTokenizer(), 8, "data.source")
    assert named in str(error.value) and str(path) in str(error.value)
