"""Greedy exactness of speculative decoding against the target alone, stats, fallback and bad input."""

import functools

import pytest
import torch
from conftest import ragged_prompts, tiny_llama

from specdec import SamplingConfig, speculative_generate, target_generate
from specdec.vocab import apply_reduced_head

VOCAB = 128
EOS = 2


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("k", [1, 2, 4, 7])
def test_greedy_speculative_equals_target_alone(target, draft, batch, k):
    for seed in range(6):
        ids, mask = ragged_prompts(batch, VOCAB, seed=seed + 100 * k)
        if batch == 1:
            ids, mask = ids[:, mask[0].argmax():], None  # an unpadded single prompt
        ref = target_generate(target, ids, mask, max_new_tokens=40, eos_token_id=EOS)
        out = speculative_generate(target, draft, ids, mask, num_draft_tokens=k, max_new_tokens=40, eos_token_id=EOS)
        assert torch.equal(out.sequences, ref.sequences), f"seed {seed}"
        assert not out.stats.fallback


def test_a_similar_draft_gets_accepted_and_stays_exact(target):
    """A draft close to the target (noisy copy) exercises long accepted runs, not only corrections."""
    near = tiny_llama(seed=0)
    with torch.no_grad():
        for param in near.parameters():
            param.mul_(1 + 0.05 * torch.randn_like(param))
    ids, mask = ragged_prompts(3, VOCAB, seed=7)
    ref = target_generate(target, ids, mask, max_new_tokens=48)
    out = speculative_generate(target, near, ids, mask, num_draft_tokens=4, max_new_tokens=48)
    assert torch.equal(out.sequences, ref.sequences)
    assert out.stats.acceptance_rate > 0.3 and out.stats.bonus > 0 and out.stats.corrections > 0


def test_top_logprobs_are_the_log_softmax_of_a_full_forward(target):
    """target_generate(top_logprobs=n) keeps the decoding logits' top n: equal to re-scoring the output."""
    ids, mask = ragged_prompts(3, VOCAB, seed=11)
    out = target_generate(target, ids, mask, max_new_tokens=12, top_logprobs=5)
    plain = target_generate(target, ids, mask, max_new_tokens=12)
    assert torch.equal(out.sequences, plain.sequences)
    assert out.top_ids.shape == out.top_logprobs.shape == (3, 12, 5)
    full_mask = torch.cat([mask, mask.new_ones(3, 12)], dim=1)
    positions = (full_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = target(input_ids=out.sequences, attention_mask=full_mask, position_ids=positions).logits
    logp = torch.log_softmax(logits[:, ids.shape[1] - 1:-1].float(), dim=-1)
    ref = torch.topk(logp, 5, dim=-1)
    assert torch.equal(out.top_ids, ref.indices)
    torch.testing.assert_close(out.top_logprobs, ref.values, atol=1e-5, rtol=0)
    assert torch.equal(out.top_ids[..., 0], out.sequences[:, ids.shape[1]:])  # greedy: top-1 is the token
    assert plain.top_ids is None
    with pytest.raises(ValueError, match="top_logprobs"):
        target_generate(target, ids, mask, max_new_tokens=2, top_logprobs=-1)


@pytest.mark.parametrize("k", [1, 3, 6])
def test_draft_equal_to_target_accepts_everything(target, k):
    ids = torch.tensor([[5, 9, 11, 4]])
    out = speculative_generate(target, target, ids, num_draft_tokens=k, max_new_tokens=1 + 10 * (k + 1))
    stats = out.stats
    assert stats.acceptance_rate == 1.0
    assert stats.mean_accepted_tokens == k + 1
    assert stats.per_position_acceptance == [1.0] * k
    assert stats.bonus == stats.rounds and stats.corrections == 0


@pytest.mark.parametrize("batch", [1, 3])
def test_eos_inside_the_draft_window_cuts_each_row(target, batch):
    ids, mask = ragged_prompts(batch, VOCAB, seed=3)
    free = target_generate(target, ids, mask, max_new_tokens=30)
    # Make the token row 0 emits at step 5 the EOS: with a perfect draft (the target itself, k = 7)
    # it then sits in the middle of an accepted window.
    eos = int(free.sequences[0, free.prompt_length + 5])
    ref = target_generate(target, ids, mask, max_new_tokens=30, eos_token_id=eos, pad_token_id=0)
    for drafter in (target, tiny_llama(seed=1, layers=1)):
        out = speculative_generate(target, drafter, ids, mask, num_draft_tokens=7, max_new_tokens=30,
                                   eos_token_id=eos, pad_token_id=0)
        assert torch.equal(out.sequences, ref.sequences)
    row = out.sequences[0, out.prompt_length:].tolist()
    cut = row.index(eos)
    assert cut <= 5 and all(t == 0 for t in row[cut + 1:])


def test_stats_are_consistent_with_the_trace(target, draft):
    ids, mask = ragged_prompts(3, VOCAB, seed=11)
    out = speculative_generate(target, draft, ids, mask, num_draft_tokens=3, max_new_tokens=25, trace=True)
    stats = out.stats
    assert len(out.trace) == stats.rounds
    assert stats.accepted == sum(int(r.num_accepted.sum()) for r in out.trace)
    assert stats.proposed == sum(r.proposed.numel() for r in out.trace)
    assert stats.bonus + stats.corrections == stats.rounds * 3
    assert 1 + sum(r.advanced for r in out.trace) == out.sequences.shape[1] - out.prompt_length
    assert stats.mean_accepted_tokens == pytest.approx(stats.emitted / (stats.rounds * 3))


def test_reduced_vocabulary_draft_is_exact(target):
    reduced = tiny_llama(seed=1, layers=1)
    keep = torch.arange(0, VOCAB, 3)  # a third of the ids: q(x) = 0 for the rest
    apply_reduced_head(reduced, keep)
    assert reduced.get_output_embeddings().out_features == keep.numel()
    ids, mask = ragged_prompts(3, VOCAB, seed=5)
    ref = target_generate(target, ids, mask, max_new_tokens=30)
    out = speculative_generate(target, reduced, ids, mask, num_draft_tokens=3, max_new_tokens=30, trace=True)
    assert torch.equal(out.sequences, ref.sequences)
    proposed = torch.cat([r.proposed.flatten() for r in out.trace])
    assert torch.isin(proposed, keep).all()


def failing_after(model, calls: int, make_bad):
    """Wrap model.forward so that its `calls`-th call misbehaves (make_bad(*args, **kwargs))."""
    original = model.forward
    count = {"n": 0}

    @functools.wraps(original)
    def forward(*args, **kwargs):
        count["n"] += 1
        if count["n"] >= calls:
            return make_bad(original, *args, **kwargs)
        return original(*args, **kwargs)

    model.forward = forward
    return model


def _raise(original, *args, **kwargs):
    raise RuntimeError("draft exploded")


def _wrong_shape(original, *args, **kwargs):
    out = original(*args, **kwargs)
    out.logits = out.logits[..., :3]
    return out


@pytest.mark.parametrize("make_bad", [_raise, _wrong_shape])
@pytest.mark.parametrize("calls", [1, 4])
def test_draft_failure_falls_back_to_target_only(target, make_bad, calls, caplog):
    bad = failing_after(tiny_llama(seed=1, layers=1), calls, make_bad)
    ids, mask = ragged_prompts(3, VOCAB, seed=2)
    ref = target_generate(target, ids, mask, max_new_tokens=20)
    with caplog.at_level("WARNING"):
        out = speculative_generate(target, bad, ids, mask, num_draft_tokens=3, max_new_tokens=20)
    assert torch.equal(out.sequences, ref.sequences)
    assert out.stats.fallback and out.stats.fallback_reason
    assert "target alone" in caplog.text


def test_timings_are_recorded_per_step(target, draft):
    ids = torch.tensor([[5, 6, 7]])
    out = speculative_generate(target, draft, ids, num_draft_tokens=2, max_new_tokens=12, timing=True)
    assert sum(n for _, n in out.timings) == 12
    times = [t for t, _ in out.timings]
    assert times == sorted(times) and len(times) == out.stats.rounds + 1
    ref = target_generate(target, ids, max_new_tokens=12, timing=True)
    assert len(ref.timings) == 12


def test_sampled_generation_is_reproducible_with_a_seeded_generator(target, draft):
    ids, mask = ragged_prompts(3, VOCAB, seed=9)
    cfg = SamplingConfig(temperature=0.8, top_p=0.95)
    runs = [speculative_generate(target, draft, ids, mask, sampling=cfg, max_new_tokens=16,
                                 generator=torch.Generator().manual_seed(4)).sequences for _ in range(2)]
    assert torch.equal(*runs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(input_ids=torch.zeros(1, 0, dtype=torch.long)), "empty"),
        (dict(input_ids=torch.tensor([[1.0, 2.0]])), "LongTensor"),
        (dict(num_draft_tokens=0), "num_draft_tokens"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(input_ids=torch.ones(1, 250, dtype=torch.long)), "context"),
        (dict(attention_mask=torch.tensor([[1, 1, 0]])), "left-padded"),
        (dict(input_ids=torch.ones(2, 3, dtype=torch.long), attention_mask=torch.tensor([[1, 1, 1], [0, 0, 0]])), "empty"),
        (dict(input_ids=torch.ones(1, 3, dtype=torch.long, device="meta")), "target is on"),
    ],
)
def test_bad_input_raises_value_error_with_a_fix(target, draft, kwargs, message):
    args = dict(input_ids=torch.tensor([[4, 5, 6]]), num_draft_tokens=2, max_new_tokens=8) | kwargs
    with pytest.raises(ValueError, match=message):
        speculative_generate(target, draft, **args)


def test_mismatched_dtypes_are_refused(target):
    with pytest.raises(ValueError, match="dtype"):
        speculative_generate(target, tiny_llama(seed=1, dtype=torch.float32), torch.tensor([[4, 5]]))


def test_stats_observe_rounds_and_merge_weighted():
    """DecodeStats counts a round once (observe_round) and merges calls with weights; the rates follow."""
    from specdec.outputs import DecodeStats
    from specdec.proposal import Proposal

    a, b = DecodeStats.for_proposal(Proposal.chain(3)), DecodeStats.for_proposal(Proposal.chain(3))
    a.observe_round([3, 1], 3)  # one row all accepted (bonus), one rejected at position 2 (correction)
    b.observe_round([0], 3)
    a.emitted, b.emitted = 4 + 2, 1
    assert (a.bonus, a.corrections, a.position_tried, a.position_accepted) == (1, 1, [2, 2, 1], [2, 1, 1])
    both = DecodeStats.merged([a, b])
    assert both.acceptance_rate == pytest.approx(4 / 9) and both.mean_accepted_tokens == pytest.approx(7 / 3)
    assert both.per_position_acceptance == pytest.approx([2 / 3, 1 / 2, 1.0])
    half = DecodeStats.merged([a, b], [0.5, 1.0])
    assert half.proposed == pytest.approx(6.0) and half.acceptance_rate == pytest.approx(2 / 6)
    assert not both.fallback and both.nodes_per_round == pytest.approx(9 / 2)


def test_a_proposal_is_a_chain_or_a_tree_parsed_once():
    from specdec.proposal import Proposal

    chain, tree, one = Proposal.of(2), Proposal.of("3x1x1"), Proposal.of("2")
    assert (chain.label, chain.depth, chain.verified_nodes, chain.value) == ("k=2", 2, 2, 2)
    assert (tree.label, tree.depth, tree.verified_nodes, tree.value) == ("tree=3x1x1", 3, 9, "3x1x1")
    assert one.is_tree and one.label == "tree=2" and one != chain
    assert Proposal.of("1x1x1") == Proposal.chain(3) and Proposal.of(tree) is tree
    with pytest.raises(ValueError, match="num_draft_tokens must be >= 1"):
        Proposal.of(0)
    with pytest.raises(ValueError, match="dynamic tree"):
        Proposal.of("dyn8").widths()
