"""``polyshard tokenizer``: train a byte-level BPE on a text source, for ``data.tokenizer``."""

from __future__ import annotations

from pathlib import Path

import typer


def tokenizer_command(
    source: str = typer.Argument(..., help="'shakespeare', a .txt file or a folder of them (as data.source)."),
    out: Path = typer.Argument(..., help="The tokenizer.json to write."),
    # No typer range: train_bpe says why below 257 fails, in one line (typer would print a usage box).
    vocab_size: int = typer.Option(4096, "--vocab-size", help="Tokens: the 256 bytes plus merges (257 or more)."),
) -> None:
    """Train a byte-level BPE (GPT-2's kind: every string round-trips) and save it as tokenizer.json;
    then train with --set data.tokenizer=OUT --set model.vocab_size=N (N at least --vocab-size)."""
    from polyshard.trainer import DataError, local_files, train_bpe

    try:
        if out.is_dir():
            raise DataError(f"{out} is a folder; give the file to write, e.g. {out / 'tokenizer.json'}")
        if not out.parent.is_dir():
            raise DataError(f"{out.parent} does not exist; create it or choose another destination")
        files = local_files(source)
        if files is None:
            raise DataError(f"{source!r} is not a local text source; give 'shakespeare', a .txt file or a folder")
        texts = (f.read_text(encoding="utf-8", errors="replace") for f in files)
        written = train_bpe(texts, vocab_size, out)
    except DataError as err:
        typer.echo(f"data error: {err}", err=True)
        raise typer.Exit(2) from err
    typer.echo(f"wrote {written} ({vocab_size} tokens)")
