"""Reading and writing Hugging Face model folders, for any :class:`~polyshard.trainer.hf.family.Family`.

A folder is ``config.json`` plus ``model.safetensors``, or shards named by
``model.safetensors.index.json``. ``config.json``'s ``model_type`` picks the family on import;
on export the family is the one the model's settings describe.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from polyshard.trainer.checkpoint_format import MASTER, MODEL, OPTIM, TOKENIZER, CheckpointError
from polyshard.trainer.config import Config, ModelConfig
from polyshard.trainer.data.tokenizer import FileTokenizer
from polyshard.trainer.hf.family import Family, setting
from polyshard.trainer.hf.gpt2 import GPT2
from polyshard.trainer.hf.llama import LLAMA_FAMILY
from polyshard.trainer.models import build_model, spec_of

PREFIX = "hf:"
CONFIG_FILE, WEIGHTS_FILE, INDEX_FILE = "config.json", "model.safetensors", "model.safetensors.index.json"
FAMILIES: dict[str, Family] = {family.model_type: family for family in (GPT2, LLAMA_FAMILY)}


def model_settings(folder: str | Path) -> dict[str, object]:
    """The ``[model]`` settings of a Hugging Face folder's ``config.json``, in polyshard's names."""
    family, hf, where = _read_config(Path(folder))
    return family.settings(hf, where)


def check_matches(folder: str | Path, model: ModelConfig) -> Family:
    """The folder's family; a :class:`CheckpointError` naming every setting of ``model`` the folder
    disagrees with (as the ``--set model.…`` values that would fix it) when they differ."""
    family, hf, where = _read_config(Path(folder))
    wanted = family.settings(hf, where)
    wrong = {}
    for key, value in wanted.items():
        ours = setting(model, key)
        shorter = key in family.at_most and isinstance(ours, int) and isinstance(value, int) and ours < value
        if ours != value and not shorter:
            wrong[key] = value
    if wrong:
        fixes = " ".join(
            f"--set model.{k}={_toml(v)}" + (" (or less)" if k in family.at_most else "") for k, v in wrong.items()
        )
        raise CheckpointError(f"{folder} holds a {family.title} model with other settings; train it with {fixes}")
    return family


def _toml(value: object) -> str:
    return json.dumps(value) if isinstance(value, str) else str(value).lower()


class HFSource:
    """A Hugging Face model folder (GPT-2 or Llama), opened as a source of model weights for any mesh
    (no optimizer state, no RNG: a run initialised from it starts at step 0)."""

    def __init__(self, folder: str | Path, config: Config):
        self.folder = Path(folder)
        self.family = check_matches(self.folder, config.model)
        stored = _weight_files(self.folder)
        # A base model's file (the Hub's "gpt2") names the tensors without the causal LM's prefix:
        # read both under the longer names.
        self.stored = {self.family.canonical(name): name for name in stored}
        self.files = {self.family.canonical(name): file for name, file in stored.items()}
        self.shapes: dict[str, tuple[int, ...]] = {}
        for name, file in self.files.items():
            with safe_open(str(self.folder / file), "pt") as f:
                if self.stored[name] not in f.keys():
                    raise CheckpointError(
                        f"{self.folder / file} holds no tensor {self.stored[name]!r}, which the index lists"
                    )
                self.shapes[name] = tuple(f.get_slice(self.stored[name]).get_shape())
        self.sources = self.family.sources(config.model)
        needed = {s.name for s in self.sources.values()}
        missing = sorted(needed - set(self.shapes))
        unexpected = sorted(n for n in set(self.shapes) - needed if not n.endswith(self.family.buffers))
        if missing or unexpected:
            raise CheckpointError(
                f"{self.folder} is not the {self.family.title} these settings describe: missing {missing}, "
                f"unexpected {unexpected}"
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
        if source.transposed:  # our (out, in) is HF's (in, out); a fused tensor's out holds several of ours
            return (saved[-1] // source.parts, saved[0])
        if source.parts > 1:
            return (saved[0] // source.parts, *saved[1:])
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

    def optim_state(self) -> dict[str, dict[str, tuple[torch.dtype, tuple[int, ...]]]]:
        return {}

    def rng_piece(self, coords: Mapping[str, int]) -> None:
        return None


def _read_config(folder: Path) -> tuple[Family, dict[str, Any], str]:
    """The folder's family, its parsed ``config.json`` and that file's path (for messages)."""
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"{folder} holds no {CONFIG_FILE}; give a Hugging Face model folder")
    try:
        hf = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path} is not valid JSON: {err}") from err
    kind = hf.get("model_type") if isinstance(hf, dict) else None
    if not isinstance(kind, str) or kind not in FAMILIES:
        raise CheckpointError(f"{path}: model_type {kind!r} is not supported; polyshard reads {sorted(FAMILIES)}")
    return FAMILIES[kind], hf, str(path)


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


def family_of(model: ModelConfig) -> Family:
    """The family whose architecture ``model`` has; an error naming what each would need otherwise."""
    allowed = spec_of(model).hf_families
    if not allowed:
        raise CheckpointError(f"model.kind={model.kind!r} has no Hugging Face counterpart polyshard reads or writes")
    needs = {}
    for family in (FAMILIES[name] for name in allowed):
        differences = family.differences(model)
        if not differences:
            return family
        needs[family.title] = ", ".join(f"{k}={v!r}" for k, v in differences.items())
    raise CheckpointError(
        "the Hugging Face export writes GPT-2 and Llama models; this model is neither: "
        + "; ".join(f"{title} would need {what}" for title, what in needs.items())
    )


def hf_state(state: Mapping[str, torch.Tensor], model: ModelConfig) -> dict[str, torch.Tensor]:
    """Our unsharded weights (:func:`polyshard.trainer.export.consolidate`) in the family's names and layouts."""
    out: dict[str, torch.Tensor] = {}
    fused: dict[str, list[torch.Tensor]] = {}
    for ours, source in family_of(model).sources(model).items():
        tensor = state[ours].T if source.transposed else state[ours]
        if source.parts > 1:  # in source order (q, k, v), side by side along HF's last dim
            fused.setdefault(source.name, []).append(tensor)
        else:
            out[source.name] = tensor
    for name, parts in fused.items():
        out[name] = torch.cat(parts, dim=-1)
    return {name: t.contiguous().clone() for name, t in sorted(out.items())}


def hf_config(model: ModelConfig) -> dict[str, object]:
    """The ``config.json`` of ``model``'s family."""
    return family_of(model).config(model)


def write_hf(
    state: Mapping[str, torch.Tensor],
    model: ModelConfig,
    destination: str | Path,
    max_shard_bytes: int = 5 << 30,
    tokenizer: Path | None = None,
) -> Path:
    """Write a Hugging Face folder into ``destination``, which must not exist yet: ``config.json`` and
    ``model.safetensors``, or above ``max_shard_bytes`` the shards ``model-00001-of-0000N.safetensors``
    with ``model.safetensors.index.json`` (as ``save_pretrained`` writes them). With ``tokenizer`` (the
    run's ``tokenizer.json``) the folder gets it too, with a ``tokenizer_config.json``, so
    ``AutoTokenizer.from_pretrained`` reads it; ``config.json``'s bos/eos ids are then its end-of-text
    token (or none). It is built under a temporary name and renamed, so it is whole or absent."""
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
        config = hf_config(model)
        if tokenizer is not None:
            end = FileTokenizer(tokenizer).end_of_text
            config.update(bos_token_id=end, eos_token_id=end)
            shutil.copyfile(tokenizer, tmp / TOKENIZER)
            (tmp / "tokenizer_config.json").write_text(
                json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}) + "\n"
            )
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        shards = _shards(tensors, max_shard_bytes)
        if len(shards) == 1:
            save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        else:
            weight_map = {}
            for i, names in enumerate(shards, start=1):
                shard = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                save_file({n: tensors[n] for n in names}, str(tmp / shard), metadata={"format": "pt"})
                weight_map.update(dict.fromkeys(names, shard))
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
