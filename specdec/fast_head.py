"""A faster LM head for decoding on a CPU, used inside `target_generate` and `speculative_generate` only.

The head is the largest matrix of a small model (SmolLM2-135M: 49,152 x 576, a third of its weights) and a
decode step multiplies it by 1 to k + 1 rows. torch's `F.linear` (x @ W^T) does that on a CPU at a fraction
of memory bandwidth: on the 2-core Zen 4 CPU this project is developed on, the SmolLM2 head took 9.7 ms for
one row, 22.5 ms for two, 33.8 ms for three and 16.8 ms for five, while the same product written W @ x^T
took 3.3 ms for two rows, 4.1 ms for three and 5.0 ms for five. One row is the slow GEMV path either way,
so a single row is computed as two. From a few dozen rows on (prefill of a batch, data generation at batch
64: 33 ms vs 52 ms) `F.linear` is the faster one again, so the fast path stops at MAX_ROWS.

The patch is scoped: the head's `forward` is replaced on entry and restored on exit, only for a plain
`nn.Linear` head on the CPU in float32 / float64 that nobody else has patched (accelerate hooks, a user's
wrapper); everything else runs unchanged. Each logit is the same dot product as before, only accumulated by
another kernel, so values may differ in the last bits, as they already do between a one-token decode step
and a k + 1 token verification; both decoders use the same head, so greedy exactness is unaffected.
"""

from __future__ import annotations

import contextlib
import os
import types

import torch

_DTYPES = (torch.float32, torch.float64)
MAX_ROWS = 16  # measured crossover between 16 and 64 rows on the development CPU
ENABLED = True  # bench/decode.py turns it off to attribute the gain; SPECDEC_FAST_HEAD=0 does too


def head_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`self(x)` computed as (W @ x^T)^T, one row padded to two; F.linear beyond MAX_ROWS rows.  [..., in] -> [..., out]"""
    flat = x.reshape(-1, x.shape[-1])
    rows = flat.shape[0]
    if rows > MAX_ROWS:
        return torch.nn.functional.linear(x, self.weight, self.bias)
    if rows == 1:
        flat = torch.cat([flat, flat])
    out = torch.matmul(self.weight, flat.T).T[:rows]
    if self.bias is not None:
        out = out + self.bias
    return out.contiguous().reshape(*x.shape[:-1], self.weight.shape[0])


def _eligible(head) -> bool:
    return (type(head) is torch.nn.Linear and "forward" not in head.__dict__
            and head.weight.device.type == "cpu" and head.weight.dtype in _DTYPES)


@contextlib.contextmanager
def fast_heads(*models):
    """Within the block, the CPU heads of `models` use `head_forward`; restored afterwards."""
    patched = []
    if not ENABLED or os.environ.get("SPECDEC_FAST_HEAD", "1") == "0":
        models = ()
    for model in models:
        head = model.get_output_embeddings() if model is not None and hasattr(model, "get_output_embeddings") else None
        if head is not None and _eligible(head):
            head.forward = types.MethodType(head_forward, head)
            patched.append(head)
    try:
        yield
    finally:
        for head in patched:
            del head.forward
