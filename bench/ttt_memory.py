"""Peak memory of one EAGLE-3 training step (the unrolled training-time test) against the row length S, at a fixed
number of tokens per batch: the chunked attention of specdec/eagle3/attention.py ("after") against the dense one
it replaced ("before", kept below).

    python bench/ttt_memory.py                                   # S = 512 .. 8192, 8192 tokens per batch
    python bench/ttt_memory.py --lengths 512 2048 --tokens 4096 --steps 3

Each (S, side) runs in a child process of its own, so that no peak carries over. The child builds a tiny random
EAGLE-3 draft (hidden 64, 4 heads, vocabulary 512), random target states and tokens for B = tokens / S rows of S
tokens, runs one small warm-up step, then resets its peak RSS (Linux: /proc/self/clear_refs) and reports how far
one forward + backward (cross-entropy over all unrolled steps) raised it above the RSS it started from. At fixed
tokens per batch, memory linear in S stays flat across S; the dense scores [B, heads, n, n] grow as S.

The children run with glibc's mmap threshold fixed at 1 MiB (MALLOC_MMAP_THRESHOLD_), so that every large tensor
is its own mapping, returned when freed: RSS then follows the live tensors. With glibc's default (a threshold that
rises to 32 MiB after the first large free) large blocks come from the heap, and the chunks' blocks, of growing
sizes, fragment it: the last column repeats "after" that way, to show what an unset machine sees.
Writes the table to docs/results/<date>-ttt-memory.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import results  # bench/results.py (this script runs with bench/ on its path)

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 8, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 8192}
LAYER_IDS = [2, 4, 5]
MMAP_THRESHOLD = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)}  # glibc: each block over 1 MiB mapped, unmapped on free


# ---- "before": the attention of Eagle3Draft.unrolled before specdec/eagle3/attention.py (commit b32b785): all
# [B, heads, n, n] scores of a step at once, kept (their softmax) by autograd for backward. The tests hold it as
# their dense reference; it is taken from there, behind the new function's signature.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_eagle3_attention import dense_reference as dense_attention_before  # noqa: E402


# ---- the child: one step, its peak
def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise OSError(f"no {field} in /proc/self/status")


def _reset_peak() -> bool:
    """Set the peak RSS (VmHWM) back to the current RSS; False where the kernel does not offer it."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def child(settings: dict) -> dict:
    """Peak RSS increase (MiB) of one training step with the given side's attention."""
    import torch
    import torch.nn.functional as F
    from transformers import LlamaConfig

    from specdec.eagle3 import Eagle3Draft, draft_config
    from specdec.eagle3 import model as eagle3_model

    torch.set_num_threads(1)  # memory, not time: one thread spares the shared CPUs and its per-thread buffers
    if settings["side"] == "before":
        eagle3_model.unrolled_attention = dense_attention_before
    torch.manual_seed(0)
    target = LlamaConfig(**TINY)
    draft = Eagle3Draft(draft_config(target, LAYER_IDS, target.vocab_size))
    draft.embed_tokens.weight.requires_grad_(False)  # frozen, as in training
    b, s, steps = settings["batch"], settings["length"], settings["steps"]
    ids = torch.randint(0, target.vocab_size, (b, s))
    mask = torch.ones_like(ids)
    states = torch.randn(b, s, len(LAYER_IDS) * target.hidden_size)

    def step(ids, states, mask) -> None:
        outs = draft(ids, states, attention_mask=mask, ttt_steps=steps)
        labels = ids[:, 2:]  # draft position t proposes token t + 2
        loss = sum(F.cross_entropy(draft.logits(out[:, :-1]).flatten(0, 1), labels.flatten()) for out in outs)
        loss.backward()
        draft.zero_grad(set_to_none=False)  # gradients stay allocated, as between optimizer steps

    step(ids[:1, :64], states[:1, :64], mask[:1, :64])  # warm-up: one-time allocations stay out of the figure
    gc.collect()
    exact = _reset_peak()
    start = _status_kib("VmRSS")
    step(ids, states, mask)
    # ru_maxrss is the process's peak since it started: an upper bound where the peak cannot be reset
    peak = _status_kib("VmHWM") if exact else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"peak_mb": (peak - start) / 1024, "exact": exact}


def run_child(settings: dict, default_malloc: bool = False) -> dict:
    env = {**os.environ, **({} if default_malloc else MMAP_THRESHOLD)}
    out = subprocess.run([sys.executable, __file__, "--child", json.dumps(settings)], capture_output=True,
                         text=True, check=False, env=env)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if out.returncode or line is None:
        raise SystemExit(f"the child {settings} failed:\n{out.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per batch: B = tokens / S")
    parser.add_argument("--steps", type=int, default=3, help="ttt_steps (unrolled proposals)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(json.loads(args.child))), flush=True)
        return
    provenance = results.header("Training-time test: peak memory of one step against the row length")
    heads = TINY["num_attention_heads"]
    lines = ["| S | B | peak MB after | peak MB before | before / after | dense scores of one step (MB) "
             "| after, glibc's default malloc (MB) |", "|---:|---:|---:|---:|---:|---:|---:|"]
    exact, figures = True, []
    for length in args.lengths:
        batch = max(1, args.tokens // length)
        peaks = {}
        for side, default_malloc in (("after", False), ("before", False), ("after, default malloc", True)):
            settings = {"side": side.split(",")[0], "batch": batch, "length": length, "steps": args.steps}
            got = run_child(settings, default_malloc)
            peaks[side], exact = got["peak_mb"], exact and got["exact"]
            print(length, side, f"{peaks[side]:.1f} MB", flush=True)
        scores = batch * heads * (length - 1) ** 2 * 4 / 2**20
        figures.append(peaks)
        lines.append(f"| {length} | {batch} | {peaks['after']:.1f} | {peaks['before']:.1f} | "
                     f"{peaks['before'] / peaks['after']:.2f} | {scores:.1f} | {peaks['after, default malloc']:.1f} |")
    spread = {side: max(f[side] for f in figures) / min(f[side] for f in figures) for side in figures[0]}
    body = "\n".join([
        f"Peak RSS increase of one EAGLE-3 training step (`Eagle3Draft.unrolled`, ttt_steps {args.steps}, forward + "
        f"backward of the cross-entropy over all steps), a tiny random draft (hidden {TINY['hidden_size']}, "
        f"{heads} heads, {TINY['num_key_value_heads']} key heads, vocabulary {TINY['vocab_size']}), float32, CPU, "
        f"{args.tokens} tokens per batch (B x S). One child process per figure, on one thread; the peak is "
        f"{'reset before the step (/proc/self/clear_refs)' if exact else 'the process peak (ru_maxrss), an upper bound'}"
        f", glibc's mmap threshold fixed at 1 MiB (RSS follows the live tensors) except in the last column. "
        f"after = the chunked attention (specdec/eagle3/attention.py), before = the dense one it replaced "
        f"(a copy in bench/ttt_memory.py). The dense scores column is one float32 [B, heads, n, n] block.",
        "", *lines, "",
        f"Largest / smallest peak across S (S grows {max(args.lengths) // min(args.lengths)}x; memory linear in S "
        f"at fixed tokens stays flat): " + ", ".join(f"{side} {x:.2f}x" for side, x in spread.items()) + "."])
    print(body)
    print(f"\nwritten to {results.write('ttt-memory', '', body, provenance)}")


if __name__ == "__main__":
    main()
