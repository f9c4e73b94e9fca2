"""Sharded checkpoints: atomic folders, placement records in the index, checksums (no trainer involved)."""

import json

import pytest
import torch
import torch.distributed as dist

from polyshard.checkpoint import (
    CheckpointError,
    LocalTensor,
    latest_checkpoint,
    load_rank,
    read_index,
    save_checkpoint,
    verify_files,
)
from polyshard.mesh import Replicate, Shard, TensorPlacement


def _save_two_steps(root):
    rank = dist.get_rank()
    full = torch.arange(12.0).reshape(4, 3)
    record = TensorPlacement("w", (4, 3), (("tp", Shard(0)),))
    tensors = {
        "model/w": LocalTensor(full[2 * rank : 2 * rank + 2], record),
        "model/b": LocalTensor(torch.ones(3), TensorPlacement("b", (3,), (("tp", Replicate()),))),
        "rng/torch": LocalTensor(torch.get_rng_state()),
    }
    for step in (5, 10, 15):
        folder = save_checkpoint(
            root, step, tensors, mesh_axes={"tp": 2}, extra={"data": {"position": step + rank}}, keep=2
        )
    loaded, extra = load_rank(folder, rank)
    return str(folder), loaded["model/w"], extra


def test_save_and_load_on_two_ranks(distributed, tmp_path):
    results = distributed.run(2, _save_two_steps, str(tmp_path))
    folder = latest_checkpoint(tmp_path)
    assert str(folder) == results[0][0] and folder.name == "step_00000015"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000010", "step_00000015"]  # keep=2
    index = read_index(folder)
    assert index["mesh"] == {"tp": 2} and index["world_size"] == 2 and index["step"] == 15
    assert TensorPlacement.from_json(index["ranks"][1]["tensors"]["model/w"]).placement("tp") == Shard(0)
    assert index["ranks"][1]["tensors"]["rng/torch"] is None
    assert [r[2] for r in results] == [{"data": {"position": 15}}, {"data": {"position": 16}}]
    torch.testing.assert_close(results[1][1], torch.arange(6.0, 12.0).reshape(2, 3), rtol=0, atol=0)
    verify_files(folder, index)


def test_corrupt_truncated_or_missing_files_are_named(distributed, tmp_path):
    distributed.run(2, _save_two_steps, str(tmp_path))
    folder = latest_checkpoint(tmp_path)
    index = read_index(folder)
    path = folder / "rank_00001.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:-7])
    with pytest.raises(CheckpointError, match="rank_00001.safetensors does not match its sha256"):
        load_rank(folder, 1)
    load_rank(folder, 0)  # the other rank's file is still fine
    path.unlink()
    with pytest.raises(CheckpointError, match="rank_00001.safetensors is missing"):
        verify_files(folder, index)
    with pytest.raises(CheckpointError, match="has no rank 2"):
        load_rank(folder, 2)
    (folder / "index.json").write_text(json.dumps({"format": 99}))
    with pytest.raises(CheckpointError, match="format 99"):
        read_index(folder)


def test_unfinished_folders_are_not_checkpoints(tmp_path):
    (tmp_path / ".tmp-step_00000020").mkdir()
    (tmp_path / "step_00000030").mkdir()  # no index.json: never completed
    assert latest_checkpoint(tmp_path) is None
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        read_index(tmp_path / "step_00000030")


def _one_rank_checkpoint(root):
    """A small complete checkpoint written without processes (one rank)."""
    record = TensorPlacement("w", (4, 3), (("tp", Replicate()),))
    tensors = {"model/w": LocalTensor(torch.arange(12.0).reshape(4, 3), record)}
    return save_checkpoint(root, 1, tensors, mesh_axes={"tp": 1})


def _craft(folder, change):
    index = json.loads((folder / "index.json").read_text())
    change(index)
    (folder / "index.json").write_text(json.dumps(index))


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda i: i["ranks"][0].update(file="../../elsewhere/x.safetensors"), "is not a bare file name"),
        (lambda i: i["ranks"][0].update(file="/etc/passwd"), "is not a bare file name"),
        (lambda i: i["ranks"][0].update(file=".."), "is not a bare file name"),
        (lambda i: i.update(world_size=3), "'world_size' 3, the mesh"),
        (lambda i: i.update(mesh={"tp": 2}), "the mesh {'tp': 2} and the rank entries disagree"),
        (lambda i: i["ranks"][0].pop("tensors"), "lacks 'file', 'sha256' or 'tensors'"),
        (lambda i: i.update(ranks="all"), "disagree"),
        (lambda i: i.update(step="ten"), "'step' is 'ten'"),
        (lambda i: i["ranks"][0]["tensors"]["model/w"].update(global_shape=[10**12, 64]), "larger than all its"),
        (lambda i: i["ranks"][0]["tensors"]["model/w"].pop("placements"), "record of 'model/w' is malformed"),
        (lambda i: i["ranks"][0]["tensors"].update({"model/ghost": None}), "holds no tensor 'model/ghost'"),
    ],
)
def test_a_crafted_index_is_refused_before_anything_is_read(tmp_path, change, message):
    from polyshard.checkpoint import Checkpoint

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "x.safetensors").write_bytes(b"not yours")
    folder = _one_rank_checkpoint(tmp_path / "run")
    _craft(folder, change)
    with pytest.raises(CheckpointError, match=message):
        Checkpoint(folder)  # what inspect, export, reshard and --resume open


def test_a_link_out_of_the_folder_is_refused(tmp_path):
    folder = _one_rank_checkpoint(tmp_path / "run")
    (tmp_path / "secret.safetensors").write_bytes((folder / "rank_00000.safetensors").read_bytes())
    (folder / "rank_00000.safetensors").unlink()
    (folder / "rank_00000.safetensors").symlink_to(tmp_path / "secret.safetensors")
    with pytest.raises(CheckpointError, match="leads outside"):
        read_index(folder)


def test_export_refuses_a_folder_or_a_missing_parent_and_leaves_nothing(tmp_path):
    from polyshard.checkpoint import export

    folder = _one_rank_checkpoint(tmp_path / "run")
    with pytest.raises(CheckpointError, match="is a folder; give the file to write"):
        export(folder, tmp_path)
    with pytest.raises(CheckpointError, match="does not exist; create it"):
        export(folder, tmp_path / "missing" / "model.safetensors")
    assert export(folder, tmp_path / "model.safetensors").is_file()
    assert not list(tmp_path.glob("*.tmp"))
