"""The parallel draft kind (specdec/parallel_draft.py): one draft forward a round, exact decoding, its replay and
choose_k's cost model."""

import pytest
import torch
from conftest import ragged_prompts, tiny_llama
from test_sampling_exact import ALPHA, PROMPTS, SETTINGS, VOCAB, combined_p, sample_counts

from specdec import SamplingConfig, draft_registry, speculative_generate, target_generate
from specdec.kv import Batch
from specdec.outputs import DecodeStats
from specdec.parallel_draft import (
    ParallelDrafter,
    ParallelKind,
    layout_logits,
    parallel_layout,
    parallel_ranks,
)
from specdec.proposal import Proposal
from specdec.ranks import teacher_forced_ranks

MASK = 5


def parallel(draft, mask: int = MASK):
    draft.config.pard_token = mask
    return draft


@pytest.fixture(scope="module")
def pair():
    return tiny_llama(seed=0), parallel(tiny_llama(seed=1, layers=1))


def test_the_registry_knows_a_parallel_draft_by_its_mask_token(pair):
    _, draft = pair
    assert draft_registry.of_model(draft).name == "parallel"
    assert draft_registry.of_config({"pard_token": 7}).name == "parallel"
    assert draft_registry.of_config({"model_type": "llama"}).name == "plain"
    assert draft_registry.of_model(tiny_llama(seed=1, layers=1)).name == "plain"
    assert draft_registry.get("parallel").vllm_speculative_config({}) == {"parallel_drafting": True}


def test_layout_reads_real_tokens_up_to_the_round_start_and_the_masks_before():
    ids = torch.tensor([[0, 11, 12, 13]])
    mask = torch.tensor([[0, 1, 1, 1]])  # one left pad
    flat, positions, allowed = parallel_layout(ids, mask, 3, MASK)
    assert flat.tolist() == [[0, 11, 12, 13] + [MASK] * 8]
    assert positions.tolist() == [[0, 0, 1, 2] * 3]
    # copy 2 at position 3: real tokens 1 (its round's last real token, 3 - 2), masks of copies 1 and 2 at 2 and 3
    row = allowed[0, 2 * 4 + 3].nonzero().flatten().tolist()
    assert row == [1, 4 + 2, 8 + 3]


def test_one_forward_proposes_what_the_layout_trains(pair):
    """The decoder's round (last token + k - 1 masks after the cache) and PARD's layout give the same logits."""
    target, draft = pair
    seq = torch.tensor([[9, 17, 33, 4, 60, 21, 8, 99]])
    n, k = 4, 3
    batch = Batch(seq[:, :n], None, 8, k + 1, None, 0)
    drafter = ParallelDrafter(draft, target, SamplingConfig())
    drafter.start(batch)
    stats = DecodeStats.for_proposal(Proposal.of(k))
    tokens, q = drafter.propose(batch, k, None, stats)
    assert q is None and stats.draft_forwards == 1
    assert drafter.cache.get_seq_length() == n  # the masks' entries are gone
    logits = layout_logits(draft, seq, torch.ones_like(seq), k, MASK)  # [k, 1, L, V]
    expected = [int(logits[j, 0, n - 1 + j].argmax()) for j in range(k)]
    assert tokens[0].tolist() == expected


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_is_token_identical_to_the_target(pair, k):
    target, draft = pair
    ids, mask = ragged_prompts(3, 128, seed=4)
    base = target_generate(target, ids, mask, max_new_tokens=20)
    out = speculative_generate(target, draft, ids, mask, num_draft_tokens=k, max_new_tokens=20)
    assert torch.equal(out.sequences, base.sequences)
    assert not out.stats.fallback, out.stats.fallback_reason
    assert out.stats.draft_forwards == out.stats.rounds  # one draft forward a round


@pytest.mark.parametrize("sampling", SETTINGS, ids=["t1.0", "t0.7-p0.9"])
def test_sampling_is_distributed_as_the_target(sampling):
    """tests/test_sampling_exact.py's chi-square on the joint of the first three tokens, ragged left-padded rows,
    k = 3 proposals from one forward, each with its own q."""
    target = tiny_llama(seed=0, vocab_size=VOCAB, hidden=16, dtype=torch.float32)
    draft = parallel(tiny_llama(seed=1, vocab_size=VOCAB, hidden=16, layers=1, dtype=torch.float32), mask=4)
    counts = sample_counts(target, draft, PROMPTS, sampling, k=3, calls=10, copies=700, seed=8)
    assert combined_p(target, PROMPTS, sampling, counts) > ALPHA


def test_parallel_replay_ranks_differ_from_the_teacher_forced_ones(pair):
    """Depth 1 is the plain teacher-forced rank; deeper ones read masks (so they differ somewhere)."""
    _, draft = pair
    ids, mask = ragged_prompts(2, 128, seed=9, min_len=10, max_len=14)
    loss = mask.clone()
    loss[:, :6] = 0
    got = parallel_ranks(draft, ids, mask, loss, 3)
    plain = teacher_forced_ranks(draft, ids, mask, loss, 3)
    assert [[r[0] for r in row] for row in got] == [[r[0] for r in row] for row in plain]
    assert got != plain


def test_choose_k_counts_one_draft_forward_a_round(pair):
    from specdec.eval import proposals

    kind = ParallelKind()
    chain = Proposal.of(4)
    assert kind.draft_forwards(chain) == 1 and draft_registry.PLAIN.draft_forwards(chain) == 4
    v = {str(chain.verified_nodes): 1.2}
    assert proposals.predicted_speedup(3.0, chain, 0.1, v, kind.draft_forwards(chain)) == pytest.approx(3.0 / 1.3)


# ---- training (train/parallel_train.py) -------------------------------------------------------------------


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    from conftest import save_tiny_world

    return save_tiny_world(tmp_path_factory.mktemp("parallel"), target_layers=2, small_seed=7, n_train=24,
                           n_heldout=6)


def _cfg(ws, out, **kw):
    from specdec.train.distill import TrainConfig

    base = dict(draft="parallel", target=str(ws / "target"), train_data=str(ws / "data"),
                heldout_data=str(ws / "heldout"), output_dir=str(out), device="cpu", draft_layers=[0], max_steps=3,
                per_device_batch_size=4, warmup_steps=1, log_every=1, eval_every=0, save_every=0, eval_samples=6,
                eval_batch_size=3, learning_rate=1e-2, parallel_tokens=3)
    base.update(kw)
    return TrainConfig(**base)


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_a_derived_parallel_run_writes_a_draft_that_decodes_exactly(workspace, tmp_path):
    import json

    from specdec.models import load_model
    from specdec.train import distill

    final = distill.run(_cfg(workspace, tmp_path / "run"))
    config = json.loads((final / "config.json").read_text())
    assert config["pard_token"] == 3  # the tiny tokenizer's unk, its one spare special id
    draft = load_model(str(final), dtype="float32", device="cpu")
    target = load_model(str(workspace / "target"), dtype="float32", device="cpu")
    assert draft_registry.of_model(draft).name == "parallel"
    history = [json.loads(line) for line in (tmp_path / "run" / "eval.jsonl").read_text().splitlines()]
    assert history and all(1.0 <= h["tau"]["4"] <= 5.0 for h in history)
    ids = torch.tensor([[1, 5, 9, 14, 20]])
    base = target_generate(target, ids, max_new_tokens=12)
    out = speculative_generate(target, draft, ids, num_draft_tokens=3, max_new_tokens=12)
    assert torch.equal(out.sequences, base.sequences) and not out.stats.fallback
    from specdec.train import publish as pub

    published = pub.publish(pub.PublishConfig(draft=str(final), out=str(tmp_path / "published"),
                                              target=str(workspace / "target")))
    assert json.loads((published / "config.json").read_text())["pard_token"] == 3
    assert '"parallel_drafting": true' in (published / "README.md").read_text()


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_lora_on_a_pretrained_base_with_an_offline_teacher_and_a_chosen_mask(workspace, tmp_path):
    import json

    from specdec.train import distill

    final = distill.run(_cfg(workspace, tmp_path / "run", parallel_base=str(workspace / "small"), lora=True,
                             lora_r=4, loss="ce", teacher="offline", max_steps=2, pard_token=100))
    assert not (final / "adapter_config.json").exists()
    assert json.loads((final / "config.json").read_text())["pard_token"] == 100


def test_the_loss_trains_every_depth_from_masks():
    """Each copy's scored positions: loss positions whose round start (t - copy) is a real token."""
    from specdec.parallel_draft import scored_in_copy

    loss = torch.tensor([[0, 0, 1, 1, 1, 0]])
    attention = torch.tensor([[0, 1, 1, 1, 1, 1]])
    assert scored_in_copy(loss, attention, 0).long().tolist() == [[0, 0, 1, 1, 1, 0]]
    assert scored_in_copy(loss, attention, 2).long().tolist() == [[0, 0, 0, 1, 1, 0]]


def test_options_are_checked_with_the_key_named(workspace, tmp_path):
    with pytest.raises(ValueError, match="parallel_tokens"):
        _cfg(workspace, tmp_path, parallel_tokens=1)
    with pytest.raises(ValueError, match="on_policy"):
        _cfg(workspace, tmp_path, teacher="on_policy")


def test_the_plan_counts_the_copies(workspace, tmp_path):
    from transformers import AutoConfig

    from specdec.train import plan

    target = AutoConfig.from_pretrained(str(workspace / "target"))

    def activations(copies: int) -> float:
        run = plan.plan_run(_cfg(workspace, tmp_path, parallel_tokens=copies), target, device_type="cpu",
                            mixed_precision="no")
        return next(t.bytes for t in run.phases["train step"] if t.name == "activations")

    assert activations(4) > 1.9 * activations(2)


def test_the_speculative_config_asks_vllm_for_parallel_drafting(tmp_path):
    import json
    from types import SimpleNamespace

    from specdec.eval.engine import vllm
    from specdec.parallel_draft import CONFIG_KEY

    (tmp_path / "draft").mkdir()
    (tmp_path / "draft" / "config.json").write_text(json.dumps({"model_type": "llama", CONFIG_KEY: 7}))
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    cfg = SimpleNamespace(vllm_speculative_config=None)
    spec = vllm.speculative_config("draft_model", str(tmp_path / "draft"), 3, cfg)
    assert spec["parallel_drafting"] is True and spec["method"] == "draft_model"
    assert "parallel_drafting" not in vllm.speculative_config("draft_model", str(tmp_path / "plain"), 3, cfg)
