"""Document masking end to end: a prepared corpus of many short documents, the loader's ``segments``,
and whole training runs (through the Trainer) that agree across layouts and differ from unmasked runs.

The exactness of the masked attention against each document computed alone is
:mod:`tests.trainer.test_documents`; here the data path feeds it.
"""

import dataclasses
import json
import random

import numpy as np
import pytest

from polyshard.mesh import Mesh
from polyshard.models.moe_gpt.config import MoEGPTConfig
from polyshard.trainer.config import from_dict
from polyshard.trainer.data import language_data

WORDS = "the king queen lord love death night day sweet fair heaven earth sword crown blood".split()
STEPS = 3


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """200 documents of 1 to 6 words, one file each: several documents per 33-token row."""
    folder = tmp_path_factory.mktemp("docs")
    rng = random.Random(0)
    for i in range(200):
        (folder / f"{i:03d}.txt").write_text(" ".join(rng.choices(WORDS, k=rng.randint(1, 6))))
    return str(folder)


def _config(corpus, document_mask=True, **parallel):
    return from_dict(
        {
            "model": {"hidden": 32, "num_layers": 2, "num_heads": 4, "context_length": 32},
            "parallel": parallel,
            "training": {"steps": STEPS, "global_batch_size": 8},
            "optimizer": {"lr": 3e-3},
            "eval": {"every": STEPS, "sample_tokens": 0},
            "data": {"source": corpus, "document_mask": document_mask},
            "logging": {"progress_bar": False},
        }
    )


def test_rows_carry_each_tokens_document(corpus, tmp_path, monkeypatch):
    monkeypatch.setenv("POLYSHARD_CACHE", str(tmp_path))
    data = language_data(_config(corpus))
    rows = data.train[0].rows(np.arange(len(data.train[0])))
    tokens, segments = rows["tokens"], rows["segments"]
    assert segments.shape == tokens.shape and (np.diff(segments, axis=1) >= 0).all()
    starts = np.argwhere(np.diff(segments, axis=1) > 0)
    assert len(starts) > len(tokens)  # several documents per row
    for row, col in starts:  # each new document follows the separator that ended the one before
        assert tokens[row, col] == ord("\n")
    assert "segments" not in language_data(_config(corpus, document_mask=False)).train[0].rows(np.arange(2))


def _train(config, out):
    from polyshard.trainer.loop import train

    result = train(config, Mesh(config.parallel.mesh_axes), out, log=False)
    return result.losses + [result.val_loss]


@pytest.fixture(scope="module")
def reference(distributed, corpus, tmp_path_factory):
    return {
        mask: distributed.run(1, _train, _config(corpus, mask), tmp_path_factory.mktemp(f"ref{mask}"))[0]
        for mask in (True, False)
    }


def test_masking_changes_what_the_model_sees(reference):
    # Rows hold several documents: attention inside each one is a different computation from the plain mask.
    assert abs(reference[True][0] - reference[False][0]) > 1e-3


@pytest.mark.parametrize(
    "world, parallel",
    [
        pytest.param(2, {"dp": 2, "zero_stage": 3}, id="dp2-zero3"),
        pytest.param(2, {"cp": 2}, id="cp2"),
        pytest.param(4, {"dp": 2, "tp": 2, "sequence_parallel": True}, id="dp2xtp2-sp"),
    ],
)
def test_a_masked_run_matches_one_process(distributed, corpus, reference, tmp_path, world, parallel):
    losses = distributed.run(world, _train, _config(corpus, True, **parallel), tmp_path)[0]
    # float32 sums in another order across ranks, over 3 AdamW steps: ~1e-6 seen; 1e-5 is the parity bound.
    np.testing.assert_allclose(losses, reference[True], rtol=1e-5, atol=1e-5)


def _moe(config):
    """The same model with every MLP a mixture of experts (the MoE GPT's default [model.moe])."""
    return dataclasses.replace(config, model=MoEGPTConfig(**{**config.model.__dict__, "kind": "moe-gpt"}))


@pytest.mark.long
@pytest.mark.parametrize(
    "world, parallel, without_cp",
    [
        pytest.param(2, {"cp": 2}, {}, id="cp2"),
        pytest.param(4, {"cp": 2, "ep": 2, "cp_style": "allgather"}, {"ep": 2}, id="cp2xep2-allgather"),
    ],
)
def test_a_masked_moe_run_with_cp_matches_the_same_layout_without_cp(
    distributed, corpus, tmp_path, world, parallel, without_cp
):
    # Masking touches attention only; the experts route each cp rank's tokens and the aux loss spans the
    # cp group, so the run equals the one without cp (aux loss included: the same data ranks).
    masked = distributed.run(world, _train, _moe(_config(corpus, True, **parallel)), tmp_path / "cp")[0]
    expected = distributed.run(world // 2, _train, _moe(_config(corpus, True, **without_cp)), tmp_path / "no")[0]
    np.testing.assert_allclose(masked, expected, rtol=1e-5, atol=1e-5)  # float32 sums in another order, as above


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    rng = random.Random(1)
    lines = [
        json.dumps({"prompt": " ".join(rng.choices(WORDS, k=rng.randint(1, 3))) + "?",
                    "response": " " + " ".join(rng.choices(WORDS, k=rng.randint(1, 4))) + "\n"})
        for _ in range(300)
    ]  # fmt: skip
    path = tmp_path_factory.mktemp("pairs") / "qa.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_packed_pairs_masked_match_one_process(distributed, pairs, tmp_path):
    def config(**parallel):
        base = _config(pairs, True, **parallel)
        return dataclasses.replace(base, data=dataclasses.replace(base.data, packing=True))

    rows = language_data(config()).train[0].rows(np.arange(16))
    starts = np.argwhere(np.diff(rows["segments"], axis=1) > 0) + [0, 1]
    assert len(starts) > 16  # several examples per row ...
    assert (rows["labels"][tuple(starts.T)] == -100).all()  # ... each starting with its (unscored) prompt
    one = distributed.run(1, _train, config(), tmp_path / "one")[0]
    two = distributed.run(2, _train, config(dp=2), tmp_path / "two")[0]
    np.testing.assert_allclose(two, one, rtol=1e-5, atol=1e-5)  # float32 sums in another order, as above
