"""Host memory over a CPU training run's steps: does the trainer's anonymous memory stay level, and if it grows,
what holds it back at what cost in speed?

    python bench/host_memory.py --data runs/demo/data                       # every variant, 150 steps each
    python bench/host_memory.py --data D --steps 300 --variants default trim

Each variant trains the demo recipe's train settings (recipes/smollm2-135m-eagle3.yaml, its mixed precision: bf16
autocast where the CPU has native bf16) for `--steps` steps on `--data`, in its own process, one at a time on
every core, sampling the process's RssAnon every 0.5 s with the step it was in. Variants:

- `default`: as specdec trains (the heap trimmed every `release_host_memory_every` steps, 25 by default);
- `keep-heap`: release_host_memory_every=0, the heap never trimmed (how specdec trained before that key);
- `trim`, `trim-10`: release_host_memory_every=1 / 10 (glibc's malloc_trim(0) after every step / every 10th:
  every whole free page of the heap back to the system, train/host_memory.py);
- `mmap-4m`: MALLOC_MMAP_THRESHOLD_=4194304, a fixed threshold (glibc then stops raising it as large blocks are
  freed, so every tensor of 4 MiB or more is its own mapping, unmapped when freed);
- `mmap-64k`: MALLOC_MMAP_THRESHOLD_=65536;
- `fp32`: mixed_precision=no (no bf16 kernels: separates oneDNN's per-shape caches from the allocator);
- `pad-1`, `pad-64`, `pad-128`: pad_to_multiple_of=1 / 64 / 128 (1: each batch as wide as its longest row, one
  width and slice height per batch; 64 and 128: a few widths, the same block sizes freed and taken again). The
  demo recipe sets 64, so there `default` is `pad-64`.

`--repeats R` runs the variants in turn R times; each row is compared with `default` of its own round.

The table gives RssAnon at a few steps, the peak, and the run's trained tokens/s (train_summary.json's pace),
each against `default` of the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import results  # bench/results.py (this script runs with bench/ on its path)

ROOT = Path(__file__).resolve().parents[1]
RECIPE = "recipes/smollm2-135m-eagle3.yaml"

VARIANTS: dict[str, dict] = {
    "default": {},
    "keep-heap": {"overrides": ["release_host_memory_every=0"]},
    "trim": {"overrides": ["release_host_memory_every=1"]},
    "trim-10": {"overrides": ["release_host_memory_every=10"]},
    "mmap-4m": {"env": {"MALLOC_MMAP_THRESHOLD_": "4194304"}},
    "mmap-64k": {"env": {"MALLOC_MMAP_THRESHOLD_": "65536"}},
    "fp32": {"overrides": ["mixed_precision=no"]},
    "pad-1": {"overrides": ["pad_to_multiple_of=1"]},
    "pad-64": {"overrides": ["pad_to_multiple_of=64"]},
    "pad-128": {"overrides": ["pad_to_multiple_of=128"]},
}

CHILD = r"""
import json, sys, threading, time
from specdec.config import load_config
from specdec.train import distill
from specdec.train.train_config import TrainConfig

def anon_mb():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon"):
            return int(line.split()[1]) / 1024
spec = json.loads(sys.argv[1])
at, samples = [0], []
def sample():
    while True:
        samples.append((at[0], anon_mb()))
        time.sleep(0.5)
threading.Thread(target=sample, daemon=True).start()
step = distill.Distiller.train_step
def counted(self, s, micro_batches):
    out = step(self, s, micro_batches)
    at[0] = s
    return out
distill.Distiller.train_step = counted
cfg = load_config(TrainConfig, spec["recipe"], spec["overrides"], section="train")
distill.run(cfg)
pace = json.load(open(cfg.output_dir + "/train_summary.json")).get("pace") or {}
print("HOST_MEMORY " + json.dumps({"samples": samples, "tokens_per_second": pace.get("tokens_per_second")}), flush=True)
"""


def run(args, name: str, out: Path) -> dict:
    variant = VARIANTS[name]
    overrides = [f"train_data={args.data}", f"output_dir={out}", "overwrite=true", f"max_steps={args.steps}",
                 "max_minutes=null", "eval_every=0", "stop_after_flat_evals=0", "save_every=0", "log_every=50",
                 *variant.get("overrides", [])]
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", **variant.get("env", {}))
    spec = {"recipe": args.recipe, "overrides": overrides}
    print(f"== {name}", flush=True)
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(spec)], cwd=ROOT, env=env, capture_output=True,
                          text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{proc.stderr[-3000:]}")
    return json.loads([x for x in proc.stdout.splitlines() if x.startswith("HOST_MEMORY ")][-1][12:])


def at_step(samples: list, step: int) -> float | None:
    """RssAnon (MB) at the last sample taken by `step`."""
    seen = [mb for s, mb in samples if s <= step]
    return seen[-1] if seen else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, required=True, help="a `specdec data` folder with recorded states")
    parser.add_argument("--recipe", default=RECIPE)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--repeats", type=int, default=1, help="rounds of every variant, in turn")
    parser.add_argument("--name", default="host-memory", help="docs/results/<date>-<name>.md")
    args = parser.parse_args()
    args.data = args.data.resolve()
    provenance = results.header("Host memory over a training run's steps")
    marks = sorted({max(1, args.steps // 6), args.steps // 3, 2 * args.steps // 3, args.steps})
    work = Path(tempfile.mkdtemp(prefix="host-memory-"))
    rounds = [{name: run(args, name, work / name) for name in args.variants} for _ in range(args.repeats)]
    shutil.rmtree(work, ignore_errors=True)
    head = "| variant | " + " | ".join(f"RssAnon at step {m}" for m in marks) + " | peak | trained tokens/s | vs default |"
    rows = [head, "|---|" + "---:|" * (len(marks) + 3)]
    for r, outcome in enumerate(rounds):
        base = outcome.get("default")
        for name, out in outcome.items():
            values = [at_step(out["samples"], m) for m in marks]
            peak = max(mb for _, mb in out["samples"])
            rate = out["tokens_per_second"] or float("nan")
            versus = f"x{rate / base['tokens_per_second']:.2f}" if base and base["tokens_per_second"] else "—"
            label = f"{name} (round {r + 1})" if args.repeats > 1 else name
            rows.append(f"| {label} | " + " | ".join("—" if v is None else f"{v:.0f} MB" for v in values)
                        + f" | {peak:.0f} MB | {rate:.0f} | {versus} |")
            print(rows[-1], flush=True)
    examples = json.loads((args.data / "manifest.json").read_text())["counts"]["examples"]
    body = "\n".join([
        f"{args.steps} training steps of {args.recipe}'s train settings on `{args.data.name}` ({examples} examples), "
        f"each variant in its own process, {args.repeats} round(s) of them in turn, one at a time on every core, the loader in a worker process (not counted); "
        "RssAnon sampled every 0.5 s and read at the last sample by each step. Variants: " + "; ".join(
            f"`{name}` {json.dumps(VARIANTS[name]) if VARIANTS[name] else '(as specdec trains)'}"
            for name in args.variants) + ".", "", *rows, ""])
    print(body)
    print(f"written to {results.write(args.name, 'Host memory over a training run', body, provenance)}")


if __name__ == "__main__":
    main()
