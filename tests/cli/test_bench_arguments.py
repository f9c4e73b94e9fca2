"""``polyshard bench`` checks its arguments before any process starts (issue 46): a count of zero or less,
a size that is no number (inf, nan), an unknown preset, or a buffer, matrix or model larger than this
machine's memory exits 2 with one line naming the flag, and no worker is started. The process count is held
against the machine's cores and memory, with ``--force`` past it.

Through typer's CliRunner in this process: ``run_local`` (which starts torchrun) and the one-process
benchmarks' own entry points are replaced by stand-ins that fail the test if they are reached.
"""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from polyshard.cli import bench as cli_bench
from polyshard.cli import main as cli_main
from polyshard.cli.errors import MAX_MESSAGE_CHARS, bounded
from polyshard.planner import fits


@pytest.fixture
def started(monkeypatch):
    """The processes the commands tried to start; the machine is this test's: 2 cores, 24 GiB."""
    calls: list[tuple[int, str]] = []

    def run_local(nproc, module, args, torchrun_args=()):
        calls.append((nproc, module))
        return 0

    monkeypatch.setattr(cli_bench, "run_local", run_local)
    monkeypatch.setattr(fits, "host_cores", lambda: 2)
    monkeypatch.setattr(fits, "host_memory", lambda: float(24 << 30))
    return calls


def _refused(args: list[str], *named: str) -> str:
    result = CliRunner().invoke(cli_main.app, ["bench", *args])
    assert result.exit_code == 2, (args, result.output)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bench error: "), (args, result.stderr)
    for word in named:
        assert word in lines[0], (args, lines[0])
    assert "Traceback" not in result.output
    return lines[0]


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["comm", "--sizes", "inf"], ["--sizes", "'INF' is not a number of bytes"]),
        (["comm", "--sizes", "4K,nan"], ["--sizes", "'NAN'"]),
        (["comm", "--sizes", "1000G"], ["--sizes 1,073,741,824,000 bytes", "24.0 GiB of host memory"]),
        (["comm", "--iters", "0"], ["--iters 0"]),
        (["data", "--sizes-mb", "nan"], ["--sizes-mb 'nan'"]),
        (["data", "--sizes-mb", "1,-2"], ["--sizes-mb '1,-2'"]),
        (["data", "--steps", "-1"], ["--steps -1"]),
        (["recompute", "--preset", "huge"], ["--preset 'huge'", "choose one of"]),
        (["recompute", "--batch", "0"], ["--batch 0"]),
        (["recompute", "--batch", "100000000"], ["--batch 100000000", "GiB of host memory"]),
        (["matmul", "--size", "10000000"], ["--size 10,000,000", "GiB"]),
        (["matmul", "--iters", "-3"], ["--iters -3"]),
        (["checkpoint", "--layers", "0"], ["--layers 0"]),
        (["checkpoint", "--hidden", "0"], ["--hidden 0"]),
        (["checkpoint", "--heads", "-1"], ["--heads -1"]),
        (["checkpoint", "--hidden", "1000000", "--heads", "1"], ["--hidden 1000000", "24.0 GiB"]),
        (["cp-memory", "--seq-lens", "0"], ["--seq-lens '0'"]),
        (["cp-memory", "--seq-lens", "100000000000"], ["--seq-lens 100000000000", "GiB of host memory"]),
        (["pp", "--iters", "-1"], ["pp: argument --iters", "-1: give at least 1"]),
        (["pp", "--microbatches", "0"], ["--microbatches", "0: give at least 1"]),
        (["pp", "--layers", "0"], ["--layers"]),
        (["pp", "--hidden", "1000000"], ["bench pp", "GiB of host memory"]),
        (["pp", "--batch", "6", "--microbatches", "4"], ["--batch 6 does not split into --microbatches 4"]),
        (["pp", "--layers", "3"], ["--layers 3 is fewer than the 4 stages of interleaved on 2 ranks"]),
        (["pp", "--schedules", "dualpipev", "--microbatches", "2", "--batch", "8"], ["dualpipev", "microbatches"]),
        (["pp", "--schedules", "1f1b,foo"], ["--schedules: unknown 'foo'"]),
        (["cp", "--seq-lens", "64", "0"], ["--seq-lens", "0: give at least 1"]),
        (["cp", "--heads", "0"], ["--heads"]),
        (["cp", "--seq-lens", "30"], ["--seq-lens 30 does not split into 2 x 2 chunks"]),
        (["cp", "--heads", "6", "--kv-heads", "4"], ["--kv-heads 4 does not divide --heads 6"]),
        (["cp", "--seq-lens", "100000000"], ["bench cp", "GiB of host memory"]),
        (["ep", "--tokens", "0"], ["--tokens"]),
        (["tp", "--iters", "abc"], ["--iters", "'abc' is not a whole number"]),
        (["dp", "--iters", "0"], ["--iters"]),
        (["prepare", "--mb", "nan"], ["--mb nan"]),
        (["prepare", "--workers", "0"], ["--workers '0'"]),
        (["deepseek", "--threads", "0"], ["--threads 0"]),
        (["plan", "--rounds", "0"], ["--rounds 0"]),
        (["compile", "--steps", "2"], ["--steps 2"]),
        (["peers", "--steps", "0"], ["--steps 0"]),
        (["peers", "--nproc", "3"], ["--nproc 3"]),
    ],
)
def test_a_bad_argument_is_one_line_and_starts_nothing(started, args, named):
    _refused(args, *named)
    assert started == []


@pytest.mark.parametrize(
    "args",
    [["comm", "--nproc", "64"], ["tp", "--nproc", "64"], ["checkpoint", "--nproc", "17"],
     ["data", "--ranks", "2,64"], ["cp-memory", "--cp", "64", "--seq-lens", "64"]],
)  # fmt: skip
def test_more_processes_than_the_machine_holds_are_refused_naming_cores_and_memory(started, args):
    line = _refused(args, "this machine has 2 cores and 24.0 GiB of memory", "--force")
    assert "or fewer" in line and started == []


def test_force_starts_them_and_a_count_the_machine_holds_passes(started):
    runner = CliRunner()
    assert runner.invoke(cli_main.app, ["bench", "comm", "--nproc", "64", "--force"]).exit_code == 0
    assert runner.invoke(cli_main.app, ["bench", "tp", "--nproc", "16", "--iters", "1"]).exit_code == 0
    assert started == [(64, "polyshard.bench.collectives"), (16, "polyshard.bench.tp")]


def test_a_message_is_bounded():
    assert bounded("short") == "short"
    line = bounded("x" * (MAX_MESSAGE_CHARS + 12_345) + "\nsecond line")
    assert len(line) < MAX_MESSAGE_CHARS + 60 and "(12,357 more characters cut)" in line and "\n" not in line
