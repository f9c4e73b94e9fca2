"""Run `polyshard train` jobs as a user would, and look at what they leave behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "apps/configs/gpt-tiny-dp.toml"
POLYSHARD = [sys.executable, "-m", "polyshard.cli.main"]
# 8 steps of the tiny GPT on dp=2, a checkpoint every 2 steps (all kept), nothing else.
SHORT = [
    *("--set", "training.steps=8", "--set", "eval.every=0", "--set", "eval.sample_tokens=0"),
    *("--set", "checkpoint.every=2", "--set", "checkpoint.keep=10", "--set", "logging.every=1"),
]
# Long enough to be interrupted: the run is stopped long before it ends.
LONG = ["--set", "training.steps=100000", "--set", "eval.every=0", "--set", "checkpoint.every=2"]


def train(out: Path, *args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    cmd = [*POLYSHARD, "train", str(CONFIG), "--out", str(out), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})


def start(out: Path, *args: str) -> subprocess.Popen:
    """A job in its own session (as a terminal would hold it), so a test can signal all of it."""
    cmd = [*POLYSHARD, "train", str(CONFIG), "--out", str(out), *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def job_processes(out: Path) -> dict[int, str]:
    """{pid: command line} of every live process whose command line names ``out``."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                state = (entry / "stat").read_text().split(") ")[1][0]
            except OSError:
                continue
            if str(out) in cmdline and state != "Z":
                found[int(entry.name)] = cmdline
    return found


def worker_pid(out: Path, rank: int) -> int:
    for pid, cmdline in job_processes(out).items():
        if "polyshard.trainer.runtime.worker" in cmdline:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            if f"RANK={rank}".encode() in env:
                return pid
    raise AssertionError(f"no worker of rank {rank} for {out}")


def wait_for(predicate, timeout: float, what: str) -> float:
    """Poll until ``predicate()``; returns the seconds it took."""
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout:
            raise AssertionError(f"waited {timeout} s for {what}")
        time.sleep(0.2)
    return time.monotonic() - started


def training_started(out: Path) -> bool:
    return (out / "checkpoints").is_dir() and any((out / "checkpoints").glob("step_*"))


def metrics(out: Path) -> list[tuple]:
    """The log's step, loss, gradient norm and learning rate (timings and memory vary run to run)."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"], r["grad_norm"], r["lr"]) for r in records]


def final_weights(out: Path):
    from polyshard.checkpoint import latest_checkpoint
    from polyshard.trainer.checkpointing.run_export import consolidate

    return consolidate(latest_checkpoint(out / "checkpoints"))


def listening_addresses(pids) -> list[str]:
    """Local addresses (hex, as /proc/net/tcp writes them) of the TCP sockets ``pids`` listen on."""
    inodes = set()
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    addresses = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                addresses.append(fields[1])
    return addresses


LOOPBACK = ("0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F")


def kill_all(out: Path) -> None:
    for pid in job_processes(out):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
