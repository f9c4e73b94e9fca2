"""`polyshard tokenizer` trains on whatever prepare reads (.txt, .jsonl, ...) and adds <|endoftext|>, the
token that ends each fine-tuning response in the pairs format."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from polyshard.cli.main import app
from polyshard.data.format import DOCS, TOKENS, read_manifest
from polyshard.data.prepare import prepare
from polyshard.data.tokenizer import load_tokenizer

pytest.importorskip("tokenizers")

WORDS = "the king and the queen went to the market to buy bread and wine for the feast".split()


def _lines(count: int) -> list[str]:
    return [" ".join(WORDS[i % 7 : i % 7 + 6]) + f" {i}" for i in range(count)]


def _train(*args: str):
    return CliRunner().invoke(app, ["tokenizer", *args])


def test_a_jsonl_source_trains_a_bpe_ending_in_the_end_of_text_token(tmp_path):
    source = tmp_path / "corpus.jsonl"
    source.write_text("".join(json.dumps({"body": line, "id": i}) + "\n" for i, line in enumerate(_lines(60))))
    result = _train(str(source), str(tmp_path / "tok.json"), "--vocab-size", "300", "--text-field", "body")
    assert result.exit_code == 0, result.output
    tokenizer = load_tokenizer(str(tmp_path / "tok.json"))
    assert tokenizer.vocab_size == 300 and tokenizer.end_of_text == 299  # the last id, as GPT-2's 50256
    assert f"wrote {tmp_path / 'tok.json'} (300 tokens, <|endoftext|> included)" in result.output
    assert tokenizer.decode([299]) == "<|endoftext|>"
    line = _lines(60)[5]
    assert tokenizer.decode(tokenizer.encode(line)) == line
    assert len(tokenizer.encode(line)) < len(line.encode()) / 2  # merges learned from the "body" field


def test_a_txt_source_still_trains(tmp_path):
    (tmp_path / "corpus.txt").write_text("\n".join(_lines(60)))
    assert _train(str(tmp_path / "corpus.txt"), str(tmp_path / "tok.json"), "--vocab-size", "280").exit_code == 0
    assert load_tokenizer(str(tmp_path / "tok.json")).end_of_text == 279


def test_pairs_prepared_with_it_end_each_response_with_the_token(tmp_path):
    pairs = tmp_path / "chat.jsonl"
    rows = [{"prompt": line, "response": line[::-1]} for line in _lines(30)]
    pairs.write_text("".join(json.dumps(row) + "\n" for row in rows))
    result = _train(str(pairs), str(tmp_path / "tok.json"), "--vocab-size", "300", "--kind", "pairs")
    assert result.exit_code == 0, result.output
    manifest = prepare(pairs, tmp_path / "data", str(tmp_path / "tok.json"), kind="pairs", workers=1, progress=False)
    assert manifest.tokenizer.end_of_text == 299
    ends = []
    for shard in manifest.splits["train"].shards:
        tokens = np.fromfile(tmp_path / "data" / (shard.name + TOKENS), manifest.np_dtype)
        starts = np.fromfile(tmp_path / "data" / (shard.name + DOCS), np.int64)
        ends += tokens[np.append(starts[1:], shard.tokens) - 1].tolist()  # each example's last token
    assert ends == [299] * manifest.splits["train"].documents and len(ends) >= 29
    assert read_manifest(tmp_path / "data").tokenizer.end_of_text == 299


@pytest.mark.parametrize(
    "args, message",
    [
        (["--text-field", "body"], "corpus.jsonl, line 1: no 'body' field (it has ['text']); name the fields"),
        (["--kind", "dialogue"], "kind='dialogue'; choose one of ['text', 'pairs', 'preferences']"),
        (["--vocab-size", "100"], "a BPE vocabulary needs more than the 256 byte tokens; got vocab_size=100"),
    ],
    ids=["field", "kind", "vocab"],
)
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, args, message):
    (tmp_path / "corpus.jsonl").write_text(json.dumps({"text": "the king"}) + "\n")
    result = _train(str(tmp_path / "corpus.jsonl"), str(tmp_path / "tok.json"), *args)
    assert result.exit_code == 2 and result.output.startswith("data error: ") and message in result.output
    assert "Traceback" not in result.output and not (tmp_path / "tok.json").exists()
