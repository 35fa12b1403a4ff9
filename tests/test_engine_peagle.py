"""Proof in the serving engine for P-EAGLE: the embedded SmolLM2 target in vLLM (its own environment, a real
`vllm serve`) with a published P-EAGLE draft served as `eagle3` with `parallel_drafting: true` (the kind's
`vllm_speculative_config`), float32, greedy, through `specdec eval engine=specdec,vllm`: output token-identical
to vLLM target-only and to specdec's decoder, and vLLM's acceptance counters (drafts, draft tokens, accepted,
accepted per position) equal to specdec's own greedy counts on the same prompts and k.

The draft is fitted for a minute, with the parallel objective, to the target's own answers to these prompts, so
that both engines accept long runs of it (a random draft would make the counts trivially zero)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from test_engine_eagle3 import FAST_SERVER, NEW, REQUESTS, K, specdec_counts

from specdec import draft_registry, target_generate
from specdec.eagle3 import Eagle3Draft
from specdec.eval.engine.vllm import kind_speculative_config
from specdec.models import EMBEDDED_TARGET, load_model, load_tokenizer, save_model
from specdec.prompts import encode_prompt
from specdec.replay import target_states
from specdec.train import publish as pub
from specdec.train.eagle3_train import mask_token_id
from specdec.vllm_env import find_vllm_python

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    if find_vllm_python() is None:
        pytest.skip("no vLLM Python found (make vllm-env creates .venv-vllm; or set SPECDEC_VLLM_PYTHON)")
    root = tmp_path_factory.mktemp("engine_peagle")
    torch.manual_seed(0)
    target = load_model(EMBEDDED_TARGET, dtype="float32", device="cpu")
    tok = load_tokenizer(EMBEDDED_TARGET)
    prompts = [encode_prompt(tok, [{"role": "user", "content": text}]) for text in REQUESTS]
    answers = [target_generate(target, torch.tensor([p]), max_new_tokens=NEW, eos_token_id=tok.eos_token_id)
               .sequences[0].tolist() for p in prompts]
    used = sorted({t for seq in answers for t in seq} | set(range(256)) | {tok.eos_token_id})
    draft = fit_peagle(target, answers, torch.tensor(used), mask_token_id(-1, tok, target))
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": text}) + "\n" for text in REQUESTS))
    save_model(draft, tok, root / "trained")
    pub.publish(pub.PublishConfig(draft=str(root / "trained"), out=str(root / "peagle"), target=EMBEDDED_TARGET))
    return {"root": root, "target": target, "tok": tok, "prompts": prompts}


def fit_peagle(target, sequences: list[list[int]], keep: torch.Tensor, ptd: int, steps: int = 120) -> Eagle3Draft:
    """A P-EAGLE draft fitted (cross-entropy, the parallel objective over K proposals) to the target's answers."""
    draft = Eagle3Draft.from_target(target, None, keep_ids=keep, seed=0, ptd_token_id=ptd)
    inv = torch.full((target.config.vocab_size,), -1, dtype=torch.long)
    inv[draft.draft_to_target] = torch.arange(len(keep))
    opt = torch.optim.Adam([p for p in draft.parameters() if p.requires_grad], lr=3e-3)
    batches = []
    for seq in sequences:  # the target is frozen: its states once per sequence
        ids = torch.tensor([seq])
        mask = torch.ones_like(ids)
        with torch.no_grad():
            batches.append((ids, mask, target_states(draft, target, ids, mask)))
    for _ in range(steps):
        for ids, mask, states in batches:
            loss = 0.0
            for j, out in enumerate(draft(ids, states, attention_mask=mask, ttt_steps=K)):
                labels = inv[ids[:, 2 + j:]]
                loss = loss + F.cross_entropy(draft.logits(out[:, j:-1])[labels >= 0], labels[labels >= 0])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return draft.eval()


def test_a_published_peagle_draft_in_vllm_is_exact_and_counted_as_specdec_counts(world, tmp_path):
    from specdec.cli import main

    folder = world["root"] / "peagle"
    config = json.loads((folder / "config.json").read_text())
    assert config["ptd_token_id"] is not None and draft_registry.of_checkpoint(folder).name == "peagle"
    assert kind_speculative_config(str(folder)) == {"parallel_drafting": True}  # what the eval adds for vLLM
    out = tmp_path / "out"
    code = main(["eval", "--target", EMBEDDED_TARGET, "--draft", str(folder), "--prompts",
                 str(world["root"] / "prompts.jsonl"), "--out", str(out), "dtype=float32", "engine=specdec,vllm",
                 "concurrency=1", "vllm_method=eagle3", "--num-draft-tokens", str(K), "--max-new-tokens",
                 str(NEW), "cost_repeats=2", "warmup=0", "vllm_startup_timeout=900", "vllm_request_timeout=600",
                 FAST_SERVER])  # parallel_drafting: true comes from the kind (eval/engine/vllm.py)
    assert code == 0
    report = json.loads((out / "report.json").read_text())
    e = report["engine"]
    assert e["complete"] and e["methods"] == ["eagle3"]
    assert report["equivalence"]["passed"] and e["equivalence"]["passed"]
    assert e["equivalence"]["vs_specdec"]["mismatches"] == 0 and e["equivalence"]["vs_specdec"]["checked"] == 4
    phase = next(p for p in e["phases"] if p["mode"] == "eagle3")
    ours = specdec_counts(world, folder)
    vllm_counts = {"rounds": phase["rounds"], "proposed": phase["proposed"], "accepted": phase["accepted"],
                   "per_position": phase["accepted_per_position"]}
    assert vllm_counts == ours, (vllm_counts, ours)
    assert ours["accepted"] > ours["rounds"]  # long runs: the counts compared are not trivially zero
