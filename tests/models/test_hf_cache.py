"""``--init-from hf:org/name``: a model id found in the local Hugging Face cache, with no network.

The cache is laid out in tmp_path as huggingface_hub lays it out (``models--org--name/refs/main``, the
files in ``blobs/`` and ``snapshots/<commit>/`` holding links to them) around a tiny random GPT-2 saved
with transformers' ``save_pretrained``; HF_HUB_CACHE (or HF_HOME, or the default under ~/.cache) points
at it. A path that exists stays a path; an absent model is one line naming the cache searched.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from polyshard.checkpoint import CheckpointError
from polyshard.checkpoint.hf_cache import hf_folder, hub_cache, resolve
from polyshard.trainer.checkpointing.hugging_face import HFSource, model_settings
from polyshard.trainer.config import from_dict
from polyshard.trainer.runtime.launch import prepare_launch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

MODEL_ID = "tiny-org/tiny-gpt2"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
OLDER = "89abcdef0123456789abcdef0123456789abcdef"


def _lay_out_cache(hub: Path, saved: Path, model_id: str, commit: str) -> Path:
    """``saved``'s files as huggingface_hub caches them: each in blobs/ under its hash, linked from the
    snapshot of ``commit``; refs/main names that commit. Returns the snapshot folder."""
    repo = hub / ("models--" + model_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True)
    for file in saved.iterdir():
        digest = hashlib.sha256(file.read_bytes()).hexdigest()
        file.replace(repo / "blobs" / digest)
        (snapshot / file.name).symlink_to(Path("..", "..", "blobs", digest))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_home")
    config = transformers.GPT2Config(vocab_size=300, n_positions=16, n_embd=32, n_layer=2, n_head=4)
    torch.manual_seed(0)
    saved = root / "saved"
    transformers.GPT2LMHeadModel(config).save_pretrained(saved)
    _lay_out_cache(root / "hub", saved, MODEL_ID, COMMIT)
    return root / "hub"


@pytest.fixture
def cache(hub, monkeypatch):
    for variable in ("HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    return hub


def _snapshot(hub: Path, commit: str = COMMIT) -> Path:
    return hub / "models--tiny-org--tiny-gpt2" / "snapshots" / commit


def test_a_model_id_is_its_snapshot_and_reads_through_the_cache_links(cache):
    folder = resolve(MODEL_ID)
    assert folder == _snapshot(cache) and (folder / "config.json").is_symlink()
    assert hf_folder(f"hf:{MODEL_ID}") == folder and hf_folder("runs/x/checkpoints") is None
    config = from_dict({"model": model_settings(folder)})
    assert config.model.hidden == 32 and config.model.vocab_size == 300
    # The weights are read through the snapshot's links into blobs/, which stay inside the model's
    # cache folder; the embedding read is the one transformers saved.
    source = HFSource(folder, config)
    key = next(k for k, loc in source.locations.items() if loc.name.endswith("wte.weight"))
    read = source.read(f"model/{key}", (0, 0), (300, 32), torch.float32)
    saved = safetensors_torch.load_file(folder / "model.safetensors")
    wte = next(v for name, v in saved.items() if name.endswith("wte.weight"))
    assert torch.equal(read, wte)


def test_the_launch_and_the_cli_take_a_model_id(cache, corpus, tmp_path):
    settings = {"data": {"source": corpus}, "training": {"steps": 2, "global_batch_size": 4}}
    launch = prepare_launch(settings, out=tmp_path / "run", nproc=1, init_from=f"hf:{MODEL_ID}")
    assert launch.init_from == f"hf:{_snapshot(cache).resolve()}"  # the workers read the folder itself
    assert launch.config.model.hidden == 32  # the [model] table left out comes from the cached config.json
    result = _cli_train(tmp_path, corpus, MODEL_ID, "--dry-run")
    assert result.exit_code == 0, result.output


def test_a_model_missing_from_the_cache_is_one_line_naming_the_cache(cache, corpus, tmp_path):
    result = _cli_train(tmp_path, corpus, "tiny-org/absent")
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.output
    assert lines[0].startswith("checkpoint error: hf:tiny-org/absent: not a folder here, and the Hugging Face cache ")
    assert f"{cache} (from HF_HUB_CACHE) holds no models--tiny-org--absent" in lines[0]
    assert "`hf download tiny-org/absent`" in lines[0]


def test_a_path_that_exists_stays_a_path(cache, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny-org" / "tiny-gpt2").mkdir(parents=True)  # the model id's spelling, as a local folder
    assert resolve(MODEL_ID) == Path(MODEL_ID)
    assert resolve(str(tmp_path / "elsewhere")) == tmp_path / "elsewhere"  # absolute: a path, named if missing
    assert resolve("./gpt2") == Path("gpt2")


def test_revisions_by_ref_and_by_commit(cache, tmp_path):
    repo = cache / "models--tiny-org--tiny-gpt2"
    older = _snapshot(cache, OLDER)
    older.mkdir()
    (repo / "refs" / "v1").write_text(OLDER + "\n")
    try:
        assert resolve(f"{MODEL_ID}@v1") == older
        assert resolve(f"{MODEL_ID}@{OLDER}") == older
        with pytest.raises(CheckpointError) as err:
            resolve(f"{MODEL_ID}@v2")
        assert f"has no snapshot of revision 'v2'; it holds {COMMIT}, {OLDER}" in str(err.value)
        assert f"`hf download {MODEL_ID} --revision v2`" in str(err.value)
    finally:
        older.rmdir()
        (repo / "refs" / "v1").unlink()


@pytest.mark.parametrize("name", ["a/b/c", "org--x/y", "org/..", "-x"])
def test_a_name_that_is_no_model_id_says_what_is_accepted(cache, name):
    with pytest.raises(CheckpointError, match=r"is no Hugging Face model id; give a model folder \(hf:DIR\)"):
        resolve(name)


def test_the_cache_folder_follows_huggingface_hubs_settings(monkeypatch, tmp_path):
    for variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert hub_cache()[0] == tmp_path / "home" / ".cache" / "huggingface" / "hub"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hub_cache()[0] == tmp_path / "xdg" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    assert hub_cache() == (tmp_path / "hf_home" / "hub", "HF_HOME/hub")
    monkeypatch.setenv("HF_HUB_CACHE", "~/hub")
    assert hub_cache() == (tmp_path / "home" / "hub", "from HF_HUB_CACHE")


def test_a_link_out_of_the_models_cache_folder_is_still_refused(cache, tmp_path):
    saved = tmp_path / "saved"
    saved.mkdir()
    for file in _snapshot(cache).iterdir():
        saved.joinpath(file.name).write_bytes(file.read_bytes())
    snapshot = _lay_out_cache(cache, saved, "tiny-org/leaky", COMMIT)
    try:
        outside = tmp_path / "outside.safetensors"
        outside.write_bytes(snapshot.joinpath("model.safetensors").read_bytes())
        snapshot.joinpath("model.safetensors").unlink()
        snapshot.joinpath("model.safetensors").symlink_to(outside)
        config = from_dict({"model": model_settings(snapshot)})
        with pytest.raises(CheckpointError, match="leads outside .* copy the file into the folder"):
            HFSource(resolve("tiny-org/leaky"), config)
    finally:
        import shutil

        shutil.rmtree(cache / "models--tiny-org--leaky")


def _cli_train(tmp_path: Path, corpus: str, model_id: str, *more: str):
    from polyshard.cli.main import app

    toml = "[training]\nsteps = 2\nglobal_batch_size = 4\n"
    toml += f"[data]\nsource = {json.dumps(corpus)}\n[logging]\nprogress_bar = false\n"
    (tmp_path / "c.toml").write_text(toml)
    args = ["train", str(tmp_path / "c.toml"), "--out", str(tmp_path / "run"), "--init-from", f"hf:{model_id}"]
    return CliRunner().invoke(app, [*args, *more])
