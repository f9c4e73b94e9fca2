"""Fine-tuning data: JSON-lines prompt/response pairs, loss masks and the global token-mean loss.

Data is generated here (no download). The parity runs train the small GPT on
pairs whose responses have different lengths, so microbatches and data ranks
hold different numbers of counted tokens: only the global token-mean rule
(:mod:`polyshard.trainer.tasks.loss`) makes one process and every layout agree.
"""

import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from polyshard.mesh import Mesh
from polyshard.trainer.config import from_dict
from polyshard.trainer.data import check_language_data, language_data
from polyshard.trainer.errors import DataError
from polyshard.trainer.tasks.loss import IGNORE_INDEX, tokens_per_microbatch
from tests._layouts import LAYOUTS

ROOT = Path(__file__).resolve().parents[2]
WORDS = "the king queen lord love death night day sweet fair heaven earth sword crown blood".split()
STEPS = 4


def write_pairs(path: Path, count: int, prompt: str = "prompt", response: str = "response", seed: int = 0) -> str:
    """``count`` lines of short prompts and responses of 1 to 6 words (so row counts of counted tokens differ)."""
    rng = random.Random(seed)
    lines = []
    for _ in range(count):
        question = " ".join(rng.choices(WORDS, k=rng.randint(1, 2))) + "?"
        answer = " ".join(rng.choices(WORDS, k=rng.randint(1, 6))) + "\n"
        lines.append(json.dumps({prompt: question, response: answer}))
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _bytes(text: str) -> list[int]:
    return list(text.encode())


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("POLYSHARD_CACHE", str(tmp_path / "cache"))


def _data_config(context_length=32, global_batch=8, vocab_size=256, **data):
    model = {"context_length": context_length, "vocab_size": vocab_size}
    return from_dict({"model": model, "data": data, "training": {"global_batch_size": global_batch}})


def pair_rows(context_length, **data):
    """(training rows, validation rows) in order, as the run reads them."""
    run = language_data(_data_config(context_length, **data))
    return (examples.rows(np.arange(len(examples))) for examples in (run.train[0], run.val))


def check_pairs_source(context_length=32, global_batch=8, vocab_size=256, **data):
    check_language_data(_data_config(context_length, global_batch, vocab_size, **data))


# -- rows ----------------------------------------------------------------------


def test_padded_rows_count_only_response_tokens(tmp_path):
    lines = [
        {"document": "ab", "summary": "xyz"},
        {"document": "ab", "summary": "uvwxyz"},
        {"document": "q", "summary": "r"},
    ]
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")  # a trailing blank line is fine
    # val_fraction=0.01 holds out no whole example of three: the last one validates, as the tail rule says
    train, val = pair_rows(5, source=str(path), prompt_field="document", response_field="summary", val_fraction=0.01)
    ignore = IGNORE_INDEX
    # Bytes have no end-of-text token: rows are padded with 0, which is never a target.
    assert train["tokens"].tolist() == [_bytes("abxyz") + [0], _bytes("abuvwx")]  # the long response is cut
    assert train["labels"].tolist() == [[ignore, ignore, *_bytes("xyz"), ignore], [ignore, ignore, *_bytes("uvwx")]]
    assert val["labels"].tolist() == [[ignore, *_bytes("r"), ignore, ignore, ignore, ignore]]


def test_packed_rows_join_examples_and_cut_like_text(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(
        "\n".join(json.dumps({"prompt": p, "response": r}) for p, r in [("ab", "cd"), ("e", "fgh"), ("i", "j")])
    )
    train, val = pair_rows(3, source=str(path), packing=True, val_fraction=0.01)
    # "abcd" "efgh" "ij": two whole windows, the last of which validates (no whole example was held out)
    assert train["tokens"].tolist() == [_bytes("abcd")] and val["tokens"].tolist() == [_bytes("efgh")]
    assert train["labels"].tolist() == [[IGNORE_INDEX, IGNORE_INDEX, *_bytes("cd")]]
    assert val["labels"].tolist() == [[IGNORE_INDEX, *_bytes("fgh")]]


def test_a_tokenizer_with_an_end_of_text_token_ends_each_response_and_pads(tmp_path):
    import tokenizers

    from polyshard.data.tokenizer import train_bpe

    bpe = train_bpe(["the king and the queen"] * 20, 300, tmp_path / "tok.json")
    inner = tokenizers.Tokenizer.from_file(str(bpe))
    inner.add_special_tokens(["<|endoftext|>"])
    inner.save(str(bpe))
    end = inner.token_to_id("<|endoftext|>")
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "the king", "response": " and"}\n{"prompt": "the", "response": " queen"}\n')
    train, _ = pair_rows(8, source=str(path), tokenizer=str(bpe), val_fraction=0.01, vocab_size=301)
    prompt, response = inner.encode("the king").ids, inner.encode(" and").ids
    row = prompt + response + [end]
    assert train["tokens"][0].tolist() == row + [end] * (9 - len(row))  # padded with the end-of-text id
    assert train["labels"][0].tolist() == [IGNORE_INDEX] * len(prompt) + response + [end] + [IGNORE_INDEX] * (
        9 - len(row)
    )


# -- validation ----------------------------------------------------------------

GOOD = '{"prompt": "the king?", "response": "the queen"}'
BAD_LINES = [
    pytest.param('{"prompt": "the king?", ', "line 2: not JSON", id="not-json"),
    pytest.param('["the king?", "the queen"]', "line 2: a JSON list, not an object", id="not-an-object"),
    pytest.param('{"prompt": "the king?"}', "line 2: no 'response' field", id="missing-field"),
    pytest.param('{"prompt": 3, "response": "x"}', "line 2: 'prompt' is a JSON int, not a string", id="not-a-string"),
    pytest.param('{"prompt": "the king?", "response": ""}', "line 2: 'response' is empty", id="empty-response"),
    pytest.param('{"prompt": "", "response": "x"}', "line 2: 'prompt' is empty", id="empty-prompt"),
    pytest.param(
        json.dumps({"prompt": "x" * 40, "response": "y"}),
        r"line 2: the prompt is 40 tokens, leaving no room for a response .*at most 32 prompt tokens fit",
        id="prompt-too-long",
    ),
]


@pytest.mark.parametrize("bad, message", BAD_LINES)
def test_a_bad_line_is_a_data_error_naming_file_and_line(tmp_path, bad, message):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join([GOOD, bad] + [GOOD] * 30) + "\n")
    with pytest.raises(DataError, match=f"d.jsonl, {message}"):
        check_pairs_source(source=str(path))


def test_the_fields_the_file_uses_are_named_in_the_error(tmp_path):
    path = Path(write_pairs(tmp_path / "d.jsonl", 100, prompt="document", response="summary"))
    with pytest.raises(DataError, match=r"line 1: no 'prompt' field \(it has \['document', 'summary'\]\); .*"):
        check_pairs_source(source=str(path))
    check_pairs_source(source=str(path), prompt_field="document", response_field="summary")


@pytest.mark.parametrize(
    "count, packing, message",
    [
        pytest.param(6, False, "gives [0-6] training examples .*, fewer than one global batch of 8", id="padded"),
        pytest.param(8, True, "gives [0-7] training examples .*, fewer than one global batch of 8", id="packed"),
        pytest.param(1, False, "holds 1 examples: too few for a training and a validation split", id="one"),
    ],
)
def test_too_few_examples_for_a_global_batch(tmp_path, count, packing, message):
    path = write_pairs(tmp_path / "d.jsonl", count)
    with pytest.raises(DataError, match=message):
        check_pairs_source(source=path, packing=packing)


def test_missing_file_non_utf8_and_vocabulary_errors(tmp_path):
    with pytest.raises(DataError, match=r"no such file; give a .jsonl file with one \{\"prompt\""):
        check_pairs_source(source=str(tmp_path / "none.jsonl"))
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(GOOD.encode() + b'\n{"prompt": "caf\xe9", "response": "x"}\n')
    with pytest.raises(DataError, match="latin1.jsonl, line 2: not UTF-8 text"):
        check_pairs_source(source=str(path))
    words = write_pairs(tmp_path / "d.jsonl", 100)
    with pytest.raises(DataError, match=r"holds byte 121, past model.vocab_size=100; use vocab_size >= 122"):
        check_pairs_source(source=words, vocab_size=100)  # 'y' is byte 121


@pytest.mark.long
def test_the_cli_stops_a_bad_file_before_any_process_starts(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join([GOOD, '{"prompt": "the king?"}'] + [GOOD] * 30) + "\n")
    config = tmp_path / "ft.toml"
    config.write_text(f'[model]\npreset = "tiny"\n[data]\nsource = "{path}"\n')
    cmd = [sys.executable, "-m", "polyshard.cli.main", "train", str(config), "--out", str(tmp_path / "run")]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert f"data error: {path}, line 2: no 'response' field" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "run").exists()


# -- the loss ------------------------------------------------------------------


def _logits_and_targets(vocab=11):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, vocab, generator=g) * 2  # (B, S, V)
    targets = torch.randint(0, vocab, (3, 5), generator=g)
    targets[0, :3] = targets[1, :1] = targets[2, 4] = IGNORE_INDEX  # prompt and padding positions
    return logits, targets


def _by_hand(logits, targets):
    """Mean of -log p(target) over the counted positions only."""
    counted = [
        (b, s) for b in range(targets.shape[0]) for s in range(targets.shape[1]) if targets[b, s] != IGNORE_INDEX
    ]
    return sum(-torch.log_softmax(logits[b, s].double(), -1)[targets[b, s]] for b, s in counted) / len(counted)


def _masked_loss(tp):
    from polyshard.trainer.engine.builder import loss_function

    config = from_dict({"model": {"vocab_size": 11, "num_heads": 2}, "parallel": {"tp": tp}})
    mesh = Mesh({"tp": tp})
    full, targets = _logits_and_targets()
    if tp == 1:
        logits = full.clone().requires_grad_()
    else:  # this rank's columns of the vocabulary padded to 12 (a padding column that must get no mass)
        padded, width = torch.cat([full, torch.full((3, 5, 1), 50.0)], dim=-1), 12 // tp
        logits = padded[..., mesh.coord("tp") * width : (mesh.coord("tp") + 1) * width].clone().requires_grad_()
    loss = loss_function(config, mesh)(logits, targets)  # outside a step: this batch's mean over counted tokens
    loss.backward()
    return loss.item(), _by_hand(full, targets).item(), logits.grad, targets


@pytest.mark.parametrize("tp", [1, 2])
def test_masked_tokens_add_nothing_to_the_loss_or_its_gradient(distributed, tp):
    for loss, by_hand, grad, targets in distributed.run(tp, _masked_loss, tp):
        # float32 log-softmax against a float64 hand computation (and a 2-way sum under tp): ~1e-7 relative.
        assert loss == pytest.approx(by_hand, rel=1e-6)
        assert torch.equal(grad[targets == IGNORE_INDEX], torch.zeros_like(grad[targets == IGNORE_INDEX]))
        assert grad[targets != IGNORE_INDEX].abs().sum() > 0


def _global_mean_over_data_ranks():
    """2 data ranks x 2 microbatches of one row, holding 1, 5 | 3, 0 counted tokens."""
    from polyshard.trainer.tasks.loss import TokenMeanLoss

    group = Mesh({"dp": 2}).group("dp")
    g = torch.Generator().manual_seed(1)
    logits, targets = torch.randn(4, 5, 11, generator=g), torch.randint(0, 11, (4, 5), generator=g)
    targets[0, 1:] = targets[2, :2] = targets[3] = IGNORE_INDEX
    mine = slice(2 * dist.get_rank(group), 2 * dist.get_rank(group) + 2)
    loss_fn = TokenMeanLoss(lambda x, t: F.cross_entropy(x.flatten(0, 1), t.flatten(), reduction="sum"))
    count = tokens_per_microbatch(targets[mine], group, num_microbatches=2)
    # what the pipeline executor and dp do: each microbatch's loss / m, summed, then averaged over data ranks
    rank_loss = sum(loss_fn(x, t, count) / 2 for x, t in zip(logits[mine].chunk(2), targets[mine].chunk(2)))
    total = rank_loss.detach().reshape(1)
    dist.all_reduce(total, group=group)
    return float(total) / 2, _by_hand(logits, targets).item(), count


def test_the_step_loss_is_the_mean_over_counted_tokens_of_the_global_batch(distributed):
    for loss, by_hand, count in distributed.run(2, _global_mean_over_data_ranks):
        assert loss == pytest.approx(by_hand, rel=1e-6)  # float32 sums vs a float64 hand computation
        assert count == 9 / (2 * 2)  # 1 + 5 + 3 + 0 counted tokens over 2 data ranks x 2 microbatches


# -- training: every layout agrees with one process ------------------------------------------------


def _config(path, packing=False, **parallel):
    return from_dict(
        {
            "model": {"hidden": 32, "num_layers": 2, "num_heads": 4, "context_length": 32},
            "parallel": parallel,
            # weight_decay 0.1 (the default) acts on the matrices in every AdamW step
            "training": {
                "steps": STEPS,
                "global_batch_size": 8,
            },
            "optimizer": {
                "lr": 3e-3,
            },
            "lr_schedule": {
                "warmup_steps": 2,
            },
            "eval": {
                "every": STEPS,
                "sample_tokens": 0,
            },
            "data": {"source": path, "packing": packing, "val_fraction": 0.2},
            "logging": {"progress_bar": False},
        }
    )


def _train(config, out):
    """(losses + gradient norms + validation loss, the consolidated parameters on rank 0) after STEPS steps."""
    from polyshard.checkpoint import latest_checkpoint
    from polyshard.trainer.checkpointing.run_export import consolidate
    from polyshard.trainer.loop import train

    result = train(config, Mesh(config.parallel.mesh_axes), out, log=False)
    state = consolidate(latest_checkpoint(out / "checkpoints")) if dist.get_rank() == 0 else None
    return result.losses + result.grad_norms + [result.val_loss], state


def _first_step_by_hand(config):
    """The first global batch's (loss, gradient norm) from the unsharded model, under the global
    token mean and, for contrast, as the mean of two microbatches' own means."""
    from polyshard.models import build_model
    from polyshard.trainer.loop import make_loaders, split_batch

    train_data, _ = make_loaders(config, Mesh(config.parallel.mesh_axes))
    inputs, targets = split_batch(config, train_data.next_batch())
    model = build_model(config.model, seed=config.training.seed)
    results = []
    for halves in (False, True):
        logits = model(inputs)
        losses = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view(targets.shape)
        counted = targets != IGNORE_INDEX
        if halves:
            loss = sum(losses[h][counted[h]].mean() for h in (slice(0, 4), slice(4, 8))) / 2
        else:
            loss = losses[counted].sum() / counted.sum()
        model.zero_grad()
        loss.backward()
        results.append((loss.item(), torch.cat([p.grad.flatten() for p in model.parameters()]).norm().item()))
    return results


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory):
    return write_pairs(tmp_path_factory.mktemp("pairs") / "qa.jsonl", 120)


@pytest.fixture(scope="module")
def reference(distributed, pairs_file, tmp_path_factory):
    return {
        packing: distributed.run(1, _train, _config(pairs_file, packing), tmp_path_factory.mktemp(f"ref{packing}"))[0]
        for packing in (False, True)
    }


def test_the_first_step_is_the_mean_over_response_tokens(distributed, pairs_file, reference):
    (loss, norm), (_, norm_of_means) = distributed.run(1, _first_step_by_hand, _config(pairs_file))[0]
    numbers, _ = reference[False]
    # The same float32 model and weights, summed in another order: ~1e-7 relative.
    assert numbers[0] == pytest.approx(loss, rel=1e-6)
    assert numbers[STEPS] == pytest.approx(norm, rel=1e-5)  # the gradient norm before clipping
    # The two halves (microbatches of the mb2 layout below) hold different numbers of response tokens:
    # averaging their means would weigh tokens differently and give another gradient, one that differs by
    # far more than the 1e-5 the same sum varies by in another order (how much more depends on the batch).
    assert abs(norm_of_means - norm) > 1e-4 * norm


# (layout, packed rows, settings beside the layout's)
ROWS = [
    pytest.param("one-process", False, {"microbatches": 2}, id="mb2"),
    pytest.param("dp2", False, {}, id="dp2"),
    pytest.param("tp2", False, {}, id="tp2"),
    pytest.param("pp2-1f1b", False, {}, id="pp2-mb2"),
    pytest.param("dp2", True, {}, id="dp2-packed"),
]


@pytest.mark.parametrize("name, packing, extra", ROWS)
def test_fine_tuning_matches_one_process(distributed, pairs_file, reference, tmp_path, name, packing, extra):
    world, parallel = LAYOUTS[name]
    parallel = {**parallel, **extra}
    results = distributed.run(world, _train, _config(pairs_file, packing, **parallel), tmp_path)
    numbers, state = results[0]
    want_numbers, want_state = reference[packing]
    assert all(r[0] == numbers for r in results)  # every rank reports the same losses
    # Layouts differ from one process only in the order float32 sums are taken (all-reduces, the
    # vocab-parallel softmax, microbatch accumulation): ~1e-7 relative per step, compounded over a
    # few AdamW steps. A mean of microbatch means instead puts the gradient norms ~1e-2 off.
    assert numbers == pytest.approx(want_numbers, rel=2e-5)
    assert numbers[STEPS - 1] < numbers[0]  # it learns
    assert state.keys() == want_state.keys()
    for name, tensor in state.items():
        # AdamW's update m / (sqrt(v) + eps) carries the ~1e-7 relative gradient differences over, except
        # for an element whose gradient is only rounding noise (the key bias: softmax ignores a shift of
        # every key, so its true gradient is 0), which moves by noise / (|noise| + eps): ~1e-6 after
        # STEPS steps. A wrong weighting of tokens moves updates by a good fraction of lr = 3e-3.
        torch.testing.assert_close(tensor, want_state[name], rtol=1e-5, atol=1e-5, msg=name)
