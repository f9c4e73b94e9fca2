"""Contiguous, balanced stages from an ordered list of layers (one process, no communication)."""

import pytest

from polyshard.mesh import get_placement
from polyshard.pp import PartitionError, balanced_partition, build_stages, parameter_counts
from tests.pp import models


def test_balances_by_cost_not_by_count():
    assert balanced_partition([10, 10, 10, 30], 2) == [range(0, 3), range(3, 4)]
    assert balanced_partition([1] * 7, 3) == [range(0, 2), range(2, 4), range(4, 7)]  # uneven layer counts
    assert balanced_partition([5, 1, 1, 1, 1, 1], 2) == [range(0, 1), range(1, 6)]


def test_every_layer_in_exactly_one_stage():
    for n in range(1, 12):
        for p in range(1, n + 1):
            ranges = balanced_partition([(i * 7) % 5 + 1 for i in range(n)], p)
            assert [i for r in ranges for i in r] == list(range(n)) and all(len(r) > 0 for r in ranges)


def test_more_stages_than_layers_is_an_error():
    with pytest.raises(PartitionError, match="cannot split 3 layers into 4 stages.*choose num_stages <= 3"):
        balanced_partition([1, 1, 1], 4)


def test_parameter_counts_use_meta_device():
    assert parameter_counts(models.builders(2)) == [models.HIDDEN * models.HIDDEN + models.HIDDEN] * 2


def test_caller_cost_function_and_placements():
    # a cost that makes layer 0 as expensive as all the others together puts it alone on stage 0
    stages = build_stages(models.builders(), 2, [0, 1], cost=lambda i: 7.0 if i == 0 else 1.0)
    assert len(stages[0]) == 1 and len(stages[1]) == 7
    placement = get_placement(stages[1][0][0].weight)
    assert placement.name == "layers.1.0.weight" and placement.layer == 1
    assert placement.global_shape == (models.HIDDEN, models.HIDDEN)
