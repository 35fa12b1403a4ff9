"""The memory gate's accounted bytes (eval/memory.py): hand-computed sums on tiny models, shared tensors counted
once, and the same figure from two evaluations of the same draft."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_llama

from specdec import fast_linear
from specdec.cli import main
from specdec.eval import memory

# tiny_llama: vocab 128, hidden 32, intermediate 64, 4 heads of 8, 2 KV heads
EMBED = 128 * 32
LAYER_LINEARS = 32 * 32 + 2 * (32 * 16) + 32 * 32 + 3 * (32 * 64)  # q, k, v, o; gate, up, down
LAYER = LAYER_LINEARS + 2 * 32  # and two norms
ROTARY = 2 * 4  # inv_freq and original_inv_freq, head_dim / 2 each


def _params(layers: int) -> int:
    return EMBED + layers * LAYER + 32 + EMBED  # embeddings, layers, final norm, head


def test_weights_are_parameters_and_buffers_each_storage_once():
    model = tiny_llama(layers=2, dtype=torch.float32)
    assert memory.weights_bytes(model) == 4 * (_params(2) + ROTARY)
    # a head tied to the embeddings is one tensor: counted once
    model.lm_head.weight = model.model.embed_tokens.weight
    assert memory.weights_bytes(model) == 4 * (_params(2) - EMBED + ROTARY)


def test_tensors_shared_with_the_target_are_the_target_s():
    target, draft = tiny_llama(seed=0, dtype=torch.float32), tiny_llama(seed=1, layers=1, dtype=torch.float32)
    draft.model.embed_tokens.weight = target.model.embed_tokens.weight  # as share_target_embeddings does
    assert memory.weights_bytes(draft, shared_with=target) == 4 * (_params(1) - EMBED + ROTARY)
    assert memory.weights_bytes(target) == 4 * (_params(2) + ROTARY)  # the target counts it, once


def test_draft_overhead_is_the_hand_computed_sum():
    target, draft = tiny_llama(seed=0, dtype=torch.float32), tiny_llama(seed=1, layers=1, dtype=torch.float32)
    draft.lm_head.weight = target.lm_head.weight  # a shared head: neither its weight nor its copy is the draft's
    out = memory.draft_overhead(draft, target, prompt_length=10, max_new_tokens=20, proposed=3, batch=2)
    weights = 4 * (_params(1) - EMBED + ROTARY)
    may_reorder = fast_linear._enabled() and fast_linear._packing_available()
    copies = 4 * LAYER_LINEARS if may_reorder else 0  # the reordered copies the CPU fast path may make
    kv = 1 * 2 * 2 * 8 * (10 + 20 + 3) * 2 * 4  # layers x (k, v) x kv heads x head_dim x positions x batch x bytes
    assert out == {"weights": weights, "copies": copies, "kv_cache": kv, "states": 0, "total": weights + copies + kv,
                   "positions": 33, "batch_size": 2}
    base = memory.target_only(target, prompt_length=10, max_new_tokens=20, batch=2)
    assert base["total"] == 4 * (_params(2) + ROTARY) + 2 * 2 * 2 * 8 * 30 * 2 * 4
    # float64 layers never get a reordered copy
    assert memory.copies_bytes(tiny_llama(seed=1, layers=1)) == 0


def test_an_eagle3_drafter_holds_the_target_s_states_after_the_prompt():
    config = tiny_llama(layers=1).config
    config.eagle_aux_hidden_state_layer_ids, config.target_hidden_size = [1, 2, 3], 48
    assert memory.states_bytes(config, prompt_length=10, batch=2, dtype_bytes=4) == 2 * 2 * 10 * 3 * 48 * 4
    assert memory.states_bytes(tiny_llama(layers=1).config, 10, 2, 4) == 0


def _eval(ckpt, out, *extra):
    return main(["eval", "--target", ckpt["target"], "--draft", ckpt["draft"], "--prompts", ckpt["prompts"],
                 "--max-new-tokens", "6", "--out", str(out), "dtype=float64", "cost_repeats=1", "threads=1",
                 "num_prompts=2", "warmup=0", "--num-draft-tokens", "2", *extra])


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_two_evaluations_of_a_draft_account_the_same_bytes(tiny_checkpoints, tmp_path):
    reports = []
    for name in ("a", "b"):
        assert _eval(tiny_checkpoints, tmp_path / name) == 0
        reports.append(json.loads((tmp_path / name / "report.json").read_text()))
    first, second = (r["memory"] for r in reports)
    assert first["accounted"] == second["accounted"] and first["overhead_mb"] == second["overhead_mb"]
    assert first["target_only"] == second["target_only"] and first["limit_mb"] == second["limit_mb"]
    # the tiny draft in float64 (no reordered copies): its weights and a KV cache of one layer at the longest
    # prompt + 6 new tokens + 2 proposals
    accounted = first["accounted"]
    # (a loaded model's two rotary buffers may share one storage, counted once)
    assert 8 * _params(1) < accounted["weights"] <= 8 * (_params(1) + ROTARY) and accounted["copies"] == 0
    assert accounted["kv_cache"] == 1 * 2 * 2 * 8 * accounted["positions"] * 1 * 8
    assert first["overhead_mb"] == pytest.approx(accounted["total"] / 2**20)
    assert first["limit_mb"] == pytest.approx(0.2 * first["target_only_mb"])
    assert "rss_overhead_mb" in first  # measured, informational
    reason = reports[0]["decision"]["reasons"][3]
    assert reason.startswith(f"memory overhead {first['overhead_mb']:.1f} MB") and "target-only" in reason
    md = (tmp_path / "a" / "report.md").read_text()
    assert "Memory, accounted" in md and "Memory, measured (informational" in md
