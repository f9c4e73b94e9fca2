"""The GPT family: GPT-2's and Llama's architectures on one decoder-only transformer (:mod:`.model`),
with the Hugging Face adapters for each (:mod:`.gpt2`, :mod:`.llama`)."""

from polyshard.trainer.models.gpt.model import GPT, SPEC, Embedding, LMHead

__all__ = ["GPT", "SPEC", "Embedding", "LMHead"]
