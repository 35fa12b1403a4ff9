"""Memory and disk plans of the 8B EAGLE-3 recipes (train/plan/) for a machine of 8 x 80 GB GPUs, from the
targets' published configs: no download, no weights, no GPU needed.

    python bench/plan.py                                   # 8 x 80 GiB; writes docs/results/<date>-plan-8b.md
    python bench/plan.py --device-gb 141 --devices 8 --mean-length 1500

Each plan is exactly what `specdec train --plan --config RECIPE plan_device_gb=80 plan_devices=8
--target-config CONFIG` prints: per device, the resident terms (draft, AdamW, target weights, ...), each phase's
terms (train step, online target forward, held-out replay, optimizer step) with the peak phase marked, the
recorded states' read rate and the data stage's disk size. The configs below are the models' config.json values
(meta-llama/Llama-3.1-8B-Instruct, Qwen/Qwen3-8B), kept here because this machine has no network.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import results  # bench/results.py (this script runs with bench/ on its path)

from specdec.config import load_config
from specdec.train import plan
from specdec.train.distill import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
TARGETS = {
    "recipes/llama3.1-8b-eagle3.yaml": {
        "model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 131072, "tie_word_embeddings": False, "hidden_act": "silu",
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
    "recipes/qwen3-8b-eagle3.yaml": {
        "model_type": "qwen3", "hidden_size": 4096, "num_hidden_layers": 36, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 12288, "vocab_size": 151936,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 40960, "tie_word_embeddings": False, "hidden_act": "silu",
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device-gb", type=float, default=80.0, help="memory per device, GiB")
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--mean-length", type=int, default=0,
                        help="mean tokens per sample for the disk plan (0: half of max_length)")
    args = parser.parse_args()
    sections, rows = [], []
    for recipe, config in TARGETS.items():
        cfg = load_config(TrainConfig, ROOT / recipe, [f"plan_device_gb={args.device_gb}",
                                                       f"plan_devices={args.devices}"], section="train")
        options = plan.PlanOptions(plan=True, target_config=json.dumps(config), plan_mean_length=args.mean_length)
        p = plan.plan_for(cfg, options, data=plan.recipe_data_config(str(ROOT / recipe)))
        text = p.render()
        print(text, "\n")
        sections += [f"## {recipe}", "", "```", text, "```", ""]
        phases = ", ".join(f"{name} {p.phase_total(name) / plan.GiB:.1f}" for name in p.phases)
        rows.append(f"| {recipe} | {p.total / plan.GiB:.1f} | {p.peak_phase} | {p.largest.name} "
                    f"({p.largest.bytes / plan.GiB:.1f}) | {phases} | {'yes' if p.fits() else 'no'} |")
    body = "\n".join([
        f"Plans of the 8B EAGLE-3 recipes for {args.devices} devices of {args.device_gb:g} GiB (`train/plan/`, the "
        "plan `specdec train --plan` prints and every run checks), from the targets' published configs. Upper "
        "bounds where the data decides: every row max_length long, every position scored. GiB per device. The "
        "activation formulas are those tests/test_plan.py checks against measured peaks of real training steps on a "
        "CPU (float32 and bf16 autocast); the CUDA caching allocator's slack is counted only in the 1 GiB runtime "
        "term.", "",
        "| recipe | total | peak phase | largest term | phases | fits |", "|---|---:|---|---|---|---|", *rows, "",
        *sections])
    print(f"written to {results.write('plan-8b', 'Memory and disk plans of the 8B EAGLE-3 recipes', body)}")


if __name__ == "__main__":
    main()
