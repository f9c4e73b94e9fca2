"""Each routing rule of moe-gpt trained on expert-parallel layouts against one process.

Six AdamW steps (weight decay 0.1, warmup then cosine) through the real step
(:func:`polyshard.trainer.loop.train_step`: pipeline executor, dp/ZeRO wrappers, tp plan,
clip, the experts' load all-reduce and the bias update) on live processes, compared with one
process on the same config and data: the losses, the gradient norms before clipping, the
router weights after the last step, and every sigmoid router's selection bias, which must be
bitwise equal on every rank and to one process's (it moves by exact steps from integer counts).

The Switch load-balancing loss is off (its per-rank batches make it differ by layout by design,
see test_e2e_parity.MOE_RTOL); the sigmoid rules carry the sequence-wise balance loss and the
z-loss instead, both means over sequences or tokens that no layout changes.
"""

import dataclasses

import pytest
import torch

from polyshard.mesh import Mesh
from polyshard.models.common.moe import MoELayer
from polyshard.trainer.config import from_dict
from tests._layouts import LAYOUTS
from tests._short import short_run
from tests.trainer.test_e2e_parity import _stop_and_resume

STEPS = 6
# Layouts change only the order of float32 sums (all-reduces, the experts' grouped rows, tp's
# vocabulary-parallel loss): ~1e-7 relative per step, compounded over six AdamW steps (as DENSE_RTOL
# in test_e2e_parity). A routing decision flipped by such round-off would break far more than this.
RTOL = 2e-5

RULES = {
    "softmax": {},  # Mixtral: top-k of the softmax, renormalised
    "softmax-raw": {"router_renormalize": False},  # Qwen-MoE as configured: the raw probabilities
    "sigmoid": {  # DeepSeek-V3: sigmoid affinities, aux-loss-free bias, seq-wise loss, z-loss, scale
        "router": "sigmoid",
        "router_bias_update_rate": 0.01,
        "seq_aux_loss_weight": 0.01,
        "router_z_loss_weight": 0.001,
        "router_scale": 2.5,
    },
    "grouped": {  # DeepSeek-V3's group-limited choice: 2 groups of 2 experts, the best one per token
        "router": "sigmoid",
        "router_bias_update_rate": 0.01,
        "router_groups": 2,
        "router_group_topk": 1,
        "top_k": 2,
    },
}


def _config(corpus, rule, capacity_factor=None, **parallel):
    model = dict(RULES[rule])
    model |= {"capacity_factor": capacity_factor} if capacity_factor else {}
    return from_dict(
        {
            "model": {
                "kind": "moe-gpt",
                "hidden": 32,
                "num_layers": 2,
                "num_heads": 4,
                "context_length": 16,
                "num_experts": 4,
                "aux_loss_weight": 0.0,
                **model,
            },
            "parallel": parallel,
            **short_run(STEPS),
            "data": {"source": corpus},
            "logging": {"progress_bar": False},
        }
    )


def _routers(engine):
    """Global name -> this rank's router of every MoE layer it holds."""
    out = {}
    for index, stage in engine.stages.items():
        for name, module in stage.named_modules():
            if isinstance(module, MoELayer):
                position, _, rest = name.partition(".")
                out[f"layers.{engine.layer_ids[index][int(position)]}.{rest}.router"] = module.router
    return out


def _router_weights(engine):
    """Global name -> the router weights this rank holds (ZeRO-3: gathered whole, a collective over dp)."""
    if engine.config.parallel.zero_stage < 3:
        return {f"{n}.weight": r.weight.detach().clone() for n, r in _routers(engine).items()}
    out = {}
    for index, wrapper in engine.wrappers.items():
        names = engine.global_names(index)
        full = wrapper.full_parameters()  # ZeRO-3 frees a layer's parameters after use
        out |= {names[n]: t.clone() for n, t in full.items() if n.endswith("router.weight")}
    return out


def _run(config):
    from polyshard.trainer.engine.builder import build_engine
    from polyshard.trainer.engine.schedule import schedule_of
    from polyshard.trainer.loop import make_loaders, split_batch, train_step

    mesh = Mesh(config.parallel.mesh_axes)
    torch.manual_seed(config.training.seed)
    engine = build_engine(config, mesh)
    train_data, _ = make_loaders(config, mesh)
    lr = schedule_of(config)
    losses, norms, biases = [], [], []
    for step in range(STEPS):
        measured = train_step(engine, *split_batch(config, train_data.next_batch()), lr=lr(step))
        losses.append(measured.loss)
        norms.append(measured.grad_norm)
        biases.append({n: r.bias.clone() for n, r in _routers(engine).items() if r.bias is not None})
    weights = _router_weights(engine)
    loads = {i: load.tokens_per_expert for i, load in measured.expert_load.items()}
    return losses + norms, weights, biases, loads


@pytest.fixture(scope="module")
def one_process(distributed, corpus):
    cache = {}

    def get(rule):
        if rule not in cache:
            config = _config(corpus, rule)
            cache[rule] = distributed.run(1, _run, config)[0]
        return cache[rule]

    return get


MOE_LAYOUTS = (
    "ep2",
    "ep4",
    "dp2xep2-zero1",
    "ep2xpp2",
    "ep2xtp2",
    "dp2-zero3",  # the bias beside parameters ZeRO-3 frees after use
    "cp2xep2",  # cp splits each sequence: the load sums over cp ranks too, the seq-wise loss sums each one's parts
)
# The default suite runs one layout per rule (each layout once); `make test-long` runs the whole table.
FAST = {"softmax": "ep2xpp2", "softmax-raw": "ep2", "sigmoid": "dp2xep2-zero1", "grouped": "ep2xtp2"}
ROWS = [
    pytest.param(rule, layout, id=f"{rule}-{layout}", marks=() if FAST[rule] == layout else pytest.mark.long)
    for rule in RULES
    for layout in MOE_LAYOUTS
]


@pytest.mark.parametrize("rule, layout", ROWS)
def test_routing_rule_matches_one_process(distributed, corpus, one_process, rule, layout):
    world, parallel = LAYOUTS[layout]
    reference = one_process(rule)
    results = distributed.run(world, _run, _config(corpus, rule, **parallel))
    numbers, weights, biases, loads = results[0]
    assert all(r[0] == numbers for r in results)  # every rank reports the same global losses and norms
    assert numbers == pytest.approx(reference[0], rel=RTOL)  # losses, then pre-clip gradient norms
    assert numbers[STEPS - 1] < numbers[0]  # and it learns
    for name, weight in weights.items():  # the router weights after six steps (their gradients include the aux losses)
        torch.testing.assert_close(weight, reference[1][name], rtol=RTOL, atol=1e-6)
    held = set()
    for _, _, rank_biases, rank_loads in results:
        assert rank_loads == reference[3]  # the last step's load per layer, summed over every token
        for step, step_biases in enumerate(rank_biases):
            for name, bias in step_biases.items():
                assert torch.equal(bias, reference[2][step][name]), (step, name)  # bitwise, every step
                held.add(name)
    if rule in ("sigmoid", "grouped"):
        assert held == set(reference[2][0]) and len(held) == 2  # every layer's bias is on some rank
        assert any(b.abs().sum() > 0 for step in reference[2] for b in step.values())  # and the bias did move


def test_the_rules_route_differently(one_process):
    # The table above would pass with a rule silently ignored: the four rules must give four runs.
    runs = [one_process(rule)[0] for rule in RULES]
    assert len({tuple(r) for r in runs}) == len(RULES)


def _saved_biases(folder, step=STEPS):
    from polyshard.checkpoint import step_dir
    from polyshard.trainer.checkpointing.run_export import consolidate

    return {k: v for k, v in consolidate(step_dir(folder / "checkpoints", step)).items() if k.endswith("router.bias")}


@pytest.mark.parametrize(
    "world, parallel",
    [
        pytest.param(2, {"ep": 2}, id="ep2"),
        pytest.param(
            4,
            {"ep": 2, "pp": 2, "microbatches": 2, "zero_stage": 1},
            id="ep2xpp2-zero1",
            marks=pytest.mark.long,
        ),
    ],
)
def test_resume_restores_the_bias_bitwise(distributed, corpus, tmp_path, world, parallel):
    config = _config(corpus, "sigmoid", **parallel)
    for whole, resumed in distributed.run(world, _stop_and_resume, config, tmp_path):
        assert resumed == whole  # exact: the resumed routing chooses with the saved bias
    whole, split = _saved_biases(tmp_path / "whole"), _saved_biases(tmp_path / "split")
    assert len(whole) == 2 and all(torch.equal(whole[n], split[n]) for n in whole)
    # the resumed run started from a moved bias: after 3 steps of +-rate each entry is odd multiples of rate
    halfway = _saved_biases(tmp_path / "split", STEPS // 2)
    assert all(b.abs().min() > 0 for b in halfway.values())


def _loaded_biases(config, source, out):
    from polyshard.trainer.loop import Trainer

    trainer = Trainer(config, Mesh(config.parallel.mesh_axes), out, log=False, init_from=source)
    return {f"{n}.bias": r.bias.clone() for n, r in _routers(trainer.engine).items()}


@pytest.mark.parametrize(
    "world, parallel",
    [
        pytest.param(1, {}, id="one-process", marks=pytest.mark.long),
        pytest.param(4, {"dp": 2, "tp": 2}, id="dp2xtp2"),
        pytest.param(4, {"ep": 2, "pp": 2, "microbatches": 2}, id="ep2xpp2", marks=pytest.mark.long),
    ],
)
def test_the_bias_reshards_into_another_layout(distributed, corpus, tmp_path_factory, world, parallel):
    # Saved on ep2 (after six updates), loaded on another mesh: every rank holds its layers' saved bias.
    folder = tmp_path_factory.getbasetemp() / "routing-ep2-source"
    if not folder.exists():
        distributed.run(2, _train_only, _config(corpus, "sigmoid", ep=2), folder)
    saved = _saved_biases(folder)
    from polyshard.checkpoint import step_dir

    source = step_dir(folder / "checkpoints", STEPS)
    held = {}
    for biases in distributed.run(world, _loaded_biases, _config(corpus, "sigmoid", **parallel), source, folder):
        for name, bias in biases.items():
            assert torch.equal(bias, saved[name]), name
            held[name] = bias
    assert held.keys() == saved.keys() and any(b.abs().sum() > 0 for b in held.values())


def _train_only(config, out):
    from polyshard.trainer.loop import train

    train(config, Mesh(config.parallel.mesh_axes), out, log=False)


# -- auxiliary-loss-free balancing brings a skewed router back ------------------------------------------

BALANCE_STEPS = 200


def _balance_curve(config, skew, steps=BALANCE_STEPS):
    """Train ``config`` with every router's bias started at ``skew`` toward expert 0 (each token takes it
    first); returns, per step, the worst layer's tokens of the busiest expert over the mean."""
    from polyshard.trainer.engine.builder import build_engine
    from polyshard.trainer.loop import make_loaders, split_batch, train_step

    mesh = Mesh(config.parallel.mesh_axes)
    torch.manual_seed(config.training.seed)
    engine = build_engine(config, mesh)
    for router in _routers(engine).values():
        router.bias[0] = skew
    train_data, _ = make_loaders(config, mesh)
    curve = []
    for _ in range(steps):
        measured = train_step(engine, *split_batch(config, train_data.next_batch()), lr=config.optimizer.lr)
        curve.append(max(load.max_over_mean for load in measured.expert_load.values()))
    return curve


@pytest.mark.long  # a training job (5 s)
def test_aux_loss_free_balancing_undoes_a_skewed_router(distributed, corpus):
    # 4 experts, top-2: with expert 0 in every token's choice its load is twice the mean (2.0).
    # The bias starts 0.1 toward it; at 0.002 a step the update takes it back in about 50 steps, and
    # then moves by steps small beside the spread of the affinities (~0.03 at this init), so the
    # load stays near the mean. DeepSeek-V3 uses 0.001 over far longer runs; the rule is the same.
    config = _config(corpus, "sigmoid")
    moe = dataclasses.replace(config.model.moe, seq_aux_loss_coef=0.0, bias_update_rate=0.002)
    model = dataclasses.replace(config.model, num_layers=1, moe=moe)
    training = dataclasses.replace(config.training, global_batch_size=16)  # 256 tokens a step: less count noise
    config = dataclasses.replace(config, model=model, training=training)
    balanced = distributed.run(1, _balance_curve, config, 0.1)[0]
    print("max/mean tokens per expert, step by step:", [round(v, 3) for v in balanced])
    assert balanced[0] == 2.0  # the skew holds at the start: expert 0 takes every token
    first = next(step for step, value in enumerate(balanced, 1) if value < 1.3)
    print(f"below 1.3 first at step {first}; mean of the last 50 steps {sum(balanced[-50:]) / 50:.3f}")
    assert first <= BALANCE_STEPS
    assert sum(balanced[-50:]) / 50 < 1.2  # and it stays balanced (a step's count of 256 tokens is noisy)
    # Without the update the same router stays skewed: the balance is the bias's doing, not training's.
    still = dataclasses.replace(config.model.moe, bias_update_rate=0.0)
    frozen = dataclasses.replace(config, model=dataclasses.replace(config.model, moe=still))
    skewed = distributed.run(1, _balance_curve, frozen, 0.1, 50)[0]
    assert min(skewed) > 1.8


def _train_logged(config, out):
    from polyshard.trainer.loop import Trainer

    trainer = Trainer(config, Mesh(config.parallel.mesh_axes), out)
    trainer.run()
    return {n: r.bias.clone() for n, r in _routers(trainer.engine).items()}


def test_the_run_folder_shows_each_layers_load(distributed, corpus, tmp_path):
    import json

    config = _config(corpus, "sigmoid", ep=2, capacity_factor=0.5)  # a tight capacity drops tokens
    config = dataclasses.replace(config, training=dataclasses.replace(config.training, steps=2))
    biases = distributed.run(2, _train_logged, config, tmp_path)[0]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    last = records[-1]
    for layer in (1, 2):  # the two blocks are pipeline layers 1 and 2
        counts = last[f"moe/layer{layer}/tokens_per_expert"]
        assert sum(counts) == 8 * 16 * 2  # every token of the global step, top-2
        assert last[f"moe/layer{layer}/tokens_max"] == max(counts)
        assert last[f"moe/layer{layer}/max_over_mean"] == pytest.approx(max(counts) / (sum(counts) / 4))
        assert last[f"moe/layer{layer}/dropped_tokens"] > 0
        bias = biases[f"layers.{layer}.mlp.moe.router"]  # after the last step's update, as the record says
        assert (last[f"moe/layer{layer}/bias_min"], last[f"moe/layer{layer}/bias_max"]) == (bias.min(), bias.max())
    assert (tmp_path / "expert_load.png").stat().st_size > 0


def test_dry_run_says_how_tokens_are_routed(corpus):
    from polyshard.planner.dry_run import describe

    grouped = describe(_config(corpus, "grouped", ep=2))
    assert "routing: sigmoid top-2 of 4 experts; within the best 1 of 2 groups; selection bias moved 0.01" in grouped
    assert "routing: softmax top-2 of 4 experts; balance losses: none" in describe(_config(corpus, "softmax"))
