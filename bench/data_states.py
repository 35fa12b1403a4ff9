"""The target's states with backend=vllm: extracted from vLLM's own forwards, or a transformers prefill after its
decoding (`vllm_states=extract|prefill`), timed in one run.

    python bench/data_states.py                       # embedded SmolLM2 target, 16 prompts x 64 new tokens
    python bench/data_states.py --prompts 32 --max-new-tokens 128 --repeats 2 --compiled

Greedy, float32, the same prompts (spread over the embedded prompt set's kinds) and feature layers as the demo's
recipe; the two ways alternate (ABBA over --repeats). Time per token = the manifest's generation seconds (vLLM's
start and model loading excluded; the prefill, or the extraction's extra work, included) over the generated tokens,
and over the fed positions whose states are recorded (prompt + completion - 1 per row). Prints how much of the
prefill way's time the prefill takes, and whether both ways made the same completions and (to bf16 rounding) the
same states; writes the table to docs/results/<date>-data-states.md with the machine's load before each run.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from specdec.models import EMBEDDED_TARGET, load_model
from specdec.train.data import DataConfig, load_generated, recorded_features, run

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data import _load, _vllm_version, pick_prompts, same_rows  # noqa: E402
from results import write  # noqa: E402


def one_run(args, records: list[dict], folder: Path, way: str) -> dict:
    """One `specdec data` run of backend=vllm with record_features, its states the `way` given."""
    prompts = folder / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = DataConfig(target=args.target, prompts=str(prompts), output_dir=str(folder / "out"), backend="vllm",
                     max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, shard_size=len(records),
                     temperature=0.0, device="cpu", dtype="float32", spec_bench_turns="first",
                     record_features=True, eagle_aux_layer_ids=args.layer_ids, vllm_states=way,
                     vllm_args=None if args.compiled else {"enforce_eager": True})
    manifest = run(cfg)
    rows = {r["prompt_id"]: r["input_ids"] for r in load_generated(cfg.output_dir)}
    states = {pid: f for columns, feats in recorded_features(cfg.output_dir)
              for pid, f in zip(columns["prompt_id"], feats)}
    shards = manifest["shards"]
    return dict(way=way, seconds=sum(s["seconds"] for s in shards), tokens=manifest["counts"]["generated_tokens"],
                fed=sum(len(f) for f in states.values()), prefill=sum(s.get("states_seconds", 0.0) for s in shards),
                rows=rows, states=states)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=EMBEDDED_TARGET)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=1, help="runs of each way (alternated, ABBA)")
    parser.add_argument("--layer-ids", type=json.loads, default=[2, 15, 27])
    parser.add_argument("--compiled", action="store_true", help="vLLM's compiled default (starts ~4x slower)")
    args = parser.parse_args()
    records = pick_prompts(args.prompts)
    load_model(args.target)  # convert/cache the embedded checkpoint before any timing
    results = []
    for rep in range(args.repeats):
        for way in ("extract", "prefill") if rep % 2 == 0 else ("prefill", "extract"):
            load = _load()
            with tempfile.TemporaryDirectory() as tmp:
                result = dict(one_run(args, records, Path(tmp), way), rep=rep, load=load)
            results.append(result)
            print(f"rep {rep} {way:>8}: {result['tokens']} tokens ({result['fed']} fed positions) in "
                  f"{result['seconds']:.1f} s = {1e3 * result['seconds'] / result['tokens']:.1f} ms/token; "
                  f"prefill of states: {result['prefill']:.1f} s of {result['seconds']:.1f} s (load {load})",
                  flush=True)
    lines = ["| rep | states | generated tokens | ms / generated token | ms / fed position | prefill of states "
             "| same completions | states equal (bf16) | load before |", "|---:|---|---:|---:|---:|---|---:|---|---|"]
    for r in results:
        other = next(o for o in results if o["rep"] == r["rep"] and o["way"] != r["way"])
        same, close = same_rows(r, other)
        share = f"{r['prefill']:.1f} s of {r['seconds']:.1f} s ({r['prefill'] / r['seconds']:.0%})" \
            if r["way"] == "prefill" else "-"
        lines.append(f"| {r['rep']} | {r['way']} | {r['tokens']} | {1e3 * r['seconds'] / r['tokens']:.1f} | "
                     f"{1e3 * r['seconds'] / r['fed']:.2f} | {share} | {len(same)}/{len(r['rows'])} | {close} | "
                     f"{r['load']} |")
    table = "\n".join(lines)
    print(table)
    body = "\n".join([
        f"- vLLM {_vllm_version()} (its own environment), CPU, float32, greedy; target {args.target}; "
        f"{len(records)} embedded training prompts x up to {args.max_new_tokens} new tokens, batch "
        f"{args.batch_size}; eagle_aux_layer_ids {args.layer_ids}; {'compiled' if args.compiled else 'enforce_eager'}",
        "- extract: vLLM's extract_hidden_states method (a one-token speculative step per decode step) and its "
        "states written per request; prefill: plain decoding, then a batched transformers prefill over each row",
        "- time = the manifest's generation seconds (engine start and model loading excluded); states equal = "
        "every row with the same completion has the same states to bf16 rounding (atol 2e-2, rtol 1e-2)",
        "- load = the 1-minute load average / cores just before each run (other work shares the machine)", "",
        table, ""])
    print(f"wrote {write('data-states', 'specdec data backend=vllm: extracted states vs a prefill', body)}")


if __name__ == "__main__":
    main()
