"""Sampled speculative decoding is distributed as the target: chi-square against the exact distribution.

The exact joint distribution of the first M generated tokens is enumerated from the target (small vocabulary),
samples come from `speculative_generate`, and a chi-square test at ALPHA (fixed before any run; the generator
is seeded, so each test is deterministic) compares them. A deliberately wrong sampler must fail the same test.
"""

import pytest
import torch
from conftest import tiny_llama

import specdec.verify
from specdec import SamplingConfig, speculative_generate
from specdec.eval import verify as verify_cmd
from specdec.vocab import apply_reduced_head

ALPHA = 1e-3
VOCAB = 16
M = 3  # tokens whose joint distribution is tested
SETTINGS = [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.7, top_p=0.9)]
PROMPTS = [[3, 4, 5], [7, 8], [9, 10, 11, 12]]


@pytest.fixture(scope="module")
def pair():
    target = tiny_llama(seed=0, vocab_size=VOCAB, hidden=16, dtype=torch.float32)
    draft = tiny_llama(seed=1, vocab_size=VOCAB, hidden=16, layers=1, dtype=torch.float32)
    return target, draft


def exact_joint(target, prompt: list[int], sampling: SamplingConfig) -> torch.Tensor:
    """P(first M generated tokens) under the warped target, by enumeration.  -> [V ** M]"""
    device = next(target.parameters()).device
    return verify_cmd.exact_joint(target, torch.tensor(prompt, device=device), M, sampling).cpu()


def left_pad(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def sample_counts(target, draft, prompts, sampling, k, calls, copies, seed) -> list[torch.Tensor]:
    """Counts of the first M tokens per distinct prompt, over calls x copies samples each (on the target's
    device, with a generator there)."""
    device = next(target.parameters()).device
    ids, mask = (t.to(device) for t in left_pad([p for p in prompts for _ in range(copies)]))
    if len(prompts) == 1:
        mask = None
    g = torch.Generator(device=device).manual_seed(seed)
    counts = [torch.zeros(VOCAB**M, dtype=torch.long) for _ in prompts]
    for _ in range(calls):
        out = speculative_generate(target, draft, ids, mask, num_draft_tokens=k, sampling=sampling,
                                   max_new_tokens=M + 1, generator=g)
        first = out.sequences[:, out.prompt_length: out.prompt_length + M]
        index = (first * torch.tensor([VOCAB**2, VOCAB, 1], device=device)).sum(1).cpu()
        for j in range(len(prompts)):
            counts[j] += torch.bincount(index[j * copies:(j + 1) * copies], minlength=VOCAB**M)
    return counts


def combined_p(target, prompts, sampling, counts) -> float:
    """One chi-square over independent rows (cells with expected count < 5 pooled): statistics and degrees of
    freedom add up. A sample the target cannot produce makes the p-value 0."""
    fits = [verify_cmd.goodness_of_fit(c, exact_joint(target, p, sampling)) for p, c in zip(prompts, counts)]
    if any(f["impossible_samples"] for f in fits):
        return 0.0
    return verify_cmd.chi2_sf(sum(f["chi2"] for f in fits), sum(f["dof"] for f in fits))


@pytest.mark.parametrize("sampling", SETTINGS, ids=["t1.0", "t0.7-p0.9"])
@pytest.mark.parametrize("k", [1, 2])
def test_many_rows_of_one_prompt_match_the_target(pair, sampling, k):
    """20,000 samples as 10 calls of 2,000 rows: rows accept different counts (rule 5)."""
    target, draft = pair
    counts = sample_counts(target, draft, PROMPTS[:1], sampling, k, calls=10, copies=2000, seed=k)
    assert combined_p(target, PROMPTS[:1], sampling, counts) > ALPHA


@pytest.mark.parametrize("sampling", SETTINGS, ids=["t1.0", "t0.7-p0.9"])
def test_ragged_left_padded_rows_match_the_target(pair, sampling):
    target, draft = pair
    counts = sample_counts(target, draft, PROMPTS, sampling, k=2, calls=10, copies=700, seed=5)
    assert combined_p(target, PROMPTS, sampling, counts) > ALPHA


def test_reduced_vocabulary_draft_matches_the_target(pair):
    target, _ = pair
    reduced = apply_reduced_head(tiny_llama(seed=1, vocab_size=VOCAB, hidden=16, layers=1, dtype=torch.float32),
                                 torch.tensor([0, 2, 3, 5, 8, 9, 12, 15]))
    counts = sample_counts(target, reduced, PROMPTS[:1], SETTINGS[0], k=2, calls=10, copies=2000, seed=3)
    assert combined_p(target, PROMPTS[:1], SETTINGS[0], counts) > ALPHA


def test_the_test_catches_a_wrong_residual(pair, monkeypatch):
    """Resampling from p instead of norm(max(p - q, 0)) after a rejection is a classic bug: it must fail."""
    target, draft = pair
    monkeypatch.setattr(specdec.verify, "residual_distribution", lambda p, q: p)
    counts = sample_counts(target, draft, PROMPTS[:1], SETTINGS[0], k=2, calls=10, copies=2000, seed=1)
    assert combined_p(target, PROMPTS[:1], SETTINGS[0], counts) < ALPHA


@pytest.mark.slow
@pytest.mark.parametrize("sampling", SETTINGS, ids=["t1.0", "t0.7-p0.9"])
def test_batch_one_matches_the_target(pair, sampling):
    """6,000 separate batch-1 calls: every round advances by its own accepted count. (The 2,000-row calls above
    carry the statistical power at a fraction of the time; separate calls cost a model forward per sample.)"""
    target, draft = pair
    counts = sample_counts(target, draft, PROMPTS[:1], sampling, k=2, calls=6_000, copies=1, seed=11)
    assert combined_p(target, PROMPTS[:1], sampling, counts) > ALPHA


@pytest.mark.slow
@pytest.mark.parametrize("sampling", SETTINGS, ids=["t1.0", "t0.7-p0.9"])
def test_batch_three_matches_the_target(pair, sampling):
    """Batches of 3 different left-padded prompts, 2,500 calls: 7,500 samples."""
    target, draft = pair
    counts = sample_counts(target, draft, PROMPTS, sampling, k=2, calls=2_500, copies=1, seed=13)
    assert combined_p(target, PROMPTS, sampling, counts) > ALPHA


@pytest.mark.parametrize("sampling", SETTINGS, ids=["t1.0", "t0.7-p0.9"])
def test_eagle3_draft_matches_the_target(pair, sampling):
    """An EAGLE-3 draft with a reduced vocabulary (its q read from its own outputs after the first proposal, zero
    outside its ids) on ragged left-padded rows: the joint of the first three tokens is still the target's."""
    from specdec.eagle3 import Eagle3Draft

    target, _ = pair
    draft = Eagle3Draft.from_target(target, [1], keep_ids=torch.tensor([0, 2, 3, 5, 8, 9, 12, 15]), seed=5)
    with torch.no_grad():
        draft.fc.weight.normal_(std=0.5, generator=torch.Generator().manual_seed(0))  # q that moves with the states
    counts = sample_counts(target, draft, PROMPTS, sampling, k=3, calls=10, copies=700, seed=8)
    assert combined_p(target, PROMPTS, sampling, counts) > ALPHA
