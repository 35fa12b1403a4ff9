"""Distillation losses and acceptance maths: closed-form identities, edge cases, held-out simulation."""

from __future__ import annotations

import math

import pytest
import torch

from specdec.replay import greedy_rounds, per_position_agreement, simulated_tau, tau_from_alpha
from specdec.train import losses


def _logits(seed: int, shape=(3, 5, 11), scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64) * scale


def _kl_ref(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return (p * (p.log() - q.log())).sum(-1)


@pytest.mark.parametrize("name", ["fkl", "rkl", "jsd", "tvd"])
def test_zero_for_identical_inputs(name):
    x = _logits(0)
    assert losses.LOSSES[name](x, x.clone(), beta=0.3).abs() < 1e-6


@pytest.mark.parametrize("name", ["fkl", "rkl", "jsd", "tvd"])
def test_positive_for_different_inputs(name):
    assert losses.LOSSES[name](_logits(0), _logits(1), beta=0.3) > 1e-3


def test_forward_and_reverse_kl_match_the_definition():
    s, t = _logits(0), _logits(1)
    q, p = s.softmax(-1), t.softmax(-1)
    assert torch.allclose(losses.forward_kl(s, t), _kl_ref(p, q).mean().float(), atol=1e-5)
    assert torch.allclose(losses.reverse_kl(s, t), _kl_ref(q, p).mean().float(), atol=1e-5)


def test_jsd_beta_edges_are_forward_and_reverse_kl():
    """TRL GKD convention: beta = 0 is KL(p || q), beta = 1 is KL(q || p)."""
    s, t = _logits(2), _logits(3)
    assert torch.equal(losses.generalized_jsd(s, t, beta=0.0), losses.forward_kl(s, t))
    assert torch.equal(losses.generalized_jsd(s, t, beta=1.0), losses.reverse_kl(s, t))


def test_jsd_interior_matches_mixture_definition_and_limits():
    s, t = _logits(4), _logits(5)
    q, p = s.softmax(-1), t.softmax(-1)
    beta = 0.3
    m = beta * p + (1 - beta) * q
    ref = (beta * _kl_ref(p, m) + (1 - beta) * _kl_ref(q, m)).mean()
    assert torch.allclose(losses.generalized_jsd(s, t, beta=beta), ref.float(), atol=1e-5)
    # Symmetric JSD is bounded by log 2; JSD(beta) / beta -> forward KL as beta -> 0 (and reverse KL at 1).
    assert losses.generalized_jsd(s, t, beta=0.5) <= math.log(2) + 1e-6
    s1, t1, small = _logits(4, scale=1.0), _logits(5, scale=1.0), 1e-4
    assert torch.allclose(losses.generalized_jsd(s1, t1, beta=small) / small, losses.forward_kl(s1, t1), rtol=2e-3)
    assert torch.allclose(losses.generalized_jsd(s1, t1, beta=1 - small) / small, losses.reverse_kl(s1, t1),
                          rtol=2e-3)
    with pytest.raises(ValueError, match="beta"):
        losses.generalized_jsd(s, t, beta=1.5)


def test_tvd_is_one_minus_overlap_and_half_l1():
    s, t = _logits(6), _logits(7)
    q, p = s.softmax(-1), t.softmax(-1)
    half_l1 = 0.5 * (p - q).abs().sum(-1).mean()
    assert torch.allclose(losses.total_variation(s, t), half_l1.float(), atol=1e-6)
    alpha = losses.acceptance_alpha(s, t)
    assert torch.allclose(1 - alpha.mean(), losses.total_variation(s, t), atol=1e-6)


def test_temperature_scales_both_sides():
    s, t = _logits(8), _logits(9)
    assert torch.allclose(losses.forward_kl(s, t, temperature=2.0), losses.forward_kl(s / 2, t / 2), atol=1e-6)


def test_mask_selects_positions_and_ignores_garbage_elsewhere():
    s, t = _logits(10), _logits(11)
    mask = torch.zeros(3, 5, dtype=torch.bool)
    mask[0, 1] = mask[2, 3] = True
    s_bad, t_bad = s.clone(), t.clone()
    s_bad[~mask] = float("nan")
    t_bad[~mask] = float("-inf")
    for name in ("fkl", "rkl", "jsd", "tvd"):
        want = losses.LOSSES[name](s[mask], t[mask])
        got = losses.LOSSES[name](s_bad, t_bad, mask)
        assert torch.allclose(got, want), name
    labels = torch.randint(0, 11, (3, 5))
    ref = -s.log_softmax(-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)[mask].mean()
    assert torch.allclose(losses.cross_entropy(s, labels, mask), ref.float(), atol=1e-6)


def test_empty_mask_gives_zero_with_a_gradient():
    s = _logits(12).requires_grad_()
    loss = losses.forward_kl(s, _logits(13), torch.zeros(3, 5, dtype=torch.bool))
    loss.backward()
    assert loss == 0 and torch.all(s.grad == 0)


def test_truncated_teacher_offline_topn():
    """Top-n teacher: renormalised over its n ids; losses finite with finite gradients."""
    vocab, n = 11, 3
    t = _logits(14, (4, vocab))
    logp = t.log_softmax(-1)
    top = logp.topk(n, dim=-1)
    dense = losses.dense_teacher_logits(top.indices, top.values, vocab)
    assert torch.isneginf(dense).sum() == 4 * (vocab - n)
    p_renorm = dense.softmax(-1)
    assert torch.allclose(p_renorm.sum(-1), torch.ones(4, dtype=p_renorm.dtype))
    s = _logits(15, (4, vocab)).requires_grad_()
    for name in ("fkl", "rkl", "jsd", "tvd"):
        loss = losses.LOSSES[name](s, dense, beta=0.5)
        grad, = torch.autograd.grad(loss, s)
        assert torch.isfinite(loss) and torch.isfinite(grad).all(), name
    # Forward KL against the renormalised top-n: sum over the n ids only.
    q = s.detach().softmax(-1)
    pr = p_renorm.double()
    support = pr > 0
    ref = torch.where(support, pr * (pr.log() - q.log()), torch.zeros_like(pr)).sum(-1).mean()
    assert torch.allclose(losses.forward_kl(s, dense), ref.float(), atol=1e-5)
    # The same teacher as its own student: every divergence is zero.
    for name in ("fkl", "rkl", "jsd", "tvd"):
        assert losses.LOSSES[name](dense, dense) < 1e-6


def test_reduced_vocab_teacher_is_renormalised_but_alpha_is_not():
    vocab = 11
    keep = torch.tensor([0, 2, 3, 7])
    t = _logits(16, (5, vocab))
    restricted = losses.restrict_teacher(t, keep)
    assert restricted.shape == (5, 4)
    # A draft equal to the renormalised restricted teacher has zero loss...
    assert losses.forward_kl(restricted, restricted) < 1e-6
    # ...but its acceptance is only the target's mass on the kept ids (mass outside is never accepted).
    alpha = losses.acceptance_alpha(restricted, t, draft_to_target=keep)
    kept_mass = t.softmax(-1)[:, keep].sum(-1)
    assert torch.allclose(alpha, kept_mass.float(), atol=1e-6)
    inv = losses.target_to_draft_map(keep, vocab)
    assert inv.tolist() == [0, -1, 1, 2, -1, -1, -1, 3, -1, -1, -1]
    # Offline top-n with a reduced draft: top ids the draft lacks are dropped.
    top = t.log_softmax(-1).topk(3, dim=-1)
    dense = losses.dense_teacher_logits(top.indices, top.values, 4, inv)
    for row in range(5):
        present = [inv[i].item() for i in top.indices[row] if inv[i] >= 0]
        assert sorted(torch.isfinite(dense[row]).nonzero().flatten().tolist()) == sorted(present)


def test_greedy_agreement_and_topn_alpha():
    t = _logits(17, (6, 9))
    s = t.clone()
    s[:3] = -s[:3]  # flip the first three rows: argmax becomes argmin
    agree = losses.greedy_agreement(s, t)
    assert agree.tolist() == [False] * 3 + [True] * 3
    keep = torch.arange(9)
    assert torch.equal(losses.greedy_agreement(s, t, draft_to_target=keep), agree)
    logp = t.log_softmax(-1)
    top = logp.topk(9, dim=-1)  # all ids stored: the lower bound is exact
    assert torch.allclose(losses.acceptance_alpha_topn(s, top.indices, top.values),
                          losses.acceptance_alpha(s, t), atol=1e-6)
    top3 = logp.topk(3, dim=-1)
    assert torch.all(losses.acceptance_alpha_topn(s, top3.indices, top3.values)
                     <= losses.acceptance_alpha(s, t) + 1e-6)
    # A reduced draft (ids 1, 4, 6, 7 of 9): q is 0 at the ids it lacks, read without a target-sized tensor.
    kept = torch.tensor([1, 4, 6, 7])
    reduced = _logits(5, (6, 4))
    assert torch.allclose(losses.acceptance_alpha_topn(reduced, top.indices, top.values, draft_to_target=kept),
                          losses.acceptance_alpha(reduced, t, draft_to_target=kept), atol=1e-6)


# ---- the loss table and its composition ---------------------------------------------------------------------


def _cfg(**kw):
    from specdec.train.distill import TrainConfig

    return TrainConfig(**kw)


def test_configured_loss_adds_weighted_ce_to_a_divergence_and_ce_alone_ignores_the_weight():
    s, t = _logits(20, (7, 11)).float(), _logits(21, (7, 11)).float()
    ids = torch.randint(0, 11, (7,), generator=torch.Generator().manual_seed(0))
    valid = torch.tensor([True, True, False, True, True, True, False])
    fkl, ce = losses.forward_kl(s, t, temperature=2.0), losses.cross_entropy(s, ids, valid)
    got = losses.configured_loss(_cfg(loss="fkl", ce_weight=0.3, temperature=2.0), s, t, ids, valid)
    assert torch.equal(got, fkl + 0.3 * ce)
    assert torch.equal(losses.configured_loss(_cfg(loss="ce", ce_weight=0.3), s, None, ids, valid), ce)
    assert not losses.reads_teacher(_cfg(loss="ce", ce_weight=0.3)) and losses.reads_teacher(_cfg(loss="tvd"))
    jsd = losses.configured_loss(_cfg(loss="jsd", beta=0.2), s, t, ids, summed=True)
    assert torch.equal(jsd, losses.generalized_jsd(s, t, beta=0.2) * 7)


@pytest.fixture
def stub_loss(monkeypatch):
    """A loss registered in the table only: 7 at every position, recording the options it was given."""
    seen = []

    def seven(student_logits, teacher_logits, mask=None, temperature=1.0):
        seen.append((tuple(student_logits.shape), tuple(teacher_logits.shape), temperature))
        return student_logits.float().mean() * 0.0 + 7.0

    monkeypatch.setitem(losses.LOSSES, "seven", losses.Loss(seven, losses.TEACHER, ("temperature",)))
    return seen


def test_a_loss_registered_in_the_table_trains_both_kinds(stub_loss):
    """Adding a loss is a row of `losses.LOSSES`: the config accepts it and both trainers compose it."""
    from conftest import tiny_llama

    from specdec.eagle3 import Eagle3Draft, target_states
    from specdec.train import plain_train
    from specdec.train.batches import collate
    from specdec.train.eagle3_train import eagle3_loss, teacher_head

    with pytest.raises(ValueError, match="fkl, rkl, jsd, tvd, ce, seven"):
        _cfg(loss="unknown")
    batch = collate({"input_ids": [[5, 6, 7, 8, 9, 10], [11, 12, 13, 14]], "prompt_length": [2, 2]}, pad_id=0,
                    max_length=16)
    student = _logits(22, (2, 6, 128)).float().requires_grad_()
    cfg = _cfg(loss="seven", ce_weight=0.5, temperature=1.5)
    scored = int(batch["loss_mask"].sum())
    plain = plain_train.compute_loss(cfg, student, _logits(23, (scored, 128)).float(), batch, None)
    ce = losses.cross_entropy(student[batch["loss_mask"]], batch["labels"][batch["loss_mask"]])
    assert torch.allclose(plain, 7.0 + 0.5 * ce) and stub_loss == [((scored, 128), (scored, 128), 1.5)]
    target = tiny_llama(seed=0, layers=4, dtype=torch.float32)
    draft = Eagle3Draft.from_target(target, [1, 2, 3], seed=1)
    states = target_states(target, batch["input_ids"], batch["attention_mask"], [1, 2, 3], final=True).float()
    head = teacher_head(target.get_output_embeddings(), draft.kept_ids())
    cfg = _cfg(draft="eagle3", loss="seven", ttt_steps=2, eagle_aux_layer_ids=[1, 2, 3])
    assert torch.allclose(eagle3_loss(cfg, draft, batch, states, head, None), torch.tensor(7.0))
    assert len(stub_loss) == 3  # one call per unrolled step


# ---- simulate --------------------------------------------------------------------------------------------


def test_greedy_rounds_closed_forms():
    assert greedy_rounds([True] * 10, 4) == (2, 10)  # 5 + 5 (4 accepted + bonus each)
    assert greedy_rounds([False] * 7, 3) == (7, 7)  # one correction token per round
    # F T T F T: round 1 rejects at once (1 token), round 2 accepts T T then F -> 3 tokens, round 3: T -> end.
    assert greedy_rounds([False, True, True, False, True], 4) == (3, 5)
    assert greedy_rounds([], 4) == (0, 0)
    with pytest.raises(ValueError):
        greedy_rounds([True], 0)


def test_simulated_tau_pools_rounds_and_is_monotone_for_perfect_drafts():
    taus = simulated_tau([[True] * 36], ks=range(1, 9))
    assert taus[1] == 2.0 and taus[2] == 3.0 and taus[5] == 6.0
    pooled = simulated_tau([[False] * 4, [True] * 4], ks=[3])
    assert pooled[3] == (4 + 4) / (4 + 1)
    assert simulated_tau([], ks=[1]) == {1: 0.0}


def test_tau_from_alpha_and_per_position():
    assert tau_from_alpha(0.0, 4) == 1.0
    assert tau_from_alpha(1.0, 4) == 5.0
    assert math.isclose(tau_from_alpha(0.5, 2), 1.75)
    pos = per_position_agreement([[True, False, True, True, True]], k=2)
    # rounds: [T F] -> pos1 1/1, pos2 0/1; then start at 2: [T T] -> pos1 2/2, pos2 1/2... then bonus.
    assert pos == [1.0, 0.5]


def test_rows_without_teacher_mass_are_dropped_not_nan():
    """A reduced head that lacks every stored top-n id of a position has no renormalised teacher there."""
    teacher = losses.dense_teacher_logits(torch.tensor([[0, 1], [5, 6]]), torch.log(torch.tensor([[0.6, 0.3], [0.5, 0.4]])),
                                          vocab=4, target_to_draft=torch.tensor([0, 1, 2, 3, -1, -1, -1]))
    student = torch.randn(2, 4, requires_grad=True)
    assert torch.isnan(losses.forward_kl(student, teacher))
    kept_student, kept_teacher = losses.with_teacher_mass(student, teacher)
    assert kept_student.shape == (1, 4)
    loss = losses.forward_kl(kept_student, kept_teacher)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(student.grad).all() and student.grad[1].abs().sum() == 0


@pytest.mark.parametrize("truncated", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_forward_kl_gradient_is_autograds(truncated, temperature):
    """forward_kl's hand-written gradient (q - p over the student's logits) equals autograd's through the plain
    definition, masked rows, truncated (-inf) teachers and a temperature included."""
    teacher = _logits(1, scale=2.0).float()
    if truncated:  # an offline teacher: its stored top-n, -inf elsewhere
        teacher = teacher.masked_fill(teacher < 0, float("-inf"))
    mask = torch.rand(3, 5, generator=torch.Generator().manual_seed(2)) > 0.3
    student = _logits(0, scale=2.0).float().requires_grad_(True)
    got = losses.forward_kl(student, teacher, mask, temperature)
    got.backward()
    got_grad, student.grad = student.grad.clone(), None

    log_q = torch.log_softmax(student[mask] / temperature, -1)
    log_p = torch.log_softmax(teacher[mask] / temperature, -1)
    p = log_p.exp()
    want = torch.where(p > 0, p * (log_p - log_q), torch.zeros_like(p)).sum(-1).mean()
    want.backward()
    assert torch.allclose(got, want, atol=1e-6)
    assert torch.allclose(got_grad, student.grad, atol=1e-7)
    assert got_grad[~mask].abs().sum() == 0


def test_forward_kl_with_a_learning_teacher_gives_both_gradients():
    """A teacher that requires grad (no trainer has one today) takes autograd's path and gets its gradient."""
    student, teacher = _logits(0).requires_grad_(True), _logits(1).requires_grad_(True)
    losses.forward_kl(student, teacher).backward()
    got = student.grad.clone(), teacher.grad.clone()
    student.grad = teacher.grad = None
    log_q, log_p = torch.log_softmax(student.float(), -1), torch.log_softmax(teacher.float(), -1)
    (log_p.exp() * (log_p - log_q)).sum(-1).mean().backward()  # the plain definition, through autograd
    assert teacher.grad.abs().sum() > 0
    torch.testing.assert_close(got, (student.grad, teacher.grad))
