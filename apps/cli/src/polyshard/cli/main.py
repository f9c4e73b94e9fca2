"""The ``polyshard`` command line."""

from __future__ import annotations

import typer

from polyshard.cli.bench import bench_app
from polyshard.cli.checkpoints import export, generate, inspect, reshard
from polyshard.cli.evaluate import eval_command
from polyshard.cli.families import RegistryHelp
from polyshard.cli.plan import plan_command
from polyshard.cli.prepare import prepare_command
from polyshard.cli.schedule import schedule_command
from polyshard.cli.tokenizer import tokenizer_command
from polyshard.cli.train import train

app = typer.Typer(help="polyshard: N-D parallel training on torch.distributed.", no_args_is_help=True)
app.add_typer(bench_app, name="bench")
app.command("schedule")(schedule_command)
app.command("plan")(plan_command)
app.command("train", cls=RegistryHelp)(train)
app.command("inspect")(inspect)
app.command("export", cls=RegistryHelp)(export)
app.command("reshard")(reshard)
app.command("generate")(generate)
app.command("eval")(eval_command)
app.command("tokenizer")(tokenizer_command)
app.command("prepare")(prepare_command)


def _print_versions(value: bool) -> None:
    if value:
        from polyshard.cli.version import versions_text

        typer.echo(versions_text())
        raise typer.Exit()


@app.callback()
def _options(
    version: bool = typer.Option(
        False, "--version", callback=_print_versions, is_eager=True, help="Print each polyshard package's version."
    ),
) -> None:
    """The options of polyshard itself, before any command."""


def main() -> None:
    app()


if __name__ == "__main__":
    main()
