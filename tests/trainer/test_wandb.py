"""``logging.wandb``: a run logged to Weights & Biases in offline mode (WANDB_MODE=offline, files under
tmp_path, no network), read back from the files wandb wrote: the resolved config, every metric of
``metrics.jsonl`` at its step, from rank 0 only, and ``--resume`` continuing the same W&B run."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from polyshard.checkpoint import step_dir
from polyshard.mesh import Mesh
from polyshard.trainer.config import from_dict, load_config
from polyshard.trainer.engine.constraints import validate
from polyshard.trainer.errors import ConfigError
from polyshard.trainer.loop import train
from polyshard.trainer.loop.wandb_run import STATE_FILE, WandbRun
from tests.trainer._wandb_files import offline_runs

pytest.importorskip("wandb")


def _config(corpus, stop_at=0, **logging):
    return from_dict(
        {
            "model": {"hidden": 32, "num_layers": 2, "num_heads": 4, "context_length": 16},
            "parallel": {"dp": 2},
            "training": {
                "steps": 4,
                "global_batch_size": 8,
                "stop_at": stop_at,
            },  # fmt: skip
            "eval": {
                "every": 2,
                "batches": 1,
                "sample_tokens": 0,
            },
            "data": {"source": corpus},
            "checkpoint": {"every": 2},
            "logging": {"progress_bar": False, "wandb": True, **logging},
        }
    )


def _train_offline(config, out, wandb_dir, resume):
    """Train in offline mode with wandb's files under ``wandb_dir``; the pool's worker processes live on
    after this test, so the environment is put back."""
    saved = {key: os.environ.get(key) for key in ("WANDB_MODE", "WANDB_DIR", "WANDB_SILENT")}
    os.environ.update(WANDB_MODE="offline", WANDB_DIR=wandb_dir, WANDB_SILENT="true")
    try:
        train(config, Mesh(config.parallel.mesh_axes), Path(out), resume=resume)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def test_an_offline_run_holds_the_config_and_every_metric_and_a_resumed_run_continues_it(distributed, corpus, tmp_path):
    out, wandb_dir = tmp_path / "run", tmp_path / "wandb_files"
    tags = ["tiny", "dp2"]
    logging = {"wandb_project": "polyshard-tests", "wandb_run_name": "tiny-dp2", "wandb_tags": tags}
    config, first = _config(corpus, **logging), _config(corpus, stop_at=3, **logging)
    validate(config, world_size=2)
    distributed.run(2, _train_offline, first, str(out), str(wandb_dir), False)
    # As if the run had crashed after step 3's log line but before its checkpoint was written: the
    # resumed run repeats step 3 from the checkpoint of step 2.
    shutil.rmtree(step_dir(out / "checkpoints", 3))
    distributed.run(2, _train_offline, config, str(out), str(wandb_dir), True)

    runs = offline_runs(wandb_dir)
    assert len(runs) == 2  # one W&B run per launch: rank 0 alone logs (two ranks would make four)
    state = json.loads((out / STATE_FILE).read_text())
    assert runs[0].id == runs[1].id == state["id"] and state["last_step"] == 4  # the same W&B run, continued
    for run in runs:
        assert (run.project, run.name, run.tags) == ("polyshard-tests", "tiny-dp2", tags)
        # The resolved config: what the file set and the defaults it left, each section a nested table.
        assert run.config["training"]["steps"] == 4 and run.config["optimizer"]["lr"] == config.optimizer.lr
        assert run.config["model"]["hidden"] == 32 and run.config["parallel"]["dp"] == 2
        assert run.config["logging"]["wandb_tags"] == tags
    assert [row["_step"] for row in runs[0].history] == [1, 2, 3]
    assert [row["_step"] for row in runs[1].history] == [4]  # step 3 was sent by the first launch

    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    logged = {row["_step"]: row for run in runs for row in run.history}
    for record in records:
        row = logged[record["step"]]
        if record["step"] == 3:  # logged by the first launch, trained again by the second: the same maths,
            for key in ("loss", "grad_norm", "lr"):  # other timings and memory
                assert row[key] == record[key], key
            continue
        values = {k: v for k, v in record.items() if k != "step" and not isinstance(v, list)}
        assert {k: row[k] for k in values} == values  # the same floats, through JSON both ways
        peaks = record["peak_memory_bytes_per_rank"]
        assert [row[f"peak_memory_bytes_per_rank/rank{i}"] for i in range(2)] == peaks
    assert {"loss", "grad_norm", "lr", "tokens_per_s", "val_loss", "mfu"} <= set(logged[4])


@pytest.mark.parametrize(
    "override, message",
    [
        (
            'logging.wandb_mode="cloud"',
            r"logging.wandb_mode='cloud'; choose one of \['online', 'offline', 'disabled'\]",
        ),
        ('logging.wandb_tags="a,b"', r"logging.wandb_tags='a,b' must be a list of strings"),
        ("logging.wandb=maybe", r"logging.wandb='maybe' must be true or false"),
    ],
)
def test_bad_wandb_fields_name_the_field(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_wandb_without_its_package_names_the_extra(monkeypatch):
    config = load_config(None, ["logging.wandb=true"])
    validate(config, world_size=1)  # installed here (requirements-dev.txt)
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if it were not installed
    with pytest.raises(ConfigError, match=r"^logging.wandb = true needs the wandb package .*"
                       r"pip install 'polyshard-trainer\[wandb\]'"):  # fmt: skip
        validate(config, world_size=1)


def test_a_run_wandb_cannot_start_is_a_config_error(monkeypatch, tmp_path):
    import wandb

    def refuse(**_):
        raise wandb.errors.UsageError("No API key configured. Use `wandb login` to log in.")

    monkeypatch.setattr(wandb, "init", refuse)
    with pytest.raises(ConfigError, match=r"No API key configured.*set logging.wandb_mode = 'offline'"):
        WandbRun(load_config(None, ["logging.wandb=true"]), tmp_path, resume=False)
    assert not (tmp_path / STATE_FILE).exists()


def test_a_state_file_that_is_not_ours_is_named(tmp_path):
    (tmp_path / STATE_FILE).write_text('{"id": 3}')
    with pytest.raises(ConfigError, match=f"{STATE_FILE} holds no W&B run id and last step; delete it"):
        WandbRun(load_config(None, ["logging.wandb=true"]), tmp_path, resume=True)


def test_a_disabled_run_logs_nothing_and_records_no_id(tmp_path):
    config = load_config(None, ["logging.wandb=true", 'logging.wandb_mode="disabled"'])
    run = WandbRun(config, tmp_path, resume=False)
    run.write({"step": 1, "loss": 2.5, "peak_memory_bytes_per_rank": [1, 2]})
    run.close()
    # An id that names no W&B run is not kept: a later --resume with W&B on starts a real run.
    assert not (tmp_path / STATE_FILE).exists() and not (tmp_path / "wandb").exists()
