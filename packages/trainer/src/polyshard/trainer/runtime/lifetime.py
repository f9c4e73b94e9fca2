"""Process lifetime: no polyshard process outlives the one that started it.

A worker that loses its launcher (the launcher was killed, or crashed) would
otherwise go on training alone, writing checkpoints nobody asked for. On Linux
the kernel can send a child a signal when its parent dies; each layer of a job
(``polyshard`` -> torchrun's agent -> workers) asks for one.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def die_with_parent(sig: int = signal.SIGTERM) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent exits; returns whether it could.

    Only Linux has this; elsewhere the caller relies on its launcher to stop it (torchrun does when it
    exits normally). If the parent is already gone (we were reparented before asking), exit now.
    """
    if not sys.platform.startswith("linux"):
        return False
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if parent == 1 or os.getppid() != parent:  # the parent died before the request took effect
        os.kill(os.getpid(), sig)
    return True


def quiet_interrupts() -> None:
    """Ctrl-C reaches every process of the terminal's foreground group; a worker ends at once and
    silently (its launcher reports the interruption once), instead of printing a traceback per rank.
    Checkpoints stay whole: each is published by a rename only after every rank wrote its file."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
