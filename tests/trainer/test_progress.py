"""The progress line: redrawn on a terminal, plain lines in a pipe or a CI log."""

from polyshard.trainer.loop.metrics import Progress


def test_piped_progress_prints_plain_lines(capsys):
    progress = Progress(40, enabled=True, interactive=False)
    for step in range(40):
        progress.update(step, 1.0, 100.0)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 20 and "\r" not in "".join(lines)  # every 2nd step: a twentieth of the run
    assert lines[-1].startswith("step 40/40 loss 1.0000")


def test_terminal_progress_redraws_one_line(capsys):
    progress = Progress(3, enabled=True, interactive=True)
    for step in range(3):
        progress.update(step, 2.0, 10.0)
    out = capsys.readouterr().out
    assert out.count("\r") == 3 and out.count("\n") == 1 and "[########################] step 3/3" in out


def test_a_resumed_log_drops_the_steps_after_its_checkpoint(tmp_path):
    from polyshard.trainer.loop.metrics import MetricsLog

    log = MetricsLog(tmp_path, enabled=True)
    for step in range(1, 6):  # the run crashed after step 5; its last checkpoint is step 3
        log.write({"step": step, "loss": 1.0 / step})
    resumed = MetricsLog(tmp_path, enabled=True, resume_from=3)
    for step in range(4, 7):
        resumed.write({"step": step, "loss": 1.0 / step})
    # Before: steps 4 and 5 stood twice. Now the log equals an uninterrupted run's.
    assert [r["step"] for r in resumed.records()] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in MetricsLog(tmp_path, enabled=True).records()] == []  # a fresh run starts empty
