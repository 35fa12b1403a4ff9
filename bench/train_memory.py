"""Host memory of EAGLE-3 training against the dataset's size: peak RSS of the same run on a small and a large
synthetic data folder (same tokens per batch, same steps), each in its own process.

    python bench/train_memory.py                                  # 200 vs 20,000 samples of 64 tokens
    python bench/train_memory.py --before ../specdec-old          # the same runs with another checkout's code too

The folders have the data stage's layout with recorded target states (random tokens, random bf16 states: memory
does not depend on the values), for a tiny random Llama target (hidden 32, 4 layers). Each run trains `--steps`
optimizer steps with the recorded states and reports its peak RSS (ru_maxrss). The ratio large / small says
whether memory grows with the data; `--before` repeats both runs with the code of another checkout.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import results  # bench/results.py (this script runs with bench/ on its path)
import torch
from checkouts import last_figure, run_child

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the tiny target and tokenizer the tests build

LAYERS = [1, 2, 3]
SHARD = 256

CHILD = """
import json, resource, sys
from specdec.train import distill
cfg = distill.TrainConfig(**json.loads(sys.argv[1]))
distill.run(cfg)
print("PEAK_RSS_KB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def write_folder(folder: Path, samples: int, length: int, width: int, seed: int) -> None:
    """A `specdec data` folder of `samples` rows of `length` tokens (half prompt) with recorded states."""
    from specdec.eagle3 import RECORDED_STATES_DTYPE
    from specdec.train.data import features_file, write_features, write_shard

    g = torch.Generator().manual_seed(seed)
    shards = []
    for s, start in enumerate(range(0, samples, SHARD)):
        rows = [{"prompt_id": f"p{seed}-{i}", "category": "synthetic", "sample_index": 0, "turn": 0,
                 "input_ids": torch.randint(7, 128, (length,), generator=g).tolist(), "prompt_length": length // 2,
                 "features": torch.randn(length - 1, width, generator=g).to(RECORDED_STATES_DTYPE)}
                for i in range(start, min(start + SHARD, samples))]
        name = f"shards/shard-{s:05d}.parquet"
        (folder / "shards").mkdir(parents=True, exist_ok=True)
        write_features(rows, folder / features_file(name))
        write_shard(rows, folder / name, top_logprobs=False)
        shards.append({"index": s, "file": name, "examples": len(rows), "generated_tokens": len(rows) * length // 2})
    manifest = {"format": "specdec-data/1", "complete": True, "num_shards": len(shards), "shards": shards,
                "fingerprint": f"synthetic-{samples}-{length}-{seed}",
                "features": {"layer_ids": LAYERS, "dtype": str(RECORDED_STATES_DTYPE).removeprefix("torch.")}}
    (folder / "manifest.json").write_text(json.dumps(manifest))


def peak_rss_mb(checkout: Path, settings: dict) -> float:
    """The peak RSS of one training run with `checkout`'s code, in its own process."""
    out = run_child(checkout, CHILD, settings, env={"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"})
    return last_figure(out, "PEAK_RSS_KB") / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", type=int, default=200)
    parser.add_argument("--large", type=int, default=20_000)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--before", type=Path, help="another checkout whose code to measure the same way")
    args = parser.parse_args()
    from conftest import tiny_llama, tiny_tokenizer

    work = Path(tempfile.mkdtemp(prefix="train-memory-"))
    target = tiny_llama(seed=0, layers=4, dtype=torch.float32)
    target.save_pretrained(work / "target")
    tiny_tokenizer().save_pretrained(work / "target")
    width = (1 + len(LAYERS)) * target.config.hidden_size
    sizes = {"small": args.small, "large": args.large}
    for name, samples in sizes.items():
        write_folder(work / name, samples, args.length, width, seed=1)
    write_folder(work / "heldout", 16, args.length, width, seed=2)
    checkouts = {"after": ROOT, **({"before": args.before.resolve()} if args.before else {})}
    rows = []
    for label, checkout in checkouts.items():
        peaks = {}
        for name in sizes:
            settings = dict(target=str(work / "target"), train_data=str(work / name),
                            heldout_data=str(work / "heldout"), output_dir=str(work / f"run-{label}-{name}"),
                            device="cpu", draft="eagle3", teacher="online", eagle_aux_layer_ids=LAYERS,
                            draft_vocab_size=64, ttt_steps=3, max_steps=args.steps, per_device_batch_size=args.batch,
                            max_length=args.length, warmup_steps=0, eval_every=0, save_every=0, eval_samples=8,
                            log_every=args.steps)
            peaks[name] = peak_rss_mb(checkout, settings)
            print(f"{label:6} {name:5} {sizes[name]:>7} samples: peak RSS {peaks[name]:.0f} MB", flush=True)
        rows.append((label, peaks["small"], peaks["large"], peaks["large"] / peaks["small"]))
    data_mb = sum(f.stat().st_size for f in (work / "large").rglob("*") if f.is_file()) / 2**20
    table = [f"| code | peak RSS, {args.small} samples | peak RSS, {args.large} samples | large / small |",
             "|---|---:|---:|---:|"]
    table += [f"| {label} | {small:.0f} MB | {large:.0f} MB | {ratio:.3f} |" for label, small, large, ratio in rows]
    body = "\n".join([
        f"EAGLE-3 training, {args.steps} steps of {args.batch} x {args.length} tokens, ttt_steps 3, states recorded "
        f"by the data stage (the large folder: {data_mb:.0f} MB on disk), tiny random Llama target (hidden 32, "
        "4 layers), one process each.", "", *table, ""])
    print(body)
    results.write("train-memory", "Training's host memory against the dataset's size", body)


if __name__ == "__main__":
    main()
