"""A prepared folder is untrusted input too: its offsets are checked when it is opened (a damaged
``.docs`` used to train silently wrong, or fail with IndexError in the workers), its largest token is
recorded and checked, and no file it links to outside itself is read. (Issue 33.)"""

from __future__ import annotations

import json

import numpy as np
import pytest

from polyshard.data.errors import DataError
from polyshard.data.format import DOCS, MANIFEST, TOKENS, read_manifest
from polyshard.data.loader import ShardedLoader
from polyshard.data.prepare import prepare
from polyshard.data.prepared import open_prepared
from tests.data._folders import write_folder

DOCS_3 = {"train": [[[1, 2, 3], [4, 5], [6, 7, 8, 9]], [[10, 11], [12]]]}  # shard 0: 9 tokens, 3 documents


@pytest.mark.parametrize(
    "offsets",
    [
        [0, 5, 3],  # backwards
        [0, -2, 5],  # negative
        [0, 3, 9],  # at the end of the shard
        [0, 3, 400],  # past it
        [2, 3, 5],  # not starting at 0
        [0, 3, 2**62],  # far past, as a corrupt file may hold
    ],
)
def test_offsets_out_of_order_or_outside_the_shard_are_refused_on_open(tmp_path, offsets):
    write_folder(tmp_path, DOCS_3)
    np.asarray(offsets, "<i8").tofile(tmp_path / ("train-00000" + DOCS))
    with pytest.raises(DataError, match=r"train-00000\.docs: document offset \d is .* the folder is damaged"):
        open_prepared(tmp_path)


def test_equal_offsets_and_good_ones_open(tmp_path):
    write_folder(tmp_path, DOCS_3)
    open_prepared(tmp_path)
    np.asarray([0, 3, 3], "<i8").tofile(tmp_path / ("train-00000" + DOCS))  # an empty document is no damage
    assert open_prepared(tmp_path).train.documents == 5


@pytest.mark.parametrize("which", [MANIFEST, "train-00000" + TOKENS, "train-00001" + DOCS])
def test_files_linked_from_outside_the_folder_are_refused(tmp_path, which):
    folder = tmp_path / "prepared"
    write_folder(folder, DOCS_3)
    outside = tmp_path / ("outside-" + which)
    (folder / which).rename(outside)
    (folder / which).symlink_to(outside)
    with pytest.raises(DataError, match=rf"{which} is a link to .*outside the prepared folder"):
        open_prepared(folder)


def test_a_link_inside_the_folder_and_a_linked_folder_are_read(tmp_path):
    folder = tmp_path / "prepared"
    write_folder(folder, DOCS_3)
    (folder / "train-00000.tokens").rename(folder / "real.bin")
    (folder / "train-00000.tokens").symlink_to(folder / "real.bin")
    (tmp_path / "named").symlink_to(folder, target_is_directory=True)  # the folder the user names may be a link
    assert open_prepared(tmp_path / "named").train.read(0, 3).tolist() == [1, 2, 3]


def test_prepare_records_each_shards_largest_token_and_reading_checks_it(tmp_path):
    (tmp_path / "corpus").mkdir()
    for i, text in enumerate(["abc", "xyz~", "hello"]):
        (tmp_path / "corpus" / f"{i}.txt").write_text(text)
    prepare(tmp_path / "corpus", tmp_path / "out", val_fraction=0.0, shard_tokens=6, progress=False, workers=1)
    shards = read_manifest(tmp_path / "out").splits["train"].shards
    for shard in shards:
        tokens = np.fromfile(tmp_path / "out" / (shard.name + TOKENS), "<u2")
        assert shard.max_token == int(tokens.max())
    raw = json.loads((tmp_path / "out" / MANIFEST).read_text())
    raw["splits"]["train"]["shards"][0]["max_token"] = 300  # past the byte tokenizer's 256
    (tmp_path / "out" / MANIFEST).write_text(json.dumps(raw))
    with pytest.raises(DataError, match="shard 'train-00000' holds token 300, past the tokenizer's 256"):
        read_manifest(tmp_path / "out")
    raw["splits"]["train"]["shards"][0]["max_token"] = -1
    (tmp_path / "out" / MANIFEST).write_text(json.dumps(raw))
    with pytest.raises(DataError, match="max_token is -1, not a token id"):
        read_manifest(tmp_path / "out")


class _Many:
    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def rows(self, ids):
        return {"tokens": np.asarray(ids)[:, None]}


@pytest.mark.parametrize("weights", [[1e308, 1e308, 1.0], [1e300, 1e-300], [3.0, 1.0]])
def test_mixture_shares_never_overflow(weights):
    loader = ShardedLoader(
        [_Many(50)] * len(weights), batch_size=8, rank=0, world_size=1, seed=0, shuffle=False, weights=weights
    )
    for _ in range(20):
        loader.next_batch()
    shares = np.asarray(list(loader.shares().values()))
    expected = np.asarray(weights) / np.max(weights)
    assert np.allclose(shares, expected / expected.sum(), atol=0.02), shares  # one slot in 160, rounded
    with pytest.raises(DataError, match="one positive finite weight per source"):
        ShardedLoader([_Many(5)] * 2, batch_size=1, rank=0, world_size=1, seed=0, shuffle=False, weights=[1, np.inf])
