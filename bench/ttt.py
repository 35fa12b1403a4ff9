"""Cost of the training-time test: one EAGLE-3 optimizer step (loss, backward, AdamW) against ttt_steps.

    python bench/ttt.py                              # SmolLM2-135M shapes, batch 16 x 320 tokens, steps 1 2 3 5 7
    python bench/ttt.py --steps 1 3 5 --batch 8 --length 512 --repeats 5 --device cuda

The draft and the target's states are random with the embedded target's shapes (the cost depends on the shapes,
not on the weights). The step counts are timed interleaved, in an order that rotates from pass to pass, so
that drift in the machine's speed slows all alike; each figure is the median over passes. Prints the step time
of each ttt_steps, its ratio to ttt_steps = 1 and the cost added per extra unrolled step: constant increments
mean the cost grows linearly. Writes the table to docs/results/.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import results  # bench/results.py (this script runs with bench/ on its path)
import torch
from transformers import LlamaConfig

from specdec.eagle3 import Eagle3Draft, draft_config
from specdec.train.distill import TrainConfig
from specdec.train.eagle3_train import eagle3_loss

SMOLLM2 = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                      num_key_value_heads=3, vocab_size=49152, rms_norm_eps=1e-5, max_position_embeddings=8192,
                      rope_theta=100000.0)


def make_step(steps: int, draft: Eagle3Draft, batch: dict, states: torch.Tensor, head, inv_map):
    """One optimizer step of the EAGLE-3 loss unrolled `steps` deep, as a callable."""
    cfg = TrainConfig(draft="eagle3", teacher="online", ttt_steps=steps, eagle_aux_layer_ids=draft.layer_ids)
    optimizer = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=1e-5)

    def step() -> None:
        loss = eagle3_loss(cfg, draft, batch, states, head, inv_map)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, nargs="+", default=[1, 2, 3, 5, 7])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=320, help="tokens per row (the completion is the second half)")
    parser.add_argument("--vocab", type=int, default=4096, help="draft vocabulary")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast (what the trainer uses where native)")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    config = draft_config(SMOLLM2, [2, 15, 27], args.vocab)
    draft = Eagle3Draft(config).to(device)
    draft.set_vocabulary(torch.randperm(SMOLLM2.vocab_size)[: args.vocab])
    draft.embed_tokens.weight.requires_grad_(False)
    hidden = SMOLLM2.hidden_size
    ids = torch.randint(0, SMOLLM2.vocab_size, (args.batch, args.length), device=device)
    ids[:, args.length // 2:] = draft.draft_to_target[ids[:, args.length // 2:] % args.vocab]  # scored tokens
    loss_mask = torch.zeros_like(ids, dtype=torch.bool)
    loss_mask[:, args.length // 2 - 1: -1] = True
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": loss_mask,
             "labels": torch.roll(ids, -1, dims=1)}
    states = torch.randn(args.batch, args.length, 4 * hidden, device=device)
    head = torch.nn.Linear(hidden, args.vocab, bias=False, device=device).requires_grad_(False)
    inv_map = torch.full((SMOLLM2.vocab_size,), -1, dtype=torch.long, device=device)
    inv_map[draft.draft_to_target] = torch.arange(args.vocab, device=device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if args.bf16 else contextlib.nullcontext()
    steps = {n: make_step(n, draft, batch, states, head, inv_map) for n in args.steps}
    times: dict[int, list[float]] = {n: [] for n in args.steps}
    with autocast:
        for fn in steps.values():  # warm-up
            fn()
        order = list(args.steps)
        for i in range(args.repeats):
            for n in order[i % len(order):] + order[: i % len(order)]:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                steps[n]()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                times[n].append(time.perf_counter() - start)
    median = {n: statistics.median(t) for n, t in times.items()}
    base = median[args.steps[0]]
    lines = [f"| ttt_steps | step time (s) | ratio to ttt_steps = {args.steps[0]} | added per extra step (s) |",
             "|---:|---:|---:|---:|"]
    prev = None
    for n in args.steps:
        added = "" if prev is None else f"{(median[n] - median[prev]) / (n - prev):.3f}"
        lines.append(f"| {n} | {median[n]:.3f} | {median[n] / base:.2f} | {added} |")
        prev = n
    body = "\n".join([
        f"One EAGLE-3 optimizer step (specdec's unrolled training-time test, `train/eagle3_train.py`), SmolLM2-135M "
        f"shapes, batch {args.batch} x {args.length} tokens, draft vocabulary {args.vocab}, "
        f"{'bf16 autocast' if args.bf16 else 'float32'}, {args.device}; median of {args.repeats} interleaved passes.",
        "", *lines])
    print(body)
    print(f"\nwritten to {results.write('ttt-step-cost', 'Training-time test: step cost against ttt_steps', body)}")


if __name__ == "__main__":
    main()
