"""``dpo.reference = "precomputed"``: the reference's log-probs computed once before the first step, in the
run's own batches, kept in the run folder, and the reference dropped. Its losses, gradients, parameters and
validation loss equal a held reference's (``reference = "model"``) on one process and on parallel layouts;
a resumed run reads the file back and continues bit for bit; a missing, edited or mismatched file is a
one-line error."""

import dataclasses
import functools
import json
import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from polyshard.mesh import Mesh
from polyshard.trainer.config import from_dict
from polyshard.trainer.errors import DataError
from polyshard.trainer.loop import Trainer
from polyshard.trainer.loop.reference_logps import FILE
from tests._layouts import Tolerance, _FirstGradients, compared_pieces, layout
from tests._pieces import parameter_pieces
from tests._short import short_run

STEPS = 4
WORDS = "the king queen lord love death night day sweet fair".split()
# The stored numbers are the held reference's forward on the same rows, but in batches of other pairs
# (in order, not the step's shuffled ones): float32 round-off of a reordered sum at most, ~1e-7 relative
# per margin, then compounded over the steps as in tests/trainer/test_dpo_parity.py, whose bounds these are
# (a layout's own round-off is of the same size). Measured on one process: bit for bit equal.
TOLERANCE = Tolerance(numbers=2e-5, grads={"rtol": 2e-5, "atol": 5e-7}, params={"rtol": 2e-5, "atol": 8e-6})


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    rng = random.Random(1)
    path = tmp_path_factory.mktemp("dpo") / "pairs.jsonl"
    lines = []
    for _ in range(44):
        prompt = " ".join(rng.choices(WORDS, k=rng.randint(1, 6))) + ":"
        chosen, rejected = (" ".join(rng.choices(words, k=rng.randint(1, 3))) for words in (WORDS[:5], WORDS[5:]))
        lines.append(json.dumps({"prompt": prompt, "chosen": chosen, "rejected": rejected}))
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _config(pairs, reference="precomputed", **parallel):
    return from_dict(
        {
            "model": {"kind": "gpt", "hidden": 32, "num_layers": 2, "num_heads": 4, "context_length": 16},
            "parallel": parallel,
            # an evaluation at the end: the validation pairs' stored numbers count too (5 of 44, not a whole batch)
            **short_run(STEPS, training={"task": "dpo"}, eval_every=STEPS, weight_decay=2.0),
            "dpo": {"beta": 0.5, "label_smoothing": 0.1, "reference": reference},
            "data": {"source": pairs, "val_fraction": 0.1},
            "logging": {"progress_bar": False},
        }
    )


def train_dpo(config, out):
    """tests/_layouts.py's worker, plus the validation loss and whether a reference is held."""
    mesh = Mesh(config.parallel.mesh_axes)
    first = _FirstGradients()
    trainer = Trainer(config, mesh, out, log=False, hooks=[first])
    first.engine = trainer.engine
    held = trainer.preferences.reference is not None
    result = trainer.run()
    return {**compared_pieces(mesh, trainer, first, result), "val_loss": result.val_loss, "held": held}


@pytest.mark.parametrize(
    "name", [layout("one-process"), layout("dp2"), layout("pp2-1f1b"), layout("dp2-zero3"), layout("cp2-ring")]
)
def test_precomputed_log_probs_train_as_a_held_reference(parity, pairs, tmp_path, name):
    """dp2: each data rank's holder fills its pairs; pp2: only the last stage computes them, in microbatches;
    ZeRO-3: the reference's rows are swapped into the policy's gathers for the pass, then dropped (the policy's
    own rows back); cp2: each row's chunk parts added over cp before they are stored."""
    config_of = functools.partial(_config, pairs)
    compared = parity.check(name, config_of, TOLERANCE, tmp_path, reference=_config(pairs, "model"), worker=train_dpo)
    expected = parity.reference(_config(pairs, "model"), train_dpo)[0]
    assert expected["held"] and not any(r["held"] for r in compared.results)  # dropped once computed
    for result in compared.results:
        assert result["val_loss"] == pytest.approx(expected["val_loss"], rel=2e-5)
    stored = load_file(tmp_path / FILE)
    assert stored["train"].shape == (40, 2) and stored["val"].shape == (4, 2) and stored["train"].dtype == torch.float64
    assert (stored["train"] < 0).all() and len(set(stored["train"].flatten().tolist())) > 40  # real sums, no zeros


def _stop_and_resume(config, out):
    """(the whole run's losses and parameters, those of the run stopped at step 2 and resumed)."""
    mesh = Mesh(config.parallel.mesh_axes)
    whole = Trainer(config, mesh, out / "whole", log=False)
    losses = whole.run().losses
    half = dataclasses.replace(config, training=dataclasses.replace(config.training, stop_at=STEPS // 2))
    Trainer(half, mesh, out / "split", log=False).run()
    resumed = Trainer(config, mesh, out / "split", log=False, resume=True)
    assert resumed.preferences.reference is None and resumed.start == STEPS // 2
    return (losses, parameter_pieces(whole.engine)), (resumed.run().losses, parameter_pieces(resumed.engine))


def test_a_resumed_precomputed_run_continues_bit_for_bit(distributed, pairs, tmp_path):
    results = distributed.run(2, _stop_and_resume, _config(pairs, dp=2), tmp_path)
    (losses, params), (resumed_losses, resumed_params) = results[0]
    assert resumed_losses == losses  # exact: the same numbers read back, the same state, the same order
    assert len(params) == len(resumed_params) > 0
    for (name, value, _), (other, resumed, _) in zip(params, resumed_params):
        assert name == other and torch.equal(value, resumed), name


def _resume_message(config, out):
    try:
        Trainer(config, Mesh(config.parallel.mesh_axes), out, log=False, resume=True)
    except DataError as error:
        return str(error)
    return None


def test_a_missing_edited_or_mismatched_file_is_one_line(distributed, pairs, tmp_path):
    config = _config(pairs)
    config = dataclasses.replace(config, training=dataclasses.replace(config.training, steps=2))
    distributed.run(1, _stop_and_resume_once, config, tmp_path)
    path = tmp_path / FILE
    original = path.read_bytes()
    tensors = load_file(path)
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as file:
        metadata = file.metadata()
    tensors["train"][3, 1] += 1e-3  # an edited number under the recorded checksum
    save_file(tensors, str(path), metadata=metadata)
    edited = distributed.run(1, _resume_message, config, tmp_path)[0]
    path.write_bytes(original)
    fewer = tmp_path / "fewer.jsonl"
    fewer.write_text("\n".join(open(pairs).read().splitlines()[:-4]) + "\n")
    other_data = dataclasses.replace(config, data=dataclasses.replace(config.data, source=str(fewer)))
    mismatched = distributed.run(1, _resume_message, other_data, tmp_path)[0]
    lines = open(pairs).read().splitlines()
    changed = tmp_path / "changed.jsonl"  # as many pairs, one of them another
    changed.write_text("\n".join([json.dumps({"prompt": "day:", "chosen": "love", "rejected": "night"}), *lines[1:]]))
    same_count = dataclasses.replace(config, data=dataclasses.replace(config.data, source=str(changed)))
    other_pair = distributed.run(1, _resume_message, same_count, tmp_path)[0]
    path.unlink()
    missing = distributed.run(1, _resume_message, config, tmp_path)[0]
    for message, named in (
        (edited, "its log-probs do not match the checksum it records"),
        (mismatched, "was computed for 40 train pairs"),
        (other_pair, "was computed for 40 train pairs"),
        (missing, "is missing: a run with dpo.reference = 'precomputed' resumes"),
    ):
        assert message is not None and named in message and str(path) in message and "\n" not in message, message
    assert "the run reads 36" in mismatched and "the run reads 40" in other_pair


def _stop_and_resume_once(config, out):
    Trainer(config, Mesh(config.parallel.mesh_axes), out, log=False).run()
