"""The trainer's optional extras (``pip install 'polyshard-trainer[<extra>]'``), imported only when a
setting asks for one; a missing one is a one-line :class:`ConfigError` naming the setting and the extra."""

from __future__ import annotations

import importlib
from types import ModuleType

from polyshard.trainer.errors import ConfigError


def require(module: str, *, setting: str, extra: str, package: str) -> ModuleType:
    """``module`` imported, for ``setting`` (``logging.wandb``), which the extra ``extra`` installs."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ConfigError(
            f"{setting} = true needs the {package} package ({err}); install it with "
            f"pip install 'polyshard-trainer[{extra}]' (or pip install {package}), or set {setting} = false"
        ) from err


def tensorboard() -> ModuleType:
    """``torch.utils.tensorboard`` (needs the tensorboard package, and protobuf)."""
    return require("torch.utils.tensorboard", setting="logging.tensorboard", extra="tensorboard", package="tensorboard")


def wandb() -> ModuleType:
    return require("wandb", setting="logging.wandb", extra="wandb", package="wandb")
