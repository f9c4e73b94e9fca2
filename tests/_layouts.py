"""The parity tests' layouts by name, and one runner that trains a config on a layout and compares it.

``LAYOUTS`` is the one table: a name (the test id) -> the world size and the ``[parallel]`` settings. A
parity test lists the names it runs (:func:`layout` makes the pytest rows, marks included) and calls the
``parity`` fixture (tests/conftest.py), which trains the same config on one process (once per
config, cached for the session) and on the layout, then compares through tests/_pieces.py:

    TOLERANCE = Tolerance(numbers=2e-5, grads={...}, params={...})   # each with a comment saying why

    @pytest.mark.parametrize("name", [layout("dp2"), layout("tp2xpp2-zbh1", LONG)])
    def test_it_trains_as_on_one_process(parity, corpus, tmp_path, name):
        compared = parity.check(name, functools.partial(_config, corpus), TOLERANCE, tmp_path)

What is compared: every rank's losses and pre-clip gradient norms (equal on every rank, and within
``numbers`` of the reference's, relative), every gradient of the first step as the optimizer reads it
(reduced, clipped), every parameter and every saved buffer after the last step; replicas (over dp, tp,
cp, a tied weight's copies) must be equal bit for bit (:func:`tests._pieces.assemble`). The
returned :class:`Compared` names every tensor compared and the largest difference seen, so a test can
say what it expects to be there (a sink, a router's bias) and a tolerance's comment can quote a measurement.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from polyshard.mesh import Mesh
from polyshard.trainer.config import Config
from polyshard.trainer.loop import Hook, Trainer
from tests._pieces import assemble, buffer_pieces, gradient_pieces, parameter_pieces, where

LONG = pytest.mark.long

# name -> (world size, [parallel] settings). Names say the axes and their sizes ("x" composes them), then
# what differs from the axis's defaults: the pipeline schedule, the ZeRO stage, the cp style.
LAYOUTS: dict[str, tuple[int, dict[str, Any]]] = {
    "one-process": (1, {}),  # for a reference of another config (the same numbers another way)
    # data parallel and ZeRO
    "dp2": (2, {"dp": 2}),
    "dp2-zero1": (2, {"dp": 2, "zero_stage": 1}),
    "dp2-zero2": (2, {"dp": 2, "zero_stage": 2}),
    "dp2-zero3": (2, {"dp": 2, "zero_stage": 3}),
    "dp3-zero1": (3, {"dp": 3, "zero_stage": 1}),  # rows split unevenly (padding), owners 0, 1, 2, 0, ...
    "dp3-zero2": (3, {"dp": 3, "zero_stage": 2}),
    # tensor parallel, with sequence parallelism (-sp)
    "tp2": (2, {"tp": 2}),
    "tp2-sp": (2, {"tp": 2, "sequence_parallel": True}),
    "tp4": (4, {"tp": 4}),
    "tp4-sp": (4, {"tp": 4, "sequence_parallel": True}),
    # pipelines: the schedule, and microbatches (m2: fewer than a V's or three stages' stages)
    "pp2-m1": (2, {"pp": 2}),  # one microbatch: the stages take turns (evaluation and generation)
    "pp2-1f1b": (2, {"pp": 2, "microbatches": 2, "schedule": "1f1b"}),
    "pp2-zbh1": (2, {"pp": 2, "microbatches": 4, "schedule": "zb-h1"}),
    "pp2-zbh1-m2": (2, {"pp": 2, "microbatches": 2, "schedule": "zb-h1"}),
    "pp2-interleaved": (2, {"pp": 2, "microbatches": 2, "schedule": "interleaved", "virtual_stages": 2}),
    # V placements: rank 0 holds the embedding and the head (stages 0 and 3), rank 1 the two middle stages
    "pp2-zbv": (2, {"pp": 2, "microbatches": 4, "schedule": "zb-v", "virtual_stages": 2}),
    "pp2-zbv-m2": (2, {"pp": 2, "microbatches": 2, "schedule": "zb-v", "virtual_stages": 2}),
    "pp2-dualpipev": (2, {"pp": 2, "microbatches": 4, "schedule": "dualpipev", "virtual_stages": 2}),
    "pp3-m2-zero1": (3, {"pp": 3, "microbatches": 2, "zero_stage": 1}),
    # three uneven stages (embedding + block, block, head) with fewer microbatches than stages
    "pp3-uneven": (3, {"pp": 3, "microbatches": 2, "stage_layers": [2, 1, 1]}),
    "pp3-uneven-zero1": (3, {"pp": 3, "microbatches": 2, "stage_layers": [2, 1, 1], "zero_stage": 1}),
    # context parallel: the ring (default), one all-gather, Ulysses' all-to-alls, both on 2 x 2
    "cp2-ring": (2, {"cp": 2}),
    "cp2-allgather": (2, {"cp": 2, "cp_style": "allgather"}),
    "cp2-ulysses": (2, {"cp": 2, "cp_style": "ulysses"}),
    "cp3-ring": (3, {"cp": 3}),  # an odd group: 2 x 3 chunks, rank r holding r and 5 - r
    "cp3-allgather": (3, {"cp": 3, "cp_style": "allgather"}),
    "cp3-ulysses": (3, {"cp": 3, "cp_style": "ulysses"}),
    "cp4-ring": (4, {"cp": 4}),
    "cp4-allgather": (4, {"cp": 4, "cp_style": "allgather"}),
    "cp4-ulysses": (4, {"cp": 4, "cp_style": "ulysses"}),
    "cp2x2-ulysses-ring": (4, {"cp": 4, "cp_style": "ulysses+ring", "cp_ulysses": 2}),
    # experts
    "ep2": (2, {"ep": 2}),
    "ep4": (4, {"ep": 4}),
    # two axes
    "dp2xtp2": (4, {"dp": 2, "tp": 2}),
    "dp2xtp2-zero2": (4, {"dp": 2, "tp": 2, "zero_stage": 2}),
    # sequence parallelism under each ZeRO stage: the sequence-sharded norms' gradients summed over tp
    "dp2xtp2-sp-zero1": (4, {"dp": 2, "tp": 2, "sequence_parallel": True, "zero_stage": 1}),
    "dp2xtp2-sp-zero2": (4, {"dp": 2, "tp": 2, "sequence_parallel": True, "zero_stage": 2}),
    "dp2xtp2-sp-zero3": (4, {"dp": 2, "tp": 2, "sequence_parallel": True, "zero_stage": 3}),
    "dp3xtp2-sp-zero3": (6, {"dp": 3, "tp": 2, "sequence_parallel": True, "zero_stage": 3}),
    "dp2xpp2-zero2": (4, {"dp": 2, "pp": 2, "microbatches": 2, "zero_stage": 2}),
    # GPipe: both microbatches' forwards run before either backward, so a ZeRO-3 unit kept gathered
    # from forward to backward (the chunked loss's head) waits for two backwards
    "dp2xpp2-gpipe-zero3": (4, {"dp": 2, "pp": 2, "microbatches": 2, "schedule": "gpipe", "zero_stage": 3}),
    "tp2xpp2": (4, {"tp": 2, "pp": 2, "microbatches": 2}),
    # split backward over tp's matmul Functions, which compute their weight gradients in B: W reuses them
    "tp2xpp2-zbh1": (4, {"tp": 2, "pp": 2, "microbatches": 2, "schedule": "zb-h1"}),
    "cp2xtp2": (4, {"cp": 2, "tp": 2}),
    "cp2xtp2-sp": (4, {"cp": 2, "tp": 2, "sequence_parallel": True}),
    "cp2xtp2-ulysses": (4, {"cp": 2, "tp": 2, "cp_style": "ulysses"}),
    "cp2xdp2": (4, {"cp": 2, "dp": 2}),
    "cp2xdp2-zero3": (4, {"cp": 2, "dp": 2, "zero_stage": 3}),
    "cp2xdp2-zero3-ulysses": (4, {"cp": 2, "dp": 2, "zero_stage": 3, "cp_style": "ulysses"}),
    "cp2xpp2": (4, {"cp": 2, "pp": 2, "microbatches": 2}),
    "cp2xpp2-ulysses": (4, {"cp": 2, "pp": 2, "microbatches": 2, "cp_style": "ulysses"}),
    "dp2xep2": (4, {"dp": 2, "ep": 2}),
    "dp2xep2-zero1": (4, {"dp": 2, "ep": 2, "zero_stage": 1}),
    "ep2xtp2": (4, {"ep": 2, "tp": 2}),
    "ep2xpp2": (4, {"ep": 2, "pp": 2, "microbatches": 2}),
    "ep2xtp2-sp": (4, {"ep": 2, "tp": 2, "sequence_parallel": True}),
    "cp2xep2": (4, {"cp": 2, "ep": 2}),
    "cp2xep2-allgather": (4, {"cp": 2, "ep": 2, "cp_style": "allgather"}),
    "cp2xep2-ulysses": (4, {"cp": 2, "ep": 2, "cp_style": "ulysses"}),
    "cp2xep2-zero1": (4, {"cp": 2, "ep": 2, "zero_stage": 1}),
    "cp2xep2-ulysses-zero1": (4, {"cp": 2, "ep": 2, "cp_style": "ulysses", "zero_stage": 1}),
    # three axes: eight processes (~20 s each on two cores), make test-long's
    "dp2xtp2xpp2": (8, {"dp": 2, "tp": 2, "pp": 2, "microbatches": 2}),
    "dp2xcp2xtp2": (8, {"dp": 2, "cp": 2, "tp": 2}),
    "dp2xcp2xtp2-sp": (8, {"dp": 2, "cp": 2, "tp": 2, "sequence_parallel": True}),
    "dp2xcp2xep2": (8, {"dp": 2, "cp": 2, "ep": 2}),
    # hybrid sharding: ZeRO over groups of dp_shard neighbouring data ranks, all-reduced across the groups
    "dp4-shard2-zero1": (4, {"dp": 4, "dp_shard": 2, "zero_stage": 1}),
    "dp4-shard2-zero2": (4, {"dp": 4, "dp_shard": 2, "zero_stage": 2}),
    "dp4-shard2-zero3": (4, {"dp": 4, "dp_shard": 2, "zero_stage": 3}),
    "dp2-shard1xpp2-zero2": (4, {"dp": 2, "dp_shard": 1, "pp": 2, "microbatches": 2, "zero_stage": 2}),
    "dp2-shard1xep2-zero1": (4, {"dp": 2, "dp_shard": 1, "ep": 2, "zero_stage": 1}),
    "dp2-shard1xcp2-zero3": (4, {"dp": 2, "dp_shard": 1, "cp": 2, "zero_stage": 3}),
    "dp4-shard2xtp2-zero1": (8, {"dp": 4, "dp_shard": 2, "tp": 2, "zero_stage": 1}),
    "dp4-shard2xtp2-sp-zero3": (8, {"dp": 4, "dp_shard": 2, "tp": 2, "sequence_parallel": True, "zero_stage": 3}),
    "dp2xtp2-spxpp2-zero3": (
        8,
        {"dp": 2, "tp": 2, "sequence_parallel": True, "pp": 2, "microbatches": 2, "zero_stage": 3},
    ),
    "dp4-shard2-zero2-cp2-ulysses": (8, {"dp": 4, "dp_shard": 2, "zero_stage": 2, "cp": 2, "cp_style": "ulysses"}),
}


def layout(name: str, *marks: pytest.MarkDecorator, model: str | None = None) -> Any:
    """The pytest row of layout ``name`` (its id), with ``model`` before it when a test runs several."""
    if name not in LAYOUTS:
        raise KeyError(f"no layout {name!r} in tests/_layouts.py's LAYOUTS")
    if model is None:
        return pytest.param(name, id=name, marks=marks)
    return pytest.param(model, name, id=f"{model}-{name}", marks=marks)


def mesh_row(name: str, *marks: pytest.MarkDecorator, id: str | None = None, **extra: Any) -> Any:
    """The pytest row ``(world size, [parallel] settings)`` of layout ``name``, for a test that runs the
    layout its own way; ``extra`` settings join the layout's (a recompute mode, document masks), and the
    row's id then says so (``id``)."""
    if name not in LAYOUTS:
        raise KeyError(f"no layout {name!r} in tests/_layouts.py's LAYOUTS")
    world, parallel = LAYOUTS[name]
    return pytest.param(world, {**parallel, **extra}, id=id or name, marks=marks)


def without(name: str, *axes: str) -> dict[str, Any]:
    """Layout ``name``'s settings less ``axes`` (and their styles): the same layout without cp, say."""
    return {k: v for k, v in LAYOUTS[name][1].items() if k.split("_")[0] not in axes}


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """How close a layout must come to its reference; the test that defines one says why each is what it is."""

    numbers: float
    """Losses and pre-clip gradient norms, relative (pytest.approx's rel)."""
    grads: dict[str, float]
    """The first step's gradients: torch.testing.assert_close's rtol and atol."""
    params: dict[str, float]
    """Every parameter after the last step."""
    buffers: dict[str, float] = dataclasses.field(default_factory=lambda: {"rtol": 0.0, "atol": 0.0})
    """Saved buffers (a router's selection bias, moved by exact token counts): bit for bit unless told."""
    numbers_abs: float = 0.0
    """Losses and norms, absolute, besides ``numbers``: for a loss whose terms cancel (GRPO's advantages
    have mean 0), whose round-off is of the terms' size, not of the loss's."""
    params_outliers: tuple[float, float] | None = None
    """(fraction, atol): at most this fraction of a parameter's entries may lie past ``params``, each still
    within atol. Adam divides each gradient by its own size, so an entry whose gradient is as small as its
    round-off takes a step set by that noise (tests/_bounds.py's AdamWDrift): a few entries, each a fraction
    of one update, where a stale or misplaced tensor moves most of its entries by a whole one."""


@dataclasses.dataclass
class Compared:
    """What a check compared: the count of numbers, the tensors' names by kind, the largest differences,
    and the layout's results (every rank's worker dict) for a test's own further checks."""

    numbers: int
    names: dict[str, list[str]]
    largest: dict[str, float]
    results: list[dict[str, Any]]


class _FirstGradients(Hook):
    """Keeps this rank's pieces of the first step's gradients, as the optimizer read them."""

    def __init__(self) -> None:
        self.engine: Any = None
        self.pieces: list[Any] = []

    def before_zero_grad(self, step: int) -> None:
        if step == 1:
            self.pieces = gradient_pieces(self.engine)


def _within_outliers(
    name: str, got: torch.Tensor, want: torch.Tensor, tol: dict[str, float], outliers: tuple[float, float]
) -> None:
    """Every entry within ``outliers``' atol, and all but its fraction within ``tol`` (see Tolerance)."""
    fraction, atol = outliers
    assert got.shape == want.shape, f"params {name}: {tuple(got.shape)} against {tuple(want.shape)}"
    moved = (got.double() - want.double()).abs()
    largest = float(moved.max()) if moved.numel() else 0.0
    assert largest <= atol, f"params {name}: {largest} past {atol}"
    beyond = int((moved > tol["atol"] + tol["rtol"] * want.double().abs()).sum())
    assert beyond <= fraction * want.numel(), f"params {name}: {beyond} of {want.numel()} entries past {tol}"


def trained_numbers(config: Config, out: Path) -> list[float]:
    """A worker for runs whose tensors no reference shares: the real training loop on this rank, then its
    losses and pre-clip gradient norms (losses alone would not see a gradient scaled by a constant: AdamW
    and clipping normalise it away; the norm does)."""
    from polyshard.trainer.loop import train

    result = train(config, Mesh(config.parallel.mesh_axes), out, log=False)
    return result.losses + result.grad_norms


def train_pieces(config: Config, out: Path) -> dict[str, Any]:
    """The worker: the real training loop on this rank, then its numbers and its pieces of every tensor."""
    mesh = Mesh(config.parallel.mesh_axes)
    first = _FirstGradients()
    trainer = Trainer(config, mesh, out, log=False, hooks=[first])
    first.engine = trainer.engine
    return compared_pieces(mesh, trainer, first, trainer.run())


def compared_pieces(mesh: Mesh, trainer: Trainer, first: _FirstGradients, result: Any) -> dict[str, Any]:
    """What :func:`compare` reads of one rank's run: a worker with hooks of its own adds its keys to it."""
    return {
        **where(mesh),
        # losses alone would not see a gradient scaled by a constant (AdamW and clipping normalise it away)
        "numbers": result.losses + result.grad_norms,
        "grads": first.pieces,
        "params": parameter_pieces(trainer.engine),
        "buffers": buffer_pieces(trainer.engine),
    }


def compare(
    results: list[dict[str, Any]], reference: list[dict[str, Any]], tolerance: Tolerance, *, learns: bool = True
) -> Compared:
    """Every rank's results against the reference's (each a worker's dict); raises on the first difference.
    ``learns``: the last step's loss must be under the first's (not for a harness whose batches are noise)."""
    numbers = results[0]["numbers"]
    assert all(r["numbers"] == numbers for r in results), "ranks report different losses or norms"
    expected = pytest.approx(reference[0]["numbers"], rel=tolerance.numbers, abs=tolerance.numbers_abs)
    assert numbers == expected  # losses, pre-clip norms
    steps = len(numbers) // 2
    assert not learns or numbers[steps - 1] < numbers[0], f"it does not learn: losses {numbers[:steps]}"
    names, largest = {}, {}
    for key, tol in (("grads", tolerance.grads), ("params", tolerance.params), ("buffers", tolerance.buffers)):
        got, expected = assemble(results, key), assemble(reference, key)
        assert set(got) == set(expected), f"{key}: {sorted(set(got) ^ set(expected))} on one side only"
        names[key], largest[key] = sorted(expected), 0.0
        for name, value in expected.items():
            if key == "params" and tolerance.params_outliers is not None:
                _within_outliers(name, got[name], value, tol, tolerance.params_outliers)
            else:
                torch.testing.assert_close(got[name], value, **tol, msg=lambda m, k=key, n=name: f"{k} {n}: {m}")
            if value.numel():
                largest[key] = max(largest[key], float((got[name].double() - value.double()).abs().max()))
    assert names["grads"] and names["params"], "nothing compared"
    return Compared(len(numbers), names, largest, results)


class Parity:
    """The ``parity`` fixture: references trained once per config, checks of a layout against them."""

    def __init__(self, distributed: Any, out: Path) -> None:
        self.distributed, self.out = distributed, out
        self._references: dict[str, list[dict[str, Any]]] = {}

    def run(self, world: int, config: Config, out: Path, worker: Callable[..., Any] = train_pieces) -> list[Any]:
        """``worker(config, out)`` on ``world`` processes (the session's live workers)."""
        return self.distributed.run(world, worker, config, out)

    def reference(self, config: Config, worker: Callable[..., Any] = train_pieces) -> list[dict[str, Any]]:
        """``config`` trained on its own layout, once per session (keyed by the worker and the config)."""
        key = f"{getattr(worker, '__module__', '')}.{getattr(worker, '__qualname__', repr(worker))} {config!r}"
        if key not in self._references:
            out = self.out / f"reference-{len(self._references)}"
            self._references[key] = self.run(config.parallel.world_size, config, out, worker)
        return self._references[key]

    def check(
        self,
        name: str,
        config_of: Callable[..., Config],
        tolerance: Tolerance,
        out: Path,
        *,
        reference: Config | None = None,
        worker: Callable[..., Any] = train_pieces,
        learns: bool = True,
    ) -> Compared:
        """``config_of(**settings)`` trained on layout ``name`` against ``reference`` (default: ``config_of()``,
        one process) by ``worker`` (``train_pieces`` or a harness's own loop returning the same dict);
        returns what was compared."""
        world, settings = LAYOUTS[name]
        config = config_of(**settings)
        assert config.parallel.world_size == world, f"layout {name} is {world} processes, the config {config.parallel}"
        expected = self.reference(config_of() if reference is None else reference, worker)
        return compare(self.run(world, config, out, worker), expected, tolerance, learns=learns)
