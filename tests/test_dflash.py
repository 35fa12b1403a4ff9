"""DFlash drafts (specdec/dflash/): the computation, exact decoding (greedy and sampled), one draft forward a
round, the replay equal to the decoder, both layouts (speculators' own class reads its one), and training."""

import pytest
import torch
import torch.nn.functional as F
from conftest import ragged_prompts, tiny_llama
from draft_checks import draft_ids, fit, greedy_outputs_equal_the_target, replay_predicts_every_round

from specdec import speculative_generate, target_generate
from specdec.dflash import DFlashDraft
from specdec.draft_registry import get, of_checkpoint
from specdec.proposal import Proposal

VOCAB = 128
EOS = 2
LAYERS = [1, 2, 3]  # of a 4-layer target
BLOCK = 4


@pytest.fixture(scope="module")
def target4():
    return tiny_llama(seed=0, layers=4)


@pytest.fixture(scope="module")
def random_draft(target4):
    return DFlashDraft.from_target(target4, LAYERS, num_layers=2, block_size=BLOCK, seed=3).eval()


def fitted_draft(target, keep_ids=None, steps: int = 150, layers=LAYERS, vocab: int = VOCAB,
                 sampling=None) -> DFlashDraft:
    """A draft fitted (cross-entropy at every anchor) to the target's continuations (greedy unless `sampling`)
    of a few prompts, so that decoding them accepts long runs and whole blocks."""
    from specdec.eagle3 import target_states

    draft = DFlashDraft.from_target(target, layers, keep_ids, num_layers=1, block_size=BLOCK, seed=0)
    prompts = ragged_prompts(6, vocab, seed=21, min_len=6, max_len=6)[0]
    options = {} if sampling is None else {"sampling": sampling, "generator": torch.Generator().manual_seed(0)}
    seq = target_generate(target, prompts, max_new_tokens=30, **options).sequences
    states = target_states(target, seq, torch.ones_like(seq), layers)
    anchors = torch.arange(seq.shape[1] - BLOCK)[None].expand(seq.shape[0], -1)
    labels = seq.gather(1, (anchors[..., None] + torch.arange(BLOCK)).flatten(1)).view(*anchors.shape, BLOCK)
    local = draft_ids(draft, vocab)[labels[..., 1:]]

    def loss():
        logits = draft(seq, states, anchors)[:, :, 1:]
        return F.cross_entropy(logits[local >= 0], local[local >= 0])

    return fit(draft, loss, steps)


@pytest.fixture(scope="module")
def good_draft(target4):
    return fitted_draft(target4)


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("which", ["random", "fitted"])
def test_greedy_output_equals_the_target_alone(target4, random_draft, good_draft, which, batch, k):
    draft = random_draft if which == "random" else good_draft
    greedy_outputs_equal_the_target(target4, draft, batch, k, VOCAB, EOS)


def test_a_round_is_one_draft_forward_and_a_fitted_draft_accepts_blocks(target4, good_draft):
    prompts = ragged_prompts(6, VOCAB, seed=21, min_len=6, max_len=6)[0]
    ref = target_generate(target4, prompts, max_new_tokens=30)
    out = speculative_generate(target4, good_draft, prompts, num_draft_tokens=3, max_new_tokens=30)
    assert torch.equal(out.sequences, ref.sequences)
    assert out.stats.acceptance_rate > 0.5 and out.stats.bonus > 0
    assert out.stats.draft_forwards == out.stats.rounds
    assert get("dflash").draft_forwards(Proposal.chain(5)) == 1


def test_replayed_runs_match_the_decoders_rounds(target4, good_draft):
    """The held-out replay is exact: on the target's own greedy output it predicts every round's accepted count
    of the real decoder (specdec/replay.py through the kind's block replay)."""
    prompts = ragged_prompts(6, VOCAB, seed=21, min_len=6, max_len=6)[0][:1]
    k, new = 3, 46  # fitted on 30 tokens: the rest makes it miss too
    out, runs = replay_predicts_every_round(target4, good_draft, prompts, k, new)
    assert max(int(r.num_accepted[0]) for r in out.trace) == k and min(runs) == 0


def test_save_load_round_trip_is_exact_and_the_config_is_vllms(target4, random_draft, tmp_path):
    import json

    get("dflash").save(random_draft, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"] == {"mask_token_id": VOCAB - 1, "target_layer_ids": [0, 1, 2]}
    assert config["block_size"] == BLOCK and config["num_hidden_layers"] == 2
    assert of_checkpoint(tmp_path).name == "dflash"
    loaded = get("dflash").load(str(tmp_path), torch.float64)
    assert loaded.layer_ids == LAYERS
    ids = torch.tensor([[5, 17, 33, 8, 91, 40, 7, 9]])
    from specdec.eagle3 import target_states

    with torch.no_grad():
        states = target_states(target4, ids, torch.ones_like(ids), LAYERS)
        anchors = torch.tensor([[1, 3]])
        torch.testing.assert_close(loaded(ids, states, anchors), random_draft(ids, states, anchors), rtol=0, atol=0)


@pytest.mark.parametrize("sampling", [dict(temperature=1.0), dict(temperature=0.7, top_k=6, top_p=0.9)])
def test_sampled_output_follows_the_targets_exact_law(sampling):
    """Under sampling, a round's k tokens and each slot's own q [B, k, V] (one forward) through the rejection
    sampler give the target's law: the first 3 tokens' joint law against the exact one, and the target alone's
    samples (specdec/eval/verify.py's statistical check, as for chains)."""
    from specdec.eval.verify import (
        _encode,
        exact_joint,
        goodness_of_fit,
        homogeneity,
        judge,
        sample_tokens,
        tiny_pair,
    )
    from specdec.sampling import SamplingConfig

    target, _ = tiny_pair(vocab_size=8, seed=0, head_scale=6.0)  # p spread enough that q matters
    config = SamplingConfig(**sampling)
    # fitted to the target's samples: often accepted, often not, each slot's q its own
    draft = fitted_draft(target, steps=60, layers=[1], vocab=8, sampling=config)
    prompt = torch.tensor([3, 1, 4, 1, 5])
    exact = exact_joint(target, prompt, 3, config)
    counts = {}
    for mode in ("speculative", "target-only"):
        g = torch.Generator().manual_seed(7)
        toks = sample_tokens(mode, target, draft, prompt, 3, config, 3, 4000, 500, g)
        counts[mode] = torch.bincount(_encode(toks, 8), minlength=exact.numel())
    assert judge(goodness_of_fit(counts["speculative"], exact), 1e-3)["passed"]
    assert judge(homogeneity(counts["speculative"], counts["target-only"]), 1e-3)["passed"]


def test_the_slot_weights_and_the_anchored_targets():
    from specdec.train.dflash_train import block_targets, choose_anchors, slot_weights

    w = slot_weights(4, 7.0)
    assert w[0] == 0 and w[1] == 1 and torch.allclose(w[2:], torch.tensor([torch.e ** (-1 / 7), torch.e ** (-2 / 7)]))
    ids = torch.tensor([[1, 5, 6, 7, 8, 9, 0], [1, 4, 3, 2, 0, 0, 0]])
    loss_mask = torch.tensor([[0, 1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0, 0]], dtype=torch.bool)
    batch = {"input_ids": ids, "loss_mask": loss_mask, "labels": ids.roll(-1, 1), "attention_mask": ids > 0}
    anchors = choose_anchors(batch, 3, 4, seed=0)
    assert torch.equal(anchors, choose_anchors(batch, 3, 4, seed=0))  # the same draw for counts and loss
    assert all(loss_mask[b, a] for b in range(2) for a in anchors[b].tolist() if a >= 0)
    predictor, local, scored = block_targets(batch, torch.tensor([[1], [2]]), 4, None, 128)
    assert predictor[0, 0].tolist() == [0, 1, 2, 3] and local[0, 0, 1:].tolist() == [6, 7, 8]
    assert scored[0, 0].tolist() == [False, True, True, True]  # the anchor slot is never trained
    assert scored[1, 0].tolist() == [False, True, False, False]  # the completion ends after token 3


def test_many_blocks_attend_in_groups_exactly_as_in_one_call(target4, random_draft, monkeypatch):
    """Training's forward over many anchors attends in groups of whole blocks (attention_group): the logits and
    the gradients equal one attention call over every block's slots."""
    from specdec.dflash import model
    from specdec.eagle3 import target_states

    assert model.attention_group(context=40, anchors=30, block_size=BLOCK) == 64
    assert model.attention_group(context=1000, anchors=300, block_size=3) == 501  # half the context, whole blocks
    assert model.attention_group(context=40, anchors=5, block_size=BLOCK) == 20  # never more than every block
    ids = ragged_prompts(2, VOCAB, seed=8, min_len=40, max_len=40)[0]
    mask = torch.ones_like(ids)
    states = target_states(target4, ids, mask, LAYERS)
    anchors = torch.stack([torch.randperm(39, generator=torch.Generator().manual_seed(r))[:30].sort().values
                           for r in range(2)])
    anchors[1, -3:] = -1  # rows with fewer anchors

    def logits_and_grads():
        random_draft.zero_grad()
        logits = random_draft(ids, states, anchors, mask)
        logits.square().sum().backward()
        return logits, [p.grad.clone() for p in random_draft.parameters() if p.grad is not None]

    grouped = logits_and_grads()  # 120 slots a row: groups of 64 and 56
    monkeypatch.setattr(model, "attention_group", lambda context, anchors, block_size: anchors * block_size)
    one_call = logits_and_grads()
    random_draft.zero_grad()
    torch.testing.assert_close(grouped[0], one_call[0])
    assert len(grouped[1]) == len(one_call[1]) > 0
    for a, b in zip(grouped[1], one_call[1]):
        torch.testing.assert_close(a, b)


def test_a_groups_mask_is_built_for_it_alone_and_not_kept_for_backward(target4, random_draft, monkeypatch):
    """The slots' attention mask stays compact ([B, A, S], AnchoredMask): a group's dense part equals the whole
    mask's slice for those slots, and no group's dense mask outlives the forward (each is rebuilt in backward)."""
    import gc
    import weakref

    from specdec.dflash import model
    from specdec.eagle3 import target_states

    ids = ragged_prompts(2, VOCAB, seed=8, min_len=40, max_len=40)[0]
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # a left-padded row
    anchors = torch.stack([torch.randperm(39, generator=torch.Generator().manual_seed(r))[:30].sort().values
                           for r in range(2)])
    anchors[1, -3:] = -1
    allowed = model.anchored_mask(anchors, torch.zeros_like(ids), mask, BLOCK)
    whole, n_context = allowed.dense(), ids.shape[1]
    assert whole.shape == (2, 1, 30 * BLOCK, n_context + 30 * BLOCK) and allowed.dense() is whole
    for start, stop in ((0, 64), (64, 120), (8, 12)):
        torch.testing.assert_close(allowed.dense(start, stop), torch.cat(
            [whole[..., start:stop, :n_context], whole[..., start:stop, n_context + start:n_context + stop]], -1))

    built = []
    dense = model.AnchoredMask.dense

    def recorded(self, start=0, stop=None):
        out = dense(self, start, stop)
        built.append(weakref.ref(out))
        return out

    monkeypatch.setattr(model.AnchoredMask, "dense", recorded)
    states = target_states(target4, ids, mask, LAYERS)
    logits = random_draft(ids, states, anchors, mask)  # 120 slots a row: groups of 64 and 56, 2 layers
    assert len(built) == 2 * 2
    gc.collect()
    assert [ref() for ref in built] == [None] * 4
    logits.square().sum().backward()
    assert len(built) == 2 * 4  # each group's mask built again in backward
    random_draft.zero_grad()


@pytest.mark.parametrize("teacher", ["online", "top-n"])
@pytest.mark.parametrize("chunk", [5, 4096])
def test_the_loss_reads_each_predicting_positions_teacher_once_and_equals_a_slot_by_slot_sum(
        target4, random_draft, teacher, chunk, monkeypatch):
    """Overlapping blocks predict from one position at several slots: the teacher's head runs once a position
    (per chunk), and the loss and its gradients equal the slot-by-slot sum of the configured loss."""
    from specdec.eagle3 import target_states
    from specdec.train import dflash_train, losses
    from specdec.train.distill import TrainConfig

    cfg = TrainConfig(draft="dflash", loss="fkl", ce_weight=0.5, dflash={"block_size": BLOCK, "loss_decay": 2.0})
    ids = ragged_prompts(2, VOCAB, seed=5, min_len=12, max_len=12)[0]
    mask = torch.ones_like(ids, dtype=torch.bool)
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.roll(-1, 1),
             "loss_mask": torch.arange(12)[None].expand(2, -1) >= 3}
    h = target4.config.hidden_size
    states = torch.cat([torch.randn(2, 12, h, generator=torch.Generator().manual_seed(1)),  # the final states
                        target_states(target4, ids, mask, LAYERS)], -1)
    head = target4.lm_head
    if teacher == "top-n":
        logprobs = torch.log_softmax(head(states[..., :h]), -1).topk(6, dim=-1)
        batch["top_ids"], batch["top_logprobs"] = logprobs.indices, logprobs.values
        head = None
    anchors = dflash_train.choose_anchors(batch, 9, BLOCK, seed=0)  # every eligible position
    rows_seen = []
    if head is not None:
        monkeypatch.setattr(head, "forward", lambda x, f=head.forward: rows_seen.append(x.shape[0]) or f(x))
    monkeypatch.setattr(dflash_train, "loss_chunk_rows", lambda vocab: chunk)
    draft = random_draft
    loss = dflash_train.dflash_loss(cfg, draft, batch, states, head, None, anchors)
    grads = torch.autograd.grad(loss, [draft.fc.weight])
    teacher_rows = sum(rows_seen)  # counted before the reference below runs the head itself

    predictor, local, scored = dflash_train.block_targets(batch, anchors, BLOCK, None, VOCAB)
    weights = dflash_train.slot_weights(BLOCK, 2.0).expand_as(scored)
    hiddens = draft(ids, states[..., h:], anchors, mask, head=False)
    reference = 0.0
    for b, a, j in scored.nonzero().tolist():
        student = draft.lm_head(hiddens[b, a, j])[None]
        at = predictor[b, a, j]
        dense = (target4.lm_head(states[b, at, :h]) if teacher == "online"
                 else losses.dense_teacher_logits(batch["top_ids"][b, at], batch["top_logprobs"][b, at], VOCAB))
        reference = reference + weights[b, a, j] * losses.configured_loss(cfg, student, dense[None],
                                                                           local[b, a, j][None], summed=True)
    reference = reference / weights[scored].sum()
    torch.testing.assert_close(loss, reference, check_dtype=False)
    torch.testing.assert_close(grads[0], torch.autograd.grad(reference, [draft.fc.weight])[0], check_dtype=False)
    if head is not None:  # each chunk's distinct predicting positions, once (twice when recomputed in backward)
        flat = (torch.arange(2)[:, None, None] * 12 + predictor)[scored]
        count = flat.numel()
        distinct = sum(flat[i:i + chunk].unique().numel() for i in range(0, count, chunk))
        assert teacher_rows == distinct * (2 if count > chunk else 1)
        if count <= chunk:  # one chunk: blocks of 4 overlap, and most positions predict at several slots
            assert distinct < count / 2


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_dflash_trains_plans_replays_and_publishes(tmp_path, capsys):
    import json

    from conftest import save_tiny_world

    from specdec.models import load_model
    from specdec.train import distill, plan
    from specdec.train import publish as pub

    ws = save_tiny_world(tmp_path / "ws", target_layers=4, small_seed=3, n_train=8, n_heldout=4)
    cfg = distill.TrainConfig(draft="dflash", target=str(ws / "target"), train_data=str(ws / "data"),
                              heldout_data=str(ws / "heldout"), output_dir=str(tmp_path / "run"), device="cpu",
                              max_steps=3, per_device_batch_size=2, warmup_steps=1, eval_every=0, save_every=0,
                              eval_samples=4, eval_batch_size=2, data_workers=0, learning_rate=3e-3,
                              dflash={"block_size": 4, "num_anchors": 6, "dflash_layer_ids": LAYERS,
                                      "dflash_layers": 1, "loss_decay": 4.0}, states="online", pack=True)
    plan_text = plan.plan_run(cfg, plan.target_config(cfg.target), device_type="cpu", mixed_precision="no").render()
    assert "activations" in plan_text and "target states" in plan_text
    final = distill.run(cfg)
    summary = json.loads((tmp_path / "run" / "train_summary.json").read_text())
    assert summary["steps"] == 3
    assert json.loads((tmp_path / "run" / "eval.jsonl").read_text().splitlines()[-1])["positions"] > 0  # replayed
    trained = load_model(str(final), dtype="float32", device="cpu")
    assert isinstance(trained, DFlashDraft) and trained.block_size == 4 and trained.layer_ids == LAYERS
    target = load_model(str(ws / "target"), dtype="float32", device="cpu")
    fresh = DFlashDraft.from_target(target, LAYERS, num_layers=1, block_size=4, seed=cfg.seed)
    assert not torch.equal(trained.fc.weight, fresh.fc.weight.float())  # it trained
    torch.testing.assert_close(trained.lm_head.weight, target.lm_head.weight[trained.kept_ids()])  # frozen
    out = pub.publish(pub.PublishConfig(draft=str(final), out=str(tmp_path / "pub"), target=str(ws / "target")))
    assert '"method": "dflash"' in (out / "README.md").read_text()
    assert json.loads((out / "config.json").read_text())["architectures"] == ["DFlashDraftModel"]


def test_speculators_own_dflash_class_computes_the_published_drafts_logits(tmp_path, monkeypatch):
    """format=speculators loads in speculators 0.9's `DFlashDraftModel` (an independent implementation, its eager
    attention on the CPU) and gives specdec's logits for the same anchored blocks; the target's states in another
    layer order change them (so the comparison can fail)."""
    core = pytest.importorskip("speculators.models.dflash.core", reason="speculators 0.9.0 is not installed")
    from conftest import tiny_tokenizer

    from specdec.draft_kind import PublishContext
    from specdec.eagle3 import target_states
    from specdec.models import save_model

    target = tiny_llama(seed=0, layers=4, dtype=torch.float32)
    save_model(target, tiny_tokenizer(), tmp_path / "target")  # speculators reads the verifier's embeddings
    keep = torch.cat([torch.arange(4), 4 + torch.randperm(124, generator=torch.Generator().manual_seed(1))[:60]])
    draft = DFlashDraft.from_target(target, LAYERS, keep, num_layers=2, block_size=BLOCK, seed=3).float().eval()
    get("dflash").save(draft, tmp_path / "spec", "speculators", PublishContext(lambda: str(tmp_path / "target"), 3))
    config = core.DFlashSpeculatorConfig.from_pretrained(str(tmp_path / "spec"))
    assert config.aux_hidden_state_layer_ids == LAYERS and config.block_size == BLOCK
    # vLLM reads false as causal attention inside the block (dflash_config.causal): the draft attends both ways
    assert config.sliding_window_non_causal is True and config.sample_from_anchor is False
    assert of_checkpoint(tmp_path / "spec").name == "dflash"
    assert get("dflash").load(str(tmp_path / "spec"), torch.float32).layer_ids == LAYERS
    config.transformer_layer_config._attn_implementation = "eager"
    theirs_model = core.DFlashDraftModel.from_pretrained(str(tmp_path / "spec"), config=config).eval().float()
    ids = torch.tensor([[1, 17, 42, 99, 5, 63, 7, 92, 53, 71, 4, 83, 14, 117]])
    anchors = torch.tensor([2, 5, 9])
    monkeypatch.setattr(core, "select_anchors", lambda *_: (anchors, torch.ones(3, dtype=torch.bool)))
    with torch.no_grad():
        states = target_states(target, ids, torch.ones_like(ids), LAYERS)
        mine = draft(ids, states, anchors[None])[0]
        s = ids.shape[1]
        theirs = theirs_model._backbone_forward(states, ids, torch.ones_like(ids), torch.zeros(1, s, 32),
                                                torch.zeros(1, s, dtype=torch.long), max_anchors=3)[1]
        torch.testing.assert_close(theirs[0].view(3, BLOCK, -1), mine, rtol=1e-4, atol=1e-4)
        assert torch.equal(theirs_model.d2t, draft.d2t)
        other = torch.cat(states.chunk(3, dim=-1)[::-1], dim=-1)
        assert not torch.allclose(draft(ids, other, anchors[None])[0], mine, atol=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama3.1-8b-dflash.yaml", "qwen3-8b-dflash.yaml"])
def test_the_8b_recipe_runs_end_to_end_on_a_tiny_target_of_its_architecture(name, tmp_path):
    """data -> held-out data -> train -> eval -> publish through the CLI with the recipe's settings, over a seeded
    random target of its architecture (tests/test_recipes_8b.py's stand-ins), a few steps."""
    import json
    from pathlib import Path

    from test_recipes_8b import TARGETS, _cli, _reset_accelerate, _save_target, _write_prompts

    from specdec.config import read_recipe

    recipe_path = Path(__file__).resolve().parents[1] / "recipes" / name
    build = TARGETS[name.replace("dflash", "eagle3")]
    target = _save_target(build, tmp_path / "target")
    prompts, out = _write_prompts(tmp_path), tmp_path / "run"
    config, shared = ["--config", str(recipe_path)], [f"target={target}", "device=cpu", "dtype=float32"]
    data = [*shared, "column_map=null", "backend=transformers", "max_new_tokens=24", "batch_size=8"]
    _cli("data", *config, *data, f"prompts={prompts['train']}", f"output_dir={out / 'data'}")
    _cli("data", *config, *data, f"prompts={prompts['heldout']}", f"output_dir={out / 'data_heldout'}")
    try:
        _cli("train", *config, *shared, f"output_dir={out}", "max_steps=4", "learning_rate=3e-3", "warmup_steps=1",
             "eval_every=0", "save_every=0", "eval_samples=4", "per_device_batch_size=4", "max_length=64",
             "draft_vocab_size=64", f"dflash.dflash_layer_ids={LAYERS}", "dflash.dflash_layers=2")
    finally:
        _reset_accelerate()
    _cli("eval", *config, *shared, f"output_dir={out}", f"draft={out / 'final'}", f"prompts={prompts['heldout']}",
         "engine=specdec", "vllm_ngram=false", "max_new_tokens=20", "cost_repeats=2", "warmup=0")
    _cli("publish", *config, f"target={target}", "dtype=float32", f"draft={out / 'final'}", f"out={out / 'publish'}",
         f"report={out / 'eval' / 'report.json'}")
    recipe = read_recipe(recipe_path)
    trained = json.loads((out / "train_summary.json").read_text())["config"]
    assert trained["draft"] == "dflash" and trained["loss"] == recipe["train"]["loss"] == "ce"
    assert trained["block_size"] == recipe["train"]["dflash"]["block_size"] == 16
    report = json.loads((out / "eval" / "report.json").read_text())
    assert report["equivalence"]["mode"] == "greedy" and report["equivalence"]["passed"]
    published = json.loads((out / "publish" / "config.json").read_text())
    target_config = json.loads((target / "config.json").read_text())
    assert published["architectures"] == ["DFlashDraftModel"] and published["block_size"] == 16
    assert published["dflash_config"]["target_layer_ids"] == [i - 1 for i in LAYERS]
    assert published["draft_vocab_size"] == 64 and published["target_hidden_size"] == target_config["hidden_size"]
    assert published["rope_parameters"] == target_config["rope_parameters"]
    assert '"method": "dflash"' in (out / "publish" / "README.md").read_text()


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_dflash_in_two_processes_trains_exactly_as_one(tmp_path, caplog):
    """draft=dflash under `accelerate launch` with two gloo processes equals one process at the same global batch
    (float32): per-step losses, final weights and the held-out figures. The anchors of a row depend on the row
    alone, and the loss divides by the step's slot weight over both processes."""
    from conftest import save_tiny_world
    from test_train import two_processes_train_as_one

    ws = save_tiny_world(tmp_path / "ws", target_layers=2, small_seed=7, n_train=24, n_heldout=6)
    train = dict(draft="dflash", dflash_layer_ids=[1], dflash_layers=1, block_size=4, num_anchors=5,
                 draft_vocab_size=40, teacher="online", states="online", max_steps=3, eval_every=0, save_every=0,
                 learning_rate=1e-2, max_grad_norm=0.5, mixed_precision="no")
    _, evals = two_processes_train_as_one(ws, tmp_path, caplog, train)
    assert len(evals[0]) == len(evals[1]) >= 1
    for got, want in zip(*evals):
        assert got["positions"] == want["positions"] > 0 and got["tau"] == pytest.approx(want["tau"])


def test_each_proposed_token_comes_with_its_own_slots_q(target4, good_draft, monkeypatch):
    """Under sampling, q[:, j] is the warped distribution of mask slot j + 1 of the round's one block forward (in
    target ids, zero outside a reduced head), and token j was drawn where q[:, j] has mass."""
    from specdec.dflash.drafter import DFlashDrafter
    from specdec.sampling import SamplingConfig, probabilities

    sampling = SamplingConfig(temperature=0.8, top_k=20)
    blocks, rounds = [], []
    block, propose = DFlashDraft.block, DFlashDrafter.propose
    monkeypatch.setattr(DFlashDraft, "block", lambda self, *a, **kw: blocks.append(block(self, *a, **kw)) or blocks[-1])
    monkeypatch.setattr(DFlashDrafter, "propose",
                        lambda self, *a, **kw: rounds.append(propose(self, *a, **kw)) or rounds[-1])
    prompts = ragged_prompts(2, VOCAB, seed=5)[0]
    speculative_generate(target4, good_draft, prompts, num_draft_tokens=3, max_new_tokens=12, sampling=sampling,
                         generator=torch.Generator().manual_seed(0))
    assert len(blocks) == len(rounds) > 0
    for logits, (tokens, q) in zip(blocks, rounds):
        expected = probabilities(logits[:, 1 : q.shape[1] + 1], sampling)
        torch.testing.assert_close(q, expected.to(q.dtype))
        assert (q.gather(2, tokens[..., None]) > 0).all()


def test_layer_ids_out_of_range_name_the_dflash_key():
    """A DFlash draft's bad layer ids are named by the key a DFlash recipe sets, not EAGLE-3's."""
    with pytest.raises(ValueError, match=r"dflash_layer_ids must be distinct ids in 1\.\.3"):
        DFlashDraft.from_target(tiny_llama(seed=0, layers=4), [1, 9])


@pytest.mark.usefixtures("fresh_accelerate_state")
@pytest.mark.parametrize("norm_init", ["target", "ones"])
def test_the_drafts_final_norm_starts_where_norm_init_says(tmp_path, norm_init):
    """One step at warm-up's zero learning rate exports the draft as built: its final norm the target's, or ones."""
    from conftest import save_tiny_world

    from specdec.models import load_model
    from specdec.train import distill

    ws = save_tiny_world(tmp_path / "ws", target_layers=4, small_seed=3, n_train=4, n_heldout=2)
    saved = load_model(str(ws / "target"), dtype="float32", device="cpu")
    with torch.no_grad():  # a trained target's final norm is not ones (SmolLM2's averages 1.8)
        saved.model.norm.weight.copy_(1.5 + 0.1 * torch.randn(saved.model.norm.weight.shape))
    saved.save_pretrained(ws / "target")
    cfg = distill.TrainConfig(draft="dflash", target=str(ws / "target"), train_data=str(ws / "data"),
                              heldout_data=str(ws / "heldout"), output_dir=str(tmp_path / "run"), device="cpu",
                              max_steps=1, per_device_batch_size=2, warmup_steps=1, eval_every=0, save_every=0,
                              eval_samples=0, data_workers=0,
                              dflash={"block_size": 4, "num_anchors": 4, "dflash_layer_ids": LAYERS,
                                      "dflash_layers": 1, "norm_init": norm_init}, states="online")
    built = load_model(str(distill.run(cfg)), dtype="float32", device="cpu")
    target = load_model(str(ws / "target"), dtype="float32", device="cpu")
    expected = torch.ones_like(built.norm.weight) if norm_init == "ones" else target.model.norm.weight
    torch.testing.assert_close(built.norm.weight, expected)


def test_norm_init_takes_target_or_ones():
    from specdec.train.kinds.dflash import DFlashOptions

    with pytest.raises(ValueError, match="norm_init must be target or ones"):
        DFlashOptions(norm_init="zeros")
