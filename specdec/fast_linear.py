"""Faster linear layers for decoding on a CPU, used inside `target_generate` and `speculative_generate` only.

A decode step multiplies every weight matrix of a model by 1 to k + 1 rows (more for a tree), so it streams all
the weights from memory once per step. Which kernel does that fastest for a handful of rows depends on the CPU
and its BLAS: on some machines torch's `F.linear` (x @ W^T) runs at a fraction of memory bandwidth there while
the same product written W @ x^T runs near it, and on others `F.linear` is the faster one. Some odd row counts
also take a slower kernel than the next even one (one row most of all), so computing them padded to it pays.
No one rule holds across machines (docs/results has both kinds), so the choice is measured, not assumed.

For each layer shape, dtype, row count and thread count first seen inside `fast_linears`, `_measure` times each
candidate (`F.linear`; W @ x^T over the rows; for odd counts W @ x^T padded by one row) as a sweep over every
patched layer of that shape, which streams the weights as a decode step does, and keeps the fastest. `F.linear`
stays unless another takes under MARGIN of its time, so noise cannot swap kernels for nothing. The choice is
kept for the process (`choices()` lists it; eval's report records it). Past MAX_ROWS rows (prefill, data
generation at batch 64) `F.linear` is used unmeasured. Measuring costs a few sweeps per new row count, a fraction
of a second for a small model: eval and the bench scripts pay it in their warm-up (`calibrate`), a lone decoder
call in its first steps.

The patch is scoped: each layer's `forward` is replaced on entry and restored on exit, only for plain
`nn.Linear` layers on the CPU in float32 / float64 that nobody else has patched (accelerate hooks, a user's
wrapper); everything else runs unchanged. Each output is the same dot product as before, only accumulated by
another kernel, so values may differ in the last bits, as they already do between a one-token decode step
and a k + 1 token verification; both decoders use the same layers and the same choices, so greedy exactness is
unaffected (the eval's equivalence check verifies it on every run). SPECDEC_FAST_LINEAR=0 turns the path off.
"""

from __future__ import annotations

import contextlib
import os
import time
import types
from collections import defaultdict
from collections.abc import Iterable

import torch

_DTYPES = (torch.float32, torch.float64)
MAX_ROWS = 16  # row counts measured; beyond them F.linear (prefill-sized products, where BLAS does well)
MARGIN = 0.95  # another kernel replaces F.linear only when it takes under this fraction of F.linear's time
REPEATS = 3  # timed sweeps per candidate; the fastest sweep counts (noise only ever adds time)
ENABLED = True  # bench/decode.py turns it off to attribute the gain; SPECDEC_FAST_LINEAR=0 does too
F_LINEAR = 0  # a plan: 0 is F.linear, n > 0 is W @ x^T over n rows (the real ones, padded up to n)

# (out features, in features, dtype, has bias, rows, threads) -> plan, measured once per process
_choices: dict[tuple, int] = {}


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.nn.functional.linear(x, weight, bias)  # one name, so tests can slow it down


def _matmul(weight: torch.Tensor, flat_t: torch.Tensor) -> torch.Tensor:
    return torch.matmul(weight, flat_t)


def linear_forward(self: torch.nn.Linear, x: torch.Tensor, plan: int = F_LINEAR) -> torch.Tensor:
    """`self(x)` computed as `plan` says: F.linear for 0, else (W @ x^T)^T over `plan` >= rows rows, the extra
    rows copies of the last. [..., in] -> [..., out]"""
    flat = x.reshape(-1, x.shape[-1])
    rows = flat.shape[0]
    if plan == F_LINEAR:
        return _linear(x, self.weight, self.bias)
    if plan > rows:
        flat = torch.cat([flat, flat[-1:].expand(plan - rows, -1)])
    out = _matmul(self.weight, flat.T).T[:rows]
    if self.bias is not None:
        out = out + self.bias
    return out.contiguous().reshape(*x.shape[:-1], self.weight.shape[0])


def _shape_key(layer: torch.nn.Linear) -> tuple:
    return (*layer.weight.shape, layer.weight.dtype, layer.bias is not None)


def _candidates(rows: int) -> list[int]:
    return [F_LINEAR, rows] + ([rows + 1] if rows % 2 else [])


def choose(times: dict[int, float]) -> int:
    """The plan to keep from the fastest time of each: F.linear unless another beats it by MARGIN."""
    best = min(times, key=times.get)
    return best if times[best] < MARGIN * times[F_LINEAR] else F_LINEAR


def _measure(layers: list[torch.nn.Linear], rows: int) -> int:
    """Time each candidate plan as a sweep over `layers` (one shape) at `rows` rows; the plan to use."""
    first = layers[0]
    # its own generator: measuring must not move the global RNG that a sampling decoder's seed drives
    x = torch.randn(rows, first.in_features, dtype=first.weight.dtype, generator=torch.Generator().manual_seed(0))
    plans = _candidates(rows)
    times = dict.fromkeys(plans, float("inf"))
    with torch.no_grad():
        for repeat in range(REPEATS):  # the order rotates, so a first call's extra cost hits each plan once
            for plan in plans[repeat % len(plans):] + plans[:repeat % len(plans)]:
                start = time.perf_counter()
                for layer in layers:
                    linear_forward(layer, x, plan)
                times[plan] = min(times[plan], time.perf_counter() - start)
    return choose(times)


def _plan(layers: list[torch.nn.Linear], rows: int) -> int:
    if rows > MAX_ROWS:
        return F_LINEAR
    key = (*_shape_key(layers[0]), rows, torch.get_num_threads())
    if key not in _choices:
        _choices[key] = _measure(layers, rows)
    return _choices[key]


def _kernel(rows: int, plan: int) -> str:
    return "F.linear" if plan == F_LINEAR else "W@x^T" if plan == rows else "W@x^T padded"


def choices() -> list[dict]:
    """What was measured in this process: per layer shape, dtype, row count and threads, the kernel kept."""
    return [{"out_features": out, "in_features": inp, "dtype": str(dtype).removeprefix("torch."), "bias": bias,
             "rows": rows, "threads": threads, "kernel": _kernel(rows, plan), "computed_rows": plan or rows}
            for (out, inp, dtype, bias, rows, threads), plan in sorted(_choices.items(), key=str)]


def summary(entries: list[dict] | None = None) -> str:
    """One line for reports: how many measured (layer shape, rows) pairs kept each kernel (`choices()` by
    default, or the entries a report recorded)."""
    counts = defaultdict(int)
    for entry in choices() if entries is None else entries:
        counts[entry["kernel"]] += 1
    kept = ", ".join(f"{kernel} {n}" for kernel, n in sorted(counts.items())) or "nothing measured"
    return f"CPU linear kernels kept per (layer shape, rows): {kept}"


def _enabled() -> bool:
    value = os.environ.get("SPECDEC_FAST_LINEAR", "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"SPECDEC_FAST_LINEAR={value!r}: use 1 (the default: kernels measured on this machine) "
                         "or 0 (PyTorch's own F.linear everywhere)")
    return ENABLED and value == "1"


def _eligible(layer) -> bool:
    return (type(layer) is torch.nn.Linear and "forward" not in layer.__dict__
            and layer.weight.device.type == "cpu" and layer.weight.dtype in _DTYPES)


def _eligible_layers(models: Iterable) -> list[torch.nn.Linear]:
    seen, layers = set(), []
    for model in models:
        for layer in model.modules() if model is not None else ():
            if _eligible(layer) and id(layer) not in seen:  # a model passed twice (draft == target) counts once
                seen.add(id(layer))
                layers.append(layer)
    return layers


def _groups(layers: list[torch.nn.Linear]) -> dict[tuple, list[torch.nn.Linear]]:
    groups = defaultdict(list)
    for layer in layers:
        groups[_shape_key(layer)].append(layer)
    return groups


def _patch(layer: torch.nn.Linear, group: list[torch.nn.Linear]) -> None:
    def forward(self, x):  # looks `linear_forward` up at call time, so tests can wrap it
        return linear_forward(self, x, _plan(group, x.numel() // x.shape[-1]))

    layer.forward = types.MethodType(forward, layer)


def calibrate(*models, rows: Iterable[int] = range(1, MAX_ROWS + 1)) -> None:
    """Measure the kernels for these row counts now (a warm-up), so no timed decoder call pays for it."""
    if not _enabled():
        return
    for group in _groups(_eligible_layers(models)).values():
        for n in rows:
            _plan(group, n)


@contextlib.contextmanager
def fast_linears(*models):
    """Within the block, the CPU linear layers of `models` use the kernels measured fastest; restored after."""
    layers = _eligible_layers(models) if _enabled() else []
    for group in _groups(layers).values():
        for layer in group:
            _patch(layer, group)
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward
