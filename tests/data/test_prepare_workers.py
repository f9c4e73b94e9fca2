"""Tokenizing workers end with the `prepare` that started them: killing its main process alone (SIGKILL,
the OOM killer) used to leave them running (issue 33)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from tests.reliability._jobs import wait_for

# A prepare's pool of two workers, each busy with a task that never ends, in a process of its own.
_PREPARE = """
import sys, time
from concurrent.futures import wait
from polyshard.data import encode
from polyshard.data import prepare as p
from polyshard.data.sources import Chunk, Fields
settings = encode.Settings("bytes", Fields(), "\\n", "<u2")
encoded = p._encoded(iter([Chunk()] * 2), settings, 2)
next(encoded)  # both workers are started and have loaded the tokenizer
import multiprocessing
print(" ".join(str(c.pid) for c in multiprocessing.active_children() if "Process" in c.name), flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def test_killing_prepare_ends_its_workers(tmp_path):
    main = subprocess.Popen([sys.executable, "-c", _PREPARE], stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        line = main.stdout.readline() if main.stdout else ""
        workers = [int(pid) for pid in line.split()]
        assert len(workers) == 2 and all(_alive(pid) for pid in workers), line
        os.kill(main.pid, signal.SIGKILL)
        main.wait()
        wait_for(lambda: not any(_alive(pid) for pid in workers), 30, "the workers to end with their parent")
    finally:
        main.kill()
        main.wait()
