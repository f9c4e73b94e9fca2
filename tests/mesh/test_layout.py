"""Rank arithmetic of MeshLayout, checked without processes."""

import pytest

from polyshard.mesh import MeshError, MeshLayout


def test_quintnet_groups_dp_tp_pp():
    # Axes ordered [dp, tp, pp], 2x2x2: the groups listed in the QuintNet write-up.
    layout = MeshLayout({"dp": 2, "tp": 2, "pp": 2})
    assert layout.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.groups("pp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.groups("tp") == [[0, 2], [1, 3], [4, 6], [5, 7]]


def test_docstring_example_pp_dp_tp():
    # The worked example in polyshard/mesh/layout.py, every group.
    layout = MeshLayout({"pp": 2, "dp": 2, "tp": 2})
    expected = {
        ("tp",): [[0, 1], [2, 3], [4, 5], [6, 7]],
        ("dp",): [[0, 2], [1, 3], [4, 6], [5, 7]],
        ("pp",): [[0, 4], [1, 5], [2, 6], [3, 7]],
        ("pp", "dp"): [[0, 2, 4, 6], [1, 3, 5, 7]],
        ("pp", "tp"): [[0, 1, 4, 5], [2, 3, 6, 7]],
        ("dp", "tp"): [[0, 1, 2, 3], [4, 5, 6, 7]],
        ("pp", "dp", "tp"): [list(range(8))],
    }
    assert {s: layout.groups(s) for s in layout.axis_subsets()} == expected
    assert layout.coords(5) == {"pp": 1, "dp": 0, "tp": 1}


def test_last_axis_fastest_and_round_trip():
    layout = MeshLayout([("dp", 3), ("ep", 2), ("tp", 2)])
    assert [layout.coords(r)["tp"] for r in range(4)] == [0, 1, 0, 1]
    for rank in range(layout.world_size):
        assert layout.rank_of(layout.coords(rank)) == rank


def test_multi_axis_group_order_and_partition():
    layout = MeshLayout({"dp": 2, "ep": 3, "tp": 2})
    groups = layout.groups(("ep", "dp"))  # axis order in the request does not matter
    assert groups == layout.groups(("dp", "ep"))
    assert sorted(r for g in groups for r in g) == list(range(12))
    assert all(len(g) == 6 for g in groups)
    assert layout.ranks_in_group(("dp", "ep"), 1) == [1, 3, 5, 7, 9, 11]


def test_size_one_axes():
    layout = MeshLayout({"pp": 1, "dp": 4, "tp": 1})
    assert layout.groups("tp") == [[0], [1], [2], [3]]
    assert layout.groups("dp") == [[0, 1, 2, 3]]
    assert layout.size(("pp", "tp")) == 1


@pytest.mark.parametrize(
    "axes, message",
    [
        ({}, "at least one axis"),
        ([("dp", 2), ("dp", 2)], "duplicate axis names"),
        ({"": 2}, "non-empty strings"),
        ({"dp": 0}, "sizes must be integers >= 1"),
        ({"dp": 2.0}, "sizes must be integers >= 1"),
    ],
)
def test_bad_layouts(axes, message):
    with pytest.raises(MeshError, match=message):
        MeshLayout(axes)


def test_unknown_axis_and_bad_rank():
    layout = MeshLayout({"dp": 2, "tp": 2})
    with pytest.raises(MeshError, match=r"unknown mesh axis 'pp'; this mesh has axes \['dp', 'tp'\]"):
        layout.groups("pp")
    with pytest.raises(MeshError, match="outside this mesh of 4 ranks"):
        layout.coords(4)
    with pytest.raises(MeshError, match="listed twice"):
        layout.groups(("dp", "dp"))


def test_split_axis_answers_for_the_pair():
    # The module docstring's example: dp split into dp_replicate x dp_shard, tp fastest.
    layout = MeshLayout({"dp_replicate": 2, "dp_shard": 2, "tp": 2})
    assert layout.aliases == {"dp": ("dp_replicate", "dp_shard")}
    assert [layout.coords(r)["dp"] for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert layout.groups("dp_shard") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.groups("dp_replicate") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # "dp" is the pair: the same groups as an unsplit dp=4 axis would give.
    assert layout.groups("dp") == MeshLayout({"dp": 4, "tp": 2}).groups("dp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert layout.size("dp") == 4 and layout.size(("dp", "tp")) == 8
    assert layout.normalize_axes(("tp", "dp")) == ("dp_replicate", "dp_shard", "tp")
    assert layout.rank_of(layout.coords(5)) == 5


def test_bad_split_axes():
    with pytest.raises(MeshError, match="must come before 'dp_shard'"):
        MeshLayout({"dp_shard": 2, "dp_replicate": 2})
    with pytest.raises(MeshError, match="already the pair's name"):
        MeshLayout({"dp": 2, "dp_replicate": 2, "dp_shard": 2})
    with pytest.raises(MeshError, match=r"unknown mesh axis 'ep'.*dp \(= dp_replicate x dp_shard\)"):
        MeshLayout({"dp_replicate": 2, "dp_shard": 2}).groups("ep")
