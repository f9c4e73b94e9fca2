"""DPO against TRL's own DPOTrainer (trl 1.16) and against the same maths on transformers' model: a tiny
random Llama built with transformers, the same token-id pairs in the same order, the same reference (the
starting weights), beta, AdamW at a constant rate with gradient clipping, five steps. polyshard trains from
the Hugging Face folder (``--init-from hf:``) on one process, tp2 and dp2 ZeRO-3.

* transformers + autograd + torch's AdamW, the loss written out here as TRL's formula: every step's loss,
  pre-clip gradient norm and rewards, and every weight after the last step, agree to float32 round-off.
* TRL: its first step (policy = reference: the same weights, the same pairs) logs the written-out loss and
  rewards to round-off, which says the written-out formula is TRL's. Its later steps drift from it: TRL 1.16
  scores through its fused LM head (``add_fused_lm_head``), whose first-step gradient here has norm 5.7748
  where autograd through transformers' own logits gives 5.7792 for the same loss, and AdamW's first step
  moves every weight by lr x the gradient's sign, so how far TRL's next losses land from the formula's
  depends on the CPU's kernels (4e-4 relative at step 2 on AVX2, 2.8e-3 at step 3 on AVX-512). So each
  later step is held to the triangle inequality: ours may be no further from TRL's number than the
  written-out formula is, plus our own round-off from that formula.
"""

import json
import random

import pytest
import torch
from safetensors.torch import load_file

from polyshard.mesh import Mesh
from polyshard.trainer.checkpointing.hugging_face import hf_state, model_settings
from polyshard.trainer.checkpointing.run_export import consolidate
from polyshard.trainer.config import from_dict
from polyshard.trainer.loop import Hook, Trainer
from tests._layouts import LAYOUTS
from tests.models.test_hf_llama import VOCAB, _save_llama

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")

STEPS, PAIRS_PER_STEP, BETA, LR = 5, 4, 0.5, 1e-3
# The same sums as transformers' in another order: ~1e-6 relative on a loss or norm (measured 8e-7). The
# weights after five steps: measured at most 3.9e-6 apart on one process, 1.1e-6 on tp2 and 4.2e-6 on dp2
# ZeRO-3 (AdamW scales an element whose gradient is float32 noise up to lr-sized steps), under 2e-9 on
# average per tensor. A reward is beta x a difference of two sums of a few log-probs of O(1) each: float32
# round-off of ~1e-6 on each (the same sums in another order), far under REWARD_ATOL.
EXACT_RTOL, PARAM_ATOL, PARAM_MEAN, REWARD_ATOL = 1e-5, 2e-5, 1e-8, 1e-5
REWARDS = ("rewards/chosen", "rewards/rejected", "rewards/margins")


def _pairs(count: int, seed: int) -> list[dict[str, list[int]]]:
    rng = random.Random(seed)
    ids = lambda low, high: [rng.randrange(2, VOCAB) for _ in range(rng.randint(low, high))]  # noqa: E731
    return [{"prompt_ids": ids(2, 6), "chosen_ids": ids(1, 5), "rejected_ids": ids(1, 5)} for _ in range(count)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo-trl")
    folder = _save_llama(root / "llama", tie=False)
    train, val = root / "train.jsonl", root / "val.jsonl"
    train.write_text("".join(json.dumps(p) + "\n" for p in _pairs(2 * PAIRS_PER_STEP, 0)))
    val.write_text("".join(json.dumps(p) + "\n" for p in _pairs(2, 1)))
    return folder, train, val


class _Rewards(Hook):
    def __init__(self) -> None:
        self.records: list[dict[str, float]] = []

    def after_step(self, step, seconds, record) -> None:
        self.records.append({k: v for k, v in record.items() if k in ("loss", "grad_norm") or k.startswith("rewards/")})


def _ours(folder, train, val, out, parallel):
    config = from_dict(
        {
            "model": model_settings(folder),
            "parallel": parallel,
            "training": {"task": "dpo", "steps": STEPS, "global_batch_size": PAIRS_PER_STEP},
            "optimizer": {"lr": LR, "weight_decay": 0.0, "beta2": 0.999, "grad_clip": 1.0},
            "lr_schedule": {"name": "constant", "min_lr": LR, "warmup_steps": 0},
            "eval": {"every": 0, "sample_tokens": 0},
            "dpo": {"beta": BETA},
            "data": {"source": str(train), "val_source": str(val), "shuffle": False},
            "logging": {"progress_bar": False},
        }
    )  # fmt: skip
    rewards = _Rewards()
    trainer = Trainer(
        config, Mesh(config.parallel.mesh_axes), out, log=False, init_from=f"hf:{folder}", hooks=[rewards]
    )
    trainer.run()
    if not trainer.rank0:
        return None
    state = consolidate(next((out / "checkpoints").glob("step_*")))
    return rewards.records, hf_state(state, config.model)


def _trls(folder, train, out):
    from datasets import Dataset
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    class InOrder(trl.DPOTrainer):
        def _prepare_dataset(self, dataset, *args, **kwargs):  # the ids as given, as polyshard reads them
            return dataset

    words = Tokenizer(WordLevel({str(i): i for i in range(VOCAB)}, unk_token="0"))
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=words, pad_token="0", eos_token="1")
    args = trl.DPOConfig(
        output_dir=str(out), beta=BETA, loss_type=["sigmoid"], learning_rate=LR, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0,
        per_device_train_batch_size=PAIRS_PER_STEP, max_steps=STEPS, train_sampling_strategy="sequential",
        logging_steps=1, report_to="none", save_strategy="no", use_cpu=True, max_length=None, seed=0,
    )  # fmt: skip
    lines = [json.loads(line) for line in train.read_text().splitlines()]
    dataset = Dataset.from_list(lines)
    model = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    trainer = InOrder(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    return logs, {k: v.detach() for k, v in model.state_dict().items()}


def _autograd(folder, train):
    """The reference written out: transformers' model, autograd, torch's AdamW and clip_grad_norm_, TRL's
    sigmoid loss on row log-probs from log_softmax, pairs in file order. Returns per-step (loss, norm), the
    rewards each step logs as TRL defines them (before its update), and the weights after the last step."""
    model = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    reference = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    pairs = [json.loads(line) for line in train.read_text().splitlines()]

    def logps(net, pair, side):
        ids = torch.tensor([pair["prompt_ids"] + pair[side]])
        log_probs = torch.log_softmax(net(ids).logits[0, :-1].float(), dim=-1)
        start = len(pair["prompt_ids"]) - 1  # the position that predicts the response's first token
        return log_probs[start:].gather(1, ids[0, start + 1 :, None]).sum()

    steps, rewards = [], []
    for step in range(STEPS):
        batch = [pairs[(step * PAIRS_PER_STEP + k) % len(pairs)] for k in range(PAIRS_PER_STEP)]
        losses, chosen_rewards, rejected_rewards = [], [], []
        for pair in batch:
            with torch.no_grad():
                ref = [logps(reference, pair, side) for side in ("chosen_ids", "rejected_ids")]
            chosen, rejected = (logps(model, pair, side) for side in ("chosen_ids", "rejected_ids"))
            losses.append(-torch.nn.functional.logsigmoid(BETA * ((chosen - ref[0]) - (rejected - ref[1]))))
            chosen_rewards.append(BETA * float(chosen.detach() - ref[0]))
            rejected_rewards.append(BETA * float(rejected.detach() - ref[1]))
        margins = [c - r for c, r in zip(chosen_rewards, rejected_rewards)]
        mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
        rewards.append(
            {
                "rewards/chosen": mean(chosen_rewards),
                "rewards/rejected": mean(rejected_rewards),
                "rewards/margins": mean(margins),
                "rewards/accuracies": mean([m > 0 for m in margins]),
            }
        )
        loss = torch.stack(losses).mean()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        steps.append((float(loss), float(norm)))
    return steps, rewards, {k: v.detach() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def references(setup, tmp_path_factory):
    """TRL's logged steps, and the written-out reference's (loss, norm) steps, rewards and weights: once for
    every layout."""
    folder, train, _ = setup
    theirs, _ = _trls(folder, train, tmp_path_factory.mktemp("trl"))
    return theirs, *_autograd(folder, train)


@pytest.mark.long  # ~30 s: two trainers and the written-out reference, five steps each
@pytest.mark.parametrize("name", ["one-process", "tp2", "dp2-zero3"])
def test_dpo_follows_trls_dpo_trainer_and_the_formula_on_transformers(distributed, setup, references, tmp_path, name):
    folder, train, val = setup
    theirs, exact, exact_rewards, exact_weights = references
    ranks, parallel = LAYOUTS[name]
    ours, weights = distributed.run(ranks, _ours, folder, train, val, tmp_path / "ours", parallel)[0]
    assert len(ours) == len(theirs) == STEPS
    assert ours[0]["loss"] == theirs[0]["loss"]  # policy = reference: log 2 on both, to the bit
    for step, (mine, logged, (loss, _), formula) in enumerate(zip(ours, theirs, exact, exact_rewards), start=1):
        for key, value, atol in (
            ("loss", loss, EXACT_RTOL * abs(loss)),
            *((k, formula[k], REWARD_ATOL) for k in REWARDS),
        ):
            assert mine[key] == pytest.approx(value, abs=atol), f"step {step} {key}: ours against the formula"
            drift = abs(logged[key] - value)  # TRL's distance from the formula on transformers
            if step == 1:  # the same weights: TRL's number is the formula's
                assert drift <= atol, f"step 1 {key}: TRL {logged[key]} against the formula's {value}"
            assert abs(mine[key] - logged[key]) <= drift + atol, f"step {step} {key}: further from TRL than the formula"
        # a pair whose margin is within round-off of 0 may count on one side only
        assert abs(mine["rewards/accuracies"] - formula["rewards/accuracies"]) <= 1 / PAIRS_PER_STEP

    got = [number for r in ours for number in (r["loss"], r["grad_norm"])]
    assert got == pytest.approx([number for pair in exact for number in pair], rel=EXACT_RTOL)
    started = load_file(folder / "model.safetensors")
    for name, tensor in weights.items():
        torch.testing.assert_close(tensor, exact_weights[name], rtol=0.0, atol=PARAM_ATOL, msg=name)
        assert float((tensor - exact_weights[name]).abs().mean()) < PARAM_MEAN, name
        assert not torch.equal(tensor, started[name]), f"{name} did not train: the comparison would see nothing"
