"""Which core runs a call: the run's setting (``auto`` by default) and what the call needs."""

from __future__ import annotations

import torch

from polyshard.models.common.cores.flex import flex_available

CORES = ("auto", "sdpa", "blocksparse", "flex")


def choose_core(setting: str, masked: bool, device: torch.device) -> str:
    """The core for one call: ``masked`` when documents, a window or sinks are in play (beyond causality).
    ``auto`` keeps plain SDPA for unmasked calls (bit for bit as before) and otherwise takes FlexAttention
    on CUDA, else the block-sparse core. A forced choice that cannot serve the call is a ValueError."""
    if setting not in CORES:
        raise ValueError(f"attention core {setting!r} is unknown; choose one of {CORES}")
    if setting == "auto":
        if not masked:
            return "sdpa"
        return "flex" if flex_available(device) else "blocksparse"
    if setting == "sdpa" and masked:
        raise ValueError(
            "attention core 'sdpa' takes no document mask, sliding window or sinks; set the attention core "
            "to 'auto' or 'blocksparse'"
        )
    if setting == "flex" and not flex_available(device):
        raise ValueError(
            f"attention core 'flex' needs CUDA and torch's FlexAttention; this runs on {device.type}: set the "
            "attention core to 'auto' or 'blocksparse'"
        )
    return setting
