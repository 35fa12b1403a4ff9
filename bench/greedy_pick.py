"""The greedy pick of a decoding step: argmax over the step's logits in the target's dtype, against converting them
to float32 first (what specdec.sampling.next_token does), on this CPU, with the same indices checked.

    python bench/greedy_pick.py                       # 64 rows (the data stage's batch) and 1 row, a 49,152 vocabulary
    python bench/greedy_pick.py --rows 1 8 64 --vocab 151936 --dtype bfloat16

Writes docs/results/<date>-greedy-pick.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results import write  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--vocab", type=int, default=49152, help="SmolLM2's vocabulary by default")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--name", default="greedy-pick")
    return parser.parse_args()


def ms(fn, repeats: int) -> float:
    """The median of `repeats` timed calls, after a few untimed ones."""
    for _ in range(5):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main() -> None:
    args = parse_args()
    dtype = getattr(torch, args.dtype)
    lines = ["| rows | argmax in " + args.dtype + " (ms) | converted, then argmax (ms) | ratio | same indices |",
             "|---:|---:|---:|---:|---|"]
    for rows in args.rows:
        # Rounded to the dtype, with ties made likely (repeated maxima), as real bf16 logits have them.
        logits = (torch.randn(rows, args.vocab, generator=torch.Generator().manual_seed(rows)) * 4).round().to(dtype)
        same = torch.equal(logits.argmax(dim=-1), logits.float().argmax(dim=-1))
        plain = ms(lambda x=logits: x.argmax(dim=-1), args.repeats)
        converted = ms(lambda x=logits: x.float().argmax(dim=-1), args.repeats)
        lines.append(f"| {rows} | {plain:.3f} | {converted:.3f} | {plain / converted:.2f}x | {same} |")
        print(lines[-1], flush=True)
    body = "\n".join([f"- logits: [rows, {args.vocab}] {args.dtype}, whole numbers (many tied maxima); the median of "
                      f"{args.repeats} calls each", "", *lines, ""])
    print(f"wrote {write(args.name, 'The greedy pick: argmax in the logits dtype or in float32', body)}")


if __name__ == "__main__":
    main()
