"""Sharded checkpoints: atomic folders, placement records in the index, checksums."""

import json

import pytest
import torch
import torch.distributed as dist

from polyshard.mesh import Replicate, Shard, TensorPlacement
from polyshard.trainer.checkpoint import LocalTensor, latest_checkpoint, load_rank, save_checkpoint
from polyshard.trainer.checkpoint_format import CheckpointError, read_index, verify_files


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
