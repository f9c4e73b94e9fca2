"""One config, parsed once: the launcher checks and resolves it, writes it into the run folder, and
the workers read that file (``parallel.dp = "auto"`` stays symbolic for elastic restarts)."""

import json

import pytest

from polyshard.trainer import ConfigError, PlannedStep, prepare_launch, read_settings
from polyshard.trainer.runtime.launch import RESOLVED_CONFIG, read_resolved


def _settings(corpus, **parallel):
    return {
        "model": {"preset": "tiny"},
        "parallel": {"dp": "auto", "tp": 2, **parallel},
        "training": {"global_batch_size": 16},
        "data": {"source": corpus},
    }


def test_the_resolved_config_keeps_dp_auto_for_every_node_count(corpus, tmp_path):
    out = tmp_path / "run"
    launch = prepare_launch(_settings(corpus), out=out, nproc=2, nodes=(1, 2))  # elastic: 2 or 4 processes
    assert launch.config.parallel.dp == 1 and launch.nproc == 2 and not out.exists()  # checks write nothing
    written = launch.write()
    assert written == out / RESOLVED_CONFIG and json.loads(written.read_text())["parallel"]["dp"] == "auto"
    assert read_resolved(written, world_size=4).parallel.dp == 2  # a restart on two nodes
    assert read_resolved(written, world_size=2).parallel.dp == 1
    assert launch.worker_args() == ["--out", str(out.resolve())]


def test_a_planned_launch_hands_its_prediction_to_the_workers(corpus, tmp_path):
    out = tmp_path / "run"
    planned = PlannedStep(step_s=0.5, states_bytes=(1.0,), activation_bytes=(2.0,))
    launch = prepare_launch(_settings(corpus, dp=2, tp=1), out=out, nproc=2, prediction=planned)
    launch.write()
    assert launch.worker_args()[-2:] == ["--plan", str((out / "plan.json").resolve())]
    assert PlannedStep.read(out / "plan.json") == planned


def test_a_mistake_is_named_before_anything_is_written(corpus, tmp_path):
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match="tp=3"):
        prepare_launch(_settings(corpus, tp=3), out=out, nproc=3)  # tiny has 4 heads
    with pytest.raises(ConfigError, match="elastic\\) needs parallel.dp='auto'"):
        settings = _settings(corpus)
        settings["parallel"]["dp"] = 1
        prepare_launch(settings, out=out, nproc=2, nodes=(1, 2))
    with pytest.raises(ConfigError, match="not both"):
        prepare_launch(_settings(corpus), out=out, nproc=2, resume=True, init_from=str(tmp_path))
    assert not out.exists()


def test_settings_are_read_once_with_overrides_typed_by_field(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[model]\npreset = "tiny"\n[optimizer]\nlr = 1e-3\n')
    settings = read_settings(path, ["optimizer.lr=3e-4", "model.tie_embeddings=False"])
    assert settings["optimizer"]["lr"] == 3e-4 and settings["model"]["tie_embeddings"] is False
    (tmp_path / "broken.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="broken.json: the run's resolved config is not a table"):
        read_resolved(tmp_path / "broken.json")


def _train_once(settings, out):
    from polyshard.mesh import Mesh
    from polyshard.trainer.config import from_dict
    from polyshard.trainer.loop import train

    config = from_dict(settings)
    train(config, Mesh(config.parallel.mesh_axes), out, log=False)


def test_a_new_run_never_saves_over_another_runs_checkpoints(distributed, corpus, tmp_path):
    from polyshard.trainer import CheckpointError

    out = tmp_path / "run"
    settings = _settings(corpus, dp=1, tp=1)
    settings["training"] |= {"steps": 2, "global_batch_size": 2, "eval_every": 0, "sample_tokens": 0}
    distributed.run(1, _train_once, settings, out)  # one process: a run with its step-2 checkpoint
    saved = {p: p.read_bytes() for p in (out / "checkpoints").rglob("*") if p.is_file()}
    with pytest.raises(CheckpointError, match="holds a run's checkpoints .* give --resume .* or --overwrite"):
        prepare_launch(settings, out=out, nproc=1)
    assert {p: p.read_bytes() for p in (out / "checkpoints").rglob("*") if p.is_file()} == saved
    assert prepare_launch(settings, out=out, nproc=1, resume=True).nproc == 1  # continuing it is the point
    assert prepare_launch(settings, out=out, nproc=1, overwrite=True).nproc == 1  # asked to start over
