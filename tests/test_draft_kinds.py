"""The draft-kind interface (specdec/draft_kind.py) and its registry (specdec/draft_registry.py): a third kind,
declared and registered here and nowhere else, decodes exactly, replays its held-out tau and publishes; the
built-in kinds are found by config, checkpoint, model and recipe value."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from conftest import tiny_llama, tiny_tokenizer
from transformers import LlamaForCausalLM

from specdec import draft_registry, speculative_generate, target_generate
from specdec.draft_kind import PublishContext
from specdec.drafter import PlainDrafter
from specdec.eagle3 import Eagle3Draft
from specdec.models import load_model, save_model
from specdec.ranks import teacher_forced_ranks
from specdec.replay import replay_runs, target_states
from specdec.train import publish as pub

MARK = "mirror_draft"  # the config.json key that marks the stub kind's checkpoints


class MirrorDraft(torch.nn.Module):
    """The stub kind's draft: a copy of the target inside a class of its own, so it proposes the target's greedy
    token and every proposal is accepted."""

    def __init__(self, lm: LlamaForCausalLM):
        super().__init__()
        self.lm, self.config = lm, lm.config

    def get_input_embeddings(self):
        return self.lm.get_input_embeddings()

    def get_output_embeddings(self):
        return self.lm.get_output_embeddings()


class MirrorKind:
    """A third kind, through the interface only: its drafter and replay are the plain ones on the inner model."""

    name = "mirror"
    vllm_method = "mirror"
    sglang_algorithm = "MIRROR"
    formats = ("mirror",)
    maps_vocabulary = False

    def __init__(self):
        self.drafters = 0

    def recognises(self, config: dict) -> bool:
        return bool(config.get(MARK))

    def owns(self, model) -> bool:
        return isinstance(model, MirrorDraft)

    def needs_snapshot(self, config: dict) -> bool:
        return True

    def load(self, path: str, dtype: torch.dtype) -> MirrorDraft:
        return MirrorDraft(LlamaForCausalLM.from_pretrained(Path(path) / "lm", dtype=dtype))

    def save(self, model, out_dir, format: str = "", context: PublishContext | None = None, state_dict=None) -> None:
        model.lm.save_pretrained(Path(out_dir) / "lm")
        verifier = context.verifier() if context is not None else None
        (Path(out_dir) / "config.json").write_text(json.dumps({MARK: True, "verifier": verifier}))

    def drafter(self, draft, target, sampling) -> PlainDrafter:
        self.drafters += 1
        return PlainDrafter(draft.lm, target, sampling)

    def target_states(self, draft, target, input_ids, attention_mask) -> None:
        return None

    def replay_ranks(self, draft, input_ids, attention_mask, loss_mask, steps, states):
        return teacher_forced_ranks(draft.lm, input_ids, attention_mask, loss_mask, steps)

    def card_facts(self, model) -> dict:
        return {}


@pytest.fixture
def mirror():
    kind = draft_registry.register(MirrorKind())
    yield kind
    draft_registry.unregister(kind.name)


@pytest.fixture(scope="module")
def target64():
    return tiny_llama(seed=0, dtype=torch.float32)


def test_a_registered_kind_decodes_exactly_through_its_own_drafter(mirror, target64):
    draft = MirrorDraft(copy.deepcopy(target64))
    assert draft_registry.of_model(draft) is mirror
    ids = torch.tensor([[5, 17, 33, 8], [0, 9, 12, 40]])
    mask = torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]])
    out = speculative_generate(target64, draft, ids, mask, num_draft_tokens=3, max_new_tokens=16)
    assert torch.equal(out.sequences, target_generate(target64, ids, mask, max_new_tokens=16).sequences)
    assert mirror.drafters == 1 and not out.stats.fallback and out.stats.acceptance_rate == 1.0


def test_a_registered_kind_replays_its_held_out_tau(mirror, target64):
    draft = MirrorDraft(copy.deepcopy(target64))
    seq = target_generate(target64, torch.tensor([[5, 17, 33, 8]]), max_new_tokens=10).sequences
    mask, scored = torch.ones_like(seq), torch.zeros_like(seq)
    scored[:, 3:-1] = 1  # logits at 3.. predict the completion
    assert target_states(draft, target64, seq, mask) is None
    runs = replay_runs(draft, seq, mask, scored, 4, None)[0]
    assert runs == [min(4, 10 - i) for i in range(10)]  # every proposal is the target's token


def test_a_registered_kind_publishes_in_its_own_layout(mirror, target64, tmp_path):
    tok = tiny_tokenizer()
    draft_dir = save_model(MirrorDraft(copy.deepcopy(target64)), tok, tmp_path / "draft")
    out = pub.publish(pub.PublishConfig(draft=str(draft_dir), out=str(tmp_path / "pub"), target="acme/tiny-target",
                                        format="mirror"))
    assert json.loads((out / "config.json").read_text()) == {MARK: True, "verifier": "acme/tiny-target"}
    card = (out / "README.md").read_text()
    assert "vLLM `mirror`, SGLang `MIRROR`" in card and '"method": "mirror"' in card
    loaded = load_model(str(out), dtype="float32", device="cpu")
    assert isinstance(loaded, MirrorDraft) and torch.equal(loaded.lm.lm_head.weight, target64.lm_head.weight)
    with pytest.raises(ValueError, match="not a layout of mirror drafts"):
        pub.publish(pub.PublishConfig(draft=str(draft_dir), out=str(tmp_path / "pub2"), target="acme/tiny-target"))


def test_the_registry_finds_the_built_in_kinds(tmp_path):
    eagle3, plain = draft_registry.get("eagle3"), draft_registry.get("plain")
    assert draft_registry.of_config({"architectures": ["LlamaForCausalLMEagle3"]}) is eagle3
    assert draft_registry.of_config({"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3"}) is eagle3
    assert draft_registry.of_config({"architectures": ["LlamaForCausalLM"]}) is plain
    assert draft_registry.of_checkpoint(tmp_path) is plain  # no config.json: transformers decides
    assert draft_registry.of_model(tiny_llama(layers=1)) is plain
    assert draft_registry.of_model(Eagle3Draft.from_target(tiny_llama(layers=4), [1, 2, 3])) is eagle3
    assert [draft_registry.for_recipe(d) for d in ("eagle3", "derived", "scratch", "some/hub-model")] == \
        [eagle3, plain, plain, plain]
    assert (eagle3.vllm_method, plain.vllm_method) == ("eagle3", "draft_model")
    with pytest.raises(ValueError, match="registered already"):
        draft_registry.register(eagle3)
    with pytest.raises(ValueError, match="no draft kind named 'nope'"):
        draft_registry.get("nope")


def test_a_retired_layout_says_what_to_do(tmp_path):
    with pytest.raises(ValueError, match="retrain it as an EAGLE-3 draft"):
        draft_registry.of_config({"specdec_feature_draft": True})
    with pytest.raises(ValueError, match="replaced by draft: eagle3"):
        draft_registry.for_recipe("feature")
