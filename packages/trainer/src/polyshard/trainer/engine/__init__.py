"""The engine: a model laid out on the mesh and ready to step.

layout.py       pure layout arithmetic: the family's tp plan, the pipeline split by layer cost, global names
builder.py      TP -> EP -> PP -> DP/ZeRO applied in turn (build_engine)
runtime.py      the Engine: stages, wrappers, optimizers, executor
context.py      context parallelism over the cp axis (sequence chunks, ring or all-gather attention)
experts.py      expert parameters and the idle experts AdamW must leave untouched
optimizer.py    the optimizer: AdamW or Muon, chosen in one place
optim.py        the optimizer's parameter groups, the learning-rate schedule, the global gradient-norm clip
documents.py    the documents of a packed batch, handed to each stage's blocks
compiling.py    torch.compile of every block
balance.py      the experts' load, and the sigmoid router's bias moved toward balance
constraints.py  whether a config can be laid out (heads vs tp, layers vs stages, ...), before launch
"""
