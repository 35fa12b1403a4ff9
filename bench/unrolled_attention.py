"""Step 1 of EAGLE-3's unrolled attention: torch's fused causal kernel against the chunked computation.

    python bench/unrolled_attention.py                       # the demo draft's heads, bf16 and float32
    python bench/unrolled_attention.py --shapes 16x192 16x832 --rounds 9

`unrolled_attention` (specdec/eagle3/attention.py) takes torch's fused causal kernel for step 1 over right-padded
rows when no chunk is given, and the chunked computation when one is: this times both on the same inputs (forward
and backward, random upstream gradient), the chunk given being the one the function would pick itself
(`chunk_size`). Rows are right-padded to random lengths (the longest full), as the trainer's batches are. The two
run in turn, the order alternating, after one untimed round; the figures are medians. It also reports the largest
difference between the two outputs at real queries (the only ones a loss scores).
"""

from __future__ import annotations

import argparse
import statistics
import time

import results  # bench/results.py (this script runs with bench/ on its path)
import torch

from specdec.eagle3.attention import chunk_size, unrolled_attention

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64  # SmolLM2-135M's, the demo draft's layer


def inputs(batch: int, n: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)

    def leaf(heads):
        return torch.randn(batch, heads, n, HEAD_DIM, generator=g).to(dtype).requires_grad_()

    lengths = torch.randint(n // 2, n + 1, (batch,), generator=g)
    lengths[0] = n
    return leaf(HEADS), leaf(KV_HEADS), leaf(KV_HEADS), torch.arange(n)[None] < lengths[:, None]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["16x192", "16x384", "16x832"],
                        help="rows x positions of a micro-batch (the demo's: ~190 typical, ~830 its longest)")
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    rows = ["| dtype | rows x positions | chunked ms | fused ms | chunked / fused | max difference at real queries |",
            "|---|---|---:|---:|---:|---:|"]
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        for shape in args.shapes:
            batch, n = (int(x) for x in shape.split("x"))
            q, k, v, valid = inputs(batch, n, dtype, seed=n)
            upstream = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
            ways = {"chunked": chunk_size(batch, HEADS, n), "fused": None}
            times: dict[str, list[float]] = {name: [] for name in ways}
            for r in range(args.rounds + 1):
                for name in (list(ways) if r % 2 else list(ways)[::-1]):
                    start = time.perf_counter()
                    unrolled_attention(q, k, v, [], [], valid, chunk=ways[name]).backward(upstream)
                    if r:  # round 0 warms up
                        times[name].append(time.perf_counter() - start)
                    q.grad = k.grad = v.grad = None
            with torch.no_grad():
                outs = [unrolled_attention(q, k, v, [], [], valid, chunk=c) for c in ways.values()]
            real = valid[:, None, :, None].expand_as(outs[0])
            diff = (outs[0].float() - outs[1].float()).abs()[real].max().item()
            chunked, fused = (statistics.median(times[name]) for name in ways)
            rows.append(f"| {dtype_name} | {shape} | {1e3 * chunked:.1f} | {1e3 * fused:.1f} | "
                        f"{chunked / fused:.2f}x | {diff:.1e} |")
            print(rows[-1], flush=True)
    body = "\n".join([
        f"Step 1 of the unrolled attention at the demo draft's heads ({HEADS} query, {KV_HEADS} key/value heads of "
        f"{HEAD_DIM}), forward and backward, rows right-padded to random lengths; medians of {args.rounds} rounds "
        f"in alternating order.", "", *rows, ""])
    print(f"written to {results.write('attention-step-one', 'Unrolled attention, step 1: fused against chunked', body)}")


if __name__ == "__main__":
    main()
