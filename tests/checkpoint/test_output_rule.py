"""The one output rule (polyshard.checkpoint.output) for every writer of the package: export, a Hugging
Face folder, reshard and saves replace nothing unless asked, never write in, on or around the checkpoint
they read, use temporary names of their own, and refuse links and the wrong kind of path in one line."""

import stat

import pytest
import torch
from safetensors.torch import load_file

from polyshard.checkpoint import (
    Checkpoint,
    CheckpointError,
    LocalTensor,
    export,
    plans_from_records,
    save_checkpoint,
    write_hf_folder,
    write_resharded,
)
from polyshard.checkpoint.format import sha256
from polyshard.checkpoint.output import TEMP_PREFIX
from polyshard.mesh import Replicate, TensorPlacement

W = torch.arange(12.0).reshape(4, 3)
SPECS = {"w": (torch.float32, (4, 3))}


def _checkpoint(tmp_path):
    """A one-rank checkpoint in a run's ``checkpoints/`` folder, as a run saves it."""
    record = TensorPlacement("w", (4, 3), (("dp", Replicate()),))
    return save_checkpoint(
        tmp_path / "run" / "checkpoints", 1, {"model/w": LocalTensor(W, record)}, mesh_axes={"dp": 1}
    )


def _reshard(source, root, **options):
    plans = plans_from_records({"model/w": None}, {"dp": 1}, source)
    return write_resharded(source, root, {"dp": 1}, plans, **options)


def _fingerprint(folder):
    return {p.name: sha256(p) for p in sorted(folder.iterdir())}


def test_an_export_replaces_a_file_only_when_asked(tmp_path):
    source = Checkpoint(_checkpoint(tmp_path))
    out = tmp_path / "model.safetensors"
    out.write_text("the user's file")
    with pytest.raises(CheckpointError, match="model.safetensors exists; pass --overwrite"):
        export(source, out)
    assert out.read_text() == "the user's file"
    export(source, out, overwrite=True)
    torch.testing.assert_close(load_file(str(out))["w"], W, rtol=0, atol=0)
    assert stat.S_IMODE(out.stat().st_mode) & 0o044  # the usual permissions, not a private temporary's 0600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors", "run"]  # no temporary left


@pytest.mark.parametrize("inside", ["step/rank_00000.safetensors", "step/index.json", "checkpoints/new.safetensors"])
def test_nothing_is_ever_written_into_the_checkpoint_read(tmp_path, inside):
    folder = _checkpoint(tmp_path)
    before = _fingerprint(folder)
    where, name = inside.split("/")
    target = (folder if where == "step" else folder.parent) / name
    with pytest.raises(CheckpointError, match="which this command reads; write the file outside it"):
        export(Checkpoint(folder), target, overwrite=True)
    for destination in (folder, folder.parent, folder.parent.parent):  # the checkpoint, the run's saves, the run
        with pytest.raises(CheckpointError, match="which this command reads"):
            write_hf_folder(destination, {}, SPECS, lambda name: W, overwrite=True, protected=(folder,))
    with pytest.raises(CheckpointError, match="which this command reads"):
        _reshard(Checkpoint(folder), folder.parent, overwrite=True)  # the same step into its own run
    assert _fingerprint(folder) == before
    Checkpoint(folder)  # still verifies


def test_a_users_temporary_looking_files_are_never_touched(tmp_path):
    source = Checkpoint(_checkpoint(tmp_path))
    (tmp_path / "model.safetensors.tmp").write_text("mine")
    (tmp_path / ".tmp-hf").mkdir()
    (tmp_path / ".tmp-hf" / "notes.txt").write_text("mine too")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / ".tmp-hf2").symlink_to(elsewhere)  # a link where the old name was: no FileExistsError
    (tmp_path / "dst").mkdir()
    (tmp_path / "dst" / ".tmp-step_00000001").mkdir()
    export(source, tmp_path / "model.safetensors")
    write_hf_folder(tmp_path / "hf", {}, SPECS, lambda name: W)
    write_hf_folder(tmp_path / "hf2", {}, SPECS, lambda name: W)
    _reshard(source, tmp_path / "dst")
    assert (tmp_path / "model.safetensors.tmp").read_text() == "mine"
    assert (tmp_path / ".tmp-hf" / "notes.txt").read_text() == "mine too"
    assert (tmp_path / ".tmp-hf2").resolve() == elsewhere and elsewhere.is_dir()
    assert (tmp_path / "dst" / ".tmp-step_00000001").is_dir()
    assert not list(tmp_path.glob(f"**/{TEMP_PREFIX}*"))  # ours are gone


def test_links_and_the_wrong_kind_of_path_are_one_line(tmp_path):
    source = Checkpoint(_checkpoint(tmp_path))
    (tmp_path / "dangling").symlink_to(tmp_path / "nothing")
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "a-folder").mkdir()
    cases = [
        (lambda: export(source, tmp_path / "dangling", overwrite=True), "dangling is a link"),
        (lambda: export(source, tmp_path / "a-folder"), "a-folder is a folder; give the file"),
        (lambda: write_hf_folder(tmp_path / "dangling", {}, SPECS, lambda n: W), "dangling is a link"),
        (lambda: write_hf_folder(tmp_path / "a-file", {}, SPECS, lambda n: W, overwrite=True), "is a file, not a"),
        (lambda: _reshard(source, tmp_path / "dangling"), "dangling is a link to nothing"),
        (lambda: _reshard(source, tmp_path / "a-file"), "a-file is a file, not a folder"),
        (lambda: _reshard(source, tmp_path / "a-file" / "deeper"), "a-file is a file, not a folder"),
    ]
    for call, message in cases:
        with pytest.raises(CheckpointError, match=message) as caught:
            call()
        assert "\n" not in str(caught.value)
    assert (tmp_path / "a-file").read_text() == "x" and not (tmp_path / "nothing").exists()


def test_a_folder_is_replaced_only_when_asked_and_only_once_complete(tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "old.txt").write_text("old")
    with pytest.raises(CheckpointError, match="hf exists; pass --overwrite"):
        write_hf_folder(tmp_path / "hf", {}, SPECS, lambda name: W)

    def fails(name):
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        write_hf_folder(tmp_path / "hf", {}, SPECS, fails, overwrite=True)
    assert [p.name for p in (tmp_path / "hf").iterdir()] == ["old.txt"]  # a failed replacement keeps the old one
    write_hf_folder(tmp_path / "hf", {}, SPECS, lambda name: W, overwrite=True)
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["config.json", "model.safetensors"]
    assert stat.S_IMODE((tmp_path / "hf").stat().st_mode) & 0o055  # not a private temporary's 0700
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_reshard_replaces_a_step_only_when_asked(tmp_path):
    source = Checkpoint(_checkpoint(tmp_path))
    first = _reshard(source, tmp_path / "new" / "checkpoints").folder  # missing parents are made
    with pytest.raises(CheckpointError, match="step_00000001 exists; pass --overwrite"):
        _reshard(source, tmp_path / "new" / "checkpoints")
    assert _reshard(source, tmp_path / "new" / "checkpoints", overwrite=True).folder == first
    torch.testing.assert_close(Checkpoint(first).whole("model/w"), W, rtol=0, atol=0)


def test_a_save_clears_only_temporaries_of_its_own(tmp_path):
    root = tmp_path / "checkpoints"
    root.mkdir()
    killed = root / f"{TEMP_PREFIX}step_00000001-k1ll3d"  # what a save killed midway leaves
    killed.mkdir()
    (root / ".tmp-step_00000001").mkdir()  # not ours
    folder = save_checkpoint(root, 2, {"model/w": LocalTensor(W)}, mesh_axes={"dp": 1})
    assert not killed.exists() and (root / ".tmp-step_00000001").is_dir()
    assert sorted(p.name for p in root.iterdir()) == [".tmp-step_00000001", "step_00000002"]
    assert stat.S_IMODE(folder.stat().st_mode) & 0o055
