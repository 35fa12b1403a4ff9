"""The timed A/B loop: every batch of the workload decoded target-only and with each proposal, the order alternating
from batch to batch, after untimed warm-up passes; only the decoder calls are timed (device-synchronised)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from specdec.decode import speculative_generate, target_generate
from specdec.eval import metrics
from specdec.eval.config import EvalConfig
from specdec.eval.timing import PeakMemory, measure_costs, sync
from specdec.outputs import DecodeStats
from specdec.proposal import Proposal
from specdec.tokens import left_pad


@dataclass
class Call:
    """One timed decoder call on one batch of prompts."""

    proposal: Proposal | None  # None: the target-only baseline
    batch_size: int
    rows: list[int]  # prompt indices
    seconds: float
    timings: list[tuple[float, int]]
    tokens: list[list[int]]  # generated tokens per row, cut after EOS
    peak_mb: float
    stats: DecodeStats | None = None  # speculative calls' counters

    @property
    def mode(self) -> str:
        return "baseline" if self.proposal is None else "speculative"


def measure(cfg: EvalConfig, target, draft, encoded: list[list[int]], eos, pad, device: torch.device):
    """The timed A/B loop over batch sizes and batches; returns (calls, costs per batch size, loop timing)."""
    calls: list[Call] = []
    memory = PeakMemory(device)
    costs: dict[int, dict] = {}
    timing = {"loop_s": 0.0, "decoder_s": 0.0}
    n = len(encoded)
    bar = tqdm(total=sum(-(-n // b) * (1 + len(cfg.proposals(b))) for b in cfg.batch_size), desc="eval", unit="call")
    for b in cfg.batch_size:
        proposals = cfg.proposals(b)
        groups = [list(range(i, min(i + b, n))) for i in range(0, n, b)]
        first_ids, first_mask = left_pad([encoded[i] for i in groups[0]], pad, device)
        # Cost ratios on the first batch's common (unpadded) suffix: the decoders' per-step shapes.
        nodes = sorted({p.verified_nodes for p in proposals})
        costs[b] = measure_costs(target, draft, first_ids[:, first_mask.all(0)], nodes, cfg.cost_repeats)
        for _ in range(cfg.warmup):
            for p in [None, *proposals]:
                _decode(target, draft, p, first_ids, first_mask, cfg, eos, pad, torch.Generator(device=device))
        loop_start = time.perf_counter()
        for gi, group in enumerate(groups):
            order = [None, *proposals] if gi % 2 == 0 else [*proposals[::-1], None]  # A/B: alternate who goes first
            for p in order:
                calls.append(_timed_call(cfg, target, draft, p, group, b, encoded, eos, pad, memory, gi))
                timing["decoder_s"] += calls[-1].seconds
                bar.update(1)
        timing["loop_s"] += time.perf_counter() - loop_start
    bar.close()
    return calls, costs, timing


def _timed_call(cfg, target, draft, proposal, group, b, encoded, eos, pad, memory: PeakMemory, gi) -> Call:
    """One decoder call on one batch, timed alone; its tokens counted and its peak memory read after the clock."""
    device = memory.device
    ids, mask = left_pad([encoded[i] for i in group], pad, device)
    gen = torch.Generator(device=device).manual_seed(cfg.seed + gi)
    memory.reset()
    sync(device)
    t0 = time.perf_counter()
    res = _decode(target, draft, proposal, ids, mask, cfg, eos, pad, gen)
    sync(device)
    seconds = time.perf_counter() - t0
    peak = memory.read_mb()
    new = res.sequences[:, res.prompt_length:].tolist()
    lengths = metrics.generated_lengths(new, eos)
    return Call(proposal, b, group, seconds, res.timings, [row[:n] for row, n in zip(new, lengths)], peak,
                None if proposal is None else res.stats)


def _decode(target, draft, proposal: Proposal | None, ids, mask, cfg: EvalConfig, eos, pad, gen):
    mask = None if bool(mask.all()) else mask
    common = dict(sampling=cfg.sampling(), max_new_tokens=cfg.max_new_tokens, eos_token_id=eos, generator=gen,
                  pad_token_id=pad, timing=True)
    if proposal is None:
        return target_generate(target, ids, mask, **common)
    return speculative_generate(target, draft, ids, mask, proposal, **common)
