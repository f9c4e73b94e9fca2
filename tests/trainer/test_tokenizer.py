"""Real tokenizers: a byte-level BPE trained on the corpus round-trips any text, a run trains with
it, and a tokenizer larger than the model's vocabulary is refused before launch."""

from __future__ import annotations

import pytest

from polyshard.mesh import Mesh
from polyshard.trainer.config import from_dict
from polyshard.trainer.data.text import check_text_source
from polyshard.trainer.data.tokenizer import ByteTokenizer, load_tokenizer, train_bpe
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
    from polyshard.trainer.checkpoint import latest_checkpoint
    from polyshard.trainer.export import consolidate
    from polyshard.trainer.loop import sample_text

    config = from_dict(
        {
            "model": {"hidden": 32, "num_layers": 2, "num_heads": 4, "context_length": 16, "vocab_size": 300},
            "parallel": {"dp": 2},
            "training": {"steps": 12, "global_batch_size": 8, "lr": 3e-3, "warmup_steps": 2, "eval_every": 0},
            "data": {"source": corpus, "tokenizer": str(bpe)},
            "logging": {"progress_bar": False},
        }
    )
    losses = distributed.run(2, _train, config, tmp_path)[0]
    assert losses[-1] < losses[0] - 0.5  # from ~ln(300) = 5.7 toward the corpus's few words
    text = sample_text(config, consolidate(latest_checkpoint(tmp_path / "checkpoints")), 8, "the king")
    assert text.startswith("the king") and len(text) > len("the king")


def test_a_tokenizer_larger_than_the_vocabulary_is_refused(bpe, corpus):
    with pytest.raises(DataError, match=r"has 300 tokens, more than model.vocab_size=256; use vocab_size >= 300"):
        check_text_source(corpus, 16, 0.1, 8, 256, str(bpe))
    with pytest.raises(DataError, match="no tokenizer.json there"):
        load_tokenizer("/nonexistent/folder")
