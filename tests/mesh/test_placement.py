"""Placement records: slicing, reassembly and JSON round trips."""

import pytest
import torch

from polyshard.mesh import MeshLayout, PlacementError, Replicate, Shard, TensorPlacement, get_placement, set_placement
from polyshard.mesh.placement import shard_tensor


def _reassemble(record, layout, pieces):
    full = torch.empty(record.tiled_shape)
    for rank, piece in enumerate(pieces):
        full[record.local_slices(layout.as_dict(), layout.coords(rank))] = piece
    return full


def test_two_axes_shard_same_dim_nest_outer_first():
    layout = MeshLayout({"dp": 2, "tp": 2})
    record = TensorPlacement("w", (8, 3), (("dp", Shard(0)), ("tp", Shard(0))))
    # dp splits rows into halves; tp splits each half: rank (dp=1, tp=0) holds rows 4:6.
    assert record.local_slices(layout.as_dict(), {"dp": 1, "tp": 0}) == (slice(4, 6), slice(0, 3))
    full = torch.arange(24.0).reshape(8, 3)
    pieces = [shard_tensor(full, record, layout.as_dict(), layout.coords(r)) for r in range(4)]
    assert all(p.shape == record.local_shape(layout.as_dict()) for p in pieces)
    torch.testing.assert_close(_reassemble(record, layout, pieces), full, rtol=0, atol=0)


def test_shard_two_dims_and_replicate():
    layout = MeshLayout({"dp": 2, "tp": 2, "pp": 2})
    record = TensorPlacement("w", (4, 6), (("dp", Replicate()), ("tp", Shard(1)), ("pp", Shard(0))))
    full = torch.randn(4, 6)
    pieces = [shard_tensor(full, record, layout.as_dict(), layout.coords(r)) for r in range(8)]
    assert pieces[0].shape == (2, 3)
    torch.testing.assert_close(_reassemble(record, layout, pieces), full, rtol=0, atol=0)
    torch.testing.assert_close(pieces[0], pieces[4], rtol=0, atol=0)  # dp replicas hold equal pieces


def test_padded_vocab_record_round_trips_json():
    record = TensorPlacement("wte.weight", (50257, 8), (("tp", Shard(0)),), layer=0, padded_shape=(50260, 8))
    again = TensorPlacement.from_json(record.to_json())
    assert again == record
    assert again.local_shape({"tp": 4}) == (12565, 8)


def test_attach_and_read():
    p = torch.nn.Parameter(torch.zeros(2))
    assert get_placement(p) is None
    record = TensorPlacement("x", (4,), (("tp", Shard(0)),))
    set_placement(p, record)
    assert get_placement(p) is record
    assert get_placement(p).with_axis("dp", Replicate()).placement("dp") == Replicate()


def test_bad_records():
    with pytest.raises(PlacementError, match="shards dim 2 but the tensor has 2 dims"):
        TensorPlacement("w", (4, 4), (("tp", Shard(2)),))
    with pytest.raises(PlacementError, match="does not split evenly over tp=3; pad the dim"):
        TensorPlacement("w", (4, 4), (("tp", Shard(0)),)).local_slices({"tp": 3}, {"tp": 0})
    with pytest.raises(PlacementError, match="at least as large"):
        TensorPlacement("w", (4, 4), padded_shape=(3, 4))
    with pytest.raises(PlacementError, match="expected a TensorPlacement"):
        set_placement(torch.zeros(1), {"name": "w"})
