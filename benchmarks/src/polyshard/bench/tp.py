"""Benchmark: polyshard.tp against PyTorch's DTensor tensor parallel on the same modules.

Both start from one plain module (same seed): ours converted by
:func:`polyshard.tp.parallelize`, the peer by
``torch.distributed.tensor.parallel.parallelize_module`` with
``ColwiseParallel``/``RowwiseParallel`` on a 1-D ``DeviceMesh``. One step is
forward + backward of (B, S, H) activations; the two are timed interleaved and
the outputs and input gradients are compared. Run it with::

    polyshard bench tp --nproc 2 --json /tmp/tp_bench.json
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist
from torch import nn

from polyshard.bench.arguments import positive
from polyshard.bench.timing import (
    Record,
    comparison_record,
    held_bytes,
    run_bench,
    time_interleaved,
    write_records,
)
from polyshard.mesh import Mesh
from polyshard.models.common import MLP, Attention, Block
from polyshard.tp.plan import parallelize
from polyshard.tp.styles import ColumnParallel, RowParallel, ShardHeads, Style, TPEntry

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

B, S, H, HEADS = 4, 128, 256, 8


def _ours(model: nn.Module, tp_group: dist.ProcessGroup | None, prefix: str) -> nn.Module:
    plan: dict[str, Style | list[Style]] = {f"{prefix}fc_in": ColumnParallel(), f"{prefix}fc_out": RowParallel()}
    if prefix:
        plan |= {
            "attn": [TPEntry(), ShardHeads()],
            "attn.[qkv]_proj": ColumnParallel(input_entered=True),
            "attn.o_proj": RowParallel(),
        }
    return parallelize(model, tp_group=tp_group, plan=plan)


def _peer(model: nn.Module, device_mesh: DeviceMesh, prefix: str) -> nn.Module:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {f"{prefix}fc_in": ColwiseParallel(), f"{prefix}fc_out": RowwiseParallel()}
    if prefix:
        plan |= {f"attn.{p}_proj": ColwiseParallel() for p in "qkv"} | {"attn.o_proj": RowwiseParallel()}
        attn = cast(Attention, model.get_submodule("attn"))  # the Block case's attention
        attn.num_heads //= device_mesh.size()  # as torchtitan does: local heads
        attn.num_kv_heads //= device_mesh.size()
    return parallelize_module(model, device_mesh, plan)


def _step(model: nn.Module, x: torch.Tensor, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward + backward; returns the output and the input gradient."""
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    out = model(x)
    out.backward(grad_out)
    return out.detach(), cast(torch.Tensor, x.grad)  # backward just set it


def run_case(
    name: str,
    make: Callable[[], nn.Module],
    prefix: str,
    tp_group: dist.ProcessGroup | None,
    device_mesh: DeviceMesh,
    iters: int,
) -> Record:
    torch.manual_seed(0)
    plain = make()
    ours, peer = _ours(copy.deepcopy(plain), tp_group, prefix), _peer(copy.deepcopy(plain), device_mesh, prefix)
    g = torch.Generator().manual_seed(1)
    x, grad_out = torch.randn(B, S, H, generator=g), torch.randn(B, S, H, generator=g)
    (out_a, gx_a), (out_b, gx_b) = _step(ours, x, grad_out), _step(peer, x, grad_out)
    # Same maths with sums in a different order: float32 round-off only; 1e-4 (looser than the
    # tests' 1e-5) because the benchmark sums over H=256 and 4H=1024 terms instead of 16-64.
    match = torch.allclose(out_a, out_b, rtol=1e-4, atol=1e-5) and torch.allclose(gx_a, gx_b, rtol=1e-4, atol=1e-5)
    ours_s, peer_s = time_interleaved(
        lambda: _step(ours, x, grad_out), lambda: _step(peer, x, grad_out), group=dist.group.WORLD, iters=iters
    )
    n = dist.get_world_size(tp_group)
    # No optimizer in this step: what each rank holds is its parameters and their gradients.
    return comparison_record(
        f"{name} tp={n} B={B} S={S} H={H}",
        ours_s,
        peer_s,
        match,
        ours_held_bytes=held_bytes([ours]),
        peer_held_bytes=held_bytes([peer]),
    )


def run_all(iters: int) -> list[Record]:
    from torch.distributed.device_mesh import init_device_mesh

    n = dist.get_world_size()
    group = Mesh({"tp": n}).group("tp")
    device_mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("tp",))
    return [
        run_case("mlp fwd+bwd", lambda: MLP(H), "", group, device_mesh, iters),
        run_case("block fwd+bwd", lambda: Block(H, HEADS), "mlp.", group, device_mesh, iters),
    ]


def parser() -> argparse.ArgumentParser:
    """The flags of ``main``; ``polyshard bench tp`` checks them before any process starts."""
    parser = argparse.ArgumentParser(
        prog="polyshard bench tp", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", default=None, help="write the records to this file (rank 0)")
    parser.add_argument("--iters", type=positive, default=10, help="timed steps per implementation")
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse_args(argv)
    run_bench(lambda ctx: run_all(args.iters), lambda records: write_records(records, args.json))


if __name__ == "__main__":
    main()
