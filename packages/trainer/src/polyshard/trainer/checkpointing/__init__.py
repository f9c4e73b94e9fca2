"""The trainer's side of checkpoints: which tensors an engine saves and restores (:mod:`.state`),
where each lives for any config without a model (:mod:`.records`), moving a checkpoint to another
layout offline or while loading (:mod:`.reshard`), and the plain and Hugging Face exports that
need the model's settings (:mod:`.export`). The format itself is ``polyshard.checkpoint``'s.
"""
