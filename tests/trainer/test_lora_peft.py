"""LoRA from a Hugging Face folder to a PEFT folder and back: trained on tp2 from ``hf:DIR``, exported with
``--format peft``'s writer, the folder loads onto the transformers base with peft with exactly our keys and
gives our logits; ``lora.init = "peft:DIR"`` starts a run (on tp2) from it; bad folders are refused in one
line naming the file. Tolerances: ROUND_OFF (float32 sums in another order), as tests/models/_hf.py's."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from polyshard.checkpoint import Checkpoint, CheckpointError, latest_checkpoint
from polyshard.mesh import Mesh
from polyshard.models import build_model
from polyshard.models.common.lora import is_adapter
from polyshard.trainer.checkpointing.hugging_face import hf_state, model_settings
from polyshard.trainer.checkpointing.peft import write_peft
from polyshard.trainer.checkpointing.run_export import consolidate
from polyshard.trainer.config import from_dict
from polyshard.trainer.engine.lora import apply_lora
from polyshard.trainer.engine.peft_folder import peft_targets, read_peft
from tests._pieces import assemble, parameter_pieces, where
from tests.models._hf import ROUND_OFF
from tests.models.test_hf import _tokens
from tests.models.test_hf_llama import _save_llama

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return _save_llama(tmp_path_factory.mktemp("llama"), tie=False)


def _config(folder, corpus, init=None, **parallel):
    lora = {"rank": 4, "alpha": 8.0, "targets": "all-linear", **({"init": f"peft:{init}"} if init else {})}
    return from_dict(
        {
            "model": model_settings(folder),
            "parallel": parallel,
            "training": {"steps": 3, "global_batch_size": 4},
            "optimizer": {"lr": 1e-2},
            "eval": {"every": 0, "sample_tokens": 0},
            "data": {"source": corpus},
            "logging": {"progress_bar": False},
            "lora": lora,
        }
    )


def _train_from_hf(config, folder, out):
    from polyshard.trainer.loop import train

    return train(config, Mesh(config.parallel.mesh_axes), out, log=False, init_from=f"hf:{folder}").losses


def _ours(config, state):
    """One process's adapted model holding ``state`` (the base and the adapters)."""
    model = build_model(config.model)
    apply_lora(model, config)
    model.load_state_dict(state, strict=True)
    return model.eval()


@pytest.fixture(scope="module")
def trained(distributed, base, corpus, tmp_path_factory):
    """The run on tp2 from the folder, its consolidated state and its PEFT export."""
    out = tmp_path_factory.mktemp("lora-run")
    config = _config(base, corpus, tp=2)
    distributed.run(2, _train_from_hf, config, base, out / "run")
    step = latest_checkpoint(out / "run" / "checkpoints")
    return config, consolidate(step), write_peft(Checkpoint(step), out / "peft")


def test_the_peft_export_loads_onto_the_transformers_base(base, trained):
    config, state, folder = trained
    original = load_file(base / "model.safetensors")
    frozen = hf_state({k: v for k, v in state.items() if not is_adapter(k)}, config.model)
    assert all(torch.equal(frozen[k], original[k]) for k in original)  # the base is the folder's, bit for bit
    written = load_file(folder / "adapter_model.safetensors")
    # 7 linears x 2 layers x (A, B), PEFT's names
    assert len(written) == 28 and "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight" in written
    assert any(t.abs().sum() > 0 for k, t in written.items() if ".lora_B." in k)  # trained away from B = 0
    model = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base), folder).eval()
    loaded = peft.get_peft_model_state_dict(model)
    assert loaded.keys() == written.keys() and all(torch.equal(loaded[k], written[k]) for k in written)
    with torch.no_grad():
        theirs, mine = model(_tokens()[:, :-1]).logits, _ours(config, state)(_tokens()[:, :-1])
    torch.testing.assert_close(mine, theirs, rtol=ROUND_OFF, atol=ROUND_OFF)
    settings = json.loads((folder / "adapter_config.json").read_text())
    assert (settings["r"], settings["lora_alpha"], settings["peft_type"]) == (4, 8.0, "LORA")


def _adapters_at_start(config, folder, out):
    from polyshard.trainer.loop import Trainer

    mesh = Mesh(config.parallel.mesh_axes)
    trainer = Trainer(config, mesh, out, log=False, init_from=f"hf:{folder}")
    return {**where(mesh), "params": parameter_pieces(trainer.engine)}


def test_a_run_starts_from_a_peft_folder(distributed, base, corpus, trained, tmp_path):
    _, _, exported = trained
    config = _config(base, corpus, init=exported, tp=2)
    params = assemble(distributed.run(2, _adapters_at_start, config, base, tmp_path / "run"), "params")
    written = load_file(exported / "adapter_model.safetensors")
    for name, tensor in params.items():
        if is_adapter(name):
            hf = name.replace("layers.", "model.layers.", 1).replace(".attn.", ".self_attn.")
            layer = int(name.split(".")[1])
            key = "base_model.model." + hf.replace(f"model.layers.{layer}.", f"model.layers.{layer - 1}.", 1)
            assert torch.equal(tensor, written[key]), name


def _refused(config, match):
    with pytest.raises(CheckpointError, match=match):
        read_peft(config)


def test_bad_peft_folders_are_refused_naming_the_file(base, corpus, trained, tmp_path):
    _, _, exported = trained
    config = _config(base, corpus, init=exported)
    assert len(read_peft(config)) == 14
    copy = tmp_path / "copy"
    copy.mkdir()
    settings = json.loads((exported / "adapter_config.json").read_text())
    tensors = load_file(exported / "adapter_model.safetensors")

    def write(settings_edit=None, tensors_edit=None):
        (copy / "adapter_config.json").write_text(json.dumps({**settings, **(settings_edit or {})}))
        save_file({**tensors, **(tensors_edit or {})}, str(copy / "adapter_model.safetensors"))
        return _config(base, corpus, init=copy)

    _refused(write({"peft_type": "IA3"}), r"adapter_config.json: peft_type='IA3' is not read; polyshard reads 'LORA'")
    _refused(write({"r": 8}), r"r=8 but \[lora\] says 4; set lora's rank to match the folder")
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    _refused(
        write(tensors_edit={key: torch.zeros(4, 32)}),
        r"q_proj.lora_A.weight is torch.float32 \(4, 32\), this model needs a float \(4, 64\)",
    )
    _refused(write(tensors_edit={"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64)}), "unexpected")
    _refused(write(tensors_edit={key: torch.full((4, 64), float("nan"))}), "NaN or infinite")
    write()
    data = (copy / "adapter_model.safetensors").read_bytes()
    (copy / "adapter_model.safetensors").write_bytes(data[:100])  # a tampered, truncated file
    _refused(_config(base, corpus, init=copy), "is not a readable safetensors file")
    plain = dataclasses.replace(config, lora=None)
    with pytest.raises(CheckpointError, match=r"trained no LoRA adapters \(\[lora\] was not set\)"):
        peft_targets(plain, "run")


def test_the_export_command_writes_the_peft_folder(trained, tmp_path):
    from typer.testing import CliRunner

    from polyshard.cli import main as cli_main

    _, _, exported = trained
    step = next((exported.parent / "run" / "checkpoints").glob("step_*"))
    result = CliRunner().invoke(cli_main.app, ["export", str(step), str(tmp_path / "out"), "--format", "peft"])
    assert result.exit_code == 0, result.output
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert (tmp_path / "out" / name).read_bytes() == (exported / name).read_bytes()
    again = CliRunner().invoke(cli_main.app, ["export", str(step), str(tmp_path / "out"), "--format", "peft"])
    assert again.exit_code == 2 and len(again.output.strip().splitlines()) == 1, again.output


def test_the_merged_export_is_the_adapted_model(base, trained, tmp_path):
    from typer.testing import CliRunner

    from polyshard.cli import main as cli_main

    config, state, exported = trained
    step = next((exported.parent / "run" / "checkpoints").glob("step_*"))
    plain = CliRunner().invoke(cli_main.app, ["export", str(step), str(tmp_path / "hf"), "--format", "hf"])
    assert plain.exit_code == 2 and "--format hf --merge" in plain.output  # never the untrained base silently
    ours = CliRunner().invoke(cli_main.app, ["export", str(step), str(tmp_path / "w.safetensors")])
    assert ours.exit_code == 2 and "--format peft writes the adapters" in ours.output
    merged = CliRunner().invoke(cli_main.app, ["export", str(step), str(tmp_path / "hf"), "--format", "hf", "--merge"])
    assert merged.exit_code == 0, merged.output
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    with torch.no_grad():
        theirs, mine = loaded.eval()(_tokens()[:, :-1]).logits, _ours(config, state)(_tokens()[:, :-1])
    torch.testing.assert_close(theirs, mine, rtol=ROUND_OFF, atol=ROUND_OFF)
    assert not torch.equal(
        load_file(tmp_path / "hf" / "model.safetensors")[_Q], load_file(base / "model.safetensors")[_Q]
    )


_Q = "model.layers.0.self_attn.q_proj.weight"


def test_a_lora_runs_state_generates_text(trained):
    # `polyshard generate` builds the adapted model before loading the run's state (adapter keys included)
    from polyshard.trainer.loop.sample import sample_text

    config, state, _ = trained
    text = sample_text(config, state, 4, prompt="ab", temperature=0.0)
    assert text.startswith("ab") and text == sample_text(config, state, 4, prompt="ab", temperature=0.0)
