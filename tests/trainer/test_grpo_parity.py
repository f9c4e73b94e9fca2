"""GRPO trains on every layout it runs on as on one process (tests/_layouts.py's runner): each data
rank draws exactly the completions one process draws for its prompts (generation is seeded per prompt
and sample, loop.generation), so the rewards, advantages, losses, pre-clip gradient norms, every gradient
of the first step and every parameter after AdamW with weight decay agree within float tolerance.

The model starts random, so its completions are random bytes of varied lengths (a stop string cuts some);
the reward reads their token ids, so every group's rewards differ and every row has an advantage.
"""

import dataclasses
import functools
import json
import random

import pytest

from polyshard.mesh import Mesh
from polyshard.trainer.config import from_dict
from polyshard.trainer.loop import Hook, Trainer
from tests._layouts import LONG, Tolerance, _FirstGradients, compared_pieces, layout

STEPS = 3  # with iterations = 2: generation batches at steps 1 and 3
# Gradients, parameters and norms: as test_dpo_parity.py's (float32 sums taken in another order, ~1e-7
# relative per step, compounded over AdamW steps). The losses are sums of +-advantage x ratio terms that
# cancel (a group's advantages have mean 0; with equal completion lengths the loss is 0 exactly): their
# round-off is ~1e-7 of the terms' sum, sum |A| / tokens ~ 1, so they also pass within 1e-6 absolute.
TOLERANCE = Tolerance(
    numbers=2e-5, grads={"rtol": 2e-5, "atol": 5e-7}, params={"rtol": 2e-5, "atol": 8e-6}, numbers_abs=1e-6
)
# Two generation batches and four optimizer steps of lr 1e-3: Adam divides each gradient by its own size,
# so an entry whose gradient is as small as its round-off takes a step set by that noise (tests/_bounds.py's
# AdamWDrift): 1.15e-5 seen on one entry of 4096 on tp2, 1% of one update. A step on stale rows or a ratio
# against the wrong log-probs moves entries by whole updates (1e-3); atol 2e-5 stays far below that.
ITERATED = dataclasses.replace(TOLERANCE, params={"rtol": 2e-5, "atol": 2e-5})
REWARD_ATOL = 1e-6  # a mean of float32 rewards in [0, 1] taken in another order


def byte_height(prompts, completions, completion_ids, **columns):
    """A dense reward: each completion's mean token id / 256 (the rows of a group always differ)."""
    assert set(columns) >= {"answer"}, "the prompt lines' other fields reach the reward as columns"
    return [sum(ids) / (256 * max(len(ids), 1)) for ids in completion_ids]


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("grpo") / "prompts.jsonl"
    lines = []
    for _ in range(24):
        word = "".join(rng.choices("abcdef", k=rng.randint(1, 5)))
        lines.append(json.dumps({"prompt": f"{word}>", "answer": word[::-1]}))
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _config(prompts, beta=0.0, iterations=1, loss_type="dapo", **parallel):
    return from_dict(
        {
            "model": {"kind": "gpt", "hidden": 32, "num_layers": 2, "num_heads": 4, "context_length": 16},
            "parallel": parallel,
            # weight decay 2.0: a rank that missed it shows in the parameters (test_e2e_parity.py's PARAM_TOL)
            "training": {
                "steps": STEPS,
                "global_batch_size": 4,  # prompts: 16 completions a step
                "task": "grpo",
            },
            "optimizer": {
                "weight_decay": 2.0,
            },
            "lr_schedule": {
                "warmup_steps": 1,
            },
            "eval": {
                "every": 0,
                "sample_tokens": 0,
            },
            "grpo": {
                "generations": 4,
                "max_completion_length": 8,
                "stop": ["a"],
                "beta": beta,
                "iterations": iterations,
                "loss_type": loss_type,
                "rewards": [
                    {"function": "tests.trainer.test_grpo_parity:byte_height"},
                    {"function": "exact_answer", "weight": 0.5},
                ],
            },
            "data": {"source": prompts, "tokenizer": "bytes"},
            "logging": {"progress_bar": False},
        }
    )


class _Rollouts(Hook):
    """Each step's rows of this data rank (prompt + completion tokens) and the logged mean reward."""

    def __init__(self) -> None:
        self.rows: list[list[list[int]]] = []
        self.rewards: list[float] = []
        self.trainer: Trainer | None = None

    def after_step(self, step, seconds, record) -> None:
        assert self.trainer is not None and self.trainer.rollouts is not None
        current = self.trainer.rollouts.current
        assert current is not None
        self.rows.append(current.inputs.tolist())
        if "reward" in record:
            self.rewards.append(record["reward"])


def train_grpo(config, out):
    """tests/_layouts.py's worker, plus each step's rows and rewards."""
    mesh = Mesh(config.parallel.mesh_axes)
    first, rollouts = _FirstGradients(), _Rollouts()
    trainer = Trainer(config, mesh, out, log=False, hooks=[first, rollouts])
    first.engine, rollouts.trainer = trainer.engine, trainer
    data_rank = mesh.group_rank(config.parallel.batch_axes)
    return {
        **compared_pieces(mesh, trainer, first, trainer.run()),
        "rows": rollouts.rows,
        "rewards": rollouts.rewards,
        "data_rank": data_rank,
        "data_ranks": config.parallel.data_ranks,
    }


def _same_rows(results, expected):
    """Every rank's rows are one process's rows of its data rank's share of the global batch."""
    whole = expected[0]["rows"]
    for result in results:
        share = len(whole[0]) // result["data_ranks"]
        start = result["data_rank"] * share
        for step, (got, want) in enumerate(zip(result["rows"], whole)):
            assert got == want[start : start + share], f"step {step + 1}: rank {result['data_rank']} drew other rows"
        assert result["rewards"] == pytest.approx(expected[0]["rewards"], abs=REWARD_ATOL)


@pytest.mark.parametrize("name", [layout("dp2"), layout("tp2"), layout("dp2-zero3", LONG)])
def test_grpo_draws_and_trains_as_on_one_process(parity, prompts, tmp_path, name):
    config_of = functools.partial(_config, prompts)
    compared = parity.check(name, config_of, TOLERANCE, tmp_path, worker=train_grpo, learns=False)
    expected = parity.reference(config_of(), train_grpo)
    _same_rows(compared.results, expected)
    lengths = {len([t for t in row if t]) for step in expected[0]["rows"] for row in step}
    assert len(lengths) > 1, "the completions should differ in length (stop strings, prompt lengths)"


@pytest.mark.long
@pytest.mark.parametrize("name", [layout("tp2"), layout("dp2"), layout("dp2-zero3")])
def test_grpo_with_a_reference_and_two_iterations_trains_as_on_one_process(parity, prompts, tmp_path, name):
    """beta > 0 holds a frozen reference; iterations = 2 reuses each generation batch for a second step,
    its ratios against the log-probs the policy had when it generated (the grpo loss type, per row)."""
    config_of = functools.partial(_config, prompts, beta=0.1, iterations=2, loss_type="grpo")
    compared = parity.check(name, config_of, ITERATED, tmp_path, worker=train_grpo, learns=False)
    expected = parity.reference(config_of(), train_grpo)
    _same_rows(compared.results, expected)
    assert len(expected[0]["rewards"]) == 2  # steps 1 and 3 generate; step 2 reuses step 1's rows
