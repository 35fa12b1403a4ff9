"""Decode throughput: target alone vs specdec's speculative decoder vs transformers assisted generation.

    python bench/decode.py                                   # embedded SmolLM2 target, derived 2-layer draft
    python bench/decode.py --draft outputs/demo/draft --k 4 --prompts 8 --max-new-tokens 64

Greedy, batch 1, the same prompts, k and draft for every mode; the three modes run prompt by prompt in turn
(A/B/C) so machine drift hits all alike, after one warm-up prompt. Prints tokens/s of each mode, the ratios
measured in this run, and the share of the speculative call spent outside the two models' forward calls
(sampling, verification, cache rollback, bookkeeping). Every output is checked token-identical to the target's.
The "plain linears" rows are the same calls with the CPU linear fast path off (specdec/fast_linear.py), to show
how much of the gain over transformers comes from the matmul layout (which the target alone gets too) and how
much from the loop.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import torch

from specdec import fast_linear, target_generate
from specdec.decode import speculative_generate
from specdec.models import EMBEDDED_TARGET, load_model, load_tokenizer
from specdec.outputs import DecodeStats
from specdec.prompts import encode_prompt, read_prompts

SPEC_BENCH = Path(__file__).resolve().parents[2] / "shared" / "data" / "specbench_mtbench.jsonl"


class ForwardTimer:
    """Wall time spent inside the top-level forward calls of the given models."""

    def __init__(self, *models):
        self.total, self._start, self.handles = 0.0, 0.0, []
        for model in models:
            self.handles.append(model.register_forward_pre_hook(self._pre))
            self.handles.append(model.register_forward_hook(self._post))

    def _pre(self, *_):
        self._start = time.perf_counter()

    def _post(self, *_):
        self.total += time.perf_counter() - self._start

    def remove(self):
        for handle in self.handles:
            handle.remove()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=EMBEDDED_TARGET)
    parser.add_argument("--draft", default=None, help="draft checkpoint; default: derived from target layers")
    parser.add_argument("--layers", default="0,1", help="target layers of the derived draft")
    parser.add_argument("--prompts-file", default=str(SPEC_BENCH))
    parser.add_argument("--prompts", type=int, default=6, help="number of prompts (plus one warm-up)")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="float32", help="both models' dtype (bfloat16 on CPUs that do it natively)")
    args = parser.parse_args()
    torch.manual_seed(0)
    tokenizer, target, draft = _load(args)
    eos = tokenizer.eos_token_id
    prompts = read_prompts(args.prompts_file, limit=args.prompts + 1)
    encoded = [torch.tensor([encode_prompt(tokenizer, p.messages[:1])]) for p in prompts]
    modes, stats = _modes(args, target, draft, eos)
    seconds, tokens, forward_share = _time_modes(modes, encoded, target, draft)
    report(args, modes, seconds, tokens, stats[1:], forward_share, len(encoded) - 1)


def _load(args):
    """The tokenizer, the target and the draft (derived from the target's layers unless one is given)."""
    tokenizer = load_tokenizer(args.target)
    target = load_model(args.target, dtype=args.dtype, device="cpu")
    if args.draft:
        draft = load_model(args.draft, dtype=args.dtype, device="cpu")
    else:
        from specdec.train.draft import derive_draft

        draft = derive_draft(target, [int(x) for x in args.layers.split(",")]).to(getattr(torch, args.dtype))
    draft.eval()
    # transformers' assistant: exactly k tokens per round (no confidence early stop, no schedule).
    draft.generation_config.num_assistant_tokens = args.k
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    draft.generation_config.assistant_confidence_threshold = 0.0
    return tokenizer, target, draft


def _modes(args, target, draft, eos):
    """The decoders compared, by name, and the list the speculative one's counters go to."""
    stats: list = []

    def run_target(ids):
        return target_generate(target, ids, max_new_tokens=args.max_new_tokens, eos_token_id=eos).sequences

    def speculate(ids):
        return speculative_generate(target, draft, ids, num_draft_tokens=args.k, max_new_tokens=args.max_new_tokens,
                                    eos_token_id=eos)

    def run_specdec(ids):
        out = speculate(ids)
        stats.append(out.stats)  # the counters reported below come from the fast-path mode only
        return out.sequences

    def plain_linears(run):
        def run_plain(ids):
            fast_linear.ENABLED = False
            try:
                return run(ids)
            finally:
                fast_linear.ENABLED = True

        return run_plain

    def run_assisted(ids):
        return target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=draft, do_sample=False,
                               max_new_tokens=args.max_new_tokens, eos_token_id=eos, pad_token_id=eos)

    modes = {"target alone": run_target, "specdec speculative": run_specdec,
             "target alone, plain linears": plain_linears(run_target),
             "specdec speculative, plain linears": plain_linears(lambda ids: speculate(ids).sequences),
             "transformers assisted": run_assisted}
    return modes, stats


def _time_modes(modes: dict, encoded: list, target, draft):
    """Every mode on every prompt in turn (prompt 0 untimed, the warm-up), each checked against the target alone."""
    seconds = {name: 0.0 for name in modes}
    tokens = {name: 0 for name in modes}
    forward_share: list[float] = []
    with torch.inference_mode():
        for index, ids in enumerate(encoded):
            reference = None
            for name, fn in modes.items():
                timer = ForwardTimer(target, draft) if name == "specdec speculative" else None
                start = time.perf_counter()
                seq = fn(ids)
                elapsed = time.perf_counter() - start
                if timer:
                    timer.remove()
                    forward_share.append(timer.total / elapsed)
                new = seq[0, ids.shape[1]:]
                if reference is None:
                    reference = new
                elif not torch.equal(new, reference[: len(new)]) or len(new) != len(reference):
                    print(f"WARNING: {name} differs from the target alone on prompt {index}")
                if index > 0:  # prompt 0 is the warm-up
                    seconds[name] += elapsed
                    tokens[name] += len(new)
    return seconds, tokens, forward_share


def report(args, modes, seconds: dict, tokens: dict, stats: list, forward_share: list[float], prompts: int) -> None:
    """The table of tokens/s and ratios measured in this run, then the speculative counters."""
    rate = {name: tokens[name] / seconds[name] for name in modes}
    print(f"\nmachine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, {args.dtype}, "
          f"torch {torch.__version__}; target {args.target}; draft "
          f"{args.draft or 'layers ' + args.layers + ' of the target'}; greedy, batch 1, k={args.k}, "
          f"{prompts} prompts x {args.max_new_tokens} new tokens (+1 warm-up)\n")
    print("| mode | tokens/s | vs target alone | vs transformers assisted |\n|---|---|---|---|")
    for name in modes:
        print(f"| {name} | {rate[name]:.1f} | {rate[name] / rate['target alone']:.2f}x | "
              f"{rate[name] / rate['transformers assisted']:.2f}x |")
    merged = DecodeStats.merged(stats)
    accepted, tau = merged.acceptance_rate, merged.mean_accepted_tokens
    outside = 1 - statistics.median(forward_share[1:])
    print(f"\nspecdec: acceptance rate {accepted:.3f}, mean accepted tokens {tau:.2f}, "
          f"time outside forward calls {100 * outside:.1f}% of the call (median over prompts)")

if __name__ == "__main__":
    main()
