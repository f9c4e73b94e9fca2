"""Checkpoints written before a config field retired still load: their recorded settings are read
with the retired fields passed over, and anything else unknown is still refused."""

import dataclasses

import pytest
import torch

from polyshard.checkpoint import Checkpoint, CheckpointError, LocalTensor, save_checkpoint
from polyshard.mesh import Replicate, TensorPlacement
from polyshard.trainer.checkpointing.run_export import saved_config
from polyshard.trainer.config import from_dict


def _saved_with(tmp_path, **more):
    config = dataclasses.asdict(from_dict({"model": {"preset": "tiny"}, "parallel": {"dp": 1}}))
    for section, values in more.items():
        config[section].update(values)
    record = TensorPlacement("w", (2,), (("dp", Replicate()),))
    folder = save_checkpoint(
        tmp_path, 1, {"model/w": LocalTensor(torch.ones(2), record)}, mesh_axes={"dp": 1}, config=config
    )
    return Checkpoint(folder)


def test_the_settings_an_older_polyshard_recorded_still_load(tmp_path):
    # What a checkpoint of polyshard 0.2 records: the layout mode and the planner's step time.
    source = _saved_with(tmp_path, parallel={"layout": "manual"}, logging={"predicted_step_s": None})
    assert saved_config(source).model.hidden == 64


def test_an_unknown_setting_is_still_refused(tmp_path):
    source = _saved_with(tmp_path, parallel={"shards": 3})
    with pytest.raises(CheckpointError, match="the saved config is not valid.*shards"):
        saved_config(source)
