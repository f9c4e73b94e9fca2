"""DPO pairs and GRPO prompts in TRL's conversational form, rendered with a tokenizer folder's chat template:
the token ids against ``transformers``' ``apply_chat_template`` on the same folder, and the one-line
errors of a conversational row a folder cannot render."""

import json

import numpy as np
import pytest

from polyshard.data.chat import Chat
from polyshard.data.tokenizer import ByteTokenizer, load_tokenizer, train_bpe
from polyshard.trainer.data.preferences import read_pairs
from polyshard.trainer.data.prompts import read_prompts
from polyshard.trainer.errors import DataError

# A ChatML-like template that leans on what templates use: the special tokens, loops, a generation prompt.
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
CORPUS = ["the king and the queen said hello to the user and the assistant"] * 20


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tokenizer folder as ``transformers`` saves one: tokenizer.json, tokenizer_config.json, chat_template.jinja."""
    transformers = pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("chat")
    train_bpe(CORPUS, 300, root / "bpe.json")
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(root / "bpe.json"), eos_token="<|endoftext|>", bos_token="<|endoftext|>"
    )
    hf.chat_template = TEMPLATE
    hf.save_pretrained(root / "tok")
    return root / "tok"


def _hf(folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def _ids(hf, messages, **kwargs):
    out = hf.apply_chat_template(messages, tokenize=True, **kwargs)
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)


def _write(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


USER = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello king"}]


def test_conversational_pairs_are_the_templates_tokens(folder, tmp_path):
    hf, tokenizer = _hf(folder), load_tokenizer(str(folder))
    rows = [
        {"prompt": USER, "chosen": "the queen", "rejected": "the user said"},
        {"prompt": USER, "chosen": [{"role": "assistant", "content": "hello"}], "rejected": "and"},
    ]
    examples = read_pairs(_write(tmp_path / "p.jsonl", rows), tokenizer, 80, "data.source")
    got = examples.rows(np.arange(2))
    prompt = _ids(hf, USER, add_generation_prompt=True)
    for k, row in enumerate(rows):
        for side, name in enumerate(("chosen", "rejected")):
            response = row[name] if isinstance(row[name], list) else [{"role": "assistant", "content": row[name]}]
            whole = _ids(hf, USER + response)
            assert whole[: len(prompt)] == prompt  # this template renders the prompt alike alone and in the whole
            tokens, labels = got["tokens"][k, side], got["labels"][k, side]
            assert tokens[: len(whole)].tolist() == whole
            scored = labels[labels != -100].tolist()
            assert scored == whole[len(prompt) :]  # the assistant's turn, its end-of-turn tokens included
            assert scored[-2:] == hf.encode("<|endoftext|>\n", add_special_tokens=False)  # nothing appended after


def test_a_conversational_grpo_prompt_is_the_templates_generation_prompt(folder, tmp_path):
    hf, tokenizer = _hf(folder), load_tokenizer(str(folder))
    path = _write(tmp_path / "q.jsonl", [{"prompt": USER, "answer": "7"}, {"prompt": "plain text", "answer": "8"}])
    chat, plain = read_prompts(path, tokenizer, 200, 300, "data.source")
    assert chat.ids == _ids(hf, USER, add_generation_prompt=True)
    assert chat.text == hf.apply_chat_template(USER, tokenize=False, add_generation_prompt=True)
    assert chat.columns == {"answer": "7"} and plain.ids == tokenizer.encode("plain text")


def test_the_template_comes_from_the_tokenizer_config_too(folder, tmp_path):
    """Older folders keep the template in tokenizer_config.json; the tokens are the same."""
    old = tmp_path / "old"
    old.mkdir()
    (old / "tokenizer.json").write_bytes((folder / "tokenizer.json").read_bytes())
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (old / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    ours = Chat(load_tokenizer(str(old)))
    assert ours.template is not None and ours.template.source.name == "tokenizer_config.json"
    assert ours.prompt(USER, "here")[0] == _ids(_hf(folder), USER, add_generation_prompt=True)


def test_a_conversational_row_without_a_template_is_named(tmp_path):
    train_bpe(CORPUS, 300, tmp_path / "tokenizer.json")  # a folder with no chat template
    rows = [{"prompt": "q", "chosen": "a", "rejected": "b"}, {"prompt": USER, "chosen": "a", "rejected": "b"}]
    path = _write(tmp_path / "p.jsonl", rows)
    for tokenizer in (ByteTokenizer(), load_tokenizer(str(tmp_path))):
        with pytest.raises(DataError) as error:
            read_pairs(path, tokenizer, 32, "data.source")
        message = str(error.value)
        assert f"{path}, line 2: prompt is a list of messages" in message and "no chat template" in message
        assert "\n" not in message
    with pytest.raises(DataError, match=r"line 1: prompt is a list of messages.*no chat template"):
        read_prompts(_write(tmp_path / "q.jsonl", [{"prompt": USER}]), ByteTokenizer(), 32, 300, "data.source")


@pytest.mark.parametrize(
    ("prompt", "chosen", "named"),
    [
        ([{"role": "user", "content": 3}], "a", "prompt[0] must be"),
        ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "x"}], "a", "ends with a 'assistant'"),
        (USER, "", "chosen is empty"),
        (USER, [{"role": "assistant"}], "chosen[0] must be"),
    ],
)
def test_a_bad_conversational_row_is_named(folder, tmp_path, prompt, chosen, named):
    path = _write(tmp_path / "p.jsonl", [{"prompt": prompt, "chosen": chosen, "rejected": "b"}])
    with pytest.raises(DataError) as error:
        read_pairs(path, load_tokenizer(str(folder)), 32, "data.source")
    assert f"{path}, line 1: " in str(error.value) and named in str(error.value)
