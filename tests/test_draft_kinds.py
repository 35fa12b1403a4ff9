"""The draft-kind interface (specdec/draft_kind.py) and its registry (specdec/draft_registry.py), with its training
side (train/kinds/): a third kind, declared and registered here and nowhere else, decodes exactly, replays its
held-out tau, trains, plans its memory and publishes; the built-in kinds are found by config, checkpoint, model and
recipe value."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import torch
from conftest import save_tiny_world, tiny_llama, tiny_tokenizer
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from specdec import draft_registry, speculative_generate, target_generate
from specdec.config import load_config
from specdec.draft_kind import PublishContext
from specdec.drafter import PlainDrafter
from specdec.eagle3 import Eagle3Draft
from specdec.models import load_model, save_model
from specdec.ranks import teacher_forced_ranks
from specdec.replay import replay_runs, target_states
from specdec.train import distill, kinds, plain_train, plan
from specdec.train import publish as pub
from specdec.train.heldout import evaluating
from specdec.train.kinds import KindOptions, TrainingFacts
from specdec.train.plan import KindPlan, PlanContext, Term, plain_activations

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

    def forward(self, **inputs):
        return self.lm(**inputs)


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

    def draft_forwards(self, proposal) -> int:
        return proposal.depth  # one token a forward (a tree: one forward a level)

    def card_facts(self, model) -> dict:
        return {}


@dataclasses.dataclass
class MirrorOptions(KindOptions):
    """draft=mirror's keys."""

    mirror_loss_weight: float = 1.0  # the cross-entropy's weight

    def __post_init__(self) -> None:
        if self.mirror_loss_weight <= 0:
            raise ValueError(f"mirror_loss_weight must be > 0, got {self.mirror_loss_weight}")


class MirrorRun:
    """One run's mirror draft: cross-entropy on the target's tokens, the plain kind's held-out figures."""

    prefetch = None

    def __init__(self, cfg, target):
        self.cfg, self.model = cfg, MirrorDraft(copy.deepcopy(target).float().requires_grad_(True))

    def counts(self, batch):
        return None

    def loss(self, model, batch, micro, rank, prefetched=None, denominators=None):
        mask = batch["loss_mask"].bool()
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        ce = torch.nn.functional.cross_entropy(logits[mask].float(), batch["labels"][mask])
        return self.cfg.options.mirror_loss_weight * ce

    def evaluate(self, model, chunks, gather):
        with evaluating(model):
            part = plain_train.evaluate_part(model.lm, None, chunks, None)
        return plain_train.merge_parts(gather([part]), self.cfg.eval_k, alpha_is_lower_bound=True)


class MirrorTraining:
    """The third kind's training side, through the interface only (train/kinds/base.py: TrainingKind)."""

    name = "mirror"
    facts = TrainingFacts(teachers=("online",), lora=False)
    options = MirrorOptions

    def start(self, cfg, target, tokenizer, vocabulary, device, autocast, folders) -> MirrorRun:
        return MirrorRun(cfg, target)

    def plan(self, ctx: PlanContext) -> KindPlan:
        cfg, b, s = ctx.cfg, ctx.cfg.per_device_batch_size, ctx.cfg.max_length
        model = plan.target.on_meta(lambda: AutoModelForCausalLM.from_config(ctx.target_cfg))
        fix = ctx.activation_fix()
        peak = plain_activations(b, s, ctx.tw, ctx.tw.layers, ctx.tw.vocab, ctx.half, cfg.loss)["peak"]
        return KindPlan(model, fix, heldout=8 * cfg.eval_batch_size * s * ctx.tw.vocab,
                        step=[Term("activations", peak, f"B={b}, S={s}", fix)], target_why="a copy of it trains")

    def card_usage(self, info, k: int) -> list[str]:
        return ["## Usage", "", f"`mirror serve {info.model_ref} --proposals {k}`", ""]


@pytest.fixture
def mirror():
    kind = draft_registry.register(MirrorKind())
    training = kinds.register(MirrorTraining())
    yield kind
    kinds.unregister(training.name)
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
    assert "vLLM `mirror`, SGLang `MIRROR`" in card
    assert f"`mirror serve {out.name} --proposals 4`" in card  # its training side's usage section (no local path)
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


def test_a_registered_kind_takes_its_own_options(mirror, tmp_path):
    cfg = distill.TrainConfig(draft="mirror", mirror_loss_weight=2.0)
    assert cfg.kind.name == "mirror" and cfg.options == MirrorOptions(2.0) and cfg.mirror_loss_weight == 2.0
    assert distill.TrainConfig(draft="mirror", mirror={"mirror_loss_weight": 3.0}).options.mirror_loss_weight == 3.0
    assert distill.TrainConfig(draft="mirror").needs_target  # its only teacher is online
    recipe = tmp_path / "mirror.yaml"
    recipe.write_text("draft: mirror\ntrain:\n  mirror:\n    mirror_loss_weight: 3.0\n")
    assert load_config(distill.TrainConfig, recipe, section="train").mirror_loss_weight == 3.0
    assert load_config(distill.TrainConfig, recipe, ["mirror.mirror_loss_weight=5"],
                       section="train").options.mirror_loss_weight == 5.0  # a dotted override of the block
    with pytest.raises(ValueError, match="set both flat and in the train.mirror block"):
        load_config(distill.TrainConfig, recipe, ["mirror_loss_weight=5"], section="train")
    with pytest.raises(ValueError, match="mirror_loss_weight must be > 0"):
        distill.TrainConfig(draft="mirror", mirror_loss_weight=0.0)
    with pytest.raises(ValueError, match="ttt_steps is for draft=eagle3 or peagle, not draft=mirror"):
        distill.TrainConfig(draft="mirror", ttt_steps=2)
    with pytest.raises(ValueError, match="mirror_loss_weight is for draft=mirror"):
        distill.TrainConfig(draft="eagle3", mirror_loss_weight=2.0)
    with pytest.raises(ValueError, match="teacher=online"):
        distill.TrainConfig(draft="mirror", teacher="offline")


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_a_registered_kind_trains_plans_and_publishes(mirror, tmp_path, capsys):
    ws = save_tiny_world(tmp_path / "ws", target_layers=2, small_seed=3, n_train=8, n_heldout=4)
    cfg = distill.TrainConfig(draft="mirror", target=str(ws / "target"), train_data=str(ws / "data"),
                              heldout_data=str(ws / "heldout"), output_dir=str(tmp_path / "run"), device="cpu",
                              max_steps=2, per_device_batch_size=2, warmup_steps=1, eval_every=0, save_every=0,
                              eval_samples=2, eval_batch_size=2, data_workers=0, mirror_loss_weight=0.5)
    plan_text = plan.plan_run(cfg, plan.target_config(cfg.target), device_type="cpu", mixed_precision="no").render()
    assert "activations" in plan_text and "target weights" in plan_text and "a copy of it trains" in plan_text
    assert distill.main(["--plan", "draft=mirror", f"target={ws / 'target'}", "device=cpu",
                         "plan_device_gb=80"]) == 0
    assert "plan: draft mirror" in capsys.readouterr().out
    final = distill.run(cfg)
    summary = json.loads((tmp_path / "run" / "train_summary.json").read_text())
    assert summary["steps"] == 2 and summary["config"]["mirror_loss_weight"] == 0.5
    assert draft_registry.of_checkpoint(final) is mirror  # saved by its core side
    trained = load_model(str(final), dtype="float32", device="cpu")
    assert isinstance(trained, MirrorDraft)
    target = load_model(str(ws / "target"), dtype="float32", device="cpu")
    assert not torch.equal(trained.lm.lm_head.weight, target.lm_head.weight)  # it trained
    out = pub.publish(pub.PublishConfig(draft=str(final), out=str(tmp_path / "pub"), target=str(ws / "target"),
                                        format="mirror"))
    assert "`mirror serve" in (out / "README.md").read_text()
