"""Peak memory of the language-model loss: the whole logits against training.loss_chunks.

The loss of N tokens over a V-word vocabulary, from (N, H) hidden states and the (V, H) head, forward and
backward, as the trainer computes it: F.linear then cross-entropy in float32 (chunks = 0), or
:func:`polyshard.tp.chunked_linear_cross_entropy` (chunks > 1). Each variant runs in its own process and
reports how far the loss raised the process's peak resident memory above what it held before (the
inputs; the gradients of the hidden states and of the head are in every variant's figure alike).

    python -m polyshard.bench.loss_memory                          # N 2048, H 512, V 128256 (Llama 3's)
    python -m polyshard.bench.loss_memory --tokens 8192 --chunks 0 8 32

Memory, not time, is the point: one run at a modest token count is enough, on a busy machine too.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys

MIB = 1 << 20


def measure(tokens: int, hidden_size: int, vocab: int, chunks: int) -> dict[str, float]:
    """In this process: the loss's forward and backward, and the peak resident memory it added."""
    import torch
    import torch.nn.functional as F

    from polyshard.tp import chunked_linear_cross_entropy

    torch.manual_seed(0)
    hidden = torch.randn(tokens, hidden_size, requires_grad=True)
    weight = (torch.randn(vocab, hidden_size) * hidden_size**-0.5).requires_grad_()
    target = torch.randint(0, vocab, (tokens,))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    if chunks <= 1:
        loss = F.cross_entropy(F.linear(hidden, weight).float(), target, reduction="sum")
    else:
        loss = chunked_linear_cross_entropy(hidden, weight, target, None, chunks=chunks)
    loss.backward()
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"chunks": chunks, "loss": float(loss.detach()) / tokens, "peak_mib": (after - before) / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--chunks", type=int, nargs="+", default=[0, 4, 16])
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a child process: measure these chunks
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(measure(args.tokens, args.hidden, args.vocab, args.one)))
        return
    logits_mib = args.tokens * args.vocab * 4 / MIB
    print(f"N={args.tokens} tokens, H={args.hidden}, V={args.vocab}: one float32 copy of the logits = "
          f"{logits_mib:.0f} MiB")  # fmt: skip
    print("chunks  peak added by the loss  / logits copy   loss per token")
    for chunks in args.chunks:
        child = [sys.executable, "-m", "polyshard.bench.loss_memory", "--tokens", str(args.tokens),
                 "--hidden", str(args.hidden), "--vocab", str(args.vocab), "--one", str(chunks)]  # fmt: skip
        result = json.loads(subprocess.run(child, check=True, capture_output=True, text=True).stdout)
        print(f"{chunks:6d}  {result['peak_mib']:12.0f} MiB        {result['peak_mib'] / logits_mib:6.2f}x"
              f"        {result['loss']:.4f}")  # fmt: skip


if __name__ == "__main__":
    main()
