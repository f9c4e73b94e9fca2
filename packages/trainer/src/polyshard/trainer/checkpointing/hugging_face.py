"""The Hugging Face format for every family that has one: read a ``transformers`` folder onto any mesh, write one back.

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
``[model.rope]``'s ``theta``, ``scaling``, ``factor``, ``low_freq_factor``, ``high_freq_factor``,
``original_context``); anything polyshard does not compute (biases, another activation or
rope type, a head dim of its own) is refused, naming the key.

Import: :class:`HFSource` opens the folder as a checkpoint source (``polyshard.checkpoint.HFWeights``)
for :func:`polyshard.trainer.checkpointing.run_reshard.load_into`, so each rank of any mesh reads only
the regions its placement records name (safetensors' lazy slices, one tensor region at a time),
exactly as an online reshard reads a polyshard checkpoint. Export: :func:`write_hf` writes
``config.json`` and ``model.safetensors`` (streamed from a checkpoint, one tensor at a time) that
``transformers.AutoModelForCausalLM.from_pretrained`` loads.

Each family is one record (:mod:`polyshard.models.gpt.hf_gpt2`, :mod:`polyshard.models.gpt.hf_llama`,
declared as :class:`polyshard.models.hf_adapter.HFAdapter`); this module reads and writes any of them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from polyshard.checkpoint import MODEL, TOKENIZER, Checkpoint, CheckpointError
from polyshard.checkpoint.export import blocks
from polyshard.checkpoint.hf import (
    CONFIG_FILE,
    INDEX_FILE,
    PREFIX,
    WEIGHTS_FILE,
    HFWeights,
    check_new_folder,
    read_config,
    write_hf_folder,
)
from polyshard.checkpoint.output import reading
from polyshard.data.tokenizer import FileTokenizer
from polyshard.models import build_model, check_model
from polyshard.models.hf_adapter import HFAdapter, setting
from polyshard.models.hf_adapters import hf_adapter_of, hf_adapters
from polyshard.models.hf_keys import in_folder_terms, setting_keys
from polyshard.trainer.checkpointing.saved import check_saved_shapes
from polyshard.trainer.checkpointing.state import persistent_buffers
from polyshard.trainer.config import Config, ModelConfig, from_dict
from polyshard.trainer.errors import ConfigError

__all__ = [
    "CONFIG_FILE",
    "INDEX_FILE",
    "PREFIX",
    "WEIGHTS_FILE",
    "HFSource",
    "check_matches",
    "export_note",
    "hf_adapter_of",
    "hf_config",
    "hf_state",
    "model_settings",
    "write_hf",
]


def model_settings(folder: str | Path) -> dict[str, object]:
    """The ``[model]`` settings of a Hugging Face folder's ``config.json``, in polyshard's names (a setting
    the folder leaves unset, such as no sliding window, is left out: TOML has no null, and unset is the
    default)."""
    family, hf, where = _read_config(Path(folder))
    return {key: value for key, value in _checked_settings(family, hf, where).items() if value is not None}


def _checked_settings(family: HFAdapter, hf: Mapping[str, Any], where: str) -> dict[str, object]:
    """The folder's settings, refused in the folder's terms (its config.json and key, issue 46) when they
    make no model a run can take (num_local_experts 1e9, an odd qk_rope_head_dim): the file is at fault."""
    wanted = family.settings(hf, where)
    try:
        check_model(from_dict({"model": wanted}).model)
    except ConfigError as err:
        raise CheckpointError(in_folder_terms(str(err), setting_keys(family, hf, where), where)) from err
    return wanted


def check_matches(folder: str | Path, model: ModelConfig) -> HFAdapter:
    """The folder's family; a :class:`CheckpointError` naming every setting of ``model`` the folder
    disagrees with (as the ``--set model.…`` values that would fix it) when they differ."""
    family, hf, where = _read_config(Path(folder))
    wanted = _checked_settings(family, hf, where)
    wrong = {}
    for key, value in wanted.items():
        ours = setting(model, key)
        shorter = key in family.at_most and isinstance(ours, int) and isinstance(value, int) and ours < value
        if ours != value and not shorter:
            wrong[key] = (ours, value)
    if wrong:
        both = "; ".join(f"model.{k}={_toml(ours)} here, {_toml(v)} in the folder" for k, (ours, v) in wrong.items())
        fixes = " ".join(
            f"--set model.{k}={_toml(v)}" + (" (or less)" if k in family.at_most else "") for k, (_, v) in wrong.items()
        )
        raise CheckpointError(
            f"{folder} holds a {family.title} model with other settings ({both}); train it with {fixes}, or "
            "leave those settings out of [model]: with --init-from hf:DIR they come from the folder"
        )
    return family


def _toml(value: object) -> str:
    return json.dumps(value) if isinstance(value, (str, list)) else str(value).lower()


class HFSource(HFWeights):
    """A Hugging Face model folder (a family of the registry) whose ``config.json`` matches ``config``'s model,
    opened as a source of model weights for any mesh (:class:`polyshard.checkpoint.HFWeights`)."""

    def __init__(self, folder: str | Path, config: Config):
        family = check_matches(folder, config.model)
        super().__init__(
            folder,
            family.locations(config.model),
            title=family.title,
            canonical=family.canonical,
            buffers=family.buffers,
        )
        self.family = family
        wanted = _shapes(config.model)
        for ours, location in self.locations.items():
            if self.global_shape(MODEL + ours) != wanted[ours]:
                raise CheckpointError(
                    f"{self.folder}: {location.name} is {list(self.global_shape(MODEL + ours))}, which does not make "
                    f"{ours} {list(wanted[ours])}; config.json and the weights disagree"
                )


def _shapes(model: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Our parameters' and persistent buffers' shapes (a sigmoid router's selection bias is a buffer that
    DeepSeek-V3's files hold as ``e_score_correction_bias``), from the model on the meta device."""
    skeleton = build_model(model, layers=())
    return {name: tuple(p.shape) for name, p in [*skeleton.named_parameters(), *persistent_buffers(skeleton)]}


def _read_config(folder: Path) -> tuple[HFAdapter, dict[str, Any], str]:
    """The folder's family, its parsed ``config.json`` and that file's path (for messages)."""
    hf, path = read_config(folder)
    kind = hf.get("model_type")
    families = hf_adapters()
    if not isinstance(kind, str) or kind not in families:
        raise CheckpointError(f"{path}: model_type {kind!r} is not supported; polyshard reads {sorted(families)}")
    return families[kind], hf, str(path)


# -- export --------------------------------------------------------------------------------------------


Part = tuple[str, bool, int | None]
"""One of our tensors in a Hugging Face tensor: (our name, transposed, expert index or None)."""


def _hf_tensors(
    model: ModelConfig, ours: Callable[[str, int | None], torch.Tensor], dtype: Callable[[str], torch.dtype]
) -> tuple[dict[str, tuple[torch.dtype, tuple[int, ...]]], Callable[[str], torch.Tensor]]:
    """The family's tensors (name -> dtype and shape, in file order) and a function making each from
    our weights (``ours(name, expert)``: the whole tensor, or with an expert index that expert's slice
    of stacked experts), one at a time: transposed where the family stores ``x @ W``, and fused tensors
    (GPT-2's q, k, v) put side by side along the last dim in their parts' order."""
    parts = _parts(model)
    shapes = _shapes(model)

    def shape_of(hf_name: str) -> tuple[int, ...]:
        pieces = []
        for n, transposed, expert in parts[hf_name]:
            shape = shapes[n] if expert is None else shapes[n][1:]
            pieces.append(shape[::-1] if transposed else shape)
        if len(pieces) == 1:
            return pieces[0]
        return (*pieces[0][:-1], sum(p[-1] for p in pieces))

    def make(hf_name: str) -> torch.Tensor:
        pieces = [ours(n, expert).T if transposed else ours(n, expert) for n, transposed, expert in parts[hf_name]]
        return (pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=-1)).contiguous()

    specs = {hf_name: (dtype(members[0][0]), shape_of(hf_name)) for hf_name, members in sorted(parts.items())}
    return specs, make


def _parts(model: ModelConfig) -> dict[str, list[Part]]:
    """HF tensor name -> the pieces of ours it is made of, in their order."""
    parts: dict[str, list[Part]] = {}
    for name, location in hf_adapter_of(model).locations(model).items():
        if location.stacked:  # one HF tensor per expert, each one row of our stacked tensor
            for expert, hf_name in enumerate(location.stacked):
                parts.setdefault(hf_name, []).append((name, location.transposed, expert))
        else:
            parts.setdefault(location.name, []).append((name, location.transposed, None))
    return parts


def _from_state(state: Mapping[str, torch.Tensor]) -> Callable[[str, int | None], torch.Tensor]:
    return lambda name, expert: state[name] if expert is None else state[name][expert]


def hf_state(state: Mapping[str, torch.Tensor], model: ModelConfig) -> dict[str, torch.Tensor]:
    """Our unsharded weights (:func:`polyshard.trainer.checkpointing.run_export.consolidate`) in the family's
    names and layouts."""
    specs, make = _hf_tensors(model, _from_state(state), lambda name: state[name].dtype)
    return {name: make(name).clone() for name in specs}


def export_note(model: ModelConfig) -> str | None:
    """What an export of ``model`` to its family's format changes, to tell the user (None: nothing)."""
    family = hf_adapter_of(model)
    notes = [family.note(model)]
    depth = model.prediction_depth
    if depth and not any(".mtp." in name for name in family.locations(model)):
        # transformers' Llama, GPT-2, Qwen and Mixtral have no multi-token prediction: inference drops it
        notes.append(
            f"the {depth} multi-token prediction depth(s) (layers.{model.num_layers + 1}.mtp.*) are left out: "
            "this format has none; the next-token model is written whole"
        )
    return "; ".join(note for note in notes if note) or None


def hf_config(model: ModelConfig) -> dict[str, object]:
    """The ``config.json`` of ``model``'s family."""
    return hf_adapter_of(model).config(model)


def write_hf(
    state: Mapping[str, torch.Tensor] | Checkpoint,
    model: ModelConfig,
    destination: str | Path,
    max_shard_bytes: int = 5 << 30,
    tokenizer: Path | None = None,
    *,
    overwrite: bool = False,
) -> Path:
    """Write a Hugging Face folder into ``destination``, which must not exist yet: ``config.json`` and
    ``model.safetensors``, or above ``max_shard_bytes`` the shards ``model-00001-of-0000N.safetensors``
    with ``model.safetensors.index.json`` (as ``save_pretrained`` writes them). ``state`` is our
    unsharded weights, or a checkpoint to stream them from one tensor at a time. With ``tokenizer``
    (the run's ``tokenizer.json``) the folder gets it too, with a ``tokenizer_config.json``, so
    ``AutoTokenizer.from_pretrained`` reads it; ``config.json``'s bos/eos ids are then its end-of-text
    token (or none). It is built under a temporary name and renamed, so it is whole or absent; a folder
    already there is replaced only with ``overwrite``, the checkpoint read never."""
    protected = reading(state.folder) if isinstance(state, Checkpoint) else ()
    check_new_folder(destination, overwrite=overwrite, protected=protected)  # before any tensor is read
    produce: Callable[[str], torch.Tensor | Iterator[torch.Tensor]]
    if isinstance(state, Checkpoint):
        source = state
        check_saved_shapes(source)  # a tampered index is named before any file is written

        def ours(name: str, expert: int | None) -> torch.Tensor:
            if expert is None:
                return source.whole(MODEL + name)
            shape = source.global_shape(MODEL + name)  # one expert's slice of the stacked tensor
            return source.read(
                MODEL + name, (expert, *(0,) * (len(shape) - 1)), (1, *shape[1:]), source.dtype(MODEL + name)
            )[0]

        specs, make = _hf_tensors(model, ours, lambda n: source.dtype(MODEL + n))
        parts = _parts(model)

        def produce(hf_name: str) -> torch.Tensor | Iterator[torch.Tensor]:
            pieces = parts[hf_name]
            if len(pieces) == 1 and not pieces[0][1] and pieces[0][2] is None:  # stored as we store it
                return blocks(source, MODEL + pieces[0][0])  # in row blocks: the embeddings, the largest tensors
            return make(hf_name)  # transposed, fused or one expert: a few MB each, whole
    else:
        specs, produce = _hf_tensors(model, _from_state(state), lambda name: state[name].dtype)
    config = hf_config(model)
    files: dict[str, Path | str] = {}
    if tokenizer is not None:
        text = FileTokenizer(tokenizer)
        end = text.end_of_text
        config.update(bos_token_id=end, eos_token_id=end)
        files[TOKENIZER] = tokenizer
        # The tokenizer knows its end-of-text token by name only from here (lm_eval stops generating at it).
        named = {} if end is None else dict.fromkeys(("bos_token", "eos_token"), text.inner.id_to_token(end))
        files["tokenizer_config.json"] = json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", **named}) + "\n"
    return write_hf_folder(
        destination, config, specs, produce, max_shard_bytes=max_shard_bytes, files=files, overwrite=overwrite,
        protected=protected,
    )  # fmt: skip
