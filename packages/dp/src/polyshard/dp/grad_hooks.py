"""Gradient hooks that do not keep their wrapper alive.

A post-accumulate-grad hook is stored on the parameter's C++ side, which the
garbage collector cannot see into. A hook that refers to its wrapper (a bound
method, a closure over ``self``) closes a cycle parameter -> hook -> wrapper ->
module -> parameter that is never collected: the wrapper, its gradient buffers
and its process group then live until the process exits. A process group alive
past ``destroy_process_group`` keeps gloo's threads running into the
interpreter's exit, which now and then aborts the process (SIGABRT,
"terminate called without an active exception"). The hooks here hold their
wrapper weakly, so it is freed with the last reference the user drops.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from torch import nn


def weak_grad_hook(param: nn.Parameter, method: Callable[..., Any], *args: Any) -> None:
    """Call ``method(*args, param)`` after ``param``'s gradient is accumulated, while ``method``'s object
    lives (afterwards the hook does nothing). ``args`` must not refer to the object or its parameters."""
    ref = weakref.WeakMethod(method)

    def hook(p: nn.Parameter) -> None:
        bound = ref()
        if bound is not None:
            bound(*args, p)

    param.register_post_accumulate_grad_hook(hook)
