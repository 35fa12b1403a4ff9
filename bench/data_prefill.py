"""The data stage's batch handling against one padded forward that runs every row to the end, in one run: the
prefill in groups, finished rows dropped from the decoding batch, a larger batch.

    python bench/data_prefill.py                      # 256 embedded training prompts (one demo shard's worth)
    python bench/data_prefill.py --prompts 128 --dtype float32 --variants grouped   # a CPU without native bf16
    python bench/data_prefill.py --variants grouped grouped-drop --exact-variant grouped-drop

1. Speed: `specdec.train.data.run`, exactly as `specdec data` runs it (seconds from its manifest, so model loading
   is left out), at the demo recipe's data settings (bf16 where native, top-n, recorded states, batch_tokens,
   max_new_tokens), greedy, one shard, on `--prompts` embedded training prompts, one of each kind in turn (the
   demo's mix of kinds, less its self-written prompts). Variants, alternated (rep 0 in order, rep 1 reversed):
   `one-forward` (grouped_prefill=false, drop_finished_rows=false, batch_size 64: the data stage before either),
   `grouped` (grouped_prefill=true), `grouped-drop` (grouped_prefill=true, drop_finished_rows=true: as specdec data
   now runs) and `grouped-128` (grouped_prefill=true, batch_size 128). Each run's completions are compared with
   `one-forward`'s of the same rep; where a row differs, the target's gap between its two most likely tokens at the
   first differing position (from `one-forward`'s top-n) says whether the two roundings met a near-tie. Every pair
   of the other variants is compared too (median of the same-rep ratios).
2. Exactness: the same comparison in float32 on `--exact-prompts` prompts (shorter answers), `--exact-variant`
   against `one-forward`, where rounding leaves no near-tie to flip: completions must be identical and the top-n
   log-probs equal to float32 rounding.

Writes docs/results/<date>-data-prefill.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data import pick_prompts  # noqa: E402
from data_limit import data_run  # noqa: E402
from results import write  # noqa: E402

from specdec.config import load_config  # noqa: E402
from specdec.models import load_model  # noqa: E402
from specdec.train.data import DataConfig  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "smollm2-135m-eagle3.yaml"
VARIANTS = {"one-forward": {"grouped_prefill": False, "drop_finished_rows": False, "batch_size": 64},
            "grouped": {"grouped_prefill": True, "drop_finished_rows": False, "batch_size": 64},
            "grouped-drop": {"grouped_prefill": True, "drop_finished_rows": True, "batch_size": 64},
            "grouped-128": {"grouped_prefill": True, "drop_finished_rows": False, "batch_size": 128}}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default=str(RECIPE), help="its data: section's settings are the ones timed")
    parser.add_argument("--prompts", type=int, default=256, help="embedded training prompts, one of each kind in turn")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each variant, alternated")
    parser.add_argument("--exact-prompts", type=int, default=48, help="float32 prompts for the exactness check")
    parser.add_argument("--exact-variant", default="grouped-drop", choices=list(VARIANTS)[1:],
                        help="the variant checked against one-forward in float32")
    parser.add_argument("--dtype", default=None, help="the target's dtype for the timed runs [the recipe's]")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS),
                        help="one-forward always runs (the baseline)")
    parser.add_argument("--name", default="data-prefill", help="docs/results/<date>-<name>.md")
    return parser.parse_args()


def timed(data: DataConfig, records: list[dict], settings: dict) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        return data_run(DataConfig(**{**data.__dict__, **settings}), records, Path(tmp))


def divergences(run: dict, base: dict) -> tuple[int, list[float]]:
    """Rows completed alike, and at each differing row's first differing token the gap between `base`'s two most
    likely log-probs there."""
    same, gaps = 0, []
    for key, tokens in base["completions"].items():
        other = run["completions"][key]
        if other == tokens:
            same += 1
            continue
        at = next((j for j, (a, b) in enumerate(zip(tokens, other)) if a != b), min(len(tokens), len(other)) - 1)
        top = base["top"][key][1][at]
        gaps.append(top[0] - top[1])
    return same, gaps


def pairs(ratios: dict[str, list[float]]) -> list[str]:
    """Each later variant against each earlier one but the baseline: the median of their same-rep ratios."""
    names = [k for k in ratios if k != "one-forward"]
    return ["", *(f"Median tokens/s of `{b}` against `{a}` of the same rep: **"
                  f"{statistics.median(rb / ra for ra, rb in zip(ratios[a], ratios[b])):.2f}x**"
                  for i, a in enumerate(names) for b in names[i + 1:])] if len(names) > 1 else []


def main() -> None:
    args = parse_args()
    data = load_config(DataConfig, Path(args.recipe), [], section="data")
    data = DataConfig(**{**data.__dict__, "temperatures": None, "num_samples": 1, "temperature": 0.0,  # greedy
                         "dtype": args.dtype or data.dtype})
    variants = ["one-forward"] + [v for v in args.variants if v != "one-forward"]
    load_model(data.target)  # convert/cache the embedded checkpoint before any timing
    records = pick_prompts(args.prompts)
    runs = []
    for rep in range(args.repeats):
        for name in (variants if rep % 2 == 0 else list(reversed(variants))):
            result = timed(data, records, VARIANTS[name])
            result.update(variant=name, rep=rep)
            runs.append(result)
            print(f"rep {rep} {name:<12} {result['tokens']} tokens in {result['seconds']:.1f} s = "
                  f"{result['tokens'] / result['seconds']:.1f} tok/s", flush=True)
    lines = ["| rep | variant | seconds | generated tokens | tokens/s | vs one-forward, same rep | completions as "
             "one-forward's | top-2 gap at the first difference (median, max) |",
             "|---:|---|---:|---:|---:|---:|---:|---|"]
    ratios: dict[str, list[float]] = {name: [] for name in variants}
    for rep in range(args.repeats):
        mine = {r["variant"]: r for r in runs if r["rep"] == rep}
        base = mine["one-forward"]
        for name in variants:
            r = mine[name]
            speed = (r["tokens"] / r["seconds"]) / (base["tokens"] / base["seconds"])
            ratios[name].append(speed)
            same, gaps = divergences(r, base)
            gap = f"{statistics.median(gaps):.3f}, {max(gaps):.3f}" if gaps else "-"
            lines.append(f"| {rep} | {name} | {r['seconds']:.1f} | {r['tokens']} | {r['tokens'] / r['seconds']:.1f} | "
                         f"{speed:.2f}x | {same}/{len(base['completions'])} | {gap} |")
    exact = DataConfig(**{**data.__dict__, "dtype": "float32", "max_new_tokens": 32})
    exact_records = pick_prompts(args.exact_prompts)
    one, checked = (timed(exact, exact_records, VARIANTS[name]) for name in ("one-forward", args.exact_variant))
    same, _ = divergences(checked, one)
    top_diff = max(abs(a - b) for key in one["top"] for ra, rb in zip(one["top"][key][1], checked["top"][key][1])
                   for a, b in zip(ra, rb))
    body = [f"- data settings: {Path(args.recipe).name}'s data section, greedy: batch_tokens {data.batch_tokens}, "
            f"max_new_tokens {data.max_new_tokens}, top_logprobs {data.top_logprobs}, record_features "
            f"{data.record_features} (layers {data.eagle_aux_layer_ids}), dtype {data.dtype}; {len(records)} embedded "
            f"training prompts, one of each kind in turn, one shard",
            "- seconds: the manifest's generation seconds (model loading excluded); variants: "
            + "; ".join(f"`{k}` {VARIANTS[k]}" for k in variants), "", *lines, "",
            "Median tokens/s against `one-forward` of the same rep: "
            + ", ".join(f"`{k}` **{statistics.median(v):.2f}x**" for k, v in ratios.items() if k != "one-forward"),
            *pairs(ratios),
            "", f"Exactness, float32, {len(exact_records)} prompts x up to 32 new tokens, `{args.exact_variant}` "
            f"against `one-forward`: {same}/{len(one['completions'])} completions identical, top-n log-probs within "
            f"{top_diff:.1e}; {one['tokens'] / one['seconds']:.1f} against {checked['tokens'] / checked['seconds']:.1f}"
            f" tokens/s (one-forward, {args.exact_variant}).", ""]
    print("\n".join(body))
    print(f"wrote {write(args.name, 'specdec data: the batch handling', chr(10).join(body))}")


if __name__ == "__main__":
    main()
