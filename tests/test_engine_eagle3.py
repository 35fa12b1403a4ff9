"""Proof in the serving engine: the embedded SmolLM2 target in vLLM (its own environment, a real `vllm serve`)
with a published EAGLE-3 draft as `eagle3` and a published plain draft as `draft_model`, float32, greedy, through
`specdec eval engine=specdec,vllm`: output token-identical to vLLM target-only and to specdec's decoder, and vLLM's
acceptance counters (drafts, draft tokens, accepted, accepted per position) equal to specdec's own greedy counts
on the same prompts and k.

The EAGLE-3 draft is fitted for a minute to the target's own answers to these prompts, so that both engines
accept long runs of it (a random draft would make the counts trivially zero)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from specdec import speculative_generate, target_generate
from specdec.eagle3 import Eagle3Draft
from specdec.models import EMBEDDED_TARGET, load_model, load_tokenizer, save_model
from specdec.prompts import encode_prompt
from specdec.replay import target_states
from specdec.train import publish as pub
from specdec.train.draft import derive_draft
from specdec.train.losses import target_to_draft_map
from specdec.vllm_env import find_vllm_python

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

K, NEW = 3, 40
REQUESTS = ["Name three colours of the rainbow.", "What is the capital of France?",
            "Write one sentence about the sea.", "List the days of the week."]
FAST_SERVER = "vllm_args=[--enforce-eager,--distributed-executor-backend,uni]"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    if find_vllm_python() is None:
        pytest.skip("no vLLM Python found (make vllm-env creates .venv-vllm; or set SPECDEC_VLLM_PYTHON)")
    # Both drafts sit under a path containing "eagle3", which vLLM would otherwise take as the method of the plain
    # one too (eval/engine/vllm.py: _path_vllm_keeps_the_method_of).
    root = tmp_path_factory.mktemp("engine_eagle3")
    target, tok, prompts, answers = target_and_answers(root)
    draft = fit_eagle3(target, answers, used_ids(answers, tok))
    save_model(draft, tok, root / "eagle3_trained")
    save_model(derive_draft(target, [0, 29]), tok, root / "plain_trained")
    for name in ("eagle3", "plain"):
        pub.publish(pub.PublishConfig(draft=str(root / f"{name}_trained"), out=str(root / name),
                                      target=EMBEDDED_TARGET))
    return {"root": root, "target": target, "tok": tok, "prompts": prompts}


def target_and_answers(root):
    """The embedded target (float32, CPU), its tokenizer, the REQUESTS' prompts and the target's greedy answers to
    them (prompt and answer); root/prompts.jsonl holds the requests for `specdec eval`."""
    torch.manual_seed(0)
    target = load_model(EMBEDDED_TARGET, dtype="float32", device="cpu")
    tok = load_tokenizer(EMBEDDED_TARGET)
    prompts = [encode_prompt(tok, [{"role": "user", "content": text}]) for text in REQUESTS]
    answers = [target_generate(target, torch.tensor([p]), max_new_tokens=NEW, eos_token_id=tok.eos_token_id)
               .sequences[0].tolist() for p in prompts]
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": text}) + "\n" for text in REQUESTS))
    return target, tok, prompts, answers


def used_ids(answers: list[list[int]], tok) -> torch.Tensor:
    """A draft vocabulary that holds every answer's tokens, the first 256 ids and EOS."""
    return torch.tensor(sorted({t for seq in answers for t in seq} | set(range(256)) | {tok.eos_token_id}))


def fit_eagle3(target, sequences: list[list[int]], keep: torch.Tensor, steps: int = 120,
               ptd_token_id: int | None = None, ttt_steps: int = 3) -> Eagle3Draft:
    """An EAGLE-3 draft fitted (cross-entropy over `ttt_steps` unrolled steps) to the target's greedy answers; with a
    `ptd_token_id`, a P-EAGLE draft fitted with the parallel objective over `ttt_steps` proposals."""
    draft = Eagle3Draft.from_target(target, None, keep_ids=keep, seed=0, ptd_token_id=ptd_token_id)
    inv = target_to_draft_map(draft.draft_to_target, target.config.vocab_size)
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
            for j, out in enumerate(draft(ids, states, attention_mask=mask, ttt_steps=ttt_steps)):
                labels = inv[ids[:, 2 + j:]]
                loss = loss + F.cross_entropy(draft.logits(out[:, j:-1])[labels >= 0], labels[labels >= 0])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return draft.eval()


def specdec_counts(world, draft_dir) -> dict:
    """specdec's own greedy counts at k = K over the prompts, one at a time (the engine's concurrency 1), counted
    as vLLM counts them. vLLM proposes k tokens in every round, also in one that passes max_tokens, and counts
    what the target accepts there before it cuts the output; specdec proposes no token past max_new_tokens. So
    specdec decodes K tokens further here and counts the rounds that start before NEW tokens: the same rounds,
    each with k proposals (greedy output is a prefix of the longer one)."""
    target, tok = world["target"], world["tok"]
    draft = load_model(str(draft_dir), dtype="float32", device="cpu")
    totals = {"rounds": 0, "proposed": 0, "accepted": 0, "per_position": [0] * K}
    for p in world["prompts"]:
        out = speculative_generate(target, draft, torch.tensor([p]), num_draft_tokens=K, max_new_tokens=NEW + K,
                                   eos_token_id=tok.eos_token_id, trace=True)
        generated = 1  # the prefill's token
        for round_ in out.trace:
            if generated >= NEW:
                break
            assert round_.proposed.shape[1] == K
            accepted = int(round_.num_accepted[0])
            totals["rounds"] += 1
            totals["proposed"] += K
            totals["accepted"] += accepted
            for j in range(accepted):
                totals["per_position"][j] += 1
            generated += accepted + 1
    return totals


def vllm_matches_specdec(world, draft_dir, out, vllm_method: str, mode: str) -> dict:
    """`specdec eval engine=specdec,vllm` of the published draft at K: complete, served as `mode`, output
    token-identical to vLLM target-only and to specdec's decoder, and vLLM's acceptance counters equal to
    `specdec_counts`, which it returns."""
    from specdec.cli import main

    code = main(["eval", "--target", EMBEDDED_TARGET, "--draft", str(draft_dir), "--prompts",
                 str(world["root"] / "prompts.jsonl"), "--out", str(out), "dtype=float32", "engine=specdec,vllm",
                 "concurrency=1", f"vllm_method={vllm_method}", "--num-draft-tokens", str(K), "--max-new-tokens",
                 str(NEW), "cost_repeats=2", "warmup=0", "vllm_startup_timeout=900", "vllm_request_timeout=600",
                 FAST_SERVER])
    assert code == 0
    report = json.loads((out / "report.json").read_text())
    e = report["engine"]
    assert e["complete"] and e["methods"] == [mode]
    assert report["equivalence"]["passed"] and e["equivalence"]["passed"]
    assert e["equivalence"]["vs_specdec"]["mismatches"] == 0 and e["equivalence"]["vs_specdec"]["checked"] == 4
    phase = next(p for p in e["phases"] if p["mode"] == mode)
    ours = specdec_counts(world, draft_dir)
    vllm_counts = {"rounds": phase["rounds"], "proposed": phase["proposed"], "accepted": phase["accepted"],
                   "per_position": phase["accepted_per_position"]}
    assert vllm_counts == ours, (vllm_counts, ours)
    return ours


@pytest.mark.parametrize("kind, method", [("eagle3", "eagle3"), ("plain", "draft_model")])
def test_published_drafts_in_vllm_are_exact_and_counted_as_specdec_counts(world, kind, method, tmp_path):
    ours = vllm_matches_specdec(world, world["root"] / kind, tmp_path / "out", method, method)
    if kind == "eagle3":
        assert ours["accepted"] > ours["rounds"]  # long runs: the counts compared are not trivially zero
