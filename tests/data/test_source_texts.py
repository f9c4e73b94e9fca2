"""`source_texts`: a source's documents as text through prepare's own reader (what `polyshard tokenizer`
trains on), for every file kind prepare reads, with prepare's checks."""

from __future__ import annotations

import gzip
import json

import pytest

from polyshard.data.errors import DataError
from polyshard.data.sources import Fields
from polyshard.data.texts import source_texts


def test_a_folder_of_text_and_json_lines_gives_every_document_in_path_order(tmp_path):
    (tmp_path / "a.txt").write_text("the first file\nwhole\n")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "line one", "id": 1}) + "\n\n" + '{"text": ""}\n')
    (tmp_path / "c.jsonl.gz").write_bytes(gzip.compress(b'{"text": "zipped \\u00e9"}\n'))
    assert list(source_texts(tmp_path)) == ["the first file\nwhole\n", "line one", "zipped é"]  # "" skipped
    blocks = Fields(split_on="blank")
    (tmp_path / "a.txt").write_text("one block\n\n  \nanother\n")
    assert list(source_texts(tmp_path / "a.txt", blocks)) == ["one block", "another"]


def test_pairs_give_the_prompt_and_the_response(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"q": "who?", "a": "the king"}) + "\n" + json.dumps({"q": "where?", "a": "here"}))
    fields = Fields(kind="pairs", prompt_field="q", response_field="a")
    assert list(source_texts(path, fields)) == ["who?", "the king", "where?", "here"]


def test_prepare_s_checks_name_the_file_and_line(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "fine"}\n{"body": "no text field"}\n')
    with pytest.raises(DataError, match=r"c\.jsonl, line 2: no 'text' field .* with --text-field"):
        list(source_texts(path))
    with pytest.raises(DataError, match="no such file or folder"):
        source_texts(tmp_path / "missing.jsonl")  # checked when asked, before any text is read
