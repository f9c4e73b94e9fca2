"""Benchmark (not a test): activation memory per rank against sequence length, with and without
context parallelism.

    torchrun --nproc-per-node CP -m polyshard.bench.context_memory --seq-lens 1024 4096 16384

Each process builds the same small Llama (``llama-tiny``'s width, 2 blocks, batch 1, float32), keeps
its cp chunks of one sequence (all of it when CP is 1) and runs one forward. The activation memory is
what autograd saves for the backward pass, counted through ``torch.autograd.graph.saved_tensors_hooks``
(each storage once): the bytes a rank holds between forward and backward, the part of memory context
parallelism divides. The cp=1 run uses PyTorch's own scaled-dot-product attention; cp > 1 the ring
(or all-gather) kernel of :mod:`polyshard.cp`. Rank 0 prints one line per length: tokens per rank,
MiB saved per rank, and with ``--json FILE`` writes the records.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from polyshard.bench.arguments import positive
from polyshard.cp import position_ids
from polyshard.mesh import Mesh, init_distributed
from polyshard.models import build_model, output_width
from polyshard.trainer.config import from_dict
from polyshard.trainer.engine.context import apply_context_parallel, local_tokens


def saved_bytes(fn: Callable[[], object]) -> int:
    """Bytes of the tensors autograd saves while ``fn()`` runs, each storage counted once."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def measure(seq_len: int, style: str, layers: int = 2) -> dict[str, object]:
    cp = dist.get_world_size()
    model_cfg = from_dict({"model": {"preset": "llama-tiny", "num_layers": layers, "context_length": seq_len}}).model
    model = build_model(model_cfg)
    group = Mesh({"cp": cp}).group("cp") if cp > 1 else None
    if group is not None:
        apply_context_parallel(model, group, style)
    tokens = torch.randint(0, output_width(model_cfg), (1, seq_len), generator=torch.Generator().manual_seed(0))
    mine = local_tokens(tokens, group)
    positions = position_ids(seq_len, group, "cpu") if group is not None else None
    nbytes = saved_bytes(lambda: model(mine, positions=positions))
    return {"seq_len": seq_len, "cp": cp, "style": style if cp > 1 else "sdpa", "tokens_per_rank": mine.shape[1],
            "saved_mib": nbytes / 2**20}  # fmt: skip


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", type=positive, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--style", default="ring", choices=["ring", "allgather"])
    parser.add_argument("--json", default=None, help="write the records to this JSON file (rank 0)")
    args = parser.parse_args(argv)
    init_distributed()
    records = []
    for seq_len in args.seq_lens:
        record = measure(seq_len, args.style)
        peak = torch.tensor([record["saved_mib"]], dtype=torch.float64)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)  # the largest rank's (they hold equal shares)
        record["saved_mib"] = float(peak)
        records.append(record)
        if dist.get_rank() == 0:
            print(f"S={seq_len:>6} cp={record['cp']} ({record['style']}): {record['tokens_per_rank']:>6} tokens "
                  f"per rank, {record['saved_mib']:8.1f} MiB saved for backward per rank", flush=True)  # fmt: skip
    if args.json and dist.get_rank() == 0:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
