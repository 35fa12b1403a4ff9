"""bench/kinds.py's measurement of one published draft: `specdec eval` with choose_k (as the demo runs it; with
vLLM beside it unless --no-vllm), then the draft's cost per round at k, timed through its own drafter.

eval's cost calibration (eval/timing.py: `measure_costs`) times c, one draft forward of one new position, and
choose_k multiplies it by the kind's draft forwards per round (k for EAGLE-3, 1 for the kinds that propose a whole
round at once). A parallel kind's one forward still feeds k positions (PARD's and P-EAGLE's k - 1 mask slots,
DFlash's block), so its cost at k = 4 against k = 1 is measured here as the round itself: each `Drafter.propose`
of k tokens inside greedy decodes at that k (the decoder's own calls, after the tokens the round before accepted),
over a cached target step timed between them.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from unittest import mock

import torch

from specdec import speculative_generate
from specdec.draft_registry import make_drafter
from specdec.eval.timing import _CachedStep, sync
from specdec.fast_linear import fast_linears

# Greedy decodes per k timing the rounds, and their length: each gives a round every tau tokens, so 3 x 32 tokens
# give medians over dozens of rounds at every k, in seconds
ROUND_PASSES, ROUND_TOKENS = 3, 32


class _TimedProposals:
    """The decoder's drafters, each `propose` call timed (device-synchronised): a round's draft work as decoding
    does it, after the accepted tokens of the round before."""

    def __init__(self, device: torch.device, clock=time.perf_counter):
        self.device, self.clock, self.seconds = device, clock, []

    def __call__(self, draft, target, sampling):
        drafter = make_drafter(draft, target, sampling)
        propose, first = drafter.propose, [True]

        def timed(batch, k, generator, stats):
            sync(self.device)
            started = self.clock()
            out = propose(batch, k, generator, stats)
            sync(self.device)
            if not first[0]:  # a call's first round also reads the whole prompt: not a round's cost
                self.seconds.append(self.clock() - started)
            first[0] = False
            return out

        drafter.propose = timed
        return drafter


def round_costs(target, draft, ids: torch.Tensor, ks: list[int], repeats: int, max_new_tokens: int,
                eos=None, clock=time.perf_counter) -> dict:
    """{k: the draft's median round of k proposals / one cached target step}: greedy decodes of `ids` at each k,
    `repeats` passes in an order rotating from pass to pass (as eval/timing.py's `measure_costs`, against drift),
    a cached target step timed between them; each pass's first is a warm-up."""
    timers = {k: _TimedProposals(ids.device, clock) for k in ks}
    target_step, step_times = _CachedStep(target, ids, 1), []
    with torch.inference_mode():
        for i in range(repeats + 1):
            for k in ks[i % len(ks):] + ks[: i % len(ks)]:
                with mock.patch("specdec.decode.make_drafter", timers[k]):
                    speculative_generate(target, draft, ids, num_draft_tokens=k, max_new_tokens=max_new_tokens,
                                         eos_token_id=eos)
                with fast_linears(target):
                    sync(ids.device)
                    started = clock()
                    target_step()
                    sync(ids.device)
                    step_times.append(clock() - started)
            if i == 0:  # warm-up pass: the kernels' first measurement, the first allocations
                for timer in timers.values():
                    timer.seconds.clear()
                step_times.clear()
    step = statistics.median(step_times)
    return {str(k): statistics.median(t.seconds) / step if t.seconds else math.nan for k, t in timers.items()}


def eval_child(spec: dict) -> dict:
    """`specdec eval` of one published draft with choose_k (and vLLM when asked), then its round costs."""
    from specdec.eval.config import EvalConfig
    from specdec.eval.engine import EngineError
    from specdec.eval.proposals import label
    from specdec.eval.runner import run
    from specdec.eval.workload import load_workload

    cfg = EvalConfig(**spec["eval"])
    loaded = []

    def keep(eval_cfg):  # the run's own models, loaded and calibrated once, then timed again below
        loaded.append(load_workload(eval_cfg))
        return loaded[-1]

    with mock.patch("specdec.eval.runner.load_workload", keep):
        try:
            report = run(cfg)
        except EngineError as err:  # vLLM's part incomplete: its report keeps what finished; the error says what
            print(f"engine run incomplete: {err}", flush=True)
            report = json.loads((cfg.out_dir() / "report.json").read_text())
    chosen = report["config"]["num_draft_tokens"]
    choose = report["choose_k"]
    workload = loaded[-1]
    ks = sorted({1, chosen, max(spec["cost_ks"])})
    rounds = round_costs(workload.target, workload.draft, torch.tensor([workload.encoded[0]]), ks,
                         min(cfg.cost_repeats, ROUND_PASSES), min(cfg.max_new_tokens, ROUND_TOKENS), workload.eos)
    engine = report.get("engine") or {}
    vllm = {str(row["concurrency"]): row["speedup"] for row in engine.get("sweep") or []
            if row["method"] == engine.get("primary_method") and row.get("speedup") is not None}
    return {"k": chosen, "c": choose["c"], "v": choose["v"], "predicted": choose["predicted_speedup"][label(chosen)],
            "replayed_tau": choose["tau"][label(chosen)], "speedup": report["speedup"],
            "measured_tau": report["speculative"]["mean_accepted_tokens"], "round_cost": rounds,
            "equivalence": report["equivalence"]["passed"], "vllm": vllm,
            "vllm_complete": engine.get("complete"), "vllm_mismatches": (engine.get("equivalence") or {}).get(
                "mismatches")}
