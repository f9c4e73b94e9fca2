"""`prepare` treats its source, its output folder and its own leftovers as untrusted: every bad case is
one DataError naming the file (line, row) and the fix; nothing outside the named folders is read or
written; no folder the user had is lost, whatever moment a run is killed at; one document's memory is
bounded by a stated limit. (Issue 33: tracebacks, links followed, a 3.1 GB peak on one gzipped line.)"""

from __future__ import annotations

import errno
import gzip
import io
import json
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from polyshard.data import output
from polyshard.data import prepare as p
from polyshard.data.errors import DataError
from polyshard.data.format import MANIFEST, TOKENS, read_manifest
from polyshard.data.output import PROGRESS, TEMP_SUFFIX
from polyshard.data.prepare import prepare


def _prepare(source: Path, out: Path, **options: object):
    return prepare(source, out, progress=False, workers=1, val_fraction=0.0, **options)


def _no_temp(out: Path) -> bool:
    return not (out.parent / ("." + out.name + TEMP_SUFFIX)).exists()


# -- text that is not Unicode ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "kind"),
    [
        (r'{"text": "a\ud800b"}', "text"),  # a lone high surrogate
        (r'{"text": "\udc00"}', "text"),  # a lone low one
        (r'{"text": "ok \ud83d"}', "text"),  # half of a pair
        (r'{"prompt": "q", "response": "a\udfff"}', "pairs"),
    ],
)
def test_a_lone_surrogate_is_refused_naming_the_line(tmp_path, line, kind):
    source = tmp_path / "s.jsonl"
    source.write_text('{"text": "fine", "prompt": "p", "response": "r"}\n' + line + "\n")
    with pytest.raises(DataError, match=r"s\.jsonl, line 2: .* lone surrogate .* fix or drop that escape"):
        _prepare(source, tmp_path / "out", kind=kind)
    assert _no_temp(tmp_path / "out") and not (tmp_path / "out").exists()


def test_a_proper_surrogate_pair_is_text(tmp_path):
    (tmp_path / "s.jsonl").write_text(r'{"text": "emoji \ud83d\ude00"}' + "\n")
    _prepare(tmp_path / "s.jsonl", tmp_path / "out")
    tokens = np.fromfile(tmp_path / "out" / ("train-00000" + TOKENS), "<u2")
    assert bytes(tokens.tolist()) == "emoji 😀\n".encode()


# -- one document past the limit ---------------------------------------------------------------------

LIMIT = 64 << 10


def _gz(path: Path, pieces: list[bytes]) -> Path:
    with gzip.open(path, "wb") as f:
        for piece in pieces:
            f.write(piece)
    return path


def _huge_line(path: Path, mb: int) -> Path:
    return _gz(path, [b'{"text": "ok"}\n{"text": "', *[b"a" * (1 << 20)] * mb, b'"}\n'])


@pytest.mark.parametrize(
    ("name", "write", "options", "named"),
    [
        ("bomb.jsonl.gz", lambda p: _huge_line(p, 8), {}, r"bomb\.jsonl\.gz, line 2 is longer than"),
        ("one.txt", lambda p: p.write_bytes(b"x" * (LIMIT + 1)), {}, r"one\.txt \(one document: the whole file\)"),
        ("blocks.txt", lambda p: p.write_bytes(b"a\n\n" + b"y\n" * LIMIT), {"split_on": "blank", "chunk_bytes": 4096},
         r"blocks\.txt, the document starting at line 3 is longer"),
        ("pairs.jsonl", lambda p: p.write_bytes(b'{"prompt": "' + b"q" * LIMIT + b'", "response": "r"}\n'),
         {"kind": "pairs"}, r"pairs\.jsonl, line 1"),
    ],
)  # fmt: skip
def test_a_document_past_the_limit_is_refused_by_name(tmp_path, name, write, options, named):
    write(tmp_path / name)
    with pytest.raises(DataError, match=named + r".*the limit of one document.*--max-document-mb"):
        _prepare(tmp_path / name, tmp_path / "out", max_document_bytes=LIMIT, **options)
    assert _no_temp(tmp_path / "out")


def test_a_parquet_row_past_the_limit_is_refused_by_row(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["short", "z" * (LIMIT + 1)]}), tmp_path / "rows.parquet")
    with pytest.raises(DataError, match=r"rows\.parquet, row 1, 'text' is longer than"):
        _prepare(tmp_path / "rows.parquet", tmp_path / "out", max_document_bytes=LIMIT)


def test_memory_stays_bounded_on_a_gzip_bomb(tmp_path):
    """32 MB of one line in a 32 KB file: the read stops at the limit instead of holding the line."""
    source = _huge_line(tmp_path / "bomb.jsonl.gz", 32)
    assert source.stat().st_size < 1 << 20
    tracemalloc.start()
    with pytest.raises(DataError, match="longer than 1 MiB"):
        _prepare(source, tmp_path / "out", max_document_bytes=1 << 20, chunk_bytes=1 << 20)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 8 << 20, f"{peak / 2**20:.1f} MiB held for a 1 MiB limit"


def test_a_long_document_is_tokenized_in_pieces_to_the_same_tokens(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from polyshard.data.encode import PIECE, pieces
    from polyshard.data.tokenizer import FileTokenizer, train_bpe

    words = [f"w{i % 97}x" for i in range(60_000)]
    text = " ".join(words)  # about 300,000 characters on one line: several pieces
    assert len(pieces(text)) > 3 and all(len(piece) <= PIECE for piece in pieces(text))
    assert "".join(pieces(text)) == text and "".join(pieces("q" * (3 * PIECE + 5))) == "q" * (3 * PIECE + 5)
    tok = FileTokenizer(train_bpe([" ".join(words[:3000])], 400, tmp_path / "tokenizer.json"))
    assert tokenizers is not None
    (tmp_path / "doc.txt").write_text(text)
    _prepare(tmp_path / "doc.txt", tmp_path / "out", tokenizer=tok.path)
    tokens = np.fromfile(tmp_path / "out" / ("train-00000" + TOKENS), "<u2")
    # cut before a space: the same tokens; the document ends with the tokenizer's end-of-text (train_bpe makes one)
    assert tok.end_of_text is not None and tokens.tolist() == tok.encode(text) + [tok.end_of_text]


# -- compressed files cut short ----------------------------------------------------------------------


def _zst_frames(data: bytes, parts: int) -> bytes:
    zstandard = pytest.importorskip("zstandard")
    size = -(-len(data) // parts)
    return b"".join(zstandard.ZstdCompressor().compress(data[i : i + size]) for i in range(0, len(data), size))


LINES = b"".join(b'{"text": "document %d"}\n' % i for i in range(3000))


@pytest.mark.parametrize("cut", [1, 3, 100, 2000])
def test_a_zst_file_cut_inside_a_frame_is_refused(tmp_path, cut):
    data = _zst_frames(LINES, 2)
    (tmp_path / "cut.jsonl.zst").write_bytes(data[:-cut])
    with pytest.raises(DataError, match=r"cut\.jsonl\.zst: the file ends inside a zstd frame"):
        _prepare(tmp_path / "cut.jsonl.zst", tmp_path / "out")


def test_a_zst_file_of_whole_frames_is_read_whole(tmp_path):
    (tmp_path / "ok.jsonl.zst").write_bytes(_zst_frames(LINES, 3))
    manifest = _prepare(tmp_path / "ok.jsonl.zst", tmp_path / "out")
    assert manifest.documents == 3000


def test_a_gz_file_cut_short_is_refused(tmp_path):
    buffer = io.BytesIO()
    with gzip.GzipFile(fileobj=buffer, mode="wb") as f:
        f.write(LINES)
    (tmp_path / "cut.jsonl.gz").write_bytes(buffer.getvalue()[:-20])
    with pytest.raises(DataError, match=r"cut\.jsonl\.gz: cannot read or decompress it"):
        _prepare(tmp_path / "cut.jsonl.gz", tmp_path / "out")


# -- links out of the named folders --------------------------------------------------------------------


def test_a_link_out_of_a_source_folder_is_refused_and_one_inside_is_read(tmp_path):
    (tmp_path / "secret.txt").write_text("not yours")
    source = tmp_path / "corpus"
    (source / "sub").mkdir(parents=True)
    (source / "a.txt").write_text("inside")
    (source / "again.txt").symlink_to(source / "a.txt")  # inside the folder: fine
    assert _prepare(source, tmp_path / "ok").documents == 2
    (source / "sub" / "b.txt").symlink_to(tmp_path / "secret.txt")
    with pytest.raises(DataError, match=r"sub/b\.txt leads to .*secret\.txt, outside the source folder"):
        _prepare(source, tmp_path / "out")
    (source / "sub" / "b.txt").unlink()
    (source / "linked").symlink_to(tmp_path / "elsewhere", target_is_directory=True)  # a linked folder too
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "c.txt").write_text("not yours either")
    manifest = _prepare(source, tmp_path / "out")  # a linked folder is not walked into
    assert [Path(s.name).name for s in manifest.sources] == ["a.txt", "again.txt"]


def test_a_saved_dataset_whose_arrow_files_lie_outside_is_refused(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"text": ["a", "b"]}).save_to_disk(str(tmp_path / "saved"))
    arrow = next((tmp_path / "saved").glob("*.arrow"))
    moved = tmp_path / "outside.arrow"
    arrow.rename(moved)
    state = json.loads((tmp_path / "saved" / "state.json").read_text())
    state["_data_files"][0]["filename"] = "../outside.arrow"  # named by a path that leaves the folder
    (tmp_path / "saved" / "state.json").write_text(json.dumps(state))
    with pytest.raises(DataError, match=r"outside\.arrow, outside the saved dataset folder"):
        _prepare(tmp_path / "saved", tmp_path / "out")
    state["_data_files"][0]["filename"] = arrow.name
    (tmp_path / "saved" / "state.json").write_text(json.dumps(state))
    arrow.symlink_to(moved)  # or linked from inside it
    with pytest.raises(DataError, match="outside the saved dataset folder"):
        _prepare(tmp_path / "saved", tmp_path / "out")


def _interrupted(monkeypatch, source: Path, out: Path, after: int, **options: object) -> Path:
    """Run ``prepare`` until its ``after``-th progress record, then stop it as a kill would."""
    saved, save = [0], p._save_progress

    def save_then_stop(temp: Path, state: dict) -> None:
        save(temp, state)
        saved[0] += 1
        if saved[0] == after:
            raise KeyboardInterrupt

    monkeypatch.setattr(p, "_save_progress", save_then_stop)
    with pytest.raises(KeyboardInterrupt):
        _prepare(source, out, **options)
    monkeypatch.setattr(p, "_save_progress", save)
    return out.parent / ("." + out.name + TEMP_SUFFIX)


@pytest.fixture
def corpus(tmp_path) -> Path:
    folder = tmp_path / "corpus"
    folder.mkdir()
    for i in range(30):
        (folder / f"{i:02d}.txt").write_text(f"document {i} " * 20)
    return folder


def test_a_resumed_run_never_writes_through_a_link(tmp_path, monkeypatch, corpus):
    options = {"chunk_bytes": 300, "shard_tokens": 2000}
    temp = _interrupted(monkeypatch, corpus, tmp_path / "out", 3, **options)
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"keep me" * 100)
    shard = temp / ("train-00000" + TOKENS)
    assert shard.is_file()
    shard.unlink()
    shard.symlink_to(outside)
    with pytest.raises(DataError, match=r"it holds the link train-00000\.tokens\); move it away"):
        _prepare(corpus, tmp_path / "out", **options)
    assert outside.read_bytes() == b"keep me" * 100
    shard.unlink()  # and a link made between the check and the open is not followed either
    from polyshard.data.shards import Resume, SplitWriter

    (temp / ("train-00000" + TOKENS)).symlink_to(outside)
    with pytest.raises(Resume):
        SplitWriter(temp, "train", np.dtype("<u2"), False, 2000, {"closed": [], "open": ["train-00000", 0, 0]})
    assert outside.read_bytes() == b"keep me" * 100


@pytest.mark.parametrize("name", ["out", "temp", "old"])
def test_output_folders_that_are_links_are_refused(tmp_path, corpus, name):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    link = {"out": "out", "temp": ".out" + TEMP_SUFFIX, "old": ".out.old"}[name]
    (tmp_path / link).symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(DataError, match="is a link; give a real folder"):
        _prepare(corpus, tmp_path / "out")
    assert list(elsewhere.iterdir()) == []


# -- kills while the output is replaced ----------------------------------------------------------------


def test_a_kill_between_the_renames_loses_nothing(tmp_path, monkeypatch, corpus):
    out = tmp_path / "out"
    _prepare(corpus, out)
    before = {f.name: f.read_bytes() for f in out.iterdir()}
    rename = Path.rename

    def killed_after_moving_aside(self: Path, target: Path) -> Path:
        if self.name.endswith(TEMP_SUFFIX):
            raise KeyboardInterrupt  # the old output is aside, the new one not yet in place
        return rename(self, target)

    monkeypatch.setattr(Path, "rename", killed_after_moving_aside)
    with pytest.raises(KeyboardInterrupt):
        _prepare(corpus, out, overwrite=True, seed=1)
    monkeypatch.setattr(Path, "rename", rename)
    assert not out.exists() and (tmp_path / ".out.old" / MANIFEST).is_file()  # restorable, whole
    output.recover(out)  # what the next prepare into out does first
    assert {f.name: f.read_bytes() for f in out.iterdir()} == before and not (tmp_path / ".out.old").exists()


def test_a_kill_while_the_replaced_output_is_deleted_is_finished_by_the_next_run(tmp_path, corpus):
    out = tmp_path / "out"
    _prepare(corpus, out)
    old = tmp_path / ".out.old"
    _prepare(corpus, tmp_path / "other")
    (tmp_path / "other").rename(old)
    (old / MANIFEST).unlink()  # the deletion had begun
    _prepare(corpus, out, overwrite=True)
    assert not old.exists() and read_manifest(out).documents == 30


def test_a_folder_named_like_the_old_one_that_is_not_ours_is_kept(tmp_path, corpus):
    out = tmp_path / "out"
    _prepare(corpus, out)
    (tmp_path / ".out.old").mkdir()
    (tmp_path / ".out.old" / "notes.md").write_text("mine")
    with pytest.raises(DataError, match=r"\.out\.old is in the way .* move it away"):
        _prepare(corpus, out, overwrite=True)
    assert (tmp_path / ".out.old" / "notes.md").read_text() == "mine"


# -- disks that refuse the write -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "fix"),
    [
        (errno.ENOSPC, r"the disk is full\); free space"),
        (errno.EROFS, r"refused\); choose an output folder you can write"),
        (errno.EIO, r"refused\); check"),
    ],
)
def test_a_failed_write_is_one_line_and_the_run_can_resume(tmp_path, monkeypatch, corpus, code, fix):
    from polyshard.data.shards import ShardWriter

    def fail(self, encoded):
        raise OSError(code, "refused", str(tmp_path / ".out.prepare-tmp" / "train-00000.tokens"))

    monkeypatch.setattr(ShardWriter, "add", fail)
    with pytest.raises(DataError, match=rf"cannot write .*train-00000\.tokens \({fix}"):
        _prepare(corpus, tmp_path / "out")


def test_an_output_parent_that_cannot_be_written_is_refused_before_work(tmp_path, monkeypatch, corpus):
    monkeypatch.setattr(output.os, "access", lambda path, mode: False)  # as for a user without write permission
    with pytest.raises(DataError, match="cannot write in .* choose an output folder you can write"):
        _prepare(corpus, tmp_path / "out")


# -- JSON nested past the parser ---------------------------------------------------------------------

DEEP = "[" * 200_000 + "]" * 200_000


def test_deep_json_in_a_source_line_is_refused_naming_the_line(tmp_path):
    (tmp_path / "deep.jsonl").write_text('{"text": "a"}\n' + DEEP + "\n")
    with pytest.raises(DataError, match=r"deep\.jsonl, line 2: JSON nested too deeply"):
        _prepare(tmp_path / "deep.jsonl", tmp_path / "out")


def test_deep_json_where_a_manifest_or_progress_belongs(tmp_path, monkeypatch, corpus):
    (tmp_path / "fake").mkdir()
    (tmp_path / "fake" / MANIFEST).write_text(DEEP)
    with pytest.raises(DataError, match=r"manifest\.json is JSON nested too deeply"):
        read_manifest(tmp_path / "fake")
    with pytest.raises(DataError, match="is a folder that is not a prepared dataset"):
        _prepare(corpus, tmp_path / "fake")
    temp = _interrupted(monkeypatch, corpus, tmp_path / "out", 1, chunk_bytes=300)
    (temp / PROGRESS).write_text(DEEP)  # an unreadable record: start over
    assert _prepare(corpus, tmp_path / "out", chunk_bytes=300).documents == 30


def test_a_short_write_on_a_full_disk_says_so(tmp_path, monkeypatch, corpus):
    """numpy's tofile reports a short write with no errno ("N requested and M written")."""
    from polyshard.data.shards import ShardWriter

    def short(self, encoded):
        raise OSError("120060 requested and 51200 written")

    monkeypatch.setattr(ShardWriter, "add", short)
    monkeypatch.setattr(output, "_nearly_full", lambda folder: True)
    with pytest.raises(DataError, match=r"cannot write .*out \(the disk is full\); free space .* it resumes"):
        _prepare(corpus, tmp_path / "out")
