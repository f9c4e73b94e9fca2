"""A family registered from outside polyshard.models (tests/models/outside_family) trains on tp2 and
pp2 with no change to the trainer, and matches one process: the seam a new family uses."""

import pytest

from polyshard.models import ConfigError
from polyshard.trainer.config import from_dict
from tests._layouts import trained_numbers
from tests._short import short_run
from tests.models.outside_family import KIND, register_outside_family

STEPS = 4
# Layouts differ from one process only in the order float32 sums are taken: the dense parity tests' bound.
DENSE_RTOL = 2e-5


def _raw(corpus, **parallel):
    return {
        "model": {"kind": KIND, "hidden": 32, "num_layers": 2, "num_heads": 4, "context_length": 16},
        "parallel": parallel,
        **short_run(STEPS),
        "data": {"source": corpus},
        "logging": {"progress_bar": False},
    }


def _train(raw, out):
    register_outside_family()  # in each worker: a family is registered per process
    return trained_numbers(from_dict(raw), out)


def test_an_unregistered_kind_is_named():
    with pytest.raises(ConfigError, match=f"model.kind='{KIND}-x'; choose one of"):
        from_dict({"model": {"kind": KIND + "-x"}})


@pytest.mark.parametrize("parallel", [{"tp": 2}, {"pp": 2, "microbatches": 2}], ids=["tp2", "pp2"])
def test_a_family_from_outside_trains_on_tp2_and_pp2(distributed, corpus, tmp_path, parallel):
    reference = distributed.run(1, _train, _raw(corpus), tmp_path / "one")[0]
    results = distributed.run(2, _train, _raw(corpus, **parallel), tmp_path / "two")
    assert all(r == results[0] for r in results)
    assert results[0] == pytest.approx(reference, rel=DENSE_RTOL)
    assert results[0][STEPS - 1] < results[0][0]  # it learns
