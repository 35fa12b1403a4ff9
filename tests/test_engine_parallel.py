"""Proof in the serving engine: a published parallel draft (PARD) served unchanged by vLLM as `draft_model` with
`parallel_drafting: true` (eval/engine/vllm.py adds the key from the draft's kind), over the embedded SmolLM2
target, float32, greedy, through `specdec eval engine=specdec,vllm`: output token-identical to vLLM target-only and
to specdec's decoder, and vLLM's acceptance counters equal to specdec's own counts (tests/test_engine_eagle3.py's
`specdec_counts`: the same prompts, k and rounds).

The draft is derived from the target and fitted for a short while, PARD's way (specdec/parallel_draft.py's layout),
to the target's own answers to these prompts, so that both engines accept some of its mask proposals."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from test_engine_eagle3 import FAST_SERVER, NEW, REQUESTS, K, specdec_counts

from specdec.decode import target_generate
from specdec.models import EMBEDDED_TARGET, load_model, load_tokenizer, save_model
from specdec.parallel_draft import CONFIG_KEY, layout_logits
from specdec.prompts import encode_prompt
from specdec.train import publish as pub
from specdec.train.draft import derive_draft
from specdec.train.parallel_train import chosen_mask_token
from specdec.vllm_env import find_vllm_python

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


def fit_parallel(draft, sequences: list[list[int]], mask_id: int, steps: int = 40):
    """Cross-entropy of every copy (depth) over PARD's layout, on the target's greedy answers."""
    opt = torch.optim.Adam(draft.parameters(), lr=1e-3)
    for _ in range(steps):
        for seq in sequences:
            ids = torch.tensor([seq])
            logits = layout_logits(draft, ids, torch.ones_like(ids), K, mask_id)  # [K, 1, L, V]
            loss = sum(F.cross_entropy(logits[j, 0, j:-1], ids[0, j + 1:]) for j in range(K))
            opt.zero_grad()
            loss.backward()
            opt.step()
    return draft.eval()


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    if find_vllm_python() is None:
        pytest.skip("no vLLM Python found (make vllm-env creates .venv-vllm; or set SPECDEC_VLLM_PYTHON)")
    root = tmp_path_factory.mktemp("engine_parallel")
    torch.manual_seed(0)
    target = load_model(EMBEDDED_TARGET, dtype="float32", device="cpu")
    tok = load_tokenizer(EMBEDDED_TARGET)
    prompts = [encode_prompt(tok, [{"role": "user", "content": text}]) for text in REQUESTS]
    answers = [target_generate(target, torch.tensor([p]), max_new_tokens=NEW, eos_token_id=tok.eos_token_id)
               .sequences[0].tolist() for p in prompts]
    draft = derive_draft(target, [0, 29]).train()
    mask_id = chosen_mask_token(-1, tok, draft.get_input_embeddings().num_embeddings)
    setattr(draft.config, CONFIG_KEY, mask_id)
    fit_parallel(draft, answers, mask_id)
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": text}) + "\n" for text in REQUESTS))
    save_model(draft, tok, root / "trained")
    pub.publish(pub.PublishConfig(draft=str(root / "trained"), out=str(root / "parallel"), target=EMBEDDED_TARGET))
    return {"root": root, "target": target, "tok": tok, "prompts": prompts, "mask_id": mask_id}


def test_published_parallel_draft_in_vllm_is_exact_and_counted_as_specdec_counts(world, tmp_path):
    from specdec.cli import main

    published = world["root"] / "parallel"
    assert json.loads((published / "config.json").read_text())[CONFIG_KEY] == world["mask_id"]
    out = tmp_path / "out"
    code = main(["eval", "--target", EMBEDDED_TARGET, "--draft", str(published), "--prompts",
                 str(world["root"] / "prompts.jsonl"), "--out", str(out), "dtype=float32", "engine=specdec,vllm",
                 "concurrency=1", "vllm_method=auto", "--num-draft-tokens", str(K), "--max-new-tokens", str(NEW),
                 "cost_repeats=2", "warmup=0", "vllm_startup_timeout=900", "vllm_request_timeout=600", FAST_SERVER])
    assert code == 0
    report = json.loads((out / "report.json").read_text())
    e = report["engine"]
    assert e["complete"] and e["methods"] == ["draft_model"]
    assert report["equivalence"]["passed"] and e["equivalence"]["passed"]
    assert e["equivalence"]["vs_specdec"]["mismatches"] == 0 and e["equivalence"]["vs_specdec"]["checked"] == 4
    phase = next(p for p in e["phases"] if p["mode"] == "draft_model")
    ours = specdec_counts(world, published)
    vllm_counts = {"rounds": phase["rounds"], "proposed": phase["proposed"], "accepted": phase["accepted"],
                   "per_position": phase["accepted_per_position"]}
    assert vllm_counts == ours, (vllm_counts, ours)
    assert ours["per_position"][1] > 0  # mask proposals accepted: the counts compared are not only the first's

