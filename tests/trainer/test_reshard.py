"""Resharding: a checkpoint saved on one mesh, laid out for another, offline and while loading.

Checkpoint checkpoints come from real (short) training runs on live processes, so
they hold AdamW moments, ZeRO masters, padding and RNG states as training
writes them. Resharding itself runs in this process: it needs no group.
"""

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from polyshard.checkpoint import Checkpoint, CheckpointError, latest_checkpoint, read_index, step_dir
from polyshard.mesh import Mesh
from polyshard.trainer.checkpointing.records import plan_ranks
from polyshard.trainer.checkpointing.run_reshard import reshard, target_config
from polyshard.trainer.config import from_dict
from polyshard.trainer.errors import ConfigError
from polyshard.trainer.loop import train
from tests._short import SMALL_LLAMA

STEPS = 4
SAVE_AT = 2
# Continued training on another layout differs from the original only in the order float32
# sums are taken, as in the end-to-end parity test (tests/trainer/test_e2e_parity.py).
DENSE_RTOL = 2e-5

SOURCES = {
    # name: (processes, model kind, parallel settings)
    "single": (1, "gpt", {}),
    "dp2-tp2-pp2": (8, "gpt", {"dp": 2, "tp": 2, "pp": 2, "microbatches": 2}),
    "tp2": (2, "gpt", {"tp": 2}),
    "dp2-zero1": (2, "gpt", {"dp": 2, "zero_stage": 1}),
    "dp2-zero3": (2, "gpt", {"dp": 2, "zero_stage": 3}),
    "moe-dp2-ep2": (4, "moe-gpt", {"dp": 2, "ep": 2}),
    # A sigmoid router's selection bias: a buffer, saved whole by each stage's ranks, with no optimizer state.
    "moe-sigmoid-ep2-pp2": (4, "moe-gpt", {"ep": 2, "pp": 2, "microbatches": 2, "zero_stage": 1, "sigmoid": True}),
    "dp2-zero2-bf16": (2, "gpt", {"dp": 2, "zero_stage": 2, "precision": "bf16"}),
    # GPT-2's tied embedding and head: both pipeline end stages hold it, saved under one name.
    "tied-tp2-pp2": (4, "gpt", {"tp": 2, "pp": 2, "microbatches": 2, "tie_embeddings": True}),
    # Llama with 2 kv heads on tp=4: each kv head replicated on two tp ranks, saved once.
    "llama-tp4": (4, "gpt", {"tp": 4, "llama": True}),
    # Context parallelism shards no parameter: only the layout (and ZeRO over dp x cp) moves.
    "cp2-dp2-zero1": (4, "gpt", {"cp": 2, "dp": 2, "zero_stage": 1}),
    # Experts under cp: ZeRO shards them over dp x cp (the ranks holding the same experts).
    "moe-cp2-ep2-zero1": (4, "moe-gpt", {"cp": 2, "ep": 2, "zero_stage": 1}),
    # Layers that differ: blocks 0 and 2 dense (48 wide), 1 and 3 with experts, over both pipeline stages.
    "moe-dense-ep2-pp2": (4, "moe-gpt", {"ep": 2, "pp": 2, "microbatches": 2, "dense": True}),
    "tp2-sp-pp2-interleaved": (
        4,
        "gpt",
        {
            "tp": 2,
            "sequence_parallel": True,
            "pp": 2,
            "schedule": "interleaved",
            "virtual_stages": 2,
            "microbatches": 2,
        },
    ),
}


LLAMA = SMALL_LLAMA


def _config(
    corpus, kind="gpt", precision="fp32", tie_embeddings=False, llama=False, sigmoid=False, dense=False, **parallel
):
    model = {"kind": kind, "hidden": 32, "num_layers": 4, "num_heads": 4, "context_length": 16}
    model |= LLAMA if llama else {}
    model |= {"moe": {"dense_layers": [0, 2], "dense_ffn_hidden": 48}} if dense else {}
    model |= {"router": "sigmoid", "router_bias_update_rate": 0.01} if sigmoid else {}
    return from_dict(
        {
            # vocab 130: no padding on tp=2, padded to 132 on tp=4
            "model": model | {"tie_embeddings": tie_embeddings},
            "parallel": parallel,
            "training": {
                "steps": STEPS,
                "global_batch_size": 8,
                "precision": precision,
            },
            "lr_schedule": {
                "warmup_steps": 1,
            },
            "eval": {
                "every": 0,
                "sample_tokens": 0,
            },
            "data": {"source": corpus},
            "checkpoint": {"every": SAVE_AT, "keep": 4},
            "logging": {"progress_bar": False},
        }
    )


def _with_vocab(config):
    return dataclasses.replace(config, model=dataclasses.replace(config.model, vocab_size=130))


def _train(config, out, resume=False, init_from=None):
    return train(config, Mesh(config.parallel.mesh_axes), out, log=False, resume=resume, init_from=init_from).losses


@pytest.fixture(scope="module")
def trained(distributed, corpus, tmp_path_factory):
    """name -> (config, run folder, losses of all STEPS) for every source layout, each trained when first
    asked for (so a run of a few tests trains only their sources)."""

    class Trained(dict):
        def __missing__(self, name):
            world, kind, parallel = SOURCES[name]
            config = _with_vocab(_config(corpus, kind, **parallel))
            folder = tmp_path_factory.mktemp(name)
            losses = distributed.run(world, _train, config, folder)[0]
            self[name] = (config, folder, losses)
            return self[name]

    return Trained()


def _checkpoint(trained, name, step=SAVE_AT):
    return step_dir(trained[name][1] / "checkpoints", step)


def _global_state(folder) -> dict[str, torch.Tensor]:
    """Every model and optimizer tensor of a checkpoint, whole and without padding."""
    source = Checkpoint(folder)
    return {
        key: source.read(key, tuple(0 for _ in source.global_shape(key)), source.global_shape(key), source.dtype(key))
        for key in source.pieces
        if key.startswith(("model/", "optim/"))
    }


def _assert_same_state(before, after):
    """Bitwise equal wherever both hold a tensor; a master only one side keeps equals the weights."""
    assert {k for k in before if k.startswith("model/")} == {k for k in after if k.startswith("model/")}
    for key in before.keys() | after.keys():
        if key in before and key in after:
            assert torch.equal(before[key], after[key]), key
        else:
            assert key.endswith("/master"), key
            held = before if key in before else after
            weights = held["model/" + key[len("optim/") : -len("/master")]]
            assert torch.equal(held[key], weights.float()), key
    moments = [k for k in after if k.endswith("/exp_avg")]
    buffers = [k for k in after if k.endswith("router.bias")]  # no optimizer state
    assert len(moments) == len([k for k in after if k.startswith("model/")]) - len(buffers)


def _files(folder) -> list[dict[str, torch.Tensor]]:
    index = read_index(folder)
    return [load_file(str(folder / entry["file"])) for entry in index["ranks"]]


def _reshard(src, dst, mesh, **parallel):
    config = target_config(Checkpoint(src), mesh, parallel)
    return reshard(src, dst, config, max_block_bytes=4096)  # small blocks: many tensors span several


# -- the records offline resharding computes are the ones live runs save ------------------------------


@pytest.mark.parametrize("name", list(SOURCES))
def test_planned_layout_equals_what_training_saved(trained, name):
    config, folder, _ = trained[name]
    index = read_index(_checkpoint(trained, name))
    source = Checkpoint(_checkpoint(trained, name))
    plans = plan_ranks(config, source.params(), source.optim_state())
    files = _files(_checkpoint(trained, name))
    for rank, (plan, entry) in enumerate(zip(plans, index["ranks"])):
        saved = {k: v for k, v in entry["tensors"].items() if k != "rng/torch"}
        assert sorted(plan) == sorted(saved), rank
        for key, item in plan.items():
            assert (item.record.to_json() if item.record else None) == saved[key], (rank, key)
            assert (tuple(files[rank][key].shape), files[rank][key].dtype) == (item.shape, item.dtype), (rank, key)


@pytest.mark.parametrize("name", ["dp2-tp2-pp2", "dp2-zero3", "moe-dp2-ep2"])
def test_resharding_to_the_same_layout_rewrites_every_file_exactly(trained, tmp_path, name):
    config, _, _ = trained[name]
    src = _checkpoint(trained, name)
    out = reshard(src, tmp_path, config, max_block_bytes=4096).folder
    for before, after in zip(_files(src), _files(out)):
        assert before.keys() == after.keys()
        for key in before:
            assert torch.equal(before[key], after[key]), key
    assert [e["tensors"] for e in read_index(src)["ranks"]] == [e["tensors"] for e in read_index(out)["ranks"]]


# -- the layout matrix: every global tensor survives bit for bit ---------------------------------------

MATRIX = [
    pytest.param("single", [({"dp": 2, "tp": 2, "pp": 2}, {"microbatches": 2})], id="1->dp2xtp2xpp2"),
    pytest.param("dp2-tp2-pp2", [({}, {"microbatches": 1})], id="dp2xtp2xpp2->1"),
    pytest.param("dp2-tp2-pp2", [({"tp": 4, "pp": 2}, {})], id="dp2xtp2xpp2->tp4xpp2"),
    pytest.param("dp2-tp2-pp2", [({"dp": 4, "pp": 2}, {})], id="dp2xtp2xpp2->dp4xpp2"),
    pytest.param("dp2-tp2-pp2", [({"pp": 4}, {"microbatches": 4, "stage_layers": [2, 1, 1, 2]})], id="->pp4-split2112"),
    pytest.param(
        "dp2-tp2-pp2",
        [({"pp": 2}, {"schedule": "interleaved", "virtual_stages": 2, "microbatches": 2})],
        id="->pp2-interleaved",
    ),
    pytest.param("tp2", [({"tp": 4}, {})], id="tp2->tp4-vocab-padding"),
    pytest.param("moe-dp2-ep2", [({"ep": 4}, {}), ({}, {})], id="moe-dp2xep2->ep4->ep1", marks=pytest.mark.long),
    pytest.param(
        "moe-sigmoid-ep2-pp2",
        [({"dp": 2}, {"zero_stage": 3, "microbatches": 1}), ({"ep": 4}, {"zero_stage": 0})],
        id="moe-sigmoid-ep2xpp2->dp2-zero3->ep4",
        marks=pytest.mark.long,
    ),
    pytest.param(
        "moe-cp2-ep2-zero1",
        [({"ep": 2}, {"zero_stage": 0}), ({"cp": 2, "ep": 2}, {"zero_stage": 1})],
        id="moe-cp2xep2-zero1->ep2->back",
    ),
    pytest.param("moe-dense-ep2-pp2", [({"ep": 4}, {"microbatches": 1}), ({}, {})], id="moe-dense-ep2xpp2->ep4->ep1"),
    pytest.param(
        "dp2-zero1",
        [({"dp": 2}, {"zero_stage": 0}), ({"dp": 2}, {"zero_stage": 1})],
        id="zero1->dp->zero1",
        marks=pytest.mark.long,
    ),
    pytest.param(
        "dp2-zero3",
        [({"dp": 2}, {"zero_stage": 0}), ({"dp": 2}, {"zero_stage": 3})],
        id="zero3->dp->zero3",
        marks=pytest.mark.long,
    ),
    pytest.param("dp2-zero3", [({"dp": 4}, {"zero_stage": 1})], id="zero3-dp2->zero1-dp4", marks=pytest.mark.long),
    pytest.param(
        "dp2-zero2-bf16", [({}, {"zero_stage": 0}), ({"dp": 2}, {"zero_stage": 2})], id="bf16-zero2->1->zero2"
    ),
    pytest.param(
        "tied-tp2-pp2",
        [({"tp": 4}, {}), ({"dp": 2, "pp": 2}, {"zero_stage": 3})],
        id="tied->tp4->dp2xpp2-zero3",
        marks=pytest.mark.long,
    ),
    pytest.param(
        "tp2-sp-pp2-interleaved",
        [({"tp": 4}, {"sequence_parallel": False, "schedule": "1f1b", "virtual_stages": 1})],
        id="tp2-sp-interleaved->tp4",
    ),
    pytest.param(
        "cp2-dp2-zero1",
        [({"dp": 4}, {}), ({"cp": 4}, {"zero_stage": 3}), ({"cp": 2, "tp": 2}, {"zero_stage": 0})],
        id="cp-hops",
        marks=pytest.mark.long,  # the cp rows of the other reshard tests stay in the default suite
    ),
]


@pytest.mark.parametrize("name, hops", MATRIX)
def test_every_global_tensor_survives_resharding(trained, tmp_path, name, hops):
    src = _checkpoint(trained, name)
    original = _global_state(src)
    current = src
    for i, (mesh, parallel) in enumerate(hops):
        report = _reshard(current, tmp_path / f"hop{i}", mesh, **parallel)
        assert report.target_mesh == {"pp": 1, "dp": 1, "ep": 1, "cp": 1, "tp": 1} | mesh
        _assert_same_state(original, _global_state(report.folder))
        current = report.folder
    assert read_index(current)["ranks"][0]["extra"] == read_index(src)["ranks"][0]["extra"]  # data position, losses


@pytest.mark.parametrize(
    "name, mesh, parallel",
    [
        pytest.param("dp2-tp2-pp2", {"tp": 4, "pp": 2}, {}, id="dp2xtp2xpp2"),
        pytest.param("tp2", {"tp": 4}, {}, id="tp2-vocab"),
        pytest.param("dp2-zero3", {"dp": 4}, {"zero_stage": 1}, id="zero3"),
        pytest.param("moe-dp2-ep2", {"ep": 4}, {}, id="moe"),
        pytest.param("cp2-dp2-zero1", {"cp": 4}, {}, id="cp2xdp2->cp4"),
    ],
)
def test_round_trip_reproduces_the_original_files(trained, tmp_path, name, mesh, parallel):
    config, _, _ = trained[name]
    src = _checkpoint(trained, name)
    there = _reshard(src, tmp_path / "there", mesh, **parallel).folder
    back = reshard(there, tmp_path / "back", config, max_block_bytes=4096).folder
    for before, after in zip(_files(src), _files(back), strict=True):
        assert before.keys() == after.keys()
        for key in before:
            assert torch.equal(before[key], after[key]), key


# -- training continues where it left off --------------------------------------------------------------


def _continue(config, out, init_from):
    return _train(config, out, init_from=init_from)


@pytest.mark.parametrize(
    "world, parallel, offline",
    [
        pytest.param(8, {"tp": 4, "pp": 2}, True, id="offline-tp4xpp2", marks=pytest.mark.long),
        pytest.param(4, {"pp": 4, "microbatches": 4, "stage_layers": [2, 1, 1, 2]}, True, id="offline-pp4"),
        pytest.param(4, {"dp": 4, "zero_stage": 3}, False, id="online-dp4-zero3"),
        pytest.param(4, {"cp": 2, "tp": 2}, True, id="offline-cp2xtp2"),
        pytest.param(1, {}, False, id="online-single"),
    ],
)
def test_training_continues_with_the_same_losses(distributed, trained, corpus, tmp_path, world, parallel, offline):
    _, _, losses = trained["dp2-tp2-pp2"]
    config = _with_vocab(_config(corpus, **parallel))
    src = _checkpoint(trained, "dp2-tp2-pp2")
    if offline:
        reshard(src, tmp_path / "run" / "checkpoints", config, max_block_bytes=4096)
        continued = distributed.run(world, _train, config, tmp_path / "run", True)[0]
    else:
        continued = distributed.run(world, _continue, config, tmp_path / "run", str(src))[0]
    assert continued[:SAVE_AT] == losses[:SAVE_AT]  # carried over from the checkpoint
    assert continued[SAVE_AT:] == pytest.approx(losses[SAVE_AT:], rel=DENSE_RTOL)


# -- bad input ------------------------------------------------------------------------------------------


def test_a_corrupt_source_is_named_and_nothing_is_written(trained, tmp_path):
    src = tmp_path / "copy"
    import shutil

    shutil.copytree(_checkpoint(trained, "tp2"), src)
    victim = src / "rank_00001.safetensors"
    victim.write_bytes(victim.read_bytes()[:-5])
    with pytest.raises(CheckpointError, match="rank_00001.safetensors does not match its sha256"):
        _reshard(src, tmp_path / "out", {"tp": 4})
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    victim.unlink()
    with pytest.raises(CheckpointError, match="rank_00001.safetensors is missing"):
        Checkpoint(src)


def test_bad_targets_are_refused_before_anything_is_written(trained, tmp_path):
    src = _checkpoint(trained, "dp2-tp2-pp2")
    with pytest.raises(ConfigError, match="parallel.tp=3 does not divide"):
        _reshard(src, tmp_path / "a", {"tp": 3})
    with pytest.raises(ConfigError, match="stage_layers"):
        _reshard(src, tmp_path / "b", {"pp": 2}, stage_layers=[1, 2])
    config = trained["dp2-tp2-pp2"][0]
    other = dataclasses.replace(config, model=dataclasses.replace(config.model, hidden=64))
    with pytest.raises(CheckpointError, match="model must equal"):
        reshard(src, tmp_path / "c", other)
    reshard(src, tmp_path / "d", config)
    with pytest.raises(CheckpointError, match="exists; pass --overwrite"):
        reshard(src, tmp_path / "d", config)
    assert latest_checkpoint(tmp_path / "a") is None and latest_checkpoint(tmp_path / "b") is None


# -- export and the command line ----------------------------------------------------------------------


def _parallel_loss(config, folder, tokens):
    from polyshard.trainer.checkpointing.run_reshard import load_into
    from polyshard.trainer.engine.builder import build_engine
    from polyshard.trainer.loop import evaluate

    engine = build_engine(config, Mesh(config.parallel.mesh_axes))
    load_into(engine, Checkpoint(folder))
    return evaluate(engine, tokens[:, :-1], tokens[:, 1:])[0]  # every data rank gets the same batch


@pytest.mark.parametrize("name", ["dp2-tp2-pp2", "tied-tp2-pp2"])
def test_exported_weights_give_the_parallel_models_outputs(distributed, trained, tmp_path, name):
    import torch.nn.functional as F

    from polyshard.models import build_model
    from polyshard.trainer.checkpointing.run_export import export

    config, _, _ = trained[name]
    folder = _checkpoint(trained, name, STEPS)
    tokens = torch.randint(0, 130, (4, 17), generator=torch.Generator().manual_seed(3))
    parallel = distributed.run(SOURCES[name][0], _parallel_loss, config, folder, tokens)[0]
    model = build_model(config.model)
    state = load_file(str(export(folder, tmp_path / "plain.safetensors")))
    model.load_state_dict(state, strict=True)  # a tied head gets the embedding's values under its own name
    # The same weights after resharding to one process (where the tied pair is one tensor).
    single = _reshard(folder, tmp_path / "single", {}, microbatches=1).folder
    resharded = load_file(str(export(single, tmp_path / "single.safetensors")))
    assert resharded.keys() == state.keys() and all(torch.equal(resharded[k], v) for k, v in state.items())
    model.eval()
    with torch.no_grad():
        plain = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).item()
        fresh = F.cross_entropy(build_model(config.model)(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    # Same weights; tp splits the matmuls and the softmax sum, so float32 sums are taken in
    # another order (~1e-7 relative).
    assert parallel == pytest.approx(plain, rel=1e-6)
    assert abs(plain - fresh.item()) > 1e-3  # the trained weights moved the loss: a misplaced shard would show


@pytest.mark.long
def test_reshard_command(trained, tmp_path):
    import subprocess
    import sys

    polyshard = [sys.executable, "-m", "polyshard.cli.main", "reshard"]
    src = trained["dp2-tp2-pp2"][1]  # a run folder: its latest checkpoint is used
    dst = tmp_path / "new" / "checkpoints"
    ok = subprocess.run(
        polyshard
        + [str(src), str(dst), "--mesh", "pp=4", "--stage-layers", "2,1,1,2", "--set", "parallel.microbatches=4"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ok.returncode == 0, ok.stderr
    assert "to {'pp': 4, 'dp': 1, 'ep': 1, 'cp': 1, 'tp': 1}: 4 rank files" in ok.stdout
    assert "--set parallel.stage_layers=[2,1,1,2]" in ok.stdout and f"--out {dst.parent} --resume" in ok.stdout
    assert read_index(step_dir(dst, STEPS))["config"]["parallel"]["stage_layers"] == [2, 1, 1, 2]
    for args, message in [
        (["--mesh", "tp=3"], "parallel.tp=3 does not divide"),
        (["--mesh", "xp=2"], "write axis=size"),
        (["--mesh", "dp=2", "--set", "optimizer.lr=1"], "parallel.<key>=<value> only"),
    ]:
        bad = subprocess.run(polyshard + [str(src), str(tmp_path / "bad"), *args], capture_output=True, text=True)
        assert bad.returncode == 2 and message in bad.stderr, bad.stderr
    assert not (tmp_path / "bad").exists()


def _wsd(corpus, **training):
    config = _config(corpus, dp=2)
    wsd = {"name": "wsd", "decay_fraction": 0.5, "decay_shape": "sqrt"}  # decays over steps 4-6
    logging = dataclasses.replace(config.logging, every=1)
    return dataclasses.replace(
        config,
        training=dataclasses.replace(config.training, steps=6, **training),
        lr_schedule=dataclasses.replace(config.lr_schedule, **wsd),
        logging=logging,
    )


def _losses_and_lrs(config, out, resume=False):
    result = train(config, Mesh(config.parallel.mesh_axes), Path(out), resume=resume)
    records = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return result.losses, [r["lr"] for r in records]


def test_a_run_resumed_mid_decay_continues_bitwise(distributed, corpus, tmp_path):
    """WSD: stopped after step 5, inside its decay, then resumed: the same learning rates and losses,
    bit for bit, as the run that never stopped."""
    whole = distributed.run(2, _losses_and_lrs, _wsd(corpus), str(tmp_path / "whole"))[0]
    distributed.run(2, _losses_and_lrs, _wsd(corpus, stop_at=5), str(tmp_path / "split"))
    resumed = distributed.run(2, _losses_and_lrs, _wsd(corpus), str(tmp_path / "split"), True)[0]
    assert resumed == whole  # exact: the schedule depends on the step alone
    assert whole[1][2] == whole[1][1] > whole[1][3] > whole[1][4] > whole[1][5]  # stable, then decaying
