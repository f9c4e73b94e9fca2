"""Hybrid sharding (parallel.dp_shard) in the trainer: parity with one process, checkpoints across layouts.

dp = 4 with dp_shard = 2 shards ZeRO over pairs of neighbouring data ranks and
all-reduces each shard across the two pairs. The losses and gradient norms of
the real training loop must equal one process's (as every layout of
tests/trainer/test_e2e_parity.py does), for ZeRO-1/2/3 and composed with tp,
pp, ep and cp (every gradient and parameter too, by tests/_layouts.py's
runner); a checkpoint saved under it reshards bit for bit to layouts without it
(and back), and training continues from it on them.
"""

import functools
import shutil

import pytest
import torch

from polyshard.checkpoint import Checkpoint, read_index, step_dir
from polyshard.trainer.checkpointing.records import plan_ranks
from polyshard.trainer.checkpointing.run_reshard import reshard
from polyshard.trainer.errors import ConfigError
from tests._layouts import LAYOUTS, LONG, layout, trained_numbers

from .test_e2e_parity import DENSE_RTOL, MOE_RTOL, TOLERANCE, _numbers
from .test_e2e_parity import _config as _parity_config
from .test_reshard import SAVE_AT, _assert_same_state, _files, _global_state, _reshard, _with_vocab
from .test_reshard import _config as _reshard_config
from .test_reshard import _train as _reshard_train

HYBRID_LAYOUTS = [
    layout("dp4-shard2-zero2", model="gpt"),
    layout("dp4-shard2-zero1", LONG, model="gpt"),
    layout("dp4-shard2-zero3", LONG, model="gpt"),
    layout("dp4-shard2xtp2-zero1", LONG, model="gpt"),
    layout("dp2-shard1xpp2-zero2", LONG, model="gpt"),
    # Non-expert parameters shard over dp_shard x ep, experts over dp_shard; both replicate over dp_replicate.
    layout("dp2-shard1xep2-zero1", LONG, model="moe-gpt"),
    # The shard group is dp_shard x cp: cp ranks hold the other tokens of the same examples.
    layout("dp2-shard1xcp2-zero3", LONG, model="gpt"),
]


@pytest.mark.parametrize("kind, name", HYBRID_LAYOUTS)
def test_hybrid_layouts_train_as_on_one_process(parity, corpus, tmp_path, kind, name):
    world, settings = LAYOUTS[name]
    assert _parity_config(corpus, kind, **settings).parallel.hybrid
    if kind == "gpt":
        parity.check(name, functools.partial(_parity_config, corpus), TOLERANCE, tmp_path)
    else:  # the aux loss is each data rank's own (see MOE_RTOL): losses and gradient norms
        got = parity.run(world, _parity_config(corpus, kind, **settings), tmp_path, trained_numbers)[0]
        assert got == pytest.approx(_numbers(parity, corpus, "moe-gpt"), rel=MOE_RTOL)


def test_dp_shard_is_checked(corpus):
    with pytest.raises(
        ConfigError, match=r"parallel.dp_shard=3 must divide parallel.dp=4; choose dp_shard in \[1, 2, 4\]"
    ):
        _parity_config(corpus, dp=4, dp_shard=3, zero_stage=1)
    with pytest.raises(ConfigError, match="parallel.dp_shard=2 .* needs parallel.zero_stage 1, 2 or 3"):
        _parity_config(corpus, dp=4, dp_shard=2)
    with pytest.raises(ConfigError, match="parallel.dp_shard"):
        _parity_config(corpus, dp=4, dp_shard=0, zero_stage=1)
    # dp_shard = dp is plain ZeRO over all of dp: the mesh does not split.
    assert _parity_config(corpus, dp=4, dp_shard=4, zero_stage=1).parallel.mesh_axes["dp"] == 4


# -- checkpoints ---------------------------------------------------------------------------------------

HYBRID = {"dp": 4, "dp_shard": 2, "zero_stage": 2}


@pytest.fixture(scope="module")
def hybrid_run(distributed, corpus, tmp_path_factory):
    """(config, run folder, losses) of a short run on dp4 with dp_shard 2, saving every SAVE_AT steps."""
    config = _with_vocab(_reshard_config(corpus, **HYBRID))
    folder = tmp_path_factory.mktemp("hybrid")
    return config, folder, distributed.run(4, _reshard_train, config, folder)[0]


def _saved(hybrid_run):
    return step_dir(hybrid_run[1] / "checkpoints", SAVE_AT)


def test_checkpoint_records_both_sub_axes(hybrid_run):
    config, _, _ = hybrid_run
    index = read_index(_saved(hybrid_run))
    assert index["mesh"] == {"pp": 1, "dp_replicate": 2, "dp_shard": 2, "ep": 1, "cp": 1, "tp": 1}
    source = Checkpoint(_saved(hybrid_run))
    # A plain dp coordinate of a target reads the pair: dp 3 is dp_replicate 1, dp_shard 1 (rank 3); dp 5 wraps.
    assert [source.rng_piece({"dp": dp}).rank for dp in range(6)] == [0, 1, 2, 3, 0, 1]
    plans = plan_ranks(config, source.params(), source.optim_state())
    for rank, (plan, entry) in enumerate(zip(plans, index["ranks"])):
        saved = {k: v for k, v in entry["tensors"].items() if k != "rng/torch"}
        assert sorted(plan) == sorted(saved), rank
        for key, item in plan.items():  # what offline resharding computes is what training saved
            assert (item.record.to_json() if item.record else None) == saved[key], (rank, key)
        moment = saved["optim/layers.1.attn.q_proj.weight/exp_avg"]["placements"]
        assert {a: moment[a] for a in ("dp_replicate", "dp_shard")} == {"dp_replicate": "R", "dp_shard": "S(0)"}


@pytest.mark.parametrize(
    "hops",
    [
        pytest.param([({"dp": 4}, {})], id="->dp4"),  # the default suite's row; the others are long
        pytest.param(
            [({"dp": 2}, {"zero_stage": 1}), ({"dp": 4}, {"dp_shard": 2, "zero_stage": 3})],
            id="->dp2->hsdp3",
            marks=pytest.mark.long,
        ),
        pytest.param([({"dp": 8}, {"dp_shard": 4, "zero_stage": 1})], id="->dp8-shard4", marks=pytest.mark.long),
    ],
)
def test_every_global_tensor_survives_resharding_across_dp_shard(hybrid_run, tmp_path, hops):
    original = _global_state(_saved(hybrid_run))
    current = _saved(hybrid_run)
    for i, (mesh, parallel) in enumerate(hops):
        current = _reshard(current, tmp_path / f"hop{i}", mesh, **parallel).folder
        _assert_same_state(original, _global_state(current))


@pytest.mark.long
def test_round_trip_through_plain_dp_reproduces_the_files(hybrid_run, tmp_path):
    config, _, _ = hybrid_run
    there = _reshard(_saved(hybrid_run), tmp_path / "there", {"dp": 4}).folder
    back = reshard(there, tmp_path / "back", config, max_block_bytes=4096).folder
    for before, after in zip(_files(_saved(hybrid_run)), _files(back), strict=True):
        assert before.keys() == after.keys()
        for key in before:
            assert torch.equal(before[key], after[key]), key


def _continue(config, out, init_from):
    return _reshard_train(config, out, init_from=init_from)


@pytest.mark.parametrize(
    "world, parallel",
    [
        pytest.param(4, {"dp": 4, "zero_stage": 2}, id="dp4-plain"),
        pytest.param(2, {"dp": 2, "zero_stage": 1}, id="dp2", marks=pytest.mark.long),
    ],
)
def test_training_continues_without_hybrid_sharding(distributed, hybrid_run, corpus, tmp_path, world, parallel):
    _, _, losses = hybrid_run
    config = _with_vocab(_reshard_config(corpus, **parallel))
    continued = distributed.run(world, _continue, config, tmp_path / "run", str(_saved(hybrid_run)))[0]
    assert continued[:SAVE_AT] == losses[:SAVE_AT]  # carried over from the checkpoint
    # Another reduction order than the hybrid run's: float32 sums, see the parity tests.
    assert continued[SAVE_AT:] == pytest.approx(losses[SAVE_AT:], rel=DENSE_RTOL)


def test_resume_on_the_same_hybrid_layout_is_bitwise(distributed, hybrid_run, tmp_path):
    config, folder, losses = hybrid_run
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copytree(_saved(hybrid_run), step_dir(run / "checkpoints", SAVE_AT))
    assert distributed.run(4, _reshard_train, config, run, True)[0] == losses


@pytest.mark.long  # two CLI processes
def test_reshard_command_moves_in_and_out_of_hybrid_sharding(hybrid_run, tmp_path):
    import subprocess
    import sys

    polyshard = [sys.executable, "-m", "polyshard.cli.main", "reshard", str(_saved(hybrid_run))]
    ok = subprocess.run(polyshard + [str(tmp_path / "plain"), "--mesh", "dp=4"], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert "to {'pp': 1, 'dp': 4, 'ep': 1, 'cp': 1, 'tp': 1}" in ok.stdout
    assert "--set parallel.dp_shard=4" in ok.stdout  # what the next run needs: ZeRO over all of dp
    bad = subprocess.run(
        polyshard + [str(tmp_path / "bad"), "--mesh", "dp=4", "--set", "parallel.dp_shard=3"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "parallel.dp_shard=3 must divide parallel.dp=4" in bad.stderr, bad.stderr
    assert not (tmp_path / "bad").exists()
