"""lm-evaluation-harness on a checkpoint (``polyshard eval``): a tiny Llama trained 40 steps with a BPE
tokenizer that has an end-of-text token, exported with ``polyshard export --format hf``, and three local
tasks (a YAML and a JSONL each: multiple choice, rolling log-likelihood, greedy generation with stop
strings) scored by our ``LM`` on the mesh and by lm_eval's own Hugging Face backend on the export.

Tolerances: the accuracies and exact matches are counts of discrete choices, so they are equal. A
log-likelihood is a sum over the continuation's tokens of log-softmax values computed in float32 by
two implementations of the same model (ours and transformers', with other summation orders, tp's split
matmuls and vocabulary-parallel softmax), which agree to ROUND_OFF = 1e-5 on values of size ~1 per
token (tests/models/_hf.py); a sum of n tokens may drift n times that, and no continuation here has
more than 40 tokens (a rolling window is at most the 32-token context), so 40 x ROUND_OFF absolute.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from polyshard.data.tokenizer import ByteTokenizer
from polyshard.mesh import Mesh
from polyshard.trainer.config import from_dict
from tests.models._hf import ROUND_OFF

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("transformers")

POLYSHARD = [sys.executable, "-m", "polyshard.cli.main"]
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
LOGPROB_TOLERANCE = 40 * ROUND_OFF  # the longest continuation's tokens, each within ROUND_OFF (module docstring)
# A worker's first lm_eval import and a training run take seconds idle, minutes on a machine busy with other jobs.
SLOW_S = 600.0
WORDS = "the king queen lord love death night day sweet fair heaven earth sword crown blood".split()

CHOICE = """\
task: polyshard_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
"""
ROLLING = """\
task: polyshard_rolling
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
"""
GENERATE = """\
task: polyshard_generate
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: ["e", "\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
"""
TASKS = ["polyshard_choice", "polyshard_rolling", "polyshard_generate"]


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    for key, value in OFFLINE.items():
        monkeypatch.setenv(key, value)


@pytest.fixture(scope="module")
def task_folder(tmp_path_factory):
    """Three tasks, each a YAML naming its JSONL file (lm_eval's TaskManager(include_path=...) finds them)."""
    import random

    folder = tmp_path_factory.mktemp("tasks")
    rng = random.Random(1)

    def phrase(n):
        return " ".join(rng.choice(WORDS) for _ in range(n))

    def question(answer):
        return {"question": phrase(4), "choices": [f" {phrase(2)}" for _ in range(3)], "answer": answer}

    choices = [question(i % 3) for i in range(8)]
    rows = {
        "choice": choices,
        "rolling": [{"text": phrase(rng.randint(3, 30))} for _ in range(4)],  # some longer than one window
        "generate": [{"prompt": phrase(5), "target": f" {phrase(1)}"} for _ in range(6)],
    }  # fmt: skip
    for name, template in (("choice", CHOICE), ("rolling", ROLLING), ("generate", GENERATE)):
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(row) + "\n" for row in rows[name]))
        (folder / f"{name}.yaml").write_text(template.format(data=data))
    return folder


def _train(config, out):
    from polyshard.trainer.loop import train

    return train(config, Mesh(config.parallel.mesh_axes), out, log=False).losses


@pytest.fixture(scope="module")
def run(distributed, corpus, tmp_path_factory):
    """A tiny Llama trained 40 steps on one process with a BPE that has an end-of-text token, and its
    Hugging Face export (``polyshard export RUN DIR --format hf``)."""
    import transformers
    from typer.testing import CliRunner

    from polyshard.cli.main import app
    from polyshard.data.tokenizer import load_tokenizer, train_bpe

    folder = tmp_path_factory.mktemp("eval-run")
    with open(corpus) as f:
        bpe = train_bpe([f.read()], 300, folder / "tokenizer.json")  # <|endoftext|> is its last id
    end = load_tokenizer(str(bpe)).end_of_text
    assert end is not None
    model = {"preset": "llama-tiny", "hidden": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2}
    config = from_dict(
        {
            "model": {**model, "context_length": 32, "vocab_size": 301},  # odd: tp2 pads the head to 302 columns
            "training": {"steps": 40, "global_batch_size": 8},
            "optimizer": {"lr": 1e-2},
            "lr_schedule": {"warmup_steps": 4},
            "eval": {"every": 0},
            "data": {"source": corpus, "tokenizer": str(bpe)},
            "logging": {"progress_bar": False},
        }
    )
    losses = distributed.run(1, _train, config, folder / "run", timeout_s=SLOW_S)[0]
    assert losses[-1] < losses[0]  # it learned something: its answers are not uniform
    exported = CliRunner().invoke(app, ["export", str(folder / "run"), str(folder / "hf"), "--format", "hf"])
    assert exported.exit_code == 0, exported.output
    # transformers knows the end-of-text token (tokenizer_config.json names it): its generation stops there too
    assert transformers.AutoTokenizer.from_pretrained(folder / "hf").eos_token_id == end
    return folder / "run", folder / "hf"


@pytest.fixture(scope="module")
def reference(run, task_folder):
    """lm_eval's Hugging Face backend on the export: the results the mesh must give."""
    from lm_eval.tasks import TaskManager

    for key, value in OFFLINE.items():  # the module fixture runs before the function-scoped one
        os.environ.setdefault(key, value)
    manager = TaskManager(include_path=str(task_folder), include_defaults=False)
    return lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={run[1]},dtype=float32,device=cpu",
        tasks=TASKS,
        task_manager=manager,
        batch_size=1,
        log_samples=True,
    )


def _evaluate_on_mesh(run_folder, mesh_axes, task_folder, batch_size):
    from polyshard.checkpoint import open_checkpoint
    from polyshard.trainer.evaluation.harness import evaluate_checkpoint
    from polyshard.trainer.evaluation.layout import evaluation_config
    from polyshard.trainer.evaluation.worker import task_manager

    os.environ.update(OFFLINE)  # a pool worker started before this module
    source = open_checkpoint(run_folder)
    config = evaluation_config(source, mesh_axes)
    manager = task_manager(TASKS, str(task_folder))
    results = evaluate_checkpoint(
        source, config, Mesh(config.parallel.mesh_axes), TASKS, manager, batch_size=batch_size, log_samples=True
    )
    return None if results is None else {key: results[key] for key in ("results", "samples")}


def assert_same_scores(ours, theirs):
    """The metrics of every task equal, and each request's answer: log-likelihoods within LOGPROB_TOLERANCE,
    greedy flags and generated text the same."""
    for task in TASKS:
        mine, reference = ours["results"][task], theirs["results"][task]
        metrics = {key for key in reference if key.endswith(",none") and "stderr" not in key}
        assert metrics, reference
        for key in metrics:
            expected = reference[key]
            assert mine[key] == (expected if "perplexity" not in key else pytest.approx(expected, rel=1e-4)), key
        by_doc = {sample["doc_id"]: sample for sample in theirs["samples"][task]}
        assert len(by_doc) == len(ours["samples"][task]) > 0
        drift = 0.0
        for sample in ours["samples"][task]:
            other = by_doc[sample["doc_id"]]
            for got, want in zip(sample["resps"], other["resps"], strict=True):
                got, want = got[0], want[0]
                if isinstance(want, str):
                    assert got == want
                    continue
                if isinstance(want, (list, tuple)):  # (log-likelihood, greedy)
                    assert got[1] == want[1]
                    got, want = got[0], want[0]
                assert got == pytest.approx(want, abs=LOGPROB_TOLERANCE)
                drift = max(drift, abs(got - want))
        print(f"{task}: {metrics_of(mine)}; max |log-likelihood - the HF backend's| = {drift:.3g}")


def metrics_of(results):
    return {k.split(",")[0]: round(v, 4) for k, v in results.items() if k.endswith(",none") and "stderr" not in k}


@pytest.mark.long  # training, the export and lm_eval's HF backend: ~15 s idle (tests below cover MeshLM quickly)
def test_scores_on_one_process_equal_the_hf_backend_on_the_export(distributed, run, task_folder, reference):
    ours = distributed.run(1, _evaluate_on_mesh, run[0], None, task_folder, 3, timeout_s=SLOW_S)[0]
    assert_same_scores(ours, reference)
    generated = [sample["resps"][0][0] for sample in ours["samples"]["polyshard_generate"]]
    # "e" is in most of the corpus's words: a row stops inside its first such word, the text cut before it
    assert any(generated) and not any("e" in text or "\n" in text for text in generated)


@pytest.mark.long  # two worker processes build and score the model (the pool's are kept across tests)
@pytest.mark.parametrize("mesh_axes", [{"tp": 2}, {"dp": 2}], ids=["tp2", "dp2"])
def test_scores_on_two_processes_equal_the_hf_backend(distributed, run, task_folder, reference, mesh_axes):
    results = distributed.run(2, _evaluate_on_mesh, run[0], mesh_axes, task_folder, 2, timeout_s=SLOW_S)
    assert results[1] is None or results[1]["results"] == results[0]["results"]  # every rank computes alike
    assert_same_scores(results[0], reference)


@pytest.mark.long  # the whole command: torchrun, two workers importing lm_eval
def test_the_command_writes_the_scores_and_refuses_to_overwrite(run, task_folder, reference, tmp_path):
    output = tmp_path / "results.json"
    command = POLYSHARD + ["eval", str(run[0]), "--tasks", ",".join(TASKS), "--include-path", str(task_folder)]
    command += ["--mesh", "tp=2", "--batch-size", "2", "--output", str(output), "--log-samples"]
    env = {**os.environ, **OFFLINE}
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    written = json.loads(output.read_text())
    assert written["polyshard"]["mesh"]["tp"] == 2 and written["polyshard"]["step"] == 40
    assert_same_scores(written, reference)
    again = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert again.returncode == 2 and "exists; give another file, or --overwrite" in again.stderr


class _Scripted:
    """A scorer whose model always continues with ``tokens`` (its ``generate`` keeps MeshScorer's contract:
    at most ``max_new`` tokens, a row ending once ``done`` holds), so MeshLM's own part shows alone."""

    max_length = 32

    def __init__(self, text: bytes):
        self.tokens, self.asked = list(text), []

    def generate(self, prompts, max_new, done):
        self.asked.append(max_new)
        rows = []
        for _ in prompts:
            new = []
            for token in self.tokens[:max_new]:
                new.append(token)
                if done(new):
                    break
            rows.append(new)
        return rows


class _BytesWithEnd(ByteTokenizer):
    end_of_text = 0  # the NUL byte stands for an end-of-text token


def _request(settings):
    return SimpleNamespace(args=("the prompt", settings))


def test_generation_stops_at_the_stop_strings_the_end_token_and_max_tokens():
    from polyshard.trainer.evaluation import EvaluationError
    from polyshard.trainer.evaluation.harness import MeshLM

    scorer = _Scripted(b"the king day lord")
    lm = MeshLM(scorer, ByteTokenizer())
    greedy = {"until": [" day"], "max_gen_toks": 30, "do_sample": False}
    few = {"until": [" day"], "max_gen_toks": 5, "do_sample": False}
    assert lm.generate_until([_request(greedy), _request(few), _request(greedy)]) == ["the king", "the k", "the king"]
    assert sorted(scorer.asked) == [5, 30]  # one batch per distinct setting
    ended = MeshLM(_Scripted(b"ab\x00cd"), _BytesWithEnd())
    assert ended.generate_until([_request({"until": ["z"], "max_gen_toks": 9})]) == ["ab"]  # stopped, the token cut
    with pytest.raises(EvaluationError, match="generates greedily only"):
        lm.generate_until([_request({"until": ["\n"], "do_sample": True, "temperature": 0.7})])
    with pytest.raises(EvaluationError, match=r"up to 32 new tokens .* 32 positions .* a smaller max_gen_toks"):
        lm.generate_until([_request({"until": ["\n"], "max_gen_toks": 32})])
    with pytest.raises(EvaluationError, match="the run's tokenizer has none"):
        lm.loglikelihood([SimpleNamespace(args=("", " the king"))])  # an empty context needs the end token
