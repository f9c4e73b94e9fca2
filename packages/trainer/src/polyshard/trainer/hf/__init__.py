"""The Hugging Face format for GPT-2 and Llama: read a ``transformers`` folder onto any mesh, write one back.

polyshard's GPT computes both architectures (GPT-2: LayerNorm, tanh GELU, learned positions, biases;
Llama: ``norm="rms"``, ``activation="swiglu"``, ``positions="rope"``, ``bias=false``, grouped-query
attention). Only the names and, for GPT-2, two layouts differ:

==================================  ==============================================  ==========
polyshard (``layers.<i>`` below)    GPT-2 (``transformer.h.<j>``, j = i - 1)         layout
==================================  ==============================================  ==========
``0.tok.weight`` / ``0.pos.weight``  ``transformer.wte.weight`` / ``wpe.weight``     same
``i.norm1`` / ``i.norm2``            ``ln_1`` / ``ln_2``                             same
``i.attn.{q,k,v}_proj``              ``attn.c_attn`` (q, k, v side by side)          Conv1D
``i.attn.o_proj``                    ``attn.c_proj``                                 Conv1D
``i.mlp.fc_in`` / ``i.mlp.fc_out``   ``mlp.c_fc`` / ``mlp.c_proj``                   Conv1D
``L+1.norm``                         ``transformer.ln_f``                            same
``L+1.proj.weight``                  ``lm_head.weight`` (absent when tied)           same
==================================  ==============================================  ==========

GPT-2's ``Conv1D`` computes ``x @ W + b``: its weight is a ``Linear`` weight transposed.

================================  ==================================================  ======
polyshard (``layers.<i>`` below)  Llama (``model.layers.<j>``, j = i - 1)             layout
================================  ==================================================  ======
``0.tok.weight``                  ``model.embed_tokens.weight``                       same
``i.norm1`` / ``i.norm2``         ``input_layernorm`` / ``post_attention_layernorm``  same
``i.attn.{q,k,v,o}_proj``         ``self_attn.{q,k,v,o}_proj``                        same
``i.mlp.{gate,up,down}_proj``     ``mlp.{gate,up,down}_proj``                         same
``L+1.norm``                      ``model.norm``                                      same
``L+1.proj.weight``               ``lm_head.weight`` (absent when tied)               same
================================  ==================================================  ======

Llama's q and k need no permutation: polyshard's rotary embedding pairs dims i and i + D/2, as
``transformers``' ``rotate_half`` does. ``config.json`` maps to ``[model]`` settings
(``rms_norm_eps`` -> ``norm_eps``, ``rope_theta`` and Llama 3.1's ``llama3`` rope scaling ->
``rope_scale_factor``, ``rope_low_freq_factor``, ``rope_high_freq_factor``,
``rope_original_context``); anything polyshard does not compute (biases, another activation or
rope type, a head dim of its own) is refused, naming the key.

Import: :class:`HFSource` opens the folder as a checkpoint source (``polyshard.checkpoint.HFWeights``)
for :func:`polyshard.trainer.checkpointing.reshard.load_into`, so each rank of any mesh reads only
the regions its placement records name (safetensors' lazy slices, one tensor region at a time),
exactly as an online reshard reads a polyshard checkpoint. Export: :func:`write_hf` writes
``config.json`` and ``model.safetensors`` (streamed from a checkpoint, one tensor at a time) that
``transformers.AutoModelForCausalLM.from_pretrained`` loads.

Each family is one record (:mod:`.gpt2`, :mod:`.llama`); :mod:`.folder` reads and writes any of them.
"""

from polyshard.trainer.hf.family import Family
from polyshard.trainer.hf.folder import (
    CONFIG_FILE,
    FAMILIES,
    INDEX_FILE,
    PREFIX,
    WEIGHTS_FILE,
    HFSource,
    check_matches,
    family_of,
    hf_config,
    hf_state,
    model_settings,
    write_hf,
)

__all__ = [
    "CONFIG_FILE",
    "FAMILIES",
    "INDEX_FILE",
    "PREFIX",
    "WEIGHTS_FILE",
    "Family",
    "HFSource",
    "check_matches",
    "family_of",
    "hf_config",
    "hf_state",
    "model_settings",
    "write_hf",
]
