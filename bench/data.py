"""Data-stage throughput: `specdec data` (batched, length-sorted) vs a plain loop of unbatched `model.generate`.

    python bench/data.py                                  # embedded SmolLM2 target, 24 prompts x 64 new tokens
    python bench/data.py --prompts 48 --max-new-tokens 128 --batch-size 16 --target path/or/hub-id

Greedy, the same prompts (spread over the embedded prompt set's kinds), chat template and EOS for both.
The data stage runs through `train.data.run` exactly as `specdec data` does (its generation seconds come from
the manifest, so model loading is left out of both sides); the baseline calls `model.generate` once per prompt.
Prints generated tokens/s of each, their ratio measured in this run, and how many completions agree token for
token (batched float32 GEMMs may flip near-ties, so a few may differ).
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import torch

from specdec.models import EMBEDDED_TARGET, load_model, load_tokenizer
from specdec.prompts import encode_prompt, read_prompts
from train.data import DataConfig, load_generated, run
from train.prompt_set import EMBEDDED_TRAIN_PROMPTS


def pick_prompts(n: int) -> list[dict]:
    """n prompts spread evenly over the embedded train set (which is grouped by kind)."""
    prompts = read_prompts(EMBEDDED_TRAIN_PROMPTS)
    step = max(1, len(prompts) // n)
    chosen = prompts[::step][:n]
    return [{"prompt_id": p.prompt_id, "category": p.category, "messages": p.messages[:1]} for p in chosen]


def baseline(target: str, records: list[dict], max_new_tokens: int) -> tuple[dict[str, list[int]], int, float]:
    """Unbatched `model.generate`, one prompt at a time: completions, generated tokens, seconds."""
    model, tok = load_model(target, dtype="float32", device="cpu"), load_tokenizer(target)
    eos = model.generation_config.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else (eos if isinstance(eos, int) else eos[0])
    outputs, tokens = {}, 0
    start = time.perf_counter()
    for rec in records:
        ids = torch.tensor([encode_prompt(tok, rec["messages"])])
        with torch.inference_mode():
            seq = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                                 temperature=None, top_p=None, top_k=None, eos_token_id=eos, pad_token_id=pad)
        new = seq[0, ids.shape[1]:].tolist()
        eos_ids = {eos} if isinstance(eos, int) else set(eos)
        cut = next((i + 1 for i, t in enumerate(new) if t in eos_ids), len(new))
        outputs[rec["prompt_id"]] = new[:cut]
        tokens += cut
    return outputs, tokens, time.perf_counter() - start


def data_stage(target: str, records: list[dict], max_new_tokens: int, batch_size: int, folder: Path):
    """`train.data.run` over the same prompts: completions, generated tokens, generation seconds."""
    prompts = folder / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = DataConfig(target=target, prompts=str(prompts), output_dir=str(folder / "out"), max_new_tokens=max_new_tokens,
                     batch_size=batch_size, shard_size=len(records), temperature=0.0, device="cpu", dtype="float32",
                     spec_bench_turns="first")
    manifest = run(cfg)
    seconds = sum(s["seconds"] for s in manifest["shards"])
    rows = load_generated(cfg.output_dir)
    outputs = {r["prompt_id"]: r["input_ids"][r["prompt_length"]:] for r in rows}
    return outputs, manifest["counts"]["generated_tokens"], seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=EMBEDDED_TARGET)
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=12)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = leave torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    records = pick_prompts(args.prompts)
    load_model(args.target)  # convert/cache the embedded checkpoint before any timing
    with tempfile.TemporaryDirectory() as tmp:
        d_out, d_tokens, d_seconds = data_stage(args.target, records, args.max_new_tokens, args.batch_size, Path(tmp))
    b_out, b_tokens, b_seconds = baseline(args.target, records, args.max_new_tokens)
    same = sum(d_out[k] == b_out[k] for k in b_out)
    d_rate, b_rate = d_tokens / d_seconds, b_tokens / b_seconds
    print(f"machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; target {args.target}; {len(records)} prompts x up to "
          f"{args.max_new_tokens} new tokens, greedy")
    print(f"baseline  (unbatched model.generate loop): {b_tokens:5d} tokens in {b_seconds:7.1f} s = {b_rate:7.1f} tok/s")
    print(f"specdec data (batch {args.batch_size}, length-sorted):  {d_tokens:5d} tokens in {d_seconds:7.1f} s "
          f"= {d_rate:7.1f} tok/s")
    print(f"ratio data/baseline: {d_rate / b_rate:.2f}x   identical completions: {same}/{len(b_out)}")


if __name__ == "__main__":
    main()
