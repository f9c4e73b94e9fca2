"""A heartbeat per rank, so a hang can name the rank that stopped.

A collective that waits for a stopped or dead peer only knows it timed out. Each rank's background
thread writes the time into the job's rendezvous store every two seconds (torchrun's agent hosts the
store, so it outlives any worker); on a failure the rank that reports it reads every rank's last
beat, and the ranks whose beat is old are the ones that stopped making progress. A rank blocked
inside a collective still beats: its thread runs while the backend waits without Python's lock.
"""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta
from typing import cast

import torch.distributed as dist

INTERVAL_S = 2.0  # one TCP round trip to the agent per beat: on 2 cores x 8 ranks, 1 s cost a few percent
STALE_AFTER_S = 6.0  # a beat this old means the rank is stopped, dead, or stuck in Python


class Heartbeat:
    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size
        self.store = _job_store()
        self._stop = threading.Event()
        if self.store is not None:
            self._beat()
            threading.Thread(target=self._run, name="polyshard-heartbeat", daemon=True).start()

    def _beat(self) -> None:
        # Called only when there is a store (__init__ checks before the first beat and the thread).
        cast(dist.Store, self.store).set(f"polyshard/heartbeat/{self.rank}", repr(time.time()))

    def _run(self) -> None:
        while not self._stop.wait(INTERVAL_S):
            try:
                self._beat()
            except Exception:  # the store is gone: the job is ending
                return

    def stop(self) -> None:
        self._stop.set()

    def stale_ranks(self) -> dict[int, float]:
        """{rank: seconds since its last beat} for the ranks silent for over STALE_AFTER_S."""
        if self.store is None:
            return {}
        now, stale = time.time(), {}
        for rank in range(self.world_size):
            key = f"polyshard/heartbeat/{rank}"
            try:
                if not self.store.check([key]):
                    continue  # never started: reported by the rendezvous, not here
                age = now - float(self.store.get(key).decode())
            except Exception:
                return {}
            if age > STALE_AFTER_S:
                stale[rank] = age
        return stale


def _job_store() -> dist.Store | None:
    """A client of the store torchrun's agent hosts (MASTER_ADDR:MASTER_PORT); None outside torchrun."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port or "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    try:
        return dist.TCPStore(addr, int(port), is_master=False, timeout=timedelta(seconds=10))
    except Exception:
        return None
