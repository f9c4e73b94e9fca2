"""The dry-run plan: exact parameter count, every group, and the layout planner's memory per rank."""

import pytest

from polyshard.models import build_model, parameter_count
from polyshard.planner.activations import activation_bytes
from polyshard.planner.dry_run import describe
from polyshard.planner.model_states import rank_model_states
from polyshard.planner.search import Request, meshes
from polyshard.trainer.config import from_dict


def test_parameter_count_matches_the_real_model():
    config = from_dict({"model": {"preset": "tiny"}})
    assert parameter_count(config.model) == sum(p.numel() for p in build_model(config.model).parameters())
    gpt2 = from_dict({"model": {"preset": "gpt2-124m"}})
    # GPT-2 small: token table 50257 x 768, positions 1024 x 768, 12 blocks of 7,087,872, the final norm
    # 2 x 768: 124,439,808 with the head tied to the token table; ours is untied by default (+ 50257 x 768).
    assert parameter_count(gpt2.model) == 163_037_184
    tied = from_dict({"model": {"preset": "gpt2-124m", "tie_embeddings": True}})
    assert parameter_count(tied.model) == 124_439_808


def _mib(text, what, rank):
    import re

    line = next(line for line in text.splitlines() if line.strip().startswith(f"pp rank {rank}:"))
    return float(re.search(rf"{what} ([\d,.]+) MiB", line).group(1).replace(",", ""))


@pytest.mark.parametrize("stage", range(4))
def test_dry_run_memory_is_the_planners(stage):
    # The same numbers `polyshard plan` gives this layout (which tests/planner/test_memory.py holds
    # against the bytes real engines hold).
    config = from_dict({"parallel": {"dp": 4, "pp": 2, "zero_stage": stage, "microbatches": 4}})
    text = describe(config)
    for rank in range(2):
        states, acts = rank_model_states(config, rank), activation_bytes(config, rank)
        assert _mib(text, "model states", rank) == pytest.approx(states.total / 2**20, abs=0.05)
        assert _mib(text, "activations", rank) == pytest.approx(acts / 2**20, abs=0.05)


def test_describe_lists_every_group():
    text = describe(from_dict({"parallel": {"dp": 2, "tp": 2, "pp": 2}}))
    assert "8 processes" in text and "rank 5: pp=1 dp=0 ep=0 cp=0 tp=1" in text
    assert "tp               [[0, 1], [2, 3], [4, 5], [6, 7]]" in text
    assert "pp x dp x tp" in text and "memory per rank (estimate" in text


def test_model_states_count_the_heaviest_pipeline_rank_and_the_tied_copy():
    # Before: num_params / pp, which misses a tied head's copy of the embedding on the last stage.
    import re

    config = from_dict({"model": {"preset": "tiny", "tie_embeddings": True}, "parallel": {"pp": 2}})
    text = describe(config)
    printed = [int(n.replace(",", "")) for n in re.findall(r"\(([\d,]+) parameters\)", text)]
    # Counted from a real model: each stage's layers' own parameters, the head's weight (the embedding's
    # tensor) included, so the last stage counts the copy it holds.
    model = build_model(config.model)
    spans = [range(int(a), int(b) + 1) for a, b in re.findall(r"layers (\d+)-(\d+) \(", text)]
    assert [i for span in spans for i in span] == list(range(len(model.layers)))
    stages = [sum(p.numel() for i in span for p in model.layers[i].parameters()) for span in spans]
    assert printed == stages
    vocab, hidden = config.model.vocab_size, config.model.hidden
    assert sum(stages) == sum(p.numel() for p in model.parameters()) + vocab * hidden  # the copy, once more
    assert f"heaviest pipeline rank holds {max(stages):,}" in text
    for rank in range(2):
        assert _mib(text, "model states", rank) == pytest.approx(
            rank_model_states(config, rank).total / 2**20, abs=0.05
        )
    # The last stage holds the head and its copy of the embedding: fp32 weights of both ranks exceed the model's.
    assert sum(rank_model_states(config, r).params for r in range(2)) == 4 * sum(stages)
    one_rank = from_dict({"model": {"preset": "tiny", "tie_embeddings": True}})  # one tensor, no copy
    unique = sum(p.numel() for p in build_model(one_rank.model).parameters())  # the tied tensor once
    assert f"heaviest pipeline rank holds {unique:,}" in describe(one_rank)


def test_a_stage_holding_both_ends_of_a_tie_counts_the_tensor_once():
    # Before: one stage printed the embedding twice (173,824 parameters on the stage, 141,056 in the model).
    import re

    config = from_dict({"model": {"preset": "tiny", "tie_embeddings": True}})
    unique = sum(p.numel() for p in build_model(config.model).parameters())  # parameters() lists a tie once
    printed = [int(n.replace(",", "")) for n in re.findall(r"\(([\d,]+) parameters\)", describe(config))]
    assert printed == [unique]
    untied = from_dict({"model": {"preset": "tiny"}})
    assert unique < parameter_count(untied.model)  # the tie is there to be counted once


def test_a_tied_head_weighs_in_the_pipeline_split():
    from polyshard.trainer.engine.layout import pipeline_bounds

    def bounds(tie):
        model = {"vocab_size": 5000, "hidden": 32, "num_layers": 6, "num_heads": 4, "tie_embeddings": tie}
        config = from_dict({"model": model, "parallel": {"pp": 2}})
        skeleton = build_model(config.model, layers=())
        return pipeline_bounds(config, {n: p.shape for n, p in skeleton.named_parameters()})

    # The last stage computes with (and holds a copy of) the tied weight: it must weigh as untied.
    # Counting it only in the embedding gave [0, 1) and [1, 8): every block on the last stage.
    assert bounds(True) == bounds(False) == [range(0, 4), range(4, 8)]


def test_the_dry_run_draws_the_learning_rate_schedule():
    from polyshard.planner.dry_run import lr_plot

    schedule = {"warmup_steps": 10, "name": "wsd", "decay_fraction": 0.2}
    wsd = from_dict({"training": {"steps": 100}, "lr_schedule": schedule})
    plot = lr_plot(wsd, width=50, height=4)
    assert plot[0].startswith("learning rate (wsd, decay over the last 20 steps, linear; 10 warmup steps")
    top, bottom = plot[1][3:], plot[4][3:]  # after "  |"
    # Two steps a column: warmup fills the first five columns gradually, the stable part (steps 11-80,
    # columns 5-39) reaches the top, the decay (columns 40-49) falls to min_lr = lr / 10.
    assert top[5:40] == "#" * 35 and top[:2] == "  " and top[-3:] == "   "
    assert bottom[5:-1] == "#" * 44 and bottom[-1] == " "  # the last column: mean 0.1225 lr, below 1/8 of lr
    assert describe(wsd).endswith("\n".join(plot[:1] + lr_plot(wsd)[1:]))


def test_the_planner_weighs_context_parallelism_for_moe_models():
    # cp x ep is a layout polyshard runs (experts reduce over dp x cp); a capacity factor refuses cp.
    raw = {"model": {"kind": "moe-gpt", "preset": "tiny", "context_length": 8192}, "training": {"global_batch_size": 8}}
    request = Request(devices=8, devices_per_node=8, memory_gb=80)
    found = list(meshes(from_dict(raw), request))
    assert {"dp": 2, "tp": 1, "pp": 1, "ep": 2, "cp": 2} in found  # 4096 positions per cp rank, the least
    assert all(m["cp"] <= 2 for m in found)


def test_the_planner_weighs_every_cp_style_and_counts_their_bytes():
    from polyshard.planner.search import comm_of, layouts

    # 4 heads on cp 4: Ulysses gives each rank one head; the 2-D scheme all-to-alls over pairs, rings across.
    raw = {"model": {"preset": "tiny", "context_length": 32768}, "training": {"global_batch_size": 4}}
    config = from_dict(raw)
    request = Request(devices=4, devices_per_node=4, memory_gb=80, fixed={"cp": 4, "zero_stage": 0})
    found = {(p.cp_style, p.cp_ulysses): p for p in layouts(config, request)}
    assert set(found) == {("ring", None), ("allgather", None), ("ulysses", None), ("ulysses+ring", 2)}
    sent = {style: comm_of(from_dict({**raw, "parallel": p.__dict__})) for (style, _), p in found.items()}
    # Per block and microbatch, in units of one rank's K (= Q = V = the output here, fp32): the ring sends
    # 2 x 3 K/V hops forward, 6 + 4 x 2 (fp32 dK/dV, cp hops) backward = 20; Ulysses 8 all-to-alls of
    # 3/4 of a unit = 6; the 2-D scheme 8 all-to-alls of 1/2 a unit over pairs (4) and a ring of 2 ranks
    # (2 forward, 2 + 2 x 2 backward: 8) = 12.
    assert sent["ulysses"]["cp"] == pytest.approx(sent["ring"]["cp"] * 6 / 20)
    two_d = sent["ulysses+ring"]
    assert two_d["cp_ulysses"] + two_d["cp_ring"] == pytest.approx(sent["ring"]["cp"] * 12 / 20)
    # A tp rank's heads that do not split over cp leave Ulysses out (4 heads / tp 2 = 2 heads on cp 4).
    tp2 = Request(devices=8, devices_per_node=8, memory_gb=80, fixed={"cp": 4, "tp": 2, "zero_stage": 0})
    assert {(p.cp_style, p.cp_ulysses) for p in layouts(config, tp2)} == {
        ("ring", None),
        ("allgather", None),
        ("ulysses+ring", 2),
    }


def test_the_dry_run_shows_the_two_d_groups_and_the_bytes_each_axis_sends():
    config = from_dict(
        {"model": {"preset": "llama-tiny"}, "parallel": {"cp": 4, "cp_style": "ulysses+ring", "cp_ulysses": 2}}
    )
    text = describe(config)
    assert "cp_ulysses       [[0, 1], [2, 3]] (all-to-all)" in text
    assert "cp_ring          [[0, 2], [1, 3]] (ring)" in text
    sent = next(line for line in text.splitlines() if line.strip().startswith("sent by pp rank 0:"))
    assert "cp_ulysses" in sent and "cp_ring" in sent
