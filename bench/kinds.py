"""The draft kinds side by side on one budget (issues 36 and 37): the demo's data, the same training minutes for each
kind, then each draft's held-out acceptance, its cost per round and its speedup in specdec's decoder and in vLLM.

    python bench/kinds.py                                 # every default kind, 3 min of training each (~60 min)
    python bench/kinds.py --kinds eagle3 dflash-b4 --minutes 5 --no-vllm
    python bench/kinds.py --data runs/smollm2-135m-eagle3/data        # a demo run's data (recorded states)
    python bench/kinds.py --quick --no-vllm --kinds eagle3 dflash-b4  # tiny: the plumbing in a few minutes

Kinds (bench/kinds_runs.py: KINDS): `eagle3` (the demo recipe's draft, its settings), `dflash-b4`, `dflash-b8`
(DFlash blocks of 4 and 8 slots, one layer), `dflash-b4-l2` (blocks of 4, two layers; only when named),
`peagle` (P-EAGLE, 4 proposals a forward) and `parallel` (PARD: the plain recipe's derived draft, 4 tokens a
forward). Each trains with specdec's trainer for `--minutes` (`max_minutes`: the schedule fitted to the steps that
fit), one process at a time on every core, on the same rows. Then, per kind, in its own processes:

- held-out acceptance per position (chain of 4) and tau(1..4): the trainer's own held-out replay of the final
  draft over every held-out row (its kind's `evaluate`, run after the budget, the same way for every kind);
- `specdec eval` of the published draft with choose_k over k = 1..4 (DFlash: up to its block's proposals), as
  the demo runs it: c (eval's cost calibration: one draft forward over one target step), the predicted speedup
  tau / (forwards c + v(k + 1)) and the measured one at one client, greedy float32; with vLLM (unless
  `--no-vllm`): `engine=specdec,vllm` at 1 and 4 clients, the draft served as its kind is
  (eval/engine/vllm.py), at the k specdec chose;
- the draft's cost per round at k (bench/kinds_eval.py: its drafter's `propose` of k tokens over one cached target
  step), and at k = 4 against k = 1 (issue 37 asks at most 1.5x of the kinds that propose a round in one forward).

Data: `--data FOLDER` (e.g. a demo run's `data`), which must record the target's states at the demo recipe's
layers, or else made once under `--work` as bench/peer.py makes its data; the held-out folder likewise. Writes
docs/results/<date>-<name>.md (or `--out PAGE`).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path

import kinds_runs  # bench/kinds_runs.py (this script runs with bench/ on its path)
import peer  # bench/peer.py

ROOT = peer.ROOT
DEFAULT_KINDS = [k for k in kinds_runs.KINDS if k != "dflash-b4-l2"]
PARALLEL_KINDS = ("dflash", "peagle", "parallel")  # propose a whole round in one draft forward
# Minutes each kind costs besides its training, on a 2-core CPU: loading, scoring, publishing, eval (and vLLM)
OVERHEAD_MINUTES, VLLM_MINUTES, DATA_MINUTES = 4.0, 4.0, 2.5
QUICK = {"minutes": 0.1, "train_prompts": 8, "heldout_prompts": 4, "max_new_tokens": 24, "eval_prompts": 2,
         "eval_new_tokens": 16, "batch": 4, "max_length": 256, "cost_repeats": 2,
         "vllm_args": "--enforce-eager,--distributed-executor-backend,uni"}  # vLLM's quick start (the engine tests')


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", nargs=2, metavar=("ROLE", "SPEC"), help=argparse.SUPPRESS)
    parser.add_argument("--kinds", nargs="+", default=DEFAULT_KINDS, choices=list(kinds_runs.KINDS))
    parser.add_argument("--minutes", type=float, default=3.0, help="training minutes of every kind (max_minutes)")
    parser.add_argument("--data", type=Path, help="training data folder with recorded states (default: made once "
                        "under --work)")
    parser.add_argument("--heldout", type=Path, help="held-out data folder with recorded states (default: made once "
                        "under --work)")
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / "kinds", help="data, runs and reports go here")
    parser.add_argument("--no-vllm", action="store_true", help="specdec's decoder only (no vLLM servers)")
    parser.add_argument("--report-only", action="store_true",
                        help="write the page from the kinds' outcome.json under --work (an earlier run's), rerun nothing")
    parser.add_argument("--quick", action="store_true", help="tiny data, budget and eval: the plumbing only")
    parser.add_argument("--train-prompts", type=int, default=192, help="shipped training prompts answered")
    parser.add_argument("--heldout-prompts", type=int, default=48, help="shipped held-out prompts answered")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="the data's answers")
    parser.add_argument("--eval-prompts", type=int, default=8, help="held-out prompts each eval decodes")
    parser.add_argument("--eval-new-tokens", type=int, default=64)
    parser.add_argument("--concurrency", default="1,4", help="vLLM's client counts")
    parser.add_argument("--vllm-args", default="", help="extra `vllm serve` arguments, comma-separated")
    parser.add_argument("--batch", type=int, default=0, help="rows a step (default: the recipe's)")
    parser.add_argument("--max-length", type=int, default=0, help="default: the recipe's")
    parser.add_argument("--cost-repeats", type=int, default=10)
    parser.add_argument("--name", default="kinds", help="results page name")
    parser.add_argument("--out", type=Path, help="write the page here instead of docs/results/")
    args = parser.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            if parser.get_default(key) == getattr(args, key):
                setattr(args, key, value)
    return args


def check_recorded(folder: Path, layers: list[int], what: str) -> None:
    """A given data folder records the target's states at the layers the hidden-state kinds read."""
    manifest = folder / "manifest.json"
    if not manifest.is_file():
        raise ValueError(f"{what} {folder} has no manifest.json: pass a `specdec data` folder (or leave {what} out "
                         "to have the bench make one)")
    recorded = (json.loads(manifest.read_text()).get("features") or {}).get("layer_ids")
    if recorded != layers:
        raise ValueError(f"{what} {folder} records the target's states at layers {recorded}, the kinds read {layers}: "
                         f"make it with record_features=true eagle_aux_layer_ids={json.dumps(layers)}, or leave "
                         f"{what} out")


def data_folders(args, layers: list[int]) -> tuple[Path, Path, float]:
    """The training and held-out folders (given, or made once under --work) and the minutes spent making them."""
    started = time.perf_counter()
    data = args.data.resolve() if args.data else args.work / "data"
    heldout = args.heldout.resolve() if args.heldout else args.work / "data_heldout"
    for folder, given, prompts, limit in ((data, args.data, "embedded:train", args.train_prompts),
                                          (heldout, args.heldout, "embedded:heldout", args.heldout_prompts)):
        if given:
            check_recorded(folder, layers, "--data" if folder == data else "--heldout")
        else:
            peer.make_data(folder, prompts, limit, args.max_new_tokens, layers)
    return data, heldout, (time.perf_counter() - started) / 60


def eval_settings(args, kind: str, published: str, out: Path) -> dict:
    """EvalConfig keys of one kind's eval: choose_k over its chains, greedy float32, vLLM beside it when asked."""
    ks = list(range(1, kinds_runs.max_k(kind) + 1))
    vllm = {} if args.no_vllm else {
        "engine": ["specdec", "vllm"], "concurrency": [int(c) for c in args.concurrency.split(",")],
        "vllm_args": [a for a in args.vllm_args.split(",") if a]}
    return {"target": peer.TARGET, "draft": published, "prompts": "embedded:heldout", "num_prompts": args.eval_prompts,
            "max_new_tokens": args.eval_new_tokens, "num_draft_tokens": [ks[-1]], "choose_k": ks, "dtype": "float32",
            "device": "cpu", "out": str(out), "cost_repeats": args.cost_repeats, "warmup": 0 if args.quick else 1,
            **vllm}


def measure_kind(args, kind: str, train: dict, data: Path, heldout: Path) -> dict:
    """Train, score, publish, then evaluate one kind; its figures."""
    work = args.work / f"kind-{kind}"
    shutil.rmtree(work, ignore_errors=True)  # every run starts afresh
    work.mkdir(parents=True)
    config = kinds_runs.kind_config(kind, train, data, heldout, work / "train", args.minutes,
                                    batch=args.batch or None, max_length=args.max_length or None)
    print(f"== {kind}: training {args.minutes:g} min", flush=True)
    script = Path(__file__).resolve()
    trained = kinds_runs.run_child(script, "train", {"kind": kind, "config": config, "heldout_rows": 10**9},
                                   work / "train.log")
    print(f"{kind}: {trained['steps']} steps, held-out tau {trained['tau']}", flush=True)
    # --quick: no measuring of the CPU linear kernels (specdec/fast_linear.py), most of a tiny eval's time
    evaluated = kinds_runs.run_child(script, "eval", {
        "kind": kind, "eval": eval_settings(args, kind, trained["published"], work / "eval"),
        "cost_ks": kinds_runs.KS}, work / "eval.log", {"SPECDEC_FAST_LINEAR": "0"} if args.quick else None)
    print(f"{kind}: k {evaluated['k']}, speedup {evaluated['speedup']:.3f}, vLLM {evaluated['vllm']}", flush=True)
    out = {**trained, **evaluated, "config": config}
    (work / "outcome.json").write_text(json.dumps(out, indent=1))
    return out


def fmt(x, spec: str = ".3f") -> str:
    return "n/a" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def ratio(a, b) -> str:
    ok = all(isinstance(x, (int, float)) and math.isfinite(x) for x in (a, b)) and b
    return f"x{a / b:.2f}" if ok else "n/a"


def figures(out: dict, concurrency: list[int]) -> dict:
    """One kind's figures as the table reads them."""
    rounds = out["round_cost"]
    return {"tau4": out["tau"][str(max(kinds_runs.KS))], "round_k": rounds[str(out["k"])],
            "round_4_1": rounds[str(max(kinds_runs.KS))] / rounds["1"], "predicted": out["predicted"],
            "speedup": out["speedup"], **{f"vllm{c}": out["vllm"].get(str(c)) for c in concurrency}}


def table(outcome: dict, concurrency: list[int]) -> list[str]:
    """One row per kind: every figure, then the ratios against EAGLE-3 of the same run."""
    base = figures(outcome["eagle3"], concurrency) if "eagle3" in outcome else {}
    compared = ["tau4", "round_k", "predicted", "speedup", *(f"vllm{c}" for c in concurrency)]
    vllm_heads = [f"vLLM {c} client{'s' * (c > 1)}" for c in concurrency]
    head = "| " + " | ".join(["kind", "steps", "acceptance @1..4", "tau(1..4)", "k", "c", "round at k",
                              "round k=4 / k=1", "predicted", "measured", *vllm_heads,
                              "vs EAGLE-3: " + ", ".join(["tau(4)", "round at k", "predicted", "measured",
                                                          *(f"vLLM {c}" for c in concurrency)])]) + " |"
    rows = [head, "|---|" + "---:|" * (10 + len(concurrency))]
    for kind, out in outcome.items():
        f = figures(out, concurrency)
        rows.append(
            f"| {kind} | {out['steps']} | " + " / ".join(fmt(a, ".2f") for a in out["per_position"]) + " | "
            + " / ".join(fmt(out["tau"][str(k)], ".2f") for k in kinds_runs.KS)
            + f" | {out['k']} | {fmt(out['c'])} | {fmt(f['round_k'])} | {fmt(f['round_4_1'], '.2f')} | "
            f"{fmt(f['predicted'])} | {fmt(f['speedup'])} | "
            + "".join(fmt(f[f"vllm{c}"]) + " | " for c in concurrency)
            + ", ".join(ratio(f[key], base.get(key)) for key in compared) + " |")
    return rows


def report_body(args, outcome: dict, facts: dict) -> str:
    concurrency = [] if args.no_vllm else [int(c) for c in args.concurrency.split(",")]
    parallel = [(kind, figures(o, concurrency)["round_4_1"]) for kind, o in outcome.items()
                if o["config"]["draft"] in PARALLEL_KINDS]
    held = json.loads((facts["heldout"] / "manifest.json").read_text()).get("counts", {}).get("examples", "?")
    return "\n".join([
        f"Every kind: specdec's trainer for {args.minutes:g} minutes of training (`max_minutes`, the schedule fitted), "
        f"one process at a time on every core, at the demo recipe's shared train settings (bench/kinds_runs.py; "
        f"each kind's own keys below). Data: `{facts['data'].name}` "
        f"({'given' if args.data else f'{args.train_prompts} shipped training prompts'}), held-out "
        f"`{facts['heldout'].name}` ({held} examples), target states recorded at layers {facts['layers']} (made "
        f"in {facts['data_minutes']:.1f} min this run, 0 = reused).", "",
        "Held-out (the trainer's own replay of the final draft over every held-out row): acceptance @j = P(proposal "
        "j accepted | proposals < j accepted) in chain rounds of 4; tau(k) = mean accepted tokens per round, chain "
        f"of k. specdec's decoder (`specdec eval`, {args.eval_prompts} held-out prompts, {args.eval_new_tokens} new "
        "tokens, greedy float32, one client): k = choose_k's pick among 1..4 (DFlash: up to its block's proposals); "
        "c = eval's cost calibration, one draft forward over one target step; round at k = the draft's round of k "
        "proposals (its drafter's `propose`) over one target step; predicted = tau / (forwards c + v(k + 1)) from "
        "the replay, measured = target-only wall time / speculative wall time. vLLM: the same draft served as its "
        "kind is, same k and prompts, speedup at that many closed-loop clients"
        + (" (not run: --no-vllm)." if args.no_vllm else ".")
        + (" --quick: a tiny budget and eval, the CPU linear kernels unmeasured (SPECDEC_FAST_LINEAR=0): the "
           "plumbing, not figures to read." if args.quick else ""), "",
        *table(outcome, concurrency), "",
        "Round cost at k = 4 against k = 1 of the kinds that propose a round in one forward (issue 37: at most 1.5x): "
        + ("; ".join(f"{kind} {r:.2f}x ({'within' if r <= 1.5 else 'ABOVE'})" for kind, r in parallel) or "none run")
        + ".", "",
        "Settings (TrainConfig keys besides the shared ones):", "",
        *[f"- {kind}: `{json.dumps(kinds_runs.KINDS[kind])}`; {o['steps']} steps in {o['train_minutes']:.1f} min "
          f"(stopped by {o['stopped_by']}); specdec's greedy equivalence {'passed' if o['equivalence'] else 'FAILED'}"
          + ("" if args.no_vllm else f"; vLLM {'complete' if o['vllm_complete'] else 'INCOMPLETE (see its report)'}, "
             f"{o['vllm_mismatches']} mismatches against target-only") for kind, o in outcome.items()], ""])


def estimate_minutes(args) -> float:
    made = 0.0 if args.data else DATA_MINUTES * (args.train_prompts + args.heldout_prompts) / 240
    per_kind = args.minutes + OVERHEAD_MINUTES + (0.0 if args.no_vllm else VLLM_MINUTES)
    return made + len(args.kinds) * per_kind


def child(role: str, spec: dict) -> None:
    import kinds_eval  # bench/kinds_eval.py

    out = kinds_runs.train_child(spec) if role == "train" else kinds_eval.eval_child(spec)
    print("KINDS_RESULT " + json.dumps(out), flush=True)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.child:
        return child(args.child[0], json.loads(args.child[1]))
    import results  # bench/results.py

    if not args.no_vllm:
        from specdec.vllm_env import find_vllm_python

        if find_vllm_python() is None:
            raise SystemExit("bench/kinds.py: error: no vLLM environment (make vllm-env); or pass --no-vllm")
    provenance = results.header("Draft kinds on one training budget")
    print(f"expected time on a 2-core CPU: about {estimate_minutes(args):.0f} min", flush=True)
    train = peer.recipe_train()
    layers = list(train["eagle_aux_layer_ids"])
    args.work = args.work.resolve()
    args.work.mkdir(parents=True, exist_ok=True)
    data, heldout, data_minutes = data_folders(args, layers)
    if args.report_only:  # the page from each kind's outcome.json of an earlier run of this bench, nothing rerun
        outcome = {kind: json.loads((args.work / f"kind-{kind}" / "outcome.json").read_text()) for kind in args.kinds}
    else:
        outcome = {kind: measure_kind(args, kind, train, data, heldout) for kind in args.kinds}
    body = report_body(args, outcome, {"data": data, "heldout": heldout, "layers": layers,
                                       "data_minutes": data_minutes})
    print(body)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(provenance + body.rstrip() + "\n")
        print(f"\nwritten to {args.out}")
    else:
        print(f"\nwritten to {results.write(args.name, 'Draft kinds on one training budget', body, provenance)}")


if __name__ == "__main__":
    try:
        main()
    except ValueError as err:  # a bad argument or folder: one line, as specdec's CLI reports it
        print(f"bench/kinds.py: error: {err}", file=sys.stderr)
        raise SystemExit(2) from err
