"""Faster linear layers for decoding on a CPU, used inside `target_generate` and `speculative_generate` only.

A decode step multiplies every weight matrix of a model by 1 to k + 1 rows, so it streams all the weights
from memory once per step. torch's `F.linear` (x @ W^T) does that on a CPU at a fraction of memory bandwidth;
the same product written W @ x^T runs near it, the output head gaining most. One row takes the slow GEMV
path either way, so a single row is computed as two. With every linear layer on this path a decode step gets
cheaper and a verification of a few tokens cheaper still in units of that step, which is what speculation
needs (`bench/costs.py` times both, `bench/decode.py` the gain with the path off and on). Past a handful of rows
(prefill, data generation at batch 64) `F.linear` is as fast or faster again, so the fast path stops at
MAX_ROWS (MAX_HEAD_ROWS for the much larger output head).

Some small odd row counts take a slower kernel than the next even one, so they are computed padded to it
(PAD_ROWS): 3 and 7 rows as 4 and 8, which made a verification of 3 tokens (k = 2) cheaper while the other
verification lengths did not move beyond the machine's noise. The development machines' timings behind these
choices, taken before figures were kept with their provenance, are in docs/results/history.md.

The patch is scoped: each layer's `forward` is replaced on entry and restored on exit, only for plain
`nn.Linear` layers on the CPU in float32 / float64 that nobody else has patched (accelerate hooks, a user's
wrapper); everything else runs unchanged. Each output is the same dot product as before, only accumulated by
another kernel, so values may differ in the last bits, as they already do between a one-token decode step
and a k + 1 token verification; both decoders use the same layers, so greedy exactness is unaffected (the
eval's equivalence check verifies it on every run).
"""

from __future__ import annotations

import contextlib
import os
import types

import torch

_DTYPES = (torch.float32, torch.float64)
MAX_ROWS = 8  # measured: beyond 8 rows F.linear wins on some layer shapes of the development CPU
MAX_HEAD_ROWS = 16  # the output head keeps its gain up to 16 rows; F.linear wins again by 64
PAD_ROWS = {1: 2, 3: 4, 7: 8}  # row counts computed as the next even one (see above); others as they are
ENABLED = True  # bench/decode.py turns it off to attribute the gain; SPECDEC_FAST_LINEAR=0 does too


def linear_forward(self: torch.nn.Linear, x: torch.Tensor, max_rows: int = MAX_ROWS) -> torch.Tensor:
    """`self(x)` computed as (W @ x^T)^T, rows padded as PAD_ROWS says; F.linear beyond max_rows rows.
    [..., in] -> [..., out]"""
    flat = x.reshape(-1, x.shape[-1])
    rows = flat.shape[0]
    if rows > max_rows:
        return torch.nn.functional.linear(x, self.weight, self.bias)
    padded = PAD_ROWS.get(rows, rows)
    if padded > rows:
        flat = torch.cat([flat, flat[-1:].expand(padded - rows, -1)])
    out = torch.matmul(self.weight, flat.T).T[:rows]
    if self.bias is not None:
        out = out + self.bias
    return out.contiguous().reshape(*x.shape[:-1], self.weight.shape[0])


def _eligible(layer) -> bool:
    return (type(layer) is torch.nn.Linear and "forward" not in layer.__dict__
            and layer.weight.device.type == "cpu" and layer.weight.dtype in _DTYPES)


def _patch(layer: torch.nn.Linear, max_rows: int) -> None:
    def forward(self, x):  # looks `linear_forward` up at call time, so tests can wrap it
        return linear_forward(self, x, max_rows)

    layer.forward = types.MethodType(forward, layer)


@contextlib.contextmanager
def fast_linears(*models):
    """Within the block, the CPU linear layers of `models` use `linear_forward`; restored afterwards."""
    patched = []
    if not ENABLED or os.environ.get("SPECDEC_FAST_LINEAR", "1") == "0":
        models = ()
    for model in models:
        if model is None:
            continue
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        for layer in model.modules():
            if _eligible(layer):  # a model passed twice (draft == target) is patched once
                _patch(layer, MAX_HEAD_ROWS if layer is head else MAX_ROWS)
                patched.append(layer)
    try:
        yield
    finally:
        for layer in patched:
            del layer.forward
