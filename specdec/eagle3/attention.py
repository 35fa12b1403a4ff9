"""The attention of EAGLE-3's unrolled training-time test (`Eagle3Draft.unrolled`), exact, in memory linear in n.

Step j (1-based) of the test at draft position t attends, in one softmax, to

    step 1's keys at positions s <= t - (j - 1) that are real tokens (`valid`), and
    for i = 2..j, the single key of step i at position t - (j - i), where t >= j - i (the round's own proposals),

and, with `document_ids` (packed rows), only to keys of t's own document. Computed densely, each step makes
[B, heads, n, n] float32 scores and autograd keeps them, and their softmax, until backward: quadratic in n.

Here the queries go in chunks of C positions. A chunk [start, stop) can only reach step 1's keys before
stop - (j - 1), so it scores those and its j - 1 diagonal keys, takes the float32 softmax over each whole row and
weights the values. This is the dense computation, not an approximation: every query's softmax still spans every
key the dense mask allows, and the keys a chunk leaves out are ones the dense mask gives weight exactly zero
(exp(finfo.min - max) underflows to 0 in float32). Only the blocking of rows changes, so the results agree to the
last bits of float rounding. Each chunk runs under activation checkpointing: autograd keeps nothing of it but its
inputs (alive anyway) and backward recomputes one chunk's scores at a time. Memory is then O(n) kept for backward
plus one chunk's O(C n) block in flight, instead of O(n^2) per step. It is FlashAttention's recompute-in-backward
without its online softmax: a chunk holds whole rows, so a plain softmax stays exact.

Step 1 over right-padded rows without documents is plain causal attention at every real query; there (and only
there) torch's fused kernel computes it instead, which keeps O(n) for backward as well.

GQA: a key head's rep = heads / kv_heads query heads are scored against it in one matmul, so keys and values are
never repeated. A query with no allowed key (step 1, a row with no real token, or a padding position whose
document holds no real key) gets uniform weights over its chunk's keys (the dense computation spread them over
all n): finite either way, and masked later by the loss.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

# The float32 score elements one chunk may hold ([B, heads, C, keys], 512 MiB); the softmax makes a few such blocks.
SCORE_BUDGET = 1 << 27
MAX_CHUNK = 256  # queries per chunk: enough to keep the matmuls efficient, small enough to keep the block small
MIN_CHUNK = 32  # below this, per-chunk overhead dominates; a larger block is the lesser cost
MASKED = torch.finfo(torch.float32).min  # not -inf: a row with no allowed key stays finite


def chunk_size(batch: int, heads: int, n: int) -> int:
    """Queries per chunk: MAX_CHUNK unless the chunk's float32 scores [B, heads, C, n] would exceed SCORE_BUDGET."""
    return max(MIN_CHUNK, min(MAX_CHUNK, SCORE_BUDGET // max(1, batch * heads * n)))


def unrolled_attention(q: torch.Tensor, first_keys: torch.Tensor, first_values: torch.Tensor,
                       diagonal_keys: list[torch.Tensor], diagonal_values: list[torch.Tensor], valid: torch.Tensor,
                       document_ids: torch.Tensor | None = None, chunk: int | None = None) -> torch.Tensor:
    """Step j = len(diagonal_keys) + 1 of the unrolled test (module docstring).  -> [B, heads, n, d]

    q: [B, heads, n, d]; first_keys, first_values: step 1's, [B, kv_heads, n, d], rotary applied;
    diagonal_keys, diagonal_values: steps 2..j's, in step order, each [B, kv_heads, n, d] at its own position
    (not shifted); valid: [B, n] bool, real tokens; document_ids: [B, n] (keys only of the query's document) or None;
    chunk: queries per chunk (None: `chunk_size`, or torch's fused causal kernel where step 1 over right-padded
    rows allows it; a given chunk always takes the chunked computation)."""
    assert len(diagonal_keys) == len(diagonal_values) and q.shape[1] % first_keys.shape[1] == 0
    if chunk is None and not diagonal_keys and document_ids is None and _right_padded(valid):
        # Step 1 over right-padded rows is causal attention: a real query's keys at or before it are all real.
        # torch's fused kernel (flash attention on a CPU, O(n) kept for backward as here) computes it without the
        # [C, n] blocks (docs/results/2026-12-07-attention-step-one.md). Padding queries then read padding keys
        # too, where the dense mask lets them read only real ones: outputs no loss or later step reads.
        return F.scaled_dot_product_attention(q, first_keys, first_values, is_causal=True, enable_gqa=True)
    # Copies: backward recomputes each chunk from these arguments, after the caller may have grown its lists.
    diagonal_keys, diagonal_values = tuple(diagonal_keys), tuple(diagonal_values)
    b, heads, n, _ = q.shape
    step = min(chunk or chunk_size(b, heads, n), n) if n else 1
    tensors = (q, first_keys, first_values, *diagonal_keys, *diagonal_values)
    remember = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    parts = []
    for start in range(0, n, step):
        args = (q, first_keys, first_values, diagonal_keys, diagonal_values, valid, document_ids,
                start, min(start + step, n))
        # Without grad there is nothing to keep, and checkpoint would only add its bookkeeping.
        # No RNG runs inside, so the recompute needs no saved RNG state.
        parts.append(checkpoint(_chunk, *args, use_reentrant=False, preserve_rng_state=False)
                     if remember else _chunk(*args))
    return torch.cat(parts, dim=2) if parts else q.new_zeros(q.shape)


def _chunk(q, first_keys, first_values, diagonal_keys, diagonal_values, valid, document_ids, start: int,
           stop: int) -> torch.Tensor:
    """The attention of queries start..stop-1 (the arguments as `unrolled_attention`'s).  [B, heads, C, d]"""
    b, heads, _, d = q.shape
    kv, c = first_keys.shape[1], stop - start
    rep, lag = heads // kv, len(diagonal_keys)  # lag = j - 1: step 1's keys lie at least that far back
    reach = max(stop - lag, 0)  # step 1's keys [0, reach): the last query's farthest; later ones are never allowed
    scale = 1.0 / math.sqrt(d)
    queries = q[:, :, start:stop].reshape(b, kv, rep * c, d)  # a key head's queries, its rep heads stacked
    scores = (queries @ first_keys[:, :, :reach].transpose(-1, -2)) * scale  # [B, kv, rep C, R]
    scores = scores.float().view(b, kv, rep, c, reach)
    allowed = _first_allowed(valid, document_ids, start, stop, reach, lag)  # [B, C, R]
    scores = scores.masked_fill(~allowed[:, None, None], MASKED)
    queries = queries.view(b, kv, rep, c, d)
    columns, values = [scores], []
    for m, (key, value) in enumerate(zip(diagonal_keys, diagonal_values)):
        back = lag - 1 - m  # step m + 2's key sits `back` positions before its query
        key, value = _window(key, start - back, stop - back), _window(value, start - back, stop - back)  # [B, kv, C, d]
        score = ((queries * key[:, :, None]).sum(-1, keepdim=True) * scale).float()  # [B, kv, rep, C, 1]
        allowed = _diagonal_allowed(document_ids, start, stop, back, q.device)  # [B or 1, C]
        columns.append(score.masked_fill(~allowed[:, None, None, :, None], MASKED))
        values.append(value)
    weights = torch.cat(columns, dim=-1)  # [B, kv, rep, C, R + j - 1]
    del columns, scores  # freed now: at most two [C, R] blocks are alive at once, not three
    weights = torch.softmax(weights, dim=-1).to(q.dtype)
    out = (weights[..., :reach].reshape(b, kv, rep * c, reach) @ first_values[:, :, :reach]).view(b, kv, rep, c, d)
    for m, value in enumerate(values):
        out = out + weights[..., reach + m : reach + m + 1] * value[:, :, None]
    return out.reshape(b, heads, c, d)


def _right_padded(valid: torch.Tensor) -> bool:
    """Whether every row of `valid` [B, n] is its real tokens first, then padding only."""
    prefix = torch.arange(valid.shape[1], device=valid.device)[None] < valid.sum(dim=1, keepdim=True)
    return torch.equal(valid, prefix)


def _first_allowed(valid, document_ids, start: int, stop: int, reach: int, lag: int) -> torch.Tensor:
    """Which of step 1's keys 0..reach-1 each query start..stop-1 may read: causal by `lag`, real, same document.
    [B, C, R]"""
    query = torch.arange(start, stop, device=valid.device)[:, None]
    key = torch.arange(reach, device=valid.device)[None]
    allowed = (key <= query - lag)[None] & valid[:, None, :reach]
    if document_ids is not None:
        allowed = allowed & (document_ids[:, None, :reach] == document_ids[:, start:stop, None])
    return allowed


def _diagonal_allowed(document_ids, start: int, stop: int, back: int, device) -> torch.Tensor:
    """Whether the key `back` positions before each query start..stop-1 exists (and shares its document).
    [B, C], or [1, C] without documents"""
    exists = (torch.arange(start, stop, device=device) >= back)[None]
    if document_ids is None:
        return exists
    return exists & (_window(document_ids[:, None], start - back, stop - back)[:, 0] == document_ids[:, start:stop])


def _window(x: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """x at positions lo..hi-1 along dim 2, zeros before position 0 (lo may be negative).  [B, h, hi - lo, ...]"""
    inside = x[:, :, max(lo, 0) : max(hi, 0)]  # clamped: a negative bound would count from the end
    missing = (hi - lo) - inside.shape[2]
    if not missing:
        return inside
    pad = [0, 0] * (inside.dim() - 3) + [missing, 0]
    return F.pad(inside, pad)
