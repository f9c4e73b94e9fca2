"""Every size the config can set has a bound (issue 46): values that passed every check and then failed in
the workers (a loss in 1e9 chunks grew a worker past 3.8 GB; a seed or a timeout past what torch takes
overflowed there) are refused before launch, naming the field and the range that works."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from polyshard.trainer.config import from_dict
from polyshard.trainer.engine.constraints import validate
from polyshard.trainer.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]

# 16 rows over dp=2 x 2 microbatches: 4 rows of 64 positions a microbatch, 256 tokens; cp=2 halves them
LM = {"model": {"context_length": 64}, "training": {"global_batch_size": 16}, "parallel": {"dp": 2, "microbatches": 2}}


def _checked(settings: dict) -> None:
    validate(from_dict(settings))


def test_loss_chunks_are_bounded_by_the_tokens_they_split():
    _checked({**LM, "training": {"global_batch_size": 16, "loss_chunks": 256}})
    with pytest.raises(ConfigError, match=r"^training.loss_chunks=257 is more than the 256 tokens .*in 0..256$"):
        _checked({**LM, "training": {"global_batch_size": 16, "loss_chunks": 257}})
    cp = {**LM, "parallel": {"dp": 2, "microbatches": 2, "cp": 2}, "training": {"global_batch_size": 16,
          "loss_chunks": 129}}  # fmt: skip
    with pytest.raises(ConfigError, match=r"more than the 128 tokens .*model.context_length / cp=2\); .*0..128$"):
        _checked(cp)


@pytest.mark.parametrize(
    ("section", "values", "message"),
    [
        ("training", {"seed": 2**70}, r"training.seed=1180591620717411303424 is past 4,294,967,295; .*0..4294967295"),
        ("training", {"seed": 2**32 - 1}, None),
        ("parallel", {"timeout_s": 1e300}, r"parallel.timeout_s=1e\+300 must be in \(0, 604800\] seconds"),
        ("parallel", {"timeout_s": 3600.0}, None),
        ("eval", {"sample_tokens": 10**9}, r"eval.sample_tokens=1000000000 is past 100,000; .*0..100000"),
    ],
)
def test_fields_that_overflowed_in_the_workers_have_bounds(section, values, message):
    if message is None:
        from_dict({section: values})
        return
    with pytest.raises(ConfigError, match=message):
        from_dict({section: values})


def test_the_cli_refuses_a_billion_loss_chunks_in_one_line_before_any_process(monkeypatch, tmp_path):
    from polyshard.cli import train as train_cli
    from polyshard.cli.main import app

    started: list[int] = []
    monkeypatch.setattr(train_cli, "run_local", lambda nproc, *args, **kwargs: started.append(nproc) or 0)
    config = str(ROOT / "apps/configs/gpt-tiny-dp.toml")
    args = ["train", config, "--set", "training.loss_chunks=1000000000", "--out", str(tmp_path / "run")]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("config error: training.loss_chunks=1000000000 is more than")
    assert started == [] and not (tmp_path / "run").exists()
