"""bench/kinds.py's draft kinds and their training: each kind's TrainConfig on the shared data, and the child process
that trains one for its minutes, scores the final draft with the trainer's own held-out replay and publishes it.

Every kind trains with specdec's trainer (`specdec.train.distill.Distiller`) at the demo recipe's shared train
settings (recipes/smollm2-135m-eagle3.yaml: learning rate, warm-up, loss, teacher, batch, max length, draft
vocabulary) and its own keys below. The hidden-state kinds read the target states the data stage recorded (the
recipe's layers, so one recording serves them all); the parallel kind, a plain draft, runs the target as its
teacher in every step, as that kind must (its derived base needs the loaded target).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import peer  # bench/peer.py (the bench runs with bench/ on its path)

KS = peer.KS  # held-out replay depths, and choose_k's candidates
# The demo recipe's EAGLE-3-only keys: what the non-EAGLE kinds drop from the shared settings.
EAGLE_KEYS = ("eagle_aux_layer_ids", "ttt_steps", "ttt_decay", "layer_init", "fc_init", "norm_before_residual")


def dflash(block: int, layers: int) -> dict:
    # the recorded layers (added in `kind_config`) instead of DFlash's five default ones: the same recording as
    # EAGLE-3's, so no kind pays for target forwards the others skip
    # loss_decay: about half the block, as the paper's (7 for blocks of 16, 5 for 10, 4 for 8)
    return {"draft": "dflash", "block_size": block, "dflash_layers": layers, "loss_decay": block / 2,
            "states": "recorded"}


# Each kind: the TrainConfig keys it sets beside the shared settings. eagle3 is the demo recipe's draft, unchanged.
KINDS: dict[str, dict] = {
    "eagle3": {"draft": "eagle3"},
    "dflash-b4": dflash(4, 1),  # blocks of 4 (3 proposals a forward), one layer
    "dflash-b8": dflash(8, 1),  # blocks of 8, one layer
    "dflash-b4-l2": dflash(4, 2),  # blocks of 4, two layers
    "peagle": {"draft": "peagle", "ttt_steps": max(KS)},  # P-EAGLE: k = 4 proposals in one forward
    # PARD: the plain recipe's derived draft (recipes/smollm2-135m.yaml), full vocabulary (vLLM serves no reduced
    # head for it), its learning rate; the target is its online teacher. One row a micro-batch, four a step: its
    # step holds the full-vocabulary logits of 4 copies of every row (the plan puts 4 rows of 1,024 tokens at
    # ~41 GiB, one at ~10)
    "parallel": {"draft": "parallel", "parallel_base": "derived", "parallel_tokens": max(KS),
                 "draft_layers": [0, 1, 2, 3, 4, 29], "draft_vocab_size": 0, "learning_rate": 1.5e-3,
                 "teacher": "online", "per_device_batch_size": 1, "grad_accum_steps": 4},
}
SHARED_KEYS = ("draft_vocab_size", "teacher", "loss", "learning_rate", "warmup_steps", "optimizer", "lr_schedule",
               "per_device_batch_size", "max_length")


def max_k(kind: str) -> int:
    """The deepest chain a kind's round proposes as trained: a DFlash block's proposals, else max(KS)."""
    block = KINDS[kind].get("block_size")
    return min(max(KS), block - 1) if block else max(KS)


def kind_config(kind: str, train: dict, data: Path, heldout: Path, out: Path, minutes: float, seed: int = 0,
                batch: int | None = None, max_length: int | None = None) -> dict:
    """The TrainConfig keys of one kind's run: `minutes` of training (the schedule fitted), no evaluation inside
    the budget (`eval_samples=0`: the child scores the final draft afterwards, the same way for every kind)."""
    layers = list(train["eagle_aux_layer_ids"])
    shared = {k: train[k] for k in SHARED_KEYS if k in train}
    changes = dict(KINDS[kind])
    if changes["draft"] in ("eagle3", "peagle"):
        own = {k: train[k] for k in EAGLE_KEYS if k in train} | {"states": "recorded"}
    elif changes["draft"] == "dflash":
        own = {"dflash_layer_ids": layers}
    else:
        own = {}
    return {"target": peer.TARGET, "seed": seed, "device": "cpu", "dtype": "float32", "train_data": str(data),
            "heldout_data": str(heldout), "output_dir": str(out), "max_minutes": minutes, "max_steps": 100_000,
            "log_every": 5, "eval_every": 0, "save_every": 0, "eval_samples": 0, "eval_k": KS, "best_k": max(KS),
            "data_workers": 0, **shared, **own, **changes,
            # --batch / --max-length: every kind's
            **({"per_device_batch_size": batch} if batch else {}), **({"max_length": max_length} if max_length else {})}


def per_position(ranks: list, depth: int) -> list[float]:
    """P(proposal j accepted | proposals < j accepted), j = 1..depth, over greedy chain rounds of `depth` replayed
    from the held-out ranks (specdec/replay.py: a round at position i accepts the leading rank-0 proposals, and
    the next round starts after its correction or bonus; a position past the completion's end is never tried)."""
    tried, passed = [0] * depth, [0] * depth
    for row in ranks:
        n, i = len(row), 0
        while i < n:
            accepted = 0
            while accepted < depth and accepted < len(row[i]) and i + accepted < n:
                tried[accepted] += 1
                if row[i][accepted] != 0:
                    break
                passed[accepted] += 1
                accepted += 1
            i += accepted + 1
    return [p / t if t else math.nan for p, t in zip(passed, tried)]


def train_child(spec: dict) -> dict:
    """Train one kind (its own process), score its final draft on every held-out row and publish it."""
    from specdec.train import distill
    from specdec.train import publish as pub
    from specdec.train.batches import load_split

    cfg = distill.TrainConfig(**spec["config"])
    trainer = distill.Distiller(cfg)
    started = time.perf_counter()
    final = trainer.run()
    train_seconds = time.perf_counter() - started
    heldout = load_split(Path(cfg.heldout_data))
    trainer.heldout = [heldout[i] for i in range(min(spec["heldout_rows"], len(heldout)))]
    parts: list[dict] = []

    def keep(obj):  # accelerate's gather_object on one process, keeping each part's ranks for per_position
        parts.extend(obj)
        return obj

    figures = trainer.kind.evaluate(trainer.model, trainer.heldout_chunks(), keep)
    ranks = [row for part in parts for row in part["ranks"]]
    summary = json.loads((Path(cfg.output_dir) / "train_summary.json").read_text())
    published = pub.publish(pub.PublishConfig(draft=str(final), out=str(Path(cfg.output_dir) / "publish"),
                                              target=cfg.target, overwrite=True))
    return {"final": str(final), "published": str(published), "steps": summary["steps"],
            "train_minutes": summary["train_minutes"], "wall_minutes": train_seconds / 60,
            "stopped_by": summary["stopped_by"], "tau": {str(k): v for k, v in figures["tau"].items()},
            "agreement": figures["agreement"], "positions": figures["positions"],
            "per_position": per_position(ranks, max(KS))}


def run_child(script: Path, role: str, spec: dict, log: Path, env: dict | None = None) -> dict:
    """One child process of `script` (`--child ROLE`), all cores, its output kept in `log`; its RESULT line."""
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", **(env or {}))
    with log.open("w") as out:
        proc = subprocess.run([sys.executable, str(script), "--child", role, json.dumps(spec)], cwd=peer.ROOT,
                              env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
    text = log.read_text()
    if proc.returncode != 0:
        raise RuntimeError(f"{role} of {spec.get('kind')} failed (log {log}):\n{text[-4000:]}")
    return json.loads([x for x in text.splitlines() if x.startswith("KINDS_RESULT ")][-1].removeprefix(
        "KINDS_RESULT "))
