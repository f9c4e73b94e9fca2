"""Killed workers and preempted runs lose nothing: a run that was killed (mid-step, mid-save, right
after a save) and restarted by torchrun, or resumed by hand, or stopped with --stop-at and resumed,
ends with the losses, metrics log and weights of a run that was never interrupted, bit for bit.

Faults are injected with POLYSHARD_FAULT=<point>@<step>:<rank> (SIGKILL at that point, first attempt
only). Bitwise equality holds because a resumed run restores the weights, optimizer state, RNG
and data position exactly, and CPU kernels are deterministic.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.reliability._jobs import SHORT, final_weights, metrics, train


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted")
    done = train(out, *SHORT)
    assert done.returncode == 0, done.stderr
    return out


def _same_run(out, reference) -> None:
    summary, expected = (json.loads((o / "summary.json").read_text()) for o in (out, reference))
    assert summary["ended"] == "completed"
    assert summary["losses"] == expected["losses"] and len(expected["losses"]) == 8
    assert metrics(out) == metrics(reference)  # every step logged once, nothing twice
    mine, theirs = final_weights(out), final_weights(reference)
    assert mine.keys() == theirs.keys()
    for name in theirs:
        assert torch.equal(mine[name], theirs[name]), name


@pytest.mark.system
def test_a_preempted_run_whose_worker_is_then_killed_equals_an_uninterrupted_run(uninterrupted, tmp_path):
    # A job is preempted at step 3 (--stop-at), resumed, and loses a worker mid-step 5; torchrun
    # restarts the group, which resumes from step 4's checkpoint. Nothing shows in the result.
    first = train(tmp_path, *SHORT, "--stop-at", "3")
    assert first.returncode == 0, first.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["ended"].startswith("stopped at step 3") and len(summary["losses"]) == 3
    assert (tmp_path / "checkpoints" / "step_00000003").is_dir()  # saved where it stopped
    # The learning rate followed the 8-step schedule, not a 3-step one.
    assert [m[3] for m in metrics(tmp_path)] == [m[3] for m in metrics(uninterrupted)[:3]]
    rest = train(tmp_path, *SHORT, "--resume", "--torchrun=--max-restarts=1", env={"POLYSHARD_FAULT": "step@5:1"})
    assert rest.returncode == 0, rest.stderr
    assert "continuing from" in rest.stdout and "step_00000003" in rest.stdout
    assert "restart 1 of the worker group (2 processes" in rest.stdout
    assert "step_00000004" in rest.stdout.split("restart 1")[1]  # the restart resumed from step 4
    _same_run(tmp_path, uninterrupted)


@pytest.mark.system
@pytest.mark.parametrize("fault", ["step@5:1", "save@4:1", "saved@4:0"])
def test_a_worker_killed_mid_step_while_saving_or_after_is_restarted_and_resumes(uninterrupted, tmp_path, fault):
    done = train(tmp_path, *SHORT, "--torchrun=--max-restarts=1", env={"POLYSHARD_FAULT": fault})
    assert done.returncode == 0, done.stderr
    assert "restart 1 of the worker group" in done.stdout
    assert not list((tmp_path / "checkpoints").glob(".polyshard-tmp-*"))  # a half-written save was cleaned up
    _same_run(tmp_path, uninterrupted)


@pytest.mark.system
def test_a_killed_run_resumed_by_hand_equals_an_uninterrupted_one(uninterrupted, tmp_path):
    crashed = train(tmp_path, *SHORT, env={"POLYSHARD_FAULT": "save@6:1"})
    assert crashed.returncode != 0
    assert [p.is_dir() for p in (tmp_path / "checkpoints").glob(".polyshard-tmp-step_00000006-*")] == [True]  # its save
    resumed = train(tmp_path, *SHORT, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    _same_run(tmp_path, uninterrupted)


ASYNC = ["--set", "checkpoint.async_save=true"]


@pytest.mark.system
def test_an_async_save_writes_the_checkpoints_and_run_a_blocking_save_does(uninterrupted, tmp_path):
    from safetensors.torch import load_file

    done = train(tmp_path, *SHORT, *ASYNC)
    assert done.returncode == 0, done.stderr
    _same_run(tmp_path, uninterrupted)  # training never waited on the writes, and saw the same state
    saved = sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*"))
    assert saved == sorted(p.name for p in (uninterrupted / "checkpoints").glob("step_*")) and len(saved) == 4
    for step in saved:  # the copy taken at the step boundary is the state a blocking save writes
        for rank_file in sorted((uninterrupted / "checkpoints" / step).glob("rank_*.safetensors")):
            mine, theirs = load_file(tmp_path / "checkpoints" / step / rank_file.name), load_file(rank_file)
            assert mine.keys() == theirs.keys()
            assert all(torch.equal(mine[k], theirs[k]) for k in theirs), (step, rank_file.name)
        ours, reference = (
            json.loads((o / "checkpoints" / step / "index.json").read_text()) for o in (tmp_path, uninterrupted)
        )
        assert [r["extra"]["data"] for r in ours["ranks"]] == [r["extra"]["data"] for r in reference["ranks"]]


@pytest.mark.system
def test_a_run_killed_mid_async_write_keeps_the_previous_checkpoint_and_resumes(uninterrupted, tmp_path):
    crashed = train(tmp_path, *SHORT, *ASYNC, env={"POLYSHARD_FAULT": "save@6:1"})  # killed in the writer thread
    # Rank 1 was killed; torchrun names whichever rank it saw end first: rank 1 (SIGKILL) or rank 0,
    # whose next collective with the dead rank failed. Both say the run ended on the kill.
    died = ("exit code -9", "Connection closed by peer", "Connection reset by peer")
    assert crashed.returncode != 0 and any(d in crashed.stderr for d in died), crashed.stderr
    assert not (tmp_path / "checkpoints" / "step_00000006").exists(), crashed.stderr  # never published
    assert (tmp_path / "checkpoints" / "step_00000004" / "index.json").is_file()  # still the newest complete
    resumed = train(tmp_path, *SHORT, *ASYNC, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert "step_00000004" in resumed.stdout
    _same_run(tmp_path, uninterrupted)
