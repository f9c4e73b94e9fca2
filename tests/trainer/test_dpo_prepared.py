"""DPO pairs prepared once (``polyshard prepare --kind preferences``) read as their ``.jsonl`` reads: every
training and validation row (tokens, labels), and the loader's shuffled batches, for text, token-id and
conversational rows (a tokenizer folder's chat template) with prompts cut to fit; the same folder from one
worker or two and from an interrupted prepare; the held-out split the manifest records; and the one-line
errors of a folder of the wrong kind on either side."""

import json
import random

import numpy as np
import pytest

from polyshard.data.errors import DataError as PrepareError
from polyshard.data.format import held_out, read_manifest
from polyshard.data.loader import ShardedLoader
from polyshard.data.preference_rows import CHOSEN, PROMPT, REJECTED
from polyshard.data.prepare import prepare
from polyshard.data.tokenizer import load_tokenizer, train_bpe
from polyshard.trainer.config import from_dict
from polyshard.trainer.data import language_data
from polyshard.trainer.data.preferences import preference_data, read_pairs
from polyshard.trainer.errors import DataError
from polyshard.trainer.tasks import task_for

pytest.importorskip("jinja2")

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
WORDS = "the king queen lord love death night day sweet fair user assistant".split()
OPTIONS = {"progress": False, "workers": 1, "chunk_bytes": 400, "shard_tokens": 300}


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory):
    """A tokenizer folder with a chat template, as transformers saves one (no transformers needed)."""
    root = tmp_path_factory.mktemp("tok")
    train_bpe([" ".join(WORDS)] * 20, 300, root / "tokenizer.json")
    special = {"eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>"}
    (root / "tokenizer_config.json").write_text(json.dumps(special))
    (root / "chat_template.jinja").write_text(TEMPLATE)
    return root


def _rows(count, seed=0):
    """Text, token-id and conversational pairs in turn; some prompts far longer than the context."""
    rng = random.Random(seed)
    words = lambda low, high: " ".join(rng.choices(WORDS, k=rng.randint(low, high)))  # noqa: E731
    rows = []
    for k in range(count):
        prompt = words(1, 12 if k % 4 == 0 else 3)
        if k % 3 == 0:
            rows.append({"prompt": prompt, "chosen": words(1, 3), "rejected": words(1, 4)})
        elif k % 3 == 1:
            ids = lambda low, high: [rng.randrange(300) for _ in range(rng.randint(low, high))]  # noqa: E731
            rows.append({"prompt_ids": ids(1, 20), "chosen_ids": ids(1, 5), "rejected_ids": ids(1, 5)})
        else:
            messages = [{"role": "user", "content": prompt}]
            rejected = [{"role": "assistant", "content": "no"}]  # a response given as messages
            rows.append({"prompt": messages, "chosen": words(1, 2), "rejected": rejected})
    return rows


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    path = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" + ("\n" if k == 5 else "") for k, row in enumerate(_rows(40))))
    return path


def _config(source, tokenizer_folder, task="dpo", **data):
    return from_dict(
        {
            "model": {
                "kind": "gpt",
                "hidden": 32,
                "num_layers": 1,
                "num_heads": 4,
                "context_length": 16,
                "vocab_size": 320,
            },  # fmt: skip
            "training": {
                "steps": 2,
                "global_batch_size": 4,
                **({"task": task} if task else {}),
            },  # fmt: skip
            "eval": {
                "every": 0,
                "sample_tokens": 0,
            },
            "data": {"source": str(source), "tokenizer": str(tokenizer_folder), "val_fraction": 0.1, **data},
        }
    )


def _all(examples):
    return examples.rows(np.arange(len(examples)))


def _same(a, b):
    assert a.keys() == b.keys() == {"tokens", "labels", "pair"}
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def test_a_prepared_folder_gives_the_batches_of_its_jsonl(tmp_path, pairs, tokenizer_folder):
    out = tmp_path / "prepared"
    manifest = prepare(pairs, out, tokenizer_folder, kind="preferences", val_fraction=0.0, **OPTIONS)
    assert manifest.kind == "preferences" and manifest.documents == 40 and len(manifest.splits["train"].shards) > 1
    from_jsonl = preference_data(_config(pairs, tokenizer_folder))
    from_folder = preference_data(_config(out, tokenizer_folder))
    # no held-out split in the folder: both keep the last val_fraction of the pairs for validation
    sizes = [(len(data.train[0]), len(data.val)) for data in (from_jsonl, from_folder)]
    assert sizes == [(36, 4), (36, 4)]
    _same(_all(from_folder.train[0]), _all(from_jsonl.train[0]))
    _same(_all(from_folder.val), _all(from_jsonl.val))
    rows = _all(from_jsonl.train[0])
    assert (rows["tokens"][:, :, 0] != rows["tokens"][:, :, -1]).any() and (rows["labels"] != -100).any()
    loaders = [
        ShardedLoader(data.train[0], batch_size=2, rank=1, world_size=2, seed=3, shuffle=True)
        for data in (from_jsonl, from_folder)
    ]
    for _ in range(12):  # past an epoch: the shuffled order and its second epoch
        _same(loaders[0].next_batch(), loaders[1].next_batch())


def test_the_mask_bytes_say_each_tokens_part(tmp_path, tokenizer_folder):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt_ids": [5, 6, 7], "chosen_ids": [8], "rejected_ids": [9, 10]}) + "\n")
    prepare(path, tmp_path / "out", tokenizer_folder, kind="preferences", val_fraction=0.0, **OPTIONS)
    assert np.fromfile(tmp_path / "out" / "train-00000.tokens", np.uint16).tolist() == [5, 6, 7, 8, 9, 10]
    mask = np.fromfile(tmp_path / "out" / "train-00000.mask", np.uint8).tolist()
    assert mask == [PROMPT] * 3 + [CHOSEN] + [REJECTED] * 2


def test_the_held_out_split_is_the_one_the_manifest_records(tmp_path, pairs, tokenizer_folder):
    out = tmp_path / "prepared"
    prepare(pairs, out, tokenizer_folder, kind="preferences", val_fraction=0.25, seed=7, **OPTIONS)
    data = preference_data(_config(out, tokenizer_folder))
    held = held_out(7, np.arange(40), 0.25)
    assert read_manifest(out).splits["val"].documents == held.sum() == len(data.val) > 0
    every = _all(read_pairs(pairs, load_tokenizer(str(tokenizer_folder)), 17, "data.source"))
    for examples, chosen in ((data.train[0], ~held), (data.val, held)):
        got = _all(examples)
        np.testing.assert_array_equal(got["tokens"], every["tokens"][chosen])
        np.testing.assert_array_equal(got["labels"], every["labels"][chosen])
        np.testing.assert_array_equal(got["pair"], np.arange(chosen.sum()))


def test_two_workers_and_an_interrupted_prepare_write_the_same_folder(tmp_path, pairs, tokenizer_folder, monkeypatch):
    options = {**OPTIONS, "val_fraction": 0.2}
    prepare(pairs, tmp_path / "one", tokenizer_folder, kind="preferences", **options)
    prepare(pairs, tmp_path / "two", tokenizer_folder, kind="preferences", **{**options, "workers": 2})
    from polyshard.data import prepare as module

    saved, save = [], module._save_progress

    def save_then_stop(temp, state):
        save(temp, state)
        saved.append(state)
        if len(saved) == 2:
            raise KeyboardInterrupt  # Ctrl-C after two chunks: their shards and record stay in the temporary folder

    monkeypatch.setattr(module, "_save_progress", save_then_stop)
    with pytest.raises(KeyboardInterrupt):
        prepare(pairs, tmp_path / "resumed", tokenizer_folder, kind="preferences", **options)
    monkeypatch.setattr(module, "_save_progress", save)
    notes = []
    prepare(pairs, tmp_path / "resumed", tokenizer_folder, kind="preferences", note=notes.append, **options)
    assert len(notes) == 1 and notes[0].startswith("resuming an interrupted prepare")
    files = [{p.name: p.read_bytes() for p in (tmp_path / name).iterdir()} for name in ("one", "two", "resumed")]
    assert files[0] == files[1] == files[2] and len(files[0]) > 4


def test_a_folder_of_the_wrong_kind_is_refused_in_one_line(tmp_path, pairs, tokenizer_folder):
    text = tmp_path / "text.jsonl"
    text.write_text("".join(json.dumps({"text": " ".join(WORDS)}) + "\n" for _ in range(30)))
    prepare(text, tmp_path / "text", tokenizer_folder, kind="text", **OPTIONS)
    prepare(pairs, tmp_path / "prefs", tokenizer_folder, kind="preferences", **OPTIONS)
    with pytest.raises(DataError) as dpo_on_text:
        preference_data(_config(tmp_path / "text", tokenizer_folder))
    with pytest.raises(DataError) as language_on_pairs:
        language_data(_config(tmp_path / "prefs", tokenizer_folder, task=None))
    with pytest.raises(DataError) as val_of_text:
        preference_data(_config(pairs, tokenizer_folder, val_source=str(tmp_path / "text")))
    for error, folder, kind in (
        (dpo_on_text, "text", "'text'"),
        (language_on_pairs, "prefs", "'preferences'"),
        (val_of_text, "text", "'text'"),
    ):
        message = str(error.value)
        assert str(tmp_path / folder) in message and f"of kind {kind}" in message and "\n" not in message
    task_for(_config(tmp_path / "prefs", tokenizer_folder)).check_config(_config(tmp_path / "prefs", tokenizer_folder))


def test_bad_preference_lines_are_named(tmp_path, tokenizer_folder):
    path = tmp_path / "bad.jsonl"
    path.write_text(
        json.dumps({"prompt": "a", "chosen": "b", "rejected": "c"}) + "\n"
        + json.dumps({"prompt_ids": [1, 2], "chosen_ids": [3], "rejected_ids": [400]}) + "\n"
    )  # fmt: skip
    with pytest.raises(PrepareError, match=r"bad\.jsonl, line 2: token id 400 is past the tokenizer's vocab_size=300"):
        prepare(path, tmp_path / "out", tokenizer_folder, kind="preferences", **OPTIONS)
    path.write_text(json.dumps({"prompt": "a", "chosen": "", "rejected": "c"}) + "\n")
    with pytest.raises(PrepareError, match=r"bad\.jsonl, line 1: chosen is empty"):
        prepare(path, tmp_path / "out", tokenizer_folder, kind="preferences", **OPTIONS)
    (tmp_path / "t.txt").write_text("plain text")
    with pytest.raises(PrepareError, match=r"t\.txt: preference pairs are read from \.jsonl files"):
        prepare(tmp_path / "t.txt", tmp_path / "out", tokenizer_folder, kind="preferences", **OPTIONS)
