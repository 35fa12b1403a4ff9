"""Acceptance under sampling beside the timed run (`sampled_acceptance_temperature`): users serve drafts at
temperatures above 0, where acceptance differs from greedy's, so one more speculative pass measures it there.

The pass decodes the same prompts with the recommended proposal at its batch size, the temperature alone warping
p and q (no top-k / top-p), each batch seeded by the run's seed as the timed loop seeds its own. It is untimed and
has no target-only pass beside it: acceptance needs none, and no speed gate reads it (the decision stays the timed
run's). Its counters are report.json's `sampled`."""

from __future__ import annotations

import torch

from specdec.decode import speculative_generate
from specdec.eval.config import EvalConfig
from specdec.eval.result import NAME_KEYS
from specdec.eval.rows import spec_summary
from specdec.eval.workload import Workload
from specdec.outputs import DecodeStats
from specdec.proposal import Proposal
from specdec.sampling import SamplingConfig
from specdec.tokens import left_pad


def measure_sampled(cfg: EvalConfig, w: Workload, best: dict) -> dict:
    """The speculative counters of one seeded pass at `cfg.sampled_acceptance_temperature` over every prompt, with
    `best`'s proposal and batch size (a row of eval/rows.py)."""
    proposal = Proposal.of(best["tree"] or best["num_draft_tokens"])
    sampling = SamplingConfig(temperature=cfg.sampled_acceptance_temperature)
    batch, n, stats = best["batch_size"], len(w.encoded), []
    for gi, start in enumerate(range(0, n, batch)):
        ids, mask = left_pad(w.encoded[start:start + batch], w.pad, w.device)
        generator = torch.Generator(device=w.device).manual_seed(cfg.seed + gi)
        out = speculative_generate(w.target, w.draft, ids, None if bool(mask.all()) else mask, proposal,
                                   sampling=sampling, max_new_tokens=cfg.max_new_tokens, eos_token_id=w.eos,
                                   generator=generator, pad_token_id=w.pad)
        stats.append(out.stats)
    return {"temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p,
            **{key: best[key] for key in NAME_KEYS}, "batch_size": batch, "num_prompts": n, "seed": cfg.seed,
            **spec_summary(DecodeStats.merged(stats))}
