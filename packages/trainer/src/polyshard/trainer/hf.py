"""The Hugging Face format for GPT-2: read a ``transformers`` folder onto any mesh, write one back.

polyshard's GPT is GPT-2's architecture (learned positions, pre-norm blocks with biases, tanh GELU,
an unbiased head, tied or untied embeddings). Only the names and two layouts differ:

==================================  ==============================================  ==========
polyshard (``layers.<i>`` below)    Hugging Face (``transformer.h.<j>``, j = i - 1)  layout
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

Import: :class:`HFSource` opens the folder as a checkpoint source for
:func:`polyshard.trainer.reshard.load_into`, so each rank of any mesh reads only the regions its
placement records name (safetensors' lazy slices, one tensor region at a time), exactly as an
online reshard reads a polyshard checkpoint. Export: :func:`write_hf` writes ``config.json`` and
``model.safetensors`` that ``transformers.AutoModelForCausalLM.from_pretrained`` loads.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from polyshard.trainer.checkpoint_format import MASTER, MODEL, OPTIM, CheckpointError
from polyshard.trainer.config import Config, ModelConfig
from polyshard.trainer.models import build_model

PREFIX = "hf:"
CONFIG_FILE, WEIGHTS_FILE, INDEX_FILE = "config.json", "model.safetensors", "model.safetensors.index.json"
# HF's GPT-2 keeps these buffers in some saved files; they hold no weights.
_BUFFERS = (".attn.bias", ".attn.masked_bias")


@dataclass(frozen=True)
class _Source:
    """Where one of our tensors lives in the HF file: its name, whether it is transposed (Conv1D),
    and the offset along HF's last dim (q, k and v share ``c_attn``)."""

    name: str
    transposed: bool = False
    offset: int = 0


def model_settings(folder: str | Path) -> dict[str, object]:
    """The ``[model]`` settings of a GPT-2 folder's ``config.json``, in polyshard's names."""
    hf = _read_config(Path(folder))
    hidden = hf["n_embd"]
    inner = hf.get("n_inner") or 4 * hidden
    if inner % hidden:
        raise CheckpointError(f"{folder}: n_inner={inner} is not a multiple of n_embd={hidden}")
    return {
        "kind": "gpt",
        "vocab_size": hf["vocab_size"],
        "context_length": hf["n_positions"],
        "hidden": hidden,
        "num_layers": hf["n_layer"],
        "num_heads": hf["n_head"],
        "mlp_ratio": inner // hidden,
        "tie_embeddings": bool(hf.get("tie_word_embeddings", True)),
    }


def check_matches(folder: str | Path, model: ModelConfig) -> None:
    """A :class:`CheckpointError` naming every setting of ``model`` the folder disagrees with."""
    wanted = model_settings(folder)
    ours = {
        "kind": model.kind,
        "vocab_size": model.vocab_size,
        "context_length": model.context_length,
        "hidden": model.hidden,
        "num_layers": model.num_layers,
        "num_heads": model.num_heads,
        "mlp_ratio": model.mlp_ratio,
        "tie_embeddings": model.tie_embeddings,
    }
    _check_gpt2_architecture(model, str(folder))
    wrong = {k: v for k, v in wanted.items() if ours[k] != v}
    if wrong:
        fixes = " ".join(
            f"--set model.{k}={json.dumps(v) if isinstance(v, str) else str(v).lower()}" for k, v in wrong.items()
        )
        raise CheckpointError(f"{folder} holds a model with other settings; train it with {fixes}")


def _check_gpt2_architecture(model: ModelConfig, where: str) -> None:
    gpt2 = {"norm": "layer", "activation": "gelu", "positions": "learned", "bias": True, "mlp_hidden": None}
    other = {k: getattr(model, k) for k, v in gpt2.items() if getattr(model, k) != v}
    if model.kind != "gpt" or model.kv_heads != model.num_heads or other:
        raise CheckpointError(
            f"{where}: GPT-2 is a dense GPT with LayerNorm, GELU, learned positions, biases and no grouped-query "
            f"attention; this model differs ({other or model.kind}); Llama-shaped models are not supported yet"
        )


def _toml(value: object) -> str:
    return json.dumps(value) if isinstance(value, str) else str(value).lower()


class HFSource:
    """A Hugging Face GPT-2 folder, opened as a source of model weights for any mesh (no optimizer
    state, no RNG: a run initialised from it starts at step 0)."""

    def __init__(self, folder: str | Path, config: Config):
        self.folder = Path(folder)
        check_matches(self.folder, config.model)
        stored = _weight_files(self.folder)
        # GPT2Model's files (the Hub's "gpt2") name the tensors without the "transformer." of
        # GPT2LMHeadModel's: read both under the longer names.
        self.stored = {_canonical(name): name for name in stored}
        self.files = {_canonical(name): file for name, file in stored.items()}
        self.shapes: dict[str, tuple[int, ...]] = {}
        for name, file in self.files.items():
            with safe_open(str(self.folder / file), "pt") as f:
                if self.stored[name] not in f.keys():
                    raise CheckpointError(
                        f"{self.folder / file} holds no tensor {self.stored[name]!r}, which the index lists"
                    )
                self.shapes[name] = tuple(f.get_slice(self.stored[name]).get_shape())
        self.sources = _gpt2_sources(config.model)
        needed = {s.name for s in self.sources.values()}
        missing = sorted(needed - set(self.shapes))
        unexpected = sorted(n for n in set(self.shapes) - needed if not n.endswith(_BUFFERS))
        if missing or unexpected:
            raise CheckpointError(
                f"{self.folder} is not the GPT-2 these settings describe: missing {missing}, unexpected {unexpected}"
            )
        skeleton = build_model(config.model, layers=())  # the meta device: shapes only
        wanted = {name: tuple(p.shape) for name, p in skeleton.named_parameters()}
        for ours, source in self.sources.items():
            if self.global_shape(MODEL + ours) != wanted[ours]:
                raise CheckpointError(
                    f"{self.folder}: {source.name} is {list(self.shapes[source.name])}, which does not make "
                    f"{ours} {list(wanted[ours])}; config.json and the weights disagree"
                )

    # -- what load_into asks of a source --------------------------------------------------------------
    def resolve(self, key: str) -> str:
        """Model keys as they are; an fp32 master is read from the weights it starts as."""
        if key.startswith(OPTIM) and key.endswith(f"/{MASTER}"):
            key = MODEL + key[len(OPTIM) : -len(MASTER) - 1]
        if not key.startswith(MODEL) or key[len(MODEL) :] not in self.sources:
            raise CheckpointError(f"{self.folder} holds no tensor for {key!r}")
        return key

    def global_shape(self, key: str) -> tuple[int, ...]:
        source = self.sources[self.resolve(key)[len(MODEL) :]]
        saved = self.shapes[source.name]
        if source.transposed:  # our (out, in) is HF's (in, out); c_attn's out is three parameters wide
            width = saved[-1] // 3 if source.name.endswith("c_attn.weight") else saved[-1]
            return (width, saved[0])
        if source.name.endswith("c_attn.bias"):
            return (saved[0] // 3,)
        return saved

    def read(self, key: str, start: tuple[int, ...], shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The region ``start`` + ``shape`` of our tensor ``key``, zero past its shape (padding)."""
        key = self.resolve(key)
        source, full = self.sources[key[len(MODEL) :]], self.global_shape(key)
        out = torch.zeros(shape, dtype=dtype)
        want = [(s, min(s + n, g)) for s, n, g in zip(start, shape, full)]
        if any(hi <= lo for lo, hi in want):
            return out  # all padding
        with safe_open(str(self.folder / self.files[source.name]), "pt") as f:
            stored = f.get_slice(self.stored[source.name])
            if source.transposed:
                (r0, r1), (c0, c1) = want
                block = stored[c0:c1, source.offset + r0 : source.offset + r1].T
            elif len(want) == 1:
                ((lo, hi),) = want
                block = stored[source.offset + lo : source.offset + hi]
            else:
                block = stored[tuple(slice(lo, hi) for lo, hi in want)]
        out[tuple(slice(0, hi - lo) for lo, hi in want)] = block.to(dtype)
        return out

    def optim_state(self) -> dict:
        return {}

    def rng_piece(self, coords: Mapping[str, int]) -> None:
        return None


def _canonical(name: str) -> str:
    return "transformer." + name if name.startswith(("h.", "wte.", "wpe.", "ln_f.")) else name


def _gpt2_sources(model: ModelConfig) -> dict[str, _Source]:
    """Our parameter name -> where it lives in a GPT-2 file."""
    h, last = model.hidden, model.num_layers + 1
    out = {
        "layers.0.tok.weight": _Source("transformer.wte.weight"),
        "layers.0.pos.weight": _Source("transformer.wpe.weight"),
    }
    for i in range(1, last):
        hf = f"transformer.h.{i - 1}"
        ours = f"layers.{i}"
        for a, b in (("norm1", "ln_1"), ("norm2", "ln_2")):
            out[f"{ours}.{a}.weight"], out[f"{ours}.{a}.bias"] = _Source(f"{hf}.{b}.weight"), _Source(f"{hf}.{b}.bias")
        for j, proj in enumerate(("q_proj", "k_proj", "v_proj")):
            out[f"{ours}.attn.{proj}.weight"] = _Source(f"{hf}.attn.c_attn.weight", True, j * h)
            out[f"{ours}.attn.{proj}.bias"] = _Source(f"{hf}.attn.c_attn.bias", False, j * h)
        for a, b in (("attn.o_proj", "attn.c_proj"), ("mlp.fc_in", "mlp.c_fc"), ("mlp.fc_out", "mlp.c_proj")):
            out[f"{ours}.{a}.weight"] = _Source(f"{hf}.{b}.weight", True)
            out[f"{ours}.{a}.bias"] = _Source(f"{hf}.{b}.bias")
    out[f"layers.{last}.norm.weight"] = _Source("transformer.ln_f.weight")
    out[f"layers.{last}.norm.bias"] = _Source("transformer.ln_f.bias")
    if not model.tie_embeddings:
        out[f"layers.{last}.proj.weight"] = _Source("lm_head.weight")
    return out


def _read_config(folder: Path) -> dict:
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"{folder} holds no {CONFIG_FILE}; give a Hugging Face model folder")
    try:
        hf = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path} is not valid JSON: {err}") from err
    if not isinstance(hf, dict) or hf.get("model_type") != "gpt2":
        kind = hf.get("model_type") if isinstance(hf, dict) else None
        raise CheckpointError(f"{path}: model_type {kind!r} is not supported; polyshard reads 'gpt2'")
    for key in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head"):
        if not isinstance(hf.get(key), int) or isinstance(hf.get(key), bool) or hf[key] < 1:
            raise CheckpointError(f"{path}: {key}={hf.get(key)!r} must be a positive integer")
    unsupported = {
        "activation_function": ("gelu_new", "gelu_pytorch_tanh"),
        "layer_norm_epsilon": (1e-5,),
        "scale_attn_weights": (True,),
        "scale_attn_by_inverse_layer_idx": (False,),
        "reorder_and_upcast_attn": (False,),
    }
    for key, fine in unsupported.items():
        if key in hf and hf[key] not in fine:
            raise CheckpointError(f"{path}: {key}={hf[key]!r} is not supported (polyshard's GPT uses {fine[0]!r})")
    return hf


def _weight_files(folder: Path) -> dict[str, str]:
    """HF tensor name -> the file (a bare name inside ``folder``) that holds it."""
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as err:
            raise CheckpointError(f"{index} is not a safetensors index with a weight_map: {err}") from err
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: weight_map must map tensor names to files")
        for file in set(weight_map.values()):
            path = folder / str(file)
            if not isinstance(file, str) or Path(file).name != file or path.is_symlink() or not path.is_file():
                raise CheckpointError(f"{index} names {file!r}; each file must be a bare name of a file in {folder}")
        return dict(weight_map)
    single = folder / WEIGHTS_FILE
    if not single.is_file() or single.is_symlink():
        raise CheckpointError(f"{folder} holds neither {WEIGHTS_FILE} nor {INDEX_FILE}")
    with safe_open(str(single), "pt") as f:
        return {name: WEIGHTS_FILE for name in f.keys()}


# -- export --------------------------------------------------------------------------------------------


def hf_state(state: Mapping[str, torch.Tensor], model: ModelConfig) -> dict[str, torch.Tensor]:
    """Our unsharded weights (:func:`polyshard.trainer.export.consolidate`) in GPT-2's names and layouts."""
    _check_gpt2_architecture(model, "the Hugging Face export")
    out: dict[str, torch.Tensor] = {}
    fused: dict[str, list[torch.Tensor]] = {}
    for ours, source in _gpt2_sources(model).items():
        tensor = state[ours]
        if source.name.endswith(("c_attn.weight", "c_attn.bias")):
            fused.setdefault(source.name, []).append(tensor.T if source.transposed else tensor)
            continue
        out[source.name] = tensor.T if source.transposed else tensor
    for name, parts in fused.items():  # q, k, v in that order, side by side along HF's last dim
        out[name] = torch.cat(parts, dim=-1)
    return {name: t.contiguous().clone() for name, t in sorted(out.items())}


def hf_config(model: ModelConfig) -> dict[str, object]:
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": model.vocab_size,
        "n_positions": model.context_length,
        "n_embd": model.hidden,
        "n_layer": model.num_layers,
        "n_head": model.num_heads,
        "n_inner": model.mlp_ratio * model.hidden,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5,
        "resid_pdrop": model.dropout,
        "embd_pdrop": model.dropout,
        "attn_pdrop": model.dropout,
        "tie_word_embeddings": model.tie_embeddings,
        "torch_dtype": "float32",
    }


def write_hf(
    state: Mapping[str, torch.Tensor], model: ModelConfig, destination: str | Path, max_shard_bytes: int = 5 << 30
) -> Path:
    """Write a Hugging Face folder into ``destination``, which must not exist yet: ``config.json`` and
    ``model.safetensors``, or above ``max_shard_bytes`` the shards ``model-00001-of-0000N.safetensors``
    with ``model.safetensors.index.json`` (as ``save_pretrained`` writes them). It is built under a
    temporary name and renamed, so it is whole or absent."""
    destination = Path(destination)
    if destination.exists():
        raise CheckpointError(f"{destination} exists; give a new folder for the Hugging Face model")
    if not destination.parent.is_dir():
        raise CheckpointError(f"{destination.parent} does not exist; create it or choose another destination")
    tensors = hf_state(state, model)
    tmp = destination.with_name(f".tmp-{destination.name}")
    if tmp.is_dir():  # left by an export that was killed
        for file in tmp.iterdir():
            file.unlink()
        tmp.rmdir()
    tmp.mkdir()
    try:
        (tmp / CONFIG_FILE).write_text(json.dumps(hf_config(model), indent=2) + "\n")
        shards = _shards(tensors, max_shard_bytes)
        if len(shards) == 1:
            save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        else:
            weight_map = {}
            for i, names in enumerate(shards, start=1):
                file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                save_file({n: tensors[n] for n in names}, str(tmp / file), metadata={"format": "pt"})
                weight_map.update(dict.fromkeys(names, file))
            total = sum(t.numel() * t.element_size() for t in tensors.values())
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        tmp.rename(destination)
    except BaseException:
        for file in tmp.iterdir():
            file.unlink()
        tmp.rmdir()
        raise
    return destination


def _shards(tensors: Mapping[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    """Tensor names in file order, cut into groups of at most ``max_bytes`` (a larger tensor alone)."""
    groups: list[list[str]] = [[]]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if groups[-1] and size + nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    return groups
