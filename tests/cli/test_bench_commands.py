"""Every ``polyshard bench`` command runs to the end through the CLI, at its smallest sizes.

Each case launches the installed command line in a subprocess (so torchrun really starts the
workers, 2 processes where the benchmark has processes) and checks that it exits 0 and prints its
table: one row per case with a ratio (or its figures) and, where both sides compute the same thing,
"yes" in the match column. Timings are printed, never asserted. ``bench comm`` is covered by
test_bench_comm.py, which also checks its JSON.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

POLYSHARD = [sys.executable, "-m", "polyshard.cli.main", "bench"]
ROOT = Path(__file__).resolve().parents[2]

# One row of the comparison table: case, ours (ms), peer (ms), ratio, match.
ROW = r"\s+\d+\.\d+\s+\d+\.\d+\s+\d+\.\d+\s+yes$"
# bench peers adds the MiB each side holds per rank before the match column.
PEERS_ROW = r"(\s+\d+\.\d+){5}\s+yes$"

# bench pp's schedules against torch.distributed.pipelining's, with their virtual stages per rank
SCHEDULES = (("gpipe", ""), ("1f1b", ""), ("interleaved", " v=2"), ("zb-v", " v=2"), ("dualpipev", " v=2"))

# command, its smallest flags, and patterns (multiline regexes) its output must hold
CASES = {
    "tp": (["--nproc", "2", "--iters", "1"], [rf"^mlp fwd\+bwd tp=2 .*{ROW}", rf"^block fwd\+bwd tp=2 .*{ROW}"]),
    "pp": (
        ["--nproc", "2", "--layers", "4", "--hidden", "32", "--batch", "4", "--microbatches", "4", "--iters", "1"],
        [rf"^{s} p=2 m=4{v}{ROW}" for s, v in SCHEDULES],
    ),
    "dp": (
        ["--nproc", "2", "--iters", "1"],
        [
            rf"^DataParallel vs DDP dp=2{ROW}",
            rf"^ZeRO-1 vs DDP\+ZeroRedundancyOptimizer dp=2{ROW}",
            rf"^ZeRO-3 vs FSDP2 dp=2{ROW}",
        ],
    ),
    # The hang of issue 34: rank 0's one-process section used to time with collectives rank 1 never made.
    "ep": (
        ["--nproc", "2", "--iters", "1", "--tokens", "16", "--hidden", "16", "--ffn", "32", "--experts", "4"]
        + ["--experts-rows", "64", "--experts-hidden", "16", "--experts-ffn", "32"],
        [
            rf"^experts E=8 rows=64 16x32: grouped .* vs loop{ROW}",
            rf"^MoE layer E=32 top2 T=32 16x32: ours vs torch-ops grouped MoE{ROW}",
            rf"^moe E=4 top1 ep=2 T=16/rank{ROW}",
            rf"^moe E=4 top2 ep=2 T=16/rank{ROW}",
        ],
    ),
    "cp": (
        ["--nproc", "2", "--seq-lens", "32", "--heads", "2", "--kv-heads", "1", "--head-dim", "8", "--iters", "1"],
        [r"^causal S=32 cp=2 .*\d\.\d+"],
    ),
    "matmul": (
        ["--size", "64", "--iters", "1"],
        [r"^c(pu|uda) float32 64x64: \d+\.\d+ ms per matmul, \d+\.\d+ TFLOP/s$"],
    ),
    "cp-memory": (["--cp", "2", "--seq-lens", "64"], [r"^S=\s*64 cp=2 \(ring\):\s+32 tokens per rank, .* MiB saved"]),
    "recompute": (
        ["--batch", "1", "--repeats", "1"],
        [rf"^{mode}\s+(\d+\.\d+\s+){{5}}" for mode in ("none", "selective", "full")],
    ),
    "prepare": (
        ["--mb", "1", "--workers", "1", "--vocab-size", "257"],
        [r"^\| 1 \| \d+\.\d+ \| \d+\.\d+ \| \d+\.\d+x \|$"],
    ),
    "checkpoint": (
        ["--nproc", "2", "--hidden", "32", "--layers", "1", "--heads", "2"],
        [r"^blocking save, 0M parameters on 2 ranks: median step", r"^async    save, 0M parameters on 2 ranks"],
    ),
    "data": (["--sizes-mb", "0.05", "--ranks", "2", "--steps", "1"], [r"^\| 0.05 MB \| 2 \| \d+ MiB \|"]),
    "compile": (
        ["--iters", "1", "--skip-demo"],
        [
            r"^\| 2 Llama blocks fwd\+bwd .* \| \d+\.\d+x \| \d+ s \|$",
            r"^\| the same, graph breaks at tp's 4 collective places \| .* \| \d+\.\d+x \| \d+ s \|$",
        ],
    ),
    "plan": (
        ["--profile", "h100-nvlink-ib", "--rounds", "1", "--steps", "1"],
        [rf"^\| {name} \(.*\) \| \d+\.\d+ \| \d+\.\d+ \|" for name in ("dp2", "tp2", "pp2 1f1b", "tp2 x pp2")]
        + [r"^--layout auto \(4 processes\) picks .*: measured \d+\.\d+ s"],
    ),
    # the tiny DeepSeek-V3 on ep2 through `polyshard train`, beside transformers on one process
    "deepseek": (
        ["--layouts", "ep2", "--batch", "4", "--steps", "1", "--warmup", "1"],
        [r"^transformers\s+1\s+\d+\s+\d+\s+1\.00$", r"^ep2\s+2\s+\d+\s+\d+\s+\d+\.\d+$"]
        + [r"^parameters: transformers ([\d,]+), polyshard \1 \(deepseek-v3-tiny\)$"],
    ),
    # The strategy groups are the tp/pp/dp/ep/cp commands above (and test_bench_peers.py runs one group
    # through peers); the composed GPT rows are peers' own.
    "peers": (
        ["--nproc", "2", "--steps", "1", "--only", "composed"],
        [rf"^GPT-tiny {lay} \(H=64 L=4 V=256 S=64 B=16\){PEERS_ROW}" for lay in ("dp2 ZeRO-3", "tp2", "pp2 1F1B m=4")]
        + [r"^3 comparisons: ratio median \d+\.\d+, .*; 0 mismatched$"],
    ),
}


def run_bench(name: str, tmp_path: Path) -> str:
    args, _ = CASES[name]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # cwd: the repository root, where the default configs (bench compile's demo) are found.
    result = subprocess.run(POLYSHARD + [name, *args], capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert result.returncode == 0, f"polyshard bench {name} exited {result.returncode}:\n{result.stderr[-4000:]}"
    return result.stdout


@pytest.mark.bench
@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_every_bench_command_runs_to_the_end(name: str, tmp_path: Path):
    out = run_bench(name, tmp_path)
    missing = [p for p in CASES[name][1] if not re.search(p, out, re.MULTILINE)]
    assert not missing, f"polyshard bench {name}: no line matches {missing} in:\n{out[-4000:]}"
    assert not re.search(r"\sNO$", out, re.MULTILINE), f"polyshard bench {name}: outputs differ:\n{out[-4000:]}"


def test_every_bench_command_has_a_case():
    from polyshard.cli.main import bench_app

    commands = {c.name for c in bench_app.registered_commands}
    assert commands - {"comm"} == set(CASES), "a new `polyshard bench` command needs a case here"
