"""Proof in the serving engine for DFlash: the embedded SmolLM2 target (a Llama) in vLLM (its own environment, a
real `vllm serve`) with a published DFlash draft in vLLM's layout (`DFlashDraftModel`, served as `method: dflash`,
its block attending both ways), float32, greedy, through `specdec eval engine=specdec,vllm`: output
token-identical to vLLM target-only and to specdec's decoder, and vLLM's acceptance counters (drafts, draft
tokens, accepted, accepted per position) equal to specdec's own greedy counts on the same prompts and k.

vLLM's block is the anchor and k mask slots; specdec's is the trained block_size slots (k + 1 when k is larger).
The draft is trained with block_size = k + 1, so that both compute the same block. It is fitted for a minute to
the target's own answers to these prompts, so that both engines accept long runs of it."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from test_engine_eagle3 import FAST_SERVER, NEW, REQUESTS, K, specdec_counts

from specdec import draft_registry, target_generate
from specdec.dflash import DFlashDraft
from specdec.eagle3.states import target_states
from specdec.models import EMBEDDED_TARGET, load_model, load_tokenizer, save_model
from specdec.prompts import encode_prompt
from specdec.train import publish as pub
from specdec.train.losses import target_to_draft_map
from specdec.vllm_env import find_vllm_python

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

LAYERS = [2, 15, 28]  # of the target's 30


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    if find_vllm_python() is None:
        pytest.skip("no vLLM Python found (make vllm-env creates .venv-vllm; or set SPECDEC_VLLM_PYTHON)")
    root = tmp_path_factory.mktemp("engine_dflash")
    torch.manual_seed(0)
    target = load_model(EMBEDDED_TARGET, dtype="float32", device="cpu")
    tok = load_tokenizer(EMBEDDED_TARGET)
    prompts = [encode_prompt(tok, [{"role": "user", "content": text}]) for text in REQUESTS]
    answers = [target_generate(target, torch.tensor([p]), max_new_tokens=NEW + K, eos_token_id=tok.eos_token_id)
               .sequences[0].tolist() for p in prompts]
    used = sorted({t for seq in answers for t in seq} | set(range(256)) | {tok.eos_token_id})
    draft = fit_dflash(target, answers, torch.tensor(used))
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": text}) + "\n" for text in REQUESTS))
    save_model(draft, tok, root / "trained")
    pub.publish(pub.PublishConfig(draft=str(root / "trained"), out=str(root / "dflash"), target=EMBEDDED_TARGET))
    return {"root": root, "target": target, "tok": tok, "prompts": prompts}


def fit_dflash(target, sequences: list[list[int]], keep: torch.Tensor, steps: int = 150) -> DFlashDraft:
    """A one-layer DFlash draft (block K + 1) fitted (cross-entropy at every anchor) to the target's answers."""
    draft = DFlashDraft.from_target(target, LAYERS, keep, num_layers=1, block_size=K + 1, seed=0)
    inv = target_to_draft_map(draft.draft_to_target, target.config.vocab_size)
    opt = torch.optim.Adam([p for p in draft.parameters() if p.requires_grad], lr=3e-3)
    batches = []
    for seq in sequences:  # the target is frozen: its states once per sequence
        ids = torch.tensor([seq])
        with torch.no_grad():
            states = target_states(target, ids, torch.ones_like(ids), LAYERS)
        anchors = torch.arange(ids.shape[1] - K)[None]
        labels = ids.gather(1, (anchors[..., None] + torch.arange(K + 1)).flatten(1)).view(1, -1, K + 1)
        batches.append((ids, states, anchors, inv[labels[..., 1:]]))
    for _ in range(steps):
        for ids, states, anchors, local in batches:
            logits = draft(ids, states, anchors)[:, :, 1:]
            loss = F.cross_entropy(logits[local >= 0], local[local >= 0])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return draft.eval()


def test_a_published_dflash_draft_in_vllm_is_exact_and_counted_as_specdec_counts(world, tmp_path):
    from specdec.cli import main

    folder = world["root"] / "dflash"
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and draft_registry.of_checkpoint(folder).name == "dflash"
    assert "causal" not in config["dflash_config"]  # served as trained: the block attends both ways
    out = tmp_path / "out"
    code = main(["eval", "--target", EMBEDDED_TARGET, "--draft", str(folder), "--prompts",
                 str(world["root"] / "prompts.jsonl"), "--out", str(out), "dtype=float32", "engine=specdec,vllm",
                 "concurrency=1", "vllm_method=auto", "--num-draft-tokens", str(K), "--max-new-tokens",
                 str(NEW), "cost_repeats=2", "warmup=0", "vllm_startup_timeout=900", "vllm_request_timeout=600",
                 FAST_SERVER])
    assert code == 0
    report = json.loads((out / "report.json").read_text())
    e = report["engine"]
    assert e["complete"] and e["methods"] == ["dflash"]
    assert report["equivalence"]["passed"] and e["equivalence"]["passed"]
    assert e["equivalence"]["vs_specdec"]["mismatches"] == 0 and e["equivalence"]["vs_specdec"]["checked"] == 4
    phase = next(p for p in e["phases"] if p["mode"] == "dflash")
    ours = specdec_counts(world, folder)
    vllm_counts = {"rounds": phase["rounds"], "proposed": phase["proposed"], "accepted": phase["accepted"],
                   "per_position": phase["accepted_per_position"]}
    assert vllm_counts == ours, (vllm_counts, ours)
    assert ours["accepted"] > ours["rounds"]  # long runs: the counts compared are not trivially zero
