"""Seeing where time goes: ``logging.profile_steps`` (a Chrome trace per rank, the pipeline's measured
timeline beside the simulator's) and ``logging.tensorboard`` (the metrics as TensorBoard scalars)."""

import json
import sys

import pytest

from polyshard.mesh import Mesh
from polyshard.trainer.config import from_dict, load_config
from polyshard.trainer.engine.constraints import validate
from polyshard.trainer.errors import ConfigError
from polyshard.trainer.loop import train


def _config(corpus, steps=3, parallel=None, logging=None):
    return from_dict(
        {
            "model": {"hidden": 32, "num_layers": 2, "num_heads": 4, "context_length": 16},
            "parallel": parallel or {},
            "training": {"steps": steps, "global_batch_size": 8},
            "eval": {"every": 0, "sample_tokens": 0},
            "data": {"source": corpus},
            "logging": {"progress_bar": False, **(logging or {})},
        }
    )


def _train(config, out):
    from pathlib import Path

    train(config, Mesh(config.parallel.mesh_axes), Path(out))


def test_profile_steps_write_a_trace_per_rank_and_the_pipeline_timeline(distributed, corpus, tmp_path):
    config = _config(corpus, parallel={"pp": 2, "microbatches": 4}, logging={"profile_steps": [2, 3]})
    distributed.run(2, _train, config, str(tmp_path))
    profile = tmp_path / "profile"
    assert sorted(p.name for p in profile.iterdir()) == ["pipeline.svg", "pipeline.txt", "rank0.json", "rank1.json"]
    for rank in (0, 1):
        trace = json.loads((profile / f"rank{rank}.json").read_text())
        events = trace["traceEvents"]
        assert len(events) > 50
        names = {e.get("name") for e in events}
        assert {"step 2", "step 3"} <= names and "step 1" not in names  # only the profiled steps
        assert any(name.startswith("aten::") for name in names if name)  # the operators ran under the profiler
    text = (profile / "pipeline.txt").read_text()
    assert "step 3, 1f1b pp=2 m=4" in text
    assert text.count("rank 0  |") == 2 and text.count("rank 1  |") == 2  # measured, then the simulator's
    bubbles = [line for line in text.splitlines() if line.startswith("bubble measured ")]
    assert len(bubbles) == 1
    measured, simulated = (float(part.split()[-1]) for part in bubbles[0].split("|"))
    assert 0.0 < simulated < 1.0 and 0.0 < measured < 1.0
    svg = (profile / "pipeline.svg").read_text()
    assert svg.startswith("<svg") and svg.count("<svg") == 3  # one document holding both drawings
    assert "measured, step 3" in svg and "simulator from the measured costs" in svg
    assert not (tmp_path / "tensorboard").exists()  # logging.tensorboard is off by default


def test_tensorboard_scalars_equal_the_metrics_log(distributed, corpus, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = _config(corpus, steps=4, parallel={"dp": 2}, logging={"tensorboard": True})
    validate(config, world_size=2)
    distributed.run(2, _train, config, str(tmp_path))
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"loss", "grad_norm", "lr", "tokens_per_s"} <= tags
    assert {"peak_memory_bytes_per_rank/rank0", "peak_memory_bytes_per_rank/rank1"} <= tags
    for tag in tags:
        key, _, rank = tag.partition("/rank")
        expected = [(r["step"], r[key][int(rank)] if rank else r[key]) for r in records if key in r]
        got = [(e.step, e.value) for e in events.Scalars(tag)]
        assert [s for s, _ in got] == [s for s, _ in expected], tag
        assert [v for _, v in got] == pytest.approx([v for _, v in expected], rel=1e-6), tag  # float32


def test_a_resumed_run_hides_the_scalars_after_its_checkpoint(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from polyshard.trainer.loop.metrics import MetricsLog

    log = MetricsLog(tmp_path, enabled=True, tensorboard=True)
    for step in range(1, 6):  # the run crashed after step 5; its last checkpoint is step 3
        log.write({"step": step, "loss": 1.0 / step, "skipped": "text is no scalar"})
    log.close()
    resumed = MetricsLog(tmp_path, enabled=True, resume_from=3, tensorboard=True)
    for step in range(4, 7):
        resumed.write({"step": step, "loss": 10.0 / step})
    resumed.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert events.Tags()["scalars"] == ["loss"]
    scalars = events.Scalars("loss")
    assert [e.step for e in scalars] == [1, 2, 3, 4, 5, 6]
    assert [e.value for e in scalars] == pytest.approx([1.0, 0.5, 1 / 3, 2.5, 2.0, 10 / 6])


@pytest.mark.parametrize(
    "override, message",
    [
        ("logging.profile_steps=[3,1]", r"logging.profile_steps=\[3, 1\]: the first step comes after the last"),
        ("logging.profile_steps=[0,2]", r"logging.profile_steps=\[0, 2\]: steps count from 1"),
        ("logging.profile_steps=[2]", r"logging.profile_steps=\[2\] must be two steps \[first, last\]"),
        ("logging.profile_steps=[1,2,3]", r"logging.profile_steps=\[1, 2, 3\] must be two steps"),
        ("logging.profile_steps=3", r"logging.profile_steps=3 must be a list of integers or unset"),
        ("logging.profile_steps=[1.5,2]", r"logging.profile_steps=\[1.5, 2\] must be a list of integers"),
        ('logging.profile_steps="2-3"', r"logging.profile_steps='2-3' must be a list of integers"),
        ("logging.tensorboard=maybe", r"logging.tensorboard='maybe' must be true or false"),
    ],
)
def test_bad_logging_fields_name_the_field(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_profile_steps_past_the_run_are_refused_before_launch():
    config = load_config(None, ["training.steps=10", "logging.profile_steps=[5,12]"])
    with pytest.raises(ConfigError, match=r"logging.profile_steps=\[5, 12\] ends past training.steps=10"):
        validate(config, world_size=1)
    validate(load_config(None, ["training.steps=10", "logging.profile_steps=[10,10]"]), world_size=1)


def test_tensorboard_without_its_package_says_how_to_install_it(monkeypatch):
    config = load_config(None, ["logging.tensorboard=true"])
    validate(config, world_size=1)  # installed here (requirements-dev.txt)
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if it were not installed
    monkeypatch.delitem(sys.modules, "torch.utils.tensorboard", raising=False)
    with pytest.raises(ConfigError, match=r"pip install 'polyshard-trainer\[tensorboard\]'"):
        validate(config, world_size=1)


def test_pipeline_report_draws_both_timelines_on_one_scale():
    from polyshard.pp import lower, make_schedule, simulate
    from polyshard.trainer.loop.profiling import pipeline_report

    schedule = make_schedule("1f1b", 2, 4)
    # a "measured" step whose transfers took 1 ms each; the simulator replays its compute with free ones
    measured = simulate(schedule, {"F": 2e-3, "B": 4e-3, "W": 0.0}, comm_cost=1e-3).timeline
    text, svg = pipeline_report(measured, schedule, lower(schedule), "step 3")
    lines = text.splitlines()
    rows = [line for line in lines if line.startswith("rank 0  |")]
    assert len(rows) == 2 and len(rows[0]) == len("rank 0  |") + 100 + 1  # the measured step: the full width
    assert len(rows[1]) == len("rank 0  |") + round(100 * 30 / 34) + 1  # 30 ms of 34 on the same scale
    assert "measured: 34.00 ms" in text and "F 2 ms, B 4 ms, W 0 ms" in text and ": 30.00 ms" in text
    assert "bubble measured 0.294 | simulator 0.200" in lines
    assert svg.count("<svg") == 3 and "bubble 0.294" in svg and "bubble 0.200" in svg
