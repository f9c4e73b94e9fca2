"""GRPO's loss (training.task = "grpo") against TRL 1.16's ``GRPOTrainer._compute_loss`` written out here one
token at a time, the microbatch split, clipping and the KL at their edges, the packed targets, tp and dp
ranks, and the [grpo] settings' errors. The advantages are test_grpo_advantages.py's."""

import math

import pytest
import torch

from polyshard.data.examples import IGNORE_INDEX
from polyshard.trainer.config import from_dict
from polyshard.trainer.config.grpo import GRPOConfig
from polyshard.trainer.errors import ConfigError
from polyshard.trainer.tasks.grpo import (
    GRPOLoss,
    GRPOTargets,
    loss_normaliser,
    metrics_of,
    pack_targets,
    unpack_targets,
)
from polyshard.trainer.tasks.loss import token_logps

REWARDS = [{"function": "exact_answer"}]
VOCAB, LENGTH = 7, 6
# Completion tokens per row: the rows differ so that the normalisations differ.
COMPLETION = [(2, 6), (1, 3), (3, 6), (2, 4)]  # [first, end) positions whose labels count
ADVANTAGES = [1.3, -0.7, 0.4, -1.1]


def _config(**values) -> GRPOConfig:
    return GRPOConfig(rewards=REWARDS, **values)


def _batch(seed: int = 0):
    """(logits (B, S, V), labels (B, S), old log-probs, reference log-probs, advantages): old and reference
    are the policy's own log-probs moved by up to +-0.6, so some ratios leave [0.8, 1.2] and some stay."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(COMPLETION), LENGTH, VOCAB, generator=generator)
    labels = torch.full((len(COMPLETION), LENGTH), IGNORE_INDEX)
    for row, (first, end) in enumerate(COMPLETION):
        labels[row, first:end] = torch.randint(0, VOCAB, (end - first,), generator=generator)
    own = token_logps(logits, labels, None, VOCAB)
    mask = labels != IGNORE_INDEX
    old = (own + 1.2 * (torch.rand(own.shape, generator=generator) - 0.5)) * mask
    ref = (own + 1.2 * (torch.rand(own.shape, generator=generator) - 0.5)) * mask
    return logits, labels, old, ref, torch.tensor(ADVANTAGES)


def _plain_losses(logits, labels, old, ref, advantages, config: GRPOConfig, temperature: float = 1.0):
    """Per row, the list of its completion tokens' losses, TRL's formula one token at a time in float64."""
    rows = []
    for b in range(labels.shape[0]):
        tokens = []
        for s in range(labels.shape[1]):
            label = int(labels[b, s])
            if label == IGNORE_INDEX:
                continue
            scaled = logits[b, s].double() / temperature
            logp = scaled[label] - torch.logsumexp(scaled, dim=0)
            old_logp = logp.detach() if old is None else float(old[b, s])
            ratio = torch.exp(logp - old_logp)
            clipped = torch.clamp(ratio, 1 - config.epsilon, 1 + config.upper_epsilon)
            a = float(advantages[b])
            loss = -torch.minimum(ratio * a, clipped * a)
            if config.beta:
                delta = float(ref[b, s]) - logp
                kl = torch.exp(delta) - delta - 1
                loss = loss + config.beta * (kl * ratio if config.use_bias_correction_kl else kl)
            tokens.append(loss)
        rows.append(tokens)
    return rows


def _plain_loss(rows, config: GRPOConfig, microbatches: int = 1):
    """The global batch's loss as TRL defines it for each loss_type (bnpo: per microbatch of rows)."""
    every = [t for row in rows for t in row]
    if config.loss_type == "dapo":
        return sum(every) / len(every)
    if config.loss_type == "grpo":
        return sum(sum(row) / len(row) for row in rows) / len(rows)
    if config.loss_type == "dr_grpo":
        return sum(every) / (len(rows) * config.max_completion_length)
    size = len(rows) // microbatches
    parts = [rows[k * size : (k + 1) * size] for k in range(microbatches)]
    return sum(sum(t for row in part for t in row) / sum(len(row) for row in part) for part in parts) / microbatches


def _ours(logits, labels, old, ref, advantages, config: GRPOConfig, microbatches: int):
    """The executor's loss: the mean over ``microbatches`` of GRPOLoss on each, normalised for that split."""
    normaliser = loss_normaliser(config, labels, None, microbatches)
    targets = pack_targets(labels, old, ref if config.beta else None, advantages, normaliser)
    loss_fn = GRPOLoss(config, None, VOCAB)
    parts = zip(logits.chunk(microbatches), targets.chunk(microbatches))
    return sum(loss_fn(lg, tg) for lg, tg in parts) / microbatches, loss_fn.take_sums()


CASES = [
    {"loss_type": kind, **extra}
    for kind in ("dapo", "grpo", "dr_grpo", "bnpo")
    for extra in (
        {},
        {"beta": 0.05, "epsilon_high": 0.28, "max_completion_length": 5},
        {"beta": 0.05, "use_bias_correction_kl": False},
    )
]


@pytest.mark.parametrize("values", CASES, ids=lambda v: "-".join(f"{k}={x}" for k, x in v.items()))
@pytest.mark.parametrize("iterations", [1, 2])
def test_each_loss_type_is_trls_formula_for_loss_and_gradient(values, iterations):
    config = _config(iterations=iterations, **values)
    logits, labels, old, ref, advantages = _batch()
    old = None if iterations == 1 else old
    mine = logits.clone().requires_grad_(True)
    loss, sums = _ours(mine, labels, old, ref, advantages, config, microbatches=1)
    loss.backward()
    plain_logits = logits.double().requires_grad_(True)
    expected = _plain_loss(_plain_losses(plain_logits, labels, old, ref, advantages, config), config)
    expected.backward()
    # float32 log-softmax against float64: ~1e-7 relative on a loss of order 1 (measured 6e-8)
    assert float(loss.detach()) == pytest.approx(float(expected.detach()), rel=1e-6, abs=1e-7)
    torch.testing.assert_close(mine.grad.double(), plain_logits.grad, rtol=1e-5, atol=1e-7)
    assert float(sums[4]) == sum(end - first for first, end in COMPLETION) and float(sums[5]) == len(COMPLETION)


@pytest.mark.parametrize("kind", ["dapo", "grpo", "dr_grpo"])
def test_microbatches_give_the_whole_batchs_loss_and_gradient(kind):
    """One microbatch, two or four: the executor's mean over microbatches is the same loss and gradient
    (each microbatch divides by the global count / m), though the rows hold 1 to 4 completion tokens."""
    config = _config(loss_type=kind, iterations=2, beta=0.1)
    logits, labels, old, ref, advantages = _batch(seed=1)
    results = []
    for microbatches in (1, 2, 4):
        mine = logits.clone().requires_grad_(True)
        loss, sums = _ours(mine, labels, old, ref, advantages, config, microbatches)
        loss.backward()
        results.append((loss.detach(), mine.grad, sums))
    for loss, grad, sums in results[1:]:
        # the same float32 terms summed in another order: a few ulps of terms of order 1 (the loss itself is
        # ~6e-3, a difference of advantages)
        torch.testing.assert_close(loss, results[0][0], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(grad, results[0][1], rtol=1e-6, atol=1e-9)
        torch.testing.assert_close(sums, results[0][2], rtol=1e-12, atol=0.0)


def test_bnpo_is_each_microbatchs_token_mean_as_trls_per_device_batch():
    config = _config(loss_type="bnpo", iterations=2)
    logits, labels, old, ref, advantages = _batch(seed=2)
    rows = _plain_losses(logits, labels, old, ref, advantages, config)
    for microbatches in (1, 2):
        loss, _ = _ours(logits, labels, old, ref, advantages, config, microbatches)
        assert float(loss) == pytest.approx(float(_plain_loss(rows, config, microbatches)), rel=1e-6)
    whole, halves = (_ours(logits, labels, old, ref, advantages, config, m)[0] for m in (1, 2))
    assert abs(float(whole) - float(halves)) > 1e-3  # rows of 4, 2, 3, 2 tokens: the split matters, as in TRL


def _token(config: GRPOConfig, logp: float, old: float, advantage: float, ref: float | None = None):
    """One completion token's (loss, d loss / d logp, ratio) through GRPOLoss.token_losses."""
    loss_fn = GRPOLoss(config, None, VOCAB)
    logps = torch.tensor([[logp]], dtype=torch.float64, requires_grad=True)
    found = GRPOTargets(
        labels=torch.tensor([[1]]),
        old_logps=torch.tensor([[old]], dtype=torch.float64),
        ref_logps=None if ref is None else torch.tensor([[ref]], dtype=torch.float64),
        advantages=torch.tensor([advantage], dtype=torch.float64),
        normaliser=torch.tensor(1.0),
    )
    per_token, ratio, _ = loss_fn.token_losses(logps, found, torch.tensor([[True]]))
    per_token.sum().backward()
    return float(per_token.detach()), float(logps.grad), float(ratio)


@pytest.mark.parametrize(
    ("shift", "advantage", "clipped"),
    [
        (math.log(1.3), 1.0, True),  # ratio 1.3 > 1 + 0.2, pushing further up: clipped, no gradient
        (math.log(1.3), -1.0, False),  # ratio 1.3 with a negative advantage: the unclipped term is the min
        (math.log(0.7), -1.0, True),  # ratio 0.7 < 1 - 0.2, pushing further down: clipped
        (math.log(0.7), 1.0, False),
        (math.log(1.1), 1.0, False),  # inside the trust region
    ],
)
def test_clipping_stops_the_gradient_only_beyond_the_bound_in_the_advantages_direction(shift, advantage, clipped):
    config = _config(iterations=2)
    loss, grad, ratio = _token(config, logp=-1.0 + shift, old=-1.0, advantage=advantage)
    assert ratio == pytest.approx(math.exp(shift))
    bound = min(max(ratio, 0.8), 1.2)
    assert loss == pytest.approx(-min(ratio * advantage, bound * advantage))
    assert grad == (0.0 if clipped else pytest.approx(-advantage * ratio))


def test_epsilon_high_moves_only_the_upper_bound():
    config = _config(iterations=2, epsilon_high=0.28)
    assert _token(config, math.log(1.25), 0.0, 1.0)[1] == pytest.approx(-1.25)  # 1.25 < 1.28: not clipped
    assert _token(config, math.log(1.3), 0.0, 1.0)[1] == 0.0
    assert _token(config, math.log(0.75), 0.0, -1.0)[1] == 0.0  # the lower bound stays 1 - 0.2


@pytest.mark.parametrize("corrected", [True, False])
def test_kl_is_the_k3_estimator_zero_with_no_pull_at_the_reference(corrected):
    config = _config(iterations=2, beta=0.5, use_bias_correction_kl=corrected)
    loss, grad, _ = _token(config, logp=-2.0, old=-2.0, advantage=0.0, ref=-2.0)
    assert loss == 0.0 and grad == 0.0
    loss, grad, _ = _token(config, logp=-2.0, old=-2.0, advantage=0.0, ref=-1.5)
    k3 = math.exp(0.5) - 0.5 - 1
    assert loss == pytest.approx(0.5 * k3)  # the ratio is 1: the same value either way
    # d/dlogp of k3 = e^(ref - logp) - (ref - logp) - 1 is 1 - e^0.5; TRL's correction multiplies k3 by the
    # ratio e^(logp - old), whose own derivative (1) adds k3
    assert grad == pytest.approx(0.5 * (1 - math.exp(0.5) + (k3 if corrected else 0.0)))


def test_one_iteration_is_the_policy_gradient_with_ratio_one():
    """iterations = 1 and no old log-probs (TRL's on-policy case): every ratio is 1, nothing is clipped,
    and dapo's loss is minus the token-weighted mean advantage."""
    config = _config()
    logits, labels, _, _, advantages = _batch(seed=3)
    loss, sums = _ours(logits, labels, None, None, advantages, config, microbatches=2)
    tokens = torch.tensor([end - first for first, end in COMPLETION], dtype=torch.float32)
    assert float(loss) == pytest.approx(float(-(advantages * tokens).sum() / tokens.sum()), rel=1e-6)
    assert sums[:3].tolist() == [0.0, 0.0, 0.0]
    metrics = metrics_of(sums, with_kl=False)
    assert metrics["clip_ratio/region_mean"] == 0.0 and "kl" not in metrics
    assert metrics["completions/mean_length"] == float(tokens.mean())


def test_clip_metrics_count_trls_clipped_tokens():
    config = _config(iterations=2, beta=0.1)
    logits, labels, old, ref, advantages = _batch(seed=1)  # 3 tokens clipped low, 2 high, 3 outside unclipped
    loss_fn = GRPOLoss(config, None, VOCAB)
    loss_fn(logits, pack_targets(labels, old, ref, advantages, 1.0))
    metrics = metrics_of(loss_fn.take_sums(), with_kl=True)
    logps, mask = token_logps(logits, labels, None, VOCAB), labels != IGNORE_INDEX
    ratio, a = torch.exp(logps - old), advantages.unsqueeze(1)
    low, high = ((ratio < 0.8) & (a < 0) & mask).sum(), ((ratio > 1.2) & (a > 0) & mask).sum()
    assert 0 < low and 0 < high  # the batch clips on both sides, so the counts are tested
    assert metrics["clip_ratio/low_mean"] == pytest.approx(float(low / mask.sum()))
    assert metrics["clip_ratio/high_mean"] == pytest.approx(float(high / mask.sum()))
    assert metrics["clip_ratio/region_mean"] == pytest.approx(float((low + high) / mask.sum()))
    delta = (ref - logps) * mask
    kl = (delta.exp() - delta - 1) * ratio  # TRL logs the KL with its ratio correction
    assert metrics["kl"] == pytest.approx(float((kl * mask).sum() / mask.sum()), rel=1e-6)
    assert loss_fn.take_sums() is None


def test_missing_log_probs_are_refused():
    logits, labels, old, ref, advantages = _batch()
    with pytest.raises(RuntimeError, match="iterations > 1 needs the generating policy's log-probs"):
        GRPOLoss(_config(iterations=2), None, VOCAB)(logits, pack_targets(labels, None, ref, advantages, 1.0))
    with pytest.raises(RuntimeError, match="beta > 0 needs the reference's log-probs"):
        GRPOLoss(_config(beta=0.1), None, VOCAB)(logits, pack_targets(labels, old, None, advantages, 1.0))


def test_temperature_divides_the_logits_as_trls_log_probs():
    logits, labels, *_ = _batch()
    cooled = token_logps(logits, labels, None, VOCAB, temperature=0.7)
    expected = torch.log_softmax(logits / 0.7, dim=-1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(cooled, expected * (labels != IGNORE_INDEX), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("with_old", [False, True])
@pytest.mark.parametrize("with_ref", [False, True])
def test_packed_targets_come_back_exactly_from_any_rows(with_old, with_ref):
    _, labels, old, ref, advantages = _batch()
    labels[0, -1] = 250_000  # a large vocabulary's id
    targets = pack_targets(labels, old if with_old else None, ref if with_ref else None, advantages, 2.5)
    for rows in (slice(None), slice(1, 3)):
        got = unpack_targets(targets[rows])
        assert torch.equal(got.labels, labels[rows]) and float(got.normaliser) == 2.5
        assert torch.equal(got.advantages, advantages[rows].double())
        for given, back in ((with_old, got.old_logps), (with_ref, got.ref_logps)):
            assert (back is not None) == given
        if with_old:
            assert torch.equal(got.old_logps, old[rows].double())
        if with_ref:
            assert torch.equal(got.ref_logps, ref[rows].double())


# -- settings --------------------------------------------------------------------------------------------
def test_trls_defaults_and_a_toml_section_parse():
    config = _config()
    assert (config.generations, config.loss_type, config.scale_rewards, config.beta) == (8, "dapo", "group", 0.0)
    assert config.upper_epsilon == 0.2 and _config(epsilon_high=0.28).upper_epsilon == 0.28
    parsed = from_dict(
        {"grpo": {"generations": 4, "stop": ["\n"], "rewards": [{"function": "m:f", "weight": 2}, REWARDS[0]]}}
    ).grpo
    assert parsed.generations == 4 and parsed.rewards[0].weight == 2.0 and parsed.rewards[1].function == "exact_answer"


@pytest.mark.parametrize(
    ("values", "named"),
    [
        ({"generations": 1}, "grpo.generations=1 must be an integer >= 2"),
        ({"max_completion_length": 0}, "grpo.max_completion_length=0 must be an integer >= 1"),
        ({"temperature": 0}, "grpo.temperature=0 must be > 0"),
        ({"top_p": 1.5}, r"grpo.top_p=1.5 must be in \(0, 1\]"),
        ({"top_k": -1}, "grpo.top_k=-1 must be an integer >= 0"),
        ({"stop": ["", "x"]}, "grpo.stop=.* must be a list of non-empty texts"),
        ({"epsilon": 1.0}, r"grpo.epsilon=1.0 must be in \(0, 1\)"),
        ({"epsilon_high": 0}, "grpo.epsilon_high=0 must be > 0"),
        ({"beta": -0.1}, "grpo.beta=-0.1 must be >= 0"),
        ({"use_bias_correction_kl": 1}, "grpo.use_bias_correction_kl=1 must be true or false"),
        ({"loss_type": "cispo"}, "grpo.loss_type='cispo' must be one of"),
        ({"scale_rewards": "std"}, "grpo.scale_rewards='std' must be one of"),
        ({"iterations": 0}, "grpo.iterations=0 must be an integer >= 1"),
        ({"rewards": []}, r"grpo.rewards is empty; give at least one \[\[grpo.rewards\]\]"),
    ],
)
def test_bad_grpo_settings_are_one_line_errors(values, named):
    rewards = values.pop("rewards", REWARDS)
    with pytest.raises(ConfigError, match=named) as caught:
        GRPOConfig(rewards=rewards, **values)
    assert "\n" not in str(caught.value)


# -- on the mesh ---------------------------------------------------------------------------------------------
def _on_two_ranks(kind: str):
    """On 2 ranks: (the loss and this rank's logit-gradient columns with the vocabulary split over them as tp,
    the loss and gradient of this rank's half of the rows as a data-parallel replica)."""
    import torch.distributed as dist

    config = _config(loss_type=kind, iterations=2, beta=0.1, temperature=0.7)
    logits, labels, old, ref, advantages = _batch(seed=4)
    logits = torch.cat([logits, logits[..., :1] - 1.0], dim=-1)  # 8 columns: 4 a rank
    rank, group = dist.get_rank(), dist.group.WORLD
    columns = slice(4 * rank, 4 * rank + 4)
    shard = logits[..., columns].clone().requires_grad_(True)
    targets = pack_targets(labels, old, ref, advantages, loss_normaliser(config, labels, None, 1))
    tp_loss = GRPOLoss(config, group, VOCAB + 1)(shard, targets)
    tp_loss.backward()
    rows = slice(2 * rank, 2 * rank + 2)
    part = logits[rows].clone().requires_grad_(True)
    normaliser = loss_normaliser(config, labels[rows], group, 1)  # dapo: one all-reduce of the token count
    dp_targets = pack_targets(labels[rows], old[rows], ref[rows], advantages[rows], normaliser)
    dp_loss = GRPOLoss(config, None, VOCAB + 1)(part, dp_targets)
    dp_loss.backward()
    return float(tp_loss.detach()), shard.grad, float(dp_loss.detach()), part.grad


@pytest.mark.parametrize("kind", ["dapo", "grpo"])
def test_tp_and_dp_ranks_give_one_processs_loss_and_gradient(distributed, kind):
    """tp: the vocabulary-parallel log-softmax (no rank gathers the logits) gives every rank the whole loss and
    its columns' gradient; dp: the replicas' losses average to the whole batch's (the normaliser counts both)."""
    config = _config(loss_type=kind, iterations=2, beta=0.1, temperature=0.7)
    logits, labels, old, ref, advantages = _batch(seed=4)
    logits = torch.cat([logits, logits[..., :1] - 1.0], dim=-1).requires_grad_(True)
    targets = pack_targets(labels, old, ref, advantages, loss_normaliser(config, labels, None, 1))
    loss = GRPOLoss(config, None, VOCAB + 1)(logits, targets)
    loss.backward()
    results = distributed.run(2, _on_two_ranks, kind)
    for rank, (tp_loss, tp_grad, _, _) in enumerate(results):
        assert tp_loss == pytest.approx(float(loss.detach()), rel=1e-6, abs=1e-7)
        torch.testing.assert_close(tp_grad, logits.grad[..., 4 * rank : 4 * rank + 4], rtol=1e-5, atol=1e-7)
    # dp averages the replicas' gradients: each replica's own rows' gradient, halved, is the whole batch's
    assert sum(r[2] for r in results) / 2 == pytest.approx(float(loss.detach()), rel=1e-6, abs=1e-7)
    averaged = torch.cat([r[3] for r in results]) / 2
    torch.testing.assert_close(averaged, logits.grad, rtol=1e-5, atol=1e-7)
