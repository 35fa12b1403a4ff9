"""Host memory of EAGLE-3 training on a real `specdec data` folder: does the peak grow with the data, or with the
micro-batches the steps happen to draw?

    python bench/train_memory_real.py --data runs/demo/data                 # its first shard vs 6 copies of it, seeds 0-2
    python bench/train_memory_real.py --data D --copies 10 --seeds 0 1 --steps 8
    python bench/train_memory_real.py --data runs/demo/data --slice-tokens 0 4096   # whole micro-batches vs slices
    python bench/train_memory_real.py --data runs/demo/data --copies 0 --steps 150 --release-every 0 25
    python bench/train_memory_real.py --data runs/demo/data --copies 0 --steps 75 --seeds 0 --before /tmp/before

The small folder is the data folder's first shard; the large one is `--copies` copies of it (linked, not written
again: the same rows, so the rows' lengths and states are the data's own); `--copies 0` takes the whole folder
instead. Each run trains `--steps` steps of the
recipe's train settings (default the demo's, recipes/smollm2-135m-eagle3.yaml: 16 rows a micro-batch, max_length
1024, recorded states, online teacher) in its own process with the loader in that process, sampling its anonymous
memory (RssAnon) every 50 ms, and records the widest micro-batch its steps drew. The table says, per folder and
seed, the peak and the widest batch: when the peak follows the widest batch and not the folder, memory is bounded
by the batch shape (what `specdec train --plan` bounds), whatever the data's size. `--slice-tokens` runs each
case at each bound (train_config.py `slice_tokens`: a micro-batch's forward and backward in slices of rows), and the
table adds the run's trained tokens/s over its timed steps (train_summary.json's pace). `--release-every` likewise
runs each case at each `release_host_memory_every` (train/host_memory.py; 0 = the heap never trimmed), which
decides whether a long run's peak follows its steps. `--malloc` runs each case under each set of the C library's
allocator settings given as environment variables (`default`: none), e.g. glibc's `MALLOC_MMAP_THRESHOLD_` (every
block at least that large mapped on its own and unmapped when freed, where glibc otherwise raises the threshold up
to 32 MiB and keeps such blocks in its heap) and `GLIBC_TUNABLES=glibc.malloc.hugetlb=1` (those mappings in
transparent huge pages): what is left between the folders then is what the steps hold live, not what the heap keeps.
`--before` runs every case on an earlier checkout's code as well (`code` before against this).
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
from checkouts import PREAMBLE

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys, threading, time
from specdec.config import load_config
from specdec.train import batches, distill
from specdec.train.train_config import TrainConfig

def anon_mb():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon"):
            return int(line.split()[1]) / 1024
peak, widest = [0.0], [(0, 0)]
def sample():
    while True:
        peak[0] = max(peak[0], anon_mb())
        time.sleep(0.05)
threading.Thread(target=sample, daemon=True).start()
take = batches.MicroBatches.__getitem__
def recorded(self, m):
    item = take(self, m)
    shape = tuple(item[1]["input_ids"].shape)
    widest[0] = max(widest[0], shape, key=lambda s: s[0] * s[1])
    return item
batches.MicroBatches.__getitem__ = recorded
spec = json.loads(sys.argv[1])
cfg = load_config(TrainConfig, spec["recipe"], spec["overrides"], section="train")
distill.run(cfg)
pace = json.load(open(cfg.output_dir + "/train_summary.json")).get("pace") or {}
print("MEMORY_RESULT " + json.dumps({"peak_anon_mb": peak[0], "widest": widest[0],
                                     "tokens_per_second": pace.get("tokens_per_second")}), flush=True)
"""


def linked_copies(data: Path, folder: Path, copies: int) -> Path:
    """A data folder of `copies` links to `data`'s first shard (its parquet file and recorded states)."""
    manifest = json.loads((data / "manifest.json").read_text())
    first = manifest["shards"][0]
    stem = Path(first["file"]).name.removesuffix(".parquet")
    (folder / "shards").mkdir(parents=True)
    shards = []
    for c in range(copies):
        for source in (data / "shards").glob(stem + ".*"):
            (folder / "shards" / source.name.replace(stem, f"{stem}-copy{c}")).symlink_to(source.resolve())
        shards.append({**first, "index": c, "file": f"shards/{stem}-copy{c}.parquet"})
    manifest.update(shards=shards, num_shards=copies, complete=True,
                    fingerprint=f"{manifest.get('fingerprint')}-first-shard-x{copies}")
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def shown(value: int | None) -> str:
    """A key's value as the page names it: `recipe` where the run kept the recipe's."""
    return "recipe" if value is None else str(value)


def malloc_env(variant: str) -> dict[str, str]:
    """`default` -> {}; "NAME=VALUE,NAME=VALUE" -> those variables."""
    if variant == "default":
        return {}
    pairs = [item.split("=", 1) for item in variant.split(",")]
    if any(len(pair) != 2 or not pair[0] for pair in pairs):
        raise SystemExit(f"--malloc {variant!r}: give `default` or NAME=VALUE[,NAME=VALUE...]")
    return dict(pairs)


def run(recipe: str, folder: Path, out: Path, steps: int, seed: int, slice_tokens: int | None,
        release_every: int | None, malloc: str = "default", tree: Path = ROOT) -> dict:
    """One training run in its own process, on `tree`'s code (this checkout's, or another's: bench/checkouts.py)."""
    overrides = [f"train_data={folder}", f"output_dir={out}", "overwrite=true", f"max_steps={steps}",
                 *([] if slice_tokens is None else [f"slice_tokens={slice_tokens}"]),
                 *([] if release_every is None else [f"release_host_memory_every={release_every}"]),
                 "max_minutes=null", "eval_every=0", "stop_after_flat_evals=0", "save_every=0", f"seed={seed}",
                 "data_workers=0", f"log_every={steps}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", **malloc_env(malloc))
    source = CHILD
    if tree != ROOT:
        env["PYTHONPATH"], source = str(tree), PREAMBLE + CHILD
    proc = subprocess.run([sys.executable, "-c", source, json.dumps({"recipe": recipe, "overrides": overrides})],
                          cwd=tree, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"training on {folder} failed:\n{proc.stderr[-3000:]}")
    return json.loads([x for x in proc.stdout.splitlines() if x.startswith("MEMORY_RESULT ")][-1][14:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, required=True, help="a `specdec data` folder with recorded states")
    parser.add_argument("--recipe", default="recipes/smollm2-135m-eagle3.yaml")
    parser.add_argument("--copies", type=int, default=6, help="0: the whole --data folder as the large one")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--slice-tokens", type=int, nargs="+", default=[None],
                        help="slice_tokens values to run each case at (0 = whole micro-batches) [the recipe's]")
    parser.add_argument("--release-every", type=int, nargs="+", default=[None],
                        help="release_host_memory_every values to run each case at [the recipe's]")
    parser.add_argument("--malloc", nargs="+", default=["default"],
                        help="allocator settings to run each case under: `default` or NAME=VALUE[,NAME=VALUE...]")
    parser.add_argument("--before", type=Path, default=None,
                        help="a checkout (git worktree) of an earlier commit: every case runs on its code too")
    parser.add_argument("--name", default="train-memory-real", help="docs/results/<date>-<name>.md")
    args = parser.parse_args()
    provenance = results.header("Training's host memory on a real data folder")
    work = Path(tempfile.mkdtemp(prefix="train-memory-real-"))
    small = linked_copies(args.data.resolve(), work / "small", 1)
    large = linked_copies(args.data.resolve(), work / "large", args.copies) if args.copies else args.data.resolve()
    rows_per_shard = json.loads((small / "manifest.json").read_text())["shards"][0]["examples"]
    large_name = f"{args.copies} copies of it" if args.copies else "the whole folder"
    large_rows = rows_per_shard * args.copies or json.loads((large / "manifest.json").read_text())["counts"]["examples"]
    table = ["| code | allocator | release_host_memory_every | slice_tokens | folder | samples | seed | widest "
             "micro-batch drawn | peak RssAnon | trained tokens/s |", "|---|---|---|---:|---|---:|---:|---|---:|---:|"]
    measured = {}  # (code, malloc, release_every, slice_tokens, folder, seed) -> the child's result
    codes = {"this": ROOT, **({"before": args.before.resolve()} if args.before else {})}
    for (code, tree), malloc in ((item, malloc) for item in codes.items() for malloc in args.malloc):
        for release_every in args.release_every:
            for slice_tokens in args.slice_tokens:
                for name, folder, samples in (("first shard", small, rows_per_shard), (large_name, large, large_rows)):
                    for seed in args.seeds:
                        out = run(args.recipe, folder, work / f"run-{len(measured)}", args.steps, seed, slice_tokens,
                                  release_every, malloc, tree)
                        measured[code, malloc, release_every, slice_tokens, name, seed] = out
                        rows, width = out["widest"]
                        rate = out.get("tokens_per_second")
                        table.append(f"| {code} | {malloc} | {shown(release_every)} | {shown(slice_tokens)} | {name} | {samples} "
                                     f"| {seed} | {rows} x {width} tokens | {out['peak_anon_mb']:.0f} MB "
                                     f"| {f'{rate:.0f}' if rate else '—'} |")
                        print(table[-1], flush=True)
    ratios = []
    for (code, malloc, release_every, slice_tokens, name, seed), out in measured.items():
        if name != large_name:
            continue
        small_out = measured[code, malloc, release_every, slice_tokens, "first shard", seed]
        line = (f"- {code} code, {malloc}, release {shown(release_every)}, slices {shown(slice_tokens)}, seed {seed}: peak {large_name} / first "
                f"shard **{out['peak_anon_mb'] / small_out['peak_anon_mb']:.2f}x**")
        base = measured.get((code, "default", release_every, slice_tokens, name, seed))
        if malloc != "default" and base and out.get("tokens_per_second") and base.get("tokens_per_second"):
            small_base = measured[code, "default", release_every, slice_tokens, "first shard", seed]
            line += (f"; against `default` in this run: peaks {small_out['peak_anon_mb'] / small_base['peak_anon_mb']:.2f}x"
                     f" / {out['peak_anon_mb'] / base['peak_anon_mb']:.2f}x, trained tokens/s "
                     f"{small_out['tokens_per_second'] / small_base['tokens_per_second']:.2f}x"
                     f" / {out['tokens_per_second'] / base['tokens_per_second']:.2f}x (first shard / {large_name})")
        earlier = measured.get(("before", malloc, release_every, slice_tokens, name, seed))
        if code == "this" and earlier:
            small_earlier = measured["before", malloc, release_every, slice_tokens, "first shard", seed]
            line += (f"; against the `--before` code: peaks {small_out['peak_anon_mb'] / small_earlier['peak_anon_mb']:.2f}x"
                     f" / {out['peak_anon_mb'] / earlier['peak_anon_mb']:.2f}x (first shard / {large_name})")
        ratios.append(line)
    shutil.rmtree(work, ignore_errors=True)
    body = "\n".join([
        f"{args.steps} training steps of {args.recipe}'s train settings on `{args.data.name}`'s first shard "
        f"({rows_per_shard} samples) and on {large_name}, each seed a different batch order; one "
        "process each, one thread, the loader in it, RssAnon sampled every 50 ms.", "", *table, "", *ratios, ""])
    print(body)
    print(f"written to {results.write(args.name, 'Training host memory on a real data folder', body, provenance)}")


if __name__ == "__main__":
    main()
