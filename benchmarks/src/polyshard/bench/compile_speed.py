"""Benchmark (not a test): what ``training.compile`` buys, eager against compiled, in one run.

    polyshard bench compile                      # one block's forward + backward, then the demo job

1. **Blocks**: two :class:`polyshard.models.common.Block` (Llama's: RMSNorm, SwiGLU, rope; hidden 256,
   8 heads) on a batch of 8 x 128 tokens, forward + backward, in this process; eager, then each block
   compiled as the trainer compiles it (:func:`~polyshard.trainer.engine.compiling.compile_blocks`).
   Time per block, their ratio, and the first compiled call's time (compiling). Then the same blocks
   compiled with a graph break at each place tensor parallelism puts a collective (the entry and exit of
   attention and of the MLP; here an eager identity, so no communication is timed): what splitting the
   block at its collectives costs against one whole graph (see polyshard-tp's README).
   Beside them, in the same turns, a 1024 x 1024 x 1024 float32 matmul: the rate this machine multiplies
   at that moment; each block row's achieved GFLOP/s (its matmul FLOPs, counted by torch's FlopCounterMode,
   over its time) against it says how much of the step is matmul and so how much fusion can win at most.
2. **The demo**: ``polyshard train`` on the demo's config (8 processes, dp2 x tp2 x pp2) for a few steps,
   without and with ``--compile``; the median tokens/s over the steps after the compiled run's compiles,
   and the compile seconds its first step logged (rank 0's).
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

DEMO_CONFIG = Path("apps/configs/gpt-shakespeare-3d.toml")  # from the repository root, as `make demo` runs it


@dataclass
class Row:
    what: str
    eager: float  # ms per block, or tokens/s
    compiled: float
    unit: str
    compile_s: float
    speedup: float
    note: str = ""


def blocks(num_blocks: int = 2, hidden: int = 256, heads: int = 8) -> nn.Sequential:
    from polyshard.models.common import Block, RopeConfig

    torch.manual_seed(0)
    return nn.Sequential(
        *(
            Block(hidden, heads, norm="rms", activation="swiglu", bias=False, rope=RopeConfig(), mlp_hidden=4 * hidden)
            for _ in range(num_blocks)
        )
    )


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x.view_as(x)


def _forward_with_breaks(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return type(block).forward(block, x)  # type: ignore[no-any-return]


def compile_with_breaks(model: nn.Module) -> None:
    """Compile each block with a graph break where tp's collectives sit: around every attention and MLP
    (an eager identity). Through its own function, not Block.forward: dynamo does not guard on module
    hooks, so blocks with and without these hooks must not share compiled code."""
    from polyshard.collectives import eager
    from polyshard.models.common import Attention, Block

    identity = eager(_identity)
    for module in model.modules():
        if isinstance(module, Attention) or type(module).__name__ == "SwiGLU":
            module.register_forward_pre_hook(lambda _m, args: (identity(args[0]), *args[1:]))
            module.register_forward_hook(lambda _m, _args, out: identity(out))
    for block in model.modules():
        if isinstance(block, Block):
            block.forward = torch.compile(functools.partial(_forward_with_breaks, block))  # type: ignore[method-assign]


def block_speed(iters: int = 10, batch: int = 8, seq: int = 128) -> list[Row]:
    """Eager, compiled whole, and compiled with breaks at tp's collective places, timed in turns (one call
    of each per round, the median over rounds): the machine is shared, and load that comes and goes then
    falls on all three alike."""
    from polyshard.trainer.engine.compiling import compile_blocks

    eager = blocks()
    whole, split = copy.deepcopy(eager), copy.deepcopy(eager)
    x = torch.randn(batch, seq, 256)

    def step(model: nn.Module) -> float:
        start = time.perf_counter()
        model(x.requires_grad_()).sum().backward()
        return time.perf_counter() - start

    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)

    def matmul(_: nn.Module) -> float:
        start = time.perf_counter()
        torch.mm(a, b)
        return time.perf_counter() - start

    with FlopCounterMode(display=False) as counter:  # matmuls only: SDPA on CPU is not counted (~6% here)
        step(eager)  # (and the warm-up)
    flops = counter.get_total_flops() / len(eager)
    compile_blocks([whole])
    compile_with_breaks(split)
    first = {"whole": step(whole), "split": step(split)}  # compiles (or loads from the inductor cache)
    times: dict[str, list[float]] = {"eager": [], "whole": [], "split": [], "matmul": []}
    for _ in range(iters):
        for name, model in (("eager", eager), ("whole", whole), ("split", split)):
            times[name].append(step(model))
        times["matmul"].append(matmul(eager))
    peak = 2 * 1024**3 / statistics.median(times.pop("matmul")) / 1e9
    ms = {name: statistics.median(t) * 1e3 / len(eager) for name, t in times.items()}

    def rates(name: str) -> str:
        return f"{flops / ms[name] / 1e6:.0f}"

    what = f"{len(eager)} Llama blocks fwd+bwd (h256, 8 heads, {batch}x{seq}), per block"
    split_what = "the same, graph breaks at tp's 4 collective places"
    note = (
        f"matmul GFLOP/s: eager {rates('eager')}, compiled {rates('whole')}, "
        f"a 1024^3 matmul {peak:.0f} ({flops / 1e9:.2f} GFLOP of matmuls per block)"
    )
    return [
        Row(what, ms["eager"], ms["whole"], "ms", first["whole"], ms["eager"] / ms["whole"], note),
        Row(split_what, ms["eager"], ms["split"], "ms", first["split"], ms["eager"] / ms["split"]),
    ]


def _train(config: Path, out: Path, steps: int, compiled: bool) -> list[dict[str, Any]]:
    shutil.rmtree(out, ignore_errors=True)
    settings = [
        f"training.steps={steps}",
        "eval.every=0",
        "eval.sample_tokens=0",
        "logging.every=1",
        "logging.progress_bar=false",
    ]
    cmd = [sys.executable, "-m", "polyshard.cli.main", "train", str(config), "--out", str(out)]
    cmd += [a for s in settings for a in ("--set", s)] + (["--compile"] if compiled else [])
    result = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if result.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def demo_speed(config: Path, steps: int, folder: Path) -> Row:
    eager = _train(config, folder / "eager", steps, compiled=False)
    compiled = _train(config, folder / "compiled", steps, compiled=True)
    last_compile = max(i for i, r in enumerate(compiled) if "compile" in r)
    compile_s = sum(float(r["compile"]["compile_s"]) for r in compiled if "compile" in r)
    skip = max(last_compile + 1, 2)  # after the compiles (and the first steps' warm-up, eager too)

    def rate(records: list[dict[str, Any]]) -> float:
        return statistics.median(float(r["tokens_per_s"]) for r in records[skip:])

    eager_rate, compiled_rate = rate(eager), rate(compiled)
    return Row(
        f"demo {config.name}, tokens/s (median of steps {skip + 1}-{steps})",
        eager_rate,
        compiled_rate,
        "tokens/s",
        compile_s,
        compiled_rate / eager_rate,
    )


def report(rows: Sequence[Row]) -> str:
    lines = [
        "| what | eager | compiled | compiled / eager | compile time |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        figures = f"{r.eager:.1f} {r.unit} | {r.compiled:.1f} {r.unit} | {r.speedup:.2f}x | {r.compile_s:.0f} s"
        lines.append(f"| {r.what} | {figures} |")
    return "\n".join(lines + [r.note for r in rows if r.note])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="polyshard bench compile")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--config", type=Path, default=DEMO_CONFIG)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--skip-demo", action="store_true")
    args = parser.parse_args(argv)
    rows = block_speed(args.iters)
    print(report(rows), flush=True)
    if not args.skip_demo:
        with tempfile.TemporaryDirectory() as tmp:
            rows.append(demo_speed(args.config, args.steps, Path(tmp)))
        print(report(rows), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
