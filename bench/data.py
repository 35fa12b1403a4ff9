"""Data-stage throughput: `specdec data` (batched, length-sorted) vs a plain loop of unbatched `model.generate`,
or (--backend vllm) its two backends against each other.

    python bench/data.py                                  # embedded SmolLM2 target, 24 prompts x 64 new tokens
    python bench/data.py --prompts 48 --max-new-tokens 128 --batch-size 16 --target path/or/hub-id
    python bench/data.py --backend vllm                   # backend=transformers vs backend=vllm (make vllm-env)
    python bench/data.py --backend vllm --repeats 2 --prompts 64 --max-new-tokens 96 --batch-size 64

Greedy, the same prompts (spread over the embedded prompt set's kinds), chat template and EOS for both.
The data stage runs through `specdec.train.data.run` exactly as `specdec data` does (its generation seconds come
from the manifest, so model loading and vLLM's start are left out; the start is printed apart); the baseline calls
`model.generate` once per prompt. Prints generated tokens/s of each, their ratio measured in this run, and how many
completions agree token for token (batched float32 GEMMs may flip near-ties, so a few may differ).

--backend vllm runs, for float32 and bf16-if-native, without and with record_features (vLLM's features come from
a transformers prefill after its decoding, inside the timed generation), each backend `--repeats` times,
alternated (ABBA), with the demo's top_logprobs and feature layers by default; it writes the table to
docs/results/<date>-data-backends.md with the machine's load before each run (timed runs on a shared machine
need it: compare pairs, not runs hours apart).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from specdec.models import EMBEDDED_TARGET, load_model, load_tokenizer, resolve_dtype
from specdec.prompts import encode_prompt, read_prompts
from specdec.train.data import DataConfig, load_generated, run
from specdec.train.prompt_templates import EMBEDDED_TRAIN_PROMPTS


def pick_prompts(n: int) -> list[dict]:
    """n prompts of the embedded train set, one of each kind in turn (whatever order the set keeps them in)."""
    kinds: dict[str, list] = {}
    for p in read_prompts(EMBEDDED_TRAIN_PROMPTS):
        kinds.setdefault(p.category, []).append(p)
    dealt = [group[i] for i in range(max(map(len, kinds.values()))) for group in kinds.values() if i < len(group)]
    chosen = dealt[:n]
    return [{"prompt_id": p.prompt_id, "category": p.category, "messages": p.messages[:1]} for p in chosen]


def same_rows(run: dict, other: dict) -> tuple[list, bool]:
    """The ids of the rows two runs completed alike, and whether those rows' states agree to bf16 rounding."""
    same = [k for k in run["rows"] if run["rows"][k] == other["rows"].get(k)]
    return same, all(torch.allclose(run["states"][k].float(), other["states"][k].float(), atol=2e-2, rtol=1e-2)
                     for k in same)


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


def data_stage(target: str, records: list[dict], max_new_tokens: int, batch_size: int, folder: Path, **settings):
    """`specdec.train.data.run` over the same prompts (more DataConfig `settings` allowed): completions, generated
    tokens, generation seconds, and the run's other seconds (loading; vLLM's start)."""
    prompts = folder / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = DataConfig(**{**dict(target=target, prompts=str(prompts), output_dir=str(folder / "out"),
                               max_new_tokens=max_new_tokens, batch_size=batch_size, shard_size=len(records),
                               temperature=0.0, device="cpu", dtype="float32", spec_bench_turns="first"), **settings})
    started = time.perf_counter()
    manifest = run(cfg)
    wall = time.perf_counter() - started
    seconds = sum(s["seconds"] for s in manifest["shards"])
    rows = load_generated(cfg.output_dir)
    outputs = {r["prompt_id"]: r["input_ids"][r["prompt_length"]:] for r in rows}
    return outputs, manifest["counts"]["generated_tokens"], seconds, wall - seconds


def _load() -> str:
    """The machine's 1-minute load average and core count, e.g. '0.42/2'."""
    return f"{os.getloadavg()[0]:.2f}/{os.cpu_count()}"


def compare_backends(args, records: list[dict]) -> list[dict]:
    """backend=transformers and backend=vllm on the same prompts, per dtype and record_features, alternated."""
    from specdec.vllm_env import vllm_python

    vllm_python()  # fails here, with how to make vLLM's environment, rather than after the first timed run
    vllm_args = json.loads(args.vllm_args) if args.vllm_args else None
    results = []
    for dtype in args.dtypes.split(","):
        for features in (False, True):
            extra = dict(dtype=dtype, top_logprobs=args.top_logprobs, record_features=features,
                         eagle_aux_layer_ids=args.layer_ids if features else [])
            for rep in range(args.repeats):
                order = ("transformers", "vllm") if rep % 2 == 0 else ("vllm", "transformers")  # ABBA: drift cancels
                for backend in order:
                    load = _load()
                    with tempfile.TemporaryDirectory() as tmp:
                        outputs, tokens, seconds, other = data_stage(
                            args.target, records, args.max_new_tokens, args.batch_size, Path(tmp), backend=backend,
                            vllm_args=vllm_args if backend == "vllm" else None, **extra)
                    results.append(dict(dtype=dtype, features=features, rep=rep, backend=backend, tokens=tokens,
                                        seconds=seconds, rate=tokens / seconds, other_s=other, load=load,
                                        outputs=outputs))
                    print(f"{dtype:>14} features={features!s:<5} rep {rep} {backend:>12}: {tokens} tokens in "
                          f"{seconds:6.1f} s = {tokens / seconds:6.1f} tok/s (other {other:5.1f} s; load {load})",
                          flush=True)
    return results


def _vllm_version() -> str:
    from specdec.vllm_env import vllm_python, vllm_version

    return vllm_version(vllm_python())


def backends_table(results: list[dict]) -> str:
    """Markdown: per dtype, record_features and repetition, both rates and their ratio (same repetition)."""
    lines = ["| dtype | record_features | rep | transformers tok/s | vllm tok/s | vllm / transformers | "
             "identical completions | load before (transformers, vllm) | other s (transformers, vllm) |",
             "|---|---|---:|---:|---:|---:|---:|---|---|"]
    for dtype in dict.fromkeys(r["dtype"] for r in results):
        for features in (False, True):
            for rep in sorted({r["rep"] for r in results}):
                pair = {r["backend"]: r for r in results
                        if (r["dtype"], r["features"], r["rep"]) == (dtype, features, rep)}
                if len(pair) < 2:
                    continue
                t, v = pair["transformers"], pair["vllm"]
                same = sum(v["outputs"].get(k) == out for k, out in t["outputs"].items())
                resolved = str(resolve_dtype(dtype, torch.device("cpu"))).removeprefix("torch.")
                lines.append(f"| {dtype} ({resolved}) | {features} | {rep} | {t['rate']:.1f} | {v['rate']:.1f} | "
                             f"{v['rate'] / t['rate']:.2f}x | {same}/{len(t['outputs'])} | {t['load']}, {v['load']} "
                             f"| {t['other_s']:.0f}, {v['other_s']:.0f} |")
    return "\n".join(lines)


def main_backends(args) -> None:
    """--backend vllm: the table, printed and written to docs/results/."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from results import write

    records = pick_prompts(args.prompts)
    load_model(args.target)  # convert/cache the embedded checkpoint before any timing
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    cpu = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name")), "?")
    before = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    results = compare_backends(args, records)
    table = backends_table(results)
    print(table)
    body = "\n".join([
        f"- lscpu model name: {cpu}; vLLM {_vllm_version()} (its own environment); load before the runs: {before}",
        f"- target {args.target}; {len(records)} embedded training prompts x up to {args.max_new_tokens} new "
        f"tokens, greedy, batch {args.batch_size} (vLLM: max_num_seqs), top_logprobs {args.top_logprobs}, "
        f"record_features with eagle_aux_layer_ids {args.layer_ids} where true; vllm_args {args.vllm_args or 'none'}",
        "- tok/s = generated tokens / the manifest's generation seconds (vLLM's start and model loading excluded, "
        "listed as 'other s'; with record_features vLLM's figure includes its transformers feature prefill)",
        "- load = the 1-minute load average / cores just before each run (other agents share the machine)", "",
        table, ""])
    print(f"wrote {write(args.results_name, 'specdec data: backend=transformers vs backend=vllm', body)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=EMBEDDED_TARGET)
    parser.add_argument("--backend", choices=("baseline", "vllm"), default="baseline",
                        help="compare the data stage with a model.generate loop, or its two backends")
    parser.add_argument("--prompts", type=int, default=None, help="[24; 64 with --backend vllm]")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="[64; 96 with --backend vllm]")
    parser.add_argument("--batch-size", type=int, default=None, help="[12; 64 with --backend vllm]")
    parser.add_argument("--repeats", type=int, default=2, help="--backend vllm: runs of each backend per case")
    parser.add_argument("--top-logprobs", type=int, default=20, help="--backend vllm: as the demo's data")
    parser.add_argument("--layer-ids", type=json.loads, default=[2, 15, 27], help="record_features: as the demo's")
    parser.add_argument("--vllm-args", default=None, help='--backend vllm: JSON vllm.LLM arguments, e.g. '
                                                          '\'{"enforce_eager": true}\'')
    parser.add_argument("--dtypes", default="float32,bf16-if-native", help="--backend vllm: the dtypes compared")
    parser.add_argument("--results-name", default="data-backends",
                        help="--backend vllm: docs/results/<date>-<this>.md")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = leave torch's default)")
    args = parser.parse_args()
    vllm_mode = args.backend == "vllm"
    for key, plain, vllm in (("prompts", 24, 64), ("max_new_tokens", 64, 96), ("batch_size", 12, 64)):
        if getattr(args, key) is None:
            setattr(args, key, vllm if vllm_mode else plain)
    if args.threads:
        torch.set_num_threads(args.threads)
    if vllm_mode:
        main_backends(args)
        return
    records = pick_prompts(args.prompts)
    load_model(args.target)  # convert/cache the embedded checkpoint before any timing
    with tempfile.TemporaryDirectory() as tmp:
        d_out, d_tokens, d_seconds, _ = data_stage(args.target, records, args.max_new_tokens, args.batch_size,
                                                   Path(tmp))
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
