"""``polyshard prepare``: tokenize a corpus once into a prepared dataset (polyshard.data)."""

from __future__ import annotations

from pathlib import Path

import typer

from polyshard.cli.errors import fail
from polyshard.cli.launch import INTERRUPTED


def prepare_command(
    source: str = typer.Argument(
        ..., help=".txt/.jsonl[.gz|.zst]/.parquet file or folder, a save_to_disk folder, or a dataset name."
    ),
    out: Path = typer.Argument(..., help="The prepared-dataset folder to write."),
    tokenizer: str = typer.Option("bytes", "--tokenizer", help="'bytes' or a tokenizer.json (or a folder with one)."),
    kind: str = typer.Option(
        "text", "--kind", help="text (documents), pairs (prompt/response, with a mask) or preferences (DPO pairs)."
    ),
    split_on: str = typer.Option("file", "--split-on", help="A .txt document: the file, or each blank-line block."),
    text_field: str = typer.Option("text", "--text-field", help="The field (column) holding the text."),
    prompt_field: str = typer.Option("prompt", "--prompt-field", help="--kind pairs: the prompt's field."),
    response_field: str = typer.Option("response", "--response-field", help="--kind pairs: the response's field."),
    separator: str = typer.Option("\n", "--separator", help="Ends each document when there is no end-of-text token."),
    val_fraction: float = typer.Option(0.01, "--val-fraction", help="Share of documents held out for validation."),
    seed: int = typer.Option(0, "--seed", help="Chooses which documents are held out."),
    workers: int | None = typer.Option(None, "--workers", help="Tokenizing processes (default: every core)."),
    shard_tokens: int = typer.Option(1 << 28, "--shard-tokens", help="Tokens per shard file, at most (whole docs)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace a prepared dataset already at OUT."),
    max_document_mb: int = typer.Option(
        16, "--max-document-mb", help="A longer document (file, block, line or row) is refused: memory stays bounded."
    ),
    quiet: bool = typer.Option(False, "--quiet", help="No progress bar."),
) -> None:
    """Tokenize SOURCE into OUT: token shards, document offsets and a manifest, written in parallel and
    renamed into place when complete (an interrupted run resumes)."""
    from polyshard.data.__main__ import summary
    from polyshard.data.errors import DataError
    from polyshard.data.prepare import prepare

    try:
        manifest = prepare(
            source, out, tokenizer, kind=kind, split_on=split_on, text_field=text_field, prompt_field=prompt_field,
            response_field=response_field, separator=separator, val_fraction=val_fraction, seed=seed,
            workers=workers, shard_tokens=shard_tokens, overwrite=overwrite, progress=not quiet,
            max_document_bytes=max_document_mb << 20, note=lambda line: typer.echo(line, err=True),
        )  # fmt: skip
    except DataError as err:
        fail("data", err)
    except KeyboardInterrupt:  # Ctrl-C: what is kept, and that the same command resumes
        typer.echo(interrupted(out), err=True)
        raise typer.Exit(INTERRUPTED) from None
    typer.echo(summary(manifest, str(out)))


def interrupted(out: Path) -> str:
    """The line a prepare stopped by Ctrl-C ends with."""
    from polyshard.data.interrupted import kept

    done = kept(out)
    if done is None or not done.documents:
        return "interrupted: no documents were written yet; run the same command again to start over"
    return f"interrupted: {done} are kept in {done.folder}; run the same command again to resume from there"
