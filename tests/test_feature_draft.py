"""The feature-conditioned (EAGLE-style) draft: exact decoding, true features read, save and load."""

import dataclasses

import pytest
import torch
from conftest import ragged_prompts, tiny_llama

from specdec import decode, speculative_generate, target_generate
from specdec.feature_draft import FeatureDraft
from specdec.models import load_model

VOCAB = 128
EOS = 2


@pytest.fixture(scope="module")
def feature_draft(target):
    torch.manual_seed(3)
    return FeatureDraft.from_target(target, [-1]).eval()


@pytest.fixture(scope="module")
def aux_feature_draft(target):
    """Reads target layer 0's output as well as the final feature, with a live path from it (not the zero init)."""
    draft = FeatureDraft.from_target(target, [-1], aux_layers=[0]).eval()
    hidden = target.config.hidden_size
    with torch.no_grad():
        draft.fc.weight[:, 2 * hidden:].normal_(std=0.3, generator=torch.Generator().manual_seed(5))
    return draft


@pytest.mark.parametrize("kind", ["final feature", "with an auxiliary layer"])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_output_equals_the_target_alone(target, request, kind, batch, k):
    feature_draft = request.getfixturevalue("feature_draft" if kind == "final feature" else "aux_feature_draft")
    for seed in range(4):
        ids, mask = ragged_prompts(batch, VOCAB, seed=seed + 10 * k)
        if batch == 1:
            ids, mask = ids[:, mask[0].argmax():], None
        ref = target_generate(target, ids, mask, max_new_tokens=40, eos_token_id=EOS)
        out = speculative_generate(target, feature_draft, ids, mask, num_draft_tokens=k, max_new_tokens=40,
                                   eos_token_id=EOS)
        assert torch.equal(out.sequences, ref.sequences), f"seed {seed}"
        assert not out.stats.fallback and out.stats.draft_forwards > 0


def test_a_draft_that_agrees_often_gets_long_runs_and_stays_exact():
    """On a one-layer target, a draft copied from that layer that reads only the token is the target minus
    the first context token: long accepted runs exercise the rollback of guessed-feature positions."""
    target = tiny_llama(seed=4, layers=1)
    near = FeatureDraft.from_target(target, [0])
    with torch.no_grad():
        near.fc.weight[:, target.config.hidden_size:].zero_()
    ids, mask = ragged_prompts(3, VOCAB, seed=9, min_len=6, max_len=12)
    ref = target_generate(target, ids, mask, max_new_tokens=48)
    out = speculative_generate(target, near, ids, mask, num_draft_tokens=4, max_new_tokens=48)
    assert torch.equal(out.sequences, ref.sequences)
    assert out.stats.acceptance_rate > 0.3 and out.stats.bonus > 0 and out.stats.corrections > 0


@pytest.mark.parametrize("aux_layers", [[], [0]])
def test_each_round_reads_the_targets_true_features(target, monkeypatch, aux_layers):
    """Positions read with true features must carry the target's final hidden state of that position (as a
    full forward over the output computes it), then the outputs of the auxiliary layers, and draft position t
    must read token t + 1."""
    feature_draft = FeatureDraft.from_target(target, [-1], aux_layers=aux_layers).eval()
    calls = []
    forward = FeatureDraft.forward

    def spy(self, input_ids, features, position_ids=None, **kwargs):
        calls.append((input_ids.clone(), features.clone(), position_ids.clone()))
        return forward(self, input_ids, features, position_ids=position_ids, **kwargs)

    round_starts = []  # index in `calls` of each round's first draft forward (the one fed true features)
    propose = decode._FeatureDraft.propose

    def spy_round(self, *args, **kwargs):
        round_starts.append(len(calls))
        return propose(self, *args, **kwargs)

    window_lengths = []  # after each verification's write: the buffer holds only positions not yet read
    write = decode._FeatureWindow.write

    def spy_write(self, position, values):
        write(self, position, values)
        window_lengths.append(self.values.shape[1])

    monkeypatch.setattr(FeatureDraft, "forward", spy)
    monkeypatch.setattr(decode._FeatureDraft, "propose", spy_round)
    monkeypatch.setattr(decode._FeatureWindow, "write", spy_write)
    ids = torch.tensor([[5, 17, 33, 8, 91, 40]])
    out = speculative_generate(target, feature_draft, ids, num_draft_tokens=3, max_new_tokens=30)
    assert len(window_lengths) >= 5 and max(window_lengths) <= 3 + 1  # k + 1 verified positions, never the sequence
    seq = out.sequences
    with torch.no_grad():
        states = target.model(input_ids=seq, output_hidden_states=True)
        # hidden_states[i + 1] is decoder layer i's output; the last entry is the final norm's
        hidden = torch.cat([states.last_hidden_state] + [states.hidden_states[i + 1] for i in aux_layers], dim=-1)
    checked = 0
    for input_ids, features, positions in (calls[i] for i in round_starts):
        start = int(positions[0, 0])
        n = input_ids.shape[1]
        assert torch.equal(input_ids[0], seq[0, start + 1: start + 1 + n])
        torch.testing.assert_close(features[0], hidden[0, start: start + n], rtol=1e-6, atol=1e-6)
        checked += 1
    assert checked >= 5


def _reloaded_and_exact(target, draft, path, k: int):
    """Save `draft`, load it back through load_model, check every weight and exact decoding; the loaded draft."""
    draft.save_pretrained(path)
    loaded = load_model(str(path), dtype="float64", device="cpu")
    assert isinstance(loaded, FeatureDraft)
    for name, value in draft.state_dict().items():
        assert torch.equal(value, loaded.state_dict()[name]), name
    ids, mask = ragged_prompts(3, VOCAB, seed=k)
    ref = target_generate(target, ids, mask, max_new_tokens=32)
    out = speculative_generate(target, loaded, ids, mask, num_draft_tokens=k, max_new_tokens=32)
    assert torch.equal(out.sequences, ref.sequences)
    return loaded


def test_a_reduced_vocabulary_feature_draft_saves_loads_and_is_exact(target, tmp_path):
    torch.manual_seed(0)
    keep = torch.randperm(VOCAB)[:40]
    loaded = _reloaded_and_exact(target, FeatureDraft.from_target(target, [0, 1], keep_ids=keep), tmp_path / "fd", 4)
    assert torch.equal(loaded.draft_to_target, keep)
    assert loaded.config.num_hidden_layers == 2 and loaded.lm_head.out_features == 40


def test_an_auxiliary_layer_draft_saves_loads_and_is_exact(target, aux_feature_draft, tmp_path):
    loaded = _reloaded_and_exact(target, aux_feature_draft, tmp_path / "fd", 2)
    assert loaded.aux_layers == [0] and loaded.feature_width == 2 * target.config.hidden_size


def test_auxiliary_features_change_proposals_and_start_unused(target, aux_feature_draft):
    """At init the auxiliary path is zero (the draft is the final-feature one); once live it moves proposals,
    and a draft-predicted feature (width H) reads zeros in its place."""
    ids = torch.tensor([[5, 17, 33, 8]])
    hidden = target.config.hidden_size
    features = torch.randn(1, 4, aux_feature_draft.feature_width, dtype=torch.float64,
                           generator=torch.Generator().manual_seed(0))
    final_only = features[..., :hidden]
    aux_zeroed = torch.cat([final_only, torch.zeros_like(features[..., hidden:])], dim=-1)
    fresh = FeatureDraft.from_target(target, [-1], aux_layers=[0])
    plain = FeatureDraft.from_target(target, [-1])
    with torch.no_grad():
        torch.testing.assert_close(fresh(ids, features)[1], plain(ids, final_only)[1])
        assert not torch.allclose(aux_feature_draft(ids, features)[1], aux_feature_draft(ids, aux_zeroed)[1])
        torch.testing.assert_close(aux_feature_draft(ids, final_only)[1], aux_feature_draft(ids, aux_zeroed)[1])


def test_bad_layer_list_is_refused(target):
    with pytest.raises(ValueError, match="draft_layers must name"):
        FeatureDraft.from_target(target, [5])
    with pytest.raises(ValueError, match="feature_aux_layers must name"):
        FeatureDraft.from_target(target, [0], aux_layers=[2])


# ---- unrolled training and scoring (train/feature_train.py) -----------------------------------------------


def test_unrolled_run_lengths_match_the_decoders_rounds():
    """The held-out simulation is exact: on the target's own greedy output, unrolled blocks predict every
    round's accepted count of the real decoder (the guessed features feed later proposals, as in decoding)."""
    from train.feature_train import run_lengths, target_features, unrolled

    target = tiny_llama(seed=4, layers=1)
    draft = FeatureDraft.from_target(target, [0])
    with torch.no_grad():  # the token path (long runs) plus a feature path that changes some proposals
        draft.fc.weight[:, target.config.hidden_size:].normal_(std=0.05, generator=torch.Generator().manual_seed(0))
    prompt = torch.tensor([[5, 17, 33, 8, 91, 40, 12]])
    k, new = 4, 40
    out = speculative_generate(target, draft, prompt, num_draft_tokens=k, max_new_tokens=new, trace=True)
    seq = target_generate(target, prompt, max_new_tokens=new).sequences
    assert torch.equal(out.sequences, seq)
    mask = torch.ones_like(seq)
    loss_mask = torch.zeros_like(seq, dtype=torch.bool)
    loss_mask[0, prompt.shape[1] - 1: seq.shape[1] - 1] = True
    with torch.no_grad():
        outs = unrolled(draft, seq, target_features(target, seq, mask), mask, steps=k)
        runs = run_lengths(draft.lm_head, outs, seq, loss_mask, None)[0]
    i, length = 1, prompt.shape[1] + 1  # the first round drafts completion token 1 (token 0 is the prefill's)
    for r in out.trace:
        k_round = max(1, min(k, prompt.shape[1] + new - length - 1))
        assert int(r.num_accepted[0]) == min(runs[i], k_round), f"round at completion token {i}"
        i += r.advanced
        length += r.advanced
    assert max(int(r.num_accepted[0]) for r in out.trace) >= 2 and min(runs) == 0


def test_block_mask_gives_each_block_its_decode_time_view():
    from train.feature_train import block_mask

    m = block_mask(torch.ones(1, 5, dtype=torch.long), 3, torch.float32)[0, 0] == 0  # [5 queries, 15 keys]
    # block 3 at t = 4: true features up to t - 2 = 2, block 2 at t - 1 = 3, itself (block 3) at 4
    assert m[4].nonzero().flatten().tolist() == [0, 1, 2, 5 + 3, 10 + 4]
    assert m[1].nonzero().flatten().tolist() == [5 + 0, 10 + 1]  # a round starting before position 0: no block 1


@pytest.mark.usefixtures("fresh_accelerate_state")
@pytest.mark.parametrize("aux_layers, teacher, prompt_weight", [([], "offline", 0.0), ([0], "online", 0.5)])
def test_the_trainer_distils_a_feature_draft_end_to_end(tmp_path, aux_layers, teacher, prompt_weight):
    """draft=feature through the real loop: reduced head, unrolled steps, held-out tau from the unrolled
    simulation, best/ and final/ that load as feature drafts and decode exactly; offline without an auxiliary
    target layer, online (the target's head on its features) with one and with the prompt positions distilled."""
    import json
    import logging

    from conftest import save_tiny_world

    from train import distill

    ws = save_tiny_world(tmp_path / "ws", target_layers=2, small_seed=7, n_train=24, n_heldout=6)
    cfg = distill.TrainConfig(target=str(ws / "target"), train_data=str(ws / "data"), heldout_data=str(ws / "heldout"),
                              output_dir=str(tmp_path / "run"), device="cpu", draft="feature", draft_layers=[-1],
                              teacher=teacher, draft_vocab_size=40, feature_steps=2, max_steps=12,
                              per_device_batch_size=24, warmup_steps=0, log_every=1, eval_every=6, save_every=6,
                              eval_samples=6, eval_batch_size=3, learning_rate=3e-3, freeze_embeddings=True,
                              feature_aux_layers=aux_layers, prompt_loss_weight=prompt_weight)
    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logger = logging.getLogger("train.distill")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        final = distill.run(cfg)
    finally:
        logger.removeHandler(handler)
    history = [json.loads(line) for line in (tmp_path / "run" / "eval.jsonl").read_text().splitlines()]
    assert [h["step"] for h in history] == [0, 6, 12]
    assert all(1.0 <= h["tau"]["4"] <= 5.0 and 0 <= h["agreement"] <= 1 for h in history)
    # One full batch repeated: the unrolled loss must fall (the loop really optimises the feature draft).
    loss = [float(m.split("loss ")[1].split()[0]) for m in messages if m.startswith("step ") and " loss " in m]
    assert len(loss) == 12 and loss[-1] < 0.8 * loss[0]
    draft = load_model(str(final), dtype="float32", device="cpu")
    assert isinstance(draft, FeatureDraft) and draft.lm_head.out_features == 40 and draft.aux_layers == aux_layers
    assert isinstance(load_model(str(tmp_path / "run" / "best"), dtype="float32", device="cpu"), FeatureDraft)
    target = load_model(str(ws / "target"), dtype="float32", device="cpu")
    ids, mask = ragged_prompts(2, VOCAB, seed=5)
    ref = target_generate(target, ids, mask, max_new_tokens=16)
    assert torch.equal(speculative_generate(target, draft, ids, mask, 3, max_new_tokens=16).sequences, ref.sequences)


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_features_recorded_by_the_data_stage_spare_the_target_forward(tmp_path, monkeypatch):
    """`specdec data record_features=true` -> a feature draft trains and is scored with no target forward for its
    features (the recorded ones are read in); data recorded with other layers, or without features, falls back to
    computing them."""
    import json

    from conftest import save_tiny_world

    from train import distill, feature_train
    from train.data import DataConfig
    from train.data import run as run_data

    ws = save_tiny_world(tmp_path / "ws", target_layers=2, small_seed=7, n_train=2, n_heldout=2)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"explain the sum of {w} and water"}) + "\n"
                               for w in "a city book list food number simple clear water the".split()))
    for folder, limit, record in (("recorded", None, True), ("recorded_heldout", 3, True), ("plain", 4, False)):
        run_data(DataConfig(target=str(ws / "target"), prompts=str(prompts), output_dir=str(tmp_path / folder),
                            max_new_tokens=8, batch_size=4, dtype="float32", device="cpu", limit=limit,
                            record_features=record, feature_aux_layers=[0] if record else []))

    def no_target_forward(*_args, **_kw):
        raise AssertionError("the target ran for features the data stage recorded")

    monkeypatch.setattr(feature_train, "target_features", no_target_forward)
    cfg = distill.TrainConfig(target=str(ws / "target"), train_data=str(tmp_path / "recorded"),
                              heldout_data=str(tmp_path / "recorded_heldout"), output_dir=str(tmp_path / "run"),
                              device="cpu", draft="feature", draft_layers=[-1], teacher="online", feature_steps=2,
                              feature_aux_layers=[0], max_steps=4, per_device_batch_size=4, warmup_steps=0,
                              eval_every=0, save_every=0, eval_samples=3, learning_rate=3e-3)
    distill.run(cfg)
    assert len((tmp_path / "run" / "eval.jsonl").read_text().splitlines()) == 2
    with pytest.raises(AssertionError, match="recorded"):  # other auxiliary layers: the features are computed
        distill.run(dataclasses.replace(cfg, feature_aux_layers=[], output_dir=str(tmp_path / "run2")))
    with pytest.raises(AssertionError, match="recorded"):  # no recorded features: computed as well
        distill.run(dataclasses.replace(cfg, train_data=str(tmp_path / "plain"), output_dir=str(tmp_path / "run3")))


def test_the_online_teachers_restricted_head_gives_the_restricted_full_logits():
    from train import losses
    from train.feature_train import teacher_head

    head = torch.nn.Linear(16, VOCAB, bias=True)
    keep = torch.tensor([0, 2, 5, 9, 64, 127])
    x = torch.randn(7, 16, generator=torch.Generator().manual_seed(0))
    restricted = teacher_head(head, keep)
    assert restricted.out_features == len(keep) and not restricted.weight.requires_grad
    assert torch.allclose(restricted(x), losses.restrict_teacher(head(x), keep), atol=1e-6)
    assert teacher_head(head, None) is head  # a full-vocabulary draft reads the target's head as it is


def test_feature_draft_config_errors():
    from train.distill import TrainConfig

    with pytest.raises(ValueError, match="on_policy"):
        TrainConfig(draft="feature", teacher="on_policy")
    with pytest.raises(ValueError, match="lora"):
        TrainConfig(draft="feature", lora=True)
    with pytest.raises(ValueError, match="feature_aux_layers is for draft=feature"):
        TrainConfig(draft="derived", feature_aux_layers=[1])
    for wrong in ({"draft": "derived"}, {"teacher": "offline"}, {"loss": "ce"}):
        with pytest.raises(ValueError, match="prompt_loss_weight needs draft=feature, teacher=online"):
            TrainConfig(**{"draft": "feature", "teacher": "online", "prompt_loss_weight": 0.5, **wrong})
    with pytest.raises(ValueError, match="prompt_loss_weight must be >= 0"):
        TrainConfig(draft="feature", prompt_loss_weight=-1)


def test_prompt_positions_are_the_prompts_tokens_whose_feature_is_known():
    from train.distill import collate
    from train.feature_train import prompt_positions

    rows = {"input_ids": [[5, 6, 7, 8, 9, 10], [5, 6, 7], [5, 6, 7, 8]], "prompt_length": [3, 3, 4]}
    mask = prompt_positions(collate(rows, pad_id=0, max_length=16))
    # row 0: the completion is predicted from position 2 on; rows 1 and 2 have no completion, and a sequence's
    # last token has no feature (the data stage never feeds it)
    assert mask.tolist() == [[True, True, False, False, False, False], [True, True, False, False, False, False],
                             [True, True, True, False, False, False]]


def test_the_prompt_term_is_the_same_divergence_at_the_prompts_positions(target):
    """feature_loss(w) = feature_loss(0) + w x feature_loss(0) scored at the prompt's positions instead."""
    from train.distill import TrainConfig, collate
    from train.feature_train import feature_loss, prompt_positions, target_features, teacher_head

    draft = FeatureDraft.from_target(target, [-1])
    gen = torch.Generator().manual_seed(3)
    seqs = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (12, 9)]
    batch = collate({"input_ids": seqs, "prompt_length": [5, 4]}, pad_id=0, max_length=32)
    features = target_features(target, batch["input_ids"], batch["attention_mask"])
    head = draft.lm_head
    cfg = TrainConfig(draft="feature", teacher="online", feature_steps=2, feature_regression_weight=0.0)

    def loss(c, b):
        return float(feature_loss(c, draft, head, b, features, teacher_head(target.lm_head, None), None))

    as_completion = {**batch, "loss_mask": prompt_positions(batch)}
    expected = loss(cfg, batch) + 0.25 * loss(cfg, as_completion)
    assert loss(dataclasses.replace(cfg, prompt_loss_weight=0.25), batch) == pytest.approx(expected, rel=1e-5)
    assert loss(cfg, as_completion) > 0  # the prompt term is not empty here


def test_specdec_eval_runs_a_feature_draft_and_predicts_its_tau_exactly(tiny_checkpoints, tmp_path):
    """`specdec eval` with a saved feature draft: exact output, costs timed, and choose_k's unrolled replay
    equal to the decoder's measured tau on the same greedy prompts."""
    import json

    from conftest import tiny_tokenizer

    from specdec.cli import main

    target = load_model(tiny_checkpoints["target"], dtype="float64", device="cpu")
    draft = FeatureDraft.from_target(target, [0, 1])
    with torch.no_grad():  # the target minus its first context token, plus a small feature path: long runs
        draft.fc.weight[:, target.config.hidden_size:].normal_(std=0.05, generator=torch.Generator().manual_seed(1))
    draft.save_pretrained(tmp_path / "fd")
    tiny_tokenizer().save_pretrained(tmp_path / "fd")
    code = main(["eval", "--target", tiny_checkpoints["target"], "--draft", str(tmp_path / "fd"), "--prompts",
                 tiny_checkpoints["prompts"], "--max-new-tokens", "16", "--out", str(tmp_path / "out"),
                 "dtype=float64", "cost_repeats=2", "threads=1", "choose_k=2,3", "choose_k_prompts=4",
                 "num_prompts=4", "warmup=0"])
    assert code == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["equivalence"]["passed"] and report["equivalence"]["mismatches"] == 0
    ck = report["choose_k"]
    assert ck["c"] > 0 and ck["tau"][str(ck["chosen"])] > 1.5
    assert ck["tau"][str(ck["chosen"])] == pytest.approx(report["speculative"]["mean_accepted_tokens"])


def test_feature_cache_computes_once_and_tells_same_ids_with_other_tokens_apart(target):
    import contextlib

    from train.feature_train import FeatureCache, target_features

    cache = FeatureCache(target, contextlib.nullcontext)
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    first = cache(["a", "b"], {"input_ids": ids, "attention_mask": mask})
    torch.testing.assert_close(first[0], target_features(target, ids[:1], mask[:1])[0].float(), atol=1e-2, rtol=1e-2)
    assert len(cache.store) == 2 and first[1, 3].abs().sum() == 0  # padding stays zero
    other = cache(["a"], {"input_ids": torch.tensor([[5, 6, 7, 9]]), "attention_mask": torch.ones(1, 4, dtype=torch.long)})
    assert len(cache.store) == 3 and not torch.equal(other[0, 3], first[0, 3])
    again = cache(["b", "a"], {"input_ids": ids.flip(0), "attention_mask": mask.flip(0)})
    assert len(cache.store) == 3 and torch.equal(again[1], first[0])
