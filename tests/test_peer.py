"""bench/peer.py's plumbing on a tiny target: speculators' EAGLE-3 draft, trained a few steps by the bench's loop
on a data folder with recorded states, saves in its own format, loads into specdec (and back into speculators with
the same logits) and replays on held-out rows (tau computed); its packed batch is what its own `shift_batch` makes
of each sample, with the loss mask on the answer's tokens.

speculators is installed by scripts/setup.sh (`--no-deps`); these tests are skipped, with the reason, without it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import tiny_llama, tiny_tokenizer

pytest.importorskip("speculators.models.eagle3", reason="speculators 0.9.0 is not installed (scripts/setup.sh "
                    "installs it with --no-deps)")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import peer  # noqa: E402  (bench/peer.py)

LAYERS = [1, 2, 3]
KEEP = 64


def write_folder(folder: Path, target, samples: int, seed: int, completion: int = 8) -> None:
    """A `specdec data` folder of the target's greedy completions with its recorded states (final norm's output,
    then the residual streams after LAYERS, bf16, [len - 1, 4H] per row) and top-4 log-probs."""
    from specdec.eagle3 import RECORDED_STATES_DTYPE, target_states
    from specdec.train.data import features_file, write_features, write_shard

    g = torch.Generator().manual_seed(seed)
    rows = []
    with torch.no_grad():
        for i in range(samples):
            ids = torch.randint(7, 128, (int(torch.randint(3, 8, (1,), generator=g)),), generator=g).tolist()
            prompt, tops, lps = len(ids), [], []
            for _ in range(completion):
                top = target(torch.tensor([ids])).logits[0, -1].float().log_softmax(-1).topk(4)
                tops.append(top.indices.tolist())
                lps.append(top.values.tolist())
                ids.append(int(top.indices[0]))
            states = target_states(target, torch.tensor([ids[:-1]]), torch.ones(1, len(ids) - 1), LAYERS, final=True)[0]
            rows.append({"prompt_id": f"p{seed}-{i}", "category": "test", "sample_index": 0, "turn": 0,
                         "input_ids": ids, "prompt_length": prompt, "top_ids": tops, "top_logprobs": lps,
                         "features": states.to(RECORDED_STATES_DTYPE)})
    name = "shards/shard-00000.parquet"
    (folder / "shards").mkdir(parents=True)
    write_features(rows, folder / features_file(name))
    write_shard(rows, folder / name, top_logprobs=True)
    manifest = {"format": "specdec-data/1", "complete": True, "num_shards": 1, "fingerprint": f"peer-{seed}",
                "shards": [{"index": 0, "file": name, "examples": samples}],
                "features": {"layer_ids": LAYERS, "dtype": "bfloat16"}}
    (folder / "manifest.json").write_text(json.dumps(manifest))


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny float32 target saved locally (speculators reads its config, embeddings, head and norm there), data
    and held-out folders with recorded states, and the reduced vocabulary specdec's trainer would keep."""
    from specdec.models import save_model
    from specdec.train.batches import load_split

    root = tmp_path_factory.mktemp("peer")
    target = tiny_llama(seed=0, layers=4, dtype=torch.float32)
    tok = tiny_tokenizer()
    save_model(target, tok, root / "target")
    write_folder(root / "data", target, 12, seed=1)
    write_folder(root / "heldout", target, 4, seed=2)
    keep = peer.draft_vocabulary(load_split(root / "data"), tok, KEEP, target.config.vocab_size)
    return {"root": root, "target": target, "tok": tok, "keep": keep}


def test_packed_batch_is_speculators_shift_of_each_sample(world):
    data = peer.PeerData(world["root"] / "data", LAYERS, 32, batch=3, seed=0, max_length=64, pad_id=0)
    batch, scored = data(0)
    rows = data.dataset[data.schedule(0)]
    lengths = [len(ids) - 2 for ids in rows["input_ids"]]  # recorded positions (len - 1), then shifted by one
    assert batch["input_ids"].shape == (1, sum(lengths)) and batch["hidden_states"].shape == (1, sum(lengths), 96)
    assert batch["document_ids"][0].tolist() == [d for d, n in enumerate(lengths) for _ in range(n)]
    first = rows["input_ids"][0]
    assert batch["input_ids"][0, : lengths[0]].tolist() == first[1:-1]  # x_1 .. x_{n-2}: it reads x_{t+1}
    assert batch["position_ids"][0, : lengths[0]].tolist() == list(range(1, lengths[0] + 1))
    # the loss mask is its assistant-token mask shifted by one: predictions of x_{P+1} on (never of x_P)
    prompt = rows["prompt_length"][0]
    assert batch["loss_mask"][0, : lengths[0]].tolist() == [int(t + 1 >= prompt) for t in range(lengths[0])]
    assert scored == sum(len(ids) - p for ids, p in zip(rows["input_ids"], rows["prompt_length"]))


def test_peer_trains_saves_and_replays_in_specdec(world, tmp_path):
    from speculators.models.eagle3 import Eagle3DraftModel

    from specdec.eagle3 import Eagle3Draft

    verifier = str(world["root"] / "target")
    settings = dict(peer.PEER_DEFAULTS)
    model = peer.build_peer(verifier, LAYERS, world["keep"], settings, seed=0, attn="sdpa")
    assert isinstance(model, Eagle3DraftModel)
    assert not model.lm_head.weight.requires_grad and not model.embed_tokens.weight.requires_grad
    head = world["target"].lm_head.weight[world["keep"].sort().values]
    assert torch.equal(model.lm_head.weight, head)  # its head: the verifier's rows, frozen
    before = model.fc.weight.detach().clone()
    data = peer.PeerData(world["root"] / "data", LAYERS, 32, batch=4, seed=0, max_length=64, pad_id=0)
    out = peer.train_peer(model, data, settings, steps=3)
    assert out["tokens"] > 0 and len(out["losses"]) == 2 and all(torch.isfinite(torch.tensor(v)) for _, v in
                                                                  out["losses"])
    assert not torch.equal(model.fc.weight, before)
    folder = peer.save_peer(model, tmp_path / "peer")
    config = json.loads((folder / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["target_hidden_size"] in (None, 32)
    assert config["norm_before_residual"] is True and config["eagle_aux_hidden_state_layer_ids"] == LAYERS
    assert peer.tensor_names(folder) <= peer.VLLM_TENSORS
    assert peer.speculators_agrees(folder, verifier, world["root"] / "heldout", 64) < 1e-4
    from specdec.models import load_model

    loaded = load_model(str(folder), dtype="float32", device="cpu")
    assert isinstance(loaded, Eagle3Draft) and loaded.midlayer.norm_before_residual
    assert loaded.config.target_hidden_size == 32  # null in the peer's config: the draft's hidden size (issue 30)
    assert torch.equal(loaded.draft_to_target, world["keep"].sort().values)
    figures = peer.heldout_figures(folder, world["root"] / "heldout", world["tok"], 64)
    assert set(figures["tau"]) == set(peer.KS) and all(1.0 <= t <= k + 1 for k, t in figures["tau"].items())
    assert figures["positions"] > 0 and 0.0 <= figures["agreement"] <= 1.0


def test_peer_optimizers_are_speculators_own_or_specdecs(world):
    import torch.optim._muon as muon

    model = peer.build_peer(str(world["root"] / "target"), LAYERS, world["keep"], peer.PEER_DEFAULTS, seed=0)
    optimizers, schedulers = peer.peer_optimizers(model, peer.PEER_DEFAULTS, steps=100)
    assert [type(o).__name__ for o in optimizers] == ["Muon", "AdamW"] and len(schedulers) == 2
    ours = peer.peer_ours({"learning_rate": 2e-3, "warmup_steps": 30, "ttt_steps": 3, "ttt_decay": 0.8})
    optimizers, schedulers = peer.peer_optimizers(model, ours, steps=100)
    assert [type(o).__name__ for o in optimizers] == ["AdamW"] and optimizers[0].param_groups[0]["initial_lr"] == 2e-3
    # the float32 Newton-Schulz iteration is torch's bf16 one, up to bf16's rounding
    grad = torch.randn(48, 96, generator=torch.Generator().manual_seed(0))
    own = muon._zeropower_via_newtonschulz
    try:
        expected = own(grad, (3.4445, -4.7750, 2.0315), 5, 1e-7).float()
        peer.float32_newton_schulz()
        got = muon._zeropower_via_newtonschulz(grad, (3.4445, -4.7750, 2.0315), 5, 1e-7)
    finally:
        muon._zeropower_via_newtonschulz = own
    assert got.dtype == torch.float32 and torch.allclose(got, expected, atol=0.05)
    assert torch.equal(grad, torch.randn(48, 96, generator=torch.Generator().manual_seed(0)))  # left unchanged
