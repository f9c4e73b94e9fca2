"""Reading prepared folders: ranges across shards, documents, rows, the order and the loader."""

import json
import tracemalloc

import numpy as np
import pytest

from polyshard.data.errors import DataError
from polyshard.data.examples import IGNORE_INDEX, Documents, Windows
from polyshard.data.format import MANIFEST, TokenizerInfo, held_out
from polyshard.data.loader import ShardedLoader
from polyshard.data.order import Permutation
from polyshard.data.prepared import open_prepared
from polyshard.data.tokenizer import ByteTokenizer
from tests.data._folders import write_folder

DOCS = [[[1, 2, 3], [4, 5]], [[6, 7, 8, 9]], [[10], [11, 12, 13, 14, 15, 16]]]  # 3 shards, 5 documents
STREAM = list(range(1, 17))


def test_reads_any_range_across_shards(tmp_path):
    write_folder(tmp_path, {"train": DOCS})
    split = open_prepared(tmp_path).train
    assert (split.tokens, split.documents) == (16, 5)
    for start in range(17):
        for stop in range(start, 17):
            assert split.read(start, stop).tolist() == STREAM[start:stop]
    with pytest.raises(IndexError):
        split.read(3, 17)
    starts = [0, 3, 5, 9, 10]
    assert [split.document(i) for i in range(5)] == list(zip(starts, starts[1:] + [16]))
    assert split.document_starts(0, 16).tolist() == [3, 5, 9, 10]  # strictly inside the range
    assert split.document_starts(4, 10).tolist() == [5, 9]


def test_windows_and_segments(tmp_path):
    write_folder(tmp_path, {"train": DOCS})
    windows = Windows(open_prepared(tmp_path).train, 5, segments=True)
    assert len(windows) == 3  # 16 tokens, 3 whole windows of 5; the rest is dropped
    rows = windows.rows(np.array([2, 0]))
    assert rows["tokens"].tolist() == [STREAM[10:15], STREAM[0:5]]
    # window 2 covers stream 10..14: document [11..16] starts at 10, so one segment
    # window 0 covers 0..4: documents at 0 and 3
    assert rows["segments"].tolist() == [[0, 0, 0, 0, 0], [0, 0, 0, 1, 1]]
    assert "labels" not in rows
    tail = Windows(open_prepared(tmp_path).train, 5, first=2, count=1)
    assert tail.rows(np.array([0]))["tokens"].tolist() == [STREAM[10:15]]


def test_documents_pad_cut_and_mask(tmp_path):
    docs = [[[1, 2, 3, 4], [5, 6]], [[7, 8, 9, 10, 11, 12]]]
    masks = [[[0, 0, 1, 1], [0, 1]], [[0, 1, 1, 1, 1, 1]]]
    write_folder(tmp_path, {"train": docs}, masks={"train": masks})
    split = open_prepared(tmp_path).train
    rows = Documents(split, 5, pad_id=0).rows(np.array([1, 2, 0]))
    assert rows["tokens"].tolist() == [[5, 6, 0, 0, 0], [7, 8, 9, 10, 11], [1, 2, 3, 4, 0]]
    i = IGNORE_INDEX
    assert rows["labels"].tolist() == [[i, 6, i, i, i], [i, 8, 9, 10, 11], [i, i, 3, 4, i]]
    packed = Windows(split, 4).rows(np.array([0, 2]))
    assert packed["labels"].tolist() == [[i, i, 3, 4], [9, 10, 11, 12]]
    assert Documents(split, 3, 0).longest_prompt() == (2, 0)


def test_manifest_and_files_are_untrusted(tmp_path):
    write_folder(tmp_path / "ok", {"train": DOCS})
    open_prepared(tmp_path / "ok")
    with pytest.raises(DataError, match="no manifest.json"):
        open_prepared(tmp_path)

    def edited(name, change):
        folder = tmp_path / name
        write_folder(folder, {"train": DOCS})
        raw = json.loads((folder / MANIFEST).read_text())
        change(raw, folder)
        (folder / MANIFEST).write_text(json.dumps(raw))
        return folder

    cases = {
        "version": (lambda r, f: r.update(version=99), "format version 99"),
        "kind": (lambda r, f: r.update(kind="images"), "kind 'images'"),
        "name": (lambda r, f: r["splits"]["train"]["shards"][0].update(name="../escape"), "not a bare file name"),
        "size": (lambda r, f: (f / "train-00001.tokens").write_bytes(b"\0" * 3), "holds 3 bytes"),
        "missing": (lambda r, f: (f / "train-00002.docs").unlink(), "is missing"),
        "dtype": (lambda r, f: r["tokenizer"].update(vocab_size=70000), "cannot hold"),
        "count": (lambda r, f: r["splits"]["train"]["shards"][0].update(tokens=-1), "below 0"),
        "type": (lambda r, f: r.update(seed="zero"), "'seed' is 'zero'"),
    }
    for name, (change, message) in cases.items():
        with pytest.raises(DataError, match=message):
            open_prepared(edited(name, change))
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / MANIFEST).write_text("{not json")
    with pytest.raises(DataError, match="not JSON"):
        open_prepared(tmp_path / "junk")


def test_refuses_another_tokenizer(tmp_path):
    write_folder(tmp_path, {"train": DOCS}, tokenizer=TokenizerInfo("tokenizer.json", "ab" * 32, 300, 299))
    with pytest.raises(DataError, match="prepared with the tokenizer 'tokenizer.json'"):
        open_prepared(tmp_path, ByteTokenizer())


def test_permutation_is_a_bijection_in_constant_memory():
    for n in (1, 2, 3, 7, 64, 1000, 4099):
        for epoch in (0, 1):
            values = Permutation(n, seed=5, epoch=epoch)[np.arange(n)]
            assert sorted(values.tolist()) == list(range(n))
    a, b = Permutation(1000, 5, 0)[np.arange(1000)], Permutation(1000, 5, 1)[np.arange(1000)]
    assert (a != b).mean() > 0.9  # each epoch its own order
    assert abs(np.corrcoef(np.arange(1000), a)[0, 1]) < 0.1  # no visible trend left
    tracemalloc.start()
    order = Permutation(10**12, seed=0)  # far more windows than any corpus: nothing is allocated per window
    chunk = order[np.arange(10**12 - 4096, 10**12)]
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(set(chunk.tolist())) == 4096 and chunk.max() < 10**12
    assert peak < 1 << 20  # the 4096 values and their temporaries, not an index of the corpus


def test_held_out_is_seeded_and_never_the_first_document():
    docs = np.arange(100_000)
    chosen = held_out(3, docs, 0.1)
    assert not chosen[0] and abs(chosen.mean() - 0.1) < 0.005
    assert (held_out(3, docs, 0.1) == chosen).all() and (held_out(4, docs, 0.1) != chosen).any()


def _rows(n):
    class Numbers:
        def __len__(self):
            return n

        def rows(self, indices):
            return {"tokens": np.stack([indices, indices]).T.copy()}

    return Numbers()


def test_global_batches_do_not_depend_on_the_layout():
    data = _rows(50)
    whole = ShardedLoader(data, batch_size=8, rank=0, world_size=1, seed=3, shuffle=True)
    parts = [ShardedLoader(data, batch_size=2, rank=r, world_size=4, seed=3, shuffle=True) for r in range(4)]
    seen = []
    for _ in range(14):  # 6 global batches per epoch of 50: crosses two epochs
        batch = whole.next_batch()["tokens"][:, 0].tolist()
        assert batch == [t for p in parts for t in p.next_batch()["tokens"][:, 0].tolist()]
        seen.append(batch)
    assert sorted(t for b in seen[:6] for t in b) == sorted(set(t for b in seen[:6] for t in b))  # no repeats
    assert whole.state_dict() == {"epoch": 2, "position": 16}
    again = ShardedLoader(data, batch_size=4, rank=1, world_size=2, seed=3, shuffle=True)
    again.load_state_dict({"epoch": 2, "position": 8})
    assert again.next_batch()["tokens"][:, 0].tolist() == seen[-1][4:]


def test_in_order_gives_every_example_once_even_to_idle_ranks():
    data = _rows(5)
    got = [
        [
            b["tokens"][:, 0].tolist()
            for b in ShardedLoader(data, batch_size=1, rank=r, world_size=4, seed=0, shuffle=False).in_order()
        ]
        for r in range(4)
    ]
    assert got == [[[0], [4]], [[1], []], [[2], []], [[3], []]]


def test_mixture_shares_match_the_weights_on_any_layout():
    sources, weights = [_rows(40), _rows(1000), _rows(7)], [0.5, 0.3, 0.2]
    whole = ShardedLoader(
        sources, weights=weights, names=["a", "b", "c"], batch_size=16, rank=0, world_size=1, seed=1, shuffle=True
    )
    half = ShardedLoader(sources, weights=weights, batch_size=8, rank=1, world_size=2, seed=1, shuffle=True)
    for _ in range(1000):
        batch = whole.next_batch()["tokens"][:, 0]
        assert (half.next_batch()["tokens"][:, 0] == batch[8:]).all()
    shares = whole.shares()
    for name, weight in zip("abc", weights):
        assert abs(shares[name] - weight) < 0.01 * weight
    resumed = ShardedLoader(sources, weights=weights, batch_size=16, rank=0, world_size=1, seed=1, shuffle=True)
    resumed.load_state_dict(whole.state_dict())
    assert (resumed.next_batch()["tokens"] == whole.next_batch()["tokens"]).all()
    with pytest.raises(DataError, match="the run mixes 3"):
        resumed.load_state_dict({"consumed": [1, 2]})
