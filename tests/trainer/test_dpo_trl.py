"""DPO against TRL's own DPOTrainer (trl 1.16) and against the same maths on transformers' model: a tiny
random Llama built with transformers, the same token-id pairs in the same order, the same reference (the
starting weights), beta, AdamW at a constant rate with gradient clipping, five steps. polyshard trains from
the Hugging Face folder (``--init-from hf:``) on one process, tp2 and dp2 ZeRO-3.

* TRL: every step's loss agrees within 1e-3 relative, the rewards within 2.5e-3. Not closer: TRL 1.16 scores through its
  fused LM head (``add_fused_lm_head``), whose first-step gradient here has norm 5.7748 where autograd
  through transformers' own logits gives 5.7792 for the same loss (log-probs equal to 1e-6: the logged
  ``logps/chosen`` agree), and AdamW's first step moves every weight by lr x the gradient's sign, so
  the next losses differ by ~4e-4 relative and a reward by up to 1.2e-3.
* transformers + autograd + torch's AdamW, the loss written out here as TRL's formula: every step's loss
  and pre-clip gradient norm and every weight after the last step agree to float32 round-off.
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
from tests.models.test_hf_llama import VOCAB, _save_llama

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")

STEPS, PAIRS_PER_STEP, BETA, LR = 5, 4, 0.5, 1e-3
TRL_TOL = 1e-3  # TRL's fused head's gradient (see above): ~4e-4 relative on the second step's loss
REWARDS_ATOL = 2.5e-3  # and 1.2e-3 on a reward of ~1e-2 after the first step (measured)
# The same sums as transformers' in another order: ~1e-6 relative on a loss or norm (measured 8e-7). The
# weights after five steps: measured at most 3.9e-6 apart on one process, 1.1e-6 on tp2 and 4.2e-6 on dp2
# ZeRO-3 (AdamW scales an element whose gradient is float32 noise up to lr-sized steps), under 2e-9 on
# average per tensor.
EXACT_RTOL, PARAM_ATOL, PARAM_MEAN = 1e-5, 2e-5, 1e-8


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
            "training": {
                "task": "dpo", "steps": STEPS, "global_batch_size": PAIRS_PER_STEP, "lr": LR, "min_lr": LR,
                "lr_schedule": "constant", "warmup_steps": 0, "weight_decay": 0.0, "beta2": 0.999,
                "grad_clip": 1.0, "eval_every": 0, "sample_tokens": 0,
            },
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
    sigmoid loss on row log-probs from log_softmax, pairs in file order. Returns per-step (loss, norm)."""
    model = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    reference = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    pairs = [json.loads(line) for line in train.read_text().splitlines()]

    def logps(net, pair, side):
        ids = torch.tensor([pair["prompt_ids"] + pair[side]])
        log_probs = torch.log_softmax(net(ids).logits[0, :-1].float(), dim=-1)
        start = len(pair["prompt_ids"]) - 1  # the position that predicts the response's first token
        return log_probs[start:].gather(1, ids[0, start + 1 :, None]).sum()

    steps = []
    for step in range(STEPS):
        batch = [pairs[(step * PAIRS_PER_STEP + k) % len(pairs)] for k in range(PAIRS_PER_STEP)]
        losses = []
        for pair in batch:
            with torch.no_grad():
                ref = [logps(reference, pair, side) for side in ("chosen_ids", "rejected_ids")]
            chosen, rejected = (logps(model, pair, side) for side in ("chosen_ids", "rejected_ids"))
            losses.append(-torch.nn.functional.logsigmoid(BETA * ((chosen - ref[0]) - (rejected - ref[1]))))
        loss = torch.stack(losses).mean()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        steps.append((float(loss), float(norm)))
    return steps, {k: v.detach() for k, v in model.state_dict().items()}


LAYOUTS = {"one": {}, "tp2": {"tp": 2}, "dp2-zero3": {"dp": 2, "zero_stage": 3}}


@pytest.fixture(scope="module")
def references(setup, tmp_path_factory):
    """TRL's logged steps, and the written-out reference's (loss, norm) steps and weights: once for every layout."""
    folder, train, _ = setup
    theirs, _ = _trls(folder, train, tmp_path_factory.mktemp("trl"))
    return theirs, *_autograd(folder, train)


@pytest.mark.long  # ~30 s: two trainers and the written-out reference, five steps each
@pytest.mark.parametrize("name", LAYOUTS)
def test_dpo_follows_trls_dpo_trainer_and_the_formula_on_transformers(distributed, setup, references, tmp_path, name):
    folder, train, val = setup
    theirs, exact, exact_weights = references
    parallel = LAYOUTS[name]
    ranks = max(1, parallel.get("tp", 1) * parallel.get("dp", 1))
    ours, weights = distributed.run(ranks, _ours, folder, train, val, tmp_path / "ours", parallel)[0]
    assert len(ours) == len(theirs) == STEPS
    for step, (mine, logged) in enumerate(zip(ours, theirs), start=1):
        assert mine["loss"] == pytest.approx(logged["loss"], rel=TRL_TOL), f"step {step}"
        for key in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
            assert mine[key] == pytest.approx(logged[key], abs=REWARDS_ATOL), f"step {step} {key}"
        # a pair whose margin is within the two gradients' difference of 0 may count on one side only
        assert abs(mine["rewards/accuracies"] - logged["rewards/accuracies"]) <= 1 / PAIRS_PER_STEP
    assert ours[0]["loss"] == theirs[0]["loss"]  # policy = reference: log 2 on both, to the bit

    got = [number for r in ours for number in (r["loss"], r["grad_norm"])]
    assert got == pytest.approx([number for pair in exact for number in pair], rel=EXACT_RTOL)
    started = load_file(folder / "model.safetensors")
    for name, tensor in weights.items():
        torch.testing.assert_close(tensor, exact_weights[name], rtol=0.0, atol=PARAM_ATOL, msg=name)
        assert float((tensor - exact_weights[name]).abs().mean()) < PARAM_MEAN, name
        assert not torch.equal(tensor, started[name]), f"{name} did not train: the comparison would see nothing"
