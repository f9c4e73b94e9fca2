"""A tiny random Llama in Hugging Face's format, saved to a folder: it stands in for a model you would
download (`hf download meta-llama/...`) in the guides' commands, so they run on a fresh machine offline.

    python examples/tiny_hf_llama.py llama-hf      # config.json + model.safetensors, ~0.1M parameters

Its vocabulary is the byte tokenizer's 256 ids (data.tokenizer = "bytes"); a real model brings its own
tokenizer.json, which data.tokenizer then names.
"""

import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def main(folder: str) -> None:
    config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder)
    print(f"a tiny random Llama ({sum(p.numel() for p in model.parameters()):,} parameters) in {folder}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "llama-hf")
