"""EAGLE-3 drafts (specdec/eagle3/): the computation, exact decoding, the target's states read, the unrolled
training-time test equal to the decoder, save and load; the trainer and eval with draft=eagle3."""

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from conftest import ragged_prompts, tiny_llama
from draft_checks import (
    draft_ids,
    fit,
    greedy_outputs_equal_the_target,
    replay_predicts_every_round,
    run_logging_losses,
    same_loss_and_gradients,
)

from specdec import speculative_generate, target_generate
from specdec.eagle3 import Eagle3Draft, Eagle3Drafter, HiddenStateRecorder, default_layer_ids
from specdec.eagle3.drafter import _HiddenWindow
from specdec.eval import proposals
from specdec.models import load_model
from specdec.ranks import RANK_CAP, true_token_ranks
from specdec.replay import replay_ranks, runs_from_ranks, target_states

VOCAB = 128
EOS = 2
LAYERS = [1, 2, 3]  # of a 4-layer target: after 1, 2 and 3 of its decoder layers


@pytest.fixture(scope="module")
def target4():
    return tiny_llama(seed=0, layers=4)


@pytest.fixture(scope="module")
def random_draft(target4):
    return Eagle3Draft.from_target(target4, LAYERS, seed=3).eval()


def FITTED_PROMPTS() -> torch.Tensor:  # noqa: N802 - a constant, built on demand
    return ragged_prompts(6, VOCAB, seed=21, min_len=6, max_len=6)[0]


def fitted_draft(target, keep_ids=None, steps: int = 120, seed: int = 0) -> Eagle3Draft:
    """A draft fitted (cross-entropy, 3 unrolled steps) to the target's greedy continuations of a few prompts:
    it then agrees often on those prompts, so decoding them exercises long accepted runs and full accepts."""
    draft = Eagle3Draft.from_target(target, LAYERS, keep_ids, seed=seed)
    prompts = FITTED_PROMPTS()
    seq = target_generate(target, prompts, max_new_tokens=40).sequences
    mask = torch.ones_like(seq)
    states = target_states(draft, target, seq, mask)
    labels = seq[:, 2:]  # draft position t proposes token t + 2
    inv = draft_ids(draft, VOCAB)

    def loss():
        total = 0.0
        for j, out in enumerate(draft(seq, states, attention_mask=mask, ttt_steps=3)):
            local, logits = inv[labels[:, j:]], draft.logits(out[:, j:-1])
            total = total + F.cross_entropy(logits[local >= 0], local[local >= 0])
        return total

    return fit(draft, loss, steps)


@pytest.fixture(scope="module")
def good_draft(target4):
    return fitted_draft(target4)


def reference_step(draft: Eagle3Draft, ids, target_hidden) -> torch.Tensor:
    """The EAGLE-3 forward written out from the papers' and engines' description, with no cache, causal over
    the sequence, independently of the module's own code path: logits [B, n, draft_vocab]."""
    layer, attn = draft.midlayer, draft.midlayer.self_attn
    h = target_hidden @ draft.fc.weight.T  # fc over cat(a_1, a_2, a_3), no bias

    def rms(x, norm):
        return norm.weight * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
                              ).to(x.dtype)

    x = torch.cat([rms(draft.embed_tokens(ids), layer.input_layernorm), rms(h, layer.hidden_norm)], dim=-1)
    b, n, _ = x.shape
    heads, kv, d = layer.heads, layer.kv_heads, layer.head_dim
    q = (x @ attn.q_proj.weight.T).view(b, n, heads, d).transpose(1, 2)
    k = (x @ attn.k_proj.weight.T).view(b, n, kv, d).transpose(1, 2)
    v = (x @ attn.v_proj.weight.T).view(b, n, kv, d).transpose(1, 2)
    theta = draft.config.rope_parameters["rope_theta"]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = torch.arange(n, dtype=torch.float64)[:, None] * inv_freq[None]
    cos, sin = torch.cat([angles, angles], -1).cos().to(x.dtype), torch.cat([angles, angles], -1).sin().to(x.dtype)

    def rotate(t):
        half = t.shape[-1] // 2
        return t * cos + torch.cat([-t[..., half:], t[..., :half]], -1) * sin

    q, k = rotate(q), rotate(k)
    k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
    scores = (q @ k.transpose(-1, -2)) / d ** 0.5
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    attended = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, -1)
    r = attended @ attn.o_proj.weight.T + h  # the residual is h itself (norm_before_residual false)
    mlp = layer.mlp
    m = rms(r, layer.post_attention_layernorm)
    out = (F.silu(m @ mlp.gate_proj.weight.T) * (m @ mlp.up_proj.weight.T)) @ mlp.down_proj.weight.T + r
    return rms(out, draft.norm) @ draft.lm_head.weight.T


def test_the_forward_is_the_eagle3_computation(target4, random_draft):
    """The module's forward equals the computation written out by hand; swapping the two halves of the attention
    input, or reading other layers, changes it (so the test can fail)."""
    ids = torch.tensor([[5, 17, 33, 8, 91, 40]])
    with torch.no_grad():
        hidden = target_states(random_draft, target4, ids, torch.ones_like(ids))
        expected = reference_step(random_draft, ids, hidden)
        got = random_draft(ids, hidden, torch.arange(6)[None])[1]
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
        swapped = Eagle3Draft.from_target(target4, LAYERS, seed=3).eval()
        q = swapped.midlayer.self_attn.q_proj.weight
        h = q.shape[1] // 2
        q.copy_(torch.cat([q[:, h:], q[:, :h]], 1))
        assert not torch.allclose(swapped(ids, hidden, torch.arange(6)[None])[1], expected, atol=1e-3)
        other = target_states(random_draft, target4, ids, torch.ones_like(ids)).roll(1, dims=-1)
        assert not torch.allclose(random_draft(ids, other, torch.arange(6)[None])[1], expected, atol=1e-3)


def test_states_are_the_residual_stream_after_each_layer_id(target4):
    ids = torch.tensor([[5, 17, 33, 8]])
    with torch.no_grad(), HiddenStateRecorder(target4, LAYERS) as rec:
        target4(ids)
        states = target4.model(ids, output_hidden_states=True).hidden_states  # [0] = embeddings
        expected = torch.cat([states[i] for i in LAYERS], -1)
        torch.testing.assert_close(rec.latest, expected)


def test_the_vocabulary_map_is_the_engines_offset(target4):
    keep = torch.tensor([90, 3, 7, 64, 5])  # any order in; draft ids follow ascending target ids
    draft = Eagle3Draft.from_target(target4, LAYERS, keep_ids=keep)
    assert draft.draft_to_target.tolist() == [3, 5, 7, 64, 90]
    assert (torch.arange(5) + draft.d2t).tolist() == [3, 5, 7, 64, 90]  # target id = draft id + d2t[draft id]
    assert draft.t2d.sum() == 5 and draft.t2d[[3, 5, 7, 64, 90]].all() and draft.d2t.dtype == torch.long
    torch.testing.assert_close(draft.lm_head.weight, target4.lm_head.weight[[3, 5, 7, 64, 90]])


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("k", [1, 3, 6])
@pytest.mark.parametrize("which", ["random", "fitted"])
def test_greedy_output_equals_the_target_alone(target4, random_draft, good_draft, which, batch, k):
    draft = random_draft if which == "random" else good_draft
    greedy_outputs_equal_the_target(target4, draft, batch, k, VOCAB, EOS)


def test_a_draft_that_agrees_often_gets_long_runs_and_stays_exact(target4, good_draft):
    prompts = FITTED_PROMPTS()
    ref = target_generate(target4, prompts, max_new_tokens=40)
    out = speculative_generate(target4, good_draft, prompts, num_draft_tokens=4, max_new_tokens=40)
    assert torch.equal(out.sequences, ref.sequences)
    assert out.stats.acceptance_rate > 0.5 and out.stats.bonus > 0 and out.stats.corrections > 0


def test_each_round_reads_the_targets_states_and_the_next_token(target4, good_draft, monkeypatch):
    """Positions read from the target carry its residual streams at that position (as a full forward over the
    output computes them) and token t + 1; the window of unread states stays a few positions long."""
    calls, windows = [], []
    forward, write = Eagle3Draft.forward, _HiddenWindow.write

    def spy(self, input_ids, hidden, position_ids=None, from_target=True, *args, **kwargs):
        if from_target and not kwargs.get("ttt_steps"):
            calls.append((input_ids.clone(), hidden.clone(), position_ids.clone()))
        return forward(self, input_ids, hidden, position_ids, from_target, *args, **kwargs)

    def spy_write(self, position, values):
        write(self, position, values)
        windows.append(self.values.shape[1])

    monkeypatch.setattr(Eagle3Draft, "forward", spy)
    monkeypatch.setattr(_HiddenWindow, "write", spy_write)
    prompts = FITTED_PROMPTS()[:1]
    out = speculative_generate(target4, good_draft, prompts, num_draft_tokens=3, max_new_tokens=30)
    assert len(windows) >= 5 and max(windows) <= 3 + 1
    seq = out.sequences
    with torch.no_grad():
        states = target4.model(seq, output_hidden_states=True).hidden_states
    expected = torch.cat([states[i] for i in LAYERS], -1)
    for input_ids, hidden, positions in calls:
        start, n = int(positions[0, 0]), input_ids.shape[1]
        assert torch.equal(input_ids[0], seq[0, start + 1: start + 1 + n])
        torch.testing.assert_close(hidden[0], expected[0, start: start + n], rtol=1e-6, atol=1e-6)
    assert len(calls) >= 5


def float32_softmax_tolerance(keys: int, steps: int) -> float:
    """The relative error allowed between two float64 paths that differ by a float32 softmax over `keys` keys,
    fed back through `steps` steps: the unrolled attention rounds its softmax weights to float32
    (specdec/eagle3/attention.py), the decoder's runs in float64, and the RMSNorms round both to float32 alike.

    Each float32 weight is off by a few units of float32 roundoff (eps = 2^-23: exp about 1, the row's sum of
    `keys` terms about sqrt(keys) for rounding errors of random sign, the division 1/2), so the attended value
    sum_i w_i v_i is off by about (2 + sqrt(keys)) eps max|v|; o_proj and the MLP carry it at the output's scale,
    and each later step adds its own and reads the previous step's output. Allowing 4x that per step leaves room
    for the CPU's choice of float32 kernels (vector width and summation order differ between AVX2 and AVX-512),
    while a wrong key or position moves outputs by 1e-2 and more."""
    eps = torch.finfo(torch.float32).eps
    return 4 * steps * (2 + keys ** 0.5) * eps


def test_unrolled_steps_equal_the_decoders_proposals(target4, good_draft):
    """Step j of the training-time test at position t is the j-th proposal of the round whose last true position
    is t - (j - 1), fed the data's tokens: the same pre-norm output as the cached decoder's, to float32's softmax
    rounding (`float32_softmax_tolerance`), and the same proposed tokens."""
    from transformers import DynamicCache

    seq = target_generate(target4, torch.tensor([[5, 17, 33, 8, 91]]), max_new_tokens=14).sequences
    mask = torch.ones_like(seq)
    with torch.no_grad():
        states = target_states(good_draft, target4, seq, mask)
        outs = good_draft.unrolled(seq, states, mask, 4)
        for s in range(0, seq.shape[1] - 5):
            cache = DynamicCache(config=good_draft.config)
            out, _ = good_draft(seq[:, 1:s + 2], states[:, :s + 1], torch.arange(s + 1)[None], True, cache)
            decoded, unrolled = [out[0, -1]], [outs[0][0, s]]
            for j in range(2, 5):
                out, _ = good_draft(seq[:, s + j: s + j + 1], out[:, -1:], torch.tensor([[s + j - 1]]), False, cache)
                decoded.append(out[0, -1])
                unrolled.append(outs[j - 1][0, s + j - 1])
            for j, (got, want) in enumerate(zip(decoded, unrolled), 1):
                tol = float32_softmax_tolerance(keys=s + j, steps=j)
                torch.testing.assert_close(got, want, rtol=tol, atol=tol * float(want.abs().max()),
                                           msg=lambda m, s=s, j=j: f"position {s}, step {j}: {m}")
            proposals = [good_draft.logits(torch.stack(x)).argmax(-1) for x in (decoded, unrolled)]
            assert torch.equal(*proposals), f"position {s}"


def test_replayed_runs_match_the_decoders_rounds(target4, good_draft):
    """The held-out simulation is exact: on the target's own greedy output the replay predicts every round's
    accepted count of the real decoder."""
    prompts = FITTED_PROMPTS()[:1]
    k, new = 4, 56  # the draft was fitted on 40 tokens: the rest makes it miss too
    out, runs = replay_predicts_every_round(target4, good_draft, prompts, k, new)
    assert max(int(r.num_accepted[0]) for r in out.trace) >= 3 and min(runs) == 0


def test_replayed_ranks_predict_the_tree_decoders_rounds(target4, good_draft):
    """The same exactness for a static tree: the ranks replayed on the target's greedy output give every tree
    round's accepted depth (the true token within the top w_j at each depth j)."""
    prompts = FITTED_PROMPTS()[:1]
    widths, new = [3, 2, 1, 1], 56
    out = speculative_generate(target4, good_draft, prompts, max_new_tokens=new, trace=True, tree="3x2x1x1")
    seq = target_generate(target4, prompts, max_new_tokens=new).sequences
    assert torch.equal(out.sequences, seq)
    mask = torch.ones_like(seq)
    loss_mask = torch.zeros_like(seq, dtype=torch.bool)
    loss_mask[0, prompts.shape[1] - 1: seq.shape[1] - 1] = True
    ranks = replay_ranks(good_draft, seq, mask, loss_mask, len(widths), target_states(good_draft, target4, seq, mask))
    runs = runs_from_ranks(ranks, widths)[0]
    i, length = 1, prompts.shape[1] + 1
    for r in out.trace:
        depth = max(1, min(len(widths), prompts.shape[1] + new - length - 1))
        assert len(r.path) == min(runs[i], depth), f"round at completion token {i}"
        i += r.advanced
        length += r.advanced
    chain = runs_from_ranks(ranks, [1] * len(widths))[0]
    assert sum(runs) > sum(chain)  # the wider first levels find tokens the chain misses


def test_held_out_ranks_are_each_rows_own_and_the_full_heads(target4, good_draft):
    """The held-out evaluation batches rows of like length (train/distill.py) and runs the head only where a rank
    is read (specdec/eagle3/replay.py): a row's ranks are those it gets alone, however much padding its batch
    adds, and those of the head over every position (the reference below)."""
    prompts = FITTED_PROMPTS()[:2]
    rows = [target_generate(target4, prompts[i:i + 1], max_new_tokens=n).sequences[0] for i, n in ((0, 30), (1, 12))]
    width = max(len(r) for r in rows)
    ids = torch.zeros(2, width, dtype=torch.long)
    mask = torch.zeros(2, width, dtype=torch.long)
    loss_mask = torch.zeros(2, width, dtype=torch.bool)
    for b, r in enumerate(rows):
        ids[b, :len(r)], mask[b, :len(r)] = r, 1
        loss_mask[b, prompts.shape[1] - 1: len(r) - 1] = True
    steps = 3
    batched = replay_ranks(good_draft, ids, mask, loss_mask, steps, target_states(good_draft, target4, ids, mask))
    for b, r in enumerate(rows):
        one = slice(b, b + 1), slice(0, len(r))
        alone = replay_ranks(good_draft, ids[one], mask[one], loss_mask[one], steps,
                             target_states(good_draft, target4, ids[one], mask[one]))
        assert batched[b] == alone[0], f"row {b}"
    # the reference: the head over every position, read where the round's token is a scored one
    states = target_states(good_draft, target4, ids, mask)
    outs = good_draft.unrolled(ids, states, mask, steps)
    full = [true_token_ranks(good_draft.logits(o)[:, :-1], ids[:, 2:], good_draft.draft_to_target) for o in outs]
    for b in range(2):
        scored = [p for p in range(width) if loss_mask[b, p]]
        for p, got in zip(scored, batched[b]):
            want = [int(full[j - 1][b, p + j - 2]) if p + j - 2 >= 0 and p + j < width and loss_mask[b, p + j - 1]
                    else RANK_CAP for j in range(1, steps + 1)]
            assert got == want, f"row {b}, position {p}"
    assert any(r < RANK_CAP for row in batched for position in row for r in position)


def test_save_load_round_trip_is_exact(target4, tmp_path):
    keep = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(0))[:40]
    draft = fitted_draft(target4, keep_ids=keep, steps=30)
    draft.save_pretrained(tmp_path / "e3")
    config = json.loads((tmp_path / "e3" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 40
    assert config["eagle_aux_hidden_state_layer_ids"] == LAYERS and config["norm_before_residual"] is False
    loaded = load_model(str(tmp_path / "e3"), dtype="float64", device="cpu")
    assert isinstance(loaded, Eagle3Draft) and torch.equal(loaded.draft_to_target, draft.draft_to_target)
    for name, value in draft.state_dict().items():
        assert torch.equal(value, loaded.state_dict()[name]), name
    ids, mask = ragged_prompts(3, VOCAB, seed=4)
    ref = target_generate(target4, ids, mask, max_new_tokens=32)
    assert torch.equal(speculative_generate(target4, loaded, ids, mask, 3, max_new_tokens=32).sequences, ref.sequences)


def test_a_null_target_hidden_size_means_the_drafts_own(target4, random_draft, tmp_path):
    """Issue 30: stock speculators EAGLE-3 checkpoints write `target_hidden_size: null` for a target as wide as the
    draft, which speculators reads as the draft's hidden_size; specdec reads it so too, in either layout."""
    for fmt in ("speculators", "engines"):
        folder = tmp_path / fmt
        random_draft.save_pretrained(folder, format=fmt, speculators={
            "verifier": "acme/target", "verifier_architectures": ["LlamaForCausalLM"], "num_draft_tokens": 3})
        config = json.loads((folder / "config.json").read_text())
        config["target_hidden_size"] = None
        (folder / "config.json").write_text(json.dumps(config))
        loaded = load_model(str(folder), dtype="float64", device="cpu")
        assert loaded.config.target_hidden_size == random_draft.config.hidden_size
        for name, value in random_draft.state_dict().items():
            assert torch.equal(value, loaded.state_dict()[name]), (fmt, name)


def test_an_old_feature_draft_gets_a_retraining_hint(tmp_path):
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "config.json").write_text(json.dumps({"specdec_feature_draft": True, "model_type": "llama"}))
    with pytest.raises(ValueError, match="retrain it as an EAGLE-3 draft"):
        load_model(str(tmp_path / "old"), device="cpu")


def test_bad_layer_ids_are_refused(target4):
    with pytest.raises(ValueError, match="distinct ids in 1..3"):
        Eagle3Draft.from_target(target4, [0, 1, 2])
    with pytest.raises(ValueError, match="distinct ids in 1..3"):
        Eagle3Draft.from_target(target4, [1, 1, 2])
    with pytest.raises(ValueError, match="name them with eagle_aux_layer_ids"):
        Eagle3Draft.from_target(target4)
    assert default_layer_ids(30) == [2, 15, 27]  # vLLM's default for SmolLM2-135M


def test_a_draft_failure_falls_back_to_the_target(target4, random_draft, monkeypatch):
    def broken(*_a, **_k):
        raise RuntimeError("boom")

    monkeypatch.setattr(Eagle3Drafter, "propose", broken)
    ids = torch.tensor([[5, 17, 33, 8]])
    out = speculative_generate(target4, random_draft, ids, num_draft_tokens=2, max_new_tokens=12)
    assert out.stats.fallback and "boom" in out.stats.fallback_reason
    assert torch.equal(out.sequences, target_generate(target4, ids, max_new_tokens=12).sequences)


# ---- training (train/eagle3_train.py and the trainer) -----------------------------------------------------


def test_ttt_step_weights_and_the_loss_masks():
    from specdec.train.eagle3_train import step_weights

    assert step_weights(1, 0.8) == [1.0]
    w = step_weights(3, 0.8)
    assert sum(w) == pytest.approx(1.0) and w[1] / w[0] == pytest.approx(0.8) and w[2] / w[1] == pytest.approx(0.8)


def test_the_online_teachers_restricted_head_gives_the_restricted_full_logits():
    from specdec.train import losses
    from specdec.train.eagle3_train import teacher_head

    head = torch.nn.Linear(16, VOCAB, bias=True)
    keep = torch.tensor([0, 2, 5, 9, 64, 127])
    x = torch.randn(7, 16, generator=torch.Generator().manual_seed(0))
    restricted = teacher_head(head, keep)
    assert restricted.out_features == len(keep) and not restricted.weight.requires_grad
    assert torch.allclose(restricted(x), losses.restrict_teacher(head(x), keep), atol=1e-6)


def test_the_loss_is_zero_only_where_the_draft_can_propose(target4):
    """EAGLE-3's position mask: positions whose target token lies outside the draft vocabulary add nothing, and a
    draft vocabulary without any of the data's tokens gives a zero loss (not a nan)."""
    from specdec.eagle3 import target_states
    from specdec.train.batches import collate
    from specdec.train.distill import TrainConfig
    from specdec.train.eagle3_train import eagle3_loss

    draft = Eagle3Draft.from_target(target4, LAYERS, keep_ids=torch.tensor([3, 4]))
    seqs = [[10, 11, 12, 13, 14, 15], [20, 21, 22, 23]]
    batch = collate({"input_ids": seqs, "prompt_length": [2, 2]}, pad_id=0, max_length=16)
    states = target_states(target4, batch["input_ids"], batch["attention_mask"], LAYERS, final=True).float()
    inv = torch.full((VOCAB,), -1, dtype=torch.long)
    inv[draft.draft_to_target] = torch.arange(2)
    cfg = TrainConfig(draft="eagle3", teacher="offline", loss="ce", ttt_steps=2, eagle_aux_layer_ids=LAYERS)
    loss = eagle3_loss(cfg, draft, batch, states, None, inv)
    assert float(loss.detach()) == 0.0 and loss.requires_grad


@pytest.mark.parametrize("teacher", ["online", "offline"])
def test_packed_and_unpacked_batches_give_the_same_loss_and_gradients(target4, teacher):
    """Samples packed into rows (document ids through every attention, positions and the loss) train exactly as
    the same samples one per row: the loss and every gradient agree to float rounding."""
    from specdec.eagle3 import target_states
    from specdec.train import losses
    from specdec.train.batches import collate, pack, pack_order, place
    from specdec.train.distill import TrainConfig
    from specdec.train.eagle3_train import eagle3_loss, teacher_head

    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(4, VOCAB, (n,), generator=g).tolist() for n in (9, 5, 12, 7, 4, 10)]
    prompts = [3, 2, 5, 3, 2, 4]
    tops = [[torch.randint(4, VOCAB, (3,), generator=g).tolist() for _ in range(len(q) - p)] for q, p in zip(seqs, prompts)]
    logps = [[sorted(torch.randn(3, generator=g).log_softmax(-1).tolist(), reverse=True) for _ in t] for t in tops]
    batch = collate({"input_ids": seqs, "prompt_length": prompts, "top_ids": tops, "top_logprobs": logps},
                    pad_id=0, max_length=32)
    packed = pack(batch, max_length=20)
    assert len(packed["input_ids"]) < len(seqs) and packed["attention_mask"].sum() == batch["attention_mask"].sum()
    assert all(sum(len(seqs[i]) for i in row) <= 20 for row in pack_order([len(q) for q in seqs], 20))
    draft = Eagle3Draft.from_target(target4, LAYERS, keep_ids=torch.arange(60), seed=1)
    inv = losses.target_to_draft_map(draft.draft_to_target, VOCAB)
    head = teacher_head(target4.get_output_embeddings(), draft.kept_ids()) if teacher == "online" else None
    states = target_states(target4, batch["input_ids"], batch["attention_mask"], LAYERS, final=True).float()
    cfg = TrainConfig(draft="eagle3", teacher=teacher, ttt_steps=3, eagle_aux_layer_ids=LAYERS)
    results = []
    for b, s in ((batch, states), (packed, place(states, packed))):
        draft.zero_grad()
        loss = eagle3_loss(cfg, draft, b, s, head, inv)
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}))
    same_loss_and_gradients(*results)


def test_a_batch_with_nothing_scored_still_gives_every_parameter_a_gradient(target4):
    """DDP's reducer expects a gradient for every parameter from every process: a micro-batch with no scored
    position (all prompt, say) must still reach the head, the norm and fc, with zeros."""
    from specdec.eagle3 import target_states
    from specdec.train.batches import collate
    from specdec.train.distill import TrainConfig
    from specdec.train.eagle3_train import eagle3_loss

    draft = Eagle3Draft.from_target(target4, LAYERS, keep_ids=torch.arange(40))
    batch = collate({"input_ids": [[10, 11, 12, 13]], "prompt_length": [4]}, pad_id=0, max_length=16)
    assert not batch["loss_mask"].any()
    states = target_states(target4, batch["input_ids"], batch["attention_mask"], LAYERS, final=True).float()
    cfg = TrainConfig(draft="eagle3", teacher="online", ttt_steps=3, eagle_aux_layer_ids=LAYERS)
    loss = eagle3_loss(cfg, draft, batch, states, None, None)
    loss.backward()
    assert float(loss.detach()) == 0.0
    trainable = [(n, p) for n, p in draft.named_parameters() if p.requires_grad]
    assert trainable and all(p.grad is not None and not p.grad.any() for _, p in trainable)


@pytest.mark.usefixtures("fresh_accelerate_state")
@pytest.mark.parametrize("teacher, steps, pack", [("offline", 1, False), ("online", 3, False), ("offline", 2, True)])
def test_the_trainer_distils_an_eagle3_draft_end_to_end(tmp_path, teacher, steps, pack):
    """draft=eagle3 through the real loop: reduced head, unrolled steps, held-out tau from the replay, best/ and
    final/ that load as EAGLE-3 drafts and decode exactly; the loss falls on one repeated batch."""
    from conftest import save_tiny_world

    from specdec.train import distill

    ws = save_tiny_world(tmp_path / "ws", target_layers=4, small_seed=7, n_train=24, n_heldout=6)
    cfg = distill.TrainConfig(target=str(ws / "target"), train_data=str(ws / "data"), heldout_data=str(ws / "heldout"),
                              output_dir=str(tmp_path / "run"), device="cpu", draft="eagle3", teacher=teacher,
                              eagle_aux_layer_ids=LAYERS, draft_vocab_size=40, ttt_steps=steps, max_steps=12,
                              per_device_batch_size=24, warmup_steps=0, log_every=1, eval_every=6, save_every=6,
                              eval_samples=6, eval_batch_size=3, learning_rate=3e-3, pack=pack)
    final, history, loss = run_logging_losses(cfg, tmp_path / "run")
    assert [h["step"] for h in history] == [0, 6, 12]
    assert all(1.0 <= h["tau"]["4"] <= 5.0 and 0 <= h["agreement"] <= 1 for h in history)
    assert len(loss) == 12 and loss[-1] < 0.8 * loss[0]
    draft = load_model(str(final), dtype="float32", device="cpu")
    assert isinstance(draft, Eagle3Draft) and draft.lm_head.out_features == 40 and draft.layer_ids == LAYERS
    assert isinstance(load_model(str(tmp_path / "run" / "best"), dtype="float32", device="cpu"), Eagle3Draft)
    target = load_model(str(ws / "target"), dtype="float32", device="cpu")
    ids, mask = ragged_prompts(2, VOCAB, seed=5)
    ref = target_generate(target, ids, mask, max_new_tokens=16)
    assert torch.equal(speculative_generate(target, draft, ids, mask, 3, max_new_tokens=16).sequences, ref.sequences)


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_states_recorded_by_the_data_stage_spare_the_target_forward(tmp_path, monkeypatch):
    """`specdec data record_features=true` -> an EAGLE-3 draft trains and is scored with no target forward for its
    states; data recorded with other layers, or without states, falls back to computing them."""
    from conftest import save_tiny_world

    from specdec.train import distill, eagle3_states
    from specdec.train.data import DataConfig
    from specdec.train.data import run as run_data

    ws = save_tiny_world(tmp_path / "ws", target_layers=4, small_seed=7, n_train=2, n_heldout=2)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"explain the sum of {w} and water"}) + "\n"
                               for w in "a city book list food number simple clear water the".split()))
    for folder, limit, layers in (("recorded", None, [1, 2, 3]), ("recorded_heldout", 3, [1, 2, 3]),
                                  ("other", 4, [1, 2])):
        run_data(DataConfig(target=str(ws / "target"), prompts=str(prompts), output_dir=str(tmp_path / folder),
                            max_new_tokens=8, batch_size=4, dtype="float32", device="cpu", limit=limit,
                            record_features=True, eagle_aux_layer_ids=layers))

    def no_target_forward(*_args, **_kw):
        raise AssertionError("the target ran for states the data stage recorded")

    monkeypatch.setattr(eagle3_states, "target_states", no_target_forward)
    cfg = distill.TrainConfig(target=str(ws / "target"), train_data=str(tmp_path / "recorded"),
                              heldout_data=str(tmp_path / "recorded_heldout"), output_dir=str(tmp_path / "run"),
                              device="cpu", draft="eagle3", teacher="online", ttt_steps=2, eagle_aux_layer_ids=LAYERS,
                              max_steps=4, per_device_batch_size=4, warmup_steps=0, eval_every=0, save_every=0,
                              eval_samples=3, learning_rate=3e-3)
    distill.run(cfg)
    assert len((tmp_path / "run" / "eval.jsonl").read_text().splitlines()) == 2
    other = dataclasses.replace(cfg, train_data=str(tmp_path / "other"), output_dir=str(tmp_path / "run2"))
    with pytest.raises(AssertionError, match="recorded"):  # recorded with other layers: the states are computed
        distill.run(other)
    with pytest.raises(ValueError, match="no recorded target states"):  # unless the recipe says they must be read
        distill.run(dataclasses.replace(other, states="recorded", output_dir=str(tmp_path / "run3")))
    with pytest.raises(AssertionError, match="recorded"):  # online: the target runs on every batch regardless
        distill.run(dataclasses.replace(cfg, states="online", output_dir=str(tmp_path / "run4")))


def test_states_are_read_per_batch_as_recorded_or_computed_online(tmp_path):
    """A batch's rows read their own recorded states (bf16, equal to the target's to its rounding), by the
    pointer each loaded row carries, whatever order they come in; rows without a recording are computed."""
    import contextlib

    from conftest import save_tiny_world

    from specdec.eagle3 import RECORDED_STATES_DTYPE
    from specdec.models import load_model
    from specdec.train.batches import collate, load_split
    from specdec.train.data import DataConfig, features_file, read_manifest
    from specdec.train.data import run as run_data
    from specdec.train.eagle3_states import States, StatesReader, target_states

    ws = save_tiny_world(tmp_path / "ws", target_layers=4, small_seed=7, n_train=2, n_heldout=2)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"say {w} twice"}) + "\n" for w in "a b c d e f g".split()))
    run_data(DataConfig(target=str(ws / "target"), prompts=str(prompts), output_dir=str(tmp_path / "rec"),
                        max_new_tokens=6, batch_size=4, shard_size=3, dtype="float32", device="cpu",
                        record_features=True, eagle_aux_layer_ids=LAYERS))
    manifest = read_manifest(tmp_path / "rec")
    assert manifest["features"]["dtype"] == "bfloat16" and len(manifest["shards"]) == 3
    from safetensors import safe_open
    with safe_open(str(tmp_path / "rec" / features_file(manifest["shards"][0]["file"])), "pt") as f:
        assert f.get_tensor("0").dtype == RECORDED_STATES_DTYPE

    target = load_model(str(ws / "target"), dtype="float32", device="cpu")
    ds = load_split(tmp_path / "rec")
    width = (1 + len(LAYERS)) * target.config.hidden_size
    rows = ds[[6, 1, 4]]  # rows of three shards, out of order
    assert rows["states_row"] == [0, 1, 1]
    batch = collate(rows, pad_id=0, max_length=64)
    states = States("auto", target, contextlib.nullcontext, StatesReader([tmp_path / "rec"], LAYERS, width), LAYERS)
    read = states.read(rows, batch["input_ids"].shape[1])
    assert read[1] == [True, True, True]
    expected = target_states(target, batch["input_ids"], batch["attention_mask"], LAYERS, final=True).float()
    for b, length in enumerate(batch["attention_mask"].sum(1).tolist()):
        # the recording stops before each row's last token (never fed to the target): zeros there
        torch.testing.assert_close(read[0][b, : length - 1], expected[b, : length - 1], atol=3e-2, rtol=2e-2)
        assert read[0][b, length - 1:].abs().sum() == 0
    # A row without a recording (here: an unknown file) is computed by the target, the others kept as read.
    rows["states_file"][1] = ""
    read = states.read(rows, batch["input_ids"].shape[1])
    assert read[1] == [True, False, True]
    full = states.complete(batch, read)
    torch.testing.assert_close(full[1], expected[1])
    assert torch.equal(full[0], read[0][0])
    online = States("online", target, contextlib.nullcontext, StatesReader([], LAYERS, width), LAYERS)
    torch.testing.assert_close(online.complete(batch, online.read(rows, batch["input_ids"].shape[1])), expected)
    with pytest.raises(ValueError, match="states must be one of"):
        States("cached", target, contextlib.nullcontext, None, LAYERS)


def test_eagle3_config_errors():
    from specdec.train.distill import TrainConfig

    with pytest.raises(ValueError, match="replaced by draft: eagle3"):
        TrainConfig(draft="feature")
    with pytest.raises(ValueError, match="on_policy"):
        TrainConfig(draft="eagle3", teacher="on_policy")
    with pytest.raises(ValueError, match="lora"):
        TrainConfig(draft="eagle3", lora=True)
    with pytest.raises(ValueError, match="ttt_steps must be >= 1"):
        TrainConfig(draft="eagle3", ttt_steps=0)
    with pytest.raises(ValueError, match="eagle_aux_layer_ids is for draft=eagle3"):
        TrainConfig(draft="derived", eagle_aux_layer_ids=[1])


def test_specdec_eval_runs_an_eagle3_draft_and_predicts_its_tau_exactly(tmp_path, target4, good_draft):
    """`specdec eval` with a saved EAGLE-3 draft: exact output, costs timed, and choose_k's replay equal to the
    decoder's measured tau on the same greedy prompts."""
    from conftest import TINY_EVAL_PROMPTS, tiny_tokenizer

    from specdec.cli import main
    from specdec.models import save_model

    tok = tiny_tokenizer()
    save_model(target4, tok, tmp_path / "target")
    good_draft.save_pretrained(tmp_path / "e3")
    tok.save_pretrained(tmp_path / "e3")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in TINY_EVAL_PROMPTS))
    code = main(["eval", "--target", str(tmp_path / "target"), "--draft", str(tmp_path / "e3"), "--prompts",
                 str(prompts), "--max-new-tokens", "16", "--out", str(tmp_path / "out"), "dtype=float64",
                 "cost_repeats=2", "threads=1", "choose_k=2,3", "choose_k_prompts=4", "num_prompts=4", "warmup=0"])
    assert code == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["equivalence"]["passed"] and report["equivalence"]["mismatches"] == 0
    ck = report["choose_k"]
    assert ck["c"] > 0
    assert ck["tau"][proposals.label(ck["chosen"])] == pytest.approx(report["speculative"]["mean_accepted_tokens"])
