"""Help texts that name the model families the registry holds, read when the help is shown.

The families come from ``polyshard.models``' registry (and any family a distribution registers
through its entry point), so a help text never falls behind the code. Importing the registry
imports torch (seconds), so a help text holds the placeholder :data:`HF_FAMILIES`, filled in only
by a command that prints its help: ``polyshard train CONFIG`` and ``polyshard --version`` pay nothing.
"""

from __future__ import annotations

from typing import Any

from typer.core import TyperCommand

HF_FAMILIES = "{hf_adapters}"
"""Stands for the Hugging Face families polyshard reads and writes, e.g. ``GPT-2, Llama, Qwen2, ...``."""


def hf_family_titles() -> list[str]:
    """Every registered family's Hugging Face counterparts, by title, in the registry's order."""
    from polyshard.trainer import hf_adapters

    return [family.title for family in hf_adapters().values()]


class RegistryHelp(TyperCommand):
    """A command whose options' help texts may hold :data:`HF_FAMILIES`, filled in from the registry when
    the help is printed (its docstring names no family: ``polyshard --help`` lists it without asking)."""

    def format_help(self, ctx: Any, formatter: Any) -> None:  # typer's own click Context and formatter
        titles = ", ".join(hf_family_titles())
        helps = [(param, getattr(param, "help", None) or "") for param in self.params]  # options and arguments
        templates = [(param, text) for param, text in helps if HF_FAMILIES in text]
        try:  # filled for this one print: the templates stay, so a family registered later shows next time
            for param, text in templates:
                param.help = text.replace(HF_FAMILIES, titles)  # type: ignore[attr-defined]
            super().format_help(ctx, formatter)
        finally:
            for param, text in templates:
                param.help = text  # type: ignore[attr-defined]
