"""The sampling check in a serving engine: the law of the first two generated tokens of one prompt, drawn once
per seed from each server, against the target's exact law computed with transformers (chi-square and TV, as
`specdec verify`). An engine's API returns sampled tokens, not the draft's distribution, so the output law is
what can be checked; the target-only server's draws are the control."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.eval.engine.client import request_body
from specdec.eval.engine.metrics import settled_delta
from specdec.eval.engine.server import EngineError, Server
from specdec.eval.verify import _last_probs, _setting_label, goodness_of_fit, judge
from specdec.models import load_model

ALPHA = 1e-3  # eval/verify.py's threshold


@dataclass
class FirstTwo:
    """The target's exact law of its first two generated tokens after one prompt (the likeliest first tokens up
    to 99% of p, at most 16, each with every second token; one pooled cell for the rest), from transformers."""

    prompt: list[int]
    exact: object  # torch.Tensor [G * V + 1]
    first: list[int]
    vocab: int
    samples: int

    def cell(self, tokens: list[int]) -> int:
        t1, t2 = (list(tokens) + [0, 0])[:2]
        return self.first.index(t1) * self.vocab + t2 if t1 in self.first else len(self.first) * self.vocab


def exact_first_two(target: str, dtype: str, prompt: list[int], sampling, samples: int) -> FirstTwo:
    """FirstTwo for `prompt`, computed as eval/verify.py's check_pair does, before any server starts."""
    model = load_model(target, dtype, "cpu")
    ids = torch.tensor([prompt])
    p1 = _last_probs(model, ids, sampling)[0]  # [V]
    order = p1.argsort(descending=True)
    first = order[: min(16, int((p1[order].cumsum(0) < 0.99).sum()) + 1)]
    p2 = _last_probs(model, torch.cat([ids.expand(first.numel(), -1), first[:, None]], dim=1), sampling)  # [G, V]
    exact = torch.cat([(p1[first, None] * p2).reshape(-1), (1 - p1[first].sum()).clamp_min(0)[None]])
    return FirstTwo(prompt, exact, [int(t) for t in first], p2.shape[1], samples)


def draw_first_two(server: Server, probe: FirstTwo, sampling, concurrency: int, timeout: float, seed: int,
                   k: int) -> dict:
    """`probe.samples` two-token completions of the probe prompt, one seed each: cell counts and rounds seen."""
    before = server.counters(k)
    reqs, _ = server.generate([probe.prompt] * probe.samples, request_body(sampling, 2), concurrency, timeout,
                              [seed + 100_000 + i for i in range(probe.samples)])
    bad = [r.error for r in reqs if r.error]
    if bad:
        raise EngineError(server.failure(f"failed {len(bad)} request(s) of the sampling check ({bad[0]})"))
    counts = [0] * len(probe.exact)
    for r in reqs:
        counts[probe.cell(r.tokens)] += 1
    drafts = settled_delta(server, before, k, sum(len(r.tokens) for r in reqs))["drafts"]
    return {"counts": counts, "rounds": int(drafts)}


def judge_first_two(probe: FirstTwo, draws: dict, sampling, concurrency: int, engine: str) -> dict:
    """A chi-square and TV test per mode (eval/verify.py's thresholds) of the engine's draws against the exact law."""
    tests = []
    for mode, d in draws.items():
        res = goodness_of_fit(torch.tensor(d["counts"]), probe.exact)
        tests.append(judge({"test": f"{engine} {mode} vs exact", "sampling": _setting_label(sampling),
                            "batch_size": concurrency, **res, "speculative_rounds": d["rounds"]}, ALPHA))
    return {"num_tokens": 2, "alpha": ALPHA, "tests": tests,
            "passed": bool(tests) and all(t["passed"] for t in tests)}
