"""The trainer's side of checkpoints: which tensors an engine saves and restores (:mod:`.state`),
where each lives for any config without a model (:mod:`.records`), moving a checkpoint to another
layout offline (:mod:`.run_reshard`), and the exports that need the model's settings: plain and
Hugging Face (:mod:`.run_export`, :mod:`.hugging_face`) and PEFT adapter folders (:mod:`.peft`). The
format itself is ``polyshard.checkpoint``'s.
"""
