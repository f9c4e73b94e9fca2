"""``lora.experts`` in checkpoints and exports: an ep2 run's adapters-only checkpoint carries every expert's
adapters (split over ep as training holds them, with their AdamW state), a run resumed from it ends as an
uninterrupted one bit for bit, it reshards ep2 -> 1 -> ep2 to the same files, ``--format hf --merge`` folds
the expert adapters into the experts (the merged model's logits are the adapted model's, ours and
transformers'), and ``--format peft`` writes them."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from polyshard.checkpoint import RNG, Checkpoint, latest_checkpoint, read_index
from polyshard.cli import main as cli_main
from polyshard.mesh import Mesh
from polyshard.models import build_model
from polyshard.models.common.lora import is_adapter, is_expert_adapter
from polyshard.trainer.checkpointing.peft import merged_weights
from polyshard.trainer.checkpointing.records import plan_ranks
from polyshard.trainer.checkpointing.run_export import consolidate
from polyshard.trainer.checkpointing.run_reshard import reshard, target_config
from polyshard.trainer.engine.lora import apply_lora
from tests.trainer.test_lora_experts import BLOCKS, EXPERTS
from tests.trainer.test_lora_experts import _config as experts_config

transformers = pytest.importorskip("transformers")

STEPS = 4


def _train(config, out, resume=False):
    from polyshard.trainer.loop import train

    return train(config, Mesh(config.parallel.mesh_axes), out, log=False, resume=resume).losses


def _whole_and_split(config, out):
    half = dataclasses.replace(config, training=dataclasses.replace(config.training, steps=STEPS // 2))
    whole = _train(config, out / "whole")
    _train(half, out / "split")
    return whole, _train(config, out / "split", resume=True)


def _latest(out):
    return Checkpoint(latest_checkpoint(out / "checkpoints"))


def _files(folder):
    return [load_file(str(folder / entry["file"])) for entry in read_index(folder)["ranks"]]


def test_an_ep2_run_resumes_and_reshards_with_its_expert_adapters(distributed, corpus, tmp_path):
    config = experts_config(corpus, ep=2)
    whole_losses, split_losses = distributed.run(2, _whole_and_split, config, tmp_path)[0]
    assert split_losses == whole_losses
    whole, split = _latest(tmp_path / "whole"), _latest(tmp_path / "split")
    params = split.params()
    assert all(is_adapter(n) for n in params) and split.optim_state().keys() == params.keys()
    experts = [n for n in params if is_expert_adapter(n)]
    assert len(experts) == BLOCKS * 3 * 2  # A and B of w1, w3, w2 in each block
    for key in whole.pieces.keys() - {RNG}:
        assert torch.equal(whole.whole(key), split.whole(key)), key
    # Each ep rank saved its own experts' adapters: (E/2, ...) slices of the (E, ...) whole.
    index = read_index(split.folder)
    key = next(k for k in index["ranks"][0]["tensors"] if k.endswith("experts.w1_lora_A"))
    halves = [load_file(str(split.folder / entry["file"]))[key] for entry in index["ranks"]]
    assert [h.shape[0] for h in halves] == [EXPERTS // 2] * 2 and not torch.equal(halves[0], halves[1])
    assert torch.equal(torch.cat(halves), split.whole(key))
    # Offline resharding computes the records training saved, and goes ep2 -> 1 -> ep2 to the same files.
    for rank, plan in enumerate(plan_ranks(config, split.params(), split.optim_state())):
        saved = {k: v for k, v in index["ranks"][rank]["tensors"].items() if k != RNG}
        assert plan.keys() == saved.keys()
        assert all((item.record.to_json() if item.record else None) == saved[k] for k, item in plan.items())
    one = reshard(split, tmp_path / "one", target_config(split, {})).folder
    back = reshard(Checkpoint(one), tmp_path / "back", target_config(Checkpoint(one), {"ep": 2})).folder
    for before, after in zip(_files(split.folder), _files(back), strict=True):
        assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    ours, theirs = consolidate(split), consolidate(Checkpoint(one))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)

    # --format hf --merge folds them in: W + scale A @ B per expert, the adapted model's logits.
    merged = merged_weights(split)
    assert not any(is_adapter(n) for n in merged)
    adapted = build_model(config.model, seed=0)
    apply_lora(adapted, config)
    adapted.load_state_dict(ours)
    plain = build_model(config.model, seed=1)
    plain.load_state_dict(merged)
    tokens = torch.randint(0, config.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        # float32 round-off of folding the product into the weight, relative ~1e-7 of the logits
        torch.testing.assert_close(plain(tokens), adapted(tokens), rtol=1e-5, atol=1e-5)
        assert not torch.allclose(build_model(config.model, seed=0)(tokens), adapted(tokens), atol=1e-4)
    args = ["export", str(split.folder), str(tmp_path / "hf"), "--format", "hf", "--merge"]
    result = CliRunner().invoke(cli_main.app, args)
    assert result.exit_code == 0, result.output
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    # transformers' own Qwen3-MoE on the merged folder gives the adapted model's logits (1e-4: its attention
    # and softmax sum in another order, as in tests/trainer/test_lora_peft_families.py)
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, adapted(tokens), rtol=1e-4, atol=1e-4)

    # --format peft writes them as PEFT's target_parameters (loaded by peft: tests/trainer/test_lora_experts_peft.py)
    peft = CliRunner().invoke(cli_main.app, ["export", str(split.folder), str(tmp_path / "peft"), "--format", "peft"])
    assert peft.exit_code == 0, peft.output
    assert "mlp.experts.gate_up_proj" in (tmp_path / "peft" / "adapter_config.json").read_text()
