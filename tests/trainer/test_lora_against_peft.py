"""A LoRA fine-tune here against the same fine-tune with ``peft`` + ``transformers`` + ``torch.optim.AdamW``
(issue 47's measure): a tiny random Llama, Qwen3 and Qwen3-MoE built with transformers, rank 8 on every
linear, started from one PEFT adapter folder (``lora.init = "peft:DIR"``: the same A on both sides, B zero),
trained 5 steps on the same batches with the same AdamW (betas, eps, decoupled weight decay on every
adapter matrix), the same learning rate each step and the same global-norm clip. Each step's loss, on one
process and on dp2 ZeRO-3, tp2 + SP and pp2 (ep2 for the MoE), equals peft's within float32 round-off, and
so do the adapters after the last step.

Tolerance: our loss and peft's are float32 sums taken in another order (fused attention, our vocabulary
loss, sharded matmuls), ~1e-6 relative per forward; five AdamW steps compound that to ~1e-5 (as
tests/trainer/test_e2e_parity.py's rows). The adapters: Adam's step of an entry whose gradient is at
round-off is set by noise (tests/_bounds.py's AdamWDrift); entries within a tenth of one update (lr 1e-3).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from polyshard.checkpoint import Checkpoint, latest_checkpoint
from polyshard.mesh import Mesh
from polyshard.trainer.checkpointing.hugging_face import model_settings
from polyshard.trainer.checkpointing.peft import write_peft
from polyshard.trainer.config import from_dict
from polyshard.trainer.engine.schedule import schedule_of
from polyshard.trainer.loop import train
from polyshard.trainer.loop.step import split_batch
from polyshard.trainer.loop.trainer import make_loaders
from tests._layouts import LAYOUTS

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

pytestmark = pytest.mark.long

STEPS = 5
LOSS_RTOL = 2e-5  # five AdamW steps of float32 sums taken in another order (module docstring)
LR = 1e-3


def _base(folder, family):
    if family == "llama":
        from tests.models.test_hf_llama import _save_llama

        return _save_llama(folder, tie=False)
    from tests.models.test_hf_moe import _save

    return _save(folder, family)


# Every linear; the MoE's attention projections alone: peft 0.21 on transformers 5 reads "all-linear" of a
# Qwen3-MoE as the fused routed experts too (one adapter over all of them), which our per-linear adapters
# are not (routed experts take none here).
TARGETS = {"qwen3_moe": ["q_proj", "k_proj", "v_proj", "o_proj"]}


def _adapter_folder(base, folder, family):
    """PEFT's own initialisation of rank-8 adapters (A Kaiming-uniform, B zero), saved."""
    torch.manual_seed(1)
    model = transformers.AutoModelForCausalLM.from_pretrained(base)
    targets = TARGETS.get(family, "all-linear")
    settings = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=targets)
    peft.get_peft_model(model, settings).save_pretrained(folder)
    return folder


def _config(base, corpus, adapters, family, **parallel):
    return from_dict(
        {
            # transformers adds its routers' load-balancing loss only with output_router_logits, which
            # a fine-tune's forward leaves off: ours is off too, so both train on the language loss alone.
            "model": {**model_settings(base), **({"moe.aux_loss_coef": 0.0} if family in TARGETS else {})},
            "parallel": parallel,
            "training": {
                "steps": STEPS,
                "global_batch_size": 4,
            },
            "optimizer": {
                "lr": LR,
                "weight_decay": 0.1,
            },
            "lr_schedule": {
                "min_lr": LR / 10,
                "warmup_steps": 1,
            },
            "eval": {
                "every": 0,
                "sample_tokens": 0,
            },
            "data": {"source": corpus},
            "logging": {"progress_bar": False},
            "lora": {
                "rank": 8,
                "alpha": 16.0,
                "targets": TARGETS.get(family, "all-linear"),
                "init": f"peft:{adapters}",
            },
        }
    )


def _ours(config, base, out):
    """Our run's losses, and (rank 0) its last checkpoint's adapters as ``--format peft`` writes them."""
    losses = train(config, Mesh(config.parallel.mesh_axes), out, log=False, init_from=f"hf:{base}").losses
    if torch.distributed.get_rank() != 0:
        return losses, None
    folder = write_peft(Checkpoint(latest_checkpoint(out / "checkpoints")), out / "peft")
    return losses, load_file(folder / "adapter_model.safetensors")


def _peft(config, base, adapters):
    """The same steps with peft + transformers + torch.optim.AdamW, on our loader's batches."""
    train_data, _ = make_loaders(config, Mesh(config.parallel.mesh_axes))
    model = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(base), adapters, is_trainable=True
    )
    params = [p for p in model.parameters() if p.requires_grad]
    settings = config.optimizer
    optimizer = torch.optim.AdamW(
        params, lr=LR, betas=(settings.beta1, settings.beta2), eps=1e-8, weight_decay=settings.weight_decay
    )
    learning_rate = schedule_of(config)
    losses = []
    for step in range(STEPS):
        inputs, labels = split_batch(config, train_data.next_batch())
        logits = model(inputs).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, settings.grad_clip)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    return losses, {k: v.detach().clone() for k, v in peft.get_peft_model_state_dict(model).items()}


ROWS = [("llama", name) for name in ("one-process", "dp2-zero3", "tp2-sp", "pp2-1f1b")]
ROWS += [("qwen3", "one-process"), ("qwen3", "tp2-sp"), ("qwen3_moe", "one-process"), ("qwen3_moe", "ep2")]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    made = {}
    for family in sorted({family for family, _ in ROWS}):
        base = _base(tmp_path_factory.mktemp(family), family)
        made[family] = (base, _adapter_folder(base, tmp_path_factory.mktemp(f"{family}-peft"), family))
    return made


@pytest.fixture(scope="module")
def theirs(distributed, folders, corpus):
    """peft's losses per family (one process; the batches are our loader's, the same on every layout)."""
    return {
        family: distributed.run(1, _peft, _config(base, corpus, adapters, family), base, adapters)[0]
        for family, (base, adapters) in folders.items()
    }


@pytest.mark.parametrize(("family", "name"), ROWS)
def test_a_lora_fine_tune_follows_peft_step_by_step(distributed, folders, corpus, theirs, tmp_path, family, name):
    base, adapters = folders[family]
    world, parallel = LAYOUTS[name]
    config = _config(base, corpus, adapters, family, **parallel)
    ours, adapters_after = distributed.run(world, _ours, config, base, tmp_path / "run")[0]
    their_losses, their_adapters = theirs[family]
    print(f"{family} {name}: ours {ours}, peft {their_losses}")
    assert ours == pytest.approx(their_losses, rel=LOSS_RTOL)
    assert ours[-1] < ours[0]  # it learns
    assert adapters_after.keys() == their_adapters.keys()  # the exported file names peft's own keys
    for key, value in their_adapters.items():
        assert float((adapters_after[key] - value).abs().max()) < LR / 10, key
