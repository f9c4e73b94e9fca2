"""model.init = "gpt2" against "depth" on a small Llama, one process: the same rows, order, seed and schedule.

Issue 34: torchtitan's first gradient norm on its Llama debug model was 1.3 and ours 18.8, so the
clip at 1.0 throttled our first steps. This trains the same Llama twice, once per initialisation
rule, and prints the loss and the gradient norm (before clipping) of every step.

    python -m polyshard.bench.init_rules                 # dim 256, 6 layers, 16 heads, vocab 2048, rows of 256
    python -m polyshard.bench.init_rules --hidden 128 --layers 4 --heads 8 --seq 128   # a busy machine's size

One process, CPU is fine: the numbers that matter are losses and norms, not times.
"""

from __future__ import annotations

import argparse
import math

import numpy as np
import torch
import torch.nn.functional as F

from polyshard.models import build_model, spec_of
from polyshard.models.common import RopeConfig
from polyshard.models.gpt.config import GPTConfig
from polyshard.models.gpt.presets import PRESETS
from polyshard.trainer.config import Config, DataConfig, LRScheduleConfig, OptimizerConfig, TrainingConfig
from polyshard.trainer.data import language_data
from polyshard.trainer.engine.optimizer import param_groups
from polyshard.trainer.engine.schedule import schedule_of


def config_for(rule: str, args: argparse.Namespace) -> Config:
    llama = {**PRESETS["llama-tiny"], "hidden": args.hidden, "num_layers": args.layers, "num_heads": args.heads,
             "num_kv_heads": args.heads, "mlp_hidden": 3 * args.hidden, "vocab_size": args.vocab,
             "context_length": args.seq, "rope": RopeConfig(theta=500000.0)}  # fmt: skip
    return Config(
        model=GPTConfig(**llama, init=rule),
        training=TrainingConfig(steps=args.steps, global_batch_size=args.batch, seed=args.seed),
        optimizer=OptimizerConfig(lr=8e-4, weight_decay=0.1, grad_clip=1.0),
        lr_schedule=LRScheduleConfig(min_lr=8e-5, warmup_steps=3),
        data=DataConfig(source=args.data),
    )


def train(config: Config) -> tuple[list[float], list[float]]:
    """(loss, gradient norm before the clip) of every step."""
    torch.manual_seed(config.training.seed)
    model = build_model(config.model, seed=config.training.seed)
    train_cfg, chosen = config.training, config.optimizer
    groups = param_groups(model.named_parameters(), chosen.weight_decay, spec_of(config.model).decays)
    optimizer = torch.optim.AdamW(groups, lr=chosen.lr, betas=(chosen.beta1, chosen.beta2))
    schedule = schedule_of(config)
    rows = language_data(config).train[0]
    order = np.random.default_rng(train_cfg.seed).permutation(len(rows))  # the same rows for every rule
    losses, norms = [], []
    for step in range(train_cfg.steps):
        picked = order[step * train_cfg.global_batch_size : (step + 1) * train_cfg.global_batch_size]
        tokens = torch.from_numpy(rows.rows(picked)["tokens"].astype(np.int64))
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), chosen.grad_clip))
        for group in optimizer.param_groups:
            group["lr"] = schedule(step)
        optimizer.step()
        losses.append(float(loss.detach()))
        norms.append(norm)
        print(f"  step {step + 1:3d}  loss {losses[-1]:.4f}  grad norm {norm:.3f}", flush=True)
    return losses, norms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=8, help="rows per step")
    parser.add_argument("--seq", type=int, default=256, help="tokens per row")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data", default="shakespeare", help="a data.source: shakespeare, synthetic, a folder")
    args = parser.parse_args()
    results = {}
    for rule in ("gpt2", "depth"):
        print(f"model.init = {rule!r}")
        results[rule] = train(config_for(rule, args))
    print(f"\nuniform guess: ln({args.vocab}) = {math.log(args.vocab):.3f}")
    print("rule    loss@1   loss@10  loss@" + f"{args.steps:<4d}" + " grad norms of steps 1-3")
    for rule, (losses, norms) in results.items():
        at10 = losses[min(9, len(losses) - 1)]
        print(
            f"{rule:6s}  {losses[0]:.4f}   {at10:.4f}   {losses[-1]:.4f}   " + ", ".join(f"{n:.2f}" for n in norms[:3])
        )


if __name__ == "__main__":
    main()
