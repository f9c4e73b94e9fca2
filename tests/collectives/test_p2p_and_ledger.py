"""Point-to-point helpers and the byte ledger."""

import pytest
import torch
import torch.distributed as dist

from polyshard.collectives import (
    CommLedger,
    exchange,
    ops,
    post_exchange,
    recv,
    recv_with_meta,
    send,
    send_with_meta,
)
from polyshard.mesh import Mesh


def _ring_exchange():
    # Every rank sends to both neighbours and receives from both, all posted at once.
    n, r = dist.get_world_size(), dist.get_rank()
    left, right = (r - 1) % n, (r + 1) % n
    from_left, from_right = torch.empty(3), torch.empty(3)
    exchange(
        sends=[(torch.full((3,), float(r)), right), (torch.full((3,), 10.0 + r), left)],
        recvs=[(from_left, left), (from_right, right)],
    )
    return from_left.tolist(), from_right.tolist()


def test_exchange_both_neighbours_at_once(distributed):
    for r, (from_left, from_right) in enumerate(distributed.run(3, _ring_exchange)):
        assert from_left == [float((r - 1) % 3)] * 3  # left neighbour sent its rank rightwards
        assert from_right == [10.0 + (r + 1) % 3] * 3  # right neighbour sent 10 + rank leftwards


def _posted_ring():
    # Two rounds round the ring, each posted before this rank "computes" and waited after; the
    # second is posted while the first is still in flight, so per-peer order must hold.
    n, r = dist.get_world_size(), dist.get_rank()
    right, left = (r + 1) % n, (r - 1) % n
    first, second = torch.empty(2), torch.empty(2)
    with CommLedger() as ledger:
        pending = [
            post_exchange(sends=[(torch.full((2,), float(r)), right)], recvs=[(first, left)]),
            post_exchange(sends=[(torch.full((2,), 100.0 + r), right)], recvs=[(second, left)]),
        ]
        busy = torch.ones(64, 64) @ torch.ones(64, 64)  # work done while the transfers run
        for p in pending:
            p.wait()
    return first.tolist(), second.tolist(), ledger.calls("send"), ledger.total("send"), float(busy[0, 0])


def test_post_exchange_returns_before_waiting(distributed):
    for r, (first, second, sends, sent_bytes, busy) in enumerate(distributed.run(3, _posted_ring)):
        assert first == [float((r - 1) % 3)] * 2 and second == [100.0 + (r - 1) % 3] * 2
        assert sends == 2 and sent_bytes == 2 * 2 * 4 and busy == 64.0


def _pipeline_pass():
    # Stage r receives from r-1, adds one, sends to r+1: agreed shape, then with metadata.
    n, r = dist.get_world_size(), dist.get_rank()
    x = torch.zeros(2, 3) if r == 0 else recv(torch.empty(2, 3), r - 1)
    if r < n - 1:
        send(x + 1, r + 1)
    y = torch.arange(6, dtype=torch.bfloat16).reshape(1, 2, 3) if r == 0 else recv_with_meta(r - 1)
    if r < n - 1:
        send_with_meta(y * 2, r + 1)
    return x.sum().item(), y.dtype, tuple(y.shape), y.float().sum().item()


def test_send_recv_chain(distributed):
    results = distributed.run(4, _pipeline_pass)
    assert [r[0] for r in results] == [0.0, 6.0, 12.0, 18.0]
    assert all(r[1] == torch.bfloat16 and r[2] == (1, 2, 3) for r in results)
    assert [r[3] for r in results] == [15.0, 30.0, 60.0, 120.0]


def _ledger_counts():
    n = dist.get_world_size()
    mesh = Mesh({"dp": n // 2, "tp": 2})
    numel = 1536  # divisible by every world size used
    with CommLedger() as ledger:
        ops.all_reduce(torch.ones(numel))
        ops.all_reduce(torch.ones(numel), group=mesh.group("tp"))
        ops.all_gather(torch.ones(numel // n), 0)
        ops.reduce_scatter(torch.ones(numel), 0)
    # Outside the context nothing more is recorded.
    ops.all_reduce(torch.ones(numel))
    size = numel * 4
    return (
        ledger.calls("all_reduce"),
        ledger.total("all_reduce", group=tuple(range(n))),
        ledger.wire("all_reduce", group=tuple(range(n))),
        ledger.wire("all_reduce", group=mesh.group("tp")),
        ledger.total("all_gather"),
        ledger.wire("all_gather"),
        ledger.wire("reduce_scatter"),
        size,
        "all_reduce" in ledger.summary(),
    )


@pytest.mark.parametrize(  # the tp group (2 ranks) must differ from the world
    "world", [4, pytest.param(6, marks=pytest.mark.long)]
)
def test_ledger_ring_volumes(distributed, world):
    for calls, ar_bytes, ar_wire, tp_wire, ag_bytes, ag_wire, rs_wire, size, has_summary in distributed.run(
        world, _ledger_counts
    ):
        n = world
        assert calls == 2 and ar_bytes == size
        assert ar_wire == pytest.approx(2 * (n - 1) / n * size)  # ring all-reduce: 2(n-1)/n x size
        assert tp_wire == pytest.approx(2 * (2 - 1) / 2 * size)  # same formula on the 2-rank tp group
        assert ag_bytes == size and ag_wire == pytest.approx((n - 1) / n * size)
        assert rs_wire == pytest.approx((n - 1) / n * size)
        assert has_summary


def _all_to_all_wire():
    r = dist.get_rank()
    with CommLedger() as ledger:
        if r == 0:
            ops.all_to_all(torch.ones(6, 2), output_split_sizes=[1, 4], input_split_sizes=[1, 5])
        else:
            ops.all_to_all(torch.ones(6, 2), output_split_sizes=[5, 2], input_split_sizes=[4, 2])
    return ledger.wire("all_to_all")


def test_ledger_all_to_all_counts_rows_to_others(distributed):
    # Rank 0 sends 5 rows to rank 1; rank 1 sends 4 rows to rank 0; a row is 2 float32 = 8 bytes.
    assert distributed.run(2, _all_to_all_wire) == [40.0, 32.0]


def _reduce_scatter_in_place():
    # Rank r gives a flat buffer of n pieces of 3: piece j holds (r + 1) * (j + 1) + [0, 0.5, 0.25].
    n, r = dist.get_world_size(), dist.get_rank()
    buffer = torch.cat([(r + 1) * (j + 1) + torch.tensor([0.0, 0.5, 0.25]) for j in range(n)])
    with CommLedger() as ledger:
        piece, work = ops.reduce_scatter_flat_in_place(buffer, async_op=True)
        assert work is not None
        work.wait()
    expected = ops.reduce_scatter(torch.cat([(r + 1) * (j + 1) + torch.tensor([0.0, 0.5, 0.25]) for j in range(n)]))
    aliased = piece.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
    blocking, none = ops.reduce_scatter_flat_in_place(torch.ones(2 * n))
    return piece.tolist(), expected.tolist(), aliased, ledger.total("reduce_scatter"), blocking.tolist(), none


def test_reduce_scatter_flat_in_place_sums_this_ranks_piece(distributed):
    # 3 ranks: piece r sums (k + 1) * (r + 1) over the ranks k (6 * (r + 1)) plus 3 times the offsets, as
    # the plain reduce-scatter does; the ledger records a reduce-scatter of the whole buffer; on gloo the
    # piece is a view of the buffer (no copies).
    for r, (piece, expected, aliased, recorded, blocking, none) in enumerate(
        distributed.run(3, _reduce_scatter_in_place)
    ):
        assert piece == expected == [6.0 * (r + 1), 6.0 * (r + 1) + 1.5, 6.0 * (r + 1) + 0.75]
        assert aliased, "on gloo the summed piece is the buffer's own row"
        assert recorded == 3 * 3 * 4
        assert blocking == [3.0, 3.0] and none is None
