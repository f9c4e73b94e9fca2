"""A LoRA run's checkpoints hold its adapters (and their optimizer state, RNG, data position) and name the
frozen base with a checksum (polyshard.trainer.checkpointing.lora_base): a run resumed from one ends with
the same tensors, bit for bit, as an uninterrupted run, on one process from the config's own base and on
tp2 from a Hugging Face folder; a base that changed or went away is refused in one line; offline
resharding lays the adapters out as training does and goes there and back to the same files."""

from __future__ import annotations

import dataclasses
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from polyshard.checkpoint import RNG, Checkpoint, CheckpointError, latest_checkpoint, read_index
from polyshard.mesh import Mesh
from polyshard.models import build_model
from polyshard.models.common.lora import is_adapter
from polyshard.trainer.checkpointing.base_and_adapters import with_base
from polyshard.trainer.checkpointing.hugging_face import model_settings
from polyshard.trainer.checkpointing.lora_base import base_names, checksum, open_base, recorded_base
from polyshard.trainer.checkpointing.records import plan_ranks
from polyshard.trainer.checkpointing.run_export import consolidate, saved_config
from polyshard.trainer.checkpointing.run_reshard import reshard, target_config
from polyshard.trainer.config import from_dict
from tests._short import SMALL_LLAMA, short_run
from tests.models.test_hf_llama import _save_llama

transformers = pytest.importorskip("transformers")

STEPS = 4


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return _save_llama(tmp_path_factory.mktemp("llama"), tie=False)


def _config(corpus, folder=None, steps=STEPS, hf_every=0, **parallel):
    """LoRA on every linear of a small Llama: the config's own (a Hugging Face ``folder``'s) base."""
    small = {"hidden": 32, "num_layers": 2, "num_heads": 4, "context_length": 16, **SMALL_LLAMA}
    return from_dict(
        {
            "model": model_settings(folder) if folder else small,
            "parallel": parallel,
            # lr 1e-2 and weight decay: the adapters and their moments move visibly in two steps
            **short_run(steps, lr=1e-2, weight_decay=2.0),
            "data": {"source": corpus},
            "logging": {"progress_bar": False},
            "checkpoint": {"hf_every": hf_every},
            "lora": {"rank": 4, "alpha": 8.0, "targets": "all-linear", "dropout": 0.1},
        }
    )


def _train(config, out, init_from=None, resume=False):
    from polyshard.trainer.loop import train

    return train(config, Mesh(config.parallel.mesh_axes), out, log=False, init_from=init_from, resume=resume).losses


def _whole_and_split(config, out, init_from):
    """An uninterrupted run, and one stopped halfway and resumed from its adapters-only checkpoint."""
    half = dataclasses.replace(config, training=dataclasses.replace(config.training, steps=STEPS // 2))
    whole = _train(config, out / "whole", init_from)
    _train(half, out / "split", init_from)
    return whole, _train(config, out / "split", resume=True)


def _latest(out):
    return Checkpoint(latest_checkpoint(out / "checkpoints"))


@pytest.mark.parametrize("world, parallel, from_hf", [(1, {}, False), (2, {"tp": 2}, True)], ids=["one", "tp2-hf"])
def test_a_run_resumed_from_its_adapters_ends_as_an_uninterrupted_one(
    distributed, base, corpus, tmp_path, world, parallel, from_hf
):
    # From a folder, the run also writes a Hugging Face folder of its last step (checkpoint.hf_every).
    config = _config(corpus, base if from_hf else None, hf_every=STEPS if from_hf else 0, **parallel)
    init_from = f"hf:{base}" if from_hf else None
    whole_losses, split_losses = distributed.run(world, _whole_and_split, config, tmp_path, init_from)[0]
    assert split_losses == whole_losses
    whole, split = _latest(tmp_path / "whole"), _latest(tmp_path / "split")
    # Adapters (both factors of 7 linears in 2 blocks) and their AdamW state; no base weight.
    assert len(split.params()) == 28 and all(is_adapter(n) for n in split.params())
    assert split.optim_state().keys() == split.params().keys()
    assert whole.pieces.keys() == split.pieces.keys()
    for key in whole.pieces.keys() - {RNG}:  # dropout is on: the RNG carried over too, or these would differ
        assert torch.equal(whole.whole(key), split.whole(key)), key
    record = recorded_base(split)
    assert record is not None and record.source == (f"hf:{base.resolve()}" if from_hf else "init:0")
    # The checksum is of the base the run trained beside: the folder's weights, or the config's own.
    built = build_model(config.model, seed=0) if not from_hf else None
    state = consolidate(split)
    frozen = {n: state[n] for n in base_names(config)}
    if built is not None:
        assert all(torch.equal(p, frozen[n]) for n, p in built.named_parameters())
    assert record.checksum == checksum(open_base(record, saved_config(split), split.folder), base_names(config))
    if from_hf:  # `polyshard train --resume` takes the model's settings from the recorded folder, as --init-from did
        from polyshard.trainer.runtime.launch import prepare_launch

        settings = {"parallel": parallel, "data": {"source": corpus}, "lora": {"rank": 4, "alpha": 8.0}}
        assert prepare_launch(settings, out=tmp_path / "split", resume=True).config.model == config.model
        # checkpoint.hf_every writes the adapted model: the adapters folded in, as --format hf --merge does
        from typer.testing import CliRunner

        from polyshard.cli import main as cli_main

        merged = tmp_path / "merged"
        args = ["export", str(whole.folder), str(merged), "--format", "hf", "--merge"]
        assert CliRunner().invoke(cli_main.app, args).exit_code == 0
        written = tmp_path / "whole" / "hf" / whole.folder.name
        assert load_file(written / "model.safetensors").keys() == load_file(merged / "model.safetensors").keys()
        assert (written / "model.safetensors").read_bytes() == (merged / "model.safetensors").read_bytes()
    uninterrupted = consolidate(whole)
    assert state.keys() == uninterrupted.keys() and all(torch.equal(state[n], uninterrupted[n]) for n in state)


def _resume_refusal(config, out):
    try:
        _train(config, out, resume=True)
    except CheckpointError as err:
        return str(err)
    return None


def test_a_changed_or_missing_base_is_refused_in_one_line(distributed, base, corpus, tmp_path):
    from typer.testing import CliRunner

    from polyshard.cli import main as cli_main

    copy = tmp_path / "base"
    shutil.copytree(base, copy)
    config = _config(corpus, copy, steps=2)
    distributed.run(1, _train, config, tmp_path / "run", f"hf:{copy}")
    saved = _latest(tmp_path / "run")
    recorded = recorded_base(saved)
    assert recorded is not None and with_base(saved, collective=False) is not saved  # the base as it was: read
    weights = load_file(copy / "model.safetensors")
    weights["model.layers.1.mlp.up_proj.weight"][3, 5] += 1e-3  # one weight of the base, changed a little
    save_file(weights, str(copy / "model.safetensors"), metadata={"format": "pt"})

    refusal = (
        rf"holds LoRA adapters trained on the base hf:{copy.resolve()} \(checksum {recorded.checksum[:16]}\), "
        r"but that base now has checksum [0-9a-f]{16}: it was replaced or changed"
    )
    message = distributed.run(1, _resume_refusal, config, tmp_path / "run")[0]
    assert message is not None and "\n" not in message
    assert re.search(refusal, message), message
    with pytest.raises(CheckpointError, match=refusal):
        consolidate(saved)  # generate and the closing sample read the base through it
    merged = CliRunner().invoke(
        cli_main.app, ["export", str(saved.folder), str(tmp_path / "merged"), "--format", "hf", "--merge"]
    )
    assert merged.exit_code == 2 and len(merged.output.strip().splitlines()) == 1, merged.output
    assert "now has checksum" in merged.output and not (tmp_path / "merged").exists()
    # The PEFT folder holds the adapters alone and names the base folder; it reads no base weight.
    peft = CliRunner().invoke(cli_main.app, ["export", str(saved.folder), str(tmp_path / "peft"), "--format", "peft"])
    assert peft.exit_code == 0, peft.output
    assert str(copy.resolve()) in (tmp_path / "peft" / "adapter_config.json").read_text()

    shutil.rmtree(copy)
    gone = rf"holds LoRA adapters only; their base hf:{copy.resolve()} cannot be read \(.*\); put the base back"
    with pytest.raises(CheckpointError, match=gone):
        with_base(saved, collective=False)
    message = distributed.run(1, _resume_refusal, config, tmp_path / "run")[0]
    assert message is not None and re.search(gone, message), message


def _files(folder):
    return [load_file(str(folder / entry["file"])) for entry in read_index(folder)["ranks"]]


def test_an_adapters_only_checkpoint_reshards_there_and_back(distributed, corpus, tmp_path):
    config = _config(corpus, steps=2, tp=2, sequence_parallel=True)
    distributed.run(2, _train, config, tmp_path / "run")
    source = _latest(tmp_path / "run")
    # The records offline resharding computes for the adapters are those training saved beside tp's split.
    index = read_index(source.folder)
    for rank, plan in enumerate(plan_ranks(config, source.params(), source.optim_state())):
        saved = {k: v for k, v in index["ranks"][rank]["tensors"].items() if k != RNG}
        assert plan.keys() == saved.keys()
        assert all((item.record.to_json() if item.record else None) == saved[k] for k, item in plan.items())
    one = reshard(source, tmp_path / "one", target_config(source, {})).folder
    back = reshard(Checkpoint(one), tmp_path / "back", target_config(Checkpoint(one), {"tp": 2})).folder
    for before, after in zip(_files(source.folder), _files(back), strict=True):
        assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert Checkpoint(one).extra()["lora_base"] == source.extra()["lora_base"]  # the base's name travels
    assert all(is_adapter(n) for n in Checkpoint(one).params())
    ours, theirs = consolidate(source), consolidate(one)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_runs_start_from_a_whole_model_checkpoint_and_from_an_adapters_only_one(distributed, corpus, tmp_path):
    # A plain run's checkpoint holds a whole model: a LoRA run from it names that checkpoint as its base.
    plain = dataclasses.replace(_config(corpus, steps=2), lora=None)
    distributed.run(1, _train, plain, tmp_path / "plain")
    pretrained = _latest(tmp_path / "plain")
    distributed.run(1, _train, _config(corpus, steps=3), tmp_path / "lora", str(pretrained.folder))
    adapted = _latest(tmp_path / "lora")
    assert recorded_base(adapted).source == f"checkpoint:{pretrained.folder.resolve()}"
    assert all(is_adapter(n) for n in adapted.params())
    state, before = consolidate(adapted), consolidate(pretrained)
    assert all(torch.equal(state[n], before[n]) for n in before)  # the base: the plain run's weights
    # A run from that adapters-only checkpoint names the same base, read back and checked as it loads.
    distributed.run(1, _train, _config(corpus, steps=4), tmp_path / "more", str(adapted.folder))
    more = _latest(tmp_path / "more")
    assert recorded_base(more) == recorded_base(adapted) and more.step == 4
