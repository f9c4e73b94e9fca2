"""Attention on one (query chunk, key chunk) block in float32, which blocks to compute, and how
partial results merge.

Shapes, in the grouped-query layout every kernel here works in:

    B batch, K key/value heads, G query heads per key/value head (N = K * G query heads),
    Q query rows, T key rows, D query/key head dim, E value head dim
    q: (B, K, G, Q, D)   k: (B, K, 1, T, D)   v: (B, K, 1, T, E)
    out: (B, K, G, Q, E) lse: (B, K, G, Q)

Query head h uses key/value head h // G, as ``scaled_dot_product_attention(enable_gqa=True)`` does;
the size-1 dim broadcasts K and V over the G query heads without copying them.

Two kernels compute a block. The reference is plain matmul + softmax maths in float32: clear, exact to
float32 round-off, and it returns the log-sum-exp that merging needs (``scaled_dot_product_attention``
does not return it through a public API) and takes any mask. On a CPU a block with no mask of its own
(a full block, or a diagonal one: the causal triangle) runs ATen's fused flash-attention kernel instead
(:func:`fused_available`), whose forward returns lse too and whose backward takes the final out and lse:
4-8x faster on a 2,048-token block, the same numbers to float32 round-off (a blocked softmax sums in
another order). CUDA's fused kernels take no float32, so a GPU runs the reference.

Merging (the online softmax, Milakov and Gimelshein 1805.02867): a block's output is softmax-
weighted over its own keys only. Two partial results (o1, l1), (o2, l2) over disjoint key sets
combine as ``l = log(exp(l1) + exp(l2))``, ``o = o1 exp(l1 - l) + o2 exp(l2 - l)``, which is the
attention over the union of the key sets.

Masked blocks (documents, windows: ``hidden``, which :func:`polyshard.cp.blocksparse.block_hidden` gives
and whose planning skips the blocks it would hide entirely): a query row a block hides entirely gets
lse = -inf and a zero output there, which the merge then weighs by exp(-inf) = 0: it adds nothing and
no NaN appears (every query sees at least itself, so its final lse is finite).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from polyshard.cp.sharding import rank_chunks


class Block(NamedTuple):
    """One block to compute: query rows and key rows (local slices) and whether it is diagonal
    (query chunk = key chunk, so key j is visible to query i only when j <= i). ``offset``: the global
    position of the block's first query minus that of its first key (a sliding window needs it)."""

    rows: slice
    cols: slice
    diagonal: bool
    offset: int = 0


def plan_blocks(
    query_rank: int, kv_rank: int, cp: int, chunk: int, causal: bool, window: int | None = None
) -> list[Block]:
    """The blocks ``query_rank`` computes against the keys ``kv_rank`` holds, both laid out by
    :func:`polyshard.cp.sharding.shard_sequence` with chunks of ``chunk`` tokens.

    Causal: for query chunk i and key chunk j, i > j is a full block, i == j a diagonal block, and
    i < j is entirely masked and left out (no work, not a masked matmul). Non-causal: one block of
    all local queries against all of ``kv_rank``'s keys. ``window`` (causal only): a block whose keys
    all lie ``window`` or more tokens before its first query is left out too.
    """
    if not causal:
        return [Block(slice(None), slice(None), False)]
    blocks = []
    for q_half, i in enumerate(rank_chunks(query_rank, cp)):
        for k_half, j in enumerate(rank_chunks(kv_rank, cp)):
            if i >= j and not sees_nothing(i * chunk, (j + 1) * chunk - 1, window):
                rows = slice(q_half * chunk, (q_half + 1) * chunk)
                cols = slice(k_half * chunk, (k_half + 1) * chunk)
                blocks.append(Block(rows, cols, i == j, (i - j) * chunk))
    return blocks


def window_hidden(query_positions: torch.Tensor, key_positions: torch.Tensor, window: int) -> torch.Tensor:
    """(Q, T) bool: keys at least ``window`` positions before the query, which a sliding window of
    ``window`` tokens (the query itself and the ``window - 1`` before it, as Mistral, gpt-oss and
    Hugging Face's ``sliding_window`` define it) hides."""
    return query_positions.unsqueeze(-1) - key_positions.unsqueeze(-2) >= window


def sees_nothing(query_first: int, key_last: int, window: int | None) -> bool:
    """Whether a window hides a whole block: its last key lies ``window`` or more before its first query."""
    return window is not None and query_first - key_last >= window


def add_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> None:
    """Fold per-head attention sinks (gpt-oss) into a finished (out, lse) in place: each head's learned
    logit joins every softmax denominator and adds no value, i.e. a merge with a block whose lse is the
    sink and whose output is 0. ``sinks`` (N,) float32, N = K * G; out (B, K, G, Q, E), lse (B, K, G, Q)."""
    sink = sinks.reshape(lse.shape[1], lse.shape[2], 1)  # (K, G, 1): broadcast over B and Q
    merged = torch.logaddexp(lse, sink)
    out.mul_(torch.exp(lse - merged).unsqueeze(-1))
    lse.copy_(merged)


def sink_gradient(sinks: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """d loss / d sinks, (N,) float32, from the final lse (sinks included) and delta = rowsum(dO * O):
    a sink's probability p = exp(sink - lse) scales every output by 1 - p, so d out / d sink = -p out and
    the gradient is -sum over rows of p * delta (B and Q summed; only this process's query rows)."""
    sink = sinks.reshape(lse.shape[1], lse.shape[2], 1)
    return -(torch.exp(sink - lse) * delta).sum(dim=(0, 3)).reshape(-1)


def _scores(
    q: torch.Tensor, k: torch.Tensor, scale: float, diagonal: bool, hidden: torch.Tensor | None = None
) -> torch.Tensor:
    scores = (q @ k.transpose(-1, -2)) * scale  # (B, K, G, Q, D) @ (B, K, 1, D, T) -> (B, K, G, Q, T)
    if hidden is not None:  # a block's mask: the causal triangle, window and documents are in it already
        return scores.masked_fill(hidden, float("-inf"))
    if diagonal:
        scores = scores.masked_fill(_above_diagonal(scores), float("-inf"))
    return scores


def _above_diagonal(scores: torch.Tensor) -> torch.Tensor:
    """(Q, T) bool: the keys after each query of a diagonal block."""
    return torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).triu(1)


def _diagonal_exp(scores: torch.Tensor, shift: torch.Tensor, above: torch.Tensor) -> torch.Tensor:
    """``exp(scores - shift)`` with the keys ``above`` the diagonal set to 0: what ``exp`` of the
    -inf-masked scores gives, exactly, without ``exp`` of -inf, which this machine's CPU kernel runs
    ~10x slower than of a finite number (a diagonal block's forward and backward took 2.7x a full
    block's; ``polyshard.bench.pprof``). A hidden key's finite ``scores - shift`` may overflow to inf;
    masked_fill (not a product) still makes it 0."""
    return torch.exp(scores - shift).masked_fill_(above, 0.0)


def fused_available(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hidden: torch.Tensor | None) -> bool:
    """Whether ATen's CPU flash-attention kernel can compute this block: on a CPU, float32, no mask of its
    own (the causal triangle it has), and one head dim for keys and values (the kernel's contract)."""
    return hidden is None and q.device.type == "cpu" and q.dtype == torch.float32 and k.shape[-1] == v.shape[-1]


def _flat(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The grouped layout as the fused kernel takes it: (B, N, Q, D) queries and the key/value heads
    repeated over their G query heads, (B, N, T, D)."""
    b, heads, group, queries, _ = q.shape
    keys = k.shape[-2]
    return (
        q.reshape(b, heads * group, queries, q.shape[-1]),
        k.expand(b, heads, group, keys, k.shape[-1]).reshape(b, heads * group, keys, k.shape[-1]),
        v.expand(b, heads, group, keys, v.shape[-1]).reshape(b, heads * group, keys, v.shape[-1]),
    )


def _fused_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, diagonal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    qf, kf, vf = _flat(q, k, v)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qf, kf, vf, 0.0, diagonal, scale=scale)
    return out.reshape(q.shape[:-1] + (v.shape[-1],)), lse.reshape(q.shape[:-1])


def _fused_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    diagonal: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    qf, kf, vf = _flat(q, k, v)
    b, heads, group, queries, _ = q.shape
    flat_rows = (b, heads * group, queries)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout.reshape(flat_rows + (dout.shape[-1],)),
        qf,
        kf,
        vf,
        out.reshape(flat_rows + (out.shape[-1],)),
        lse.reshape(flat_rows),
        0.0,
        diagonal,
        scale=scale,
    )
    keys = k.shape[-2]
    dk = dk.reshape(b, heads, group, keys, k.shape[-1]).sum(dim=2, keepdim=True)  # summed over the G query heads
    dv = dv.reshape(b, heads, group, keys, v.shape[-1]).sum(dim=2, keepdim=True)
    return dq.reshape(q.shape), dk, dv


def block_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    diagonal: bool,
    hidden: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of float32 ``q`` over one block's keys: (out, lse), both float32. ``hidden``: the
    block's mask (:func:`polyshard.cp.blocksparse.block_hidden`); a row it hides entirely gets out 0 and lse -inf."""
    if fused_available(q, k, v, hidden):
        return _fused_forward(q, k, v, scale, diagonal)
    if diagonal and hidden is None:
        # torch.logsumexp's own steps (row max, sum of exp of the scores less it, log, plus it), with the
        # keys above the diagonal left out of the max and zeroed after exp: the same numbers, bit for bit
        scores = _scores(q, k, scale, False)
        above = _above_diagonal(scores)
        peak = scores.masked_fill(above, float("-inf")).amax(dim=-1, keepdim=True)  # finite: each row sees a key
        lse = _diagonal_exp(scores, peak, above).sum(dim=-1).log_().add_(peak.squeeze(-1))
        return _diagonal_exp(scores, lse.unsqueeze(-1), above) @ v, lse
    scores = _scores(q, k, scale, diagonal, hidden)
    lse = torch.logsumexp(scores, dim=-1)  # (B, K, G, Q); finite without a mask: every row sees a key
    if hidden is not None:  # a fully hidden row: exp(-inf - 0) = 0 rather than exp(-inf + inf) = NaN
        probs = torch.exp(scores - lse.masked_fill(lse.isneginf(), 0.0).unsqueeze(-1))
        return probs @ v, lse
    probs = torch.exp(scores - lse.unsqueeze(-1))
    return probs @ v, lse  # (B, K, G, Q, T) @ (B, K, 1, T, E) -> (B, K, G, Q, E)


def block_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    scale: float,
    diagonal: bool,
    hidden: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one block (FlashAttention's backward, Dao et al. 2205.14135, appendix B).

    ``lse`` is the log-sum-exp of each query row over *all* its keys (from the forward), so the
    recomputed ``probs`` are the final attention weights restricted to this block; ``delta`` is
    ``rowsum(dout * out)`` of the final output. Returns dq (B, K, G, Q, D) and dk, dv summed over
    the G query heads that share each key/value head: (B, K, 1, T, D), (B, K, 1, T, E). ``hidden``: the
    block's mask, as in the forward (the final lse is finite, so hidden keys get probability 0).
    ``out``: the final output's rows, which the fused kernel takes in place of ``delta`` (it forms
    rowsum(dout * out) itself); without it the reference kernel runs.
    """
    if out is not None and fused_available(q, k, v, hidden):
        return _fused_backward(q, k, v, dout, out, lse, scale, diagonal)
    if diagonal and hidden is None:
        scores = _scores(q, k, scale, False)
        probs = _diagonal_exp(scores, lse.unsqueeze(-1), _above_diagonal(scores))  # (B, K, G, Q, T)
    else:
        probs = torch.exp(_scores(q, k, scale, diagonal, hidden) - lse.unsqueeze(-1))  # (B, K, G, Q, T)
    dv = (probs.transpose(-1, -2) @ dout).sum(dim=2, keepdim=True)  # (B, K, G, T, Q) @ (.., Q, E)
    dprobs = dout @ v.transpose(-1, -2)  # (B, K, G, Q, E) @ (B, K, 1, E, T) -> (B, K, G, Q, T)
    dscores = probs * (dprobs - delta.unsqueeze(-1))  # softmax backward, row by row
    dq = (dscores @ k) * scale  # (B, K, G, Q, T) @ (B, K, 1, T, D)
    dk = (dscores.transpose(-1, -2) @ q).sum(dim=2, keepdim=True) * scale  # (.., T, Q) @ (.., Q, D)
    return dq, dk, dv


def merge_into(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor, masked: bool = False
) -> None:
    """Fold one block's (out, lse) into the running (out, lse) in place (views of the accumulators
    are fine). The running lse starts at -inf and out at 0, so the first merge copies the block.
    ``masked``: rows may have seen no key yet on either side (a document mask); they stay 0 and -inf."""
    merged = torch.logaddexp(lse, block_lse)
    if masked:  # both -inf: weigh both sides exp(-inf - 0) = 0, not exp(-inf + inf) = NaN
        safe = merged.masked_fill(merged.isneginf(), 0.0)
        out.mul_(torch.exp(lse - safe).unsqueeze(-1)).add_(block_out * torch.exp(block_lse - safe).unsqueeze(-1))
        lse.copy_(merged)
        return
    out.mul_(torch.exp(lse - merged).unsqueeze(-1)).add_(block_out * torch.exp(block_lse - merged).unsqueeze(-1))
    lse.copy_(merged)


def grouped_query(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(B, N, S, D) -> (B, K, G, S, D): query head h = k * G + g goes to key/value head k."""
    b, n, s, d = x.shape
    return x.reshape(b, kv_heads, n // kv_heads, s, d)


def grouped_kv(x: torch.Tensor) -> torch.Tensor:
    """(B, K, S, D) -> (B, K, 1, S, D): one key/value head broadcast over its G query heads."""
    return x.unsqueeze(2)


def ungrouped(x: torch.Tensor) -> torch.Tensor:
    """(B, K, G, S, E) -> (B, N, S, E)."""
    b, k, g, s, e = x.shape
    return x.reshape(b, k * g, s, e)
