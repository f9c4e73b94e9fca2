"""The engine: a model laid out on the mesh and ready to step.

parallelize.py  TP -> EP -> PP -> DP/ZeRO applied in turn; the Engine (stages, wrappers, optimizers, executor)
context.py      context parallelism over the cp axis (sequence chunks, ring or all-gather attention)
experts.py      expert parameters and the idle experts AdamW must leave untouched
optim.py        AdamW groups, the learning-rate schedule, the global gradient-norm clip
constraints.py  whether a config can be laid out (heads vs tp, layers vs stages, ...), before launch
"""
