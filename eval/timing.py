"""What eval times and how: device synchronisation, the peak memory of one decoder call, and the cost ratios c
(a draft step over a target step) and v(n+1) (verifying n draft tokens over a target step) from cached forwards."""

from __future__ import annotations

import ctypes
import gc
import os
import statistics
import time

import psutil
import torch
from transformers import DynamicCache

from specdec.draft_registry import make_drafter
from specdec.fast_linear import fast_linears
from specdec.kv import Batch, cache_kwarg, prefill
from specdec.outputs import DecodeStats
from specdec.sampling import SamplingConfig


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _release_freed_memory() -> None:
    """Collect garbage and return the C allocator's free pages to the OS (glibc's malloc_trim; a no-op elsewhere)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class PeakMemory:
    """Peak memory of one decoder call: CUDA peak allocated, or the process's peak RSS on CPU (VmHWM, which
    Linux lets a process reset through /proc/self/clear_refs; elsewhere the RSS after the call, via psutil)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.can_reset_hwm = False
        if device.type != "cuda":
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
                self.can_reset_hwm = self._hwm_mb() is not None
            except OSError:
                pass

    @staticmethod
    def _hwm_mb() -> float | None:
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) / 1024.0
        except OSError:
            return None
        return None

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.can_reset_hwm:
            # The mark restarts from the current RSS, which still holds memory that earlier work in this process
            # freed but the allocator kept (a caller that trained first: `specdec demo`, when it still evaluated in
            # the process that trained, read far more than the 135M pair's own memory, docs/results/history.md).
            # Hand that back first, so the figure is the decoder's.
            _release_freed_memory()
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")

    def read_mb(self) -> float:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 2**20
        if self.can_reset_hwm:
            return self._hwm_mb() or 0.0

        return psutil.Process(os.getpid()).memory_info().rss / 2**20


class _CachedStep:
    """One kind of timed target forward: n_new tokens after the prompt `ids` [B, L], on its own cache, which is
    cut back after each call."""

    def __init__(self, model, ids: torch.Tensor, n_new: int):

        self.model, self.n_new = model, n_new
        self.kwarg = cache_kwarg(model)
        self.cache = DynamicCache(config=model.config)
        model(input_ids=ids, use_cache=True, logits_to_keep=1, **{self.kwarg: self.cache})
        length = self.cache.get_seq_length()
        self.x = ids[:, -1:].expand(-1, n_new).contiguous()
        self.pos = torch.arange(length, length + n_new, device=ids.device)[None].expand(ids.shape[0], -1)

    def __call__(self) -> None:
        # Verification keeps every logit row, as the decoder does.
        self.model(input_ids=self.x, position_ids=self.pos, use_cache=True,
                   logits_to_keep=1 if self.n_new == 1 else 0, **{self.kwarg: self.cache})
        self.cache.crop(-self.n_new)


class _DraftStep:
    """The draft's timed forward, through its own drafter (any kind of draft): one new position after the
    prompt `ids` and the target's first token, as a round's first proposal (specdec/drafter.py: timed_step)."""

    def __init__(self, target, draft, ids: torch.Tensor):
        self.drafter = make_drafter(draft, target, SamplingConfig())
        self.batch = Batch(ids, None, 2, 2, None, 0)
        _, logits = prefill(target, self.batch, cache_kwarg(target))
        self.batch.append(logits.argmax(-1)[:, None])
        self.drafter.start(self.batch)
        self.drafter.propose(self.batch, 1, None, DecodeStats())  # reads the prompt: not timed
        self.drafter.rollback(self.batch)

    def __call__(self) -> None:
        self.drafter.timed_step(self.batch)

    def close(self) -> None:
        self.drafter.close()


def measure_costs(target, draft, ids: torch.Tensor, ks: list[int], repeats: int, clock=time.perf_counter) -> dict:
    """c = draft step / target step and v(k+1) = verify of k+1 tokens / target step, from cached forwards.

    The kinds of forward are interleaved: each of `repeats` passes times one of every kind, in an order that
    rotates from pass to pass, so that drift in the machine's speed (shared cores, clock changes) slows every
    kind alike; each figure is a median over the passes. Timed kind after kind instead, on a shared 2-core VM,
    drift made a longer verification look cheaper than a single step, and choose_k then picked a k that ran
    slower than the k it picks with interleaved timing (docs/results/history.md)."""

    device = ids.device
    with torch.inference_mode(), fast_linears(target, draft):  # the layers the decoders use
        draft_step = _DraftStep(target, draft, ids)
        steps = {"target": _CachedStep(target, ids, 1), "draft": draft_step,
                 **{k: _CachedStep(target, ids, k + 1) for k in ks}}
        order = list(steps)
        try:
            for step in steps.values():  # warm-up
                step()
            times: dict = {name: [] for name in order}
            for i in range(repeats):
                for name in order[i % len(order):] + order[: i % len(order)]:
                    sync(device)
                    t0 = clock()
                    steps[name]()
                    sync(device)
                    times[name].append(clock() - t0)
        finally:
            draft_step.close()
    t1, d1 = statistics.median(times["target"]), statistics.median(times["draft"])
    verify = {k: statistics.median(times[k]) for k in ks}
    return {"target_step_ms": 1e3 * t1, "draft_step_ms": 1e3 * d1, "c": d1 / t1,
            "verify_ms": {str(k): 1e3 * s for k, s in verify.items()},
            "v": {str(k): s / t1 for k, s in verify.items()}}
