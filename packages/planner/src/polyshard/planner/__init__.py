"""The layout planner: what each rank holds and how long a step takes, for any candidate layout.

A candidate layout is a :class:`~polyshard.trainer.config.Config` whose ``parallel`` section (dp, tp, pp,
ep, cp, ZeRO stage, microbatches, schedule) and ``training.activation_checkpointing`` say it; every
estimate below takes the config itself.

memory.py       parameters, gradients and optimizer state per rank (ZeRO paper; polyshard's engine, exact)
activations.py  bytes saved for backward per rank, in-flight microbatches from the pipeline simulator
comm.py         every collective per step: axis, op, group, bytes
pipeline.py     the simulator as the planner asks it (cached, extrapolated for long steps)
profile.py      a machine: matmul and elementwise rates, AdamW, collectives (measured, or vendor figures)
calibrate.py    measures this machine into a profile (`polyshard plan --calibrate`)
published.py    published large runs (published_runs.toml) and the planner's step time at each one's layout
calibrate_published.py  fits the built-in profiles' matmul share on the published runs marked fit
cost.py         step time: compute from FLOPs, collectives from bytes, bubbles from the simulator
search.py       every layout of a model on N devices: keep those that fit, rank by step time; their labels
report.py       the ranked table
auto.py         `polyshard train --layout auto`: choose, explain, hand the choice and its prediction to the run
bench.py        `polyshard bench plan`: predicted against measured step times of the tiny GPT
dry_run.py      `polyshard train --dry-run`: the mesh, every group, memory per rank
benchmarks/     `polyshard bench peers` (against PyTorch's DDP, FSDP2, DTensor, pipelining) and cp memory
"""
