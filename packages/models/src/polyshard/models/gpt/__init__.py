"""The GPT family: GPT-2's and Llama's architectures on one decoder-only transformer (:mod:`.model`),
with the Hugging Face adapters for each (:mod:`.hf_gpt2`, :mod:`.hf_llama`, :mod:`.hf_qwen2`, :mod:`.hf_qwen3`)."""

from polyshard.models.gpt.model import GPT, SPEC, Embedding, LMHead

__all__ = ["GPT", "SPEC", "Embedding", "LMHead"]
