"""A run's data and sizes as untrusted input (issue 33): token ids past the model's vocabulary caught
before launch (and in a worker's batch), files a manifest names outside the run's sources never
opened, a full cache disk as one line, sizes no machine can run refused with the fix, and the
planner's memory estimate held against this machine's before anything starts."""

from __future__ import annotations

import errno
import json

import numpy as np
import pytest

from polyshard.data.format import MANIFEST, SourceInfo, TokenizerInfo
from polyshard.data.prepared import open_prepared
from polyshard.planner.fits import WORKER_OVERHEAD, check_fits
from polyshard.planner.search import memory_of
from polyshard.trainer.config import from_dict
from polyshard.trainer.data import check_language_data
from polyshard.trainer.errors import ConfigError, DataError
from polyshard.trainer.loop.step import split_batch
from tests.data._folders import write_folder

BYTES = TokenizerInfo("bytes", "bytes", 256, None)


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("POLYSHARD_CACHE", str(tmp_path / "cache"))


def _config(source, **sections):
    data = {"source": str(source), **sections.pop("data", {})}
    return from_dict({"model": {"context_length": 15, **sections.pop("model", {})}, "data": data, **sections})


@pytest.mark.parametrize("bad", [256, 300, 65535])
def test_a_token_past_the_vocabulary_is_refused_before_launch_naming_the_shard(tmp_path, bad):
    docs = [[65] * 400, [66] * 400]
    write_folder(tmp_path / "p", {"train": [docs, [[67] * 300, [68, bad] + [69] * 200]], "val": [[[70] * 100]]})
    with pytest.raises(DataError, match=rf"train-00001\.tokens holds token id {bad}, past model.vocab_size=256"):
        check_language_data(_config(tmp_path / "p"))


def test_a_shard_changed_after_prepare_is_caught_although_its_manifest_says_otherwise(tmp_path):
    from polyshard.data.prepare import prepare

    (tmp_path / "corpus").mkdir()
    for i in range(40):
        (tmp_path / "corpus" / f"{i}.txt").write_text("some words " * 30)
    prepare(tmp_path / "corpus", tmp_path / "p", val_fraction=0.1, progress=False, workers=1)
    tokens = tmp_path / "p" / "train-00000.tokens"
    data = np.fromfile(tokens, "<u2")
    data[17] = 4000  # same size, a recorded max_token that now lies
    data.tofile(tokens)
    with pytest.raises(DataError, match=r"train-00000\.tokens holds token id 4000, past model.vocab_size=256"):
        check_language_data(_config(tmp_path / "p"))


def test_a_worker_refuses_a_batch_with_a_token_past_the_vocabulary():
    config = from_dict({"model": {"context_length": 4, "vocab_size": 50}})
    fine = {"tokens": np.arange(10, dtype=np.int64).reshape(2, 5)}
    assert split_batch(config, fine)[0].shape == (2, 4)
    bad = {"tokens": np.asarray([[1, 2, 3, 4, 50]], dtype=np.int64)}
    with pytest.raises(DataError, match="token id 50, past model.vocab_size=50"):
        split_batch(config, bad)


def test_a_manifests_source_outside_the_runs_sources_is_never_opened(tmp_path):
    from polyshard.trainer.data.language import _source_line

    secret = tmp_path / "secret.jsonl"
    secret.write_text('{"prompt": "a", "response": "b"}\n' * 3)
    folder = tmp_path / "p"
    write_folder(folder, {"train": [[[1, 2], [3, 4]]]}, masks={"train": [[[0, 1], [0, 1]]]})
    raw = json.loads((folder / MANIFEST).read_text())
    raw["sources"] = [vars(SourceInfo(str(secret), 99, "0" * 64))]
    (folder / MANIFEST).write_text(json.dumps(raw))
    prepared = open_prepared(folder)
    assert _source_line(prepared, False, 1, named={folder.resolve()}) is None  # not named by the run: not read
    assert _source_line(prepared, False, 1, named={secret.resolve()}) == (str(secret), 2)


def test_a_full_cache_disk_is_one_line_naming_the_cache_and_the_fix(tmp_path, monkeypatch):
    from polyshard.trainer.data import language

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "cache" / "x"))

    monkeypatch.setattr(language, "_prepare_into", full)
    (tmp_path / "t.txt").write_text("words " * 500)
    with pytest.raises(DataError, match=r"into the cache .*No space left on device.*set POLYSHARD_CACHE"):
        check_language_data(_config(tmp_path / "t.txt"))


# -- sizes that cannot run ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"model": {"kind": "moe-gpt", "moe": {"num_experts": 10**9}}}, "model.moe.num_experts=1000000000 is past"),
        ({"model": {"kind": "moe-gpt", "moe": {"num_experts": 65537}}}, "model.moe.num_experts=65537 is past 65,536"),
        ({"optimizer": {"muon_ns_steps": 10**9}}, "optimizer.muon_ns_steps=1000000000 is past 100"),
        ({"optimizer": {"muon_ns_steps": 101}}, "optimizer.muon_ns_steps=101 is past 100"),
        ({"data": {"sources": [{"path": "a", "weight": 1e308}, {"path": "b", "weight": 1.0}]}}, "weight=1e+308"),
        ({"data": {"sources": [{"path": "a", "weight": 1e308}, {"path": "b", "weight": 1e308},
                               {"path": "c", "weight": 1.0}]}}, "data.sources[0].weight=1e+308 is past 1e+12"),
        ({"data": {"source": "x.txt", "sources": [{"path": "a"}]}}, "data.source and data.sources are both set"),
        ({"data": {"source": "shakespeare", "sources": [{"path": "a"}]}}, "drop data.source, or drop"),
    ],
)  # fmt: skip
def test_sizes_that_cannot_run_are_refused_naming_the_field(settings, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("+", r"\+")):
        from_dict(settings)


def test_sane_sizes_still_parse():
    config = from_dict(
        {"model": {"kind": "moe-gpt", "moe": {"num_experts": 384}}, "optimizer": {"muon_ns_steps": 10},
         "data": {"sources": [{"path": "a", "weight": 1e9}, {"path": "b", "weight": 1e-9}]}}
    )  # fmt: skip
    assert config.model.moe.num_experts == 384 and config.data.source == "shakespeare"


def test_the_memory_estimate_is_held_against_the_machines():
    config = from_dict({"parallel": {"dp": 2}})
    per_rank = memory_of(config).total
    with_process = per_rank + WORKER_OVERHEAD  # on a host, each rank's process holds its own share too
    assert check_fits(config, 2, memory=(2.01 * with_process, "host memory", True)) == per_rank
    with pytest.raises(ConfigError, match=r"GiB the worker process holds itself\) x 2 ranks = .* more than this"):
        check_fits(config, 2, memory=(1.99 * with_process, "host memory", True))  # two ranks share the host
    check_fits(config, 2, memory=(1.01 * per_rank, "device memory per GPU", False))  # a device each
    with pytest.raises(ConfigError, match=r"--set training.global_batch_size=.*or pass --force"):
        check_fits(config, 2, memory=(0.99 * per_rank, "device memory per GPU", False))
    huge = from_dict({"model": {"hidden": 1 << 20, "num_heads": 4}})
    with pytest.raises(ConfigError, match="GiB one rank may have on any machine"):
        check_fits(huge, 1, anywhere=True)
