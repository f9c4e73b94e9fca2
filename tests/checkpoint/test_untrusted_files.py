"""Files we read but did not write (polyshard.checkpoint.untrusted): no file of a folder we read may lead
out of it, whatever its role (a checkpoint's index.json, a Hugging Face folder's config.json, its weight
map, its weights), and JSON is read with its size and nesting bounded, as one line naming the file."""

import json

import pytest
import torch
from safetensors.torch import save_file

from polyshard.checkpoint import Checkpoint, CheckpointError, LocalTensor, read_index, save_checkpoint
from polyshard.checkpoint.hf import CONFIG_FILE, INDEX_FILE, WEIGHTS_FILE, read_config, weight_files
from polyshard.checkpoint.untrusted import MAX_DEPTH, read_json


def _checkpoint(root):
    return save_checkpoint(root, 1, {"model/w": LocalTensor(torch.ones(2, 2))}, mesh_axes={"dp": 1})


def _hf_folder(folder):
    folder.mkdir()
    (folder / CONFIG_FILE).write_text(json.dumps({"model_type": "llama"}))
    save_file({"w": torch.ones(2)}, str(folder / WEIGHTS_FILE))
    return folder


def _moved_out(path, outside):
    """``path`` moved to ``outside`` and replaced by a link to it."""
    outside.parent.mkdir(parents=True, exist_ok=True)
    path.rename(outside)
    path.symlink_to(outside)


def _nested(depth):
    return "[" * depth + "]" * depth


def _one_line(call, message):
    with pytest.raises(CheckpointError, match=message) as caught:
        call()
    assert "\n" not in str(caught.value)


def test_a_checkpoints_index_that_leads_outside_is_refused(tmp_path):
    folder = _checkpoint(tmp_path / "run")
    _moved_out(folder / "index.json", tmp_path / "elsewhere" / "index.json")
    _one_line(lambda: Checkpoint(folder), "index.json leads outside")


def test_a_hugging_face_folders_files_may_not_lead_outside(tmp_path):
    folder = _hf_folder(tmp_path / "hf")
    assert read_config(folder)[0] == {"model_type": "llama"} and weight_files(folder) == {"w": WEIGHTS_FILE}
    _moved_out(folder / CONFIG_FILE, folder / "original.json")  # a link inside the folder is fine
    assert read_config(folder)[0] == {"model_type": "llama"}
    _moved_out(folder / "original.json", tmp_path / "outside" / CONFIG_FILE)  # now config.json leads out
    _one_line(lambda: read_config(folder), f"{CONFIG_FILE} leads outside")
    _moved_out(folder / WEIGHTS_FILE, tmp_path / "outside" / WEIGHTS_FILE)
    _one_line(lambda: weight_files(folder), f"{WEIGHTS_FILE} leads outside")
    (tmp_path / "outside" / INDEX_FILE).write_text(json.dumps({"weight_map": {"w": WEIGHTS_FILE}}))
    (folder / INDEX_FILE).symlink_to(tmp_path / "outside" / INDEX_FILE)
    _one_line(lambda: weight_files(folder), f"{INDEX_FILE} leads outside")


@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 200_000])  # past our bound; past the parser's recursion
def test_deeply_nested_json_is_one_line_naming_the_file(tmp_path, depth):
    folder = _checkpoint(tmp_path / "run")
    (folder / "index.json").write_text(_nested(depth))
    _one_line(lambda: read_index(folder), r"index.json is JSON nested too deeply \(more than 64 levels\)")
    hf = _hf_folder(tmp_path / "hf")
    (hf / CONFIG_FILE).write_text('{"model_type": "llama", "x": ' + _nested(depth) + "}")
    _one_line(lambda: read_config(hf), "config.json is JSON nested too deeply")
    (hf / INDEX_FILE).write_text('{"weight_map": ' + _nested(depth) + "}")
    _one_line(lambda: weight_files(hf), f"{INDEX_FILE} is JSON nested too deeply")


def test_json_is_read_within_its_size_bound(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps({"x": _nested(MAX_DEPTH - 1)}))
    assert read_json(tmp_path, tmp_path / "a.json") == {"x": _nested(MAX_DEPTH - 1)}  # a string: no depth
    (tmp_path / "b.json").write_text(json.dumps({"x": [[1]] * 1000}))
    _one_line(lambda: read_json(tmp_path, tmp_path / "b.json", limit=100), r"b.json is 5,007 bytes, more than the 100")
    (tmp_path / "c.json").write_bytes(b'{"x": "\xff"}')
    _one_line(lambda: read_json(tmp_path, tmp_path / "c.json"), "c.json is not valid JSON")
