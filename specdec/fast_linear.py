"""Faster linear layers for decoding on a CPU, used inside `target_generate` and `speculative_generate` only.

A decode step multiplies every weight matrix of a model by 1 to k + 1 rows (more for a tree), so it streams all
the weights from memory once per step. Which kernel does that fastest for a handful of rows depends on the CPU
and its BLAS: on some machines torch's `F.linear` (x @ W^T) runs at a fraction of memory bandwidth there while
the same product written W @ x^T runs near it, and on others `F.linear` is the faster one. Some odd row counts
also take a slower kernel than the next even one (one row most of all), so computing them padded to it pays.
And oneDNN's matmul on a weight reordered once into its own blocked layout (the path torch's inductor takes for
frozen CPU linears) can cost nearly the same for 2 to 16 rows as for one, where the BLAS kernels grow with the
rows: that is what makes verifying a tree of candidates cheap. No one rule holds across machines (docs/results
has several kinds), so the choice is measured, not assumed.

For each layer shape, dtype, row count and thread count first seen inside `fast_linears`, `_measure` times each
candidate (`F.linear`; W @ x^T over the rows; for odd counts W @ x^T padded by one row; in float32 where torch
has oneDNN, the reordered weight) as a sweep over every patched layer of that shape, which streams the weights
as a decode step does, and keeps the fastest. A reordered weight is a second copy of it: made only while the
copies of a shape take under PACK_SHARE of the memory available at that moment (a large target is not doubled
into swap or the OOM killer; `skipped_for_memory()` lists what was left out), kept only for the shapes where some
row count chose it (`packed_mb` says how much), released with its layer. `F.linear`
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
import weakref
from collections import defaultdict
from collections.abc import Iterable

import psutil
import torch

_DTYPES = (torch.float32, torch.float64)
MAX_ROWS = 16  # row counts measured; beyond them F.linear (prefill-sized products, where BLAS does well)
MARGIN = 0.95  # another kernel replaces F.linear only when it takes under this fraction of F.linear's time
REPEATS = 3  # timed sweeps per candidate; the fastest sweep counts (noise only ever adds time)
ENABLED = True  # bench/decode.py turns it off to attribute the gain; SPECDEC_FAST_LINEAR=0 does too
F_LINEAR = 0  # a plan: 0 is F.linear, n > 0 is W @ x^T over n rows (the real ones, padded up to n),
PACKED = -1  # and this one oneDNN's matmul on the weight reordered into its blocked layout
PACK_ROWS = MAX_ROWS  # the row count oneDNN lays the reordered weight out for (any count runs on it)
PACK_SHARE = 0.25  # a shape's reordered copies are made only when they take under this share of available memory

# (out features, in features, dtype, has bias, rows, threads) -> plan, measured once per process
_choices: dict[tuple, int] = {}
# layer shapes whose copies would not fit under PACK_SHARE when first measured: the other kernels only
_skipped: set[tuple] = set()
# id(weight) -> (weak reference to it, its version when reordered, the reordered copy); one per weight tensor, so
# layers that share a weight (a draft's lm_head tied to the target's) share the copy
_packed: dict[int, tuple] = {}


def _packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _packed_weight(weight: torch.Tensor) -> torch.Tensor:
    """The reordered copy of `weight`, made again whenever the weight was changed in place since."""
    entry = _packed.get(id(weight))
    if entry is None or entry[0]() is not weight or entry[1] != weight._version:
        key = id(weight)
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS)
        _packed[key] = (weakref.ref(weight, lambda _, key=key: _packed.pop(key, None)), weight._version, packed)
        return packed
    return entry[2]


def _release_packed(layers: list[torch.nn.Linear]) -> None:
    for layer in layers:
        _packed.pop(id(layer.weight), None)


def packed_mb(*models, shared_with=None) -> float:
    """Memory held by the reordered weight copies of these models' layers, leaving out those of weights the model
    `shared_with` also holds (all copies when no model is named)."""
    def weights(ms):
        return {id(layer.weight) for m in ms if m is not None for layer in m.modules()
                if isinstance(layer, torch.nn.Linear)}

    keys = weights(models) if models else set(_packed)
    keys -= weights([shared_with])
    return sum(entry[2].numel() * entry[2].element_size() for key, entry in list(_packed.items())
               if key in keys) / 2**20


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.nn.functional.linear(x, weight, bias)  # one name, so tests can slow it down


def _matmul(weight: torch.Tensor, flat_t: torch.Tensor) -> torch.Tensor:
    return torch.matmul(weight, flat_t)


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def linear_forward(self: torch.nn.Linear, x: torch.Tensor, plan: int = F_LINEAR) -> torch.Tensor:
    """`self(x)` computed as `plan` says: F.linear for 0, the reordered weight for PACKED, else (W @ x^T)^T over
    `plan` >= rows rows, the extra rows copies of the last. [..., in] -> [..., out]"""
    if plan == PACKED and not (torch.is_grad_enabled() and self.weight.requires_grad):  # oneDNN's op: no backward
        return _packed_linear(x, _packed_weight(self.weight), self.bias)
    if plan in (F_LINEAR, PACKED):
        return _linear(x, self.weight, self.bias)
    flat = x.reshape(-1, x.shape[-1])
    rows = flat.shape[0]
    if plan > rows:
        flat = torch.cat([flat, flat[-1:].expand(plan - rows, -1)])
    out = _matmul(self.weight, flat.T).T[:rows]
    if self.bias is not None:
        out = out + self.bias
    return out.contiguous().reshape(*x.shape[:-1], self.weight.shape[0])


def _shape_key(layer: torch.nn.Linear) -> tuple:
    return (*layer.weight.shape, layer.weight.dtype, layer.bias is not None)


def _candidates(rows: int, dtype: torch.dtype, packable: bool = True) -> list[int]:
    packed = [PACKED] if packable and dtype == torch.float32 and _packing_available() else []  # no float64 matmul
    return [F_LINEAR, rows] + ([rows + 1] if rows % 2 else []) + packed


def _room_to_pack(layers: list[torch.nn.Linear]) -> bool:
    """Whether this shape's layers may run on reordered copies: they have them already, or the copies would take
    under PACK_SHARE of the memory available now. A shape refused once stays refused (choices stay stable)."""
    shape = _shape_key(layers[0])
    if shape in _skipped:
        return False
    missing = [layer.weight for layer in layers if id(layer.weight) not in _packed]
    need = sum(w.numel() * w.element_size() for w in {id(w): w for w in missing}.values())
    if need and need >= PACK_SHARE * psutil.virtual_memory().available:
        _skipped.add(shape)
        return False
    return True


def choose(times: dict[int, float]) -> int:
    """The plan to keep from the fastest time of each: F.linear unless another beats it by MARGIN."""
    best = min(times, key=times.get)
    return best if times[best] < MARGIN * times[F_LINEAR] else F_LINEAR


def _measure(layers: list[torch.nn.Linear], rows: int) -> int:
    """Time each candidate plan as a sweep over `layers` (one shape) at `rows` rows; the plan to use."""
    first = layers[0]
    # its own generator: measuring must not move the global RNG that a sampling decoder's seed drives
    x = torch.randn(rows, first.in_features, dtype=first.weight.dtype, generator=torch.Generator().manual_seed(0))
    plans = _candidates(rows, first.weight.dtype, packable=_room_to_pack(layers))
    times = dict.fromkeys(plans, float("inf"))
    with torch.no_grad():
        if PACKED in plans:
            for layer in layers:  # reordering is a one-off cost, not the kernel's
                _packed_weight(layer.weight)
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
    shape = _shape_key(layers[0])
    key = (*shape, rows, torch.get_num_threads())
    if key not in _choices:
        _choices[key] = _measure(layers, rows)
        if not any(plan == PACKED for k, plan in _choices.items() if k[:len(shape)] == shape):
            _release_packed(layers)  # no row count of this shape runs on the copies: give their memory back
    return _choices[key]


def _kernel(rows: int, plan: int) -> str:
    return {F_LINEAR: "F.linear", PACKED: "oneDNN packed", rows: "W@x^T"}.get(plan, "W@x^T padded")


def choices() -> list[dict]:
    """What was measured in this process: per layer shape, dtype, row count and threads, the kernel kept."""
    return [{"out_features": out, "in_features": inp, "dtype": str(dtype).removeprefix("torch."), "bias": bias,
             "rows": rows, "threads": threads, "kernel": _kernel(rows, plan), "computed_rows": plan if plan > 0 else rows}
            for (out, inp, dtype, bias, rows, threads), plan in sorted(_choices.items(), key=str)]


def skipped_for_memory() -> list[dict]:
    """The layer shapes that got no reordered copies because those would not have fit (PACK_SHARE)."""
    return [{"out_features": out, "in_features": inp, "dtype": str(dtype).removeprefix("torch."), "bias": bias}
            for out, inp, dtype, bias in sorted(_skipped, key=str)]


def summary(entries: list[dict] | None = None, skipped: list[dict] | None = None) -> str:
    """One line for reports: how many measured (layer shape, rows) pairs kept each kernel, and how many shapes got
    no reordered copies for lack of memory (this process's by default, or what a report recorded)."""
    counts = defaultdict(int)
    for entry in choices() if entries is None else entries:
        counts[entry["kernel"]] += 1
    kept = ", ".join(f"{kernel} {n}" for kernel, n in sorted(counts.items())) or "nothing measured"
    skipped = skipped_for_memory() if entries is None else skipped or []
    left = (f"; {len(skipped)} layer shapes not reordered, their copies would have taken over "
            f"{PACK_SHARE:.0%} of the memory available") if skipped else ""
    return f"CPU linear kernels kept per (layer shape, rows): {kept}{left}"


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
