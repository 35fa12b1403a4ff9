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
from test_engine_eagle3 import K, target_and_answers, vllm_matches_specdec

from specdec.models import EMBEDDED_TARGET, save_model
from specdec.parallel_draft import CONFIG_KEY, layout_logits
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
    target, tok, prompts, answers = target_and_answers(root)
    draft = derive_draft(target, [0, 29]).train()
    mask_id = chosen_mask_token(-1, tok, draft.get_input_embeddings().num_embeddings)
    setattr(draft.config, CONFIG_KEY, mask_id)
    fit_parallel(draft, answers, mask_id)
    save_model(draft, tok, root / "trained")
    pub.publish(pub.PublishConfig(draft=str(root / "trained"), out=str(root / "parallel"), target=EMBEDDED_TARGET))
    return {"root": root, "target": target, "tok": tok, "prompts": prompts, "mask_id": mask_id}


def test_published_parallel_draft_in_vllm_is_exact_and_counted_as_specdec_counts(world, tmp_path):
    published = world["root"] / "parallel"
    assert json.loads((published / "config.json").read_text())[CONFIG_KEY] == world["mask_id"]
    ours = vllm_matches_specdec(world, published, tmp_path / "out", "auto", "draft_model")
    assert ours["per_position"][1] > 0  # mask proposals accepted: the counts compared are not only the first's

