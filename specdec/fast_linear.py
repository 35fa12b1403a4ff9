"""Faster linear layers for decoding on a CPU, used inside `target_generate` and `speculative_generate` only.

A decode step multiplies every weight matrix of a model by 1 to k + 1 rows, so it streams all the weights
from memory once per step. torch's `F.linear` (x @ W^T) does that on a CPU at a fraction of memory bandwidth;
the same product written W @ x^T runs near it. Measured on the 2-core Zen 4 CPU this project is developed on,
each matrix cold in cache (microseconds per matrix, `F.linear` / W @ x^T):

    rows                          1          2          4          8
    SmolLM2 MLP up, 1536 x 576    302 / 301  451 / 110  376 / 129  335 / 231
    SmolLM2 MLP down, 576 x 1536  212 / 212  314 / 106  324 / 238  350 / 349
    SmolLM2 head, 49152 x 576     9.9 / 9.9 ms at 1 row; 21.7 / 3.1 ms at 2; 15.9 / 4.1 ms at 4

One row takes the slow GEMV path either way, so a single row is computed as two. A SmolLM2-135M decode step
took 29-32 ms with every linear layer on this path, 47-48 ms with the head alone and 55 ms with neither; a
verification of 2 / 4 tokens then cost 1.0-1.14 / 1.28-1.44 single steps, against 1.44-1.49 / 1.41-1.52 with
the head alone (`bench/costs.py`). Past a handful of rows (prefill, data generation at batch 64) `F.linear` is
as fast or faster again, so the fast path stops at MAX_ROWS (MAX_HEAD_ROWS for the much larger output head).

Some small odd row counts take a slower kernel than the next even one, so they are computed padded to it
(PAD_ROWS). On a 2-core AVX2 EPYC, each matrix cold in cache, W @ x^T in microseconds by rows:

    rows                          1      2      3      4      5      6      7      8
    SmolLM2 MLP up, 1536 x 576    317    246    341    262    351    452    586    593
    SmolLM2 MLP down, 576 x 1536  247    264    388    287    383    464    526    456
    SmolLM2 head, 49152 x 576     10287  7262   10724  7492   10205  13475  16423  13700

so 3 and 7 rows are computed as 4 and 8. On that CPU a verification of 3 tokens (k = 2) went from 1.31 and 1.31
target steps to 1.16 and 1.07 (eval's measure_costs, two runs of each, interleaved); v(2), v(4) and v(5) did not
move beyond the machine's noise.
The DESIGN notes' machine showed the same for 3 against 4 tokens (115 against 88 ms a step with `F.linear`).

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
MAX_HEAD_ROWS = 16  # the output head keeps its 3x gain up to 16 rows; F.linear wins again by 64
PAD_ROWS = {1: 2, 3: 4, 7: 8}  # row counts computed as the next even one (measured above); others as they are
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
