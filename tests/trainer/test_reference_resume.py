"""A DPO or GRPO run that holds its reference (the frozen starting model) resumes: its checkpoints name the
starting weights (hf:, checkpoint: or init:SEED with a checksum, :mod:`polyshard.trainer.loop.reference_start`),
and the resumed run rebuilds the reference from them before loading the trained weights. Stopped at step 2
and resumed, a run's losses and parameters equal the uninterrupted run's bit for bit: the same reference,
the same state, the same data order, summed in the same order."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from polyshard.checkpoint import Checkpoint, CheckpointError, latest_checkpoint
from polyshard.mesh import Mesh
from polyshard.models import build_model
from polyshard.trainer.checkpointing.hugging_face import write_hf
from polyshard.trainer.config import from_dict
from polyshard.trainer.loop import Trainer
from polyshard.trainer.loop.reference_start import REFERENCE_KEY
from tests._pieces import parameter_pieces
from tests._short import short_run
from tests.trainer.test_dpo_parity import pairs  # noqa: F401  (the fixture)

STEPS = 4
MODEL = {"kind": "gpt", "hidden": 32, "num_layers": 2, "num_heads": 4, "context_length": 16}


def _dpo(source, **parallel):
    return from_dict(
        {
            "model": MODEL,
            "parallel": parallel,
            **short_run(STEPS, training={"task": "dpo", "global_batch_size": 8}, weight_decay=2.0),
            "dpo": {"beta": 0.5},
            "data": {"source": source},
            "checkpoint": {"every": 2},
            "logging": {"progress_bar": False},
        }
    )


def _grpo(prompts, **parallel):
    return from_dict(
        {
            "model": MODEL,
            "parallel": parallel,
            **short_run(STEPS, training={"task": "grpo", "global_batch_size": 2}),
            "grpo": {
                "generations": 2,
                "max_completion_length": 4,
                "beta": 0.1,
                "rewards": [{"function": "exact_answer"}],
            },
            "data": {"source": prompts, "tokenizer": "bytes"},
            "checkpoint": {"every": 2},
            "logging": {"progress_bar": False},
        }
    )


def _starting_folder(config, folder):
    """A Hugging Face folder of the model with the weights of seed 5, which no run here builds (seed 0)."""
    model = build_model(config.model, seed=5)
    return write_hf({name: p.detach() for name, p in model.named_parameters()}, config.model, folder)


def _stop_and_resume(config, out, start):
    """Runs from the Hugging Face folder ``start`` (--init-from hf:): the reference is its weights, not the
    ones a run builds. Returns (the whole run's losses and parameters, the same of the run stopped at step 2
    and resumed, the record the resumed run's checkpoint holds)."""
    mesh = Mesh(config.parallel.mesh_axes)
    whole = Trainer(config, mesh, out / "whole", log=False, init_from=f"hf:{start}")
    losses = whole.run().losses
    half = dataclasses.replace(config, training=dataclasses.replace(config.training, stop_at=STEPS // 2))
    Trainer(half, mesh, out / "split", log=False, init_from=f"hf:{start}").run()
    resumed = Trainer(config, mesh, out / "split", log=False, resume=True)
    assert resumed.start == STEPS // 2
    record = Checkpoint(latest_checkpoint(out / "split" / "checkpoints")).extra().get(REFERENCE_KEY)
    return (losses, parameter_pieces(whole.engine)), (resumed.run().losses, parameter_pieces(resumed.engine)), record


def _same(result):
    (losses, params), (resumed_losses, resumed_params), record = result
    assert resumed_losses == losses  # exact (module docstring)
    assert len(params) == len(resumed_params) > 0
    for (name, value, _), (other, resumed, _) in zip(params, resumed_params):
        assert name == other and torch.equal(value, resumed), name
    return record


@pytest.mark.parametrize("parallel", [{}, {"dp": 2, "zero_stage": 3}], ids=["one", "dp2-zero3"])
def test_a_resumed_dpo_run_continues_bit_for_bit(distributed, pairs, tmp_path, parallel):  # noqa: F811
    config = _dpo(pairs, **parallel)
    start = _starting_folder(config, tmp_path / "hf")
    record = _same(distributed.run(config.parallel.world_size, _stop_and_resume, config, tmp_path, start)[0])
    assert record["source"] == f"hf:{start.resolve()}" and len(record["checksum"]) == 64


def test_a_resumed_grpo_run_with_a_reference_continues_bit_for_bit(distributed, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": f"{w}>", "answer": w[::-1]}) + "\n" for w in ("ab", "cd", "ef", "gh"))
    )
    config = _grpo(str(prompts))
    _same(distributed.run(1, _stop_and_resume, config, tmp_path, _starting_folder(config, tmp_path / "hf"))[0])


def _resume_after_the_seed_changed(config, out):
    mesh = Mesh(config.parallel.mesh_axes)
    half = dataclasses.replace(config, training=dataclasses.replace(config.training, stop_at=2))
    Trainer(half, mesh, out, log=False).run()
    index = latest_checkpoint(out / "checkpoints") / "index.json"
    saved = json.loads(index.read_text())
    saved["ranks"][0]["extra"][REFERENCE_KEY]["source"] = "init:7"  # another seed: other starting weights
    index.write_text(json.dumps(saved))
    try:
        Trainer(config, mesh, out, log=False, resume=True)
    except CheckpointError as error:
        return str(error)
    return None


def test_a_changed_reference_is_refused_in_one_line(distributed, pairs, tmp_path):  # noqa: F811
    message = distributed.run(1, _resume_after_the_seed_changed, _dpo(pairs), tmp_path)[0]
    assert message is not None and "\n" not in message
    assert "reference is init:7" in message and "put back the weights the run started from" in message
