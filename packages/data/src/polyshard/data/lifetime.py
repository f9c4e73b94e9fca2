"""Tokenizing workers end with the ``prepare`` that started them.

A ``ProcessPoolExecutor`` worker whose parent is killed (SIGKILL, the OOM killer) would otherwise go on
waiting for tasks, holding its memory, for as long as the machine runs. On Linux the kernel sends a
child a signal when its parent exits, if the child asks (``prctl(PR_SET_PDEATHSIG)``); elsewhere the
pool's own shutdown is all there is.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def end_with_parent(parent: int) -> None:
    """Ask for SIGKILL when the parent exits; exit now if ``parent`` is already gone (the request came
    too late to be delivered)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:
        os._exit(1)
