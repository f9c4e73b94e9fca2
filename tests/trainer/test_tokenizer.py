"""Real tokenizers: a byte-level BPE trained on the corpus round-trips any text, a run trains with
it, and a tokenizer larger than the model's vocabulary is refused before launch."""

from __future__ import annotations

import json
import shutil

import pytest

from polyshard.data.tokenizer import ByteTokenizer, load_tokenizer, train_bpe
from polyshard.mesh import Mesh
from polyshard.trainer.config import from_dict
from polyshard.trainer.data import check_language_data
from polyshard.trainer.errors import DataError

pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def bpe(corpus, tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    with open(corpus) as f:
        return train_bpe([f.read()], 300, path)


def test_a_trained_bpe_round_trips_any_text_and_compresses(bpe, corpus):
    tokenizer = load_tokenizer(str(bpe))
    assert tokenizer.vocab_size == 300
    for text in ("the king and the queen", "Héllo, wörld — ✓ ROMEO:\n\tend", open(corpus).read()[:2000]):
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == text
    sample = open(corpus).read()[:2000]
    assert len(tokenizer.encode(sample)) < 0.6 * len(ByteTokenizer().encode(sample))  # merges learned the words
    assert load_tokenizer(str(bpe.parent)).vocab_size == 300  # a folder holding tokenizer.json works too


def _train(config, out):
    from polyshard.trainer.loop import train

    return train(config, Mesh(config.parallel.mesh_axes), out, log=False).losses


def test_a_run_trains_with_the_bpe(distributed, bpe, corpus, tmp_path):
    from polyshard.checkpoint import latest_checkpoint
    from polyshard.trainer.checkpointing.run_export import consolidate
    from polyshard.trainer.loop import sample_text

    config = from_dict(
        {
            "model": {"hidden": 32, "num_layers": 2, "num_heads": 4, "context_length": 16, "vocab_size": 300},
            "parallel": {"dp": 2},
            "training": {"steps": 12, "global_batch_size": 8},
            "optimizer": {"lr": 3e-3},
            "lr_schedule": {"warmup_steps": 2},
            "eval": {"every": 0},
            "data": {"source": corpus, "tokenizer": str(bpe)},
            "logging": {"progress_bar": False},
        }
    )
    losses = distributed.run(2, _train, config, tmp_path)[0]
    assert losses[-1] < losses[0] - 0.5  # from ~ln(300) = 5.7 toward the corpus's few words
    checkpoint = latest_checkpoint(tmp_path / "checkpoints")
    text = sample_text(config, consolidate(checkpoint), 8, "the king")
    assert text.startswith("the king") and len(text) > len("the king")
    _the_tokenizer_travels_with_the_checkpoint(checkpoint, bpe, tmp_path, text)


def _the_tokenizer_travels_with_the_checkpoint(checkpoint, bpe, tmp_path, text):
    """Each checkpoint holds the run's tokenizer.json, verified like its tensors: `polyshard generate`
    reads it even when the file the config named is gone, and resharding carries it along."""
    from typer.testing import CliRunner

    from polyshard.checkpoint import Checkpoint, CheckpointError
    from polyshard.cli.main import app

    assert (checkpoint / "tokenizer.json").read_bytes() == bpe.read_bytes()
    moved = tmp_path / "moved" / checkpoint.name
    shutil.copytree(checkpoint, moved)
    index = json.loads((moved / "index.json").read_text())
    index["config"]["data"]["tokenizer"] = str(tmp_path / "gone" / "tokenizer.json")
    (moved / "index.json").write_text(json.dumps(index))
    args = ["generate", str(moved), "--prompt", "the king", "--tokens", "8", "--temperature", "0.8"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert result.output.strip() == text  # the same tokens as the run's own sample (same seed and settings)
    resharded = tmp_path / "resharded"
    result = CliRunner().invoke(app, ["reshard", str(moved), str(resharded), "--mesh", "dp=1"])
    assert result.exit_code == 0, result.output
    assert (next(resharded.glob("step_*")) / "tokenizer.json").read_bytes() == bpe.read_bytes()
    exported = tmp_path / "hf"
    result = CliRunner().invoke(app, ["export", str(moved), str(exported), "--format", "hf"])
    assert result.exit_code == 0, result.output
    transformers = pytest.importorskip("transformers")
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
    ours = load_tokenizer(str(bpe))
    assert hf_tokenizer.encode("the king is here") == ours.encode("the king is here")
    assert json.loads((exported / "config.json").read_text())["eos_token_id"] == ours.end_of_text == 299  # the last
    (moved / "tokenizer.json").write_text("{}")  # tampered with
    with pytest.raises(CheckpointError, match="tokenizer.json is missing or does not match its sha256"):
        Checkpoint(moved)


def test_a_tokenizer_larger_than_the_vocabulary_is_refused(bpe, corpus):
    with pytest.raises(DataError, match=r"has 300 tokens, more than model.vocab_size=256; use vocab_size >= 300"):
        check_language_data(
            from_dict({"model": {"context_length": 16}, "data": {"source": corpus, "tokenizer": str(bpe)}})
        )
    with pytest.raises(DataError, match="no tokenizer.json there"):
        load_tokenizer("/nonexistent/folder")
