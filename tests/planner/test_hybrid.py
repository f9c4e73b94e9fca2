"""The planner weighs hybrid sharding: where its groups run, what it holds, when the search offers it.

The bytes themselves are pinned to real engines elsewhere: model states in
test_planner_memory.py and wire bytes per group in test_planner_comm.py (both
have hybrid rows); here, the placement rules on a made-up machine.
"""

import dataclasses

from polyshard.planner.cost import crosses_nodes
from polyshard.planner.model_states import rank_model_states
from polyshard.planner.search import Request, layouts
from polyshard.trainer.config import from_dict

from ._machine import flat_profile


def _config(**parallel):
    return from_dict({"model": {"preset": "tiny"}, "parallel": parallel, "training": {"global_batch_size": 16}})


def test_a_shard_group_inside_a_node_keeps_zero_traffic_there():
    profile = flat_profile(devices_per_node=2)
    hybrid = _config(dp=4, dp_shard=2, zero_stage=3).parallel
    # dp_shard is the fastest data axis: ranks [0, 1] and [2, 3] shard; [0, 2] and [1, 3] hold copies.
    assert not crosses_nodes("dp_shard", hybrid, profile)
    assert crosses_nodes("dp_replicate", hybrid, profile)
    assert crosses_nodes("dp", _config(dp=4, zero_stage=3).parallel, profile)
    # With tp inside the node too, a shard group of 2 data ranks spans 4 devices: across nodes of 2.
    assert crosses_nodes("dp_shard", _config(dp=4, dp_shard=2, tp=2, zero_stage=3).parallel, profile)


def test_sharding_over_fewer_ranks_holds_more():
    full, hybrid = _config(dp=4, zero_stage=3), _config(dp=4, dp_shard=2, zero_stage=3)
    assert rank_model_states(hybrid, 0).total > rank_model_states(full, 0).total
    # dp_shard = 2 of dp = 4 holds what ZeRO on dp = 2 holds.
    assert rank_model_states(hybrid, 0) == rank_model_states(_config(dp=2, zero_stage=3), 0)


def test_the_search_offers_the_node_sized_shard_group_when_dp_spans_nodes():
    config = _config()
    across = list(layouts(config, Request(devices=8, devices_per_node=4, memory_gb=1.0)))
    hybrid = [p for p in across if p.hybrid]
    assert hybrid and all(p.zero_stage >= 1 and p.dp_shard * p.tp * p.ep * p.cp <= 4 for p in hybrid)
    # each hybrid layout is the twin of a plain one
    plain = {dataclasses.replace(p, dp_shard=None) for p in across if not p.hybrid}
    assert all(dataclasses.replace(p, dp_shard=None) in plain for p in hybrid)
    # on one node sharding over fewer ranks saves no cross-node traffic: not offered
    inside = list(layouts(config, Request(devices=4, devices_per_node=4, memory_gb=1.0)))
    assert not any(p.hybrid for p in inside)


def test_a_fixed_dp_shard_is_the_one_offered():
    request = Request(devices=8, devices_per_node=8, memory_gb=1.0, fixed={"dp": 8, "dp_shard": 2})
    found = list(layouts(_config(), request))
    assert found and all(p.dp_shard == 2 and p.zero_stage >= 1 for p in found)
    # dp_shard = dp is sharding over all of dp: the plain layouts
    request = Request(devices=8, devices_per_node=8, memory_gb=1.0, fixed={"dp": 8, "dp_shard": 8})
    assert all(not p.hybrid for p in layouts(_config(), request))
