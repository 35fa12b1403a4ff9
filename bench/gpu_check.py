"""One prepared check of specdec on a CUDA GPU (issue 39): at most 8 minutes, one results page. Without CUDA the same
steps run at tiny shapes (`--tiny`, the default there), so the check is tested where we work (tests/test_gpu_check.py).

    python bench/gpu_check.py                          # CUDA: 8B shapes -> docs/results/<date>-gpu-check.md
    python bench/gpu_check.py --tiny --out /tmp/check  # tiny shapes (no CUDA: the default) -> <date>-gpu-check-tiny.md
    python bench/gpu_check.py --only trainer,costs --minutes 4

On a lent GPU machine (torch, transformers, accelerate and peft installed, no network): first, here,
`bash scripts/gpu_wheels.sh` (the wheels that machine lacks, into build/gpu-wheels/). The device call carries
build/gpu-wheels, installs them and the carried tree (editable: the code checked is the tree's) and runs the check:

    python3 -m pip install -q --no-index --no-deps build/gpu-wheels/*.whl && python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . && PYTHONUNBUFFERED=1 python3 bench/gpu_check.py --minutes 8 --out "$OUT"

and the page it returns goes into docs/results/. Each step runs in its own process with its share of --minutes
(trainer 2/8, peer 1.5/8, costs 1.5/8, in that order; then the tests, with all the time left); one that fails or runs
out of time is written with its error and the end of its log, and the page is rewritten after every step:

  tests    `pytest -m "not slow"` over the tests that skip without CUDA (found by their skipif in tests/)
  trainer  specdec's trainer (train/distill.py's Distiller and its real step; no checkpoint or export) training an
           EAGLE-3 draft of a random target with Llama-3.1-8B's config, drawn on the device, at the train settings
           of recipes/llama3.1-8b-eagle3.yaml (bf16, online states, ttt 7, draft vocabulary 32,000), on rows of
           4,096 tokens (pack=true, every position scored): steps/s, trained tokens/s, and peak memory against the
           memory plan of the same settings (train/plan/: CUDA's peak allocated against the plan less its runtime
           term, which the allocator does not see; a CPU's peak RSS against the whole plan)
  peer     speculators 0.9.0's Eagle3DraftModel (bench/peer.py: its build, batches and loop) on the same rows:
           trained tokens/s (its draft step alone, and with the target's forward for the states added, as specdec's
           online step has it) and peak memory, beside the trainer's
  costs    the decoder's draft cost c and verification cost v(n), n = 1..16, as eval measures them
           (eval/timing.py, bench/costs.py's random model), and target-only and speculative decoding at k = 3
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ROOT / "build" / "gpu-wheels"
GiB = 2**30
STEPS = {"tests": 3.0, "trainer": 2.0, "peer": 1.5, "costs": 1.5}  # each step's share of the default 8 minutes
TITLES = {"tests": "a. The tests that skip without CUDA", "trainer": "b. specdec's trainer at the 8B recipe's shapes",
          "peer": "c. The peer: speculators 0.9.0 on the same rows", "costs": "d. The decoder's costs"}


# ---- a. the tests ---------------------------------------------------------------------------------------------------
SKIP_WITHOUT_CUDA = re.compile(r"skipif\(\s*not torch\.cuda\.is_available\(\)")


def cuda_tests() -> list[str]:
    """The pytest node ids that skip without CUDA: a file with a module-level skipif, or the test below one."""
    nodes = []
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        lines, rel = path.read_text().splitlines(), path.relative_to(ROOT).as_posix()
        for i, line in enumerate(lines):
            if not SKIP_WITHOUT_CUDA.search(line):
                continue
            if line.lstrip().startswith("pytestmark"):
                nodes = [n for n in nodes if not n.startswith(rel)] + [rel]
                break
            below = (re.match(r"\s*(?:async\s+)?(?:def|class)\s+(\w+)", x) for x in lines[i + 1:])
            name = next((m for m in below if m), None)
            if name:
                nodes.append(f"{rel}::{name.group(1)}")
    return nodes


def pytest_figures(log: str) -> dict:
    """Counts (the summary line, or the per-test lines of a run stopped early), failures and the slowest tests."""
    outcomes = re.findall(r"::\S+ (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)", log)
    summary = next((x.strip("= ") for x in reversed(log.splitlines())
                    if re.search(r"\d+ (passed|failed|skipped|error)", x) and " in " in x), "")
    counts = {k: len([o for o in outcomes if o == k.upper()]) for k in ("passed", "failed", "skipped", "error")}
    for n, k in re.findall(r"(\d+) (passed|failed|skipped|error)", summary):
        counts[k] = int(n)
    durations = log.split("slowest", 1)[1].splitlines()[1:6] if "slowest" in log else []
    return {**counts, "summary": summary or "(no summary: the run was stopped)",
            "failures": [x for x in log.splitlines() if x.startswith(("FAILED ", "ERROR "))][:20],
            "slowest": [x.strip() for x in durations if re.match(r"\s*\d", x)]}


def tests_step(work: Path, cap_s: float) -> dict:
    nodes = cuda_tests()
    log = work / "tests.log"
    command = [sys.executable, "-m", "pytest", "-v", "-m", "not slow", "-rfE", "-p", "no:cacheprovider",
               "--durations=5", *nodes]
    rc, stopped = run_logged(command, log, cap_s)
    result = {"figures": {"selected": nodes, **pytest_figures(log.read_text())}}
    if stopped or rc not in (0, 1):  # 1: some tests failed (a figure); anything else: pytest itself did not finish
        result["error"] = f"stopped after its {cap_s / 60:.1f} minutes" if stopped else f"pytest exit code {rc}"
        result["log_tail"] = tail(log)
    return result


def tail(log: Path, lines: int = 30) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


# ---- the check: each step in its own process, the page rewritten after each ----------------------------------------
def run_logged(command: list[str], log: Path, timeout_s: float) -> tuple[int, bool]:
    """Run `command` (and whatever it starts) with its output in `log`; killed as a group after `timeout_s`."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    with log.open("w") as out:
        proc = subprocess.Popen([str(c) for c in command], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            return proc.wait(timeout=max(timeout_s, 1)), False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            return proc.wait(), True
        finally:
            print(log.read_text(errors="replace"), flush=True)  # the device call's log keeps every step's output


def child_step(name: str, args, work: Path, cap_s: float) -> dict:
    """A step in its own process (`--child NAME`): its figures, or its error."""
    command = [sys.executable, Path(__file__).resolve(), "--child", name, "--work", work, "--peer-attn",
               args.peer_attn, *(["--tiny"] if args.tiny else [])]
    rc, stopped = run_logged(command, work / f"{name}.log", cap_s)
    saved = work / f"{name}.json"
    result = json.loads(saved.read_text()) if saved.is_file() else {}
    if stopped:
        result["error"] = f"stopped after its {cap_s / 60:.1f} minutes"
    elif rc and "error" not in result:
        result["error"] = f"exit code {rc} (killed? out of memory?)"
    if "error" in result:
        result["log_tail"] = tail(work / f"{name}.log")
    return result


def run_check(steps: dict, page: Path, header: list[str], minutes: float, tiny: bool) -> dict:
    """Run `steps` ({name: fn(cap seconds) -> result}) in order within `minutes`: each gets its share, the last
    whatever the others left. The page is written before the first step and after every one. -> {name: result}"""
    deadline, results = time.monotonic() + 60 * minutes, {}
    share = sum(STEPS[n] for n in steps)
    write_page(page, header, results, tiny)
    for i, (name, step) in enumerate(steps.items()):
        left = deadline - time.monotonic()
        cap = left if i == len(steps) - 1 else min(left, 60 * minutes * STEPS[name] / share)
        start = time.monotonic()
        if left < 20:
            result = {"error": "not run: no time left"}
        else:
            try:
                result = step(cap)
            except Exception:  # noqa: BLE001 - a step's failure is a result; the others still run
                result = {"error": traceback.format_exc()[-3000:]}
        result["minutes"] = (time.monotonic() - start) / 60
        results[name] = result
        write_page(page, header, results, tiny)
    return results


def header_lines(args, title: str) -> list[str]:
    """Provenance: date, commit, machine, device, library versions, specdec's source, the command."""
    import results as results_bench  # bench/results.py

    commit = results_bench.commit()
    if commit == "unknown" and (WHEELS / "commit.txt").is_file():  # a copied tree without .git: the wheels' build
        commit = f"{(WHEELS / 'commit.txt').read_text().strip()} (recorded by scripts/gpu_wheels.sh)"
    device = (f"{torch.cuda.get_device_name()} ({torch.cuda.get_device_properties(0).total_memory / GiB:.0f} GiB, "
              f"CUDA {torch.version.cuda})" if torch.cuda.is_available() else "no CUDA device")
    return [f"# {title}", "", f"- date: {dt.datetime.now().strftime('%Y-%m-%d %H:%M')}", f"- commit: {commit}",
            f"- machine: {results_bench.cpu_model()}", f"- device: {device}",
            f"- python {sys.version.split()[0]}, " + ", ".join(f"{p} {version(p)}" for p in (
                "torch", "transformers", "accelerate", "datasets", "speculators")),
            f"- specdec: {specdec_source()}",
            "- shapes: " + ("tiny (a 32-layer Llama of hidden 64; draft vocabulary 96, rows of 128 tokens)"
                            if args.tiny else "Llama-3.1-8B's config, random bf16 weights; rows of 4,096 tokens"),
            f"- command: `python bench/gpu_check.py {' '.join(sys.argv[1:])}`", "", ""]


def version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def specdec_source() -> str:
    """Where the imported specdec comes from: the check runs this tree's code only when it is installed editable."""
    import specdec

    if Path(specdec.__file__).resolve().parent == ROOT / "specdec":
        return "this tree (editable install)"
    return ("an installed copy, not this tree: tests/test_cuda.py's subprocesses will not find specdec.train (install "
            "the tree with `pip install -e .`)")


# ---- the page -------------------------------------------------------------------------------------------------------
def num(value, digits: int = 2) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def describe_tests(f: dict, _results: dict) -> list[str]:
    lines = [f"Selected ({len(f['selected'])}): " + ", ".join(f"`{n}`" for n in f["selected"]), "",
             f"pytest: {f['summary']} (passed {f['passed']}, failed {f['failed']}, skipped {f['skipped']}, errors "
             f"{f['error']})"]
    if f["failures"]:
        lines += ["", "Failures:", "", *[f"- `{x}`" for x in f["failures"]]]
    if f["slowest"]:
        lines += ["", "Slowest:", "", *[f"- {x}" for x in f["slowest"]]]
    return lines


def describe_trainer(f: dict, _results: dict) -> list[str]:
    reserved = f"; CUDA's peak reserved {num(f['reserved_gib'])} GiB" if f["reserved_gib"] is not None else ""
    return [
        f"{f['timed_steps']} optimizer steps timed after the first ones (the first took {num(f['first_step_s'])} s); "
        f"mixed precision {f['mixed_precision']}, {f['rows']} row(s) of {f['row_tokens']} tokens a step, ttt_steps "
        f"{f['ttt_steps']}, draft vocabulary {f['draft_vocab']}.", "",
        "| steps/s | trained tokens/s | peak GiB | above the target GiB | plan GiB | measured / plan | within 15% |",
        "|---:|---:|---:|---:|---:|---:|---|",
        f"| {num(f['steps_per_s'], 3)} | {num(f['tokens_per_s'], 0)} | {num(f['peak_gib'])} | "
        f"{num(f['above_target_gib'])} | {num(f['plan_compared_gib'])} | {num(f['ratio'], 3)} | "
        f"{'yes' if f['within_15'] else 'NO'} |", "",
        f"The plan (train/plan/, one device): {num(f['plan_total_gib'])} GiB in all, peak phase {f['plan_peak_phase']}; "
        f"compared: on CUDA without its runtime term (peak allocated), on a CPU in all (peak RSS){reserved}."]


def describe_peer(f: dict, results: dict) -> list[str]:
    ours = (results.get("trainer") or {}).get("figures")
    mine = (f"| specdec (train/distill.py) | {num(ours['tokens_per_s'], 0)} | - | {num(ours['peak_gib'])} | "
            f"{num(ours['above_target_gib'])} |" if ours else "| specdec | (its step has no figures) | | | |")
    return [
        "| trainer | trained tokens/s, with the target's forward | draft step only | peak GiB | above the target GiB |",
        "|---|---:|---:|---:|---:|", mine,
        f"| speculators Eagle3DraftModel ({f['attention']} attention) | {num(f['tokens_per_s_with_forward'], 0)} | "
        f"{num(f['tokens_per_s'], 0)} | {num(f['peak_gib'])} | {num(f['above_target_gib'])} |", "",
        f"{f['timed_steps']} steps of the peer (bench/peer.py's build, packed batches and loop; AdamW at the recipe's "
        f"settings, ttt_steps {f['ttt_steps']}) on the trainer's first rows. The target's forward for the states "
        f"({num(f['target_forward_s'], 3)} s a row) is timed apart and added to the peer's step, as specdec's online "
        "step holds it. The peer's share of memory: its peak above the target and its cached batches, plus one batch."]


def describe_costs(f: dict, _results: dict) -> list[str]:
    ns = sorted(f["v"], key=int)
    return [
        f"Context {f['context']} tokens; medians of {f['repeats']} interleaved passes (eval/timing.py): target step "
        f"{num(f['target_step_ms'])} ms, EAGLE-3 draft step {num(f['draft_step_ms'])} ms, c = {num(f['c'], 3)}.", "",
        "| n | " + " | ".join(ns) + " |", "|---|" + "---:|" * len(ns),
        "| v(n) | " + " | ".join(num(f["v"][n]) for n in ns) + " |", "",
        f"Decoding {f['new_tokens']} tokens greedily: target-only {num(f['target-only_tokens_per_s'], 1)} tokens/s, "
        f"speculative (k = 3, the random draft) {num(f['speculative_tokens_per_s'], 1)} tokens/s; acceptance rate "
        f"{num(f['acceptance_rate'], 3)}, mean accepted tokens {num(f['mean_accepted_tokens'], 3)}; output "
        f"{'identical to' if f['identical'] else 'DIFFERENT from'} target-only"
        + ("; the draft FELL BACK to target-only" if f["fallback"] else "") + "."]


DESCRIBE = {"tests": describe_tests, "trainer": describe_trainer, "peer": describe_peer, "costs": describe_costs}


def write_page(page: Path, header: list[str], results: dict, tiny: bool) -> None:
    """The page: provenance, then each step's figures or its error (with its log's end), then the raw figures."""
    lines = list(header)
    if tiny:
        lines += ["Tiny shapes on a CPU: the steps' plumbing, not GPU figures (memory there is mostly the libraries').",
                  ""]
    for name, result in sorted(results.items(), key=lambda item: list(STEPS).index(item[0])):
        lines += [f"## {TITLES[name]}", "", f"{'FAILED' if 'error' in result else 'ok'}, "
                  f"{result.get('minutes', 0):.1f} min", ""]
        if result.get("figures"):
            try:
                lines += DESCRIBE[name](result["figures"], results)
            except (KeyError, TypeError, ValueError) as err:  # the raw figures below still hold them
                lines += [f"(figures not described: {err!r})"]
        if "error" in result:
            lines += ["", "Error:", "", "```", result["error"].strip(), "```"]
        if result.get("log_tail"):
            lines += ["", "The end of its log:", "", "```", result["log_tail"], "```"]
        lines.append("")
    raw = {name: result.get("figures") for name, result in results.items()}
    lines += ["## Figures", "", "```json", json.dumps(raw, indent=1, default=str), "```"]
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text("\n".join(lines) + "\n")


def main() -> None:
    args = parse_args()
    if args.child:
        import gpu_steps  # bench/gpu_steps.py (this script runs with bench/ on its path)

        return gpu_steps.child_main(args.child, args.work, args.tiny, args.peer_attn)
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    page = args.out / f"{dt.date.today().isoformat()}-gpu-check{'-tiny' if args.tiny else ''}.md"
    # The tests run last, with the time the measured steps left (on a GPU those take far less than their shares).
    order = sorted(args.only, key=lambda n: n == "tests")
    steps = {n: (lambda cap: tests_step(work, cap)) if n == "tests" else
             (lambda cap, n=n: child_step(n, args, work, cap)) for n in order}
    try:
        run_check(steps, page, header_lines(args, "specdec on a GPU: tests, trainer, peer and decoder costs"),
                  args.minutes, args.tiny)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"written to {page}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (the default without CUDA)")
    parser.add_argument("--minutes", type=float, default=8.0, help="the whole check; each step gets its share")
    parser.add_argument("--only", default=",".join(STEPS), help=f"steps to run, comma-separated: {', '.join(STEPS)}")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "results", help="where the page is written")
    parser.add_argument("--peer-attn", default="sdpa", help="speculators' draft attention (bench/peer.py's default; "
                        "its own trainer's default on a GPU is simple_flex_attention)")
    parser.add_argument("--child", choices=[n for n in STEPS if n != "tests"], help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.only = [s.strip() for s in args.only.split(",") if s.strip()]
    if not args.only or set(args.only) - set(STEPS):
        parser.error(f"--only takes steps among {', '.join(STEPS)}, got {','.join(args.only)}")
    args.tiny = args.tiny or not torch.cuda.is_available()
    return args


if __name__ == "__main__":
    main()
