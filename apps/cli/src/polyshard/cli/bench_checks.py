"""``polyshard bench``'s arguments, checked before any process starts: each refusal is one line and exit 2.

Counts and sizes are whole numbers of at least one; sizes are held against this machine: a buffer, matrix
or model that cannot fit in its memory is refused naming both (a lower bound of what the benchmark
allocates, so nothing that fits is refused); the process count against its cores and memory
(:func:`polyshard.planner.fits.check_processes`, ``--force`` past it).
"""

from __future__ import annotations

import argparse
import importlib
import math
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from polyshard.cli.errors import fail

FLOAT32 = 4  # bytes: every benchmark's tensors are float32 unless it says otherwise


def counts(**flags: int) -> None:
    """Each ``flag=value`` a whole number >= 1 (``--seq_lens`` is written ``--seq-lens``)."""
    for flag, value in flags.items():
        if value < 1:
            fail("bench", f"--{flag.replace('_', '-')} {value}: give a whole number of at least 1")


def numbers(text: str, flag: str, kind: Callable[[str], float] = int) -> list[float]:
    """A comma-separated list of finite numbers > 0 (``int``: whole ones)."""
    try:
        values = [kind(part) for part in text.split(",") if part.strip()]
    except ValueError:
        kind_name = "whole numbers" if kind is int else "numbers"
        fail("bench", f"{flag} {text!r}: give comma-separated {kind_name} above 0, e.g. 1,2")
    bad = [v for v in values if not (math.isfinite(v) and v > 0)]
    if not values or bad:
        fail("bench", f"{flag} {text!r}: {bad[0] if bad else 'nothing'} is not a number above 0; e.g. 1,2")
    return values


def processes(nproc: int, force: bool, flag: str = "--nproc") -> None:
    """``nproc`` processes (given as ``flag``) this machine can hold (its cores and memory), unless ``force``."""
    from polyshard.planner.fits import check_processes
    from polyshard.trainer import ConfigError

    if nproc < 1:
        fail("bench", f"{flag} {nproc}: give a whole number of at least 1")
    if force:
        return
    try:
        check_processes(nproc, flag=flag)
    except ConfigError as err:
        fail("bench", err)


def memory(what: str, nbytes: float, gpu: bool = False) -> None:
    """Refuse ``what`` when its ``nbytes`` (a lower bound) exceed this machine's memory (with ``gpu``: the
    smallest GPU's when torch sees GPUs, where the benchmark allocates)."""
    from polyshard.planner.fits import host_memory, machine_memory

    available, where = (machine_memory()[:2]) if gpu else (host_memory(), "host memory")
    if nbytes > available:
        fail(
            "bench",
            f"{what} needs at least {nbytes / 2**30:,.1f} GiB, more than this machine's {available / 2**30:,.1f} GiB "
            f"of {where}; give smaller sizes",
        )


def disk(flag: str, nbytes: float, folder: Path | None) -> None:
    """Refuse ``flag`` when the ``nbytes`` it writes exceed the free space where they go (``folder``, or
    the temporary folder)."""
    where = Path(folder).absolute() if folder is not None else Path(tempfile.gettempdir())
    while not where.exists() and where != where.parent:  # a folder the benchmark will create
        where = where.parent
    free = shutil.disk_usage(where).free
    if nbytes > free:
        fail(
            "bench",
            f"{flag} writes at least {nbytes / 2**30:,.1f} GiB, more than the {free / 2**30:,.1f} GiB free in "
            f"{where}; give smaller sizes or another --folder",
        )


def fits(what: str, settings: dict[str, object], nproc: int) -> None:
    """The job ``settings`` describe, valid and within this machine's memory on ``nproc`` ranks: the
    planner's estimate per rank and each process's own overhead, as ``polyshard train`` counts them."""
    from polyshard.planner.fits import WORKER_OVERHEAD
    from polyshard.planner.search import memory_of
    from polyshard.trainer import ConfigError
    from polyshard.trainer.config import from_dict

    try:
        per_rank = memory_of(from_dict(settings)).total
    except ConfigError as err:
        fail("bench", f"{what}: {err}")
    memory(f"{what} (the planner's estimate, {nproc} processes)", (per_rank + WORKER_OVERHEAD) * nproc)


def module_args(package: str, args: list[str]) -> argparse.Namespace:
    """``args`` read by ``polyshard.bench.<package>``'s own parser; a wrong flag or value is one line."""
    parser = importlib.import_module(f"polyshard.bench.{package}").parser()

    def refuse(message: str) -> None:
        fail("bench", f"{package}: {message}")

    parser.error = refuse  # argparse's own prints its usage and exits
    parsed: argparse.Namespace = parser.parse_args(args)
    return parsed


def peer_sizes(package: str, args: argparse.Namespace, nproc: int) -> None:
    """The tensors a strategy's benchmark surely allocates, held against this machine's memory, and for pp
    and cp the constraints their sizes must meet on ``nproc`` ranks."""
    if package == "pp":
        _pp_schedules(args, nproc)
    if package == "cp":
        _cp_shapes(args, nproc)
    least = _LEAST_BYTES.get(package)
    if least is not None:
        memory(f"bench {package} with these sizes on {nproc} processes", least(args, nproc))


def _pp_schedules(args: argparse.Namespace, nproc: int) -> None:
    """Each schedule of --schedules exists for ``nproc`` ranks and --microbatches, has a layer per stage,
    and the batch splits into the microbatches (the executor's rule), as the workers would find out."""
    from polyshard.bench.pp import PEERS
    from polyshard.pp import ScheduleError, make_schedule

    if args.batch % args.microbatches:
        fail("bench", f"pp: --batch {args.batch} does not split into --microbatches {args.microbatches}")
    for name in args.schedules.split(","):
        if name not in PEERS:
            fail("bench", f"pp: --schedules: unknown {name!r}; choose from {list(PEERS)}")
        try:
            stages = make_schedule(name, nproc, args.microbatches).num_stages
        except ScheduleError as err:
            fail("bench", f"pp: --schedules {name} on {nproc} processes: {err}")
        if args.layers < stages:
            fail("bench", f"pp: --layers {args.layers} is fewer than the {stages} stages of {name} on {nproc} ranks")


def _cp_shapes(args: argparse.Namespace, nproc: int) -> None:
    """Each sequence splits into 2 x cp load-balanced chunks; the query heads group over the kv heads."""
    for length in args.seq_lens:
        if length % (2 * nproc):
            fail(
                "bench",
                f"cp: --seq-lens {length} does not split into 2 x {nproc} chunks; give multiples of {2 * nproc}",
            )
    if args.heads % args.kv_heads:
        fail("bench", f"cp: --kv-heads {args.kv_heads} does not divide --heads {args.heads}")


def _pp(args: argparse.Namespace, nproc: int) -> float:
    # every layer's (hidden x hidden) weight is on some stage; each rank draws the (batch x hidden) x and y
    return float(FLOAT32 * (args.layers * args.hidden**2 + 2 * nproc * args.batch * args.hidden))


def _cp(args: argparse.Namespace, nproc: int) -> float:
    # the one-process reference holds the whole sequence's q, k, v and output
    return float(FLOAT32 * max(args.seq_lens) * (2 * args.heads + 2 * args.kv_heads) * args.head_dim)


def _ep(args: argparse.Namespace, nproc: int) -> float:
    experts = args.experts * 3 * args.hidden * args.ffn  # each expert's SwiGLU weights, on some rank
    one = args.experts_rows * args.experts_hidden + 8 * 3 * args.experts_hidden * args.experts_ffn  # rank 0 alone
    return float(FLOAT32 * (experts + nproc * args.tokens * args.hidden + one))


_LEAST_BYTES: dict[str, Callable[[argparse.Namespace, int], float]] = {"pp": _pp, "cp": _cp, "ep": _ep}
