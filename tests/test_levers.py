"""The trainer's levers (recipe keys): `optimizer` (adamw | muon), `lr_schedule` (cosine | linear) and, for EAGLE-3
drafts, `layer_init`, `fc_init` and `norm_before_residual`. Each does what it says, survives a checkpoint and a
resume, and leaves decoding exact."""

import copy
import dataclasses
import json

import pytest
import torch
from conftest import ragged_prompts, save_tiny_world, tiny_llama
from test_budget import _lrs
from test_budget import _optimizer as _sgd
from transformers import get_linear_schedule_with_warmup

from specdec import speculative_generate, target_generate
from specdec.eagle3 import Eagle3Draft
from specdec.models import load_model
from specdec.train import distill, optim
from specdec.train.budget import LinearToEnd

VOCAB = 128
LAYERS = [1, 2, 3]


def test_the_linear_schedule_is_transformers_and_stays_at_zero_past_its_end():
    ours = torch.optim.lr_scheduler.LambdaLR(_sgd(), LinearToEnd(4, 30))
    theirs = get_linear_schedule_with_warmup(_sgd(), 4, 30)
    assert _lrs(ours, 31) == pytest.approx(_lrs(theirs, 31))
    assert _lrs(ours, 3) == [0.0] * 3


def test_muon_takes_the_layer_matrices_and_adamw_the_rest():
    target = tiny_llama(seed=0, layers=4, dtype=torch.float32)
    draft = Eagle3Draft.from_target(target, LAYERS, seed=1)
    matrices, others = optim.muon_split(draft)
    names = {id(p): n for n, p in draft.named_parameters()}
    assert {names[id(p)] for p in matrices} == {"fc.weight"} | {f"midlayer.{m}.weight" for m in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    assert "lm_head.weight" in {names[id(p)] for p in others}  # vocabulary rows stay with AdamW
    assert all(p.requires_grad for p in matrices + others)  # the frozen embeddings are in neither


def _regression(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 3))
    x, y = torch.randn(32, 6), torch.randn(32, 3)
    return model, x, y


def _steps(model, optimizer, scheduler, x, y, n: int) -> list[float]:
    losses = []
    for _ in range(n):
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
    return losses


def test_muon_and_adamw_step_as_one_optimizer_under_the_schedule_and_resume_exactly():
    cfg = dataclasses.make_dataclass("Cfg", [("optimizer", str), ("learning_rate", float), ("weight_decay", float),
                                            ("lr_schedule", str), ("warmup_steps", int), ("max_steps", int)])
    settings = cfg("muon", 0.02, 0.0, "linear", 2, 12)
    model, x, y = _regression(0)
    optimizer, scheduler = optim.build(settings, model)
    assert len(optimizer.inner) == 2 and isinstance(optimizer.inner[0], torch.optim.Muon)
    losses = _steps(model, optimizer, scheduler, x, y, 6)
    assert losses[-1] < 0.9 * losses[0]
    assert all(g["lr"] == pytest.approx(0.02 * (12 - 6) / 10) for g in optimizer.param_groups)  # scheduled, both
    saved = copy.deepcopy((model.state_dict(), optimizer.state_dict(), scheduler.state_dict()))
    after = _steps(model, optimizer, scheduler, x, y, 3)

    other, _, _ = _regression(1)
    other.load_state_dict(saved[0])
    optimizer2, scheduler2 = optim.build(settings, other)
    optimizer2.load_state_dict(saved[1])
    scheduler2.load_state_dict(saved[2])
    assert _steps(other, optimizer2, scheduler2, x, y, 3) == after  # momentum and schedule came back
    for a, b in zip(model.parameters(), other.parameters()):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="another `optimizer` setting"):
        optimizer2.load_state_dict({"inner": saved[1]["inner"][:1]})  # an AdamW-only run's checkpoint


def test_a_draft_layer_started_from_the_target_and_fc_passing_the_last_state():
    target = tiny_llama(seed=0, layers=4, dtype=torch.float32)
    draft = Eagle3Draft.from_target(target, LAYERS, seed=1, layer_init="target", fc_init="last_state")
    source, layer, hidden = target.model.layers[-1], draft.midlayer, target.config.hidden_size
    for name in ("q_proj", "k_proj", "v_proj"):
        assert torch.equal(getattr(layer.self_attn, name).weight[:, hidden:], getattr(source.self_attn, name).weight)
        assert getattr(layer.self_attn, name).weight[:, :hidden].abs().sum() > 0  # the token's half stays random
    assert torch.equal(layer.mlp.down_proj.weight, source.mlp.down_proj.weight)
    assert torch.equal(layer.hidden_norm.weight, source.input_layernorm.weight)
    states = torch.randn(2, 5, len(LAYERS) * hidden)
    assert torch.allclose(draft.fc(states), states[..., -hidden:])
    plain = Eagle3Draft.from_target(target, LAYERS, seed=1)
    assert not torch.equal(plain.midlayer.mlp.down_proj.weight, source.mlp.down_proj.weight)


def test_norm_before_residual_is_saved_and_decodes_exactly(tmp_path):
    target = tiny_llama(seed=0, layers=4)
    draft = Eagle3Draft.from_target(target, LAYERS, seed=2, norm_before_residual=True).eval()
    ids, mask = ragged_prompts(1, VOCAB, seed=5)
    plain = Eagle3Draft.from_target(target, LAYERS, seed=2).eval()
    hidden = torch.randn(1, ids.shape[1], len(LAYERS) * target.config.hidden_size, dtype=torch.float64)
    positions = torch.arange(ids.shape[1])[None]
    assert not torch.allclose(draft(ids, hidden, positions)[0], plain(ids, hidden, positions)[0])  # it matters
    draft.save_pretrained(tmp_path / "d")
    assert json.loads((tmp_path / "d" / "config.json").read_text())["norm_before_residual"] is True
    loaded = load_model(str(tmp_path / "d"), dtype="float64", device="cpu")
    assert loaded.midlayer.norm_before_residual
    ids, mask = ragged_prompts(3, VOCAB, seed=4)
    ref = target_generate(target, ids, mask, max_new_tokens=24)
    assert torch.equal(speculative_generate(target, loaded, ids, mask, 3, max_new_tokens=24).sequences, ref.sequences)


def test_bad_lever_values_are_refused_with_the_choices():
    for key, value, words in (("optimizer", "sgd", "adamw, muon"), ("lr_schedule", "step", "cosine, linear"),
                              ("layer_init", "copy", "random, target"), ("fc_init", "eye", "random, last_state")):
        with pytest.raises(ValueError, match=f"{key} must be one of {words}"):
            distill.TrainConfig(**{key: value})


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_an_eagle3_run_with_every_lever_resumes_where_it_stopped(tmp_path):
    """Muon + linear schedule + target-started layer + pass-through fc + norm_before_residual, through the real
    loop: resumed from its mid-run checkpoint, it ends with the weights of the uninterrupted run."""
    ws = save_tiny_world(tmp_path / "ws", target_layers=4, small_seed=7, n_train=16, n_heldout=4)
    cfg = distill.TrainConfig(target=str(ws / "target"), train_data=str(ws / "data"), heldout_data=str(ws / "heldout"),
                              output_dir=str(tmp_path / "whole"), device="cpu", draft="eagle3",
                              eagle_aux_layer_ids=LAYERS, draft_vocab_size=40, max_steps=6, per_device_batch_size=8,
                              warmup_steps=1, log_every=1, eval_every=0, save_every=3, eval_samples=4,
                              eval_batch_size=2, learning_rate=3e-3, optimizer="muon", lr_schedule="linear",
                              layer_init="target", fc_init="last_state", norm_before_residual=True, data_workers=0)
    whole = distill.run(cfg)
    # the same run again from its step-3 checkpoint, in another folder: optimizer state, schedule and data order
    resumed = distill.run(dataclasses.replace(cfg, output_dir=str(tmp_path / "resumed"),
                                              resume_from=str(tmp_path / "whole" / "checkpoints" / "step-3")))
    a, b = load_model(str(whole), dtype="float32", device="cpu"), load_model(str(resumed), dtype="float32",
                                                                          device="cpu")
    assert a.midlayer.norm_before_residual and b.midlayer.norm_before_residual
    for name, value in a.state_dict().items():
        assert torch.equal(value, b.state_dict()[name]), name
