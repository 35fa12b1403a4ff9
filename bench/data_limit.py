"""The data stage against this CPU's limit: what fraction of its matmul rate `specdec data` reaches at the demo's
settings, where the rest of the time goes, and the KV cache that writes in place against transformers'
DynamicCache (the change this bench was written for), in one run.

    python bench/data_limit.py                      # 64 embedded training prompts, the demo recipe's data settings
    python bench/data_limit.py --prompts 128 --repeats 2

1. The matmul rate: torch's linear on this CPU at the data stage's shapes (the target's weights, a decoding step's
   rows = batch size, and a prefill's rows), in the data stage's dtype.
2. The data stage (`specdec.train.data.run`, exactly as `specdec data` runs it; seconds from its manifest, so
   model loading is left out) with the demo recipe's data settings (top_logprobs, record_features and its layers,
   dtype, batch_size, batch_tokens, max_new_tokens) on the same prompts, `--repeats` times each way, alternated
   (ABBA): `cache=inplace` is specdec's decoder cache (specdec/kv.py), `cache=dynamic` puts transformers'
   DynamicCache back, the cache every data run used before. Completions and top-n log-probs are compared row by
   row, bit for bit.
3. One more run under torch's profiler (slower; shares only): its time by operator class, and the positions the
   target computed (prefill rows x width + decoding rows x steps, padding and finished rows included), so the
   FLOPs reached: 2 x (decoder-layer parameters) per position plus 2 x (head parameters) per logit row.

Writes docs/results/<date>-data-limit.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data import pick_prompts  # noqa: E402
from results import write  # noqa: E402

import specdec.kv as kv  # noqa: E402
from specdec.config import load_config  # noqa: E402
from specdec.models import load_model, resolve_device, resolve_dtype  # noqa: E402
from specdec.train.data import DataConfig, load_generated, run  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "smollm2-135m-eagle3.yaml"
OPERATORS = {  # profiler operator name -> class (the rest: "other")
    "aten::mm": "matmul", "aten::addmm": "matmul", "aten::bmm": "matmul", "aten::linear": "matmul",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "attention", "aten::cat": "cache copies (cat)",
    "aten::topk": "top-n", "aten::_log_softmax": "top-n", "aten::argmax": "sampling",
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default=str(RECIPE), help="its data: section's settings are the ones timed")
    parser.add_argument("--prompts", type=int, default=64, help="embedded training prompts, one of each kind in turn")
    parser.add_argument("--repeats", type=int, default=2, help="runs each way, alternated")
    parser.add_argument("--no-profile", action="store_true", help="skip the profiled run")
    parser.add_argument("--name", default="data-limit", help="docs/results/<date>-<name>.md")
    return parser.parse_args()


class DynamicCacheBack:
    """Within: specdec's decoders build transformers' DynamicCache (torch.cat per step), as before kv.new_cache."""

    def __enter__(self):
        self.kept = kv.new_cache
        kv.new_cache = lambda model, capacity: kv.DynamicCache(config=model.config)

    def __exit__(self, *exc):
        kv.new_cache = self.kept


def data_run(data: DataConfig, records: list[dict], folder: Path) -> dict:
    prompts = folder / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = DataConfig(**{**data.__dict__, "prompts": str(prompts), "output_dir": str(folder / "out"),
                        "shard_size": len(records), "spec_bench_turns": "first", "max_minutes": None,
                        "overwrite": False})
    manifest = run(cfg)
    rows = {r["prompt_id"]: r for r in load_generated(cfg.output_dir)}
    return {"seconds": sum(s["seconds"] for s in manifest["shards"]),
            "tokens": manifest["counts"]["generated_tokens"],
            "completions": {k: r["input_ids"][r["prompt_length"]:] for k, r in rows.items()},
            "top": {k: (r["top_ids"], r["top_logprobs"]) for k, r in rows.items()}}


def matmul_rates(target: str, dtype: torch.dtype, batch: int, prefill_rows: int) -> dict[str, float]:
    """GFLOP/s of F.linear at a decoding step's rows and a prefill's, over one decoder layer's weights and the
    head, in `dtype` (the best of 5 timings of 10 calls)."""
    model = load_model(target, dtype=str(dtype).removeprefix("torch."), device="cpu")
    layer = model.model.layers[0]
    weights = [m.weight for m in layer.modules() if isinstance(m, torch.nn.Linear)]
    out = {}
    with torch.inference_mode():
        for label, rows, ws in (("step, layers", batch, weights), ("step, head", batch, [model.lm_head.weight]),
                                ("prefill, layers", prefill_rows, weights)):
            xs = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=dtype) for w in ws}
            flops = sum(2 * rows * w.numel() for w in ws)
            best = float("inf")
            for _ in range(5):
                started = time.perf_counter()
                for _ in range(10):
                    for w in ws:
                        F.linear(xs[w.shape[1]], w)
                best = min(best, (time.perf_counter() - started) / 10)
            out[label] = flops / best / 1e9
    return out


class PositionCount:
    """Positions the target's decoder computes and logit rows its head computes (forward hooks)."""

    def __init__(self):
        self.positions = self.logit_rows = 0
        self.handles = []

    def attach(self, model):
        def decoder(_module, args, kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            if ids is not None:
                self.positions += ids.numel()

        def head(_module, args):
            self.logit_rows += args[0].shape[:-1].numel()
        self.handles = [model.model.register_forward_pre_hook(decoder, with_kwargs=True),
                        model.lm_head.register_forward_pre_hook(head)]


def profiled_run(data: DataConfig, records: list[dict], folder: Path) -> tuple[dict, PositionCount, float, object]:
    """The data stage under torch's profiler, counting positions through hooks on the model it loads."""
    from torch.profiler import ProfilerActivity, profile

    import specdec.train.data.backend_transformers as bt

    counts, loaded = PositionCount(), []
    original = bt.load_model

    def load_and_count(*args, **kwargs):
        model = original(*args, **kwargs)
        counts.attach(model)
        loaded.append(model)
        return model
    bt.load_model = load_and_count
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            result = data_run(data, records, folder)
    finally:
        bt.load_model = original
    shares: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        shares[OPERATORS.get(event.key, "other")] += event.self_cpu_time_total
    model = loaded[0]
    layer_params = sum(p.numel() for p in model.model.layers.parameters())
    head_params = model.lm_head.weight.numel()
    flops = 2 * layer_params * counts.positions + 2 * head_params * counts.logit_rows
    return result, counts, flops, dict(shares)


def main() -> None:
    args = parse_args()
    data = load_config(DataConfig, Path(args.recipe), [], section="data")
    records = pick_prompts(args.prompts)
    load_model(data.target)  # convert/cache the embedded checkpoint before any timing
    dtype = resolve_dtype(data.dtype, resolve_device(data.device))
    rates = matmul_rates(data.target, dtype, data.batch_size, prefill_rows=min(data.batch_tokens or 8192, 8192))
    for label, rate in rates.items():
        print(f"matmul {label}: {rate:.0f} GFLOP/s ({dtype})", flush=True)
    runs = []
    for rep in range(args.repeats):
        for cache in (("inplace", "dynamic") if rep % 2 == 0 else ("dynamic", "inplace")):
            with tempfile.TemporaryDirectory() as tmp:
                if cache == "dynamic":
                    with DynamicCacheBack():
                        result = data_run(data, records, Path(tmp))
                else:
                    result = data_run(data, records, Path(tmp))
            result.update(cache=cache, rep=rep)
            runs.append(result)
            print(f"rep {rep} cache={cache:<8} {result['tokens']} tokens in {result['seconds']:.1f} s = "
                  f"{result['tokens'] / result['seconds']:.1f} tok/s", flush=True)
    lines = ["| rep | cache | seconds | generated tokens | tokens/s | inplace / dynamic, same rep | identical "
             "completions | identical top-n |", "|---:|---|---:|---:|---:|---:|---:|---:|"]
    ratios = []
    for rep in range(args.repeats):
        pair = {r["cache"]: r for r in runs if r["rep"] == rep}
        a, b = pair["inplace"], pair["dynamic"]
        ratio = b["seconds"] / a["seconds"]
        ratios.append(ratio)
        same = sum(a["completions"][k] == b["completions"][k] for k in b["completions"])
        same_top = sum(a["top"][k] == b["top"][k] for k in b["top"])
        for r in (b, a):
            lines.append(f"| {rep} | {r['cache']} | {r['seconds']:.1f} | {r['tokens']} | "
                         f"{r['tokens'] / r['seconds']:.1f} | {ratio:.2f}x | {same}/{len(b['completions'])} | "
                         f"{same_top}/{len(b['top'])} |")
    median = statistics.median(ratios)
    body = [f"- data settings: {Path(args.recipe).name}'s data section: batch_size {data.batch_size}, batch_tokens "
            f"{data.batch_tokens}, max_new_tokens {data.max_new_tokens}, top_logprobs {data.top_logprobs}, "
            f"record_features {data.record_features} (layers {data.eagle_aux_layer_ids}), dtype {data.dtype} "
            f"({dtype}); {len(records)} embedded training prompts, one of each kind in turn, greedy, one shard",
            "- seconds: the manifest's generation seconds (model loading excluded)", "",
            "## The matmul rate at the data stage's shapes", "",
            "| shape | GFLOP/s |", "|---|---:|", *[f"| {k} | {v:.0f} |" for k, v in rates.items()], "",
            "## The KV cache written in place against DynamicCache", "", *lines, "",
            f"Median ratio: **{median:.2f}x** generated tokens/s.", ""]
    if not args.no_profile:
        with tempfile.TemporaryDirectory() as tmp:
            result, counts, flops, shares = profiled_run(data, records, Path(tmp))
        total = sum(shares.values())
        best = max(rates["step, layers"], rates["prefill, layers"])
        reached = flops / result["seconds"] / 1e9
        body += ["## Where the time goes (one profiled run, cache=inplace; the profiler slows it)", "",
                 f"- positions the target computed: {counts.positions} (prefills' padded widths and every decoding "
                 f"row, finished or not), logit rows {counts.logit_rows}, generated tokens {result['tokens']}",
                 f"- matmul FLOPs: {flops / 1e12:.2f} TFLOP in {result['seconds']:.1f} s = {reached:.0f} GFLOP/s, "
                 f"{reached / best:.0%} of the best matmul rate measured above ({best:.0f} GFLOP/s)", "",
                 "| operator class | share of operator time |", "|---|---:|",
                 *[f"| {k} | {v / total:.0%} |" for k, v in sorted(shares.items(), key=lambda kv_: -kv_[1])], ""]
    print("\n".join(body))
    print(f"wrote {write(args.name, 'specdec data against the CPU matmul limit', chr(10).join(body))}")


if __name__ == "__main__":
    main()
