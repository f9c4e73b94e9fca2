"""Generation tokens/s on one process: polyshard's :func:`polyshard.trainer.loop.generation.generate` (the
training engine, a KV cache) against ``transformers``' ``model.generate`` (its own KV cache) on the same tiny
random Llama, built with transformers and imported through polyshard's Hugging Face import.

    .venv/bin/python apps/bench_generation.py                       # 8 samples x 64 new tokens, 1 thread
    .venv/bin/python apps/bench_generation.py --hidden 256 --layers 4 --samples 16 --threads 2

Both draw ``samples`` completions of one ``prompt``-token prompt, every completion ``new`` tokens long (no
stop ids; transformers with ``min_new_tokens`` so neither stops early), sampling at temperature 1 with no
top-k or top-p cut. Each is run once to warm up, then ``repeats`` times; the table gives the best run
(the least disturbed by other work on the machine) and the median. Greedy decoding is run once by both
first, as a check that the two models are the same: their tokens must agree.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from polyshard.mesh import Mesh, init_distributed
from polyshard.trainer.checkpointing.hugging_face import HFSource, model_settings
from polyshard.trainer.checkpointing.run_reshard import load_into
from polyshard.trainer.config import from_dict
from polyshard.trainer.engine.builder import build_engine
from polyshard.trainer.loop.generation import Sampling, generate


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=64, help="hidden size (heads of 16 dims)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--samples", type=int, default=8, help="completions of the prompt, drawn together")
    parser.add_argument("--new", type=int, default=64, help="new tokens per completion")
    parser.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a training rank's share of cores)")
    return parser.parse_args()


def _timed(run: Callable[[], object], repeats: int) -> list[float]:
    run()  # warm-up: first-call allocations and kernel choices
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - start)
    return seconds


def main() -> None:
    args = _arguments()
    torch.set_num_threads(args.threads)
    heads = max(1, args.hidden // 16)
    hf_config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
        num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
        max_position_embeddings=max(512, args.prompt + args.new), tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    hf_model = LlamaForCausalLM(hf_config).eval()
    folder = tempfile.mkdtemp(prefix="bench-generation-")
    hf_model.save_pretrained(folder)

    init_distributed(backend="gloo", store=dist.HashStore(), rank=0, world_size=1)
    config = from_dict({"model": model_settings(folder), "training": {"seed": 0}})
    engine = build_engine(config, Mesh(config.parallel.mesh_axes))
    load_into(engine, HFSource(folder, config), weights_only=True)

    prompt = torch.randint(0, args.vocab, (args.prompt,), generator=torch.Generator().manual_seed(1)).tolist()
    rows = torch.tensor([prompt] * args.samples)

    def ours(temperature: float) -> list[list[int]]:
        sampling = Sampling(max_new_tokens=args.new, temperature=temperature)
        return generate(engine, [prompt], args.samples, sampling, seed=0, first_row=0)

    def theirs(sample: bool) -> torch.Tensor:
        with torch.no_grad():
            out = hf_model.generate(
                rows, max_new_tokens=args.new, min_new_tokens=args.new, do_sample=sample, temperature=1.0,
                top_k=0, top_p=1.0, use_cache=True, pad_token_id=0, attention_mask=torch.ones_like(rows),
            )  # fmt: skip
        return out[:, len(prompt) :]

    greedy_agrees = ours(0.0) == theirs(False).tolist()
    tokens = args.samples * args.new
    results = {
        "polyshard generate (engine, KV cache)": _timed(lambda: ours(1.0), args.repeats),
        "transformers model.generate (KV cache)": _timed(lambda: theirs(True), args.repeats),
    }
    print(
        f"tiny random Llama: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}; {args.samples} samples x "
        f"{args.new} new tokens after a {args.prompt}-token prompt; {args.threads} thread(s); best and median of "
        f"{args.repeats}; greedy tokens agree: {greedy_agrees}"
    )
    print(f"{'implementation':<42} {'tokens/s (best)':>16} {'tokens/s (median)':>18} {'ms/step (best)':>15}")
    for name, seconds in results.items():
        best, median = min(seconds), statistics.median(seconds)
        print(f"{name:<42} {tokens / best:>16.0f} {tokens / median:>18.0f} {1000 * best / args.new:>15.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
