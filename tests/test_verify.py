"""Verification and sampling as pure functions: hand-built logits with known outcomes, and properties."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.sampling import SamplingConfig, probabilities, warp_logits
from specdec.verify import (
    acceptance_probability,
    emitted_distribution,
    greedy_verify,
    leading_true,
    rejection_verify,
    residual_distribution,
)


def one_hot_logits(choices: list[list[int]], vocab: int = 8) -> torch.Tensor:
    """Logits whose argmax at row b, position i is choices[b][i].  -> [B, n, V]"""
    logits = torch.zeros(len(choices), len(choices[0]), vocab)
    for b, row in enumerate(choices):
        for i, tok in enumerate(row):
            logits[b, i, tok] = 5.0
    return logits


def test_leading_true_counts_prefix_only():
    mask = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 1], [1, 1, 1, 1], [0, 0, 0, 0]], dtype=torch.bool)
    assert leading_true(mask).tolist() == [2, 0, 4, 0]


def test_greedy_verify_known_accept_counts_correction_and_bonus():
    draft = torch.tensor([[3, 4, 5], [3, 4, 5], [3, 4, 5]])
    target = one_hot_logits([[3, 4, 5, 6], [3, 7, 5, 6], [1, 4, 5, 6]])
    verdict = greedy_verify(draft, target)
    assert verdict.num_accepted.tolist() == [3, 1, 0]
    # row 0: all accepted, bonus = target's argmax at k+1; rows 1-2: the target's token at the first mismatch.
    assert verdict.next_token.tolist() == [6, 7, 1]


def test_rejection_verify_accepts_everything_when_q_equals_p():
    torch.manual_seed(0)
    p = torch.softmax(torch.randn(4, 4, 8), -1)
    q = p[:, :3].clone()
    draft = torch.multinomial(q.reshape(-1, 8), 1).reshape(4, 3)
    verdict = rejection_verify(draft, q, p, torch.Generator().manual_seed(1))
    assert verdict.num_accepted.tolist() == [3, 3, 3, 3]


def test_rejection_verify_rejects_tokens_the_target_never_emits_and_samples_the_residual():
    p = torch.zeros(1, 3, 4)
    p[..., 0] = 0.5
    p[..., 1] = 0.5  # the target only emits ids 0 and 1
    q = torch.zeros(1, 2, 4)
    q[..., 1] = 0.5
    q[..., 2] = 0.5
    draft = torch.tensor([[2, 1]])  # id 2 has p = 0: certain rejection at position 1
    for seed in range(20):
        verdict = rejection_verify(draft, q, p, torch.Generator().manual_seed(seed))
        assert verdict.num_accepted.item() == 0
        # residual = norm(max(p - q, 0)) = all mass on id 0
        assert verdict.next_token.item() == 0


def test_rejection_verify_bonus_comes_from_p_at_k_plus_1():
    p = torch.zeros(1, 3, 4)
    p[0, :2, 1] = 1.0
    p[0, 2, 3] = 1.0  # position k+1 puts all mass on id 3
    q = torch.zeros(1, 2, 4)
    q[0, :, 1] = 1.0
    verdict = rejection_verify(torch.tensor([[1, 1]]), q, p, torch.Generator().manual_seed(0))
    assert verdict.num_accepted.item() == 2 and verdict.next_token.item() == 3


def test_residual_is_normalised_positive_part_and_falls_back_to_p_when_equal():
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    q = torch.tensor([0.2, 0.3, 0.1, 0.4])
    torch.testing.assert_close(residual_distribution(p, q), torch.tensor([0.75, 0.0, 0.25, 0.0]))
    torch.testing.assert_close(residual_distribution(p, p.clone()), p)


def test_acceptance_probability_is_min_one_ratio():
    p = torch.tensor([0.2, 0.6, 0.0, 0.3])
    q = torch.tensor([0.4, 0.3, 0.5, 0.0])
    torch.testing.assert_close(acceptance_probability(p, q), torch.tensor([0.5, 1.0, 0.0, 0.0]))


@settings(max_examples=200, deadline=None)
@given(
    st.integers(min_value=2, max_value=12),
    st.integers(min_value=0, max_value=2**31 - 1),
    st.floats(min_value=0.0, max_value=0.9),
)
def test_emitted_distribution_equals_p_for_any_p_and_q(vocab, seed, sparsity):
    """The verification step's analytical output distribution is p (Leviathan et al. 2022, Theorem 1)."""
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(vocab, generator=g, dtype=torch.float64) * (torch.rand(vocab, generator=g) >= sparsity)
    q = torch.rand(vocab, generator=g, dtype=torch.float64) * (torch.rand(vocab, generator=g) >= sparsity)
    p[seed % vocab] += 0.1  # never all zero
    q[(seed // 7) % vocab] += 0.1
    p, q = p / p.sum(), q / q.sum()
    torch.testing.assert_close(emitted_distribution(p, q), p, atol=1e-12, rtol=0)


def test_greedy_sampling_config_and_errors():
    assert SamplingConfig().greedy and not SamplingConfig(temperature=0.7).greedy
    for bad in (dict(temperature=-1), dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5)):
        with pytest.raises(ValueError):
            SamplingConfig(**bad)


def test_warp_top_k_top_p_and_temperature():
    logits = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.1]))
    top2 = probabilities(logits, SamplingConfig(temperature=1.0, top_k=2))
    torch.testing.assert_close(top2, torch.tensor([2 / 3, 1 / 3, 0.0, 0.0]))
    # top-p 0.7 keeps the smallest prefix reaching 0.7: {0.5, 0.25}
    top_p = probabilities(logits, SamplingConfig(temperature=1.0, top_p=0.7))
    torch.testing.assert_close(top_p, torch.tensor([2 / 3, 1 / 3, 0.0, 0.0]))
    # top-p 0.5 keeps only the first token (its mass already reaches 0.5)
    assert probabilities(logits, SamplingConfig(temperature=1.0, top_p=0.5)).tolist() == [1.0, 0.0, 0.0, 0.0]
    hot = probabilities(logits, SamplingConfig(temperature=2.0))
    expected = torch.tensor([0.5, 0.25, 0.15, 0.1]).sqrt()
    torch.testing.assert_close(hot, expected / expected.sum())
    assert warp_logits(logits.half(), SamplingConfig(temperature=1.0)).dtype == torch.float32
    assert not math.isnan(float(probabilities(torch.tensor([0.0, -1e4]), SamplingConfig(temperature=0.01)).sum()))
