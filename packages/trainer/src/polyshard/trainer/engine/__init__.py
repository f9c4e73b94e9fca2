"""The engine: a model laid out on the mesh and ready to step.

layout.py        pure layout arithmetic: the family's tp plan, the pipeline split by layer cost, global names
builder.py       TP -> EP -> PP -> DP/ZeRO applied in turn (build_engine)
engine.py        the Engine: stages, wrappers, optimizers, executor
context.py       context parallelism over the cp axis (sequence chunks, ring or all-gather attention)
experts.py       expert parameters and the idle experts AdamW must leave untouched
optimizer.py     the optimizer: AdamW or Muon over its parameter groups, chosen in one place
schedule.py      the learning-rate schedules
gradient_norm.py the global gradient norm (each element counted once over the ranks) and the clip
documents.py     the documents of a packed batch, handed to each stage's blocks
compiling.py     torch.compile of every block
balance.py       the experts' load, and the sigmoid router's bias moved toward balance
mtp.py           multi-token prediction: each microbatch's shifted tokens reach the last stage
lora.py          LoRA in a run: the linears [lora] adapts, adapted after tp and before the other wrappers
frozen_dtype.py  model.frozen_dtype: a LoRA run's frozen base kept in bf16 or fp16
peft_folder.py   a PEFT folder as lora.init = 'peft:DIR' reads it, checked before the engine is built
constraints.py   whether a config can be laid out (heads vs tp, layers vs stages, ...), before launch
"""
