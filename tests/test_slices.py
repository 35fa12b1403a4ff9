"""slice_tokens (train/slices.py): a micro-batch run in slices of whole rows gives the whole micro-batch's loss and
gradient, packed or not, in one process and in two; kinds whose loss is a per-micro-batch mean refuse it."""

import pytest
import torch
from conftest import save_tiny_world, tiny_llama
from draft_checks import same_loss_and_gradients

from specdec.eagle3 import Eagle3Draft, target_states
from specdec.train import losses
from specdec.train.batches import collate, pack, place
from specdec.train.distill import TrainConfig
from specdec.train.eagle3_train import Eagle3Training, eagle3_loss, teacher_head
from specdec.train.slices import row_groups, slices

VOCAB = 128
LAYERS = [1, 2, 3]


def test_row_groups_keep_within_the_bound_and_never_cut_a_row():
    assert row_groups(16, 830, 0) == [list(range(16))]  # 0: the whole micro-batch
    assert row_groups(16, 100, 1600) == [list(range(16))]  # it fits
    groups = row_groups(16, 830, 4096)
    assert [len(g) for g in groups] == [4, 4, 4, 4] and sum(groups, []) == list(range(16))
    assert row_groups(3, 5000, 4096) == [[0], [1], [2]]  # wider than the bound: one row a slice
    assert [len(g) for g in row_groups(5, 10, 20)] == [2, 2, 1]


def _batch():
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(4, VOCAB, (n,), generator=g).tolist() for n in (9, 5, 12, 7, 4, 10)]
    return collate({"input_ids": seqs, "prompt_length": [3, 2, 5, 3, 2, 4]}, pad_id=0, max_length=32,
                   prompt_positions=True)


@pytest.mark.parametrize("packed", [False, True])
def test_the_slices_losses_and_gradients_add_up_to_the_micro_batchs(packed):
    """The trainer's sequence for one micro-batch: counts over the whole batch, then each slice's loss divided by
    them, backward. Loss and every gradient equal the unsliced micro-batch's to float rounding; the slices'
    tokens add up, and a packed slice keeps its samples' states (read ahead per unpacked sample)."""
    target = tiny_llama(seed=0, layers=4)
    batch = _batch()
    if packed:
        batch = pack(batch, max_length=14)
    unpacked = batch.get("unpacked", batch)
    states = target_states(target, unpacked["input_ids"], unpacked["attention_mask"], LAYERS, final=True).float()
    ahead = (states, [True] * len(states))
    draft = Eagle3Draft.from_target(target, LAYERS, keep_ids=torch.arange(60), seed=1)
    cfg = TrainConfig(draft="eagle3", teacher="online", ttt_steps=3, eagle_aux_layer_ids=LAYERS)
    inv = losses.target_to_draft_map(draft.draft_to_target, VOCAB)
    run = Eagle3Training.__new__(Eagle3Training)  # its counts and states, without a trainer around it
    run.cfg, run.inv_map, run.model = cfg, inv, draft
    run.states = type("Recorded", (), {"complete": staticmethod(lambda b, read: read[0])})()
    head = teacher_head(target.get_output_embeddings(), draft.kept_ids())
    denominators = run.counts(batch).clamp(min=1).float()

    def loss_of(b, read):
        s = read[0] if "segments" not in b else place(read[0], b)
        return eagle3_loss(cfg, draft, b, s, head, inv, denominators)

    results = []
    for bound in (0, 1 if packed else 2 * batch["input_ids"].shape[1]):
        parts = slices(batch, ahead, bound)
        assert len(parts) == (1 if bound == 0 else batch["input_ids"].shape[0] // (1 if packed else 2)
                              + (batch["input_ids"].shape[0] % 2 if not packed else 0))
        draft.zero_grad()
        total = 0.0
        for part, read in parts:
            loss = loss_of(part, read)
            loss.backward()
            total = total + loss.detach()
        assert sum(p["n_tokens"] for p, _ in parts) == batch["n_tokens"]
        results.append((total, {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}))
    same_loss_and_gradients(*results)


def test_a_packed_slice_renumbers_its_samples():
    batch = pack(_batch(), max_length=14)
    rows = batch["input_ids"].shape[0]
    parts = slices(batch, None, 1)
    assert len(parts) == rows
    seen = 0
    for part, _ in parts:
        samples = part["unpacked"]["input_ids"].shape[0]
        assert sorted({b for _, _, b, _ in part["segments"]}) == list(range(samples))
        assert set(part["document_ids"].unique().tolist()) - {-1} == set(range(samples))
        for _, offset, b, n in part["segments"]:  # each sample's tokens where its segment says
            assert torch.equal(part["input_ids"][0, offset:offset + n], part["unpacked"]["input_ids"][b, :n])
        seen += samples
    assert seen == batch["unpacked"]["input_ids"].shape[0]


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_two_processes_in_slices_train_exactly_as_one_whole(tmp_path, caplog):
    """Two gloo processes, each running its micro-batch one row at a time (the gradients meet once, after the last
    slice), equal one process at the same global batch in whole micro-batches (float32)."""
    from test_train import two_processes_train_as_one

    ws = save_tiny_world(tmp_path / "ws", target_layers=2, small_seed=7, n_train=24, n_heldout=6)
    train = dict(draft="eagle3", eagle_aux_layer_ids=[1], draft_vocab_size=40, teacher="online", ttt_steps=2,
                 max_steps=3, eval_every=0, save_every=0, learning_rate=1e-2, max_grad_norm=0.5,
                 mixed_precision="no")
    two_processes_train_as_one(ws, tmp_path, caplog, train, two_only={"slice_tokens": 1})


def test_kinds_whose_loss_is_a_micro_batch_mean_refuse_slices():
    from specdec.train import kinds

    with pytest.raises(ValueError, match="slice_tokens is for draft=eagle3 or peagle or dflash"):
        kinds.check(TrainConfig(draft="derived", slice_tokens=4096))
    kinds.check(TrainConfig(draft="eagle3", slice_tokens=4096))
    with pytest.raises(ValueError, match="slice_tokens must be >= 0"):
        TrainConfig(draft="eagle3", slice_tokens=-1)


def test_the_plan_counts_one_slices_rows_for_activations():
    """--plan: activations (and an online target forward) at the rows one slice holds; the states read ahead for the
    whole micro-batch stay at its rows."""
    from specdec.train import plan

    target = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 8, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 512, "max_position_embeddings": 4096,
              "tie_word_embeddings": False}

    def terms(**kw):
        cfg = TrainConfig(draft="eagle3", target="tiny", device="cpu", per_device_batch_size=16, max_length=1024,
                          eagle_aux_layer_ids=[2, 4, 5], draft_vocab_size=256, states="online", **kw)
        p = plan.plan_run(cfg, plan.config_from_dict(target), device_type="cpu", mixed_precision="no")
        named = {t.name: t for terms in p.phases.values() for t in terms}
        return named["activations"], named["target states (input)"], named["target forward"]

    whole, sliced = terms(), terms(slice_tokens=4096)
    assert "B=16" in whole[0].detail and "B=4" in sliced[0].detail
    assert sliced[0].bytes < 0.3 * whole[0].bytes and sliced[2].bytes == pytest.approx(whole[2].bytes / 4, rel=0.01)
    assert sliced[1].bytes == whole[1].bytes


@pytest.mark.usefixtures("fresh_accelerate_state")
@pytest.mark.parametrize("pack", [False, True])
def test_a_dflash_run_in_slices_ends_with_the_weights_of_one_in_whole_micro_batches(tmp_path, monkeypatch, pack):
    """DFlash through the real loop (anchors drawn once per micro-batch, then sliced with their rows), packed or
    not: three steps in slices of one row give the final weights of three steps in whole micro-batches."""
    from safetensors.torch import load_file

    from specdec.train import distill

    made = []

    def counted(batch, ahead, bound):
        parts = slices(batch, ahead, bound)
        made.append(len(parts))
        return parts

    monkeypatch.setattr(distill, "slices", counted)
    ws = save_tiny_world(tmp_path / "ws", target_layers=4, small_seed=3, n_train=8, n_heldout=4)
    weights = []
    for bound in (0, 1):
        cfg = TrainConfig(draft="dflash", target=str(ws / "target"), train_data=str(ws / "data"),
                          heldout_data=str(ws / "heldout"), output_dir=str(tmp_path / f"run-{bound}"), device="cpu",
                          max_steps=3, per_device_batch_size=4, warmup_steps=1, eval_every=0, save_every=0,
                          eval_samples=4, eval_batch_size=2, data_workers=0, learning_rate=3e-3, mixed_precision="no",
                          dflash={"block_size": 4, "num_anchors": 6, "dflash_layer_ids": LAYERS, "dflash_layers": 1},
                          states="online", pack=pack, slice_tokens=bound, max_length=24 if pack else 512)
        final = distill.run(cfg)
        weights.append(load_file(str(final / "model.safetensors")))
    whole, sliced = weights
    assert made[:3] == [1, 1, 1] and min(made[3:]) > 1  # the second run did run in slices
    assert whole.keys() == sliced.keys()
    for name in whole:
        torch.testing.assert_close(sliced[name], whole[name], atol=2e-5, rtol=1e-4, msg=name)


def test_padding_to_a_multiple_rounds_the_width_and_changes_no_loss_or_gradient():
    """pad_to_multiple_of: a batch padded to a multiple of 16 positions (train/batches.py padded_width) has the
    same masks on its real positions, nothing scored past them, and the same EAGLE-3 loss and gradients."""
    target = tiny_llama(seed=0, layers=4)
    g = torch.Generator().manual_seed(3)
    rows = {"input_ids": [torch.randint(4, VOCAB, (n,), generator=g).tolist() for n in (9, 5, 12)],
            "prompt_length": [3, 2, 5]}
    tight = collate(rows, pad_id=0, max_length=40, prompt_positions=True)
    wide = collate(rows, pad_id=0, max_length=40, prompt_positions=True, multiple=16)
    assert tight["input_ids"].shape[1] == 12 and wide["input_ids"].shape[1] == 16
    assert collate(rows, pad_id=0, max_length=14, multiple=16)["input_ids"].shape[1] == 14  # never past max_length
    for key in ("input_ids", "attention_mask", "loss_mask"):
        assert torch.equal(wide[key][:, :12], tight[key]) and not wide[key][:, 12:].any()
    assert wide["n_tokens"] == tight["n_tokens"]
    assert pack(tight, max_length=40, multiple=16)["input_ids"].shape[1] == 32  # 26 packed tokens, rounded up

    draft = Eagle3Draft.from_target(target, LAYERS, keep_ids=torch.arange(60), seed=1)
    cfg = TrainConfig(draft="eagle3", teacher="online", ttt_steps=3, eagle_aux_layer_ids=LAYERS)
    inv = losses.target_to_draft_map(draft.draft_to_target, VOCAB)
    head = teacher_head(target.get_output_embeddings(), draft.kept_ids())
    run = Eagle3Training.__new__(Eagle3Training)  # its counts, without a trainer around it
    run.cfg, run.inv_map, run.model = cfg, inv, draft
    results = []
    for batch in (tight, wide):
        states = target_states(target, batch["input_ids"], batch["attention_mask"], LAYERS, final=True).float()
        draft.zero_grad()
        loss = eagle3_loss(cfg, draft, batch, states, head, inv, run.counts(batch).clamp(min=1).float())
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}))
    same_loss_and_gradients(*results)
