"""`polyshard.models.load`: a model exported by `polyshard export RUN FILE` is rebuilt from the settings the
file records and loads with strict=True, for every family the registry holds."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from polyshard.checkpoint import CheckpointError, LocalTensor, save_checkpoint
from polyshard.mesh import Replicate, TensorPlacement
from polyshard.models import GPT, build_model, load, spec_of, tied_names
from polyshard.models.exported import SETTINGS_KEY
from polyshard.models.registry import SPECS
from polyshard.models.settings import presets
from polyshard.trainer.checkpointing.run_export import export
from polyshard.trainer.config import from_dict


def _small_models() -> dict[str, dict[str, object]]:
    """A small model of every family: its first tiny preset, or its defaults (the ViT's are small); and
    a tied GPT. (Every preset loads alike: the code that differs between families is build_model's.)"""
    models: dict[str, dict[str, object]] = {}
    for kind in SPECS:
        tiny = [name for name, (of, _) in presets().items() if of == kind and "tiny" in name]
        models[tiny[0] if tiny else kind] = {"preset": tiny[0]} if tiny else {"kind": kind}
    models["tiny-tied"] = {"preset": "tiny", "tie_embeddings": True}
    return models


SMALL = _small_models()


def _saved_run(tmp_path, model_settings):
    """A one-process checkpoint of a freshly built model, saved as a run saves it: a tied weight once,
    under its own name, and the run's settings in the index."""
    config = from_dict({"model": model_settings})
    model = build_model(config.model, seed=3)
    aliases = tied_names(config.model)
    tensors = {
        f"model/{name}": LocalTensor(t, TensorPlacement(name, tuple(t.shape), (("dp", Replicate()),)))
        for name, t in model.state_dict().items()
        if name not in aliases
    }
    step = save_checkpoint(tmp_path / "run", 1, tensors, mesh_axes={"dp": 1}, config=dataclasses.asdict(config))
    return model.eval(), step


def _inputs(model, settings):
    generator = torch.Generator().manual_seed(0)
    if isinstance(model, GPT):
        return torch.randint(0, 64, (2, 8), generator=generator)
    vit = from_dict({"model": settings}).model
    return torch.randn(2, vit.channels, vit.image_size, vit.image_size, generator=generator)


def test_every_family_of_the_registry_is_covered():
    kinds = {presets()[s["preset"]][0] if "preset" in s else s["kind"] for s in SMALL.values()}
    assert kinds == set(SPECS)


@pytest.mark.parametrize("name", list(SMALL))
def test_an_export_loads_as_the_model_it_came_from(tmp_path, name):
    original, step = _saved_run(tmp_path, SMALL[name])
    file = export(step, tmp_path / "model.safetensors")
    loaded = load(file)
    assert type(loaded) is type(original) and not loaded.training
    expected, got = original.state_dict(), loaded.state_dict()
    assert got.keys() == expected.keys()
    for key in expected:
        assert torch.equal(got[key], expected[key]), key
    model = from_dict({"model": SMALL[name]}).model
    for alias, weight in tied_names(model).items():
        assert loaded.get_parameter(alias) is loaded.get_parameter(weight)  # still one tensor, trained as one
    if not spec_of(model).has_experts:  # an MoE forward costs seconds on CPU; its weights are compared above
        with torch.no_grad():
            inputs = _inputs(original, SMALL[name])
            assert torch.equal(loaded(inputs), original(inputs))
    assert load(tmp_path).state_dict().keys() == expected.keys()  # the folder holding model.safetensors


def test_polyshard_export_writes_what_load_reads(tmp_path):
    from polyshard.cli.main import app

    original, step = _saved_run(tmp_path, SMALL["tiny-tied"])
    result = CliRunner().invoke(app, ["export", str(step.parent), str(tmp_path / "w.safetensors")])
    assert result.exit_code == 0, result.output
    loaded = load(tmp_path / "w.safetensors")
    assert all(torch.equal(t, original.state_dict()[k]) for k, t in loaded.state_dict().items())


def test_a_file_without_settings_loads_with_the_runs_model_settings(tmp_path):
    original, step = _saved_run(tmp_path, {"preset": "llama-tiny"})
    bare = tmp_path / "bare.safetensors"
    save_file(load_file(export(step, tmp_path / "model.safetensors")), str(bare))  # no metadata
    with pytest.raises(CheckpointError, match="records no model settings.*pass model= the run's \\[model\\]"):
        load(bare)
    loaded = load(bare, model={"preset": "llama-tiny"})
    assert all(torch.equal(t, original.state_dict()[k]) for k, t in loaded.state_dict().items())


def test_settings_that_do_not_match_the_weights_are_named_before_building(tmp_path):
    _, step = _saved_run(tmp_path, SMALL["tiny"])
    file = export(step, tmp_path / "model.safetensors")
    with pytest.raises(
        CheckpointError,
        match=r"missing: layers\.2\.norm.*not in the model: layers\.2\.attn.*"
        r"of another shape: layers\.0\.tok\.weight \[256, 64\] \(the model's \[300, 64\]\)",
    ):
        load(file, model={"preset": "tiny", "vocab_size": 300, "num_layers": 1})
    tensors = load_file(file)
    settings = json.loads(_metadata(file)[SETTINGS_KEY])
    save_file(tensors, str(tmp_path / "odd.safetensors"), {SETTINGS_KEY: json.dumps({**settings, "hidden": -1})})
    with pytest.raises(CheckpointError, match="odd.safetensors's recorded model settings: model.hidden=-1"):
        load(tmp_path / "odd.safetensors")
    with pytest.raises(CheckpointError, match="holds no model.safetensors"):
        load(tmp_path / "run")
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="junk.safetensors: not a safetensors file"):
        load(tmp_path / "junk.safetensors")


def _metadata(file):
    from safetensors import safe_open

    with safe_open(str(file), "pt") as handle:
        return handle.metadata()
