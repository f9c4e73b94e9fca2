"""training.compile: every layout trains the same losses with its blocks compiled as eager.

Each compiled run is compared with the eager one-process run of the same config (as the e2e parity
table compares layouts). Compiling is slow on a CPU (tens of seconds per block graph), so all but the
one-process test are long; every test shares one inductor cache (tests/conftest.py), so a graph compiled
once is a cache hit for every later test and worker.
"""

import json

import pytest

from polyshard.mesh import Mesh
from polyshard.trainer.config import from_dict
from polyshard.trainer.loop import train
from tests._layouts import LAYOUTS
from tests._short import SMALL_LLAMA, short_run

STEPS = 4
# Inductor fuses elementwise work and reorders float32 sums inside a block (its kernels against eager's):
# ~1e-6 relative per op, compounded over a few AdamW steps; the same order as between two eager layouts.
COMPILE_RTOL = 1e-4
# The MoE aux loss differs between ep layouts on its own (see test_e2e_parity.MOE_RTOL).
MOE_RTOL = 2e-4
# A cold inductor cache on a busy 2-core machine: a few block graphs at up to a minute or two each.
TIMEOUT_S = 600

LLAMA = SMALL_LLAMA


def _config(corpus, kind="gpt", compiled=False, training=None, document_mask=False, **parallel):
    return from_dict(
        {
            "model": {"kind": kind, "hidden": 32, "num_layers": 2, "num_heads": 4, "context_length": 16, **LLAMA},
            "parallel": parallel,
            **short_run(STEPS, training={"compile": compiled, **(training or {})}),
            "data": {"source": corpus, "document_mask": document_mask},
            "logging": {"progress_bar": False},
        }
    )


def _train(config, out, log=False):
    result = train(config, Mesh(config.parallel.mesh_axes), out, log=log)
    return result.losses + result.grad_norms, result.compiled


# The eager one-process references, each run the first time a test asks for it (the default suite needs one).
REFERENCES = {
    "gpt": {},
    "moe-gpt": {"kind": "moe-gpt"},
    "gpt-bf16": {"training": {"precision": "bf16"}},
    "gpt-documents": {"document_mask": True},
}


@pytest.fixture(scope="module")
def eager(distributed, corpus, tmp_path_factory):
    out, runs = tmp_path_factory.mktemp("eager"), {}

    def reference(name):
        if name not in runs:
            runs[name] = distributed.run(1, _train, _config(corpus, **REFERENCES[name]), out)[0][0]
        return runs[name]

    return reference


def _check(got, want, rtol):
    assert got == pytest.approx(want, rel=rtol)


@pytest.mark.long  # 35 s of compiles; the compiled layouts are long too
def test_one_process_compiled_matches_eager_and_logs_its_compiles(distributed, corpus, eager, tmp_path):
    config = _config(corpus, compiled=True)
    [(numbers, compiled)] = distributed.run(1, _train, config, tmp_path, True, timeout_s=TIMEOUT_S)
    _check(numbers, eager("gpt"), COMPILE_RTOL)
    assert compiled is not None and compiled.startswith("compiled: 2 frames, 1 recompiles, 0 graph breaks"), compiled
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # Two blocks, two graphs: the pipeline's shape inference runs the first block without grad (dynamo's one
    # recompile, on grad mode; evaluation reuses it), then training with grad; the second block reuses both.
    assert records[0]["compile"]["frames"] == 2 and records[0]["compile"]["recompiles"] == 1, records[0]
    assert all("compile" not in r for r in records[1:]), "a later step compiled again"


# (model, layout, [training] settings, document masks)
ROWS = [
    pytest.param("gpt", "dp2-zero3", {}, False, id="dp2-zero3"),
    pytest.param("gpt", "dp2-zero1", {"precision": "bf16"}, False, id="dp2-zero1-bf16"),
    pytest.param("gpt", "tp2-sp", {}, False, id="tp2-sp"),
    pytest.param("gpt", "pp2-1f1b", {}, False, id="pp2-1f1b"),
    pytest.param("gpt", "pp2-zbh1-m2", {"activation_checkpointing": True}, False, id="pp2-zb-ac"),
    pytest.param("gpt", "cp2-ring", {}, False, id="cp2-ring"),
    pytest.param("gpt", "cp2-ulysses", {}, False, id="cp2-ulysses"),
    pytest.param("gpt", "dp2", {"activation_checkpointing": "selective"}, False, id="dp2-selective"),
    # Document masking: each microbatch's documents are set on the blocks around its forward.
    pytest.param("gpt", "pp2-1f1b", {}, True, id="pp2-documents"),
    pytest.param("moe-gpt", "ep2", {}, False, id="ep2"),
]


@pytest.mark.long
@pytest.mark.parametrize("kind, name, training, documents", ROWS)
def test_compiled_layouts_match_eager_one_process(
    distributed, corpus, eager, tmp_path, kind, name, training, documents
):
    world, parallel = LAYOUTS[name]
    parallel = {**parallel, "document_mask": True} if documents else parallel
    config = _config(corpus, kind, compiled=True, training=training, **parallel)
    results = distributed.run(world, _train, config, tmp_path, timeout_s=TIMEOUT_S)
    bf16 = training.get("precision") == "bf16"
    rtol = MOE_RTOL if kind == "moe-gpt" else COMPILE_RTOL
    if bf16:
        rtol = 2e-2  # bf16 compute: eager and compiled round at different places (a bf16 ulp is ~4e-3)
    for numbers, compiled in results:
        _check(numbers, eager("gpt-bf16" if bf16 else "gpt-documents" if documents else kind), rtol)
        assert compiled is not None and "recompiles" in compiled, compiled


def _train_each(configs, out):
    """Several layouts one after another on the same live workers: one launched job, not one per layout."""
    return {name: _train(config, out / name) for name, config in configs.items()}


# The rest of the e2e table's axes, grouped into one job per world size (each layout is a full run; grouping
# saves the job round trips, and the compiled graphs are shared through the inductor cache): every pipeline
# schedule, split backward included (W must not run a compiled block's backward again: test_split.py), with
# activation checkpointing full and selective; ZeRO-2 under bf16; cp's all-gather attention.
GROUPED = {
    "pp2-gpipe": ("gpt", {"pp": 2, "microbatches": 2, "schedule": "gpipe"}, {}),
    "pp2-interleaved": ("gpt", {"pp": 2, "microbatches": 2, "schedule": "interleaved", "virtual_stages": 2}, {}),
    "pp2-zbv-selective": (
        "gpt",
        {"pp": 2, "microbatches": 2, "schedule": "zb-v", "virtual_stages": 2},
        {"activation_checkpointing": "selective"},
    ),
    "pp2-dualpipev-ac": (
        "gpt",
        {"pp": 2, "microbatches": 4, "schedule": "dualpipev", "virtual_stages": 2},
        {"activation_checkpointing": True},
    ),
    "dp2-zero2-bf16": ("gpt", {"dp": 2, "zero_stage": 2}, {"precision": "bf16"}),
    "cp2-allgather": ("gpt", {"cp": 2, "cp_style": "allgather"}, {}),
}


@pytest.mark.long
def test_compiled_schedules_zero2_and_cp_allgather_match_eager_one_process(distributed, corpus, eager, tmp_path):
    configs = {
        name: _config(corpus, kind, compiled=True, training=training, **parallel)
        for name, (kind, parallel, training) in GROUPED.items()
    }
    for results in distributed.run(2, _train_each, configs, tmp_path, timeout_s=2 * TIMEOUT_S):
        for name, (numbers, compiled) in results.items():
            bf16 = GROUPED[name][2].get("precision") == "bf16"
            want = eager("gpt-bf16" if bf16 else "gpt")
            # bf16 compute: eager and compiled round at different places (a bf16 ulp is ~4e-3)
            assert numbers == pytest.approx(want, rel=2e-2 if bf16 else COMPILE_RTOL), name
            assert compiled is not None and "recompiles" in compiled, (name, compiled)
