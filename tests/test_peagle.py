"""P-EAGLE drafts (specdec/eagle3/, kind `peagle`): an EAGLE-3 draft proposing a round's k tokens in one forward,
as vLLM's parallel drafting feeds it. The training objective equals the decoder's one forward; decoding is exact
(greedy token-identical, sampled distributed as the target); replay, save/load and publishing."""

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from conftest import ragged_prompts, tiny_llama
from draft_checks import fit, greedy_outputs_equal_the_target, replay_predicts_every_round, run_logging_losses

from specdec import SamplingConfig, draft_registry, speculative_generate, target_generate
from specdec.eagle3 import Eagle3Draft
from specdec.eval import verify as verify_cmd
from specdec.models import load_model
from specdec.proposal import Proposal
from specdec.replay import target_states

VOCAB = 128
EOS = 2
PTD = 3  # the mask token
LAYERS = [1, 2, 3]


@pytest.fixture(scope="module")
def target4():
    return tiny_llama(seed=0, layers=4)


@pytest.fixture(scope="module")
def random_draft(target4):
    return Eagle3Draft.from_target(target4, LAYERS, seed=3, ptd_token_id=PTD).eval()


def fitted_draft(target, steps: int = 120, k: int = 4) -> Eagle3Draft:
    """A P-EAGLE draft fitted (cross-entropy, the parallel objective over k proposals) to the target's greedy
    continuations of a few prompts: it then agrees often there, so decoding them accepts long runs."""
    draft = Eagle3Draft.from_target(target, LAYERS, seed=0, ptd_token_id=PTD)
    prompts = ragged_prompts(6, VOCAB, seed=21, min_len=6, max_len=6)[0]
    seq = target_generate(target, prompts, max_new_tokens=40).sequences
    mask = torch.ones_like(seq)
    states = target_states(draft, target, seq, mask)
    labels = seq[:, 2:]  # draft position t proposes token t + 2

    def loss():
        outs = draft(seq, states, attention_mask=mask, ttt_steps=k)
        return sum(F.cross_entropy(draft.logits(out[:, j:-1]).flatten(0, 1), labels[:, j:].flatten())
                   for j, out in enumerate(outs))

    return fit(draft, loss, steps)


@pytest.fixture(scope="module")
def good_draft(target4):
    return fitted_draft(target4)


def test_it_is_its_own_kind_and_costs_one_forward_a_round(random_draft, target4):
    kind = draft_registry.of_model(random_draft)
    assert kind.name == "peagle" and kind.draft_forwards(Proposal.chain(5)) == 1
    assert kind.vllm_speculative_config(random_draft) == {"parallel_drafting": True}
    chain = Eagle3Draft.from_target(target4, LAYERS, seed=3)
    assert draft_registry.of_model(chain).name == "eagle3"
    assert draft_registry.of_model(chain).draft_forwards(Proposal.chain(5)) == 5


def test_the_parallel_objective_equals_the_decoders_one_forward(target4, good_draft):
    """Step j of the training objective at position t is the j-th proposal of the round whose last true position
    is t - (j - 1): the same pre-norm output as one cached forward of the true positions and j - 1 masked slots."""
    from transformers import DynamicCache

    seq = target_generate(target4, torch.tensor([[5, 17, 33, 8, 91]]), max_new_tokens=14).sequences
    mask = torch.ones_like(seq)
    k = 4
    with torch.no_grad():
        states = target_states(good_draft, target4, seq, mask)
        outs = good_draft.unrolled(seq, states, mask, k)
        width = good_draft.mask_hidden.numel()
        for s in range(0, seq.shape[1] - k - 1):
            cache = DynamicCache(config=good_draft.config)
            ids = torch.cat([seq[:, 1:s + 2], torch.full((1, k - 1), PTD)], dim=1)
            hidden = torch.cat([states[:, :s + 1], good_draft.mask_hidden.expand(1, k - 1, width)], dim=1)
            out, _ = good_draft(ids, hidden, torch.arange(s + k)[None], True, cache)
            for j in range(1, k + 1):
                torch.testing.assert_close(out[0, s + j - 1], outs[j - 1][0, s + j - 1], rtol=1e-4, atol=1e-4,
                                           msg=lambda m, s=s, j=j: f"position {s}, proposal {j}: {m}")


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("k", [1, 3, 6])
@pytest.mark.parametrize("which", ["random", "fitted"])
def test_greedy_output_equals_the_target_alone(target4, random_draft, good_draft, which, batch, k):
    draft = random_draft if which == "random" else good_draft
    outputs = greedy_outputs_equal_the_target(target4, draft, batch, k, VOCAB, EOS)
    assert all(out.stats.draft_forwards == out.stats.rounds for out in outputs)  # one forward a round


def test_a_fitted_draft_accepts_long_runs_and_the_replay_predicts_each_round(target4, good_draft):
    """The replay (choose_k's tau) computes the parallel proposal: on the target's own greedy output it gives
    every round's accepted count of the real decoder."""
    prompts = ragged_prompts(6, VOCAB, seed=21, min_len=6, max_len=6)[0][:1]
    k, new = 4, 48
    out, _ = replay_predicts_every_round(target4, good_draft, prompts, k, new)
    assert max(int(r.num_accepted[0]) for r in out.trace) >= 3


def test_it_proposes_no_trees(target4, random_draft):
    ids = torch.tensor([[5, 6, 7]])
    out = speculative_generate(target4, random_draft, ids, tree="2x1", max_new_tokens=4)
    assert out.stats.fallback and "tree" in (out.stats.fallback_reason or "")


ALPHA = 1e-3
SMALL_VOCAB, M = 16, 3
SAMPLINGS = [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.7, top_p=0.9)]


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["t1.0", "t0.7-p0.9"])
def test_sampled_decoding_is_distributed_as_the_target(sampling):
    """The joint of the first three tokens (several rounds of k = 3, each position picked from its own q, a
    reduced draft vocabulary) against the target's exact law: chi-square at ALPHA (seeded, so deterministic)."""
    target = tiny_llama(seed=0, vocab_size=SMALL_VOCAB, hidden=16, dtype=torch.float32)
    draft = Eagle3Draft.from_target(target, [1], keep_ids=torch.tensor([0, 2, 3, 5, 8, 9, 12, 15]), seed=5,
                                    ptd_token_id=1)
    with torch.no_grad():  # a draft that is neither uniform nor the target: rejections and bonus tokens both happen
        draft.fc.weight.normal_(std=0.5, generator=torch.Generator().manual_seed(0))
        draft.mask_hidden.normal_(std=1.0, generator=torch.Generator().manual_seed(1))
    prompt = [3, 4, 5]
    g = torch.Generator().manual_seed(11)
    ids = torch.tensor([prompt] * 2000)
    counts = torch.zeros(SMALL_VOCAB ** M, dtype=torch.long)
    accepted = 0
    for _ in range(8):
        out = speculative_generate(target, draft, ids, num_draft_tokens=3, sampling=sampling, max_new_tokens=M + 1,
                                   generator=g)
        first = out.sequences[:, len(prompt): len(prompt) + M]
        counts += torch.bincount((first * torch.tensor([SMALL_VOCAB ** 2, SMALL_VOCAB, 1])).sum(1),
                                 minlength=SMALL_VOCAB ** M)
        accepted += out.stats.accepted
    exact = verify_cmd.exact_joint(target, torch.tensor(prompt), M, sampling)
    fit = verify_cmd.goodness_of_fit(counts, exact)
    assert accepted > 0 and not fit["impossible_samples"]
    assert verify_cmd.chi2_sf(fit["chi2"], fit["dof"]) > ALPHA


@pytest.mark.parametrize("format", ["engines", "speculators"])
def test_save_load_round_trip_is_exact(target4, good_draft, tmp_path, format):
    from specdec.draft_kind import PublishContext

    kind = draft_registry.of_model(good_draft)
    kind.save(good_draft, tmp_path, format, PublishContext(verifier=lambda: "tiny/target", num_draft_tokens=4))
    config = json.loads((tmp_path / "config.json").read_text())
    if format == "engines":  # what vLLM's eagle3 path reads for parallel drafting
        assert config["ptd_token_id"] == PTD and config["parallel_drafting"] is True
    else:
        assert config["speculators_model_type"] == "peagle" and config["mask_token_id"] == PTD
    assert draft_registry.of_checkpoint(tmp_path).name == "peagle"
    loaded = load_model(str(tmp_path), dtype="float32", device="cpu")
    assert isinstance(loaded, Eagle3Draft) and loaded.parallel and loaded.ptd_token_id == PTD
    reference = copy.deepcopy(good_draft).to(loaded.dtype)  # loaded as float32
    assert torch.equal(loaded.mask_hidden, reference.mask_hidden)
    ids = torch.tensor([[5, 17, 33, 8]])
    target = copy.deepcopy(target4).to(loaded.dtype)
    ref = speculative_generate(target, reference, ids, num_draft_tokens=4, max_new_tokens=20)
    out = speculative_generate(target, loaded, ids, num_draft_tokens=4, max_new_tokens=20)
    assert torch.equal(out.sequences, ref.sequences) and out.stats.accepted == ref.stats.accepted


@pytest.mark.usefixtures("fresh_accelerate_state")
@pytest.mark.parametrize("teacher, pack", [("offline", False), ("online", True)])
def test_the_trainer_distils_a_peagle_draft_end_to_end(tmp_path, teacher, pack):
    """draft=peagle through the real loop (reduced head, packing, the parallel objective over 3 proposals): the
    loss falls on one repeated batch, the held-out tau comes from the parallel replay, and final/ loads as a
    P-EAGLE draft with the configured mask token and decodes exactly."""
    from conftest import save_tiny_world

    from specdec.train import distill

    ws = save_tiny_world(tmp_path / "ws", target_layers=4, small_seed=7, n_train=24, n_heldout=6)
    cfg = distill.TrainConfig(target=str(ws / "target"), train_data=str(ws / "data"), heldout_data=str(ws / "heldout"),
                              output_dir=str(tmp_path / "run"), device="cpu", draft="peagle", teacher=teacher,
                              eagle_aux_layer_ids=LAYERS, draft_vocab_size=40, ttt_steps=3, ptd_token_id=PTD,
                              max_steps=12, per_device_batch_size=24, warmup_steps=0, log_every=1, eval_every=6,
                              save_every=6, eval_samples=6, eval_batch_size=3, learning_rate=3e-3, pack=pack)
    final, history, loss = run_logging_losses(cfg, tmp_path / "run")
    assert [h["step"] for h in history] == [0, 6, 12]
    assert all(1.0 <= h["tau"]["4"] <= 5.0 for h in history)
    assert len(loss) == 12 and loss[-1] < 0.8 * loss[0]
    draft = load_model(str(final), dtype="float32", device="cpu")
    assert isinstance(draft, Eagle3Draft) and draft.parallel and draft.ptd_token_id == PTD
    assert draft_registry.of_model(draft).name == "peagle"
    target = load_model(str(ws / "target"), dtype="float32", device="cpu")
    ids, mask = ragged_prompts(2, VOCAB, seed=5)
    ref = target_generate(target, ids, mask, max_new_tokens=16)
    assert torch.equal(speculative_generate(target, draft, ids, mask, 3, max_new_tokens=16).sequences, ref.sequences)


def test_the_mask_token_defaults_to_the_tokenizers_pad_then_eos():
    from types import SimpleNamespace

    from specdec.train.eagle3_train import mask_token_id

    target = SimpleNamespace(config=SimpleNamespace(eos_token_id=None))
    assert mask_token_id(7, SimpleNamespace(pad_token_id=0, eos_token_id=2), target) == 7
    assert mask_token_id(-1, SimpleNamespace(pad_token_id=0, eos_token_id=2), target) == 0
    assert mask_token_id(-1, SimpleNamespace(pad_token_id=None, eos_token_id=2), target) == 2
    with pytest.raises(ValueError, match="ptd_token_id"):
        mask_token_id(-1, SimpleNamespace(pad_token_id=None, eos_token_id=None), target)


def test_speculators_peagle_class_loads_the_export_and_computes_specdecs_logits(tmp_path, monkeypatch):
    """The published speculators layout loads in speculators 0.9.0's own `PEagleDraftModel` (an independent
    implementation) and, on fixed inputs, its logits at every position of every depth equal specdec's parallel
    objective's. Its training forward samples the (anchor, depth) pairs at random (COD sampling): here they are
    fixed to all of them."""
    pytest.importorskip("speculators.models.peagle", reason="speculators 0.9.0 is not installed")
    import speculators.models.peagle.core as peagle_core
    from conftest import tiny_tokenizer
    from speculators.losses import resolve_loss_config
    from speculators.models.peagle import PEagleDraftModel, PEagleSpeculatorConfig

    from specdec.models import save_model
    from specdec.train import publish as pub

    target = tiny_llama(seed=0, layers=4, dtype=torch.float32)
    save_model(target, tiny_tokenizer(), tmp_path / "target")
    keep = torch.cat([torch.arange(4), 4 + torch.randperm(124, generator=torch.Generator().manual_seed(1))[:60]])
    draft = Eagle3Draft.from_target(target, LAYERS, keep, seed=1, ptd_token_id=PTD).float()
    with torch.no_grad():
        draft.mask_hidden.normal_(generator=torch.Generator().manual_seed(2))
    save_model(draft, tiny_tokenizer(), tmp_path / "draft")
    folder = pub.publish(pub.PublishConfig(draft=str(tmp_path / "draft"), out=str(tmp_path / "published"),
                                           target=str(tmp_path / "target"), format="speculators"))
    ids, k = torch.tensor([[1, 17, 42, 99, 5, 63, 7, 92, 53, 71, 4, 83, 14, 117]]), 3
    with torch.no_grad():
        states = target_states(draft, target, ids, torch.ones_like(ids))
        outs = draft.unrolled(ids, states, torch.ones_like(ids), k)
    t = ids.shape[1] - 1
    mine = torch.cat([draft.logits(outs[d][0, d:t]) for d in range(k)])  # depth d at anchor a: position a + d
    anchors = [torch.arange(t - d) for d in range(k)]
    monkeypatch.setattr(peagle_core, "generate_cod_sample_indices", lambda **_: (
        torch.cat(anchors), torch.cat([torch.full((len(a),), d) for d, a in enumerate(anchors)])))
    config = PEagleSpeculatorConfig.from_pretrained(str(folder))
    config.transformer_layer_config._attn_implementation = "eager"  # its flex default fails on a CPU
    model = PEagleDraftModel.from_pretrained(str(folder), config=config).eval().float()
    captured = {}
    model.lm_head.register_forward_hook(lambda _m, _i, out: captured.setdefault("logits", out))
    with torch.no_grad():
        model(hidden_states=states[:, :-1], input_ids=ids[:, 1:], document_ids=torch.zeros(1, t, dtype=torch.long),
              verifier_last_hidden_states=torch.zeros(1, t, target.config.hidden_size), num_depths=k,
              loss_config=resolve_loss_config("kl_div", "eager"))
    assert model.mask_token_id == PTD and torch.equal(model.mask_hidden.reshape(-1), draft.mask_hidden)
    torch.testing.assert_close(captured["logits"][0], mine, rtol=1e-4, atol=1e-4)
    # the masked slots matter: without mask_hidden (zeros) the later depths differ
    with torch.no_grad():
        draft.mask_hidden.zero_()
        outs = draft.unrolled(ids, states, torch.ones_like(ids), k)
    assert not torch.allclose(draft.logits(outs[1][0, 1:t]), mine[t:2 * t - 1], atol=1e-3)


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_peagle_in_two_processes_trains_exactly_as_one(tmp_path, caplog):
    """draft=peagle under `accelerate launch` with two gloo processes equals one process at the same global batch
    (float32, as tests/test_train.py proves for EAGLE-3): per-step losses and final weights, mask_hidden included."""
    from conftest import save_tiny_world
    from test_train import two_processes_train_as_one

    workspace = save_tiny_world(tmp_path / "ws", target_layers=2, small_seed=7, n_train=24, n_heldout=6)
    train = dict(draft="peagle", eagle_aux_layer_ids=[1], draft_vocab_size=40, teacher="online", ttt_steps=3,
                 ptd_token_id=PTD, max_steps=3, eval_every=0, save_every=0, learning_rate=1e-2, max_grad_norm=0.5,
                 mixed_precision="no")
    two, _ = two_processes_train_as_one(workspace, tmp_path, caplog, train)
    assert "mask_hidden" in two
