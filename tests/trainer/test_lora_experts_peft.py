"""The routed experts' adapters (``lora.experts``) go out to PEFT: a tiny random Qwen3-MoE saved with
transformers, LoRA on attention and every expert trained from it on ep2, its checkpoint written as a PEFT
folder (``target_parameters`` on transformers 5's fused ``gate_up_proj`` and ``down_proj``) that
``peft.PeftModel.from_pretrained`` loads onto the transformers base with exactly our tensors and our
logits; what PEFT cannot hold as trained is refused in one line. Tolerance: ROUND_OFF, as
tests/models/_hf.py's (float32 sums in another order)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

from polyshard.checkpoint import Checkpoint, CheckpointError, latest_checkpoint
from polyshard.models.common.lora import is_expert_adapter
from polyshard.trainer.checkpointing.peft import write_peft
from polyshard.trainer.checkpointing.peft_experts import expert_target_parameters
from polyshard.trainer.checkpointing.run_export import consolidate
from tests.models._hf import ROUND_OFF
from tests.models.test_hf import _tokens
from tests.models.test_hf_moe import _save
from tests.trainer.test_lora_peft import _config, _ours, _train_from_hf

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


def _with_experts(config, **lora):
    return dataclasses.replace(config, lora=dataclasses.replace(config.lora, experts=True, **lora))


def _run_and_export(config, folder, out):
    import torch.distributed as dist

    _train_from_hf(config, folder, out / "run")
    if dist.get_rank() != 0:
        return None  # one writer of the (offline) export
    step = latest_checkpoint(out / "run" / "checkpoints")
    return consolidate(step), write_peft(Checkpoint(step), out / "peft")


def test_expert_adapters_go_out_to_peft(distributed, corpus, tmp_path):
    folder = _save(tmp_path / "hf", "qwen3_moe")
    config = _with_experts(_config(folder, corpus, ep=2))
    state, exported = distributed.run(2, _run_and_export, config, folder, tmp_path)[0]
    assert any(is_expert_adapter(k) and k.endswith("_lora_B") and v.abs().sum() > 0 for k, v in state.items())
    settings = json.loads((exported / "adapter_config.json").read_text())
    assert sorted(settings["target_parameters"]) == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]
    written = load_file(exported / "adapter_model.safetensors")
    assert any(".experts.base_layer.lora_A." in k for k in written) and any(".experts.lora_B." in k for k in written)
    model = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(folder), exported)
    loaded = peft.get_peft_model_state_dict(model)
    assert loaded.keys() == written.keys() and all(torch.equal(loaded[k], written[k]) for k in written)
    with torch.no_grad():
        theirs, mine = model.eval()(_tokens()[:, :-1]).logits, _ours(config, state)(_tokens()[:, :-1])
        torch.testing.assert_close(mine, theirs, rtol=ROUND_OFF, atol=ROUND_OFF)
        # the expert adapters count: without them PEFT's model gives other logits
        with model.disable_adapter():
            assert not torch.allclose(model(_tokens()[:, :-1]).logits, mine, atol=1e-4)


def test_what_peft_cannot_hold_is_refused_in_one_line(corpus, tmp_path):
    qwen3 = _with_experts(_config(_save(tmp_path / "qwen3", "qwen3_moe"), corpus), dropout=0.1)
    with pytest.raises(CheckpointError, match=r"lora.dropout=0.1 on the routed experts.*ParamWrapper") as err:
        expert_target_parameters(qwen3, "run")
    mixtral = _with_experts(_config(_save(tmp_path / "mixtral", "mixtral"), corpus))
    with pytest.raises(CheckpointError, match=r"for \['qwen3_moe'\] only, not Mixtral") as other:
        expert_target_parameters(mixtral, "run")
    assert "\n" not in str(err.value) + str(other.value)
