"""GRPO's group advantages against TRL 1.16's (``GRPOTrainer._generate_and_score_completions``, its
"sum_then_normalize" aggregation) written out one number at a time: each std scaling, completions no
reward function scored, and a data rank's groups scaled by the whole batch's std."""

import math
import statistics

import pytest
import torch

from polyshard.trainer.tasks.grpo import group_advantages, zero_std_fraction


def _plain_advantages(rewards: list[float], generations: int, scale: str) -> list[float]:
    """TRL's advantages one number at a time: statistics' stdev is the unbiased (n - 1) one, as TRL's."""
    out = []
    for start in range(0, len(rewards), generations):
        group = rewards[start : start + generations]
        mean = statistics.fmean(group)
        std = statistics.stdev(rewards) if scale == "batch" else statistics.stdev(group)
        out += [(r - mean) / (std + 1e-4) if scale != "none" else r - mean for r in group]
    return out


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_are_trls_for_each_scaling(scale):
    rewards = [1.0, 0.0, 0.5, 1.0, 2.0, 2.0, 2.0, 2.0, 0.0, 3.0, 0.25, 1.5]
    got = group_advantages(torch.tensor(rewards), 4, scale)
    assert got.tolist() == pytest.approx(_plain_advantages(rewards, 4, scale), rel=1e-5, abs=1e-6)
    assert got[4:8].tolist() == [0.0] * 4  # a group of equal rewards teaches nothing, whatever the scaling
    assert zero_std_fraction(torch.tensor(rewards), 4, scale) == (0.0 if scale == "batch" else 1 / 3)


def test_batch_scaling_of_one_ranks_groups_takes_the_whole_batchs_std():
    """A data rank holds whole groups: its advantages from its own rewards and the gathered batch's are the
    whole batch's own rows."""
    rewards = torch.tensor([1.0, 0.0, 0.5, 1.0, 2.0, 3.0, 2.0, 2.0, 0.0, 3.0, 0.25, 1.5])
    whole = group_advantages(rewards, 4, "batch")
    assert torch.equal(group_advantages(rewards[4:], 4, "batch", batch_rewards=rewards), whole[4:])
    assert not torch.allclose(group_advantages(rewards[4:], 4, "batch"), whole[4:])  # its own std differs


def test_unscored_completions_are_left_out_and_get_no_advantage():
    """NaN (no function scored it): out of its group's mean and std, advantage 0; a group with one scored
    completion has no std (TRL: NaN), so its advantages are 0 too."""
    rewards = torch.tensor([1.0, math.nan, 0.0, math.nan, math.nan, 5.0])
    got = group_advantages(rewards, 3, "group")
    mean, std = 0.5, statistics.stdev([1.0, 0.0])
    assert got.tolist() == pytest.approx([(1.0 - mean) / (std + 1e-4), 0.0, (0.0 - mean) / (std + 1e-4), 0, 0, 0])
