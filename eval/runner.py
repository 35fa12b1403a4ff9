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

import dataclasses
import logging
from pathlib import Path

import torch

from specdec import fast_linear
from specdec.eval import engine as engines
from specdec.eval import memory, plots, report
from specdec.eval.choose import choose_num_draft_tokens
from specdec.eval.config import EvalConfig
from specdec.eval.engine import report as engine_report
from specdec.eval.measure import measure
from specdec.eval.result import assemble, write_samples
from specdec.eval.rows import accounted, config_row, judge, recommend
from specdec.eval.sampled import measure_sampled
from specdec.eval.workload import Workload, load_workload
from specdec.proposal import Proposal

log = logging.getLogger(__name__)


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
    w = load_workload(cfg)
    chosen_k = None
    if cfg.choose_k:
        chosen_k = choose_num_draft_tokens(w.target, w.draft, w.encoded[: cfg.choose_k_prompts],
                                           cfg.choose_candidates(), cfg, w.eos, w.pad, w.device, w.longest)
        cfg = cfg.measuring(Proposal.of(chosen_k["chosen"]))
    calls, costs, timing = measure(cfg, w.target, w.draft, w.encoded, w.eos, w.pad, w.device)
    rows = _rows(cfg, w, calls, costs)
    judge(cfg, rows, w.target, w.draft, w.encoded[0])
    best, fastest = recommend(rows, cfg.recommend_by)
    result = assemble(cfg, w.prompts, rows, best, fastest, costs, w.device, timing)
    if chosen_k is not None:
        result["choose_k"] = chosen_k
    if cfg.sampled_acceptance_temperature:  # acceptance where sampled traffic is served: untimed, no gate reads it
        result["sampled"] = measure_sampled(cfg, w, best)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_samples(out_dir / "samples.jsonl", w.prompts, best)
    result["plots"] = plots.make_all(result, rows, best, out_dir, cfg.plot_format)
    report.write(result, out_dir)
    if wandb_run is not None:
        _log_wandb(wandb_run, result, out_dir)
    return result


def _rows(cfg: EvalConfig, w: Workload, calls, costs) -> list[dict]:
    """One row per (proposal, batch size), with what serving the draft adds to memory beside its figures."""
    # tensors the draft shares with the target count once, in the target
    weights = {"draft_weights_mb": memory.weights_bytes(w.draft, shared_with=w.target) / memory.MB,
               "shared_with_target_mb": w.shared_mb,
               # copies of weights the CPU fast path reordered in this run (calibrate made them, so both modes'
               # peaks hold them); the gate counts every copy it may make instead (eval/memory.py)
               "draft_packed_mb": fast_linear.packed_mb(w.draft, shared_with=w.target),
               "target_packed_mb": fast_linear.packed_mb(w.target)}
    rows = []
    for b in cfg.batch_size:
        for p in cfg.proposals(b):
            mem = accounted(cfg, w.target, w.draft, w.longest, p, b)
            rows.append(config_row(cfg, w.prompts, calls, p, b, costs[b], {**weights, **mem}))
    return rows


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
