"""The dry-run plan: exact parameter count, every group, and memory estimates that follow ZeRO's accounting."""

import pytest

from polyshard.trainer.config import from_dict
from polyshard.trainer.models import build_model
from polyshard.trainer.plan import describe, model_state_bytes_per_rank, parameter_count


def test_parameter_count_matches_the_real_model():
    config = from_dict({"model": {"preset": "tiny"}})
    assert parameter_count(config) == sum(p.numel() for p in build_model(config.model).parameters())
    gpt2 = from_dict({"model": {"preset": "gpt2-124m"}})
    assert 124e6 < parameter_count(gpt2) < 164e6  # 124M with tied embeddings; ours is untied by default


@pytest.mark.parametrize("stage, per_param", [(0, 16.0), (1, 4 + 4 + 8 / 4), (2, 4 + (4 + 8) / 4), (3, 16 / 4)])
def test_model_states_follow_zero_accounting(stage, per_param):
    config = from_dict({"parallel": {"dp": 4, "zero_stage": stage}})
    assert model_state_bytes_per_rank(config, 1000) == pytest.approx(1000 * per_param)


def test_describe_lists_every_group():
    text = describe(from_dict({"parallel": {"dp": 2, "tp": 2, "pp": 2}}))
    assert "8 processes" in text and "rank 5: pp=1 dp=0 ep=0 cp=0 tp=1" in text
    assert "tp               [[0, 1], [2, 3], [4, 5], [6, 7]]" in text
    assert "pp x dp x tp" in text and "memory per rank (estimate)" in text


def test_model_states_count_the_heaviest_pipeline_rank_and_the_tied_copy():
    # Before: num_params / pp, which misses a tied head's copy of the embedding on the last stage.
    import re

    config = from_dict({"model": {"preset": "tiny", "tie_embeddings": True}, "parallel": {"pp": 2}})
    text = describe(config)
    stages = [int(n.replace(",", "")) for n in re.findall(r"\(([\d,]+) parameters\)", text)]
    assert sum(stages) > parameter_count(config)  # the copy is counted once more
    assert f"heaviest pipeline rank holds {max(stages):,}" in text
    states = float(re.search(r"model states ([\d,.]+) MiB", text).group(1).replace(",", ""))
    assert states == pytest.approx(model_state_bytes_per_rank(config, max(stages)) / 2**20, abs=0.05)
    one_rank = from_dict({"model": {"preset": "tiny", "tie_embeddings": True}})  # one tensor, no copy
    assert f"heaviest pipeline rank holds {parameter_count(one_rank):,}" in describe(one_rank)


def test_a_tied_head_weighs_in_the_pipeline_split():
    from polyshard.trainer.parallelize import pipeline_bounds

    def bounds(tie):
        model = {"vocab_size": 5000, "hidden": 32, "num_layers": 6, "num_heads": 4, "tie_embeddings": tie}
        config = from_dict({"model": model, "parallel": {"pp": 2}})
        skeleton = build_model(config.model, layers=())
        return pipeline_bounds(config, {n: p.shape for n, p in skeleton.named_parameters()})

    # The last stage computes with (and holds a copy of) the tied weight: it must weigh as untied.
    # Counting it only in the embedding gave [0, 1) and [1, 8): every block on the last stage.
    assert bounds(True) == bounds(False) == [range(0, 4), range(4, 8)]
