"""Where one training step's memory goes, ours against the torch-native peer (issue 49, part 1).

Both sides of ``polyshard bench peers``' composed rows (:mod:`polyshard.bench.peers`: our engine and
``train_step``; the peer's ``parallelize_module`` -> ``fully_shard``) train the same model on the same
batches. After a warm-up step (the optimizer's state exists from there), one more step of each is measured:

* model states: the parameters, gradients and optimizer state each side holds after its step (the bench's
  held bytes: ``polyshard.dp.bytes_held`` for ours, the local shards of the peer's DTensors);
* saved for backward: the bytes of the distinct storages autograd saved during the step's forwards
  (``saved_tensors_hooks``; a storage saved twice counts once), which is what activation memory is;
* step peak: the most bytes the step allocated above what it started with, from ``torch.profiler``'s
  allocation events (``profile_memory``); the step peak less what was saved is the step's temporaries
  (logits and their gradient, gathered ZeRO-3 units, communication buffers, the optimizer's scratch).

    .venv/bin/python -m torch.distributed.run --nproc-per-node 2 apps/memory_categories.py --layout dp2
    .venv/bin/python -m torch.distributed.run --nproc-per-node 2 apps/memory_categories.py --layout tp2

Rank 0 prints MiB per rank. (PyTorch's own categorisation, ``profile._memory_profile``, stops on an
assertion over both sides' in-place collectives, so the categories are these three.)
"""

from __future__ import annotations

import argparse
import gc
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.profiler import ProfilerActivity, profile

from polyshard.bench.peers import PRESETS, Ours, Peer, batches, composed_config
from polyshard.trainer.config import Config

LAYOUTS = {"dp2": {"dp": 2}, "tp2": {"tp": 2}, "pp2": {"pp": 2}}


def measured(step: Callable[[], object]) -> tuple[int, int]:
    """One call of ``step``: (its peak bytes above its start, the bytes of the distinct storages it saved for
    backward)."""
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor  # the peer's tp saves DTensors
        try:
            storage = local.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        except RuntimeError:  # a tensor with no memory of its own (DTensor's sharding propagation): nothing held
            pass
        return tensor

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            step()
    events = sorted(
        (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"), key=lambda e: e.start_ns()
    )
    held = peak = 0
    for event in events:
        held += event.nbytes()
        peak = max(peak, held)
    return peak, sum(storages.values())


def _ours(config: Config, device: torch.device, data: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[int, int, int]:
    ours = Ours(config, device)
    ours.step(*data[0])
    peak, saved = measured(lambda: ours.step(*data[1]))
    return ours.held(*data[2]), saved, peak


def _peer(config: Config, device: torch.device, data: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[int, int, int]:
    peer = Peer(config, device)
    peer.step(*data[0])
    peak, saved = measured(lambda: peer.step(*data[1]))
    peer.step(*data[2])
    return peer.held(), saved, peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="dp2")
    parser.add_argument("--preset", choices=PRESETS, default="titan-debug")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    config = composed_config(LAYOUTS[args.layout], args.preset)
    device = torch.device("cpu")
    data_rank = Ours(config, device).mesh.group_rank(config.parallel.batch_axes)
    data = batches(config, data_rank, 3)  # the same rows for both sides
    rows = {"ours": _ours(config, device, data)}
    gc.collect()  # ours is gone before the peer is built
    rows["peer"] = _peer(config, device, data)
    if dist.get_rank() == 0:
        mib = float(1 << 20)
        print(f"{args.layout} at {args.preset} (rank 0, MiB)")
        print(f"{'':<26}{'ours':>10}{'peer':>10}")
        for i, label in enumerate(("model states", "saved for backward", "step peak above start")):
            print(f"{label:<26}{rows['ours'][i] / mib:>10.1f}{rows['peer'][i] / mib:>10.1f}")
        temporaries = {side: (rows[side][2] - rows[side][1]) / mib for side in rows}
        print(f"{'step peak less saved':<26}{temporaries['ours']:>10.1f}{temporaries['peer']:>10.1f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
