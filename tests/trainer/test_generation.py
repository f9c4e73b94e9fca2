"""Generation on the training mesh (polyshard.trainer.loop.generation): on one process the engine draws what
the model's own cached generation draws with the same uniforms; on dp2, tp2 (a vocabulary tp pads) and
ZeRO-3 dp2 the completions are one process's exactly, with data ranks holding different numbers of prompts;
the draw's top-k, top-p and inverse CDF; the layouts and prompts it refuses, by name."""

from __future__ import annotations

import random

import pytest
import torch

from polyshard.mesh import Mesh
from polyshard.models import build_model
from polyshard.models.common import Attention, Block
from polyshard.trainer.config import from_dict
from polyshard.trainer.errors import ConfigError, DataError
from polyshard.trainer.loop.generation import Sampling, check_generation, choose_tokens, generate, uniforms

VOCAB = 251  # odd: tp2 pads the head to 252 columns, and the padding column must never be drawn
SEED = 7
SAMPLES = 3
# About one token in eight stops a completion, so they end at different lengths (and some run to the end).
SAMPLING = Sampling(max_new_tokens=10, temperature=1.3, top_p=0.95, top_k=120, stop_ids=tuple(range(0, VOCAB, 8)))
_rng = random.Random(0)
PROMPTS = [[_rng.randrange(1, VOCAB) for _ in range(_rng.randint(1, 6))] for _ in range(5)]


def _config(llama: bool = False, loss_chunks: int = 1, compile: bool = False, lora: bool = False, **parallel):
    # dropout 0.1: a forward left in train mode would draw other tokens than the model in eval mode
    model = {"kind": "gpt", "vocab_size": VOCAB, "hidden": 32, "num_layers": 2, "num_heads": 4, "context_length": 16}
    model |= {"dropout": 0.1}
    if llama:
        model |= {"norm": "rms", "activation": "swiglu", "positions": "rope", "bias": False, "num_kv_heads": 2}
    training = {"seed": 3, "loss_chunks": loss_chunks, "compile": compile}
    adapters = {"lora": {"rank": 4, "alpha": 8.0, "targets": "all-linear"}} if lora else {}
    return from_dict({"model": model, "parallel": parallel, "training": training, **adapters})


def _generate_on_layout(config):
    """The worker: this data rank's share of PROMPTS (rank 0 holds one more: an idle round for the other)."""
    from polyshard.trainer.engine.builder import build_engine

    mesh = Mesh(config.parallel.mesh_axes)
    engine = build_engine(config, mesh)
    data_ranks, data_rank = config.parallel.data_ranks, mesh.group_rank(config.parallel.batch_axes)
    bounds = [len(PROMPTS) * r // data_ranks + (r > 0) * (len(PROMPTS) % data_ranks > 0) for r in range(data_ranks)]
    bounds = [*bounds, len(PROMPTS)]
    first, end = bounds[data_rank], bounds[data_rank + 1]
    completions = generate(engine, PROMPTS[first:end], SAMPLES, SAMPLING, seed=SEED, first_row=first)
    stages = list(engine.stages.values())
    return {
        "data_rank": data_rank,
        "completions": completions,
        "training": all(m.training for stage in stages for m in stage.modules()),
        "caches_removed": all(m.kv_cache is None for s in stages for m in s.modules() if isinstance(m, Attention)),
        # training.compile: each block's compiled forward, set aside while generating, is back
        "compiled": [callable(vars(m).get("forward")) for s in stages for m in s.modules() if isinstance(m, Block)],
        "adapters": sum(p.requires_grad for s in stages for p in s.parameters()),
    }


def _by_data_rank(results):
    """Every data rank's completions in row order; the ranks of one data rank (tp) must agree."""
    ranks: dict[int, list] = {}
    for result in results:
        assert result["training"] and result["caches_removed"]
        assert ranks.setdefault(result["data_rank"], result["completions"]) == result["completions"]
    return [c for rank in sorted(ranks) for c in ranks[rank]]


@pytest.fixture(scope="module")
def one_process(distributed):
    return {llama: _by_data_rank(distributed.run(1, _generate_on_layout, _config(llama))) for llama in (False, True)}


def _model_generation(config):
    """The model's own cached generation (GPT.generate) of every prompt's samples with the engine's uniforms,
    cut after the first stop id (run in a worker, as the engine's one-process run is)."""
    model = build_model(config.model, seed=config.training.seed).eval()
    completions = []
    for i, prompt in enumerate(PROMPTS):
        draws = uniforms(SEED, i, SAMPLES, SAMPLING.max_new_tokens)

        def choose(logits, position, draws=draws):
            return choose_tokens(logits, draws[:, position], SAMPLING).unsqueeze(1)

        out = model.generate(torch.tensor([prompt] * SAMPLES), SAMPLING.max_new_tokens, cache=True, choose=choose)
        for row in out[:, len(prompt) :].tolist():
            end = next((k + 1 for k, t in enumerate(row) if t in SAMPLING.stop_ids), len(row))
            completions.append(row[:end])
    return completions


@pytest.mark.parametrize("llama", [False, True], ids=["gpt2", "llama"])
def test_the_engine_draws_what_the_models_cached_generation_draws(distributed, one_process, llama):
    expected = distributed.run(1, _model_generation, _config(llama))[0]
    assert one_process[llama] == expected
    lengths = {len(c) for c in expected}
    assert 1 < len(lengths) and SAMPLING.max_new_tokens in lengths  # some stopped early, some ran to the end
    assert all(c[-1] in SAMPLING.stop_ids for c in expected if len(c) < SAMPLING.max_new_tokens)


@pytest.mark.parametrize(
    ("llama", "parallel"),
    [
        (False, {"dp": 2}),
        (True, {"tp": 2}),
        (False, {"tp": 2}),
        (True, {"dp": 2, "zero_stage": 3}),
    ],
    ids=["gpt2-dp2", "llama-tp2", "gpt2-tp2", "llama-dp2-zero3"],
)
def test_every_layout_draws_one_process_completions(distributed, one_process, llama, parallel):
    results = distributed.run(2, _generate_on_layout, _config(llama, **parallel))
    assert _by_data_rank(results) == one_process[llama]


def test_a_chunked_loss_head_on_tp2_draws_one_process_completions(distributed, one_process):
    """With training.loss_chunks the head gives hidden states: generation projects them itself."""
    results = distributed.run(2, _generate_on_layout, _config(loss_chunks=2, tp=2))
    assert _by_data_rank(results) == one_process[False]


def test_lora_adapters_on_zero3_dp2_generate_through_the_base(distributed, one_process):
    """LoRA under ZeRO-3 (the frozen base sharded too): adapters start at B = 0, so the base's completions."""
    results = distributed.run(2, _generate_on_layout, _config(lora=True, dp=2, zero_stage=3))
    assert all(result["adapters"] > 0 for result in results)
    assert _by_data_rank(results) == one_process[False]


@pytest.mark.long  # ~4 s: building a compiled engine resets dynamo, though generation compiles nothing
def test_compiled_blocks_generate_uncompiled_and_stay_compiled(distributed, one_process):
    """Under training.compile generation runs the eager blocks (nothing compiles), then puts the compiled back."""
    (result,) = distributed.run(1, _generate_on_layout, _config(compile=True))
    assert result["compiled"] == [True, True]
    assert _by_data_rank([result]) == one_process[False]


def test_the_draw_keeps_top_k_then_top_p_and_walks_the_cdf_in_token_order():
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]])
    logits = probs.log()

    def drawn(u, **settings):
        return int(choose_tokens(logits, torch.tensor([u]), Sampling(max_new_tokens=1, **settings))[0])

    # no cut: the CDF in token order is 0.05, 0.55, 0.7, 1.0
    assert [drawn(u) for u in (0.0, 0.04, 0.06, 0.6, 0.71, 0.999)] == [0, 0, 1, 2, 3, 3]
    # top_p 0.7: tokens 1 (0.5) and 3 (0.3) reach it; kept mass 0.8, CDF 0.5 then 0.8 (as 0.625, 1.0)
    assert [drawn(u, top_p=0.7) for u in (0.0, 0.6, 0.7, 0.999)] == [1, 1, 3, 3]
    # top_k 3 drops token 0, then top_p 0.5 keeps token 1 alone
    assert {drawn(u, top_k=3) for u in (0.0, 0.01)} == {1} and drawn(0.99, top_k=3, top_p=0.5) == 1
    assert drawn(0.99, temperature=0.0) == 1  # greedy
    assert drawn(0.06, temperature=100.0) == 0  # nearly flat: 0.06 falls in the first quarter


def test_what_generation_refuses_is_named():
    with pytest.raises(ConfigError, match="top_p=1.5"):
        Sampling(max_new_tokens=4, top_p=1.5)
    with pytest.raises(ConfigError, match="max_new_tokens=0"):
        Sampling(max_new_tokens=0)
    for parallel, name in (({"pp": 2}, "parallel.pp=2"), ({"cp": 2}, "parallel.cp=2")):
        with pytest.raises(ConfigError, match=name):
            check_generation(_config(**parallel), SAMPLING)
    with pytest.raises(ConfigError, match="sequence_parallel"):
        check_generation(_config(tp=2, sequence_parallel=True), SAMPLING)
    with pytest.raises(ConfigError, match="context of 16"):
        check_generation(_config(), Sampling(max_new_tokens=17))


def _refused_prompt(config, prompts):
    from polyshard.trainer.engine.builder import build_engine

    engine = build_engine(config, Mesh(config.parallel.mesh_axes))
    try:
        generate(engine, prompts, 2, SAMPLING, seed=0, first_row=40)
    except DataError as error:
        return str(error)
    return None


def test_a_bad_prompt_is_named_by_its_row(distributed):
    assert "row 41 is empty" in distributed.run(1, _refused_prompt, _config(), [[1, 2], []])[0]
    too_long = distributed.run(1, _refused_prompt, _config(), [[1] * 8])[0]
    assert "row 40 has 8 tokens" in too_long and "past the context of 16" in too_long
