"""`polyshard export` and `polyshard reshard` as a careless or hostile user drives them (issue 46): nothing
is overwritten without --overwrite, nothing is ever written into the checkpoint read, links and the wrong
kind of destination, files that lead out of the folder read, deeply nested JSON and a tampered MoE index
are each exit 2 with one line and no traceback."""

import dataclasses
import json

import pytest
from typer.testing import CliRunner

from polyshard.checkpoint import LocalTensor, save_checkpoint
from polyshard.checkpoint.format import sha256
from polyshard.cli.main import app
from polyshard.models import build_model
from polyshard.trainer.checkpointing.state import persistent_buffers
from polyshard.trainer.config import from_dict

GPT = {"hidden": 16, "num_layers": 1, "num_heads": 2, "context_length": 8, "vocab_size": 64}
DEEPSEEK = {
    "kind": "deepseek-v3", "hidden": 16, "num_layers": 2, "num_heads": 2, "context_length": 8, "vocab_size": 64,
    "mlp_hidden": 24, "q_lora_rank": 8, "kv_lora_rank": 8, "qk_nope_head_dim": 4, "qk_rope_head_dim": 4,
    "v_head_dim": 4, "moe": {"num_experts": 4, "top_k": 2, "ffn_hidden": 8, "score": "sigmoid", "dense_layers": [0]},
}  # fmt: skip


def _run(tmp_path, model=GPT):
    """A run folder holding one checkpoint of ``model`` saved as one process saves it."""
    config = from_dict({"model": model})
    built = build_model(config.model)
    tensors = {
        f"model/{n}": LocalTensor(t.detach()) for n, t in [*built.named_parameters(), *persistent_buffers(built)]
    }
    root = tmp_path / "run" / "checkpoints"
    save_checkpoint(root, 5, tensors, mesh_axes={"dp": 1}, config=dataclasses.asdict(config))
    return tmp_path / "run", root / "step_00000005"


def _cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def _refused(result, message):
    """Exit 2, one line on stderr naming the problem, no traceback."""
    assert result.exit_code == 2, result.output
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit)
    assert "Traceback" not in result.output and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert message in result.stderr, result.stderr


def _hashes(folder):
    return {p.name: sha256(p) for p in sorted(folder.iterdir())}


def test_export_and_reshard_replace_only_when_asked_and_never_the_checkpoint(tmp_path):
    run, step = _run(tmp_path)
    before = _hashes(step)
    out = tmp_path / "model.safetensors"
    out.write_text("the user's")
    _refused(_cli("export", run, out), "model.safetensors exists; pass --overwrite")
    assert out.read_text() == "the user's"
    assert _cli("export", run, out, "--overwrite").exit_code == 0 and out.stat().st_size > 1000
    for inside in (step / "rank_00000.safetensors", step / "index.json", step.parent / "w.safetensors"):
        _refused(_cli("export", run, inside, "--overwrite"), "which this command reads")
    _refused(_cli("export", run, run, "--format", "hf", "--overwrite"), "which this command reads")
    _refused(_cli("reshard", run, step.parent, "--mesh", "dp=1", "--overwrite"), "which this command reads")
    assert _hashes(step) == before and _cli("inspect", run).exit_code == 0
    assert _cli("reshard", run, tmp_path / "new", "--mesh", "dp=1").exit_code == 0
    _refused(_cli("reshard", run, tmp_path / "new", "--mesh", "dp=1"), "step_00000005 exists; pass --overwrite")
    assert _cli("reshard", run, tmp_path / "new", "--mesh", "dp=1", "--overwrite").exit_code == 0


def test_temporary_names_links_and_kinds(tmp_path):
    run, _ = _run(tmp_path)
    (tmp_path / "w.safetensors.tmp").write_text("mine")
    (tmp_path / ".tmp-hf").mkdir()
    (tmp_path / ".tmp-hf" / "notes").write_text("mine too")
    assert _cli("export", run, tmp_path / "w.safetensors").exit_code == 0
    assert _cli("export", run, tmp_path / "hf", "--format", "hf").exit_code == 0
    assert (tmp_path / "w.safetensors.tmp").read_text() == "mine"
    assert (tmp_path / ".tmp-hf" / "notes").read_text() == "mine too"
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    _refused(_cli("export", run, tmp_path / "dangling", "--format", "hf"), "dangling is a link")
    _refused(_cli("reshard", run, tmp_path / "dangling", "--mesh", "dp=1"), "dangling is a link to nothing")
    _refused(_cli("export", run, tmp_path / "w.safetensors", "--format", "hf", "--overwrite"), "is a file, not a")
    _refused(_cli("reshard", run, tmp_path / "w.safetensors", "--mesh", "dp=1"), "is a file, not a folder")
    _refused(_cli("export", run, tmp_path / "hf", "--overwrite"), "is a folder; give the file")


@pytest.mark.parametrize("change", ["linked", "nested"])
def test_an_index_that_leads_out_or_nests_too_deeply_is_one_line_everywhere(tmp_path, change):
    run, step = _run(tmp_path)
    if change == "linked":
        (tmp_path / "index.json").write_text((step / "index.json").read_text())
        (step / "index.json").unlink()
        (step / "index.json").symlink_to(tmp_path / "index.json")
        message = "index.json leads outside"
    else:
        (step / "index.json").write_text("[" * 100_000 + "]" * 100_000)
        message = "index.json is JSON nested too deeply"
    (tmp_path / "c.toml").write_text('[model]\npreset = "tiny"\n[training]\nsteps = 1\n')
    commands = [
        ["inspect", step],
        ["export", step, tmp_path / "w.safetensors"],
        ["reshard", step, "x", "--mesh", "dp=1"],
        ["train", tmp_path / "c.toml", "--out", tmp_path / "new", "--init-from", step],  # before any process
    ]
    for command in commands:
        _refused(_cli(*command), message)
    assert not (tmp_path / "new").exists()


def test_a_tampered_moe_index_names_the_tensor_and_the_file(tmp_path):
    run, step = _run(tmp_path, DEEPSEEK)
    index = json.loads((step / "index.json").read_text())
    index["config"]["model"]["moe"]["num_experts"] = 16  # what the saved files hold: 4
    (step / "index.json").write_text(json.dumps(index))
    commands = [
        ["export", run, tmp_path / "hf", "--format", "hf"],
        ["export", run, tmp_path / "w.safetensors"],  # it would record settings its weights contradict
        ["reshard", run, tmp_path / "new", "--mesh", "dp=1"],
        ["generate", run, "--tokens", "2"],
    ]
    for command in commands:
        result = _cli(*command)
        _refused(result, f"{step}/index.json: the saved config makes 'model/layers.2.mlp.moe.")
        assert "[4, " in result.stderr and "[16, " in result.stderr and "written incompletely" not in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


@pytest.mark.parametrize("change", ["linked", "nested"])
def test_train_refuses_a_folders_config_that_leads_out_or_nests_too_deeply(tmp_path, change):
    (tmp_path / "hf").mkdir()
    config = tmp_path / "hf" / "config.json"
    if change == "linked":
        (tmp_path / "outside.json").write_text(json.dumps({"model_type": "llama"}))
        config.symlink_to(tmp_path / "outside.json")
    else:
        config.write_text('{"model_type": "llama", "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    (tmp_path / "c.toml").write_text('[model]\npreset = "tiny"\n[training]\nsteps = 1\n')
    result = _cli("train", tmp_path / "c.toml", "--out", tmp_path / "run", "--init-from", f"hf:{tmp_path / 'hf'}")
    _refused(result, "config.json leads outside" if change == "linked" else "config.json is JSON nested too deeply")
    assert not (tmp_path / "run").exists()  # refused before anything started


def test_a_run_never_saves_over_the_checkpoint_it_starts_from(tmp_path):
    run, step = _run(tmp_path)
    before = _hashes(step)
    (tmp_path / "c.toml").write_text("[model]\n" + "".join(f"{k} = {v}\n" for k, v in GPT.items()))
    for out in (run, run / "checkpoints" / ".."):  # its saves would replace step_00000005 or prune it
        _refused(_cli("train", tmp_path / "c.toml", "--out", out, "--init-from", run), "where this run saves")
    assert _hashes(step) == before
