"""``polyshard bench``: benchmarks (not tests) against PyTorch's own implementations.

Every command checks its arguments (:mod:`polyshard.cli.bench_checks`) before any process starts; the
strategy packages' commands pass the flags they do not know to ``polyshard.bench.<package>``'s own parser.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import typer

from polyshard.cli import bench_checks as checks
from polyshard.cli.errors import fail
from polyshard.cli.launch import run_local
from polyshard.cli.outputs import report_args, report_file

bench_app = typer.Typer(help="Benchmarks (not tests): measure against PyTorch's own implementations.")

BENCHMARKED_PACKAGES: tuple[str, ...] = ("pp", "ep", "tp", "dp", "cp")


@bench_app.command("comm")
def bench_comm(
    nproc: int = typer.Option(4, "--nproc", help="Number of local processes."),
    ops: str = typer.Option(
        "all_reduce,all_gather,reduce_scatter,all_to_all,broadcast", "--ops", help="Comma-separated collectives."
    ),
    sizes: str = typer.Option("4K,64K,1M,4M", "--sizes", help="Comma-separated buffer sizes (K/M/G suffixes)."),
    iters: int = typer.Option(10, "--iters", help="Timed iterations per size."),
    json_path: Path | None = typer.Option(None, "--json", help="Also write the records to this JSON file."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace the --json file if it exists."),
    force: bool = typer.Option(
        False, "--force", help="Start more processes than this machine's cores and memory hold."
    ),
) -> None:
    """Time each collective over a range of sizes: time, algbw and busbw (nccl-tests definitions)."""
    from polyshard.bench.collectives import OPS, parse_size

    unknown = [o for o in ops.split(",") if o.strip() and o.strip() not in OPS]
    if unknown:
        fail("bench", f"--ops: unknown ops {unknown}; choose from {list(OPS)}")
    checks.counts(iters=iters)
    checks.processes(nproc, force)
    try:
        largest = max(parse_size(s) for s in sizes.split(","))
    except ValueError as err:
        fail("bench", f"--sizes: {err}")
    # each rank holds the buffer and an output as large (all_to_all's)
    checks.memory(f"--sizes {largest:,} bytes on {nproc} processes", 2 * nproc * largest)
    args = ["--ops", ops, "--sizes", sizes, "--iters", str(iters), *report_args("bench", json_path, overwrite)]
    raise typer.Exit(run_local(nproc, "polyshard.bench.collectives", args))


@bench_app.command("matmul")
def bench_matmul(
    size: int = typer.Option(2048, "--size", help="Square matrix side (at least 64)."),
    dtype: str = typer.Option("float32", "--dtype", help="float32 or bfloat16."),
    iters: int = typer.Option(10, "--iters"),
) -> None:
    """Measure this machine's matmul peak (TFLOP/s per process), for MFU: set logging.peak_tflops to it."""
    import time

    import torch

    if dtype not in ("float32", "bfloat16"):
        fail("bench", f"--dtype {dtype!r}: choose float32 or bfloat16")
    checks.counts(iters=iters)
    if size < 64:
        fail("bench", f"--size {size}: give a matrix side of at least 64")
    # a, b and their product
    checks.memory(f"--size {size:,} ({dtype})", 3 * size**2 * getattr(torch, dtype).itemsize, gpu=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    a = torch.randn(size, size, device=device, dtype=getattr(torch, dtype))
    b = torch.randn(size, size, device=device, dtype=getattr(torch, dtype))
    a @ b  # warm-up
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        a @ b
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / iters
    tflops = 2 * size**3 / seconds / 1e12
    typer.echo(f"{device} {dtype} {size}x{size}: {seconds * 1e3:.2f} ms per matmul, {tflops:.3f} TFLOP/s")


@bench_app.command("cp-memory")
def bench_cp_memory(
    cps: str = typer.Option("1,2,4", "--cp", help="Context-parallel sizes to measure (processes each)."),
    seq_lens: str = typer.Option("1024,2048,4096,8192,16384", "--seq-lens", help="Sequence lengths."),
    style: str = typer.Option("ring", "--style", help="ring or allgather."),
    force: bool = typer.Option(
        False, "--force", help="Start more processes than this machine's cores and memory hold."
    ),
) -> None:
    """Activation memory per rank against sequence length at each cp size (a small Llama, one forward)."""
    sizes = [int(c) for c in checks.numbers(cps, "--cp")]
    lengths = [str(int(s)) for s in checks.numbers(seq_lens, "--seq-lens")]
    if style not in ("ring", "allgather"):
        fail("bench", f"--style {style!r}: choose ring or allgather")
    checks.processes(max(sizes), force, "--cp")
    longest = max(int(n) for n in lengths)
    for cp in sizes:  # each rank of a cp run holds its 1/cp share of the sequence (context_memory's model)
        model = {"preset": "llama-tiny", "num_layers": 2, "context_length": max(1, longest // cp)}
        checks.fits(f"--seq-lens {longest} on cp={cp}", {"model": model, "training": {"global_batch_size": 1}}, cp)
    for cp in sizes:
        code = run_local(cp, "polyshard.bench.context_memory", ["--seq-lens", *lengths, "--style", style])
        if code:
            raise typer.Exit(code)


@bench_app.command("recompute")
def bench_recompute(
    preset: str = typer.Option("small", "--preset", help="Model preset (small: hidden 256, 6 layers, 256 tokens)."),
    batch: int = typer.Option(8, "--batch", help="Rows per batch."),
    precision: str = typer.Option("fp32", "--precision", help="fp32 or bf16."),
    repeats: int = typer.Option(5, "--repeats", help="Timed steps per mode (after one warm-up)."),
    vocab_size: int = typer.Option(256, "--vocab-size", help="Kept small so the blocks' time shows."),
) -> None:
    """Activation checkpointing none, selective and full: bytes one block keeps (measured and planned), step time."""
    from polyshard.bench import recompute

    if precision not in ("fp32", "bf16"):
        fail("bench", f"--precision {precision!r}: choose fp32 or bf16")
    checks.counts(batch=batch, repeats=repeats, vocab_size=vocab_size - 1)  # a vocabulary of at least 2
    # the preset (a name no family has is a ConfigError) at these sizes, within this machine's memory
    model = {"preset": preset, "vocab_size": vocab_size}
    checks.fits(f"--preset {preset!r} --batch {batch}", {"model": model, "training": {"global_batch_size": batch}}, 1)
    typer.echo(recompute.report(recompute.run(preset, batch, precision, repeats, vocab_size=vocab_size)))


@bench_app.command("data")
def bench_data(
    sizes: str = typer.Option("1,50,2048", "--sizes-mb", help="Corpus sizes in MB; the smallest is the baseline."),
    ranks: str = typer.Option("2,8", "--ranks", help="Numbers of data-parallel processes to train on."),
    steps: int = typer.Option(5, "--steps", help="Training steps per run."),
    folder: Path | None = typer.Option(None, "--folder", help="Keep the corpora and runs here (default: temporary)."),
    force: bool = typer.Option(
        False, "--force", help="Start more processes than this machine's cores and memory hold."
    ),
) -> None:
    """Memory and startup of a run's data against the corpus size: synthetic corpora prepared and trained on."""
    from polyshard.bench import data_memory

    megabytes = checks.numbers(sizes, "--sizes-mb", float)
    counts = [int(n) for n in checks.numbers(ranks, "--ranks")]
    checks.counts(steps=steps)
    checks.processes(max(counts), force, "--ranks")
    checks.disk("--sizes-mb", 2 * max(megabytes) * 1e6, folder)  # the corpus, then its prepared tokens
    args = ["--sizes-mb", *map(str, megabytes), "--ranks", *map(str, counts), "--steps", str(steps)]
    args += ["--force"] if force else []
    raise typer.Exit(data_memory.main(args + (["--folder", str(folder)] if folder else [])))


@bench_app.command("checkpoint")
def bench_checkpoint(
    nproc: int = typer.Option(2, "--nproc", help="Data-parallel processes (ZeRO-1 over them)."),
    hidden: int = typer.Option(768, "--hidden", help="The GPT's hidden size (GPT-2 small's by default)."),
    layers: int = typer.Option(12, "--layers", help="Its blocks."),
    heads: int = typer.Option(12, "--heads", help="Its attention heads (they divide --hidden)."),
    force: bool = typer.Option(
        False, "--force", help="Start more processes than this machine's cores and memory hold."
    ),
) -> None:
    """How long training stops for a checkpoint of a ~100M-parameter GPT: blocking against async_save."""
    checks.counts(hidden=hidden, layers=layers, heads=heads)
    if hidden % heads:
        fail("bench", f"--heads {heads} does not divide --hidden {hidden}; choose heads that divide it")
    checks.processes(nproc, force)
    # every rank holds the GPT's 12 x hidden^2 weights per block (ZeRO-1 shards only the optimizer state)
    checks.memory(f"--hidden {hidden} --layers {layers} on {nproc} processes", 4 * 12 * layers * hidden**2 * nproc)
    args = ["--hidden", str(hidden), "--layers", str(layers), "--heads", str(heads)]
    raise typer.Exit(run_local(nproc, "polyshard.bench.save_stall", args))


@bench_app.command("compile")
def bench_compile(
    iters: int = typer.Option(10, "--iters", help="Timed block forward + backward passes (the median)."),
    config: Path = typer.Option(
        Path("apps/configs/gpt-shakespeare-3d.toml"), "--config", help="The job trained eager and compiled."
    ),
    steps: int = typer.Option(20, "--steps", help="Training steps of each run (at least 4)."),
    skip_demo: bool = typer.Option(False, "--skip-demo", help="Time the blocks only."),
) -> None:
    """Compiled over eager (training.compile): one block's forward + backward, and the demo's tokens/s."""
    from polyshard.bench import compile_speed

    checks.counts(iters=iters, steps=steps)
    if steps < 4:
        fail("bench", f"--steps {steps}: give at least 4 (the first steps compile)")
    args = ["--iters", str(iters), "--config", str(config), "--steps", str(steps)]
    raise typer.Exit(compile_speed.main(args + (["--skip-demo"] if skip_demo else [])))


@bench_app.command("plan")
def bench_plan(
    profile: str | None = typer.Option(
        None, "--profile", help="Predict with this profile (default: calibrate this machine in the same rounds)."
    ),
    rounds: int = typer.Option(5, "--rounds", help="Rounds; each visits every layout once, interleaved."),
    steps: int = typer.Option(3, "--steps", help="Timed steps per visit (after one warm-up step)."),
    json_path: Path | None = typer.Option(None, "--json", help="Also write the rows to this JSON file."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace the --json file if it exists."),
) -> None:
    """The layout planner's predicted step time against the measured one for six layouts of the tiny GPT."""
    import json

    from polyshard.bench import plan as bench
    from polyshard.planner.profile import load_profile
    from polyshard.trainer import ConfigError

    checks.counts(rounds=rounds, steps=steps)
    report = report_file("bench", "--json", json_path, overwrite)
    try:
        machine = load_profile(profile) if profile is not None else None
    except ConfigError as err:
        fail("plan", err)
    six, auto, beside, machine = bench.run(machine, rounds=rounds, steps=steps, log=typer.echo)
    typer.echo(f"profile {machine.name}: {machine.source}")
    typer.echo(bench.report(six, auto, beside))
    if report is not None:
        rows = {"profile": machine.source, "six": [r.as_dict() for r in six], "auto": auto.as_dict()}
        report.write_text(json.dumps({**rows, "fastest_of_six": beside.as_dict()}, indent=2))


@bench_app.command("peers")
def bench_peers(
    nproc: int = typer.Option(2, "--nproc", help="Local processes: 2, 4 or 8 (the composed layouts need them)."),
    steps: int = typer.Option(10, "--steps", help="Timed steps per side, after 2 warm-up steps."),
    only: str = typer.Option(
        "dp,tp,pp,ep,cp,composed", "--only", help="Comma-separated groups: dp, tp, pp, ep, cp, composed."
    ),
    preset: str = typer.Option(
        "tiny",
        "--preset",
        help="The composed jobs' shapes, comma-separated: tiny, small, llama-tiny (tp with sequence parallelism), "
        "titan-debug (torchtitan's Llama debug model at 2,048-token rows), h1024-32k (hidden 1,024, 32K vocabulary).",
    ),
    json_path: Path | None = typer.Option(None, "--json", help="Also write the records to this JSON file."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace the --json file if it exists."),
    modes: str = typer.Option(
        "eager", "--modes", help="The composed jobs' blocks: eager, compiled (both sides, torchtitan's way), or both."
    ),
    force: bool = typer.Option(
        False, "--force", help="Start more processes than this machine's cores and memory hold."
    ),
) -> None:
    """Every strategy against its PyTorch peer, and the GPT composed on dp/tp/pp against fully_shard +
    parallelize_module + pipelining: one table of median step times, bytes held per rank, ratios, matches."""
    from polyshard.bench.peers import GROUPS, LAYOUTS, MODES, PRESETS, split_choices

    if nproc not in LAYOUTS:
        fail(
            "bench",
            f"--nproc {nproc}: choose one of {sorted(LAYOUTS)} (the composed layouts: "
            + "; ".join(
                f"{n}: {', '.join('x'.join(f'{a}{s}' for a, s in lay.items()) for lay in LAYOUTS[n])}" for n in LAYOUTS
            )
            + ")",
        )
    checks.counts(steps=steps)
    checks.processes(nproc, force)
    chosen = {}
    for option, text, choices in (("--only", only, GROUPS), ("--preset", preset, PRESETS), ("--modes", modes, MODES)):
        try:
            chosen[option] = ",".join(split_choices(text, option, choices))
        except ValueError as err:
            fail("bench", err)
    args = ["--steps", str(steps)] + [part for option, value in chosen.items() for part in (option, value)]
    args += report_args("bench", json_path, overwrite)
    raise typer.Exit(run_local(nproc, "polyshard.bench.peers", args))


@bench_app.command("deepseek")
def bench_deepseek(
    layouts: str = typer.Option("one,ep2,ep2xpp2", "--layouts", help="Comma-separated: one, ep2, ep2xpp2."),
    batch: int = typer.Option(16, "--batch", help="Rows of 64 tokens per global batch."),
    steps: int = typer.Option(10, "--steps", help="Timed steps per run, after the warm-up."),
    warmup: int = typer.Option(2, "--warmup", help="Steps before the timed ones."),
    rounds: int = typer.Option(1, "--rounds", help="Runs of every row, in turns."),
    threads: int = typer.Option(1, "--threads", help="transformers' CPU threads (ours: one per process)."),
) -> None:
    """The tiny DeepSeek-V3 trained by polyshard (one process, ep2, ep2 x pp2) against transformers on one
    process: tokens/s, tokens/s per process and their ratio."""
    from polyshard.bench import deepseek_speed

    unknown = [name for name in layouts.split(",") if name.strip() and name.strip() not in deepseek_speed.LAYOUTS]
    if unknown:
        fail("bench", f"--layouts: unknown {unknown}; choose from {list(deepseek_speed.LAYOUTS)}")
    checks.counts(batch=batch, steps=steps, warmup=warmup + 1, rounds=rounds, threads=threads)  # warmup >= 0
    args = ["--layouts", layouts, "--batch", str(batch), "--steps", str(steps), "--warmup", str(warmup)]
    raise typer.Exit(deepseek_speed.main(args + ["--rounds", str(rounds), "--threads", str(threads)]))


@bench_app.command("prepare")
def bench_prepare(
    megabytes: float = typer.Option(64.0, "--mb", help="Size of the synthetic corpus, in MB (at least 1)."),
    workers: str = typer.Option("1,2", "--workers", help="Comma-separated worker counts to measure."),
    vocab_size: int = typer.Option(8192, "--vocab-size", help="The BPE trained for the run (at least 257)."),
    force: bool = typer.Option(
        False, "--force", help="Start more processes than this machine's cores and memory hold."
    ),
) -> None:
    """polyshard prepare's MB/s against nanoGPT's pattern (datasets map + np.memmap), same tokenizer and cores."""
    from polyshard.bench.prepare_speed import report, run

    counts = [int(w) for w in checks.numbers(workers, "--workers")]
    if not (math.isfinite(megabytes) and megabytes >= 1):
        fail("bench", f"--mb {megabytes}: give a corpus of at least 1 MB")
    if vocab_size < 257:
        fail("bench", f"--vocab-size {vocab_size}: a byte-level BPE needs at least 257 (256 bytes and a merge)")
    checks.processes(max(counts), force, "--workers")  # prepare's workers are processes
    checks.disk("--mb", 2 * megabytes * 1e6, None)  # the corpus, then its prepared tokens
    typer.echo(report(run(megabytes, counts, vocab_size, log=typer.echo)))


def _bench_with_peer(package: str) -> Callable[..., None]:
    """A ``polyshard bench <package>`` command that runs ``polyshard.bench.<package>`` under torchrun.

    Flags it does not know go to the module's own parser (``--iters 2``, pp's ``--hidden 64``...),
    checked here first, with the sizes they ask for, so that a wrong one exits 2 before any process starts.
    """

    def command(
        context: typer.Context,
        nproc: int = typer.Option(2, "--nproc", help="Number of local processes."),
        json_path: Path | None = typer.Option(None, "--json", help="Also write the records to this JSON file."),
        overwrite: bool = typer.Option(False, "--overwrite", help="Replace the --json file if it exists."),
        force: bool = typer.Option(False, "--force", help="Start more processes than this machine holds."),
    ) -> None:
        args = list(context.args) + report_args("bench", json_path, overwrite)
        checks.processes(nproc, force)
        checks.peer_sizes(package, checks.module_args(package, args), nproc)
        raise typer.Exit(run_local(nproc, f"polyshard.bench.{package}", args))

    command.__doc__ = (
        f"polyshard.{package} against PyTorch's own implementation: median step times and ratios. "
        f"Other flags go to the benchmark (python -m polyshard.bench.{package} --help lists them)."
    )
    return command


# Each parallelism package has a benchmark module in polyshard.bench and a ``polyshard bench <name>`` command.
for _package in BENCHMARKED_PACKAGES:
    bench_app.command(_package, context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(
        _bench_with_peer(_package)
    )
