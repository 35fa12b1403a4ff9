"""`specdec eval`: baseline (target-only) vs speculative decoding on one fixed workload, in one process.

The workload is fixed before the run: the prompt file, seed, max_new_tokens, sampling settings and batch
sizes. For each batch size the prompts are cut into batches; each batch is decoded target-only and then
speculatively with every k of the sweep, the order alternating from batch to batch (A/B), after `warmup`
untimed passes over the first batch. Only the decoder calls are timed (device-synchronised, `timing=True`
marks for TTFT and ITL); token counting, memory reads and bookkeeping happen outside the timed region.

    specdec eval --target T --draft D --prompts FILE --num-draft-tokens 1,2,4 --max-new-tokens 64 \\
                 --temperature 0 --out DIR
"""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import json
import logging
import os
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from specdec import fast_linear, replay
from specdec.compat import check_compatible
from specdec.decode import DecodeStats, speculative_generate, target_generate
from specdec.draft_registry import make_drafter
from specdec.eval import decision as decision_mod
from specdec.eval import engine as engines
from specdec.eval import equivalence, memory, metrics, plots, proposals, report
from specdec.eval.engine import report as engine_report
from specdec.eval.verify import _draft_tokenizer, check_pair, first_turn, resolve_prompts_path
from specdec.fast_linear import fast_linears
from specdec.kv import Batch, cache_kwarg, prefill
from specdec.models import load_model, load_tokenizer, resolve_device, share_target_embeddings
from specdec.prompts import encode_prompt, read_prompts
from specdec.sampling import SamplingConfig
from specdec.tokens import left_pad, tokenizer_pad_id

log = logging.getLogger(__name__)

RECOMMEND_BY = ("speedup", "tokens_per_s", "latency_p50", "latency_p95")
PLOT_FORMATS = ("png", "svg", "pdf")


@dataclass
class EvalConfig(*engines.option_classes()):
    """`specdec eval` settings (recipe section `eval:`). Lists sweep: one row per (k or tree, batch size).
    Each serving engine's own keys (vllm_method, vllm_ngram, ...) come from its options class (eval/engine)."""

    target: str = "embedded:smollm2-135m-instruct"
    draft: str | None = None
    prompts: str = "embedded:heldout"  # .jsonl/.json prompt file; default: the shipped held-out prompt set
    num_prompts: int | None = None  # the first N prompts (None: all)
    use_chat_template: bool = True
    num_draft_tokens: list[int] = field(default_factory=lambda: [4])
    # Draft trees swept beside the chains, at batch size 1 (specdec/tree.py): e.g. 3x1x1 (top 3, then top 1),
    # dyn8 (EAGLE-2's dynamic tree of 8 nodes). [] = chains only.
    tree: list[str] = field(default_factory=list)
    batch_size: list[int] = field(default_factory=lambda: [1])
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    warmup: int = 1  # untimed passes over the first batch, per batch size
    out: str | None = None
    output_dir: str | None = None  # recipe-wide; the report goes to output_dir/eval when `out` is not set
    device: str = "auto"
    dtype: str = "auto"
    threads: int | None = None  # torch CPU threads (None: torch's default)
    report_to: str = "none"  # none | wandb
    run_name: str | None = None
    # Decision thresholds, fixed before the run; all must hold for `enable`.
    min_acceptance_rate: float = 0.5
    min_speedup: float = 1.1
    # accounted memory the draft may add, as a fraction of target-only's (its weights and KV cache; eval/memory.py)
    max_memory_overhead: float = 0.2
    recommend_by: str = "speedup"  # speedup | tokens_per_s | latency_p50 | latency_p95
    plot_format: str = "png"
    cost_repeats: int = 10  # interleaved passes timing one cached forward of each kind, for c and v
    equivalence_samples: int = 256  # sampling only: draws for the short distribution check (0: skip)
    # Candidate k values: before the timed runs, pick the one with the best predicted speedup (see
    # choose_num_draft_tokens) and measure only it; replaces num_draft_tokens. [] = off.
    choose_k: list[int] = field(default_factory=list)
    choose_tree: list[str] = field(default_factory=list)  # static tree shapes choose_k weighs beside its chains
    choose_k_prompts: int = 4  # calibration prompts (the first ones, which also serve as warm-up)
    # --- the serving engine (eval/engine/): where the draft is measured; specdec = this decoder
    engine: list[str] = field(default_factory=lambda: ["specdec"])  # specdec | vllm | specdec,vllm (side by side)
    concurrency: list[int] = field(default_factory=lambda: [1, 4, 16])  # serving engine: closed-loop clients per level

    def __post_init__(self) -> None:
        settings = engines.check_settings(self)
        self.engine, self.concurrency = settings.engine, settings.concurrency
        if not self.draft and engines.needs_draft(self):
            raise ValueError("eval needs a draft: pass --draft PATH_OR_HUB_ID (a checkpoint from `specdec train`)")
        if not self.prompts:
            raise ValueError("eval needs prompts: pass --prompts FILE.jsonl (default: embedded:heldout)")
        self.tree = proposals.normalise_trees(self.tree)
        self.choose_tree = proposals.normalise_trees(self.choose_tree, "choose_tree")
        if self.choose_tree and not self.choose_k:
            raise ValueError("choose_tree weighs trees beside chains: give choose_k too (e.g. choose_k=1,2,3)")
        for shape in self.choose_tree:
            proposals.widths(shape)
        if (not self.num_draft_tokens and not self.tree) or min(self.num_draft_tokens, default=1) < 1:
            raise ValueError(f"num_draft_tokens must be integers >= 1 (e.g. --num-draft-tokens 1,2,4), got {self.num_draft_tokens}")
        if not self.batch_size or min(self.batch_size) < 1:
            raise ValueError(f"batch_size must be integers >= 1 (e.g. --batch-size 1,4), got {self.batch_size}")
        self.num_draft_tokens = sorted(set(self.num_draft_tokens))
        if self.choose_k and min(self.choose_k) < 1:
            raise ValueError(f"choose_k must list integers >= 1 (e.g. choose_k=1,2,3,4), got {self.choose_k}")
        self.choose_k = sorted(set(self.choose_k))
        if self.choose_k_prompts < 1:
            raise ValueError(f"choose_k_prompts must be >= 1, got {self.choose_k_prompts}")
        self.batch_size = sorted(set(self.batch_size))
        if self.tree and 1 not in self.batch_size:
            raise ValueError(f"trees decode one prompt at a time: add batch size 1 to measure tree={self.tree}")
        for name in ("max_new_tokens", "cost_repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("warmup", "equivalence_samples"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1 (or unset for all), got {self.num_prompts}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        self.sampling()  # temperature / top_k / top_p checks with their own messages
        self.thresholds()
        if self.recommend_by not in RECOMMEND_BY:
            raise ValueError(f"unknown recommend_by metric {self.recommend_by!r}; use one of {', '.join(RECOMMEND_BY)}")
        if self.plot_format not in PLOT_FORMATS:
            raise ValueError(f"unknown plot_format {self.plot_format!r}; use one of {', '.join(PLOT_FORMATS)}")
        if self.report_to not in ("none", "wandb"):
            raise ValueError(f"unknown report_to {self.report_to!r}; use none or wandb")

    def sampling(self) -> SamplingConfig:
        return SamplingConfig(self.temperature, self.top_k, self.top_p)

    def proposals(self, batch_size: int) -> list:
        """The configurations measured at this batch size: every k, and the trees at batch size 1."""
        return [*self.num_draft_tokens, *(self.tree if batch_size == 1 else [])]

    def thresholds(self) -> decision_mod.Thresholds:
        return decision_mod.Thresholds(self.min_acceptance_rate, self.min_speedup, self.max_memory_overhead)

    def out_dir(self) -> Path:
        if self.out:
            return Path(self.out)
        if self.output_dir:
            return Path(self.output_dir) / "eval"
        raise ValueError("where should the report go? pass --out DIR")


# ---------------------------------------------------------------- measurement helpers


def _sync(device: torch.device) -> None:
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
            # freed but the allocator kept (`specdec demo` trains in the same process: its eval read far more than
            # the 135M pair's own memory, docs/results/history.md). Hand that back first, so the figure is the
            # decoder's.
            _release_freed_memory()
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")

    def read_mb(self) -> float:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 2**20
        if self.can_reset_hwm:
            return self._hwm_mb() or 0.0

        return psutil.Process(os.getpid()).memory_info().rss / 2**20


def _accounted(cfg: EvalConfig, target, draft, longest_prompt: int, proposal, batch: int) -> dict:
    """The memory gate's figures for one proposal at one batch size: the draft's accounted overhead and
    target-only's, in bytes per item (eval/memory.py), their totals in MB and the limit fixed by the config."""
    draft_side = memory.draft_overhead(draft, target, longest_prompt, cfg.max_new_tokens,
                                       proposals.verified_nodes(proposal), batch)
    target_side = memory.target_only(target, longest_prompt, cfg.max_new_tokens, batch)
    target_mb = target_side["total"] / memory.MB
    return {"accounted": draft_side, "target_only": target_side, "overhead_mb": draft_side["total"] / memory.MB,
            "target_only_mb": target_mb, "limit_mb": cfg.thresholds().memory_limit_mb(target_mb)}


def _batch_for(cfg: EvalConfig, proposal) -> int:
    """The batch size a proposal's memory is accounted at: the run's largest (a tree decodes one prompt at a time)."""
    return 1 if proposals.is_tree(proposal) else max(cfg.batch_size)


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
                    _sync(device)
                    t0 = clock()
                    steps[name]()
                    _sync(device)
                    times[name].append(clock() - t0)
        finally:
            draft_step.close()
    t1, d1 = statistics.median(times["target"]), statistics.median(times["draft"])
    verify = {k: statistics.median(times[k]) for k in ks}
    return {"target_step_ms": 1e3 * t1, "draft_step_ms": 1e3 * d1, "c": d1 / t1,
            "verify_ms": {str(k): 1e3 * s for k, s in verify.items()},
            "v": {str(k): s / t1 for k, s in verify.items()}}


def choose_num_draft_tokens(target, draft, prompts: list[list[int]], candidates: list, cfg: EvalConfig,
                            eos, pad, device: torch.device, longest_prompt: int | None = None) -> dict:
    """Pick k (or a static tree) by predicted speedup: tau / (d c + v(n+1)), all measured here, before any timed
    run (eval/proposals.py: d draft forwards, n verified nodes per round): the fastest candidate that passes the
    config's thresholds, or the fastest overall when none does (eval/decision.py: prefer_passing).

    tau comes from the draft teacher-forced on the target's own outputs for `prompts`: greedy rounds replayed
    exactly from the ranks of the target's tokens among the draft's proposals (specdec/replay.py, for any kind of
    draft). Under sampling the target's sampled output and the draft's ranking give an estimate, not the exact
    figure. c and v are timed as in the report. The gates are held to these figures: the acceptance rate (tau - 1)
    / d, the predicted speedup, and the accounted memory for prompts of up to `longest_prompt` tokens (default:
    the longest of `prompts`); equivalence and fallback are judged on the timed run only.
    """
    ranks, steps = [], max(proposals.depth(p) for p in candidates)
    with torch.inference_mode():
        for i, prompt in enumerate(prompts):
            ids = torch.tensor([prompt], device=device)
            gen = torch.Generator(device=device).manual_seed(cfg.seed + i)
            out = target_generate(target, ids, None, cfg.sampling(), cfg.max_new_tokens, eos, gen, pad)
            seq = out.sequences[:, : len(prompt) + metrics.generated_lengths(
                out.sequences[:, len(prompt):].tolist(), eos)[0]]
            if seq.shape[1] - len(prompt) < 2:
                continue
            # The first token comes from the target's prefill; rounds start after it, as in the decoder: logits
            # positions from len(prompt) on, each predicting the next completion token.
            mask = torch.ones_like(seq)
            scored = torch.zeros_like(seq, dtype=torch.bool)
            scored[0, len(prompt): seq.shape[1] - 1] = True
            states = replay.target_states(draft, target, seq, mask)
            ranks += replay.replay_ranks(draft, seq, mask, scored, steps, states)
    tau = {p: proposals.replayed_tau(ranks, p) for p in candidates}
    nodes = sorted({proposals.verified_nodes(p) for p in candidates})
    costs = measure_costs(target, draft, torch.tensor([prompts[0]], device=device), nodes, cfg.cost_repeats)
    predicted = {p: proposals.predicted_speedup(tau[p], p, costs["c"], costs["v"]) for p in candidates}
    # a round emits its accepted tokens plus one correction or bonus token, and proposes d
    acceptance = {p: (tau[p] - 1.0) / proposals.depth(p) for p in candidates}
    longest = longest_prompt or max(map(len, prompts))
    mem = {p: _accounted(cfg, target, draft, longest, p, _batch_for(cfg, p)) for p in candidates}
    failed = {p: decision_mod.failed_gates(decision_mod.threshold_checks(
        acceptance[p], predicted[p], mem[p]["overhead_mb"], mem[p]["target_only_mb"], cfg.thresholds()))
        for p in candidates}
    chosen, fastest = decision_mod.prefer_passing(
        candidates, lambda p: (-predicted[p], proposals.verified_nodes(p)), failed)
    chains = [p for p in candidates if not proposals.is_tree(p)]
    best_chain = max(chains, key=lambda p: (predicted[p], -p)) if chains else None
    log.info("choose_k: predicted speedup %s, failing %s -> %s (fastest %s)",
             {proposals.label(p): round(v, 3) for p, v in predicted.items()},
             {proposals.label(p): f for p, f in failed.items() if f}, proposals.label(chosen), proposals.label(fastest))

    def by_label(values: dict) -> dict:  # "k=2" / "tree=2": a one-level tree and the chain of its width share a text
        return {proposals.label(p): values[p] for p in candidates}

    return {"candidates": candidates, "prompts": len(prompts),
            "tau": by_label(tau), "c": costs["c"], "v": costs["v"],
            "predicted_speedup": by_label(predicted), "acceptance_rate": by_label(acceptance),
            "memory_overhead_mb": by_label({p: m["overhead_mb"] for p, m in mem.items()}),
            "memory_limit_mb": by_label({p: m["limit_mb"] for p, m in mem.items()}),
            "gates_checked": ["acceptance_rate", "speedup", "memory"], "failed_gates": by_label(failed),
            "chosen": chosen, "fastest": fastest, "best_chain": best_chain,
            "top_n_agreement": replay.top_n_agreement(ranks)}


@dataclass
class Call:
    """One timed decoder call on one batch of prompts."""

    mode: str  # "baseline" or "speculative"
    k: int | str | None  # the proposal: k, or a tree shape (eval/proposals.py)
    batch_size: int
    rows: list[int]  # prompt indices
    seconds: float
    timings: list[tuple[float, int]]
    tokens: list[list[int]]  # generated tokens per row, cut after EOS
    peak_mb: float
    stats: object = None  # DecodeStats for speculative calls


# ---------------------------------------------------------------- aggregation


def _mode_metrics(calls: list[Call]) -> dict:
    latencies, ttfts, itls = [], [], []
    for c in calls:
        ttft, itl = metrics.ttft_and_itl(c.timings)
        latencies += [c.seconds] * len(c.rows)  # every request of a batch waits for the whole batch
        if ttft is not None:
            ttfts += [ttft] * len(c.rows)
        itls += itl
    seconds = sum(c.seconds for c in calls)
    tokens = sum(len(t) for c in calls for t in c.tokens)
    return {
        "tokens_per_s": metrics.tokens_per_second(tokens, seconds),
        "latency_s": metrics.percentiles(latencies, (50, 95, 99)),
        "ttft_s": metrics.percentiles(ttfts, (50, 95)),
        "itl_s": metrics.percentiles(itls, (50, 95)),
        "peak_memory_mb": max(c.peak_mb for c in calls),
        "seconds": seconds,
        "tokens": tokens,
        "latencies": latencies,  # dropped from the report; kept for the CDF plot
    }


def _spec_stats(calls: list[Call], k: int, weights: list[float] | None = None) -> dict:
    """Sums of the decoder's counters over calls (optionally weighted per call), and the derived rates."""
    weights = weights or [1.0] * len(calls)
    tot = defaultdict(float)
    tried, acc = [0.0] * k, [0.0] * k
    for c, w in zip(calls, weights):
        s = c.stats
        for name in ("rounds", "row_rounds", "proposed", "accepted", "corrections", "bonus", "emitted", "tree_nodes"):
            tot[name] += w * getattr(s, name)
        tot["fallback"] = max(tot["fallback"], float(s.fallback))
        for i in range(k):
            tried[i] += w * s.position_tried[i]
            acc[i] += w * s.position_accepted[i]
    return {
        "acceptance_rate": tot["accepted"] / tot["proposed"] if tot["proposed"] else 0.0,
        "mean_accepted_tokens": tot["emitted"] / tot["row_rounds"] if tot["row_rounds"] else 0.0,
        "per_position_acceptance": [a / t if t else 0.0 for a, t in zip(acc, tried)],
        **{n: int(round(tot[n])) for n in ("rounds", "proposed", "accepted", "corrections", "bonus")},
        "nodes_per_round": tot["tree_nodes"] / tot["rounds"] if tot["rounds"] else 0.0,
        "fallback": bool(tot["fallback"]),
    }


def _categories(prompts, base: list[Call], spec: list[Call], k: int) -> dict:
    """Per-category figures; a batch's time and counters are shared equally among its rows."""
    cats = {i: p.category for i, p in enumerate(prompts)}
    if all(c is None for c in cats.values()):
        return {}
    out = {}
    for cat in sorted({c for c in cats.values() if c is not None}):
        def share(calls, cat=cat):
            secs, toks, weights = 0.0, 0, []
            for c in calls:
                mine = [j for j, r in enumerate(c.rows) if cats[r] == cat]
                secs += c.seconds * len(mine) / len(c.rows)
                toks += sum(len(c.tokens[j]) for j in mine)
                weights.append(len(mine) / len(c.rows))
            return secs, toks, weights

        b_s, b_t, _ = share(base)
        s_s, s_t, w = share(spec)
        st = _spec_stats(spec, k, w)
        out[cat] = {
            "prompts": sum(1 for c in cats.values() if c == cat),
            "baseline_tokens_per_s": metrics.tokens_per_second(b_t, b_s),
            "speculative_tokens_per_s": metrics.tokens_per_second(s_t, s_s),
            "speedup": metrics.speedup(b_s, s_s) if s_s > 0 else 0.0,
            "acceptance_rate": st["acceptance_rate"],
            "mean_accepted_tokens": st["mean_accepted_tokens"],
        }
    return out


# ---------------------------------------------------------------- the run


def run(cfg: EvalConfig) -> dict:
    """Measure, compare and decide; writes report.json, report.md, plots and samples.jsonl; returns the report."""
    threads = torch.get_num_threads()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    try:
        served = engines.serving(cfg)  # a serving engine, after this decoder when both are asked for
        if served is not None:
            return engine_report.run(served, cfg, _run if engines.DECODER in cfg.engine else None)
        return _run(cfg)
    finally:
        torch.set_num_threads(threads)


def _run(cfg: EvalConfig) -> dict:

    out_dir = cfg.out_dir()
    wandb_run = _start_wandb(cfg, out_dir) if cfg.report_to == "wandb" else None
    torch.manual_seed(cfg.seed)
    device = resolve_device(cfg.device)

    prompts = read_prompts(resolve_prompts_path(cfg.prompts), limit=cfg.num_prompts)
    tokenizer = load_tokenizer(cfg.target)
    log.info("loading target %s and draft %s", cfg.target, cfg.draft)
    target = load_model(cfg.target, cfg.dtype, device)
    draft = load_model(cfg.draft, cfg.dtype, device)
    check_compatible(tokenizer, _draft_tokenizer(cfg.draft, tokenizer), target, draft)
    shared_mb = share_target_embeddings(target, draft) / 2**20
    if shared_mb:
        log.info("the draft's input embeddings equal the target's: one copy serves both (%.1f MB saved)", shared_mb)
    encoded = [encode_prompt(tokenizer, first_turn(p.messages), cfg.use_chat_template) for p in prompts]
    if any(len(e) == 0 for e in encoded):
        raise ValueError("a prompt encodes to zero tokens; remove empty prompts from the file")
    eos = tokenizer.eos_token_id
    pad = tokenizer_pad_id(tokenizer)
    log.info("measuring the CPU linear kernels for every row count the decoders use (specdec/fast_linear.py)")
    fast_linear.calibrate(target, draft)  # here, so that no timed call below pays for a first measurement
    longest = max(map(len, encoded))
    chosen_k = None
    if cfg.choose_k:
        chosen_k = choose_num_draft_tokens(target, draft, encoded[: cfg.choose_k_prompts],
                                           [*cfg.choose_k, *cfg.choose_tree], cfg, eos, pad, device, longest)
        chosen = chosen_k["chosen"]
        cfg = dataclasses.replace(cfg, num_draft_tokens=[] if proposals.is_tree(chosen) else [chosen],
                                  tree=[chosen] if proposals.is_tree(chosen) else [])
    calls, costs, timing = _measure(cfg, target, draft, encoded, eos, pad, device)

    # What serving the draft adds: tensors it shares with the target count once, in the target.
    weights = {"draft_weights_mb": memory.weights_bytes(draft, shared_with=target) / memory.MB,
               "shared_with_target_mb": shared_mb,
               # copies of weights the CPU fast path reordered in this run (calibrate made them, so both modes'
               # peaks hold them); the gate counts every copy it may make instead (eval/memory.py)
               "draft_packed_mb": fast_linear.packed_mb(draft, shared_with=target),
               "target_packed_mb": fast_linear.packed_mb(target)}
    rows = []
    for b in cfg.batch_size:
        base = [c for c in calls if c.batch_size == b and c.mode == "baseline"]
        for k in cfg.proposals(b):
            spec = [c for c in calls if c.batch_size == b and c.k == k]
            accounted = _accounted(cfg, target, draft, longest, k, b)
            rows.append(_config_row(cfg, prompts, base, spec, k, b, costs[b], {**weights, **accounted}))
    _judge(cfg, rows, target, draft, encoded[0])
    best, fastest = _recommend(rows, cfg.recommend_by)
    result = _assemble(cfg, prompts, rows, best, fastest, best["equivalence"], costs, device, timing)
    if chosen_k is not None:
        result["choose_k"] = chosen_k
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_samples(out_dir / "samples.jsonl", prompts, best)
    result["plots"] = plots.make_all(result, rows, best, out_dir, cfg.plot_format)
    report.write(result, out_dir)
    if wandb_run is not None:
        _log_wandb(wandb_run, result, out_dir)
    return result


def _measure(cfg: EvalConfig, target, draft, encoded: list[list[int]], eos, pad, device: torch.device):
    """The timed A/B loop over batch sizes and batches; returns (calls, costs per batch size, loop timing)."""
    sampling, memory = cfg.sampling(), PeakMemory(device)
    calls: list[Call] = []
    costs: dict[int, dict] = {}
    decoder_seconds, loop_seconds = 0.0, 0.0
    n = len(encoded)
    bar = tqdm(total=sum(-(-n // b) * (1 + len(cfg.proposals(b))) for b in cfg.batch_size), desc="eval", unit="call")
    for b in cfg.batch_size:
        ks = cfg.proposals(b)
        groups = [list(range(i, min(i + b, n))) for i in range(0, n, b)]
        first_ids, first_mask = left_pad([encoded[i] for i in groups[0]], pad, device)
        # Cost ratios on the first batch's common (unpadded) suffix: the decoders' per-step shapes.
        nodes = sorted({proposals.verified_nodes(k) for k in ks})
        costs[b] = measure_costs(target, draft, first_ids[:, first_mask.all(0)], nodes, cfg.cost_repeats)
        for _ in range(cfg.warmup):
            for k in [None, *ks]:
                _decode(target, draft, k, first_ids, first_mask, sampling, cfg, eos, pad, torch.Generator(device=device))
        loop_start = time.perf_counter()
        for gi, group in enumerate(groups):
            ids, mask = left_pad([encoded[i] for i in group], pad, device)
            order = [None, *ks] if gi % 2 == 0 else [*ks[::-1], None]  # A/B: alternate who goes first
            for k in order:
                gen = torch.Generator(device=device).manual_seed(cfg.seed + gi)
                memory.reset()
                _sync(device)
                t0 = time.perf_counter()
                res = _decode(target, draft, k, ids, mask, sampling, cfg, eos, pad, gen)
                _sync(device)
                seconds = time.perf_counter() - t0
                decoder_seconds += seconds
                peak = memory.read_mb()
                new = res.sequences[:, res.prompt_length:].tolist()
                lengths = metrics.generated_lengths(new, eos)
                calls.append(Call("baseline" if k is None else "speculative", k, b, group, seconds, res.timings,
                                  [row[:n] for row, n in zip(new, lengths)], peak, None if k is None else res.stats))
                bar.update(1)
        loop_seconds += time.perf_counter() - loop_start
    bar.close()
    return calls, costs, {"loop_s": loop_seconds, "decoder_s": decoder_seconds}


def _judge(cfg: EvalConfig, rows: list[dict], target, draft, first_prompt: list[int]) -> None:
    """Fill each row's equivalence and decision."""
    if cfg.sampling().greedy:
        # A mismatch in any configuration means the decoder is not exact here: no configuration is enabled.
        all_passed = all(r["equivalence"]["passed"] for r in rows)
        for row in rows:
            row["equivalence"] = {**row["equivalence"], "all_configurations_passed": all_passed}
            row["equivalence"]["passed"] = row["equivalence"]["passed"] and all_passed
    else:
        check = None
        if cfg.equivalence_samples:
            log.info("sampling: checking the first two tokens' distribution on prompt 0 (%d draws)", cfg.equivalence_samples)
            check = check_pair(target, draft, [first_prompt], cfg.sampling(), cfg.equivalence_samples,
                               min(64, cfg.equivalence_samples), seed=cfg.seed, label=f"{cfg.target} + {cfg.draft}")
        eq = equivalence.sampling_equivalence(check)
        for row in rows:
            row["equivalence"] = eq
    for row in rows:
        row["decision"] = decision_mod.decide(
            row["speculative"]["acceptance_rate"], row["speedup"], row["equivalence"]["passed"],
            row["memory"]["overhead_mb"], row["memory"]["target_only_mb"], cfg.thresholds(),
            row["speculative"]["fallback"])


def _decode(target, draft, k, ids, mask, sampling, cfg, eos, pad, gen):
    mask = None if bool(mask.all()) else mask
    if k is None:
        return target_generate(target, ids, mask, sampling, cfg.max_new_tokens, eos, gen, pad, timing=True)
    if proposals.is_tree(k):
        return speculative_generate(target, draft, ids, mask, sampling=sampling, max_new_tokens=cfg.max_new_tokens,
                                    eos_token_id=eos, generator=gen, pad_token_id=pad, timing=True, tree=k)
    return speculative_generate(target, draft, ids, mask, k, sampling, cfg.max_new_tokens, eos, gen, pad, timing=True)


def _config_row(cfg, prompts, base: list[Call], spec: list[Call], k: int, b: int, cost: dict, mem: dict) -> dict:
    """Every figure of one (k or tree, batch size) configuration."""
    bm, sm = _mode_metrics(base), _mode_metrics(spec)
    d = proposals.depth(k)
    st = _spec_stats(spec, d)
    sm.update(st)
    by_row_base = {r: t for c in base for r, t in zip(c.rows, c.tokens)}
    by_row_spec = {r: t for c in spec for r, t in zip(c.rows, c.tokens)}
    # Peak memory per batch of prompts, to pair each speculative call with the baseline call on the same batch.
    by_group_base, by_group_spec = ({tuple(c.rows): c.peak_mb for c in calls} for calls in (base, spec))
    groups = sorted(by_group_base)
    order = sorted(by_row_base)
    eq = equivalence.greedy_equivalence([prompts[i].prompt_id for i in order], [by_row_base[i] for i in order],
                                        [by_row_spec[i] for i in order])
    v = cost["v"][str(proposals.verified_nodes(k))]
    return {
        "num_draft_tokens": d, "tree": k if proposals.is_tree(k) else None, "proposal": proposals.label(k),
        "batch_size": b,
        "baseline": bm, "speculative": sm,
        "speedup": metrics.speedup(bm["seconds"], sm["seconds"]),
        "analytical_speedup": metrics.analytical_speedup(st["per_position_acceptance"], cost["c"], v),
        "expected_tokens_per_round": metrics.expected_tokens_per_round(st["per_position_acceptance"]),
        "cost": {"c": cost["c"], "v": v},
        # the gate reads the accounted overhead_mb; the measured peaks' figure is informational (it moves between runs)
        "memory": {**mem, "rss_overhead_mb": metrics.memory_overhead_mb(
            [by_group_base[g] for g in groups], [by_group_spec[g] for g in groups],
            mem["draft_weights_mb"] + mem["draft_packed_mb"])},
        "equivalence": eq,
        "categories": _categories(prompts, base, spec, d),
        "samples": [(prompts[i].prompt_id, prompts[i].category, by_row_base[i], by_row_spec[i]) for i in order],
    }


def _recommend(rows: list[dict], by: str) -> tuple[dict, dict]:
    """(recommended, fastest): the best row by the chosen metric among those whose verdict is enable, and the best
    overall, which is also the recommended one when no row passes (ties: smaller k, then smaller batch)."""
    key = {
        "speedup": lambda r: -r["speedup"],
        "tokens_per_s": lambda r: -r["speculative"]["tokens_per_s"],
        "latency_p50": lambda r: r["speculative"]["latency_s"]["p50"],
        "latency_p95": lambda r: r["speculative"]["latency_s"]["p95"],
    }[by]
    index = list(range(len(rows)))  # rows are dicts (unhashable): choose among their positions
    chosen, fastest = decision_mod.prefer_passing(
        index, lambda i: (key(rows[i]), rows[i]["num_draft_tokens"], rows[i]["batch_size"]),
        {i: rows[i]["decision"]["failed_gates"] for i in index})
    return rows[chosen], rows[fastest]


def _public(mode: dict) -> dict:
    return {k: v for k, v in mode.items() if k not in ("latencies", "fallback")} | (
        {"fallback": mode["fallback"]} if "fallback" in mode else {})


def _row_name(row: dict) -> dict:
    return {"num_draft_tokens": row["num_draft_tokens"], "tree": row["tree"], "proposal": row["proposal"],
            "batch_size": row["batch_size"]}


def _assemble(cfg, prompts, rows, best, fastest, eq, costs, device, timing) -> dict:
    config = {
        "target": cfg.target, "draft": cfg.draft, "num_draft_tokens": best["num_draft_tokens"], "tree": best["tree"],
        "temperature": cfg.temperature, "top_k": cfg.top_k, "top_p": cfg.top_p,
        "max_new_tokens": cfg.max_new_tokens, "batch_size": best["batch_size"], "seed": cfg.seed,
        "num_prompts": len(prompts), "warmup": cfg.warmup, "prompts": cfg.prompts,
        "use_chat_template": cfg.use_chat_template, "dtype": cfg.dtype,
        "sweep_num_draft_tokens": cfg.num_draft_tokens, "sweep_tree": cfg.tree, "sweep_batch_size": cfg.batch_size,
        "recommend_by": cfg.recommend_by,
        "thresholds": dataclasses.asdict(cfg.thresholds()),
    }
    result = {
        "config": config,
        "environment": metrics.environment(device),
        "cpu_linear_kernels": fast_linear.choices(),  # what specdec/fast_linear.py measured and kept in this run
        "cpu_linear_unpacked_for_memory": fast_linear.skipped_for_memory(),  # shapes given no reordered copy
        "baseline": _public(best["baseline"]),
        "speculative": _public(best["speculative"]),
        "speedup": best["speedup"],
        "analytical_speedup": best["analytical_speedup"],
        "expected_tokens_per_round": best["expected_tokens_per_round"],
        "cost": {**best["cost"], **{k: v for k, v in costs[best["batch_size"]].items() if k not in ("c", "v")}},
        "memory": best["memory"],
        "equivalence": eq,
        "decision": best["decision"],
        # the best configuration whose verdict is enable (the best overall when none is), and the best overall
        "recommended": {**_row_name(best), "by": cfg.recommend_by,
                        "fastest": {**_row_name(fastest), "verdict": fastest["decision"]["verdict"],
                                    "failed_gates": fastest["decision"]["failed_gates"]}},
        # The measurement loop's wall time vs the time inside decoder calls (cost timing and warm-up excluded).
        "harness": {**timing, "overhead_fraction": max(0.0, 1 - timing["decoder_s"] / timing["loop_s"])
                    if timing["loop_s"] else 0.0},
    }
    if best["categories"]:
        result["categories"] = best["categories"]
    if len(rows) > 1:
        result["sweep"] = [{
            "num_draft_tokens": r["num_draft_tokens"], "tree": r["tree"], "proposal": r["proposal"],
            "batch_size": r["batch_size"], "speedup": r["speedup"], "analytical_speedup": r["analytical_speedup"],
            "baseline_tokens_per_s": r["baseline"]["tokens_per_s"],
            "speculative_tokens_per_s": r["speculative"]["tokens_per_s"],
            "acceptance_rate": r["speculative"]["acceptance_rate"],
            "mean_accepted_tokens": r["speculative"]["mean_accepted_tokens"],
            "per_position_acceptance": r["speculative"]["per_position_acceptance"],
            "nodes_per_round": r["speculative"]["nodes_per_round"],
            "baseline_latency_p50_s": r["baseline"]["latency_s"]["p50"],
            "speculative_latency_p50_s": r["speculative"]["latency_s"]["p50"],
            "c": r["cost"]["c"], "v": r["cost"]["v"],
            "equivalence_passed": r["equivalence"]["passed"], "mismatches": r["equivalence"]["mismatches"],
            "verdict": r["decision"]["verdict"], "failed_gates": r["decision"]["failed_gates"],
        } for r in rows]
    return result


def _write_samples(path: Path, prompts, best: dict) -> None:
    with path.open("w") as f:
        for pid, cat, base, spec in best["samples"]:
            f.write(json.dumps({"prompt_id": pid, "category": cat, "baseline_tokens": base,
                                "speculative_tokens": spec}) + "\n")


def _start_wandb(cfg: EvalConfig, out_dir: Path):
    try:
        import wandb
    except ImportError as err:
        raise ValueError("report_to=wandb needs wandb: pip install 'specdec[wandb]' (or set report_to=none)") from err
    # The run's files beside the report (as training keeps its own beside the checkpoints), not wherever
    # $WANDB_DIR pointed when wandb first started in this process.
    out_dir.mkdir(parents=True, exist_ok=True)
    return wandb.init(project="specdec", name=cfg.run_name, job_type="eval", config=dataclasses.asdict(cfg),
                      dir=str(out_dir))


def _log_wandb(run, result: dict, out_dir: Path) -> None:
    import wandb

    run.summary.update({
        "speedup": result["speedup"], "analytical_speedup": result["analytical_speedup"],
        "acceptance_rate": result["speculative"]["acceptance_rate"],
        "mean_accepted_tokens": result["speculative"]["mean_accepted_tokens"],
        "baseline_tokens_per_s": result["baseline"]["tokens_per_s"],
        "speculative_tokens_per_s": result["speculative"]["tokens_per_s"],
        "verdict": result["decision"]["verdict"], "equivalence_passed": result["equivalence"]["passed"],
    })
    if result.get("sweep"):
        cols = [c for c in result["sweep"][0] if not isinstance(result["sweep"][0][c], (list, dict))]
        run.log({"sweep": wandb.Table(columns=cols, data=[[r[c] for c in cols] for r in result["sweep"]])})
    run.log({name: wandb.Image(str(out_dir / file)) for name, file in result["plots"].items() if file.endswith(".png")})
    run.finish()
