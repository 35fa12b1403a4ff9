"""Per-step costs that decide whether speculation pays: the target's step, the draft's c and the target's v(n).

    python bench/costs.py                                  # embedded SmolLM2 target, derived 6-layer draft
    python bench/costs.py --shapes smollm2,llama3.1-8b,qwen2.5-7b --device cuda --dtype bfloat16

c = draft step / target step and v(n) = a verify forward of n tokens / target step, each the median of cached
forwards at a fixed context (eval's own timing). `--shapes` builds the named target/draft pairs from their
configs with random weights, so a machine without the checkpoints can measure them: these timings depend on the
shapes, not on the weights. Prints, for each pair, what mean accepted tokens tau(k) a round needs to beat the
target alone by 1.0x and by 1.3x at each k, from speedup = tau / (k c + v(k + 1)).
"""

from __future__ import annotations

import argparse
import platform

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from specdec.eval.timing import measure_costs
from specdec.models import EMBEDDED_TARGET, load_model
from specdec.train.draft import derive_draft

# Published configs of the recipes' pairs (their config.json on the Hub), with what timing depends on.
_LLAMA3 = dict(vocab_size=128256, num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0)
_QWEN25 = dict(rope_theta=1000000.0)
SHAPES = {
    "smollm2": (LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                            num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True),
                [0, 1, 2, 3, 4, 29], 8192),
    "llama3.1-8b": (LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, **_LLAMA3),
                    LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, head_dim=64,
                                tie_word_embeddings=True, **_LLAMA3), None),
    "qwen2.5-7b": (Qwen2Config(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                               num_key_value_heads=4, vocab_size=152064, **_QWEN25),
                   Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                               num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, **_QWEN25), None),
}


def random_model(config, dtype: torch.dtype, device: torch.device):
    """Weights drawn directly on the device (an 8B model initialised on a CPU takes minutes)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model = model.to_empty(device=device).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.02)
    # The rotary table is a buffer computed at init: rebuild it off the meta device.
    model.model.rotary_emb = type(model.model.rotary_emb)(config).to(device)
    return model


def pair_for(name: str, dtype: torch.dtype, device: torch.device):
    target_config, draft_spec, vocab = SHAPES[name]
    target = random_model(target_config, dtype, device)
    if isinstance(draft_spec, list):
        from specdec.train.draft import reduce_vocab

        draft = derive_draft(target, draft_spec).to(device=device, dtype=dtype)
        if vocab:
            reduce_vocab(draft, torch.arange(vocab, device=device))
        return target, draft, f"target layers {draft_spec}, {vocab or 'full'}-id head"
    return target, random_model(draft_spec, dtype, device), "the recipe's small model"


def report(name: str, costs: dict, ks: list[int], what: str) -> None:
    c = costs["c"]
    print(f"\n{name}: target step {costs['target_step_ms']:.2f} ms, draft ({what}) {costs['draft_step_ms']:.2f} ms, "
          f"c = {c:.3f}")
    print("  k  v(k+1)  tau for 1.0x  tau for 1.3x  (tau can reach k+1)")
    for k in ks:
        v = costs["v"][str(k)]
        print(f"  {k}  {v:6.2f}  {k * c + v:12.2f}  {1.3 * (k * c + v):12.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="", help=f"random-weight pairs, comma-separated: {', '.join(SHAPES)}")
    parser.add_argument("--target", default=EMBEDDED_TARGET, help="a real target (when --shapes is empty)")
    parser.add_argument("--layers", default="0,1,2,3,4,29", help="target layers of the derived draft")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--context", type=int, default=256, help="tokens already in the cache")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine()
    print(f"device {name}, {args.dtype}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"context {args.context}")
    ks = [1, 2, 3, 4, 5, 6, 8]
    ids = torch.randint(100, 1000, (1, args.context), generator=torch.Generator().manual_seed(0)).to(device)
    if args.shapes:
        for shape in args.shapes.split(","):
            target, draft, what = pair_for(shape, dtype, device)
            report(shape, measure_costs(target, draft, ids, ks, args.repeats), ks, what)
            del target, draft
            if device.type == "cuda":
                torch.cuda.empty_cache()
    else:
        target = load_model(args.target, dtype=args.dtype, device=args.device)
        layers = [int(x) for x in args.layers.split(",")]
        draft = derive_draft(target, layers).to(device=device, dtype=dtype)
        report(args.target, measure_costs(target, draft, ids, ks, args.repeats), ks, f"target layers {layers}")


if __name__ == "__main__":
    main()
