"""Evaluation on the mesh without lm_eval: MeshScorer's log-likelihoods, greedy flags and greedy generation on
one process and on dp2, tp2 (a vocabulary padded to an even width) and pp2 equal the plain one-process
model's; the layout evaluation runs on, and what it refuses (context parallelism), with the command's
other refusals.

Tolerance: every layout builds the same seeded weights (polyshard.models seeds each layer by its global
index), so only the order of float32 sums differs from the plain model (tp's split matmuls and vocabulary-
parallel softmax): ROUND_OFF (1e-5) per scored token on values of size ~1, and the rows here score at most
8 tokens, so 8 x ROUND_OFF absolute on a sum. The greedy tokens are compared exactly: with random weights
the two best logits of a row are never within round-off of each other here (the test would name the row).
"""

from __future__ import annotations

import random
import sys

import pytest
import torch

from polyshard.mesh import Mesh
from polyshard.trainer.config import from_dict
from tests._layouts import LAYOUTS, LONG, layout
from tests.models._hf import ROUND_OFF

VOCAB = 67  # odd: under tp2 the head holds 68 columns, one of them padding the argmax must pass over
LONGEST = 8  # continuation tokens scored in one row


def _config(corpus, **parallel):
    model = {"preset": "llama-tiny", "hidden": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2}
    return from_dict(
        {
            "model": {**model, "context_length": 16, "vocab_size": VOCAB},
            "parallel": parallel,
            "training": {"steps": 1, "global_batch_size": 4},
            "eval": {"every": 0},
            "data": {"source": corpus},
            "logging": {"progress_bar": False},
        }
    )


def _rows():
    rng = random.Random(3)
    rows = []
    for _ in range(7):  # lengths 2..17: the longest fills the 16-position context plus its last target
        tokens = [rng.randrange(VOCAB) for _ in range(rng.randint(2, 17))]
        rows.append((tokens, rng.randint(1, min(LONGEST, len(tokens) - 1))))
    return rows


PROMPTS = [[5, 9, 14], [3], [60, 61, 62, 63, 64, 65, 66]]


def _stops_at(token):
    return lambda new: new[-1] == token


def _on_mesh(config, stop):
    from polyshard.trainer.engine.builder import build_engine
    from polyshard.trainer.evaluation.scoring import MeshScorer

    scorer = MeshScorer(build_engine(config, Mesh(config.parallel.mesh_axes)), batch_size=3)
    return scorer.score(_rows()), scorer.generate(PROMPTS, 6, _stops_at(stop))


def _plain(config, stop):
    """The same answers from the unsharded model on this process, one row at a time."""
    from polyshard.models import build_model

    model = build_model(config.model, seed=config.training.seed).eval()
    scores = []
    with torch.no_grad():
        for tokens, n in _rows():
            logprobs = torch.log_softmax(model(torch.tensor([tokens[:-1]]))[0].float(), -1)[-n:]
            wanted = torch.tensor(tokens[-n:])
            scores.append(
                (float(logprobs.gather(1, wanted[:, None]).sum()), bool((logprobs.argmax(-1) == wanted).all()))
            )
        generated = []
        for prompt in PROMPTS:
            new: list[int] = []
            while len(new) < 6 and not (new and new[-1] == stop):
                new.append(int(model(torch.tensor([prompt + new]))[0, -1].argmax()))
            generated.append(new)
    return scores, generated


@pytest.mark.parametrize("name", [layout("one-process"), layout("tp2"), layout("dp2", LONG), layout("pp2-m1", LONG)])
def test_scores_and_greedy_tokens_equal_the_plain_models(distributed, corpus, name):
    config = _config(corpus, **LAYOUTS[name][1])
    stop = _plain(config, stop=-1)[1][0][1]  # the first prompt's second greedy token ends its row
    results = distributed.run(config.parallel.world_size, _on_mesh, config, stop)
    scores, generated = _plain(config, stop)
    assert len(generated[0]) <= 2 and max(map(len, generated)) == 6  # one row stopped early, one ran to the end
    for scored, generations in results:  # every rank holds every answer
        assert generations == generated
        for row, (got, (logprob, greedy)) in enumerate(zip(scored, scores, strict=True)):
            assert got.logprob == pytest.approx(logprob, abs=LONGEST * ROUND_OFF), row
            assert got.greedy == greedy, row


def _save(config, out):
    from polyshard.checkpoint import save_checkpoint
    from polyshard.trainer.checkpointing.state import state_tensors
    from polyshard.trainer.engine.builder import build_engine
    from tests.models.test_hf import _asdict

    engine = build_engine(config, Mesh(config.parallel.mesh_axes))
    save_checkpoint(out, 0, state_tensors(engine), mesh_axes=config.parallel.mesh_axes, config=_asdict(config))


@pytest.fixture(scope="module")
def saved(distributed, corpus, tmp_path_factory):
    """A checkpoint of the tiny Llama saved on dp2 with ZeRO-1 (nothing trained)."""
    out = tmp_path_factory.mktemp("eval-layout")
    config = _config(corpus, dp=2, zero_stage=1)
    distributed.run(2, _save, config, out)
    return out


def test_the_layout_evaluation_runs_on(saved):
    from polyshard.checkpoint import open_checkpoint
    from polyshard.trainer.errors import ConfigError
    from polyshard.trainer.evaluation.layout import evaluation_config

    source = open_checkpoint(saved)
    own = evaluation_config(source)
    assert own.parallel.mesh_axes["dp"] == 2 and own.parallel.zero_stage == 0  # the saved layout, ZeRO off
    tp = evaluation_config(source, {"tp": 2})
    assert tp.parallel.mesh_axes["tp"] == 2 and tp.parallel.mesh_axes["dp"] == 1 and not tp.parallel.sequence_parallel
    with pytest.raises(ConfigError, match=r"cp=2 is refused .* e\.g\. --mesh tp=2"):
        evaluation_config(source, {"cp": 2, "tp": 2})


def test_the_command_refuses_before_starting_anything(saved, tmp_path):
    from typer.testing import CliRunner

    from polyshard.cli.main import app

    def run(*args):
        return CliRunner().invoke(app, ["eval", str(saved), "--tasks", "polyshard_choice", *args])

    taken = tmp_path / "results.json"
    taken.write_text("{}")
    refused = run("--output", str(taken))
    assert refused.exit_code == 2 and "exists; give another file, or --overwrite" in refused.output
    assert taken.read_text() == "{}"
    cp = run("--mesh", "cp=2")
    assert cp.exit_code == 2 and "eval error: polyshard eval runs on dp, tp, pp and ep; cp=2 is refused" in cp.output
    missing = run("--step", "5")
    assert missing.exit_code == 2 and "holds no complete step_00000005 (it holds: step_00000000)" in missing.output


def test_without_lm_eval_the_command_names_the_extra(saved, monkeypatch):
    from typer.testing import CliRunner

    from polyshard.cli.main import app

    monkeypatch.setitem(sys.modules, "lm_eval", None)  # what `import lm_eval` meets when it is not installed
    result = CliRunner().invoke(app, ["eval", str(saved), "--tasks", "hellaswag"])
    assert result.exit_code == 2
    assert result.output.strip() == (
        "eval error: polyshard eval needs lm-evaluation-harness: pip install 'polyshard-trainer[eval]'"
    )
