"""`specdec publish`: plain HF export, model card, reduced-vocabulary export (expanded or not), Hub push."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import yaml
from conftest import tiny_llama, tiny_tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from specdec import SamplingConfig, speculative_generate, vocab
from specdec.models import load_model, save_model
from specdec.train import publish as pub
from specdec.train.model_card import CardInfo, render_card

TARGET_NAME = "acme/tiny-target"

REPORT = {
    "config": {"target": TARGET_NAME, "draft": "runs/draft", "num_draft_tokens": 5, "temperature": 0.0,
               "max_new_tokens": 64, "batch_size": 1, "num_prompts": 80},
    "environment": {"python": "3.12.1", "torch": "2.13.0", "transformers": "5.24.0", "device": "cpu", "threads": 2},
    "baseline": {"tokens_per_s": 17.25, "latency_s": {"p50": 3.712, "p95": 4.1, "p99": 4.4}},
    "speculative": {"tokens_per_s": 23.61, "latency_s": {"p50": 2.713, "p95": 3.0, "p99": 3.3},
                    "acceptance_rate": 0.6234, "mean_accepted_tokens": 3.4123},
    "speedup": 1.3687,
    "equivalence": {"mode": "greedy", "passed": True, "checked": 80, "mismatches": 0},
    "decision": {"verdict": "enable", "reasons": ["speedup 1.37x above 1.10x"]},
}


def _save_draft(folder: Path, model, tokenizer=None) -> Path:
    save_model(model, tokenizer, folder)
    return folder


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def keep_ids():
    # Specials plus a seeded half of the vocabulary: a reduced head of 64 of 128 ids.
    g = torch.Generator().manual_seed(3)
    rest = 4 + torch.randperm(124, generator=g)[:60]
    return torch.cat([torch.arange(4), rest]).sort().values


@pytest.fixture(scope="module")
def full_dir(tmp_path_factory, tok):
    return _save_draft(tmp_path_factory.mktemp("full") / "draft", tiny_llama(seed=1, layers=1), tok)


@pytest.fixture(scope="module")
def reduced_dir(tmp_path_factory, tok, keep_ids):
    model = vocab.apply_reduced_head(tiny_llama(seed=1, layers=1), keep_ids)
    return _save_draft(tmp_path_factory.mktemp("reduced") / "draft", model, tok)


def _cfg(draft: Path, out: Path, **kw) -> pub.PublishConfig:
    kw.setdefault("target", TARGET_NAME)
    return pub.PublishConfig(draft=str(draft), out=str(out), **kw)


def _front_matter(card: str) -> dict:
    match = re.match(r"---\n(.*?)\n---\n", card, re.S)
    assert match, "card must start with YAML front matter"
    return yaml.safe_load(match.group(1))


def _section(card: str, title: str) -> str:
    return card.split(f"## {title}", 1)[1].split("\n## ", 1)[0]


# --- export and use in transformers ------------------------------------------------------------------------

def test_full_export_is_a_plain_checkpoint_and_an_exact_assistant(full_dir, tmp_path, tok):
    out = pub.publish(_cfg(full_dir, tmp_path / "pub", report=None))
    for name in ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json", "README.md"):
        assert (out / name).is_file(), name
    assert not (out / vocab.VOCAB_MAP_FILE).exists()
    assert not list(tmp_path.glob(".pub.tmp-*")), "the temporary folder must be gone"

    draft = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64).eval()
    source = load_model(str(full_dir), dtype=torch.float64, device="cpu")
    for (name, a), (_, b) in zip(source.state_dict().items(), draft.state_dict().items()):
        assert torch.equal(a, b), name
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == tok.eos_token_id

    target = tiny_llama(seed=0)
    out_tok = AutoTokenizer.from_pretrained(out)
    for text in ("explain the story of the city", "write a short poem about water and food"):
        enc = out_tok(text, return_tensors="pt")
        kw = dict(do_sample=False, max_new_tokens=24, pad_token_id=0, eos_token_id=None)
        alone = target.generate(**enc, **kw)
        assisted = target.generate(**enc, assistant_model=draft, **kw)
        assert torch.equal(alone, assisted)


def test_out_must_be_new_or_overwritten(full_dir, tmp_path):
    out = tmp_path / "pub"
    pub.publish(_cfg(full_dir, out))
    (out / "stale.txt").write_text("left by an earlier export")
    with pytest.raises(ValueError, match="earlier export.*overwrite=true"):
        pub.publish(_cfg(full_dir, out))
    assert (out / "stale.txt").is_file()
    pub.publish(_cfg(full_dir, out, overwrite=True))
    assert (out / "README.md").is_file() and not (out / "stale.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pub"], "no temporary or old folders left behind"
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("user data")
    with pytest.raises(ValueError, match="did not write"):
        pub.publish(_cfg(full_dir, foreign, overwrite=True))
    assert (foreign / "keep.txt").read_text() == "user data"


def test_empty_out_folder_is_fine_and_out_cannot_hold_the_draft(full_dir, tmp_path):
    (tmp_path / "empty").mkdir()
    assert (pub.publish(_cfg(full_dir, tmp_path / "empty")) / "README.md").is_file()
    with pytest.raises(ValueError, match="contain or replace the draft"):
        pub.publish(_cfg(full_dir, full_dir.parent, overwrite=True))
    with pytest.raises(ValueError, match="not a checkpoint folder"):
        pub.publish(_cfg(tmp_path / "missing", tmp_path / "x"))


def test_tokenizer_taken_from_target_or_clear_error(tmp_path, tok):
    bare = _save_draft(tmp_path / "bare", tiny_llama(seed=1, layers=1))
    with pytest.raises(ValueError, match="no tokenizer"):
        pub.publish(_cfg(bare, tmp_path / "a", target=str(tmp_path / "nowhere")))
    target_dir = _save_draft(tmp_path / "target", tiny_llama(seed=0), tok)
    out = pub.publish(_cfg(bare, tmp_path / "b", target=str(target_dir)))
    assert AutoTokenizer.from_pretrained(out).get_vocab() == tok.get_vocab()
    card = (out / "README.md").read_text()
    assert "base_model" not in _front_matter(card), "a local target is not a Hub id"
    assert f"`{target_dir.name}`" in card and str(tmp_path) not in card, "a local target by its folder's name"

    other = tiny_tokenizer()
    other.add_special_tokens({"additional_special_tokens": ["<extra>"]})
    other_dir = tmp_path / "other-target"
    other.save_pretrained(other_dir)
    with pytest.raises(ValueError, match="tokenizer differs"):
        pub.publish(_cfg(target_dir, tmp_path / "c", target=str(other_dir)))


def test_target_required_and_read_from_report(full_dir, tmp_path):
    with pytest.raises(ValueError, match="--target"):
        pub.publish(pub.PublishConfig(draft=str(full_dir), out=str(tmp_path / "a")))
    report = tmp_path / "report.json"
    report.write_text(json.dumps(REPORT))
    out = pub.publish(pub.PublishConfig(draft=str(full_dir), out=str(tmp_path / "b"), report=str(report)))
    card = (out / "README.md").read_text()
    assert _front_matter(card)["base_model"] == TARGET_NAME
    assert "0.623" in card and json.loads((out / "specdec_eval_report.json").read_text()) == REPORT
    assert json.loads((out / pub.PROVENANCE_FILE).read_text())["target"] == TARGET_NAME
    with pytest.raises(ValueError, match="report"):
        pub.publish(_cfg(full_dir, tmp_path / "c", report=str(tmp_path / "missing.json")))


def test_config_validation():
    with pytest.raises(ValueError, match="--draft"):
        pub.PublishConfig(out="x")
    with pytest.raises(ValueError, match="--out"):
        pub.PublishConfig(draft="x")
    with pytest.raises(ValueError, match="repo id"):
        pub.PublishConfig(draft="x", out="y", push_to_hub="not a/valid/repo id")
    with pytest.raises(ValueError, match="dtype"):
        pub.PublishConfig(draft="x", out="y", dtype="float13")


# --- model card ---------------------------------------------------------------------------------------------

def _info(**kw) -> CardInfo:
    base = dict(name="tiny-draft", model_ref="me/tiny-draft", target=TARGET_NAME, target_ref=TARGET_NAME,
                base_model=TARGET_NAME, architecture="LlamaForCausalLM", num_layers=1, hidden_size=32,
                num_parameters=12345, dtype="float32", vocab_size=128, recipe="recipes/tiny.yaml",
                data="prompts=specbench, samples=200", license="mit")
    base.update(kw)
    return CardInfo(**base)


def test_card_metadata_parses_and_names_the_target():
    card = render_card(_info(), REPORT)
    meta = _front_matter(card)
    assert meta["base_model"] == TARGET_NAME
    assert {"speculative-decoding", "draft-model"} <= set(meta["tags"])
    assert meta["pipeline_tag"] == "text-generation"
    assert meta["library_name"] == "transformers" and meta["license"] == "mit"
    assert "recipes/tiny.yaml" in card and "prompts=specbench, samples=200" in card


def test_card_results_come_from_the_report():
    card = render_card(_info(), REPORT)
    results = _section(card, "Results")
    for figure in ("0.623", "3.41", "1.37x", "17.2", "23.6", "3.712", "2.713", "| k (draft tokens per round) | 5 |",
                   "device cpu", "threads 2", "torch 2.13.0", "greedy: passed (0 mismatches in 80 checked)",
                   "enable", "speedup 1.37x above 1.10x"):
        assert figure in results, figure
    # k from the report flows into every engine's snippet.
    assert '"num_speculative_tokens": 5' in card
    assert "--speculative-num-steps 5 --speculative-eagle-topk 1 --speculative-num-draft-tokens 6" in card
    assert "num_assistant_tokens = 5" in card and "--num-draft-tokens 5" in card


def test_the_card_gives_the_reports_intervals_beside_its_figures():
    report = {**REPORT, "intervals": {"level": 0.95, "resamples": 2000, "batches": 80,
                                      "acceptance_rate": [0.5811, 0.6602], "speedup": [1.2913, 1.4425]}}
    results = _section(render_card(_info(), report), "Results")
    assert "| acceptance rate, 95% interval over the prompts (bootstrap) | 0.581 - 0.660 |" in results
    assert "| speedup, 95% interval over the prompts (bootstrap) | 1.29x - 1.44x |" in results
    assert "interval" not in render_card(_info(), REPORT)  # an older report: no rows for them


@pytest.mark.parametrize("tree, depth", [("4x1", 2), ("4", 1)])
def test_a_report_measured_with_a_tree_says_so_and_engines_get_its_depth(tree, depth):
    # as report.json writes a tree's row: its depth in tree_depth, num_draft_tokens null
    report = {**REPORT, "config": {**REPORT["config"], "num_draft_tokens": None, "tree": tree, "tree_depth": depth}}
    card = render_card(_info(), report)
    results = _section(card, "Results")
    assert f"| {tree} (depth {depth}) |" in results and "| k (draft tokens per round)" not in card
    assert "| acceptance rate (accepted tokens per tree level: higher than its chain's with the same draft) |" in results
    assert f'tree="{tree}"' in card and f"tree={tree} --max-new-tokens" in card
    # vLLM runs the draft as a chain of the tree's depth
    assert f'"num_speculative_tokens": {depth}' in card and "--speculative-num-steps " + str(depth) in card


def test_card_names_the_task_types_where_the_draft_is_weak():
    cats = {name: {"prompts": n, "baseline_tokens_per_s": 17.0, "speculative_tokens_per_s": 20.0, "speedup": s,
                   "acceptance_rate": a, "mean_accepted_tokens": 2.0}
            for name, n, a, s in (("coding", 12, 0.74, 1.52), ("math", 11, 0.66, 1.41),
                                  ("translation", 11, 0.41, 1.02), ("long-summarisation", 10, 0.50, 1.11))}
    card = render_card(_info(), {**REPORT, "categories": cats})
    section = _section(card, "By task type")
    assert "| task type | prompts | acceptance | speedup |" in section
    assert "| translation | 11 | 0.410 | 1.02x |" in section and "| coding | 12 | 0.740 | 1.52x |" in section
    # more than 0.1 below the overall 0.623: the lowest first; math (0.66) and coding are not named
    weak = section.split("The draft is weak on ", 1)[1]
    assert weak.startswith("translation (0.410) and long-summarisation (0.500): acceptance more than 0.1 below")
    assert "math" not in weak and "coding" not in weak and "Training the draft on more prompts" in weak

    even = {name: {**c, "acceptance_rate": 0.6} for name, c in cats.items()}
    section = _section(render_card(_info(), {**REPORT, "categories": even}), "By task type")
    assert "weak" not in section and "No task type's acceptance is more than 0.1 below" in section
    assert "By task type" not in render_card(_info(), REPORT)  # no categories, no section


def test_card_without_report_states_no_figures():
    card = render_card(_info(), None)
    results = _section(card, "Results")
    assert "Not measured" in results
    assert not re.search(r"\d", results), results
    for word in ("tokens/s", "acceptance rate |", "speedup ("):
        assert word not in card
    prose = re.sub(r"```.*?```", "", card, flags=re.S)  # snippets hold settings (k, max tokens), not figures
    assert not re.search(r"\d\.\d", prose), "no decimal figure anywhere without a report"


def test_card_missing_report_fields_say_not_reported():
    card = render_card(_info(), {"config": {"num_draft_tokens": 3}})
    assert "| speedup (baseline time / speculative time) | not reported |" in card


def test_card_snippets_match_engine_apis():
    card = render_card(_info(), None)
    assert "assistant_model=draft" in card
    assert 'speculative_config={"model": "me/tiny-draft", "method": "draft_model", "num_speculative_tokens": 4}' in card
    assert "--speculative-algorithm STANDALONE --speculative-draft-model-path me/tiny-draft" in card
    assert "specdec eval --target acme/tiny-target --draft me/tiny-draft" in card


def test_card_reduced_head_warns_and_expanded_head_explains():
    reduced = render_card(_info(head="reduced", draft_vocab_size=64), None)
    assert "Warning" in reduced and "--full-vocab-head" in reduced
    assert "speculative_config" not in reduced, "stock-engine snippets would not load this export"
    assert 'load_model("me/tiny-draft")' in reduced
    on_hub = render_card(_info(head="reduced", draft_vocab_size=64, model_on_hub=True), None)
    assert 'load_model(snapshot_download("me/tiny-draft"))' in on_hub
    assert "hf download me/tiny-draft --local-dir drafts/tiny-draft\nspecdec eval --target acme/tiny-target " \
           "--draft drafts/tiny-draft" in on_hub
    expanded = render_card(_info(head="expanded", draft_vocab_size=64, expansion={
        "positions": 40, "greedy_agreement": True, "min_margin": 7.5, "max_dropped_mass": 1.5e-4, "median_dropped_mass": 2e-7}), None)
    section = _section(expanded, "Expanded vocabulary head")
    assert "never proposes a dropped id" in section and "cost" in section
    assert "identical to the reduced head" in section and "1.50e-04" in section and "Note" not in section
    leaky = render_card(_info(head="expanded", draft_vocab_size=64, expansion={
        "positions": 40, "greedy_agreement": True, "min_margin": 0.2, "max_dropped_mass": 0.3, "median_dropped_mass": 0.1}), None)
    assert "accepted less often" in _section(leaky, "Expanded vocabulary head")
    with pytest.raises(ValueError, match="draft_vocab_size"):
        _info(head="reduced")


# --- reduced vocabulary ------------------------------------------------------------------------------------

def test_reduced_export_keeps_the_id_map(reduced_dir, tmp_path, keep_ids):
    out = pub.publish(_cfg(reduced_dir, tmp_path / "pub"))
    assert (out / vocab.VOCAB_MAP_FILE).is_file()
    assert json.loads((out / "config.json").read_text())[vocab.CONFIG_KEY] == 64
    exported = load_model(str(out), dtype=torch.float64, device="cpu")
    source = load_model(str(reduced_dir), dtype=torch.float64, device="cpu")
    assert torch.equal(vocab.draft_to_target_map(exported), keep_ids)
    for (name, a), (_, b) in zip(source.state_dict().items(), exported.state_dict().items()):
        assert torch.equal(a, b), name
    card = (out / "README.md").read_text()
    assert "Warning" in card and "need the expanded export" in card


def test_expanded_export_loads_in_transformers_and_proposes_the_same_tokens(reduced_dir, tmp_path, keep_ids):
    out = pub.publish(_cfg(reduced_dir, tmp_path / "pub", full_vocab_head=True))
    assert not (out / vocab.VOCAB_MAP_FILE).exists()
    assert vocab.CONFIG_KEY not in json.loads((out / "config.json").read_text())
    expanded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64).eval()
    reduced = load_model(str(reduced_dir), dtype=torch.float64, device="cpu")
    assert expanded.lm_head.weight.shape[0] == 128
    assert torch.equal(expanded.lm_head.weight[keep_ids], reduced.lm_head.weight)

    # Greedy proposals: at every position of a few inputs, the expanded argmax is the reduced argmax.
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, 128, (4, 24), generator=g)
    with torch.no_grad():
        full_logits, red_logits = expanded(ids).logits, reduced(ids).logits  # [B, T, 128], [B, T, 64]
    assert torch.equal(full_logits.argmax(-1), keep_ids[red_logits.argmax(-1)])
    # Dropped ids are never above the best kept id (the anchor row is a mean of kept rows).
    dropped = torch.ones(128, dtype=torch.bool)
    dropped[keep_ids] = False
    assert (full_logits[..., dropped].max(-1).values < full_logits[..., keep_ids].max(-1).values).all()

    # End to end: the exact decoder sees identical proposals, hence identical accept/reject statistics.
    target = tiny_llama(seed=0)
    prompt = torch.randint(3, 128, (1, 6), generator=g)
    runs = [speculative_generate(target, d, prompt, num_draft_tokens=3, max_new_tokens=24,
                                 sampling=SamplingConfig(temperature=0.0)) for d in (reduced, expanded)]
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    assert runs[0].stats.as_dict() == runs[1].stats.as_dict()
    # ... and transformers runs it unchanged as an assistant, with the target's own greedy output.
    kw = dict(do_sample=False, max_new_tokens=16, pad_token_id=0)
    mask = torch.ones_like(prompt)
    assert torch.equal(target.generate(prompt, attention_mask=mask, assistant_model=expanded, **kw),
                       target.generate(prompt, attention_mask=mask, **kw))
    card = (out / "README.md").read_text()
    assert "identical to the reduced head" in card and "Warning" not in card


def test_anchor_rows_give_dropped_ids_tiny_probability():
    """Trained LMs' hidden states share a dominant direction, and some kept rows (rare tokens) lose along it at
    every position. The anchor finds those rows, so dropped ids get ~0 probability; a plain mean of the kept
    rows would leak far more."""
    model = tiny_llama(seed=1, layers=1)
    keep = torch.arange(0, 128, 2)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] += 10.0  # the dominant residual direction
        model.lm_head.weight[keep[-2:]] = 0.0
        model.lm_head.weight[keep[-2:], 0] = -40.0  # two sure-loser rows
    vocab.apply_reduced_head(model, keep)
    reduced_weight = model.lm_head.weight.detach().clone()
    pub.expand_head(model, anchor_fraction=0.05)
    ids = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(2))
    check = pub.check_expansion(model, reduced_weight, keep, ids)
    assert check["greedy_agreement"] and check["positions"] == 128
    hidden = pub._hidden_states(model, ids)
    kept_logits = hidden @ reduced_weight.T  # [T, 64]
    centroid_logit = (hidden @ reduced_weight.mean(0))[:, None].expand(-1, 64)  # [T, 64 dropped]
    centroid_mass = torch.cat([kept_logits, centroid_logit], 1).softmax(-1)[:, 64:].sum(-1)
    assert check["max_dropped_mass"] < 1e-9 and float(centroid_mass.median()) > 1e-4


def test_check_expansion_catches_a_dropped_row_that_wins(keep_ids):
    model = vocab.apply_reduced_head(tiny_llama(seed=1, layers=1), keep_ids)
    reduced_weight = model.lm_head.weight.detach().clone()
    pub.expand_head(model)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(4))
    assert pub.check_expansion(model, reduced_weight, keep_ids, ids)["greedy_agreement"]
    dropped = next(i for i in range(128) if i not in set(keep_ids.tolist()))
    with torch.no_grad():
        model.lm_head.weight[dropped] = 10.0 * reduced_weight.abs().max() * torch.ones(32)  # beats kept ids often
        model.lm_head.weight[dropped] *= torch.sign(pub._hidden_states(model, ids).mean(0))
    check = pub.check_expansion(model, reduced_weight, keep_ids, ids)
    assert not check["greedy_agreement"] and check["min_margin"] < 0


@pytest.mark.slow
def test_expanded_smollm2_head_gives_dropped_ids_almost_no_probability(tmp_path):
    """The real target with a head reduced to its 8,192 lowest (most frequent BPE) ids, exported in bfloat16."""
    from specdec.models import EMBEDDED_TARGET, load_tokenizer

    model = load_model(EMBEDDED_TARGET, dtype=torch.bfloat16, device="cpu")
    vocab.apply_reduced_head(model, torch.arange(8192))
    save_model(model, load_tokenizer(EMBEDDED_TARGET), tmp_path / "draft")
    out = pub.publish(_cfg(tmp_path / "draft", tmp_path / "pub", target=EMBEDDED_TARGET, full_vocab_head=True))
    check = json.loads((out / pub.PROVENANCE_FILE).read_text())["expansion"]
    assert check["greedy_agreement"] and check["min_margin"] > 1.0
    assert check["max_dropped_mass"] < 1e-2 and check["median_dropped_mass"] < 1e-4
    meta = _front_matter((out / "README.md").read_text())
    assert meta["base_model"] == pub.EMBEDDED_HUB_ID
    expanded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    assert expanded.lm_head.weight.shape[0] == 49152 and expanded.dtype == torch.bfloat16


def test_expand_head_rejects_full_heads_and_single_ids():
    with pytest.raises(ValueError, match="reduced-vocabulary"):
        pub.expand_head(tiny_llama(seed=1, layers=1))
    one = vocab.apply_reduced_head(tiny_llama(seed=1, layers=1), torch.tensor([5]))
    with pytest.raises(ValueError, match="single id"):
        pub.expand_head(one)


# --- CLI and Hub push --------------------------------------------------------------------------------------

def test_cli_flags_and_recipe(reduced_dir, tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"target": TARGET_NAME, "data": {"prompts": "shared/prompts.jsonl", "samples": 50},
                                      "publish": {"license": "mit"}}))
    out = tmp_path / "pub"
    argv = ["--config", str(recipe), "--draft", str(reduced_dir), "--out", str(out), "--full-vocab-head"]
    assert pub.main(argv) == 0
    card = (out / "README.md").read_text()
    assert _front_matter(card)["license"] == "mit"
    assert "`recipe.yaml`" in card and "prompts=shared/prompts.jsonl, samples=50" in card
    assert str(tmp_path) not in card, "no local absolute path in the card"
    assert "Expanded vocabulary head" in card

    from specdec.cli import main as cli_main
    assert cli_main(["publish", "--draft", str(reduced_dir), "--out", str(out), "--target", TARGET_NAME]) == 2
    assert cli_main(["publish", "--help"]) == 0


class _FakeHub:
    def __init__(self, fail: Exception | None = None):
        self.calls: list[tuple[str, dict]] = []
        self.fail = fail

    def install(self, monkeypatch):
        from huggingface_hub import HfApi

        def create_repo(api, repo_id, **kw):
            self.calls.append(("create_repo", {"repo_id": repo_id, **kw}))
            if self.fail is not None:
                raise self.fail
            return f"https://huggingface.co/{repo_id}"

        def upload_folder(api, **kw):
            self.calls.append(("upload_folder", {**kw, "files": sorted(p.name for p in Path(kw["folder_path"]).iterdir())}))

        monkeypatch.setattr(HfApi, "create_repo", create_repo)
        monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        return self


def test_push_to_hub_uploads_the_export(full_dir, tmp_path, monkeypatch):
    hub = _FakeHub().install(monkeypatch)
    out = pub.publish(_cfg(full_dir, tmp_path / "pub", push_to_hub="me/tiny-draft", private=True))
    (create, create_kw), (upload, upload_kw) = hub.calls
    assert create == "create_repo" and create_kw["repo_id"] == "me/tiny-draft" and create_kw["private"] is True
    assert create_kw["exist_ok"] is True
    assert upload == "upload_folder" and upload_kw["repo_id"] == "me/tiny-draft"
    assert Path(upload_kw["folder_path"]) == out and "README.md" in upload_kw["files"]
    card = (out / "README.md").read_text()
    assert "# me/tiny-draft" in card and 'from_pretrained("me/tiny-draft")' in card


def test_push_failure_is_a_clear_error_and_keeps_out(full_dir, tmp_path, monkeypatch):
    _FakeHub(fail=ConnectionError("Failed to resolve huggingface.co")).install(monkeypatch)
    out = tmp_path / "pub"
    with pytest.raises(ValueError, match="could not push.*untouched.*hf upload me/tiny-draft"):
        pub.publish(_cfg(full_dir, out, push_to_hub="me/tiny-draft"))
    assert (out / "README.md").is_file() and (out / "model.safetensors").is_file()
    AutoModelForCausalLM.from_pretrained(out)

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="HF_HUB_OFFLINE"):
        pub.push_to_hub(out, "me/tiny-draft")


def test_eagle3_export_is_what_vllm_and_sglang_load_and_is_exact(tmp_path, tok, keep_ids):
    """An EAGLE-3 draft publishes in the engines' layout: the vLLM and SGLang keys written out in each one's
    numbering, the reduced vocabulary as d2t offsets, the card with both engines' snippets and the method named;
    it loads back and decodes exactly; --full-vocab-head changes nothing."""
    from safetensors.torch import load_file

    from specdec import target_generate
    from specdec.eagle3 import Eagle3Draft

    target = tiny_llama(seed=0, layers=4)
    draft = _save_draft(tmp_path / "e3", Eagle3Draft.from_target(target, [1, 2, 3], keep_ids=keep_ids), tok)
    out = pub.publish(_cfg(draft, tmp_path / "pub", full_vocab_head=True))
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]  # vLLM: after i layers (read first)
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]  # SGLang: output of layer i
    assert config["norm_before_residual"] is False and config["draft_vocab_size"] == len(keep_ids)
    assert config["vocab_size"] == 128 and config["target_hidden_size"] == 32
    weights = load_file(str(out / "model.safetensors"))
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "midlayer.hidden_norm.weight",
            "midlayer.self_attn.q_proj.weight", "embed_tokens.weight"} <= set(weights)
    assert torch.equal(torch.arange(len(keep_ids)) + weights["d2t"], keep_ids) and weights["t2d"].sum() == len(keep_ids)
    assert weights["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * 32 and weights["fc.weight"].shape == (32, 96)
    card = (out / "README.md").read_text()
    assert '"method": "eagle3"' in card and "--speculative-algorithm EAGLE3" in card
    assert "assistant_model=draft" not in card and "need the expanded export" not in card
    exported = load_model(str(out), dtype=torch.float64, device="cpu")
    assert isinstance(exported, Eagle3Draft) and torch.equal(vocab.draft_to_target_map(exported), keep_ids)
    ids = torch.tensor([[5, 9, 33, 12]])
    ref = target_generate(target, ids, max_new_tokens=12)
    assert torch.equal(speculative_generate(target, exported, ids, num_draft_tokens=3, max_new_tokens=12).sequences,
                       ref.sequences)
