"""polyshard.checkpoint on its own: reading regions, offline reshard from records, streamed exports
(plain and Hugging Face), and its command line. No trainer, no process group."""

import json
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from polyshard.checkpoint import (
    Checkpoint,
    CheckpointError,
    LocalTensor,
    TensorLocation,
    consolidate,
    export,
    plans_from_records,
    write_hf_folder,
    write_resharded,
)
from polyshard.checkpoint.format import DTYPES
from polyshard.checkpoint.hf import HFWeights
from polyshard.checkpoint.save import save_checkpoint
from polyshard.checkpoint.writer import StreamWriter
from polyshard.mesh import MeshLayout, Replicate, Shard, TensorPlacement

W = torch.arange(40.0).reshape(10, 4)  # a weight sharded by rows over tp=2 (5 rows each)
B = torch.arange(3, dtype=torch.bfloat16)  # a replicated bias, bf16


def _tp2_checkpoint(root):
    """What two tp ranks would save, written rank by rank into one folder (an index like a real run's)."""
    from polyshard.checkpoint.format import make_index, publish, rank_entry, rank_file, sha256

    layout = MeshLayout({"tp": 2})
    record = TensorPlacement("w", (10, 4), (("tp", Shard(0)),))
    bias = TensorPlacement("b", (3,), (("tp", Replicate()),))
    tmp = root / ".tmp-step_00000003"
    tmp.mkdir(parents=True)
    entries = []
    for rank in range(2):
        rows = record.local_slices(layout.as_dict(), layout.coords(rank))
        tensors = {"model/w": W[rows], "model/b": B, "optim/w/exp_avg": -W[rows], "rng/torch": torch.get_rng_state()}
        writer = StreamWriter(tmp / rank_file(rank), {k: (t.dtype, tuple(t.shape)) for k, t in tensors.items()})
        for key, tensor in tensors.items():
            writer.write(key, tensor)
        digest = writer.close()
        assert digest == sha256(tmp / rank_file(rank))  # hashed as written
        records = {"model/w": record, "model/b": bias, "optim/w/exp_avg": record, "rng/torch": None}
        entries.append(rank_entry(rank_file(rank), digest, records, {"position": 12}))
    publish(tmp, root / "step_00000003", make_index(3, {"tp": 2}, entries, {"model": {"hidden": 4}}))
    return root / "step_00000003"


def test_regions_are_read_across_pieces_with_zero_padding(tmp_path):
    source = Checkpoint(_tp2_checkpoint(tmp_path))
    assert source.step == 3 and source.mesh == {"tp": 2} and source.settings == {"model": {"hidden": 4}}
    assert source.params() == {"w": (10, 4), "b": (3,)}
    # Rows 3..8 span both ranks' pieces; rows 10..11 lie past the tensor and read as zeros (padding).
    torch.testing.assert_close(source.read("model/w", (3, 1), (5, 2), torch.float32), W[3:8, 1:3], rtol=0, atol=0)
    padded = source.read("model/w", (8, 0), (4, 4), torch.float32)
    torch.testing.assert_close(padded[:2], W[8:], rtol=0, atol=0)
    assert padded[2:].abs().sum() == 0
    assert source.whole("model/b").dtype == torch.bfloat16
    # fp32 masters fall back to the weights when none were kept.
    torch.testing.assert_close(source.whole(source.resolve("optim/w/master")), W, rtol=0, atol=0)
    with pytest.raises(CheckpointError, match="holds no tensor 'model/ghost'"):
        source.resolve("model/ghost")


def test_reshard_from_records_alone_to_another_mesh(tmp_path):
    """tp=2 by rows -> tp=4 by columns with no model: each target rank holds exactly its column."""
    source = Checkpoint(_tp2_checkpoint(tmp_path / "src"))
    target = TensorPlacement("w", (10, 4), (("tp", Shard(1)),))
    records = {"model/w": target, "optim/w/exp_avg": target, "model/b": None}
    plans = plans_from_records(records, {"tp": 4}, source)
    report = write_resharded(source, tmp_path / "dst", {"tp": 4}, plans, max_block_bytes=16)
    assert report.files == 4 and report.largest_block_bytes <= 16  # four 1-float rows at a time
    resharded = Checkpoint(report.folder)  # verified again: its own sha256s
    assert resharded.mesh == {"tp": 4} and resharded.extra() == {"position": 12}
    torch.testing.assert_close(resharded.whole("model/w"), W, rtol=0, atol=0)
    torch.testing.assert_close(resharded.whole("optim/w/exp_avg"), -W, rtol=0, atol=0)
    for rank in range(4):
        local = load_file(str(report.folder / f"rank_{rank:05d}.safetensors"))
        torch.testing.assert_close(local["model/w"], W[:, rank : rank + 1], rtol=0, atol=0)
        torch.testing.assert_close(local["model/b"], B, rtol=0, atol=0)
        # Ranks 2 and 3 lie past the source's tp=2 mesh: they continue its ranks 0 and 1's generators.
        assert "rng/torch" in local
    with pytest.raises(CheckpointError, match="exists; pass --overwrite"):
        write_resharded(source, tmp_path / "dst", {"tp": 4}, plans)
    assert not list((tmp_path / "dst").glob(".polyshard-tmp-*"))


def test_export_streams_every_tensor_and_names_aliases(tmp_path):
    source = Checkpoint(_tp2_checkpoint(tmp_path / "run"))
    written = export(source, tmp_path / "model.safetensors", {"head.weight": "w"}, max_block_bytes=32)
    state = load_file(str(written))
    assert sorted(state) == ["b", "head.weight", "w"]
    torch.testing.assert_close(state["w"], W, rtol=0, atol=0)
    torch.testing.assert_close(state["head.weight"], W, rtol=0, atol=0)
    assert state["b"].dtype == torch.bfloat16
    assert consolidate(source).keys() == {"b", "w"}


def test_a_hugging_face_folder_is_written_tensor_by_tensor_and_read_back(tmp_path):
    """Shards above the size limit, an index like save_pretrained's; reading maps transposed and fused
    tensors back to ours."""
    q, k = torch.randn(4, 6), torch.randn(4, 6)
    made = []

    def produce(name):
        made.append(name)
        return {"attn.qk": torch.cat([q.T, k.T], dim=-1), "norm": torch.ones(6)}[name]

    specs = {"attn.qk": (torch.float32, (6, 8)), "norm": (torch.float32, (6,))}
    folder = write_hf_folder(tmp_path / "hf", {"model_type": "toy"}, specs, produce, max_shard_bytes=100)
    assert made == ["attn.qk", "norm"]
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    with safe_open(str(folder / "model-00001-of-00002.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}
    locations = {
        "q.weight": TensorLocation("attn.qk", transposed=True, offset=0, parts=2),
        "k.weight": TensorLocation("attn.qk", transposed=True, offset=4, parts=2),
        "norm.weight": TensorLocation("norm"),
    }
    weights = HFWeights(folder, locations)
    assert weights.global_shape("model/k.weight") == (4, 6)
    torch.testing.assert_close(weights.read("model/k.weight", (1, 2), (2, 3), torch.float32), k[1:3, 2:5])
    torch.testing.assert_close(weights.read("model/q.weight", (0, 0), (4, 6), torch.float32), q)
    with pytest.raises(CheckpointError, match="exists; pass --overwrite to replace it, or give a new folder"):
        write_hf_folder(folder, {}, specs, produce)
    with pytest.raises(CheckpointError, match=r"missing \['gone'\], unexpected \['norm'\]"):
        HFWeights(folder, {"q.weight": locations["q.weight"], "x": TensorLocation("gone")})


def test_a_failed_hugging_face_write_leaves_nothing(tmp_path):
    def produce(name):
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        write_hf_folder(tmp_path / "hf", {}, {"a": (torch.float32, (2,))}, produce)
    assert list(tmp_path.iterdir()) == []


def test_the_dtype_table_covers_what_checkpoints_hold():
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool):
        assert dtype in DTYPES.values()


@pytest.mark.long  # three commands, each a fresh interpreter (12 s)
def test_the_command_line_inspects_reshards_and_exports(tmp_path):
    root = tmp_path / "run" / "checkpoints"
    record = TensorPlacement("w", (10, 4), (("dp", Replicate()),))
    save_checkpoint(
        root,
        2,
        {"model/w": LocalTensor(W, record), "rng/torch": LocalTensor(torch.get_rng_state())},
        mesh_axes={"dp": 1},
    )

    def cli(*args):
        return subprocess.run(
            [sys.executable, "-m", "polyshard.checkpoint", *map(str, args)], capture_output=True, text=True
        )

    shown = cli("inspect", tmp_path / "run")
    assert shown.returncode == 0 and "step 2, mesh {'dp': 1}" in shown.stdout and "40 parameters" in shown.stdout
    moved = cli("reshard", root / "step_00000002", tmp_path / "dp2", "--mesh", "dp=2")
    assert moved.returncode == 0, moved.stderr
    assert Checkpoint(tmp_path / "dp2" / "step_00000002").mesh == {"dp": 2}
    out = cli("export", tmp_path / "dp2", tmp_path / "w.safetensors")
    assert out.returncode == 0, out.stderr
    torch.testing.assert_close(load_file(str(tmp_path / "w.safetensors"))["w"], W, rtol=0, atol=0)
    missing = cli("inspect", tmp_path / "nothing")
    assert (
        missing.returncode == 2 and missing.stderr.startswith("checkpoint error:") and "Traceback" not in missing.stderr
    )
