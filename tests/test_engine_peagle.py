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
from test_engine_eagle3 import K, fit_eagle3, target_and_answers, used_ids, vllm_matches_specdec

from specdec import draft_registry
from specdec.eval.engine.vllm import kind_speculative_config
from specdec.models import EMBEDDED_TARGET, save_model
from specdec.train import publish as pub
from specdec.train.eagle3_train import mask_token_id
from specdec.vllm_env import find_vllm_python

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    if find_vllm_python() is None:
        pytest.skip("no vLLM Python found (make vllm-env creates .venv-vllm; or set SPECDEC_VLLM_PYTHON)")
    root = tmp_path_factory.mktemp("engine_peagle")
    target, tok, prompts, answers = target_and_answers(root)
    # the parallel objective over K proposals
    draft = fit_eagle3(target, answers, used_ids(answers, tok), ptd_token_id=mask_token_id(-1, tok, target),
                       ttt_steps=K)
    save_model(draft, tok, root / "trained")
    pub.publish(pub.PublishConfig(draft=str(root / "trained"), out=str(root / "peagle"), target=EMBEDDED_TARGET))
    return {"root": root, "target": target, "tok": tok, "prompts": prompts}


def test_a_published_peagle_draft_in_vllm_is_exact_and_counted_as_specdec_counts(world, tmp_path):
    folder = world["root"] / "peagle"
    config = json.loads((folder / "config.json").read_text())
    assert config["ptd_token_id"] is not None and draft_registry.of_checkpoint(folder).name == "peagle"
    assert kind_speculative_config(str(folder)) == {"parallel_drafting": True}  # what the eval adds for vLLM
    # served as eagle3; parallel_drafting: true comes from the kind (eval/engine/vllm.py)
    ours = vllm_matches_specdec(world, folder, tmp_path / "out", "eagle3", "eagle3")
    assert ours["accepted"] > ours["rounds"]  # long runs: the counts compared are not trivially zero
