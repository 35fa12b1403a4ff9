"""A published EAGLE-3 draft in vLLM speculators' format loads in `speculators` 0.9.0 (an independent
implementation of the same draft, run here on the CPU) and its forward gives specdec's logits; a wrong layer id,
d2t convention or concatenation order makes the comparison fail.

speculators is installed by scripts/setup.sh (`--no-deps`: its own requirements pull CUDA builds of torchvision);
these tests are skipped, with the reason, where it is missing."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_llama, tiny_tokenizer
from test_eagle3 import LAYERS, fitted_draft

from specdec.models import save_model
from specdec.replay import target_states
from specdec.train import publish as pub

speculators_eagle3 = pytest.importorskip("speculators.models.eagle3", reason="speculators 0.9.0 is not installed "
                                         "(scripts/setup.sh installs it with --no-deps)")

SEQ = [1, 17, 42, 99, 5, 63, 7, 92, 53, 71, 4, 83, 14, 117]


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """A tiny float32 target saved locally, and a fitted EAGLE-3 draft with a reduced vocabulary published from it
    in both layouts: (target, specdec's draft, {"engines": dir, "speculators": dir})."""
    root = tmp_path_factory.mktemp("speculators")
    target = tiny_llama(seed=0, layers=4, dtype=torch.float32)
    save_model(target, tiny_tokenizer(), root / "target")
    keep = torch.cat([torch.arange(4), 4 + torch.randperm(124, generator=torch.Generator().manual_seed(1))[:60]])
    draft = fitted_draft(target, keep_ids=keep, steps=40).float()
    save_model(draft, tiny_tokenizer(), root / "draft")
    outs = {}
    for fmt in ("engines", "speculators"):
        outs[fmt] = pub.publish(pub.PublishConfig(draft=str(root / "draft"), out=str(root / fmt),
                                                  target=str(root / "target"), format=fmt))
    return target, draft, outs


def speculators_logits(folder, aux: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """speculators' own first-step logits for draft positions 0..T-1 (tokens x_1..x_T, the target's states
    h_0..h_{T-1}, position ids 0..T-1 as vLLM uses), its eager attention (its flex default fails on a CPU)."""
    config = speculators_eagle3.Eagle3SpeculatorConfig.from_pretrained(str(folder))
    config.transformer_layer_config._attn_implementation = "eager"
    model = speculators_eagle3.Eagle3DraftModel.from_pretrained(str(folder), config=config).eval().float()
    captured = {}
    hook = model.lm_head.register_forward_hook(lambda _m, _i, out: captured.setdefault("logits", out))
    t = aux.shape[1]
    with torch.no_grad():
        model(hidden_states=aux, input_ids=torch.tensor([ids[1:t + 1]]), document_ids=torch.zeros(1, t, dtype=torch.long),
              position_ids=torch.arange(t)[None], ttt_steps=1)
    hook.remove()
    return captured["logits"][0], model


def test_speculators_loads_the_export_and_computes_specdecs_logits(published):
    target, draft, outs = published
    folder = outs["speculators"]
    config = json.loads((folder / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and "model_type" not in config
    assert config["norm_before_residual"] is False and config["eagle_aux_hidden_state_layer_ids"] == LAYERS
    assert config["transformer_layer_config"]["model_type"] == "llama"
    ids = torch.tensor([SEQ])
    with torch.no_grad():
        aux = target_states(draft, target, ids, torch.ones_like(ids))[:, :-1]  # h_0 .. h_{T-1}
        mine = draft(ids[:, 1:], aux, torch.arange(ids.shape[1] - 1)[None])[1][0]
    theirs, model = speculators_logits(folder, aux, SEQ)
    torch.testing.assert_close(theirs, mine, rtol=1e-4, atol=1e-4)
    # the draft-to-target map: the same target ids from both
    assert torch.equal(model.d2t, draft.d2t) and torch.equal(model.t2d, draft.t2d)
    picked = theirs.argmax(-1)
    assert torch.equal(picked + model.d2t[picked], draft.draft_to_target[mine.argmax(-1)])


def test_the_comparison_fails_on_a_wrong_layer_order_or_concatenation(published):
    """The test above can fail: the target's states in another layer order, or the attention input's halves
    swapped, give other logits."""
    target, draft, outs = published
    ids = torch.tensor([SEQ])
    with torch.no_grad():
        aux = target_states(draft, target, ids, torch.ones_like(ids))[:, :-1]
        mine = draft(ids[:, 1:], aux, torch.arange(ids.shape[1] - 1)[None])[1][0]
    hidden = target.config.hidden_size
    reordered = torch.cat([aux[..., 2 * hidden:], aux[..., :2 * hidden]], dim=-1)  # layers (3, 1, 2)
    theirs, _ = speculators_logits(outs["speculators"], reordered, SEQ)
    assert not torch.allclose(theirs, mine, rtol=1e-3, atol=1e-3)
    swapped = json.loads((outs["speculators"] / "config.json").read_text())
    from safetensors.torch import load_file, save_file

    state = load_file(str(outs["speculators"] / "model.safetensors"))
    for name in ("q_proj", "k_proj", "v_proj"):
        w = state[f"layers.0.self_attn.{name}.weight"]
        state[f"layers.0.self_attn.{name}.weight"] = torch.cat([w[:, hidden:], w[:, :hidden]], dim=1).contiguous()
    broken = outs["speculators"].parent / "swapped"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps(swapped))
    save_file(state, str(broken / "model.safetensors"))
    theirs, _ = speculators_logits(broken, aux, SEQ)
    assert not torch.allclose(theirs, mine, rtol=1e-3, atol=1e-3)


def test_both_layouts_load_back_into_specdec_identically(published):
    from specdec.models import load_model

    _, draft, outs = published
    engines = load_model(str(outs["engines"]), dtype="float32", device="cpu")
    spec = load_model(str(outs["speculators"]), dtype="float32", device="cpu")
    for name, value in draft.state_dict().items():
        assert torch.equal(engines.state_dict()[name], value) and torch.equal(spec.state_dict()[name], value), name
    card = (outs["speculators"] / "README.md").read_text()
    assert "vllm serve" in card and "SGLang does not read this layout" in card
