"""A training step returns what it measured (polyshard.trainer.loop.step.TrainStepResult) and leaves
nothing of it on the engine: a tiny MoE model with a multi-token prediction depth, one process. (One depth:
the load count keeps one MoE layer per pipeline layer, and two depths share the last one.)"""

import math

import torch

from polyshard.mesh import Mesh
from polyshard.trainer.config import from_dict

ROWS, LENGTH, VOCAB, EXPERTS, TOP_K, DEPTHS, WEIGHT = 4, 16, 67, 4, 2, 1, 0.3


def _config(weight=WEIGHT):
    model = {
        "kind": "moe-gpt",
        "hidden": 32,
        "num_layers": 2,
        "num_heads": 4,
        "num_kv_heads": 2,
        "context_length": LENGTH,
        "vocab_size": VOCAB,
        "norm": "rms",
        "activation": "swiglu",
        "positions": "rope",
        "bias": False,
        "mlp_hidden": 40,
        "mtp_depth": DEPTHS,
        "moe": {"num_experts": EXPERTS, "top_k": TOP_K},
    }
    training = {"steps": 1, "global_batch_size": ROWS, "mtp_loss_weight": weight}
    return from_dict({"model": model, "training": training})


def _step(config):
    from polyshard.trainer.engine.balance import moe_layers
    from polyshard.trainer.engine.builder import build_engine
    from polyshard.trainer.loop import train_step

    engine = build_engine(config, Mesh(config.parallel.mesh_axes))
    tokens = torch.randint(0, VOCAB, (ROWS, LENGTH + 1), generator=torch.Generator().manual_seed(3))
    attributes = dict(vars(engine))
    measured = train_step(engine, tokens[:, :-1], tokens[:, 1:], 1e-3)
    changed = sorted(k for k, v in vars(engine).items() if k not in attributes or attributes[k] is not v)
    return {
        "loss": measured.loss,
        "grad_norm": measured.grad_norm,
        "finite": measured.finite,
        "mtp_losses": measured.mtp_losses,
        "loads": {i: (load.tokens, load.tokens_per_expert) for i, load in measured.expert_load.items()},
        "moe_layers": sorted(moe_layers(engine)),
        "spans": len(measured.timeline.spans) if measured.timeline is not None else 0,
        "changed": changed,
        "left_on_engine": [name for name in ("mtp_losses", "expert_load", "timeline") if hasattr(engine, name)],
    }


def test_a_step_returns_its_mtp_losses_and_expert_load_and_sets_nothing_on_the_engine(distributed):
    got = distributed.run(1, _step, _config())[0]
    assert got["finite"] and got["grad_norm"] > 0
    # The depth's loss comes apart from the main loss: the weight scales its gradient (the same weights
    # and tokens with weight 0 give another norm) and neither reported loss.
    assert len(got["mtp_losses"]) == DEPTHS
    without = distributed.run(1, _step, _config(weight=0.0))[0]
    assert (without["loss"], without["mtp_losses"]) == (got["loss"], got["mtp_losses"])
    assert abs(without["grad_norm"] - got["grad_norm"]) > 0.1
    assert abs(got["mtp_losses"][0] - math.log(VOCAB)) < 1.0, got
    # One load per MoE layer (the trunk's and the depths'), each token routed to top_k experts.
    assert sorted(got["loads"]) == got["moe_layers"] and len(got["moe_layers"]) >= 2
    for tokens, per_expert in got["loads"].values():
        assert len(per_expert) == EXPERTS and sum(per_expert) == TOP_K * tokens and 0 < tokens <= ROWS * LENGTH
    assert got["loads"][min(got["loads"])][0] == ROWS * LENGTH  # the first block routes every input token
    assert got["spans"] > 0  # the executor's timeline of the step
    assert got["left_on_engine"] == [] and got["changed"] == [], got
