"""Benchmark (not a test): every strategy against its PyTorch peer, and whole GPTs composed on a
mesh against the torch-native composition, in one run, one table.

    polyshard bench peers --nproc 2 --json peers.json
    polyshard bench peers --nproc 2 --only composed --modes compiled   # both sides' blocks compiled
    python -m torch.distributed.run --nproc-per-node 4 -m polyshard.bench.peers --steps 10

Strategy rows come from each package's own benchmark, called as a function (``polyshard.bench.dp``:
DataParallel vs DDP, ZeRO-1 vs ZeroRedundancyOptimizer, ZeRO-3 vs FSDP2; ``polyshard.bench.tp``:
polyshard.tp vs DTensor ``parallelize_module``; ``polyshard.bench.pp``: each schedule vs
torch.distributed.pipelining's; ``polyshard.bench.ep``: the expert-parallel MoE layer vs the same
layer on one process; ``polyshard.bench.cp``: ring attention vs one process's SDPA), on the world
group, with their shapes, warm-up and interleaving.

Composed rows train the trainer's GPT on a layout (dp2, tp2, pp2 at 2 ranks; dp2 x tp2, tp2 x pp2,
dp2 x pp2 at 4; dp2 x tp2 x pp2 at 8), at each shape ``--preset`` names (:data:`SHAPES`: the small
``tiny``, ``small`` and ``llama-tiny``; the real ``titan-debug``, torchtitan's Llama 3 debug model at
2,048-token rows, 8 per data rank, and ``h1024-32k``), eager or compiled (``--modes``):

* ours: :func:`polyshard.trainer.engine.builder.build_engine` and
  :func:`polyshard.trainer.loop.train_step`, exactly as ``polyshard train`` steps
  (ZeRO-3 on the dp axis, 1F1B on the pp axis, the global-norm clip, AdamW);
* the peer: the torch-native composition torchtitan uses, on a ``DeviceMesh`` of the same shape and
  rank order: ``parallelize_module`` (Colwise/Rowwise on q/k/v/o and the MLP, the embedding split
  along the vocabulary, the head by columns; for the Llama shapes torchtitan's plan with sequence-
  parallel norms and ``loss_parallel``, and ours with ``parallel.sequence_parallel``) -> ``fully_shard``
  per layer and per stage ->
  ``PipelineStage`` + ``Schedule1F1B``, ``clip_grad_norm_``'s maths on DTensors (the pipeline's
  partial norms summed over pp, as torchtitan does) and ``torch.optim.AdamW``.

Both start from the same weights (each layer drawn from its own seeded generator, the full model one
process would build), take the same batches (random tokens, each data rank its rows of a global
batch), the same AdamW groups and settings, and the same clip. The first ``--check-steps`` steps of
each are compared loss by loss; then both are timed interleaved (``time_interleaved``: warm-up, then
alternating, each step between barriers, the slowest rank's time, the median). Bytes held per rank:
parameters, gradients and optimizer state after a step (``polyshard.dp.bytes_held`` for ours, the
local shards of the peer's DTensors). A peer that cannot be built or run here is reported as
``peer unavailable: <the exception>`` beside ours.

With ``--modes compiled`` the composed rows compile both sides' transformer blocks, one compiled unit per
block: ours with ``training.compile`` (Block.forward compiled, our collectives eager between graph
pieces), the peer as torchtitan does (``module.compile(fullgraph=True)`` on each block after
``parallelize_module`` and before ``fully_shard``, so DTensor's collectives are traced into the block's
graph). The first check steps compile (both sides, untimed) and are compared loss by loss
with the compiled tolerance. The strategy rows are each package's own eager benchmark either way.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from polyshard.bench.timing import Column, Record, comparison_record, held_bytes, run_bench, time_interleaved
from polyshard.collectives import ops
from polyshard.dp import bytes_held
from polyshard.mesh import DistributedContext, Mesh
from polyshard.models import build_model, output_width, sequence_length, spec_of
from polyshard.trainer.config import Config, from_dict
from polyshard.trainer.engine.builder import build_engine
from polyshard.trainer.engine.layout import global_names, pipeline_bounds
from polyshard.trainer.engine.optimizer import param_groups
from polyshard.trainer.loop import train_step

GROUPS = ("dp", "tp", "pp", "ep", "cp", "composed")
MODES = ("eager", "compiled")
# The composed layouts measured at each world size.
LAYOUTS: dict[int, list[dict[str, int]]] = {
    2: [{"dp": 2}, {"tp": 2}, {"pp": 2}],
    4: [{"dp": 2, "tp": 2}, {"tp": 2, "pp": 2}, {"dp": 2, "pp": 2}],
    8: [{"dp": 2, "tp": 2, "pp": 2}],
}
GLOBAL_BATCH, MICROBATCHES, LR, CHECK_STEPS = 16, 4, 1e-3, 3


@dataclass(frozen=True)
class Shape:
    """What the composed rows train: a ``[model]`` table and its batch.

    ``rows_per_data_rank``: each data rank's rows (None: a global batch of :data:`GLOBAL_BATCH` rows,
    split over the data ranks). ``microbatches``: 1F1B's on the pp axis. ``sequence_parallel``: tp
    layouts run with sequence parallelism, and the peer with torchtitan's Llama plan (sequence-parallel
    norms, the loss computed on vocabulary-sharded logits). ``max_steps`` / ``check_steps`` /
    ``warmup``: a real shape's step takes seconds on a CPU, so it times fewer steps, and its untimed
    check steps (the same forward, backward and optimizer step) are its warm-up."""

    model: dict[str, Any]
    rows_per_data_rank: int | None = None
    microbatches: int = MICROBATCHES
    sequence_parallel: bool = False
    max_steps: int | None = None
    check_steps: int = CHECK_STEPS
    warmup: int = 2

    def global_batch(self, data_ranks: int) -> int:
        return GLOBAL_BATCH if self.rows_per_data_rank is None else self.rows_per_data_rank * data_ranks


# Llama 3's architecture as torchtitan's llama3 model builds it (untied head, RMSNorm eps 1e-5, rotary
# theta 5e5 with Llama 3.1's frequency scaling).
_LLAMA3 = {
    "norm": "rms", "activation": "swiglu", "positions": "rope", "bias": False, "norm_eps": 1e-5,
    "rope": {"theta": 500000.0, "scaling": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
             "high_freq_factor": 4.0, "original_context": 8192},
}  # fmt: skip


def _real_shape(**model: Any) -> Shape:
    """A Llama 3 of these sizes as torchtitan trains it: 8 rows per data rank, 1F1B with 8 microbatches,
    tp with sequence parallelism; 2 compared steps (its warm-up), then at most 3 timed."""
    return Shape(
        _LLAMA3 | model,
        rows_per_data_rank=8,
        microbatches=8,
        sequence_parallel=True,
        max_steps=3,
        check_steps=2,
        warmup=0,
    )


SHAPES: dict[str, Shape] = {
    "tiny": Shape({"preset": "tiny"}),
    "small": Shape({"preset": "small"}),
    # Llama's architecture at the tiny width, tp with sequence parallelism: the real shapes' plan, small.
    "llama-tiny": Shape({"preset": "llama-tiny"}, sequence_parallel=True),
    # torchtitan's llama3 "debugmodel" at its own training shape: 2,048-token rows, 8 per data rank,
    # 1F1B with 8 microbatches, tp with sequence parallelism and loss parallel.
    "titan-debug": _real_shape(
        hidden=256, num_layers=6, num_heads=16, num_kv_heads=16, mlp_hidden=768, vocab_size=2048, context_length=2048
    ),
    # A wider Llama with a 32K vocabulary (the head and loss are a third of the work): hidden 1024, GQA,
    # 512-token rows so that 8 rows per data rank take seconds, not minutes, on 2 CPU cores.
    "h1024-32k": _real_shape(
        hidden=1024, num_layers=4, num_heads=16, num_kv_heads=8, mlp_hidden=2816, vocab_size=32768, context_length=512
    ),
}
PRESETS = tuple(SHAPES)
# Both sides run float32 on the same batches; they differ in the order sums are taken (dp's
# reduce-scatter, tp's split matmuls and all-reduces, the vocabulary-parallel loss against the
# gathered logits), ~1e-7 relative per step, compounded through AdamW over a few steps: the
# end-to-end parity tests' 2e-5 (tests/trainer/test_e2e_parity.py, same model family and widths).
LOSS_RTOL = 2e-5
# Compiled, each side's inductor fuses elementwise work and reorders float32 sums in its own kernels
# (~1e-6 relative per op), on top of the above: the compiled parity tests' 1e-4 (tests/trainer/test_compile.py).
COMPILED_LOSS_RTOL = 1e-4


def layout_name(layout: dict[str, int]) -> str:
    return " x ".join(f"{axis}{size}" for axis, size in layout.items())


def composed_config(
    layout: dict[str, int], preset: str = "tiny", grad_clip: float = 1.0, compiled: bool = False
) -> Config:
    """The trainer config both sides train: the shape ``preset``'s model and batch (:data:`SHAPES`), ZeRO-3
    on dp, 1F1B on pp, sequence parallelism on tp where the shape says, the gradient norm clipped to
    ``grad_clip`` (the trainer's default 1.0), blocks compiled if ``compiled``."""
    shape = SHAPES[preset]
    parallel: dict[str, Any] = dict(layout)
    if layout.get("dp", 1) > 1:
        parallel["zero_stage"] = 3  # the peer's fully_shard is ZeRO-3
    if layout.get("pp", 1) > 1:
        parallel |= {"schedule": "1f1b", "microbatches": shape.microbatches}
    if layout.get("tp", 1) > 1 and shape.sequence_parallel:
        parallel["sequence_parallel"] = True
    batch = shape.global_batch(layout.get("dp", 1))
    return from_dict(
        {
            "model": dict(shape.model),
            "parallel": parallel,
            "training": {"global_batch_size": batch, "compile": compiled},
            "optimizer": {"lr": LR, "grad_clip": grad_clip},
            "lr_schedule": {"warmup_steps": 0},
            "eval": {"every": 0, "sample_tokens": 0},
        }
    )


def batches(config: Config, data_rank: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` steps' batches: random tokens, this data rank's rows of each global batch."""
    model, par = config.model, config.parallel
    batch = config.training.global_batch_size
    rows = batch // par.data_ranks
    out = []
    for step in range(count):
        g = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, output_width(model), (batch, sequence_length(model) + 1), generator=g)
        mine = tokens[data_rank * rows : (data_rank + 1) * rows]
        out.append((mine[:, :-1].contiguous(), mine[:, 1:].contiguous()))
    return out


class Ours:
    """polyshard's engine, stepped as the training loop steps it."""

    def __init__(self, config: Config, device: torch.device):
        self.config = config
        self.mesh = Mesh(config.parallel.mesh_axes)
        self.engine = build_engine(config, self.mesh, device=device)

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        return train_step(self.engine, inputs, targets, self.config.optimizer.lr).loss

    def held(self, inputs: torch.Tensor, targets: torch.Tensor) -> int:
        """Bytes held at the end of one more step, after the optimizer step and before the gradients
        are dropped (where the peer is measured: its gradients live until the next step's zero_grad)."""
        engine, held = self.engine, []

        def measure() -> None:
            pairs = zip(engine.stages, engine.optimizers)
            held.append(sum(bytes_held(engine.wrappers[s], opt).total for s, opt in pairs))

        train_step(engine, inputs, targets, self.config.optimizer.lr, before_zero_grad=measure)
        return held[0]


class Peer:
    """The torch-native composition: parallelize_module -> fully_shard -> PipelineStage + Schedule1F1B."""

    def __init__(self, config: Config, device: torch.device):
        from torch.distributed.device_mesh import init_device_mesh

        self.config, par, self.device = config, config.parallel, device
        axes = {axis: size for axis, size in (("pp", par.pp), ("dp", par.dp), ("tp", par.tp))}
        # pp x dp x tp, tp fastest: the same ranks on each axis as polyshard's Mesh.
        self.device_mesh = init_device_mesh(device.type, tuple(axes.values()), mesh_dim_names=tuple(axes))
        self.pp_rank = self.device_mesh.get_local_rank("pp")
        self.tp_rank = self.device_mesh.get_local_rank("tp")
        full = build_model(config.model, seed=config.training.seed, device=device)
        bounds = pipeline_bounds(config, {n: p.shape for n, p in full.named_parameters()})
        layer_ids = bounds[self.pp_rank]
        layers = cast(nn.ModuleList, full.layers)  # every model family keeps its pipeline layers in one list
        self.stage = nn.Sequential(*(layers[i] for i in layer_ids))
        self.first, self.last = self.pp_rank == 0, self.pp_rank == par.pp - 1
        if par.tp > 1:
            self._tensor_parallel(layer_ids)
        if config.training.compile:
            self._compile_blocks(layer_ids)
        if par.dp > 1:
            self._fully_shard()
        names = global_names(self.stage, layer_ids)
        named = [(names[n], p) for n, p in self.stage.named_parameters()]
        chosen = config.optimizer
        groups = param_groups(named, chosen.weight_decay, spec_of(config.model).decays)
        self.optimizer = torch.optim.AdamW(groups, lr=chosen.lr, betas=(chosen.beta1, chosen.beta2))
        self.schedule = None
        if par.pp > 1:
            from torch.distributed.pipelining import PipelineStage, Schedule1F1B

            stage = PipelineStage(self.stage, self.pp_rank, par.pp, device, group=self.device_mesh.get_group("pp"))
            self.schedule = Schedule1F1B(stage, n_microbatches=par.microbatches, loss_fn=self.loss_fn)

    def _tensor_parallel(self, layer_ids: range) -> None:
        """torchtitan's Llama plan on our module names: q/k/v and the MLP's inputs by columns, o and its
        output by rows, the embedding split along the vocabulary, the head by columns. With sequence
        parallelism (``parallel.sequence_parallel``): the norms run on sequence shards, the attention and
        MLP gather their input, the row-parallel outputs reduce-scatter back to sequence shards, and the
        head's logits stay split along the vocabulary for ``loss_parallel``; without, the head's logits
        are gathered for a plain cross-entropy."""
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            PrepareModuleInput,
            RowwiseParallel,
            SequenceParallel,
            parallelize_module,
        )

        tp_mesh = self.device_mesh["tp"]
        sp = self.config.parallel.sequence_parallel
        rows = Shard(1) if sp else Replicate()  # the layout of activations between tp regions
        last = self.config.model.num_layers + 1
        for index, layer in zip(layer_ids, self.stage):
            plan: dict[str, Any]
            if index == 0:
                plan = {"tok": RowwiseParallel(input_layouts=Replicate(), output_layouts=rows)}
            elif index == last:
                if sp:
                    head = ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)
                    plan = {"norm": SequenceParallel(), "proj": head}
                else:
                    plan = {"proj": ColwiseParallel(output_layouts=Replicate())}
            else:
                plan = {f"attn.{p}_proj": ColwiseParallel() for p in "qkv"}
                plan["attn.o_proj"] = RowwiseParallel(output_layouts=rows)
                if hasattr(layer.mlp, "gate_proj"):  # SwiGLU
                    plan |= {"mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel()}
                    plan["mlp.down_proj"] = RowwiseParallel(output_layouts=rows)
                else:
                    plan |= {"mlp.fc_in": ColwiseParallel(), "mlp.fc_out": RowwiseParallel(output_layouts=rows)}
                if sp:
                    plan |= {"norm1": SequenceParallel(), "norm2": SequenceParallel()}
                    for name in ("attn", "mlp"):  # each gathers its sequence-sharded input
                        plan[name] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
            parallelize_module(layer, tp_mesh, plan)

    @contextmanager
    def _loss_context(self) -> Iterator[None]:
        """torchtitan's ``loss_parallel`` around forward and backward when the head's logits stay split."""
        if self.config.parallel.tp > 1 and self.config.parallel.sequence_parallel:
            from torch.distributed.tensor.parallel import loss_parallel

            with loss_parallel():
                yield
        else:
            yield

    def _compile_blocks(self, layer_ids: range) -> None:
        """torchtitan's per-block compile: each transformer block's ``__call__`` compiled whole
        (``fullgraph``: DTensor's collectives traced into the graph), after tensor parallelism and before
        fully_shard (whose hooks stay outside the compiled blocks)."""
        last = self.config.model.num_layers + 1
        for index, layer in zip(layer_ids, self.stage):
            if index not in (0, last):  # the embedding and the head stay eager, as ours do
                layer.compile(fullgraph=True)
            elif index == 0 and self.config.parallel.tp > 1 and self.config.parallel.sequence_parallel:
                # torch 2.13 on CPU/gloo: a compiled block whose input is the embedding's asynchronous
                # reduce-scatter (RowwiseParallel's output, still in flight) hands a plain tensor back to
                # that redistribute's backward, which fails ("'Tensor' object has no attribute
                # '_local_tensor'"). Waiting for it in eager first (one copy of the block's input) is the
                # smallest change that lets the peer run.
                layer.register_forward_hook(lambda module, inputs, output: output.clone())

    def _fully_shard(self) -> None:
        from torch.distributed.fsdp import fully_shard

        dp_mesh = self.device_mesh["dp"]
        # torchtitan: with pp, parameters stay gathered across microbatches; without, every layer but the
        # last reshards after its forward (the last one's backward comes next), as ours keeps the head.
        reshard = self.config.parallel.pp == 1
        for index, layer in enumerate(self.stage):
            fully_shard(layer, mesh=dp_mesh, reshard_after_forward=reshard and index < len(self.stage) - 1)
        fully_shard(self.stage, mesh=dp_mesh, reshard_after_forward=reshard)

    @staticmethod
    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        with self._loss_context():
            if self.schedule is None:
                loss: torch.Tensor | None = self.loss_fn(self.stage(inputs), targets)
                assert loss is not None
                loss.backward()
            else:
                losses: list[torch.Tensor] = []
                args = (inputs,) if self.first else ()
                self.schedule.step(*args, target=targets if self.last else None, losses=losses)
                loss = torch.stack(losses).mean() if self.last else None  # Schedule1F1B scales grads by 1/m
        if loss is not None and hasattr(loss, "full_tensor"):  # loss_parallel's loss: a replicated DTensor
            loss = loss.full_tensor()
        self._clip(self.config.optimizer.grad_clip)
        self.optimizer.step()
        # The loss of the global batch, the same on every rank: the last stage's tp rank 0 of each
        # data rank holds its mean; sum those and divide by the data ranks.
        holder = self.last and self.tp_rank == 0 and loss is not None
        value = float(loss.detach()) if holder and loss is not None else 0.0
        total = torch.tensor([value], dtype=torch.float64, device=self.device)
        ops.all_reduce(total)
        return float(total) / self.config.parallel.dp

    def _clip(self, max_norm: float) -> None:
        """torch.nn.utils.clip_grad_norm_'s maths on DTensor gradients: per-mesh norms (each a full
        norm of its group), their squares summed, then over the pipeline ranks as torchtitan does."""
        # DTensor refuses one foreach call over plain tensors and DTensors, or DTensors of two meshes
        # (fully_shard's dp-only shards beside dp x tp ones): one group per mesh, plain tensors apart.
        by_mesh: dict[Any, list[torch.Tensor]] = {}
        for p in self.stage.parameters():
            if p.grad is not None:
                by_mesh.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
        square = torch.zeros((), dtype=torch.float32, device=self.device)
        for params in by_mesh.values():
            norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
            full = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
            square += full.float() ** 2
        if self.config.parallel.pp > 1:
            dist.all_reduce(square, group=self.device_mesh.get_group("pp"))
        if max_norm > 0:
            for params in by_mesh.values():
                torch.nn.utils.clip_grads_with_norm_(params, max_norm, square.sqrt())  # scales each p.grad

    def held(self) -> int:
        return held_bytes([self.stage], [self.optimizer])


def _same_everywhere(value: bool, device: torch.device) -> bool:
    flag = torch.tensor([1.0 if value else 0.0], device=device)
    ops.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def composed_case(
    layout: dict[str, int],
    steps: int,
    *,
    check_steps: int | None = None,
    preset: str = "tiny",
    device: torch.device | str = "cpu",
    warmup: int | None = None,
    grad_clip: float = 1.0,
    compiled: bool = False,
) -> Record:
    """Ours against the torch-native composition on ``layout`` (its product must be the world size).
    ``steps`` timed steps (at most the shape's ``max_steps``); ``check_steps`` and ``warmup`` default to
    the shape's."""
    device = torch.device(device)
    shape = SHAPES[preset]
    steps = min(steps, shape.max_steps or steps)
    check_steps = shape.check_steps if check_steps is None else check_steps
    warmup = shape.warmup if warmup is None else warmup
    config = composed_config(layout, preset, grad_clip, compiled)
    m, par = config.model, config.parallel
    case = (
        f"GPT-{preset} {layout_name(layout)}"
        + (" ZeRO-3" if layout.get("dp", 1) > 1 else "")
        + (" SP" if par.tp > 1 and par.sequence_parallel else "")
        + (f" 1F1B m={par.microbatches}" if layout.get("pp", 1) > 1 else "")
        + f" (H={m.hidden} L={m.num_layers} V={output_width(m)} S={sequence_length(m)}"
        + f" B={config.training.global_batch_size})"
        + (" compiled" if compiled else "")
    )
    ours = Ours(config, device)
    data_rank = ours.mesh.group_rank(config.parallel.batch_axes)
    data = [(x.to(device), y.to(device)) for x, y in batches(config, data_rank, max(check_steps, 4))]
    ours_losses = [ours.step(*data[i]) for i in range(check_steps)]
    peer: Peer | None = None
    peer_losses: list[float] = []
    reason = None
    try:
        peer = Peer(config, device)
        peer_losses = [peer.step(*data[i]) for i in range(check_steps)]
    except Exception as err:  # the peer cannot run here: say why, keep ours
        reason = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}".strip()
        if dist.get_rank() == 0:
            traceback.print_exc()
    reasons = [None] * dist.get_world_size()
    dist.all_gather_object(reasons, reason)
    reason = next((r for r in reasons if r is not None), None)
    counter = {"ours": check_steps, "peer": check_steps}

    def run(side: str, fn: Callable[[torch.Tensor, torch.Tensor], float]) -> Callable[[], float]:
        def call() -> float:
            counter[side] += 1
            return fn(*data[counter[side] % len(data)])

        return call

    extra: dict[str, Any] = {"group": "composed", "layout": layout, "ours_losses": ours_losses}
    if reason is not None or peer is None:
        # Ours alone, timed the same way (each call between barriers, slowest rank, median).
        ours_s, _ = time_interleaved(
            run("ours", ours.step), lambda: None, group=dist.group.WORLD, iters=steps, warmup=warmup
        )
        record = {"case": case, "ours_s": ours_s, "peer_s": None, "ratio": None, "outputs_match": None}
        return record | extra | {"ours_held_bytes": ours.held(*data[0]), "peer_unavailable": reason}
    worst = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(ours_losses, peer_losses))
    rtol = COMPILED_LOSS_RTOL if compiled else LOSS_RTOL
    close = all(math.isclose(a, b, rel_tol=rtol) for a, b in zip(ours_losses, peer_losses))
    match = _same_everywhere(close, device)
    ours_s, peer_s = time_interleaved(
        run("ours", ours.step), run("peer", peer.step), group=dist.group.WORLD, iters=steps, warmup=warmup
    )
    return comparison_record(
        case,
        ours_s,
        peer_s,
        match,
        **extra,
        peer_losses=peer_losses,
        loss_max_rel_diff=worst,
        ours_held_bytes=ours.held(*data[0]),
        peer_held_bytes=peer.held(),
    )


def skipped_row(group: str, reason: str) -> Record:
    """A row saying a group was not measured, and why."""
    row = {"case": f"{group} (package benchmark)", "ours_s": None, "peer_s": None, "ratio": None}
    return row | {"outputs_match": None, "group": group, "peer_unavailable": reason}


def strategy_rows(groups: Sequence[str], steps: int, device: torch.device | str = "cpu") -> list[Record]:
    """Each package benchmark's records on the world group, tagged with their group."""
    n = dist.get_world_size()
    strategies = [g for g in groups if g != "composed"]
    if torch.device(device).type != "cpu":
        reason = f"not measured on {torch.device(device).type}: its package benchmark builds its models on the CPU"
        return [skipped_row(g, reason) for g in strategies]
    rows: list[Record] = []
    if "dp" in groups:
        from polyshard.bench import dp as dp_bench

        rows += [r | {"group": "dp"} for r in dp_bench.run_all(steps)]
    if "tp" in groups:
        from polyshard.bench import tp as tp_bench

        rows += [r | {"group": "tp"} for r in tp_bench.run_all(steps)]
    if "pp" in groups:
        from polyshard.bench import pp as pp_bench

        # pp's shapes, with enough layers and microbatches for a V of 2n stages at n ranks (8+ ranks)
        layers, microbatches = max(8, 2 * n), max(8, 2 * n)
        records = pp_bench.compare(layers=layers, microbatches=microbatches, iters=steps)
        rows += [r | {"group": "pp"} for r in records]
    if "ep" in groups:
        from polyshard.bench import ep as ep_bench

        rows += [r | {"group": "ep"} for r in ep_bench.compare(iters=steps)]
    if "cp" in groups:
        from polyshard.bench import cp as cp_bench

        rows += [r | {"group": "cp"} for r in cp_bench.compare([256 * n], iters=steps)]
    return rows


def measure(
    groups: Sequence[str],
    steps: int,
    presets: Sequence[str] = ("tiny",),
    device: torch.device | str = "cpu",
    modes: Sequence[str] = ("eager",),
) -> list[Record]:
    """Every row for this world size (call on every rank; every rank returns the same records): the
    strategy rows, then each preset's composed layouts in each mode (eager, compiled)."""
    n = dist.get_world_size()
    rows = strategy_rows(groups, steps, device)
    if "composed" in groups:
        for preset in presets:
            for mode in modes:
                compiled = mode == "compiled"
                for lay in LAYOUTS.get(n, []):
                    rows.append(composed_case(lay, steps, preset=preset, device=device, compiled=compiled))
    return [r | {"world_size": n} for r in rows]


def split_choices(text: str, option: str, choices: Sequence[str]) -> list[str]:
    """``text``'s comma-separated names, each one of ``choices`` (a ValueError naming ``option`` if not)."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in choices]
    if unknown or not names:
        raise ValueError(f"{option}: unknown {unknown or 'empty'}; choose from {list(choices)}, comma-separated")
    return names


def _mib(value: int | None) -> str:
    return "–" if value is None else f"{value / 2**20:.2f}"


COLUMNS: tuple[Column, ...] = (
    ("case", 62, lambda r: r["case"]),
    ("ours (ms)", 11, lambda r: "–" if r["ours_s"] is None else f"{r['ours_s'] * 1e3:.2f}"),
    ("peer (ms)", 11, lambda r: "–" if r["peer_s"] is None else f"{r['peer_s'] * 1e3:.2f}"),
    ("ratio", 7, lambda r: "–" if r["ratio"] is None else f"{r['ratio']:.2f}"),
    ("ours MiB", 10, lambda r: _mib(r.get("ours_held_bytes"))),
    ("peer MiB", 10, lambda r: _mib(r.get("peer_held_bytes"))),
    ("match", 7, lambda r: "n/a" if r["outputs_match"] is None else ("yes" if r["outputs_match"] else "NO")),
)


def format_report(records: Sequence[Record]) -> str:
    """The table, then a line per unavailable peer and a one-line summary."""
    from polyshard.bench.timing import format_table

    lines = [format_table(records, COLUMNS)]
    for r in records:
        if r.get("peer_unavailable"):
            what = "peer unavailable" if r["ours_s"] is not None else "skipped"
            lines.append(f"{what} for {r['case']}: {r['peer_unavailable']}")
    ratios = [r["ratio"] for r in records if r["ratio"] is not None]
    above = [r["case"] for r in records if r["ratio"] is not None and r["ratio"] > 1.0]
    mismatched = [r["case"] for r in records if r["outputs_match"] is False]
    if ratios:
        lines.append(
            f"{len(ratios)} comparisons: ratio median {sorted(ratios)[len(ratios) // 2]:.2f}, "
            f"{len(above)} above 1.0"
            + (f" ({'; '.join(above)})" if above else "")
            + f"; {len(mismatched)} mismatched"
            + (f" ({'; '.join(mismatched)})" if mismatched else "")
        )
    return "\n".join(lines)


def quiet_peer_warnings() -> None:
    """Two notices the peer prints every step would bury the table: FSDP2's about modules returning
    views (nothing here writes into them in place) and DTensor's that a norm over dp x tp takes two
    all-reduces (the peer's cost, which its time includes)."""
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per side (after 2 warm-up steps)")
    parser.add_argument("--only", default=",".join(GROUPS), help="comma-separated subset of " + ", ".join(GROUPS))
    parser.add_argument(
        "--preset", default="tiny", help="the composed jobs' shapes, comma-separated: " + ", ".join(PRESETS)
    )
    parser.add_argument("--json", default=None, help="write the records to this JSON file (rank 0)")
    parser.add_argument(
        "--modes", default="eager", help="the composed jobs' blocks: eager, compiled (both sides), or eager,compiled"
    )
    args = parser.parse_args(argv)
    try:
        groups = split_choices(args.only, "--only", GROUPS)
        presets = split_choices(args.preset, "--preset", PRESETS)
        modes = split_choices(args.modes, "--modes", MODES)
    except ValueError as err:
        parser.error(str(err))
    if args.steps < 1:
        parser.error(f"--steps {args.steps}: give at least 1 timed step")

    def run(ctx: DistributedContext) -> list[Record]:
        torch.set_num_threads(1)  # ranks share the machine's cores
        quiet_peer_warnings()
        return measure(groups, args.steps, presets, ctx.device, modes)

    def report(records: list[Record]) -> None:
        print(format_report(records), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(records, f, indent=2)

    run_bench(run, report)


if __name__ == "__main__":
    main()
