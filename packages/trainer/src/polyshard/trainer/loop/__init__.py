"""One training run: the step, evaluation, loading and saving (:mod:`.train`), and the plan check
that holds a planned run against its prediction (:mod:`.plan_check`)."""

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
