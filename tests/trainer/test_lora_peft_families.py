"""The PEFT round trip on every family with a Hugging Face adapter: a tiny random model saved with
transformers (the savers of tests/models/test_hf*.py), LoRA trained from ``hf:`` that folder on one
process, its checkpoint written as a PEFT folder that ``peft.PeftModel.from_pretrained`` loads onto the
transformers base with exactly our tensors and our logits, and read back by ``lora.init = "peft:DIR"``.
GPT-2's fused ``c_attn`` both ways (ours as one adapter of rank 3r, PEFT's own of rank r); the adapters
peft 0.21 would load onto a family's routed experts refused by name. Tolerances: ROUND_OFF, as
tests/models/_hf.py's (float32 sums in another order)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from polyshard.checkpoint import MODEL, Checkpoint, CheckpointError, latest_checkpoint
from polyshard.models import build_model
from polyshard.models.hf_adapters import hf_adapters
from polyshard.trainer.checkpointing.hugging_face import HFSource
from polyshard.trainer.checkpointing.peft import PEFT_EXPERT_NAMES, write_peft
from polyshard.trainer.checkpointing.run_export import consolidate
from polyshard.trainer.engine.lora import apply_lora
from polyshard.trainer.engine.peft_folder import read_peft
from tests.models._hf import ROUND_OFF
from tests.models.test_hf import _tokens
from tests.trainer.test_lora_peft import _config, _ours, _train_from_hf

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

# MLA's projections: peft re-targets DeepSeek's dense and shared gate/up/down_proj at the routed experts
# (PEFT_EXPERT_NAMES; the refusal is test_adapters_peft_would_load_onto_the_experts_are_refused's).
MLA = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
TARGETS = {"deepseek_v3": MLA, "deepseek_v2": ["q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]}
# The default suite: GPT-2's fused Conv1D c_attn, Qwen2-MoE's shared expert beside routed ones (whose
# gate_proj the file must not claim), DeepSeek-V3's MLA; `make test-long` every other family.
QUICK = ("gpt2", "qwen2_moe", "deepseek_v3")
FAMILIES = (*QUICK, "llama", "qwen2", "qwen3", "mixtral", "qwen3_moe", "deepseek_v2", "gpt_oss")


def _save_family(folder, family):
    from tests.models import test_hf, test_hf_deepseek, test_hf_gpt_oss, test_hf_llama, test_hf_moe

    if family == "gpt2":
        return test_hf._save_gpt2(folder, tie=True)
    if family == "llama":
        return test_hf_llama._save_llama(folder, tie=False)
    if family == "gpt_oss":
        return test_hf_gpt_oss._save(folder)
    if family.startswith("deepseek"):
        return test_hf_deepseek._save(folder, family)
    return test_hf_moe._save(folder, family)


def _family_config(folder, corpus, family):
    config = _config(folder, corpus)
    if family not in TARGETS:
        return config  # "all-linear"
    return dataclasses.replace(config, lora=dataclasses.replace(config.lora, targets=TARGETS[family]))


def _with_init(config, folder):
    return dataclasses.replace(config, lora=dataclasses.replace(config.lora, init=f"peft:{folder}"))


def _round_trip(config, folder, out):
    """One process: train from the folder with adapters, then the PEFT export of its last checkpoint."""
    _train_from_hf(config, folder, out / "run")
    step = latest_checkpoint(out / "run" / "checkpoints")
    return consolidate(step), write_peft(Checkpoint(step), out / "peft")


def test_every_family_with_a_hugging_face_adapter_is_a_row():
    assert set(FAMILIES) == set(hf_adapters())


@pytest.mark.parametrize("family", [f if f in QUICK else pytest.param(f, marks=pytest.mark.long) for f in FAMILIES])
def test_every_family_goes_out_to_peft_and_back(distributed, corpus, tmp_path, family):
    folder = _save_family(tmp_path / "hf", family)
    config = _family_config(folder, corpus, family)
    state, exported = distributed.run(1, _round_trip, config, folder, tmp_path)[0]
    written = load_file(exported / "adapter_model.safetensors")
    assert any(t.abs().sum() > 0 for k, t in written.items() if ".lora_B." in k)  # trained
    model = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(folder), exported)
    loaded = peft.get_peft_model_state_dict(model)
    assert loaded.keys() == written.keys() and all(torch.equal(loaded[k], written[k]) for k in written)
    with torch.no_grad():
        theirs, mine = model.eval()(_tokens()[:, :-1]).logits, _ours(config, state)(_tokens()[:, :-1])
    torch.testing.assert_close(mine, theirs, rtol=ROUND_OFF, atol=ROUND_OFF)
    back = read_peft(_with_init(config, exported))
    assert back.keys() == {k.removesuffix(".lora_A.weight") for k in state if k.endswith(".lora_A.weight")}
    for name, (a, b) in back.items():
        assert torch.equal(a, state[f"{name}.lora_A.weight"]) and torch.equal(b, state[f"{name}.lora_B.weight"])


def _ours_from_folder(config, folder):
    """One process's adapted model: the base from the Hugging Face folder, the adapters from ``lora.init``."""
    model = build_model(config.model)
    apply_lora(model, config)
    source = HFSource(folder, config)
    base = {}
    for name in source.locations:
        shape = tuple(source.global_shape(MODEL + name))
        base[name] = source.read(MODEL + name, (0,) * len(shape), shape, torch.float32)
    missing, unexpected = model.load_state_dict(base, strict=False)
    assert not unexpected and all(".lora_" in k for k in missing)
    return model.eval()


def test_a_peft_made_gpt2_adapter_reads_as_peft_computes(corpus, tmp_path):
    # PEFT's own all-linear adapter on GPT-2: c_attn (q, k, v in one Conv1D) at rank r, c_proj and c_fc
    from tests.models.test_hf import _save_gpt2

    folder = _save_gpt2(tmp_path / "hf", tie=False)  # a head of its own: the folder holds every weight we load
    config = _config(folder, corpus)
    settings = peft.LoraConfig(r=4, lora_alpha=8.0, target_modules="all-linear")
    model = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(folder), settings)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.3)  # B away from zero: the adapters count
    model.save_pretrained(tmp_path / "peft")
    saved = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert saved["fan_in_fan_out"] and {m.rsplit(".", 1)[-1] for m in saved["target_modules"]} == {
        "c_attn", "c_fc", "c_proj"
    }  # fmt: skip
    with torch.no_grad():
        theirs = model.eval()(_tokens()[:, :-1]).logits
        mine = _ours_from_folder(_with_init(config, tmp_path / "peft"), folder)(_tokens()[:, :-1])
    torch.testing.assert_close(mine, theirs, rtol=ROUND_OFF, atol=ROUND_OFF)


def test_a_fused_modules_adapter_that_is_not_ours_is_refused(corpus, tmp_path):
    folder = _save_family(tmp_path / "hf", "gpt2")
    config = _config(folder, corpus)
    model = peft.get_peft_model(
        transformers.AutoModelForCausalLM.from_pretrained(folder), peft.LoraConfig(r=4, target_modules="all-linear")
    )
    model.save_pretrained(tmp_path / "peft")
    settings = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    tensors = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    key = "base_model.model.transformer.h.0.attn.c_attn.lora_B.weight"

    def refused(settings_edit, tensors_edit, match):
        (tmp_path / "peft" / "adapter_config.json").write_text(json.dumps({**settings, **settings_edit}))
        save_file({**tensors, **tensors_edit}, str(tmp_path / "peft" / "adapter_model.safetensors"))
        with pytest.raises(CheckpointError, match=match):
            read_peft(_with_init(config, tmp_path / "peft"))

    ours = {"rank_pattern": {"c_attn": 12}, "alpha_pattern": {"c_attn": 24.0}, "lora_alpha": 8.0}
    wide = {key.replace("lora_B", "lora_A"): torch.zeros(12, 32), key: torch.ones(96, 12)}  # rank 3r, B full
    refused(ours, wide, r"c_attn.lora_B.weight is not block diagonal")
    refused({**ours, "alpha_pattern": {"c_attn": 8.0}}, {}, r"alpha_pattern=\{'c_attn': 8.0\} are not read")
    refused({"fan_in_fan_out": False}, {}, r"fan_in_fan_out=False, but this model's modules are Conv1D")


def test_gpt2s_targets_are_its_module_names(corpus, tmp_path):
    from polyshard.models.lora_targets import select_targets

    folder = _save_family(tmp_path / "hf", "gpt2")
    model = _config(folder, corpus).model
    c_attn = select_targets(model, ["c_attn"], 4)
    assert [(t.short, t.hf_path, t.part, t.parts) for t in c_attn[:3]] == [
        (p, "transformer.h.0.attn.c_attn", i, 3) for i, p in enumerate(("q_proj", "k_proj", "v_proj"))
    ]
    assert {t.hf_short for t in select_targets(model, "all-linear", 4)} == {"c_attn", "c_proj", "c_fc"}
    assert len(select_targets(model, ["c_proj"], 4)) == 4  # attention's and the MLP's, in both blocks


def test_a_part_of_c_attn_alone_is_refused_by_the_export(distributed, corpus, tmp_path):
    from typer.testing import CliRunner

    from polyshard.cli import main as cli_main

    folder = _save_family(tmp_path / "hf", "gpt2")
    config = _config(folder, corpus)
    config = dataclasses.replace(config, lora=dataclasses.replace(config.lora, targets=["q_proj", "c_fc"]))
    distributed.run(1, _train_from_hf, config, folder, tmp_path / "run")
    step = latest_checkpoint(tmp_path / "run" / "checkpoints")
    result = CliRunner().invoke(cli_main.app, ["export", str(step), str(tmp_path / "out"), "--format", "peft"])
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output
    assert "['q_proj'] are parts of the fused Hugging Face module c_attn" in result.output
    assert "['k_proj', 'q_proj', 'v_proj'] (or 'c_attn')" in result.output


def test_adapters_peft_would_load_onto_the_experts_are_refused(distributed, corpus, tmp_path):
    from typer.testing import CliRunner

    from polyshard.cli import main as cli_main

    folder = _save_family(tmp_path / "hf", "deepseek_v2")
    config = _config(folder, corpus)  # all-linear: the dense block's and the shared experts' MLPs too
    distributed.run(1, _train_from_hf, config, folder, tmp_path / "run")
    step = latest_checkpoint(tmp_path / "run" / "checkpoints")
    result = CliRunner().invoke(cli_main.app, ["export", str(step), str(tmp_path / "out"), "--format", "peft"])
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output
    assert "DeepSeek-V2 adapter on model.layers.0.mlp.down_proj onto the fused routed experts" in result.output
    assert not (tmp_path / "out").exists()


def test_the_refused_names_are_the_installed_pefts():
    # peft re-targets these names at the fused experts in these families (what PEFT_EXPERT_NAMES refuses)
    from peft.utils import transformers_weight_conversion as conversion
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    found = {}
    for family in hf_adapters():
        pattern = conversion._MODEL_TO_CONVERSION_PATTERN.get(family)
        names = conversion._MOE_TARGET_MODULE_MAPPING.get(pattern or "", {})
        if names and get_checkpoint_conversion_mapping(family) is not None:
            found[family] = set(names)
    assert found == {family: set(names) for family, names in PEFT_EXPERT_NAMES.items()}
