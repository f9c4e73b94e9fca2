"""``hf:`` names (``--init-from hf:...``): a Hugging Face model folder, or a model id found in the local
Hugging Face cache, with no network.

``hf:DIR`` with a ``DIR`` that exists is that folder. Otherwise ``hf:org/name`` (or ``hf:name``,
``hf:org/name@revision``) is looked up where ``huggingface_hub`` downloads (``hf download org/name``,
``from_pretrained``)::

    <cache>/models--org--name/refs/main          the commit of the revision "main"
    <cache>/models--org--name/snapshots/<commit>/ config.json, model.safetensors, ... (links into blobs/)
    <cache>/models--org--name/blobs/             the files themselves

The cache is ``HF_HUB_CACHE``, else ``HF_HOME/hub``, else ``$XDG_CACHE_HOME/huggingface/hub``, else
``~/.cache/huggingface/hub``, as huggingface_hub chooses it (its legacy ``HUGGINGFACE_HUB_CACHE`` too).
A snapshot's files are links into the model's ``blobs/``: reading them stays inside the model's cache
folder (:func:`polyshard.checkpoint.untrusted.check_inside`).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from polyshard.checkpoint.errors import CheckpointError
from polyshard.checkpoint.hf import PREFIX

REPO_FOLDER_PREFIX, SNAPSHOTS = "models--", "snapshots"
# A Hugging Face model id: [org/]name, each part letters, digits, '.', '_', '-' (no '--' or '..', which the
# Hub refuses and which would make the cache folder's name ambiguous or leave the cache).
_PART = r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9_])?"
_MODEL_ID = re.compile(rf"^(?:{_PART}/)?{_PART}$")
_REVISION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]*$")  # a branch or tag (refs/<revision>) or a commit
_COMMIT = re.compile(r"^[A-Za-z0-9]+$")  # a snapshot folder's name: the commit's hash


def hf_folder(init_from: str | Path | None) -> Path | None:
    """The model folder an ``--init-from`` names when it starts with ``hf:`` (:func:`resolve`); None for a
    checkpoint (or nothing)."""
    if init_from is None or not str(init_from).startswith(PREFIX):
        return None
    return resolve(str(init_from)[len(PREFIX) :])


def resolve(name: str) -> Path:
    """The folder ``name`` (what follows ``hf:``) stands for: itself when it exists (or looks like a path:
    absolute, or starting with ``.`` or ``~``), else the cache's snapshot of the model id ``name``; a
    one-line :class:`CheckpointError` naming the cache searched and how to fill it otherwise."""
    path = Path(name).expanduser()
    if path.exists() or path.is_absolute() or name.startswith((".", "~")):
        return path  # a missing folder is named by whatever reads it
    model_id, _, revision = name.partition("@")
    if not _MODEL_ID.match(model_id) or ".." in model_id or "--" in model_id:
        raise CheckpointError(
            f"hf:{name}: no such folder, and {model_id!r} is no Hugging Face model id; give a model folder "
            "(hf:DIR) or a model id as hf:org/name (hf:org/name@revision for another revision)"
        )
    return snapshot(model_id, revision or "main")


def snapshot(model_id: str, revision: str = "main") -> Path:
    """The cache's folder of ``model_id`` at ``revision`` (a branch or tag the cache has a ref for, or a
    commit)."""
    cache, where = hub_cache()
    repo = cache / (REPO_FOLDER_PREFIX + model_id.replace("/", "--"))
    get = f"hf download {model_id}" + ("" if revision == "main" else f" --revision {revision}")
    if not repo.is_dir():
        raise CheckpointError(
            f"hf:{model_id}: not a folder here, and the Hugging Face cache {cache} ({where}) holds no "
            f"{repo.name}; download it there first (`{get}`, or from_pretrained once online), point "
            "HF_HUB_CACHE at the cache that has it, or give the model's folder as hf:DIR"
        )
    if not _REVISION.match(revision) or ".." in revision:
        raise CheckpointError(f"hf:{model_id}@{revision}: {revision!r} is no branch, tag or commit name")
    ref = repo / "refs" / revision
    commit = ref.read_text().strip() if ref.is_file() else revision
    folder = repo / SNAPSHOTS / commit
    if not _COMMIT.match(commit) or not folder.is_dir():
        have = sorted(p.name for p in (repo / SNAPSHOTS).glob("*") if p.is_dir())
        held = f"it holds {', '.join(have)} (name one as hf:{model_id}@<commit>)" if have else "it holds none"
        raise CheckpointError(
            f"hf:{model_id}: {repo} has no snapshot of revision {revision!r}; {held}, or download it (`{get}`)"
        )
    return folder


def hub_cache() -> tuple[Path, str]:
    """The Hugging Face cache folder, and which setting chose it (said in errors)."""
    for variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(variable):
            return _expanded(os.environ[variable]), f"from {variable}"
    if os.environ.get("HF_HOME"):
        return _expanded(os.environ["HF_HOME"]) / "hub", "HF_HOME/hub"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
    where = "XDG_CACHE_HOME/huggingface/hub" if os.environ.get("XDG_CACHE_HOME") else "the default"
    return _expanded(base) / "huggingface" / "hub", f"{where}; set HF_HUB_CACHE to search another"


def _expanded(path: str) -> Path:
    return Path(os.path.expandvars(os.path.expanduser(path)))
