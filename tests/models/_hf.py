"""What every Hugging Face family's import test checks after importing a folder on some mesh and saving
the run's checkpoint (``test_hf_llama._import_and_score``): the logits and loss transformers gives, and an
export with no training between that gives the folder's tensors back, bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from polyshard.checkpoint import Checkpoint
from polyshard.trainer.checkpointing.hugging_face import hf_state, write_hf
from polyshard.trainer.config import Config
from tests.models.test_hf import _tokens

ROUND_OFF = 1e-5  # float32: the same sums as transformers', taken in another order

# The meshes a family's import test scores on (each test says which run in the default suite).
MESHES = {
    "one": {}, "tp2": {"tp": 2}, "ep2": {"ep": 2}, "pp2": {"pp": 2}, "cp2": {"cp": 2}, "ep2xtp2": {"ep": 2, "tp": 2},
}  # fmt: skip


def transformers_logits(folder: Path) -> torch.Tensor:
    """transformers' (B, S - 1, V) logits of the shared tokens from the model in ``folder``, in eval mode."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        return model(_tokens()[:, :-1]).logits


def assert_scores_as_transformers(
    label: str, config: Config, logits: torch.Tensor, losses: list[float] | None, hf_logits: torch.Tensor
) -> None:
    """``logits``, the whole (B, S, V) put back from every rank, and each rank's mean loss (None: not
    compared) against transformers' on the same tokens."""
    print(f"{label}: max |logit - transformers'| = {(logits - hf_logits).abs().max():.3g}")
    torch.testing.assert_close(logits, hf_logits, rtol=ROUND_OFF, atol=ROUND_OFF)
    if losses is not None:
        hf_loss = float(torch.nn.functional.cross_entropy(hf_logits.flatten(0, 1), _tokens()[:, 1:].flatten()))
        assert losses == pytest.approx([hf_loss] * len(losses), rel=ROUND_OFF)


def assert_imports_as_transformers(
    distributed, label: str, config: Config, folder: Path, tmp_path: Path, *, losses: bool = True, streamed: bool = True
) -> None:
    """``folder`` imported on ``config``'s layout (tests/models/test_hf_llama.py's worker): its logits, put
    back whole from every rank, and (with ``losses``) each rank's mean loss score as transformers' do, and
    the checkpoint saved right after the import exports the folder back."""
    from tests.models.test_hf_llama import _import_and_score, _whole_logits

    results = distributed.run(config.parallel.world_size, _import_and_score, config, folder, tmp_path)
    hf_logits = transformers_logits(folder)
    logits = _whole_logits([piece for _, piece in results], config.model.vocab_size)
    assert_scores_as_transformers(label, config, logits, [loss for loss, _ in results] if losses else None, hf_logits)
    assert_export_gives_the_folder_back(tmp_path, folder, config, hf_logits, streamed=streamed)


def assert_export_gives_the_folder_back(
    tmp_path: Path, folder: Path, config: Config, hf_logits: torch.Tensor, *, streamed: bool = True
) -> None:
    """The checkpoint in ``tmp_path`` (saved right after the import) exported: the folder's tensors bit
    for bit (a tied head, which transformers' files may hold too, is written once); with ``streamed``
    the same from ``polyshard export --format hf``'s path, one tensor at a time; and the consolidated
    state in a one-process model scores as transformers does."""
    from polyshard.models import build_model
    from polyshard.trainer.checkpointing.run_export import consolidate

    step = next(tmp_path.glob("step_*"))
    state = consolidate(step)
    original = load_file(folder / "model.safetensors")
    exported = hf_state(state, config.model)
    assert exported.keys() == original.keys() - ({"lm_head.weight"} if config.model.tie_embeddings else set())
    for key, tensor in exported.items():
        assert torch.equal(tensor, original[key]), key
    if streamed:
        written = load_file(write_hf(Checkpoint(step), config.model, tmp_path / "streamed") / "model.safetensors")
        assert written.keys() == exported.keys() and all(torch.equal(written[k], exported[k]) for k in written)
    model = build_model(config.model)
    model.load_state_dict(state, strict=True)
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(_tokens()[:, :-1]), hf_logits, rtol=ROUND_OFF, atol=ROUND_OFF)
