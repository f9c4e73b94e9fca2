"""A LoRA run's memory: ZeRO-3 shards the frozen base too, and ``model.frozen_dtype`` keeps it in bf16.
Measured on real engines after real steps (the bytes of live storages, polyshard.dp.bytes_held), not timed:
the parameters a rank holds fall to its ZeRO-3 rows and the frozen matrices to half their bytes, while a
bf16 base trains within bf16 round-off of the float32 run on one process and on dp2 ZeRO-3. A ZeRO-3 run
whose base is sharded trains as one process does (tests/_layouts.py's runner and
test_lora_parity's tolerance: losses, adapter gradients, adapters after AdamW steps with weight decay),
the base coming back from every rank's rows bit for bit as built."""

import functools

import pytest
import torch

from polyshard.dp import bytes_held
from polyshard.mesh import Mesh
from polyshard.models import build_model
from polyshard.models.common.lora import is_adapter
from polyshard.trainer.config import from_dict
from polyshard.trainer.errors import ConfigError
from tests._layouts import LONG
from tests._pieces import assemble
from tests._short import SMALL_LLAMA, short_run
from tests.trainer.test_lora_parity import TOLERANCE

STEPS = 4


def _config(corpus, frozen_dtype=None, **parallel):
    model = {"hidden": 32, "num_layers": 2, "num_heads": 4, "context_length": 16, **SMALL_LLAMA}
    return from_dict(
        {
            "model": {**model, "frozen_dtype": frozen_dtype},
            "parallel": parallel,
            **short_run(STEPS, lr=1e-2, weight_decay=2.0),
            "data": {"source": corpus},
            "logging": {"progress_bar": False},
            "lora": {"rank": 4, "alpha": 8.0, "targets": "all-linear"},
        }
    )


def _train(config, out):
    """This rank's losses and, after the last step, the bytes it holds (params, grads, optimizer state)
    and the bytes of its frozen parameters' storage (ZeRO-3: its rows; else the whole tensors)."""
    from polyshard.trainer.loop import Trainer

    mesh = Mesh(config.parallel.mesh_axes)
    trainer = Trainer(config, mesh, out, log=False)
    losses = trainer.run().losses
    engine = trainer.engine
    held = [0, 0, 0]
    for (_, wrapper), optimizer in zip(sorted(engine.wrappers.items()), engine.optimizers):
        report = bytes_held(wrapper, optimizer)
        held = [a + b for a, b in zip(held, (report.params, report.grads, report.optimizer_state))]
    frozen = 0
    for index, wrapper in engine.wrappers.items():
        if config.parallel.zero_stage == 3:
            tensors = {n: t for n, t in wrapper.local_shards().items() if not is_adapter(n)}
        else:
            tensors = {n: p for n, p in engine.stages[index].named_parameters() if not p.requires_grad}
        frozen += sum(t.numel() * t.element_size() for t in tensors.values())
    return {"losses": losses, "held": held, "frozen": frozen}


def _run(parity, world, config, out):
    return parity.run(world, config, out, _train)


def test_zero3_shards_the_frozen_base(parity, corpus, tmp_path):
    config_of = functools.partial(_config, corpus)
    (whole,) = _run(parity, 1, config_of(), tmp_path / "one")
    for rank in _run(parity, 2, config_of(dp=2, zero_stage=3), tmp_path / "zero3"):
        # Each rank holds its rows of every parameter: half, plus the padding of odd dims (88-wide MLP
        # rows split evenly; the vocabulary and the rank-4 adapters' dims too), well under 55%
        assert rank["held"][0] < 0.55 * whole["held"][0], (rank["held"], whole["held"])
        assert rank["frozen"] < 0.55 * whole["frozen"]
        # Gradients and AdamW state are the adapters' alone, halved again by ZeRO
        assert rank["held"][2] < 0.55 * whole["held"][2]


@pytest.mark.parametrize("world, parallel", [(1, {}), (2, {"dp": 2, "zero_stage": 3})], ids=["one", "dp2-zero3"])
def test_a_bf16_base_trains_within_round_off_and_halves_the_base(parity, corpus, tmp_path, world, parallel):
    config_of = functools.partial(_config, corpus)
    (fp32,) = _run(parity, 1, config_of(), tmp_path / "fp32")
    for rank in _run(parity, world, config_of("bfloat16", **parallel), tmp_path / "bf16"):
        # The frozen weights and the base products are rounded to bf16 (relative 2^-9 each), errors that
        # mostly average out over a row's sums: the losses moved by 5.7e-5 to 1.3e-4 of their size (one
        # process and dp2 ZeRO-3 alike). 1e-3 leaves room for other kernels; a base left in float32 gives
        # the fp32 losses exactly, and a lost adapter update or a misread base moves them by more.
        assert rank["losses"] != fp32["losses"]
        assert rank["losses"] == pytest.approx(fp32["losses"], rel=1e-3)
        # Every frozen matrix is 2 bytes an element instead of 4; only the norms (1-D) stay float32
        whole = fp32["frozen"] / world
        assert 0.5 * whole <= rank["frozen"] < 0.52 * whole, (rank["frozen"], whole)
        # The adapters' gradients and AdamW state stay float32: the same bytes as the fp32 run's share
        assert rank["held"][2] == pytest.approx(fp32["held"][2] / world, rel=0.05)


@pytest.mark.parametrize(
    "settings, says",
    [
        ({"lora": None}, "there is no [lora] section"),
        ({"training": {"precision": "bf16"}}, "mixed precision already keeps"),
        ({"training": {"loss_chunks": 4}}, "set loss_chunks = 0"),
        ({"model": {"frozen_dtype": "int8"}}, "must be one of ['bfloat16', 'float16']"),
    ],
    ids=["no-lora", "bf16-precision", "loss-chunks", "not-a-dtype"],
)
def test_frozen_dtype_needs_a_lora_run_in_fp32(corpus, settings, says):
    from polyshard.trainer.engine.constraints import validate

    raw = {
        "model": {"hidden": 32, "num_layers": 2, "num_heads": 4, "frozen_dtype": "bfloat16"},
        "training": {"global_batch_size": 8},
        "data": {"source": corpus},
        "lora": {"rank": 4},
    }
    for section, values in settings.items():
        raw[section] = None if values is None else {**raw[section], **values}
    with pytest.raises(ConfigError) as caught:
        validate(from_dict({k: v for k, v in raw.items() if v is not None}))
    assert says in str(caught.value) and "\n" not in str(caught.value)


# dp2 ZeRO-3 with the base in bf16 (its sharded units gather in bf16 beside the fp32 adapters'); (long) the
# head kept gathered through GPipe's two forwards before their backwards, and hybrid sharding
SHARDED_BASE = [
    pytest.param("dp2-zero3", "bfloat16", id="dp2-zero3-bf16-base"),
    pytest.param("dp2xpp2-gpipe-zero3", None, id="dp2xpp2-gpipe-zero3", marks=LONG),
    pytest.param("dp4-shard2-zero3", None, id="dp4-shard2-zero3", marks=LONG),
]


@pytest.mark.parametrize("name, frozen_dtype", SHARDED_BASE)
def test_a_sharded_base_trains_as_on_one_process(parity, corpus, tmp_path, name, frozen_dtype):
    config_of = functools.partial(_config, corpus, frozen_dtype)
    compared = parity.check(name, config_of, TOLERANCE, tmp_path)
    assert compared.names["grads"] and all(is_adapter(n) for n in compared.names["grads"])
    config = config_of()
    built = dict(build_model(config.model, seed=config.training.seed).named_parameters())
    after = assemble(compared.results, "params")
    frozen = [n for n in after if not is_adapter(n)]
    # The frozen base comes back from every rank's rows exactly as built (rounded once to its dtype)
    assert frozen and all(torch.equal(after[n], built[n].to(after[n].dtype)) for n in frozen)
    assert frozen_dtype is None or after[frozen[0]].dtype == torch.bfloat16
