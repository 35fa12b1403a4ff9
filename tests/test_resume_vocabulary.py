"""A resumed run keeps the reduced draft head's vocabulary its checkpoint was trained with, whatever the data now
counts: the head rows were learned for those target ids."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from conftest import save_tiny_world

from specdec.train import distill

LAYERS = [1, 2, 3]


def _resumed(cfg) -> distill.Distiller:
    """A Distiller set up and resumed as `run` does, before its first step."""
    trainer = distill.Distiller(cfg)
    trainer.prepare()
    return trainer


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_a_resume_on_grown_data_keeps_the_vocabulary_the_head_was_trained_for(tmp_path):
    ws = save_tiny_world(tmp_path / "ws", target_layers=4, small_seed=7, n_train=16, n_heldout=8)
    cfg = distill.TrainConfig(target=str(ws / "target"), train_data=str(ws / "data"), heldout_data=str(ws / "heldout"),
                              output_dir=str(tmp_path / "run"), device="cpu", draft="eagle3",
                              eagle_aux_layer_ids=LAYERS, draft_vocab_size=40, max_steps=2, per_device_batch_size=8,
                              warmup_steps=0, eval_every=0, save_every=2, eval_samples=4, data_workers=0)
    distill.run(cfg)
    step2 = tmp_path / "run" / "checkpoints" / "step-2"
    trained = json.loads((tmp_path / "run" / "draft_vocab.json").read_text())["ids"]
    assert json.loads((step2 / "trainer_state.json").read_text())["draft_vocab"] == trained

    # The data grew (the held-out folder's answers joined the training data): counted again, the ids differ.
    grown = dataclasses.replace(cfg, train_data=f"{ws / 'data'},{ws / 'heldout'}", heldout_data="", max_steps=3)
    recounted = _resumed(dataclasses.replace(grown, output_dir=str(tmp_path / "fresh")))
    assert sorted(recounted.vocab_ids) != sorted(trained)

    resumed = _resumed(dataclasses.replace(grown, resume_from=str(step2)))
    assert resumed.model.draft_to_target.tolist() == trained
    assert torch.equal(resumed.model.kept_ids(), resumed.model.draft_to_target)  # the saved d2t agrees

    # A checkpoint saved before the state kept the ids: they are read from its d2t.
    state = json.loads((step2 / "trainer_state.json").read_text())
    (step2 / "trainer_state.json").write_text(json.dumps({k: v for k, v in state.items() if k != "draft_vocab"}))
    older = _resumed(dataclasses.replace(grown, resume_from=str(step2)))
    assert older.model.draft_to_target.tolist() == trained

    with pytest.raises(ValueError, match="draft_vocab_size=40"):
        _resumed(dataclasses.replace(grown, resume_from=str(step2), draft_vocab_size=48))
