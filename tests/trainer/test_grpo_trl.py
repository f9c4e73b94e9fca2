"""GRPO's loss against TRL's own: ``trl.GRPOTrainer._compute_loss`` (trl 1.16) on a tiny random Llama built
with transformers, for fixed prompts, completions and advantages, against :class:`GRPOLoss` on the same
model's logits, for every loss type, on- and off-policy (old log-probs, two-sided clipping with
epsilon_high, the KL to a reference, a temperature), split into two microbatches as TRL's gradient
accumulation splits them.

The inputs are built as ``_generate_and_score_completions`` hands them to the loss: prompt ids and mask,
completion ids right-padded with the completion mask, the advantages, the generation batch's completion
tokens (``num_items_in_batch``), and the old and reference per-token log-probs when the loss needs them.
Prompts share one length, so TRL's left padding adds nothing and the positions agree.

Tolerances: TRL scores through its fused LM head (``add_fused_lm_head``: log-probs and their gradient
computed tile by tile on the head's weight), polyshard through the model's logits and a log-softmax, so
the same sums run in another order: the losses and every parameter's gradient agree to float32 round-off
(the bounds below). With TRL's default ``bf16=True`` its forward runs under bf16 autocast even on CPU
(4.5e-3 apart on a log-prob here), so the comparison sets ``bf16=False``.
"""

import pytest
import torch

from polyshard.trainer.config.grpo import GRPOConfig
from polyshard.trainer.tasks.grpo import GRPOLoss, group_advantages, loss_normaliser, pack_targets
from polyshard.trainer.tasks.loss import IGNORE_INDEX, token_logps

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

VOCAB, PROMPT, COMPLETION, GENERATIONS = 64, 4, 6, 2
LENGTHS = [6, 3, 1, 5, 6, 2, 4, 6]  # each completion's tokens (its end of text included), 4 groups of 2
REWARDS = [1.0, 0.0, 0.5, 0.5, 2.0, -1.0, 0.25, 1.0]  # the second group's are equal: advantages 0
# float32 sums in another order (Higham: the error of a sum taken in another order is relative to the sum of
# its terms' magnitudes, not to the sum): the loss's terms are each completion's advantage times a ratio near
# 1, which cancel within a group (on-policy grpo's loss is ~1e-3 of terms of ~0.7), so the bound is LOSS_RTOL
# relative to the loss or to the mean |advantage|, whichever is larger. Measured: 4.8e-7 relative on a loss
# (grpo off-policy) on AVX2; on AVX-512 on-policy grpo's loss is 7.3e-9 from TRL's, 1e-8 of its terms'.
LOSS_RTOL = 5e-6
# A gradient entry: measured at most 1.04e-7 apart, 9e-7 of its tensor's largest entry; entries far below
# their tensor's scale carry round-off of that scale, so the bound is 1e-5 x the tensor's largest entry.
GRAD_RTOL, GRAD_SCALE = 1e-5, 1e-5

SETTINGS = {
    "on-policy": {},
    "on-policy-kl": {"beta": 0.04},  # the ratio is 1, but TRL's KL correction has its gradient
    "off-policy": {"iterations": 2, "beta": 0.04, "epsilon_high": 0.28, "temperature": 0.7},
    "plain-kl": {"iterations": 2, "beta": 0.04, "use_bias_correction_kl": False},
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, rms_norm_eps=1e-6, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # norms start at 1: make every tensor count
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    path = tmp_path_factory.mktemp("grpo-trl") / "llama"
    model.save_pretrained(path)
    return path


def _batch():
    """(B, P + C) token ids (completions right-padded with 0) and the (B, C) completion mask."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(2, VOCAB, (len(LENGTHS), PROMPT + COMPLETION), generator=generator)
    mask = torch.zeros(len(LENGTHS), COMPLETION, dtype=torch.long)
    for row, length in enumerate(LENGTHS):
        mask[row, :length] = 1
        ids[row, PROMPT + length - 1] = 1  # the end of text closes it
    ids[:, PROMPT:] *= mask
    return ids, mask


def _our_rows(ids, mask):
    """The pipeline's rows: inputs all but the last token, labels the completion's tokens shifted by one."""
    labels = ids.clone()
    labels[:, :PROMPT] = IGNORE_INDEX
    labels[:, PROMPT:] = labels[:, PROMPT:].masked_fill(mask == 0, IGNORE_INDEX)
    return ids[:, :-1], labels[:, 1:]


def _side_log_probs(folder, ids, mask, config: GRPOConfig):
    """(B, C) 'old' and 'reference' log-probs: the starting model's, moved by up to +-0.5 so that ratios
    leave the clipping range and the KL is not 0; 0 on padding, as TRL's."""
    model = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    inputs, labels = _our_rows(ids, mask)
    with torch.no_grad():
        own = token_logps(model(inputs).logits, labels, None, VOCAB, temperature=config.temperature)
    own = own[:, PROMPT - 1 :]
    generator = torch.Generator().manual_seed(2)
    moved = [(own + (torch.rand(own.shape, generator=generator) - 0.5)) * mask for _ in range(2)]
    return moved[0], moved[1]


def _trls(folder, ids, mask, advantages, old, ref, config: GRPOConfig, tmp_path):
    args = trl.GRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=len(LENGTHS) // 2, gradient_accumulation_steps=2,
        num_generations=GENERATIONS, max_completion_length=COMPLETION, loss_type=config.loss_type,
        beta=config.beta, epsilon=config.epsilon, epsilon_high=config.epsilon_high, num_iterations=config.iterations,
        use_bias_correction_kl=config.use_bias_correction_kl,
        temperature=config.temperature, use_cpu=True, report_to="none", save_strategy="no",
        bf16=False,  # TRL defaults to bf16, which autocasts the forward on CPU too: compare float32 with float32
    )  # fmt: skip
    model = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    prompts = [{"prompt": "2 3"}] * len(LENGTHS)
    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=lambda prompts, completions, **_: [0.0] * len(prompts),
        args=args,
        train_dataset=datasets.Dataset.from_list(prompts),  # not read: the inputs are given
        processing_class=_tokenizer(),
    )
    trainer.current_gradient_accumulation_steps = 2  # what Trainer's loop sets for each accumulation window
    model.train()
    total = 0.0
    for half in (slice(0, 4), slice(4, 8)):  # TRL's two accumulation microbatches of one generation batch
        inputs = {
            "prompt_ids": ids[half, :PROMPT],
            "prompt_mask": torch.ones(4, PROMPT, dtype=torch.long),
            "completion_ids": ids[half, PROMPT:],
            "completion_mask": mask[half],
            "advantages": advantages[half],
            "num_items_in_batch": mask.sum(),  # the whole generation batch's completion tokens
        }
        if config.iterations > 1:
            inputs["old_per_token_logps"] = old[half]
        if config.beta:
            inputs["ref_per_token_logps"] = ref[half]
        loss = trainer._compute_loss(model, inputs)
        loss.backward()
        total += float(loss.detach())
    return total, {name: p.grad for name, p in model.named_parameters()}


def _tokenizer():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    words = Tokenizer(WordLevel({str(i): i for i in range(VOCAB)}, unk_token="0"))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=words, pad_token="0", eos_token="1")


def _ours(folder, ids, mask, advantages, old, ref, config: GRPOConfig):
    """GRPOLoss as the pipeline executor runs it: two microbatches, each loss / 2, one backward."""
    model = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    inputs, labels = _our_rows(ids, mask)
    full = lambda part: torch.cat([torch.zeros(len(LENGTHS), PROMPT - 1), part], dim=1)  # noqa: E731
    normaliser = loss_normaliser(config, labels, None, 2)
    targets = pack_targets(
        labels,
        full(old) if config.iterations > 1 else None,
        full(ref) if config.beta else None,
        advantages,
        normaliser,
    )
    loss_fn = GRPOLoss(config, None, VOCAB)
    logits = model(inputs).logits
    loss = sum(loss_fn(lg, tg) / 2 for lg, tg in zip(logits.chunk(2), targets.chunk(2)))
    loss.backward()
    return float(loss.detach()), {name: p.grad for name, p in model.named_parameters()}


# Every loss type on- and off-policy; TRL's default (dapo) also without a reference and with the plain k3.
CASES = [(kind, setting) for kind in ("dapo", "grpo", "dr_grpo", "bnpo") for setting in ("on-policy-kl", "off-policy")]
CASES += [("dapo", "on-policy"), ("dapo", "plain-kl")]


@pytest.mark.long  # ~20 s: 7 importing trl, then ~1.3 s a case (TRL's trainer loads its reference model)
@pytest.mark.parametrize(("loss_type", "setting"), CASES)
def test_loss_and_gradients_are_trls_grpo_trainers(folder, tmp_path, loss_type, setting):
    config = GRPOConfig(
        loss_type=loss_type, max_completion_length=COMPLETION, rewards=[{"function": "exact_answer"}],
        generations=GENERATIONS, **SETTINGS[setting],
    )  # fmt: skip
    ids, mask = _batch()
    advantages = group_advantages(torch.tensor(REWARDS), GENERATIONS, config.scale_rewards)
    old, ref = _side_log_probs(folder, ids, mask, config)
    theirs, their_grads = _trls(folder, ids, mask, advantages, old, ref, config, tmp_path)
    mine, my_grads = _ours(folder, ids, mask, advantages, old, ref, config)
    # (on-policy grpo's loss is ~0: each row's token mean is -A, and a group's advantages add up to 0)
    assert mine == pytest.approx(theirs, rel=LOSS_RTOL, abs=LOSS_RTOL * float(advantages.abs().mean()))
    for name, grad in their_grads.items():
        scale = float(grad.abs().max())
        torch.testing.assert_close(my_grads[name], grad, rtol=GRAD_RTOL, atol=GRAD_SCALE * scale, msg=name)
    assert max(float(g.abs().max()) for g in their_grads.values()) > 1e-3  # the comparison sees gradients
