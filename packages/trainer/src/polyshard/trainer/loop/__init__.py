"""One training run.

trainer.py     the :class:`Trainer`: step, evaluate, save, and the hooks at fixed points of each step
step.py        one optimizer step: forward/backward over microbatches, reductions, clip, AdamW
evaluate.py    forward-only pipelined evaluation over any batches
resume.py      where a run starts: a checkpoint on any mesh, a Hugging Face folder, a restarted job
sample.py      text from the unsharded weights
hooks.py       the :class:`Hook` points; the replica check and fault injection as hooks
plan_check.py  a planned run's prediction against what it measures (a hook)
profiling.py   ``logging.profile_steps`` traces and the pipeline timeline (a hook)
metrics.py     ``metrics.jsonl``, the progress line, MFU, ``loss.png``, TensorBoard
wandb_run.py   ``logging.wandb``: the config and the metrics to Weights & Biases, continued on resume
integrity.py   replica checksums and finite weights
faults.py      ``POLYSHARD_FAULT`` kill points
"""

from polyshard.trainer.loop.evaluate import evaluate, evaluate_batches
from polyshard.trainer.loop.hooks import Hook
from polyshard.trainer.loop.resume import saved_by_this_job
from polyshard.trainer.loop.sample import sample_text
from polyshard.trainer.loop.step import batch_segments, split_batch, train_step
from polyshard.trainer.loop.trainer import RunResult, Trainer, make_loaders, train

__all__ = [
    "Hook",
    "RunResult",
    "Trainer",
    "evaluate",
    "evaluate_batches",
    "make_loaders",
    "sample_text",
    "saved_by_this_job",
    "batch_segments",
    "split_batch",
    "train",
    "train_step",
]
