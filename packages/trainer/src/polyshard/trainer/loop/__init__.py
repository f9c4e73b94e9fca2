"""One training run: the step, evaluation, loading and saving (:mod:`.train`), and what runs beside
it: metrics and the progress line (:mod:`.metrics`), the profiler (:mod:`.profiling`), the replica
and finiteness checks (:mod:`.integrity`), the plan check that holds a planned run against its
prediction (:mod:`.plan_check`) and injected faults (:mod:`.faults`)."""

from polyshard.trainer.loop.train import (
    RunResult,
    evaluate,
    evaluate_batches,
    make_loaders,
    sample_text,
    saved_by_this_job,
    split_batch,
    train,
    train_step,
)

__all__ = [
    "RunResult",
    "evaluate",
    "evaluate_batches",
    "make_loaders",
    "sample_text",
    "saved_by_this_job",
    "split_batch",
    "train",
    "train_step",
]
