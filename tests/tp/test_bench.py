"""The benchmark's cases run on the test pool and report matching outputs (timing is not checked)."""

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from polyshard.mesh import Mesh
from polyshard.models.common import MLP, Block
from polyshard.tp import bench


def _cases():
    n = dist.get_world_size()
    group, device_mesh = Mesh({"tp": n}).group("tp"), init_device_mesh("cpu", (n,), mesh_dim_names=("tp",))
    records = [
        bench.run_case("mlp", lambda: MLP(bench.H), "", group, device_mesh, iters=1),
        bench.run_case("block", lambda: Block(bench.H, bench.HEADS), "mlp.", group, device_mesh, iters=1),
    ]
    return [(r["case"], r["outputs_match"], r["ours_s"] > 0, r["peer_s"] > 0) for r in records]


def test_bench_cases_match_dtensor(distributed):
    for rank_records in distributed.run(2, _cases):
        assert [r[1:] for r in rank_records] == [(True, True, True)] * 2
        assert rank_records[0][0].startswith("mlp tp=2")
