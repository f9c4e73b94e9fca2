"""`prepare`: every source kind gives the tokens of its documents tokenized alone, the splits the seeded
rule says, the same folder whatever the workers, and resumes an interrupted run to the same bytes."""

from __future__ import annotations

import gzip
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from polyshard.data.errors import DataError
from polyshard.data.format import DOCS, MANIFEST, MASK, TOKENS, held_out, read_manifest
from polyshard.data.interrupted import kept
from polyshard.data.output import PROGRESS, TEMP_SUFFIX
from polyshard.data.prepare import prepare
from polyshard.data.tokenizer import ByteTokenizer, FileTokenizer, Tokenizer, train_bpe

tokenizers = pytest.importorskip("tokenizers")

WORDS = "the a of and to in is was he she it café naïve 日本 über long longer longest whale sea ship".split()


def _documents(count: int, seed: int = 0) -> list[str]:
    """Short documents of random words over a few lines each (some non-ASCII)."""
    rng = random.Random(seed)
    lines = lambda: " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12)))  # noqa: E731
    return ["\n".join(lines() for _ in range(rng.randint(1, 3))) for _ in range(count)]


DOCUMENTS = _documents(40)


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> FileTokenizer:
    """A byte-level BPE with no end-of-text token (documents end with the separator)."""
    path = train_bpe(DOCUMENTS, 300, tmp_path_factory.mktemp("bpe") / "tokenizer.json", end_of_text=None)
    return FileTokenizer(path)


@pytest.fixture(scope="module")
def bpe_eot(tmp_path_factory) -> FileTokenizer:
    """A byte-level BPE with GPT-2's <|endoftext|>."""
    t = tokenizers
    tokenizer = t.Tokenizer(t.models.BPE())
    tokenizer.pre_tokenizer = t.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = t.decoders.ByteLevel()
    trainer = t.trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=t.pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<|endoftext|>"]
    )
    tokenizer.train_from_iterator(DOCUMENTS, trainer=trainer)
    path = tmp_path_factory.mktemp("bpe_eot") / "tokenizer.json"
    tokenizer.save(str(path))
    loaded = FileTokenizer(path)
    assert loaded.end_of_text is not None
    return loaded


def _reference(documents: list[str], tokenizer: Tokenizer, separator: str = "\n") -> list[list[int]]:
    """Each document tokenized alone, then its end: the end-of-text token, else the separator tokenized alone."""
    end = [tokenizer.end_of_text] if tokenizer.end_of_text is not None else tokenizer.encode(separator)
    return [tokenizer.encode(d) + end for d in documents if d]


def _split_docs(folder: Path, split: str, what: str = TOKENS) -> list[list[int]]:
    """The documents of ``split`` read back plainly (``what``: the tokens, or the mask)."""
    manifest = read_manifest(folder)
    found: list[list[int]] = []
    for shard in manifest.splits[split].shards if split in manifest.splits else ():
        values = np.fromfile(folder / (shard.name + what), manifest.np_dtype if what == TOKENS else np.uint8)
        starts = np.fromfile(folder / (shard.name + DOCS), np.int64).tolist() + [shard.tokens]
        found += [values[a:b].tolist() for a, b in zip(starts, starts[1:])]
    return found


def _expected_splits(docs: list[list[int]], seed: int, fraction: float) -> dict[str, list[list[int]]]:
    held = held_out(seed, np.arange(len(docs)), fraction)
    return {"train": [d for d, h in zip(docs, held) if not h], "val": [d for d, h in zip(docs, held) if h]}


def _check(folder: Path, docs: list[list[int]], seed: int = 0, fraction: float = 0.0) -> None:
    expected = _expected_splits(docs, seed, fraction)
    for split in ("train", "val"):
        assert _split_docs(folder, split) == expected[split], split


def _write_texts(folder: Path, documents: list[str]) -> Path:
    folder.mkdir()
    for i, doc in enumerate(documents):
        (folder / f"doc-{i:03d}.txt").write_text(doc, encoding="utf-8")
    return folder


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


# -- sources ---------------------------------------------------------------------------------------


def test_bytes_text_folder_is_todays_stream(tmp_path):
    """One document per file, each followed by "\\n": the trainer's "\\n".join(documents) + "\\n"."""
    source = _write_texts(tmp_path / "corpus", DOCUMENTS[:10])
    manifest = prepare(source, tmp_path / "out", "bytes", val_fraction=0.0, progress=False, workers=1)
    stream = np.fromfile(tmp_path / "out" / "train-00000.tokens", np.uint16)
    assert bytes(stream.astype(np.uint8)) == ("\n".join(DOCUMENTS[:10]) + "\n").encode("utf-8")
    assert manifest.dtype == "uint16" and manifest.separator == "\n" and "val" not in manifest.splits
    assert [s.name for s in manifest.sources] == [str(source / f"doc-{i:03d}.txt") for i in range(10)]
    assert manifest.sources[0].bytes == len(DOCUMENTS[0].encode())
    assert read_manifest(tmp_path / "out") == manifest


@pytest.mark.parametrize("split_on", ["file", "blank"])
@pytest.mark.parametrize("eot", [False, True])
def test_text_files_with_a_bpe(tmp_path, bpe, bpe_eot, split_on, eot):
    tokenizer = bpe_eot if eot else bpe
    if split_on == "file":
        source = _write_texts(tmp_path / "corpus", DOCUMENTS)
        docs = DOCUMENTS
    else:  # blocks separated by blank lines (one with spaces), two files
        source = tmp_path / "corpus"
        source.mkdir()
        (source / "a.txt").write_text("\n\n".join(DOCUMENTS[:20]) + "\n", encoding="utf-8")
        (source / "b.txt").write_text("\n\n \n\n" + "\n  \n".join(DOCUMENTS[20:]), encoding="utf-8")
        docs = DOCUMENTS
    manifest = prepare(
        source, tmp_path / "out", tokenizer.path, split_on=split_on, val_fraction=0.25, seed=3, chunk_bytes=200,
        shard_tokens=150, progress=False, workers=1,
    )  # fmt: skip
    _check(tmp_path / "out", _reference(docs, tokenizer), seed=3, fraction=0.25)
    assert manifest.separator == (None if eot else "\n")
    assert manifest.tokenizer.end_of_text == tokenizer.end_of_text and manifest.tokenizer.name == "tokenizer.json"
    assert len(manifest.splits["train"].shards) > 1 and manifest.splits["val"].documents > 0
    for shard in manifest.splits["train"].shards:  # whole documents, within the size unless one alone
        assert shard.tokens <= 150 or shard.documents == 1


def _jsonl(records: list[object]) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode("utf-8")


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz", ".jsonl.zst"])
def test_json_lines(tmp_path, bpe_eot, suffix):
    records = [{"text": d, "id": i} for i, d in enumerate(DOCUMENTS)]
    records.insert(5, {"text": ""})  # an empty document: skipped
    data = _jsonl(records).replace(b"\n", b"\n\n", 1)  # a blank line: skipped
    if suffix == ".jsonl.gz":
        data = gzip.compress(data)
    elif suffix == ".jsonl.zst":
        zstandard = pytest.importorskip("zstandard")
        data = zstandard.ZstdCompressor().compress(data)
    (tmp_path / f"corpus{suffix}").write_bytes(data)
    prepare(tmp_path / f"corpus{suffix}", tmp_path / "out", bpe_eot.path, val_fraction=0.2, chunk_bytes=100,
            progress=False, workers=1)  # fmt: skip
    _check(tmp_path / "out", _reference(DOCUMENTS, bpe_eot), fraction=0.2)


def test_parquet_folder(tmp_path, bpe):
    pq = pytest.importorskip("pyarrow.parquet")
    pa = pytest.importorskip("pyarrow")
    source = tmp_path / "corpus"
    (source / "data").mkdir(parents=True)
    for part, docs in enumerate((DOCUMENTS[:25], DOCUMENTS[25:])):
        table = pa.table({"body": docs, "n": list(range(len(docs)))})
        pq.write_table(table, source / "data" / f"train-{part}.parquet", row_group_size=7)
    prepare(source, tmp_path / "out", bpe.path, text_field="body", val_fraction=0.2, progress=False, workers=1)
    _check(tmp_path / "out", _reference(DOCUMENTS, bpe), fraction=0.2)


def test_saved_dataset_folder(tmp_path, bpe_eot):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"text": DOCUMENTS}).save_to_disk(str(tmp_path / "saved"))
    manifest = prepare(tmp_path / "saved", tmp_path / "out", bpe_eot.path, val_fraction=0.2, progress=False, workers=1)
    _check(tmp_path / "out", _reference(DOCUMENTS, bpe_eot), fraction=0.2)
    assert all(s.name.endswith(".arrow") and len(s.sha256) == 64 for s in manifest.sources)


PAIRS = [(f"Q{i}: {d[:20]}", f"A{i}: {d}") for i, d in enumerate(DOCUMENTS[:12])]


@pytest.mark.parametrize("eot", [False, True])
def test_pairs_mask_falls_between_prompt_and_response(tmp_path, bpe_eot, eot):
    tokenizer: Tokenizer = bpe_eot if eot else ByteTokenizer()
    (tmp_path / "chat.jsonl").write_bytes(_jsonl([{"q": p, "a": r} for p, r in PAIRS]))
    manifest = prepare(
        tmp_path / "chat.jsonl", tmp_path / "out", bpe_eot.path if eot else "bytes", kind="pairs", prompt_field="q",
        response_field="a", val_fraction=0.0, progress=False, workers=1,
    )  # fmt: skip
    end = [tokenizer.end_of_text] if eot else []  # the byte tokenizer's pairs get no separator
    tokens = [tokenizer.encode(p) + tokenizer.encode(r) + end for p, r in PAIRS]
    masks = [[0] * len(tokenizer.encode(p)) + [1] * (len(tokenizer.encode(r)) + len(end)) for p, r in PAIRS]
    assert _split_docs(tmp_path / "out", "train") == tokens
    assert _split_docs(tmp_path / "out", "train", MASK) == masks
    assert manifest.kind == "pairs" and manifest.separator is None


# -- workers, restarts, the output folder ------------------------------------------------------------


def test_one_and_two_workers_write_the_same_bytes(tmp_path, bpe):
    source = _write_texts(tmp_path / "corpus", DOCUMENTS)
    options = dict(val_fraction=0.2, chunk_bytes=150, shard_tokens=120, progress=False)
    one = prepare(source, tmp_path / "one", bpe.path, workers=1, **options)
    two = prepare(source, tmp_path / "two", bpe.path, workers=2, **options)
    assert one == two and len(one.splits["train"].shards) > 2
    assert _files(tmp_path / "one") == _files(tmp_path / "two")


_INTERRUPTED = """
import os, sys
from polyshard.data import prepare as p
saved = 0
def save_then_die(temp, state, save=p._save_progress):
    global saved
    saved += 1
    if saved == 4:  # the 4th chunk is on disk, its progress record is not: the rerun must cut it off
        os._exit(9)
    save(temp, state)
p._save_progress = save_then_die
p.prepare(sys.argv[1], sys.argv[2], sys.argv[3], val_fraction=0.2, chunk_bytes=150, shard_tokens=120,
          progress=False, workers=1)
"""


def test_an_interrupted_run_resumes_to_the_same_folder(tmp_path, bpe, monkeypatch):
    source = _write_texts(tmp_path / "corpus", DOCUMENTS)
    out, whole = tmp_path / "out", tmp_path / "whole"
    run = subprocess.run([sys.executable, "-c", _INTERRUPTED, str(source), str(out), str(bpe.path)], env=os.environ)
    assert run.returncode == 9
    temp = tmp_path / ("." + out.name + TEMP_SUFFIX)
    assert not out.exists() and (temp / PROGRESS).is_file()
    assert json.loads((temp / PROGRESS).read_text())["cursor"][0] > 0

    from polyshard.data import encode

    tokenized = []
    call = encode.Encoder.__call__
    monkeypatch.setattr(encode.Encoder, "__call__", lambda self, chunk: tokenized.append(chunk) or call(self, chunk))
    done, notes = kept(out), []  # what the last record holds, not the 4th chunk written after it
    options = {"val_fraction": 0.2, "chunk_bytes": 150, "shard_tokens": 120, "progress": False, "workers": 1}
    prepare(source, out, bpe.path, **options, note=notes.append)
    assert done is not None and 0 < done.documents < len(DOCUMENTS)
    assert notes == [
        f"resuming an interrupted prepare of {out}: {done} were done and are kept; the source is read again "
        "from the start (to hash it) and tokenized from where it stopped"
    ]
    resumed_parts = sum(len(c.parts) for c in tokenized)
    assert 0 < resumed_parts < len(DOCUMENTS)  # only what came after the last record was tokenized
    prepare(source, whole, bpe.path, val_fraction=0.2, chunk_bytes=150, shard_tokens=120, progress=False, workers=1)
    assert _files(out) == _files(whole) and not temp.exists()


def test_a_changed_source_starts_over(tmp_path, bpe):
    source = _write_texts(tmp_path / "corpus", DOCUMENTS)
    out = tmp_path / "out"
    subprocess.run([sys.executable, "-c", _INTERRUPTED, str(source), str(out), str(bpe.path)], env=os.environ)
    (source / "doc-000.txt").write_text("a different first document", encoding="utf-8")
    prepare(source, out, bpe.path, val_fraction=0.2, chunk_bytes=150, shard_tokens=120, progress=False, workers=1)
    _check(out, _reference(["a different first document", *DOCUMENTS[1:]], bpe), fraction=0.2)


def test_overwrite_replaces_only_a_prepared_dataset(tmp_path):
    source = _write_texts(tmp_path / "corpus", DOCUMENTS[:5])
    out = tmp_path / "out"
    prepare(source, out, progress=False, workers=1)
    with pytest.raises(DataError, match="already a prepared dataset; pass --overwrite"):
        prepare(source, out, progress=False, workers=1)
    prepare(_write_texts(tmp_path / "other", DOCUMENTS[5:7]), out, progress=False, workers=1, overwrite=True)
    assert read_manifest(out).documents == 2
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "keep.txt").write_text("mine")
    with pytest.raises(DataError, match="not a prepared dataset; choose another"):
        prepare(source, notes, progress=False, workers=1, overwrite=True)
    assert (notes / "keep.txt").read_text() == "mine"


def test_progress_bar_on_stderr(tmp_path, capsys):
    prepare(_write_texts(tmp_path / "corpus", DOCUMENTS[:3]), tmp_path / "out", workers=1)
    assert "MB/s" in capsys.readouterr().err
    prepare(tmp_path / "corpus", tmp_path / "quiet", workers=1, progress=False)
    assert capsys.readouterr().err == ""


# -- untrusted input -----------------------------------------------------------------------------------


def _bad_cases(tmp_path: Path) -> dict[str, tuple[Path, dict[str, object], str]]:
    (tmp_path / "empty").mkdir()
    (tmp_path / "latin1.txt").write_bytes("ok\nna\xefve\n".encode("latin-1"))
    (tmp_path / "broken.jsonl").write_bytes(b'{"text": "fine"}\n{"text": "cut\n')
    (tmp_path / "list.jsonl").write_bytes(b'{"text": "fine"}\n[1, 2]\n')
    (tmp_path / "field.jsonl").write_bytes(b'{"text": "fine"}\n{"body": "x"}\n')
    (tmp_path / "number.jsonl").write_bytes(b'{"text": 3}\n')
    (tmp_path / "pairs.jsonl").write_bytes(b'{"prompt": "p", "response": "r"}\n{"prompt": "p", "response": ""}\n')
    (tmp_path / "corrupt.jsonl.gz").write_bytes(b"\x1f\x8b not gzip at all")
    (tmp_path / "notes.csv").write_text("a,b\n")
    return {
        "missing": (tmp_path / "nothere.txt", {}, "nothere.txt: no such file"),
        "empty folder": (tmp_path / "empty", {}, "empty holds no"),
        "not utf-8": (tmp_path / "latin1.txt", {}, r"latin1.txt, line 2: not UTF-8"),
        "malformed line": (tmp_path / "broken.jsonl", {}, r"broken.jsonl, line 2: not JSON"),
        "not an object": (tmp_path / "list.jsonl", {}, r"list.jsonl, line 2: a JSON list"),
        "wrong field": (tmp_path / "field.jsonl", {}, r"field.jsonl, line 2: no 'text' field .* --text-field"),
        "not a string": (tmp_path / "number.jsonl", {}, r"number.jsonl, line 1: 'text' is a JSON int"),
        "empty response": (tmp_path / "pairs.jsonl", {"kind": "pairs"}, r"pairs.jsonl, line 2: 'response' is empty"),
        "corrupt gzip": (tmp_path / "corrupt.jsonl.gz", {}, "corrupt.jsonl.gz: cannot read or decompress"),
        "unknown kind of file": (tmp_path / "notes.csv", {}, "notes.csv is not a"),
        "text as pairs": (tmp_path / "latin1.txt", {"kind": "pairs"}, "latin1.txt: fine-tuning pairs need .jsonl"),
    }


BAD = [
    "missing", "empty folder", "not utf-8", "malformed line", "not an object", "wrong field", "not a string",
    "empty response", "corrupt gzip", "unknown kind of file", "text as pairs",
]  # fmt: skip


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_a_data_error_naming_the_file(tmp_path, case):
    source, options, message = _bad_cases(tmp_path)[case]
    out = tmp_path / "out"
    with pytest.raises(DataError, match=message):
        prepare(source, out, progress=False, workers=1, **options)  # type: ignore[arg-type]
    assert not out.exists() and not (tmp_path / ("." + out.name + TEMP_SUFFIX)).exists()


def test_a_wrong_parquet_column_is_refused_before_work(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    pa = pytest.importorskip("pyarrow")
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "a.parquet")
    with pytest.raises(DataError, match=r"a.parquet: no 'text' column \(it has \['body'\]\); .* --text-field"):
        prepare(tmp_path / "a.parquet", tmp_path / "out", progress=False)


@pytest.mark.parametrize("where", ["same", "inside"])
def test_the_output_may_not_be_in_the_source(tmp_path, where):
    source = _write_texts(tmp_path / "corpus", DOCUMENTS[:3])
    out = source if where == "same" else source / "prepared"
    with pytest.raises(DataError, match="write the prepared dataset to a folder outside the source"):
        prepare(source, out, progress=False)
    assert sorted(p.name for p in source.iterdir()) == [f"doc-{i:03d}.txt" for i in range(3)]


def test_cli_prepare_exit_codes(tmp_path):
    source = _write_texts(tmp_path / "corpus", DOCUMENTS[:3])
    cli = [sys.executable, "-m", "polyshard.cli.main", "prepare"]
    bad = subprocess.run([*cli, str(tmp_path / "nothere"), str(tmp_path / "out")], capture_output=True, text=True)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().count("\n") == 0 and "nothere: no such file or folder" in bad.stderr
    good = subprocess.run([*cli, str(source), str(tmp_path / "out"), "--quiet"], capture_output=True, text=True)
    assert good.returncode == 0, good.stderr
    assert "train: 3 documents" in good.stdout and (tmp_path / "out" / MANIFEST).is_file()
