"""Mesh on live processes: groups really contain the ranks the layout says."""

import os

import pytest
import torch
import torch.distributed as dist

from polyshard.mesh import DistributedInitError, Mesh, MeshError, init_distributed

from .._errors import assert_caught, caught


def _group_sums(axes):
    """For every axis subset, all-reduce the rank over mesh.group(subset)."""
    mesh = Mesh(axes)
    out = {}
    for subset in mesh.layout.axis_subsets():
        t = torch.tensor([float(mesh.rank)])
        dist.all_reduce(t, group=mesh.group(subset))
        out[subset] = (t.item(), sum(mesh.ranks_in_group(subset)), mesh.group_rank(subset))
    return out


@pytest.mark.long
def test_quintnet_groups_on_eight_ranks(distributed):
    # 8 ranks, [dp, tp, pp] = 2x2x2: every group's all-reduce sums exactly its listed ranks.
    results = distributed.run(8, _group_sums, {"dp": 2, "tp": 2, "pp": 2})
    for rank, per_subset in enumerate(results):
        for subset, (got, expected, _) in per_subset.items():
            assert got == expected, (rank, subset)
    assert results[0][("dp",)][1] == 0 + 4 and results[0][("pp",)][1] == 0 + 1 and results[0][("tp",)][1] == 0 + 2


@pytest.mark.parametrize(
    "world, axes",
    [
        (1, {"dp": 1}),
        (3, {"pp": 1, "dp": 3, "tp": 1}),
        pytest.param(6, {"dp": 3, "tp": 2}, marks=pytest.mark.long),  # six processes on two cores (10 s)
        (4, {"dp": 1, "ep": 2, "tp": 2, "pp": 1}),
    ],
)
def test_meshes_of_many_sizes(distributed, world, axes):
    results = distributed.run(world, _group_sums, axes)
    for per_subset in results:
        for got, expected, _ in per_subset.values():
            assert got == expected


def _new_group_calls(axes):
    calls = []
    original = dist.new_group

    def counting(*args, **kwargs):
        calls.append(args[0] if args else kwargs.get("ranks"))
        return original(*args, **kwargs)

    dist.new_group = counting
    try:
        mesh = Mesh(axes)
    finally:
        dist.new_group = original
    return len(calls), mesh.ranks_in_group(("dp", "ep")), mesh.group("ep") is mesh.group(("pp", "ep"))


def test_subsets_differing_by_size_one_axes_share_groups(distributed):
    # The trainer's four axes with only dp > 1: 15 subsets, but one set of singleton groups
    # (every subset without dp) and the world (every subset with dp); it used to create 14 groups.
    for calls, data_ranks, aliased in distributed.run(2, _new_group_calls, {"pp": 1, "dp": 2, "ep": 1, "tp": 1}):
        assert calls == 2 and aliased and data_ranks == [0, 1]


def _short_timeout():
    import time

    mesh = Mesh({"dp": 3}, timeout_s=1.0)
    pair = mesh.group_at("dp", [0, 1])  # a group of its own (the whole dp axis is the world group)
    if mesh.rank != 0:
        if mesh.rank == 1:
            time.sleep(3.0)  # a rank that stopped answering
        return None
    started = time.monotonic()
    try:
        dist.barrier(group=pair)  # rank 1 is asleep: must time out after 1 s, not hang
    except Exception as err:  # gloo reports a timeout as a RuntimeError
        return type(err).__name__, time.monotonic() - started
    return "no timeout", time.monotonic() - started


def test_mesh_groups_use_the_given_timeout(distributed):
    result = distributed.run(3, _short_timeout, timeout_s=60)
    assert result[1:] == [None, None]
    kind, seconds = result[0]
    assert kind != "no timeout" and seconds < 3.0  # the 1 s limit fired before the peer woke up


def _ends_of_each_pipeline():
    mesh = Mesh({"pp": 3, "tp": 2})
    group = mesh.group_at("pp", [2, 0])
    assert mesh.group_at("pp", [0, 2]) is group  # created once, cached
    if group is None:
        return None
    members = torch.zeros(6, dtype=torch.int64)
    members[mesh.rank] = 1
    dist.all_reduce(members, group=group)
    return [r for r, present in enumerate(members.tolist()) if present]


def test_group_at_pairs_the_first_and_last_pipeline_ranks(distributed):
    # pp=3 x tp=2: pipelines [0, 2, 4] and [1, 3, 5]; their ends pair up per tp coordinate.
    assert distributed.run(6, _ends_of_each_pipeline) == [[0, 4], [1, 5], None, None, [0, 4], [1, 5]]


def _submesh_and_coords():
    mesh = Mesh({"dp": 2, "ep": 2})
    sub = mesh.submesh(("ep",))
    t = torch.ones(1)
    dist.all_reduce(t, group=sub.group("ep"))
    return mesh.coords(), sub.rank, sub.size(), t.item(), mesh.coord("dp"), sub.ranks_in_group("ep")


def test_submesh(distributed):
    results = distributed.run(4, _submesh_and_coords)
    assert [r[0] for r in results] == [{"dp": 0, "ep": 0}, {"dp": 0, "ep": 1}, {"dp": 1, "ep": 0}, {"dp": 1, "ep": 1}]
    assert [r[1] for r in results] == [0, 1, 0, 1]  # submesh rank = ep coordinate
    assert all(r[2] == 2 and r[3] == 2.0 for r in results)
    assert [r[5] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]


def _torch_device_mesh():
    mesh = Mesh({"dp": 2, "tp": 2})
    device_mesh = mesh.to_torch_device_mesh()
    tp_ranks = dist.get_process_group_ranks(device_mesh.get_group("tp"))
    return device_mesh.mesh.tolist(), list(device_mesh.mesh_dim_names), tp_ranks, mesh.ranks_in_group("tp")


def test_to_torch_device_mesh(distributed):
    for mesh_ranks, names, tp_ranks, ours in distributed.run(4, _torch_device_mesh):
        assert mesh_ranks == [[0, 1], [2, 3]] and names == ["dp", "tp"]
        assert tp_ranks == ours


def _wrong_world_size():
    too_big = caught(Mesh, {"dp": 4, "tp": 2})
    unknown_axis = caught(lambda: Mesh({"dp": 2}).group("ep"))
    # Already initialised: asking again as the same rank is a no-op, as another rank an error.
    ctx = init_distributed(rank=dist.get_rank(), world_size=2)
    other_rank = caught(init_distributed, rank=dist.get_rank(), world_size=3)
    return too_big, unknown_axis, (ctx.world_size, ctx.backend), other_rank


def test_errors_inside_a_job(distributed):
    results = distributed.run(2, _wrong_world_size)
    assert len(results) == 2
    for too_big, unknown_axis, same_rank, other_rank in results:
        assert_caught(too_big, MeshError, "has 8 ranks but the job has 2 processes")
        assert_caught(unknown_axis, MeshError, "unknown mesh axis 'ep'")
        assert same_rank == (2, "gloo")
        assert_caught(other_rank, DistributedInitError, "already running as rank")


def test_init_errors_before_any_group(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(DistributedInitError, match="launch with torchrun"):
        init_distributed()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(MeshError, match=r"has 6 ranks but the job has 4 processes"):
        init_distributed(mesh_axes={"dp": 3, "tp": 2})
    monkeypatch.setenv("WORLD_SIZE", "four")
    with pytest.raises(DistributedInitError, match="not an integer"):
        init_distributed()
    assert not dist.is_initialized() and "MASTER_PORT" not in os.environ


def test_mesh_without_processes_is_an_error():
    with pytest.raises(MeshError, match="call polyshard.mesh.init_distributed"):
        Mesh({"dp": 2})
