"""Checks shared by the tests of the drafts that read the target's hidden states (tests/test_eagle3.py,
tests/test_peagle.py, tests/test_dflash.py): fitting a draft, exact greedy decoding, the replay equal to the
decoder's rounds, and a trainer run with its logged losses."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from conftest import ragged_prompts

from specdec import speculative_generate, target_generate
from specdec.replay import replay_runs, target_states


def fit(draft, loss_of, steps: int, lr: float = 1e-2):
    """`steps` Adam steps of the draft's trainable weights on the loss `loss_of()` computes; the draft, in eval
    mode."""
    opt = torch.optim.Adam([p for p in draft.parameters() if p.requires_grad], lr=lr)
    for _ in range(steps):
        loss = loss_of()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return draft.eval()


def draft_ids(draft, vocab: int) -> torch.Tensor:
    """Each target id's draft id, -1 where the draft's vocabulary lacks it.  [vocab]"""
    inv = torch.full((vocab,), -1, dtype=torch.long)
    inv[draft.draft_to_target] = torch.arange(draft.config.draft_vocab_size)
    return inv


def greedy_outputs_equal_the_target(target, draft, batch: int, k: int, vocab: int = 128, eos: int = 2) -> list:
    """Greedy decoding with `draft` at k of three ragged batches (one unpadded prompt when batch == 1) is
    token-identical to the target alone, drafting without fallback; returns the three outputs."""
    outputs = []
    for seed in range(3):
        ids, mask = ragged_prompts(batch, vocab, seed=seed + 10 * k)
        if batch == 1:
            ids, mask = ids[:, mask[0].argmax():], None
        ref = target_generate(target, ids, mask, max_new_tokens=40, eos_token_id=eos)
        out = speculative_generate(target, draft, ids, mask, num_draft_tokens=k, max_new_tokens=40, eos_token_id=eos)
        assert torch.equal(out.sequences, ref.sequences), f"seed {seed}"
        assert not out.stats.fallback and out.stats.draft_forwards > 0
        outputs.append(out)
    return outputs


def replay_predicts_every_round(target, draft, prompts: torch.Tensor, k: int, new: int):
    """On the target's own greedy output of one prompt, the held-out replay's runs give every round's accepted
    count of the real decoder (specdec/replay.py through the draft's kind); returns (the decoder's output with
    its trace, the replayed runs)."""
    out = speculative_generate(target, draft, prompts, num_draft_tokens=k, max_new_tokens=new, trace=True)
    seq = target_generate(target, prompts, max_new_tokens=new).sequences
    assert torch.equal(out.sequences, seq)
    mask = torch.ones_like(seq)
    loss_mask = torch.zeros_like(seq, dtype=torch.bool)
    loss_mask[0, prompts.shape[1] - 1: seq.shape[1] - 1] = True
    runs = replay_runs(draft, seq, mask, loss_mask, k, target_states(draft, target, seq, mask))[0]
    i, length = 1, prompts.shape[1] + 1  # the first round drafts completion token 1 (token 0 is the prefill's)
    for r in out.trace:
        k_round = max(1, min(k, prompts.shape[1] + new - length - 1))
        assert int(r.num_accepted[0]) == min(runs[i], k_round), f"round at completion token {i}"
        i += r.advanced
        length += r.advanced
    return out, runs


def run_logging_losses(cfg, run_dir: Path):
    """distill.run(cfg), its logged step losses caught; returns (its result, eval.jsonl's records, the losses)."""
    from specdec.train import distill

    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logger = logging.getLogger("specdec.train.distill")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        final = distill.run(cfg)
    finally:
        logger.removeHandler(handler)
    history = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    loss = [float(m.split("loss ")[1].split()[0]) for m in messages if m.startswith("step ") and " loss " in m]
    return final, history, loss


def same_loss_and_gradients(reference: tuple, other: tuple) -> None:
    """Two (loss, {parameter name: gradient}) pairs of the same draft on the same samples agree to float rounding
    (the reference's loss not zero, so the comparison can fail)."""
    (loss_a, grads_a), (loss_b, grads_b) = reference, other
    assert float(loss_a) > 0
    torch.testing.assert_close(loss_b, loss_a, atol=1e-5, rtol=1e-5)
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], atol=1e-5, rtol=1e-4, msg=name)
