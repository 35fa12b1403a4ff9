"""Draft trees (specdec/tree.py): shapes, the tree mask and path KV, greedy identity, sampled exactness."""

import pytest
import torch
from conftest import tiny_llama
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DynamicCache

import specdec.tree
from specdec import SamplingConfig, replay, speculative_generate, target_generate
from specdec.draft_registry import make_drafter
from specdec.eagle3 import Eagle3Draft
from specdec.eval import verify as verify_cmd
from specdec.kv import Batch, cache_kwarg, forward_masked, keep_path, prefill
from specdec.outputs import DecodeStats, TreeTrace
from specdec.ranks import RANK_CAP, true_token_ranks
from specdec.tree import Tree, TreeSpec, emitted_distribution, sampled_walk, without
from specdec.vocab import apply_reduced_head

ALPHA = 1e-3
TREES = ["3x1x1", "2x2x1", "4", "dyn8", "dyn6-d3-w2"]


def test_tree_shapes_parse_and_refuse_with_a_fix():
    assert TreeSpec.parse("3x1x1") == TreeSpec(widths=(3, 1, 1))
    assert TreeSpec.parse("3x1x1").max_nodes == 9 and TreeSpec.parse("2x2").max_nodes == 6
    assert TreeSpec.parse("dyn8") == TreeSpec(nodes=8, depth=4, width=3)
    assert TreeSpec.parse("dyn8-d5-w2").max_depth == 5 and str(TreeSpec.parse("dyn8-d5-w2")) == "dyn8-d5-w2"
    assert TreeSpec.parse("1x1x1").is_chain and not TreeSpec.parse("2x1").is_chain
    for bad in ["3,1", "0x2", "dyn0", "tree"]:
        with pytest.raises(ValueError, match="3x1x1|>= 1"):
            TreeSpec.parse(bad)


def _grown(target, draft, spec: str, prompt=(3, 4, 5, 6)) -> Tree:
    batch = Batch(torch.tensor([prompt]), None, 8, 8, None, 0)
    drafter = make_drafter(draft, target, SamplingConfig())
    prefill(target, batch, cache_kwarg(target))
    batch.append(torch.tensor([[7]]))
    drafter.start(batch)
    spec = TreeSpec.parse(spec)
    stats = DecodeStats()
    tree = specdec.tree.grow(drafter, batch, spec, spec.max_depth, stats)
    assert stats.draft_forwards == spec.max_depth  # the root, then one forward per level fed
    return tree


@pytest.mark.parametrize("kind", ["plain", "eagle3"])
def test_static_and_dynamic_trees_have_their_shape(target, draft, kind):
    if kind == "eagle3":
        draft = Eagle3Draft.from_target(target, [1], seed=3)
    static = _grown(target, draft, "3x2x1")
    assert len(static) == 3 + 6 + 6 and static.depths == [1] * 3 + [2] * 6 + [3] * 6
    assert [static.parents.count(i) for i in range(3)] == [2, 2, 2]
    dynamic = _grown(target, draft, "dyn7-d3-w2")
    assert len(dynamic) == 7
    for i, parent in enumerate(dynamic.parents):  # breadth-first, closed under parents, siblings best first
        assert parent < i and (parent < 0 or dynamic.scores[parent] >= dynamic.scores[i])
    kids = dynamic.children()
    for siblings in kids.values():
        assert [dynamic.scores[c] for c in siblings] == sorted((dynamic.scores[c] for c in siblings), reverse=True)


def test_kept_path_kv_equals_a_causal_forward_over_the_path(target):
    """The tree forward's KV of the accepted path, moved next to the prefix, is what a plain causal forward over
    prefix + path caches (positions included): the next round sees exactly the target's own state."""
    prefix = torch.tensor([[3, 4, 5, 6, 7]])
    tree = Tree()
    for token, parent in [(9, -1), (11, -1), (13, 0), (15, 1), (17, 3)]:
        tree.add(token, parent, 0.0)
    path = [1, 3, 4]  # 11 -> 15 -> 17
    kwarg = cache_kwarg(target)
    cache = DynamicCache(config=target.config)
    target(input_ids=prefix[:, :4], use_cache=True, **{kwarg: cache})
    ids, positions, allowed = specdec.tree.verification_inputs(tree, 7, 4, 4, "cpu")
    forward_masked(target, cache, ids, positions, allowed, kwarg)
    keep_path(cache, 5, [5 + i for i in path])
    reference = DynamicCache(config=target.config)
    target(input_ids=torch.tensor([[3, 4, 5, 6, 7, 11, 15, 17]]), use_cache=True, **{kwarg: reference})
    assert cache.get_seq_length() == 8
    for got, want in zip(cache.layers, reference.layers):
        torch.testing.assert_close(got.keys, want.keys, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(got.values, want.values, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("tree", TREES)
@pytest.mark.parametrize("kind", ["random", "target-copy", "eagle3", "reduced"])
def test_greedy_tree_decoding_equals_the_target_alone(target, draft, tree, kind):
    drafts = {
        "random": lambda: draft,
        "target-copy": lambda: target,  # accepts deep paths: exercises the kept-path KV every round
        "eagle3": lambda: Eagle3Draft.from_target(target, [1], seed=3),
        "reduced": lambda: apply_reduced_head(tiny_llama(seed=1, layers=1), torch.arange(0, 128, 2)),
    }
    prompt = torch.tensor([[3, 4, 5, 6, 7, 8]])
    want = target_generate(target, prompt, max_new_tokens=24).sequences
    out = speculative_generate(target, drafts[kind](), prompt, max_new_tokens=24, tree=tree, trace=True)
    assert torch.equal(out.sequences, want)
    stats = out.stats
    assert not stats.fallback and stats.tree == str(TreeSpec.parse(tree))
    assert stats.emitted == sum(r.advanced for r in out.trace) == 23
    assert stats.accepted == sum(len(r.path) for r in out.trace)
    assert stats.tree_nodes == sum(len(r.tree) for r in out.trace)
    if kind == "target-copy":
        assert stats.mean_accepted_tokens > 1.5


def test_a_tree_round_describes_itself():
    tree = Tree()
    for token, parent in [(9, -1), (11, -1), (13, 0), (15, 1)]:
        tree.add(token, parent, -0.5)
    text = TreeTrace(tree, [1, 3], 42, 3).describe(lambda t: f"<{t}>")
    assert text.splitlines() == ["  <9>  (-0.50)", "    <13>  (-0.50)", "* <11>  (-0.50)", "  * <15>  (-0.50)",
                                 "-> bonus <42> (accepted 2)"]
    assert "correction 42 (accepted 0)" in TreeTrace(tree, [], 42, 1).describe()


def test_eos_and_padding_and_batches(target, draft):
    prompt = torch.tensor([[0, 0, 3, 4, 5]])
    mask = torch.tensor([[0, 0, 1, 1, 1]])
    want = target_generate(target, prompt[:, 2:], max_new_tokens=20, eos_token_id=[9, 17]).sequences
    out = speculative_generate(target, target, prompt, mask, max_new_tokens=20, eos_token_id=[9, 17], tree="3x1x1")
    assert torch.equal(out.sequences, want)
    with pytest.raises(ValueError, match="one prompt at a time"):
        speculative_generate(target, draft, torch.tensor([[3, 4], [5, 6]]), tree="3x1x1")
    flex = tiny_llama(seed=1, layers=1)
    flex.config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match="attn_implementation='sdpa'"):
        speculative_generate(target, flex, torch.tensor([[3, 4]]), tree="3x1x1")


def test_a_width_one_tree_is_the_chain(target, draft):
    prompt = torch.tensor([[3, 4, 5]])
    tree = speculative_generate(target, draft, prompt, max_new_tokens=16, tree="1x1x1")
    chain = speculative_generate(target, draft, prompt, max_new_tokens=16, num_draft_tokens=3)
    assert tree.stats.tree is None and tree.stats.as_dict() == chain.stats.as_dict()


def test_a_draft_failure_inside_a_tree_falls_back_to_the_target(target, draft):
    calls = {"n": 0}
    original = draft.forward

    def forward(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] > 4:
            raise RuntimeError("boom")
        return original(*args, **kwargs)

    draft.forward = forward
    try:
        prompt = torch.tensor([[3, 4, 5]])
        out = speculative_generate(target, draft, prompt, max_new_tokens=16, tree="2x2")
    finally:
        del draft.forward
    assert out.stats.fallback and "boom" in out.stats.fallback_reason
    assert torch.equal(out.sequences, target_generate(target, prompt, max_new_tokens=16).sequences)


# ---- sampling: each emitted token is distributed as the target's


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 6), st.floats(0.1, 3.0))
def test_the_emitted_distribution_is_the_target_for_any_candidates(seed, n, spread):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(8, generator=g) * spread, dim=0)
    if seed % 3 == 0:
        p[torch.randperm(8, generator=g)[:3]] = 0.0  # top-k / top-p zeros
        p = p / p.sum()
    candidates = torch.randperm(8, generator=g)[:n].tolist()
    torch.testing.assert_close(emitted_distribution(p, candidates), p, atol=1e-6, rtol=0)


def _one_node_counts(p: torch.Tensor, candidates: list[int], draws: int, seed: int) -> torch.Tensor:
    """What `sampled_walk` emits first at a root whose children are `candidates` (leaves: a bonus follows)."""
    tree = Tree()
    for token in candidates:
        tree.add(token, -1, 0.0)
    rows = torch.cat([p[None], p.new_full((len(candidates), p.numel()), 1.0 / p.numel())])
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(p.numel(), dtype=torch.long)
    for _ in range(draws):
        path, token = sampled_walk(tree, rows, g)
        counts[tree.tokens[path[0]] if path else token] += 1
    return counts


def _fit(counts: torch.Tensor, p: torch.Tensor) -> float:
    fit = verify_cmd.goodness_of_fit(counts, p)
    return 0.0 if fit["impossible_samples"] else verify_cmd.chi2_sf(fit["chi2"], fit["dof"])


P_NODE = torch.tensor([0.30, 0.25, 0.15, 0.10, 0.08, 0.06, 0.04, 0.02])


def test_the_sampled_walk_emits_the_target_distribution():
    assert _fit(_one_node_counts(P_NODE, [1, 0, 5], draws=20_000, seed=0), P_NODE) > ALPHA


def test_the_test_catches_a_wrong_residual(monkeypatch):
    """Trying the next sibling against p itself (the rejected candidates not removed) over-emits later siblings."""
    monkeypatch.setattr(specdec.tree, "without", lambda r, token: r)
    assert _fit(_one_node_counts(P_NODE, [1, 0, 5], draws=20_000, seed=0), P_NODE) < ALPHA


def test_a_residual_that_forgets_to_renormalise_is_caught(monkeypatch):
    def unnormalised(r, token):
        r = r.clone()
        r[token] = 0.0
        return r

    monkeypatch.setattr(specdec.tree, "without", unnormalised)
    assert _fit(_one_node_counts(P_NODE, [1, 0, 5], draws=20_000, seed=0), P_NODE) < ALPHA
    assert without(P_NODE, 0).sum() == pytest.approx(1.0)


VOCAB, M = 16, 3
PROMPT = [3, 4, 5]
SETTINGS = [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.7, top_p=0.9)]


@pytest.fixture(scope="module")
def small_pair():
    target = tiny_llama(seed=0, vocab_size=VOCAB, hidden=16, dtype=torch.float32)
    draft = tiny_llama(seed=1, vocab_size=VOCAB, hidden=16, layers=1, dtype=torch.float32)
    return target, draft


def _joint_counts(target, draft, tree: str, sampling, calls: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.tensor([PROMPT])
    counts = torch.zeros(VOCAB**M, dtype=torch.long)
    for _ in range(calls):
        out = speculative_generate(target, draft, ids, sampling=sampling, max_new_tokens=M + 1, generator=g, tree=tree)
        first = out.sequences[0, len(PROMPT): len(PROMPT) + M].tolist()
        counts[first[0] * VOCAB**2 + first[1] * VOCAB + first[2]] += 1
    return counts


@pytest.mark.parametrize("sampling", SETTINGS, ids=["t1.0", "t0.7-p0.9"])
@pytest.mark.parametrize("tree", ["3x2", "dyn5-d2-w3"])
def test_sampled_tree_decoding_is_distributed_as_the_target(small_pair, tree, sampling):
    """The joint of the first three tokens (two tree rounds at least), 3,000 batch-1 calls."""
    target, draft = small_pair
    counts = _joint_counts(target, draft, tree, sampling, calls=3_000, seed=7)
    exact = verify_cmd.exact_joint(target, torch.tensor(PROMPT), M, sampling)
    assert _fit(counts, exact) > ALPHA


def test_sampled_eagle3_tree_is_distributed_as_the_target(small_pair):
    target, _ = small_pair
    draft = Eagle3Draft.from_target(target, [1], keep_ids=torch.tensor([0, 2, 3, 5, 8, 9, 12, 15]), seed=5)
    with torch.no_grad():
        draft.fc.weight.normal_(std=0.5, generator=torch.Generator().manual_seed(0))
    counts = _joint_counts(target, draft, "2x2", SETTINGS[1], calls=3_000, seed=9)
    exact = verify_cmd.exact_joint(target, torch.tensor(PROMPT), M, SETTINGS[1])
    assert _fit(counts, exact) > ALPHA


# ---- teacher-forced replay of trees (specdec/replay.py)


@pytest.fixture(scope="module")
def near(target):
    """A noisy copy of the target: right often, not always, and often second or third when not first."""
    model = tiny_llama(seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(1 + 0.3 * torch.randn(param.shape, generator=g, dtype=param.dtype))
    return model


@pytest.mark.parametrize("widths", [[3, 1, 1], [4], [2, 2, 2]])
def test_replayed_ranks_predict_a_plain_drafts_tree_rounds(target, near, widths):
    draft, prompt, new = near, torch.tensor([[3, 4, 5, 6, 7, 8]]), 40
    tree = "x".join(map(str, widths))
    out = speculative_generate(target, draft, prompt, max_new_tokens=new, trace=True, tree=tree)
    seq = target_generate(target, prompt, max_new_tokens=new).sequences
    mask = torch.ones_like(seq)
    loss_mask = torch.zeros_like(seq, dtype=torch.bool)
    loss_mask[0, prompt.shape[1] - 1: seq.shape[1] - 1] = True
    runs = replay.runs_from_ranks(replay.replay_ranks(draft, seq, mask, loss_mask, len(widths)), widths)[0]
    i, length = 1, prompt.shape[1] + 1
    for r in out.trace:
        depth = max(1, min(len(widths), prompt.shape[1] + new - length - 1))
        assert len(r.path) == min(runs[i], depth)
        i += r.advanced
        length += r.advanced
    assert torch.equal(out.sequences, seq)
    chain = replay.runs_from_ranks(replay.replay_ranks(draft, seq, mask, loss_mask, len(widths)), [1] * len(widths))
    assert sum(runs) > sum(chain[0]) > 0  # the replay sees what the tree finds beyond the first choice


def test_ranks_and_top_n_agreement_by_hand():
    logits = torch.tensor([[0.1, 0.9, 0.5, 0.3]])
    assert true_token_ranks(logits, torch.tensor([1]), None).tolist() == [0]
    assert true_token_ranks(logits, torch.tensor([3]), None).tolist() == [2]
    # a reduced vocabulary: rows are target ids 10, 11, 12, 13; id 5 is outside it
    ranks = true_token_ranks(logits.expand(2, 4), torch.tensor([12, 5]), torch.tensor([10, 11, 12, 13]))
    assert ranks.tolist() == [1, RANK_CAP]
    ranks = [[[0, 1], [2, 0], [0, RANK_CAP]]]  # the last start has no second completion token
    top = replay.top_n_agreement(ranks, ns=(1, 2, 4))
    assert top[0] == {"1": 2 / 3, "2": 2 / 3, "4": 1.0}
    assert top[1] == {"1": 0.5, "2": 1.0, "4": 1.0}
    assert replay.runs_from_ranks(ranks, [3, 1]) == [[1, 2, 1]]
