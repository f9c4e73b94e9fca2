"""DPO trains on every layout it runs on as on one process (tests/_layouts.py's runner): losses,
pre-clip gradient norms, every gradient of the first step and every parameter after AdamW with weight
decay, and TRL's reward metrics step by step; the reference stays bit for bit what it was built as.

The pairs' responses have different lengths and the prompts are cut when long (context 16), so rows hold
different numbers of completion tokens; a data rank, a microbatch and a pipeline stage each see whole pairs.
"""

import functools
import json
import random

import pytest
import torch

from polyshard.mesh import Mesh
from polyshard.trainer.config import from_dict
from polyshard.trainer.loop import Hook, Trainer
from tests._layouts import LONG, Tolerance, _FirstGradients, compared_pieces, layout
from tests._short import SMALL_LLAMA, short_run

STEPS = 4
WORDS = "the king queen lord love death night day sweet fair".split()
# As the dense rows of test_e2e_parity.py: float32 sums taken in another order (all-reduces, the
# vocab-parallel log-softmax, sharded matmuls), ~1e-7 relative per step, compounded over AdamW steps.
# The reference's log-probs add a forward's worth of such noise to each pair's margin.
TOLERANCE = Tolerance(numbers=2e-5, grads={"rtol": 2e-5, "atol": 5e-7}, params={"rtol": 2e-5, "atol": 8e-6})
# The rewards are beta x log-ratios of sums of ~10 log-probs (each ~-5): ~1e-6 absolute of float32 noise.
REWARDS_ATOL = 1e-5


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("dpo") / "pairs.jsonl"
    lines = []
    for _ in range(48):
        prompt = " ".join(rng.choices(WORDS, k=rng.randint(1, 4))) + ":"
        # a preference to learn: chosen responses draw from the first words, rejected ones from the last
        chosen, rejected = (" ".join(rng.choices(words, k=rng.randint(1, 3))) for words in (WORDS[:5], WORDS[5:]))
        lines.append(json.dumps({"prompt": prompt, "chosen": chosen, "rejected": rejected}))
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _config(pairs, llama=False, loss="sigmoid", lora=False, **parallel):
    return from_dict(
        {
            "model": {
                "kind": "gpt",
                "hidden": 32,
                "num_layers": 2,
                "num_heads": 4,
                "context_length": 16,
                **(SMALL_LLAMA if llama else {}),
            },
            "parallel": parallel,
            # weight decay 2.0: a rank that missed it shows in the parameters (test_e2e_parity.py's PARAM_TOL)
            **short_run(STEPS, training={"task": "dpo", "global_batch_size": 8}, weight_decay=2.0),
            "dpo": {"beta": 0.5, "loss": loss, **({"label_smoothing": 0.1} if loss == "sigmoid" else {})},
            "data": {"source": pairs},
            "logging": {"progress_bar": False},
            **({"lora": {"rank": 4, "alpha": 8.0}} if lora else {}),
        }
    )


class _Rewards(Hook):
    """Each step's reward metrics as the trainer logged them."""

    def __init__(self) -> None:
        self.rewards: list[float] = []

    def after_step(self, step, seconds, record) -> None:
        self.rewards += [record[k] for k in ("rewards/chosen", "rewards/rejected", "rewards/accuracies")]


def train_dpo(config, out):
    """tests/_layouts.py's worker, plus the rewards and whether the reference changed."""
    mesh = Mesh(config.parallel.mesh_axes)
    first, rewards = _FirstGradients(), _Rewards()
    trainer = Trainer(config, mesh, out, log=False, hooks=[first, rewards])
    first.engine = trainer.engine
    reference = list(trainer.preferences.reference.parameters())
    before = [p.detach().clone() for p in reference]
    return {
        **compared_pieces(mesh, trainer, first, trainer.run()),
        "rewards": rewards.rewards,
        "reference_kept": bool(before) and all(torch.equal(a, b) for a, b in zip(before, reference)),
        "reference_frozen": all(not p.requires_grad and p.grad is None for p in reference),
    }


@pytest.mark.parametrize(
    ("model", "name"),
    [
        layout("dp2", model="gpt"),
        layout("tp2", model="gpt"),
        layout("pp2-1f1b", model="gpt"),
        layout("tp2-sp", model="llama"),
        layout("pp2-zbh1", model="llama"),
        layout("dp2-zero2", model="gpt"),
        # cp: each rank holds two chunks of every row; the rows' log-prob parts are added up over cp
        layout("cp2-ring", model="gpt"),
        layout("cp2-allgather", LONG, model="gpt"),
        layout("cp2-ulysses", LONG, model="llama"),
        layout("cp2xdp2", LONG, model="gpt"),
        layout("dp2-zero3", model="gpt"),  # the reference is each rank's rows of it, gathered block by block
    ],
)
def test_dpo_trains_as_on_one_process(parity, pairs, tmp_path, model, name):
    config_of = functools.partial(_config, pairs, llama=model == "llama")
    compared = parity.check(name, config_of, TOLERANCE, tmp_path, worker=train_dpo)
    expected = parity.reference(config_of(), train_dpo)[0]
    assert expected["reference_kept"] and expected["reference_frozen"]
    for result in compared.results:
        assert result["reference_kept"] and result["reference_frozen"], "the reference moved or took gradients"
        assert result["rewards"] == pytest.approx(expected["rewards"], abs=REWARDS_ATOL)
    assert compared.results[0]["numbers"][0] == pytest.approx(0.6931472, rel=1e-6)  # policy = reference: log 2


@pytest.mark.parametrize("name", [layout("tp2"), layout("cp2-ring")])
def test_ipo_trains_as_on_one_process(parity, pairs, tmp_path, name):
    """IPO divides by each row's completion tokens: under cp the count is added up over the chunks too."""
    config_of = functools.partial(_config, pairs, loss="ipo")
    parity.check(name, config_of, TOLERANCE, tmp_path, worker=train_dpo)


@pytest.mark.parametrize("name", [layout("tp2"), layout("dp2-zero3"), layout("pp2-1f1b")])
def test_dpo_with_lora_uses_the_base_as_its_reference(parity, pairs, tmp_path, name):
    """With LoRA the reference is the policy with its adapters off (no copy: ZeRO-3 runs too); B starts at
    zero, so the first step's policy is the reference and the loss is log 2 on every layout."""
    config_of = functools.partial(_config, pairs, lora=True)
    compared = parity.check(name, config_of, TOLERANCE, tmp_path, worker=train_dpo)
    expected = parity.reference(config_of(), train_dpo)[0]
    for result in [expected, *compared.results]:
        assert not result["reference_kept"]  # no copy to keep: the reference has no parameters of its own
        assert result["rewards"] == pytest.approx(expected["rewards"], abs=REWARDS_ATOL)
    assert compared.results[0]["numbers"][0] == pytest.approx(0.6931472, rel=1e-6)
    assert compared.results[0]["rewards"][:2] == [0.0, 0.0]  # adapters off is the base exactly
