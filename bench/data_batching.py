"""`specdec data` (backend=transformers) with batches bounded by padded positions (`batch_tokens`) or by prompts
alone (`batch_tokens=0`), timed in one run on the demo recipe's data settings.

    python bench/data_batching.py                        # 128 embedded training prompts, 8 of each kind
    python bench/data_batching.py --prompts 64 --repeats 2 --batch-tokens 8192

The prompts are the embedded training set's, one of each kind in turn (long-summarisation's 520-750-token
documents beside one-line requests), answered as the demo's data stage answers them (recipes/
smollm2-135m-eagle3.yaml: max_new_tokens, batch_size, top_logprobs, record_features and its layers, dtype), greedy,
in one shard; the two settings alternate (ABBA over --repeats). Time = the manifest's generation seconds (model
loading excluded). Prints the ratio measured in this run, the padded positions each way computed, how many
completions are identical and whether their states agree to bf16 rounding; writes docs/results/<date>-<name>.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import yaml

from specdec.models import EMBEDDED_TARGET, load_model
from specdec.train.data import DataConfig, load_generated, recorded_features, run
from specdec.train.data.backend import _batches

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data import _load, pick_prompts, same_rows  # noqa: E402
from results import header, write  # noqa: E402

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "smollm2-135m-eagle3.yaml"


def one_run(args, data: dict, records: list[dict], folder: Path, batch_tokens: int) -> dict:
    prompts = folder / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = DataConfig(target=args.target, prompts=str(prompts), output_dir=str(folder / "out"), device="cpu",
                     max_new_tokens=data["max_new_tokens"], batch_size=data["batch_size"], batch_tokens=batch_tokens,
                     top_logprobs=data["top_logprobs"], dtype=data["dtype"], record_features=True,
                     eagle_aux_layer_ids=data["eagle_aux_layer_ids"], shard_size=len(records), temperature=0.0,
                     spec_bench_turns="first")
    manifest = run(cfg)
    rows = {r["prompt_id"]: (r["input_ids"], r["prompt_length"]) for r in load_generated(cfg.output_dir)}
    states = {pid: f for columns, feats in recorded_features(cfg.output_dir)
              for pid, f in zip(columns["prompt_id"], feats)}
    return dict(batch_tokens=batch_tokens, seconds=sum(s["seconds"] for s in manifest["shards"]),
                tokens=manifest["counts"]["generated_tokens"], padded=padded_positions(rows, cfg),
                rows={k: ids for k, (ids, _) in rows.items()}, states=states)


def padded_positions(rows: dict, cfg: DataConfig) -> int:
    """Positions the decoder computed, padding included: each batch's rows x (its longest prompt + the longest
    completion), batched as the data stage batched them (length-sorted, batch_size and batch_tokens)."""
    prompts = {k: ids[:n] for k, (ids, n) in rows.items()}
    new = {k: len(ids) - n for k, (ids, n) in rows.items()}
    order = sorted(prompts, key=lambda k: -len(prompts[k]))
    return sum(len(chunk) * (max(len(prompts[k]) for k in chunk) + max(new[k] for k in chunk))
               for chunk in _batches(order, prompts, cfg.batch_size, cfg))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=EMBEDDED_TARGET)
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--batch-tokens", type=int, default=DataConfig().batch_tokens, help="the bounded way's budget")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each way (alternated, ABBA)")
    parser.add_argument("--name", default="data-batching", help="results page name")
    args = parser.parse_args()
    provenance = header("specdec data: batches bounded by padded positions")
    data = yaml.safe_load(RECIPE.read_text())["data"]
    records = pick_prompts(args.prompts)
    load_model(args.target)  # convert/cache the embedded checkpoint before any timing
    results = []
    for rep in range(args.repeats):
        for budget in (0, args.batch_tokens) if rep % 2 == 0 else (args.batch_tokens, 0):
            load = _load()
            with tempfile.TemporaryDirectory() as tmp:
                result = dict(one_run(args, data, records, Path(tmp), budget), rep=rep, load=load)
            results.append(result)
            print(f"rep {rep} batch_tokens={budget}: {result['tokens']} tokens in {result['seconds']:.1f} s, "
                  f"{result['padded']} padded positions (load {load})", flush=True)
    lines = ["| rep | batch_tokens | seconds | generated tokens | tokens/s | padded positions | ratio to 0, same rep "
             "| same completions | states equal (bf16) | load before |", "|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in results:
        other = next(o for o in results if o["rep"] == r["rep"] and o["batch_tokens"] != r["batch_tokens"])
        unbounded = r if r["batch_tokens"] == 0 else other
        same, close = same_rows(r, other)
        lines.append(f"| {r['rep']} | {r['batch_tokens']} | {r['seconds']:.1f} | {r['tokens']} | "
                     f"{r['tokens'] / r['seconds']:.1f} | {r['padded']} | {unbounded['seconds'] / r['seconds']:.2f}x | "
                     f"{len(same)}/{len(r['rows'])} | {close} | {r['load']} |")
    table = "\n".join(lines)
    print(table)
    body = "\n".join([
        f"- target {args.target}; {len(records)} embedded training prompts, one of each kind in turn; "
        f"{RECIPE.name}'s data settings: max_new_tokens {data['max_new_tokens']}, batch_size {data['batch_size']}, "
        f"top_logprobs {data['top_logprobs']}, record_features with layers {data['eagle_aux_layer_ids']}, dtype "
        f"{data['dtype']}, greedy, one shard",
        "- seconds = the manifest's generation seconds (model loading excluded); ratio = the unbounded run's seconds "
        "over this run's, the same rep; padded positions = what each batch computed, rows x (longest prompt + "
        "longest completion); states equal = rows with the same completion have the same states to bf16 rounding",
        "- load = the 1-minute load average / cores just before each run", "", table, ""])
    print(f"wrote {write(args.name, 'specdec data: batches bounded by padded positions', body, provenance)}")


if __name__ == "__main__":
    main()
