"""bench/peer_dflash.py on a tiny target: speculators' DFlash draft packed as its pipeline feeds a DFlash run, and
the whole bench at a tiny size (data folders with recorded states, both trainers in their own processes, the
held-out replay of both saved folders, the results page with both rows and finite figures).

speculators is installed by scripts/setup.sh (`--no-deps`); these tests are skipped, with the reason, without it."""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import pytest
import torch
from conftest import tiny_llama, tiny_tokenizer

pytest.importorskip("speculators.models.dflash", reason="speculators 0.9.0 is not installed (scripts/setup.sh "
                    "installs it with --no-deps)")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import peer_dflash  # noqa: E402  (bench/peer_dflash.py)
import results  # noqa: E402  (bench/results.py)
from test_peer import LAYERS, write_folder  # noqa: E402

BLOCK = 4


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny float32 target saved locally and bench/peer.py's two data folders under work/."""
    from specdec.models import save_model

    root = tmp_path_factory.mktemp("peer-dflash")
    target = tiny_llama(seed=0, layers=4, dtype=torch.float32)
    save_model(target, tiny_tokenizer(), root / "target")
    write_folder(root / "work" / "data", target, 12, seed=1)
    write_folder(root / "work" / "data_heldout", target, 4, seed=2)
    return root


def test_packed_batch_is_each_sample_unshifted_then_a_padded_tail(world):
    data = peer_dflash.DFlashPeerData(world / "work" / "data", LAYERS, 32, batch=3, seed=0, max_length=64, pad_id=0,
                                      block=BLOCK)
    batch, scored = data(0)
    rows = data.dataset[data.schedule(0)]
    lengths = [len(ids) for ids in rows["input_ids"]]
    total = sum(lengths) + BLOCK
    assert batch["input_ids"].shape == (1, total) and batch["hidden_states"].shape == (1, total, 96)
    assert batch["document_ids"][0].tolist() == [d for d, n in enumerate(lengths) for _ in range(n)] + [-1] * BLOCK
    first, prompt = rows["input_ids"][0], rows["prompt_length"][0]
    assert batch["input_ids"][0, : lengths[0]].tolist() == first  # no shift: token t with the states at t
    assert batch["position_ids"][0, : lengths[0]].tolist() == list(range(lengths[0]))
    assert batch["loss_mask"][0, : lengths[0]].tolist() == [int(t >= prompt) for t in range(lengths[0])]
    assert batch["loss_mask"][0, -BLOCK:].sum() == 0 and batch["hidden_states"][0, -BLOCK:].abs().sum() == 0
    # the last token has no recorded state: zeros there, the recording everywhere before
    assert batch["hidden_states"][0, lengths[0] - 1].abs().sum() == 0
    assert batch["verifier_last_hidden_states"][0, : lengths[0] - 1].abs().sum(-1).min() > 0
    assert scored == sum(len(ids) - p for ids, p in zip(rows["input_ids"], rows["prompt_length"]))


def test_bench_writes_its_page_with_both_rows_and_finite_figures(world, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(results, "RESULTS", tmp_path / "results")  # never the repository's docs/results
    path = peer_dflash.main([
        "--target", str(world / "target"), "--work", str(world / "work"), "--layer-ids", *map(str, LAYERS),
        "--draft-vocab", "64", "--block", str(BLOCK), "--steps", "3", "--batch", "2", "--max-new-tokens", "8",
        "--train-prompts", "12", "--heldout-prompts", "4", "--max-length", "64"])
    assert path.parent == tmp_path / "results" and path.name.endswith("-peer-dflash.md")
    text = path.read_text()
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if re.match(r"\| (specdec|peer) \|", line)}
    assert set(rows) == {"specdec", "peer"}
    for line in rows.values():
        figures = [float(x) for x in line.strip("| ").split("|")[1:]]
        assert len(figures) == 3 + (BLOCK - 1) + 4 and all(math.isfinite(x) for x in figures)
        taus = figures[3:3 + BLOCK - 1]
        assert all(1.0 <= t <= k + 1 for k, t in enumerate(taus, 1))  # tau(k): 1 .. k + 1 tokens a round
    ratio = re.search(r"specdec / peer: held-out tau\(3\) ([\d.]+)x, trained tokens/s ([\d.]+)x, peak RSS ([\d.]+)x",
                      text)
    assert ratio and all(math.isfinite(float(x)) and float(x) > 0 for x in ratio.groups())
    # both folders load in speculators and in specdec with the same logits
    diffs = [float(x) for x in re.findall(r"max \|logit difference\| to specdec's on held-out blocks ([\d.e+-]+)",
                                          text)]
    assert len(diffs) == 2 and all(d < 1e-3 for d in diffs)
    assert "specdec / peer" in capsys.readouterr().out  # the ratios are printed too
