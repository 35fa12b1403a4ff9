"""A DFlash peer comparison: specdec's DFlash trainer against vLLM speculators 0.9.0's `DFlashDraftModel`, same
data, same budget (bench/peer.py does it for EAGLE-3; its data, loop, optimizers and child processes are reused).

    python bench/peer_dflash.py                # 240 steps x 4 rows, block 8: ~8 min on 2 quiet cores, plus ~6 min
                                               # once for the data (runs/peer, shared with bench/peer.py)
    python bench/peer_dflash.py --runs specdec peer peer-ours
    python bench/peer_dflash.py --quick        # a few steps on a few rows (runs/peer-quick): the plumbing

Data: bench/peer.py's: specdec's data stage on the embedded target (SmolLM2-135M-Instruct, float32, greedy, 64 new
tokens), recording its final hidden state and its residual streams after layers 2, 15 and 27 (bf16), for
`--train-prompts` shipped training prompts and `--heldout-prompts` held-out ones. Each folder is made once.

Every draft has one shape: `--block` slots (the anchor and block - 1 proposals), one Qwen3 decoder layer at the
target's widths reading the target's residual streams after layers [2, 15, 27] (speculators' default for a
30-layer verifier), the same 4096 kept ids (specdec's choice), the mask token = the vocabulary's last id, the
target's embeddings and kept head rows frozen. The runs train on the same rows in the same order (specdec's
schedule) for the same optimizer steps, each in its own process (peak RSS = its ru_maxrss; one thread each), with
specdec's autocast rule (bf16 only where the CPU computes it natively):

- `specdec`: `specdec.train.distill.run(TrainConfig(draft="dflash", ...))`, recorded states, AdamW lr 2e-3 (wd 0),
  warm-up 30 then cosine to 0, cross-entropy on the target's tokens (the DFlash recipes' loss), slot j weighing
  exp(-(j - 1) / 4) (the paper's gamma for blocks of 8, speculators' default), every scored position an anchor.
- `peer`: speculators' `DFlashDraftModel`, its layer config as its CLI's `create_transformer_layer_config`
  derives it (qwen3, silu), built by its `from_training_args`, trained by its own forward and loss (`ce`, eager)
  at its trainer's DFlash defaults: Muon on the 2-D weights + AdamW (lr 1e-3, wd 0.1 / 0.01), linear decay after a 1%
  warm-up, clipping at 1.0, D-PACE slot weights (alpha 0.5); bench/peer.py's Muon note holds.
- `specdec-norm-ones` (`--runs`): `specdec` with its draft's final norm starting at ones (`norm_init: ones`, as the
  peer's starts) instead of the target's final norm weights.
- `specdec-fkl`, `specdec-muon`, `specdec-fkl-muon` (`--runs`): `specdec` with `loss: fkl` (forward KL to the
  target's distribution over the kept ids, which the online teacher reads from the recorded final states: the
  target's own distribution, as the peer's argmax label is drawn from it), with `optimizer: muon` (specdec's
  Muon on the layers' matrices, AdamW on the rest, at specdec's learning rate), or both.
- `peer-ours` (`--runs`): the same model, forward and loss at specdec's settings (AdamW, learning rate, warm-up,
  cosine, fixed-exp-decay slot weights with specdec's gamma).

The peer's loop is bench/peer.py's (its Trainer.train_epoch's step) with DFlash's call arguments (`max_anchors`,
`per_position_loss_weight`, `gamma`, `dpace_alpha`). Its batch is what its pipeline hands a DFlash run (no shift,
unlike EAGLE-3): each sample's tokens with the target's states at the same positions and its assistant-token loss
mask, packed into one row with document_ids, then `block` positions of document -1 (its collate pads to
total_seq_len; unpadded, its anchors would skip the packed row's tail). Where the designs differ, kept as they are:

- anchors: specdec draws `num_anchors` per row among positions that predict an answer token, the last prompt token
  included; speculators draws `max_anchors` per packed micro-batch among answer tokens, so it never trains the
  block anchored at the last prompt token (which specdec's held-out replay also counts, one block of ~64 a row).
  Both counts cover every eligible position (speculators': batch x max_new_tokens, all computed, padded ones too).
- labels: specdec's cross-entropy reads the data's token (the float32 target's greedy choice) and skips slots whose
  token is not kept; speculators' reads the argmax of the kept head rows on the recorded bf16 final state.
- normalisation: specdec divides the weighted sum by the step's total slot weight; speculators by the slot count.
- the recorded final state is the final norm's output already, so its frozen `verifier_norm` is the identity; the
  recording has no state at a row's last token, which the bench feeds with zero states (no term reads them: the
  position is context only for later anchors of its row, and its verifier state the target of a slot past the row).
- its draft layer uses full attention (its CLI: a 2048-token sliding window unless --full-attention-indices).
- initialisation, each its own: specdec's final norm starts as the target's final norm, speculators' at ones (so
  its first losses are far lower); random weights normal with std 0.02 (specdec) or the verifier's
  initializer_range (speculators).

Held-out: each draft is saved in speculators' `dflash` format (specdec's through `specdec publish
format=speculators`, the peer's by its own save_pretrained), loaded into specdec's `DFlashDraft` (the layouts map
name for name; the target's embeddings where a folder stores none, as the decoder and vLLM take them) and scored by
the trainer's own held-out replay (train/dflash_train.py: `block_ranks`, `merge_parts`): greedy agreement of slot 1,
top-1 at slots 2 and 3, tau(k) for k = 1 .. block - 1. speculators' `DFlashDraftModel.from_pretrained` also loads
each folder; its logits are compared with specdec's on held-out anchors. Prints the ratios of the run and writes
docs/results/<date>-peer-dflash.md.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from unittest import mock

import peer  # bench/peer.py (this script runs with bench/ on its path)
import torch

ROOT = peer.ROOT
# specdec's runs: their changes to the `specdec` run's TrainConfig ("dflash": its DFlash options changed)
OURS = {"specdec": {}, "specdec-norm-ones": {"dflash": {"norm_init": "ones"}}, "specdec-fkl": {"loss": "fkl"},
        "specdec-muon": {"optimizer": "muon"}, "specdec-fkl-muon": {"loss": "fkl", "optimizer": "muon"}}
RUNS = (*OURS, "peer", "peer-ours")
FULL = {"work": ROOT / "runs" / "peer", "train_prompts": 192, "heldout_prompts": 48, "max_new_tokens": 64,
        "steps": 240, "batch": 4}
QUICK = {"work": ROOT / "runs" / "peer-quick", "train_prompts": 8, "heldout_prompts": 4, "max_new_tokens": 16,
         "steps": 4, "batch": 2}
# specdec's settings (the demo recipe's learning rate and warm-up, the DFlash recipes' loss), shared by peer-ours
LEARNING_RATE, WARMUP, LOSS_DECAY = 2e-3, 30, 4.0
# speculators 0.9.0's trainer defaults for --speculator-type dflash (train/config/schema.py): bench/peer.py's
# optimizer and schedule, cross-entropy, D-PACE slot weights
PEER_DEFAULTS = {**{k: peer.PEER_DEFAULTS[k] for k in ("optimizer", "lr", "weight_decay", "muon_lr", "muon_momentum",
                                                        "muon_weight_decay", "muon_ns_steps", "muon_adjust_lr_fn",
                                                        "schedule", "warmup_steps", "max_grad_norm")},
                 "loss": "ce", "weighting": "dpace", "dpace_alpha": 0.5, "gamma": 4.0}


def peer_ours(steps: int) -> dict:
    """speculators' model, forward and loss at specdec's settings."""
    return {"optimizer": "adamw", "lr": LEARNING_RATE, "weight_decay": 0.0, "schedule": "cosine-to-end",
            "warmup_steps": warmup(steps), "max_grad_norm": 1.0, "loss": "ce", "weighting": "fixed-exp-decay",
            "dpace_alpha": 0.5, "gamma": LOSS_DECAY}


def warmup(steps: int) -> int:
    return min(WARMUP, steps // 4)  # a --quick run's schedule still has steps after its warm-up


# ---- speculators' DFlash draft and its batches ----------------------------------------------------------------
def layer_config(verifier: str):
    """The draft layer's config as speculators' CLI derives it from the verifier for DFlash (train/cli.py:
    `create_transformer_layer_config`, qwen3, silu; that module needs pydantic-settings, not installed), one layer
    at full attention instead of its sliding window."""
    from speculators.models.utils import resolve_draft_intermediate_size
    from transformers import AutoConfig, Qwen3Config

    v = AutoConfig.from_pretrained(verifier)
    rope = {k: x for k, x in copy.deepcopy(v.rope_parameters).items() if k not in ("type", "partial_rotary_factor")}
    return Qwen3Config(
        vocab_size=v.vocab_size, hidden_size=v.hidden_size, intermediate_size=resolve_draft_intermediate_size(v),
        num_hidden_layers=1, num_attention_heads=v.num_attention_heads, num_key_value_heads=v.num_key_value_heads,
        hidden_act="silu", max_position_embeddings=v.max_position_embeddings, initializer_range=v.initializer_range,
        rms_norm_eps=v.rms_norm_eps, head_dim=getattr(v, "head_dim", None) or v.hidden_size // v.num_attention_heads,
        tie_word_embeddings=False, sliding_window=2048, use_sliding_window=False, layer_types=["full_attention"],
        rope_parameters=rope)


def build_peer(verifier: str, layer_ids: list[int], keep_ids: torch.Tensor, block: int, mask_token_id: int,
               seed: int, attn: str = "sdpa"):
    """speculators' DFlashDraftModel as its `from_training_args` builds it: a seeded fc and layer (its init), the
    verifier's embeddings and kept head rows (both frozen), the vocabulary maps."""
    from speculators.models.dflash import DFlashDraftModel

    layer = layer_config(verifier)
    t2d, d2t = peer.vocab_maps(keep_ids, layer.vocab_size)
    torch.manual_seed(seed)
    model = DFlashDraftModel.from_training_args(
        verifier_config=layer, t2d=t2d, d2t=d2t, verifier_name_or_path=verifier, target_layer_ids=list(layer_ids),
        draft_attn_impl=attn, draft_vocab_size=int(keep_ids.numel()), block_size=block, mask_token_id=mask_token_id)
    model.verifier_norm = torch.nn.Identity()  # the recorded final state is normed already (bench/peer.py)
    return model.float().train()


def dflash_batch(batch: dict, prompt_lengths: list[int], states: torch.Tensor, hidden: int, block: int) -> dict:
    """A collated micro-batch and its recorded states [B, S, 4H] as speculators' pipeline feeds a DFlash run: each
    sample's tokens, the states at the same positions (zeros at its last token, never fed), its assistant-token loss
    mask, packed into one row with document_ids, then `block` positions of document -1."""
    parts = []
    for b, prompt in enumerate(prompt_lengths):
        n = int(batch["attention_mask"][b].sum())
        row = torch.zeros(n, states.shape[-1], dtype=states.dtype)
        row[: n - 1] = states[b, : n - 1]
        parts.append({"input_ids": batch["input_ids"][b, :n], "hidden_states": row[:, hidden:],
                      "verifier_last_hidden_states": row[:, :hidden], "loss_mask": (torch.arange(n) >= prompt).long(),
                      "position_ids": torch.arange(n), "document_ids": torch.full((n,), b)})
    parts.append({k: torch.zeros(block, *v.shape[1:], dtype=v.dtype) for k, v in parts[0].items()})
    parts[-1]["document_ids"] -= 1
    return {k: torch.cat([p[k] for p in parts])[None] for k in parts[0]}


class DFlashPeerData(peer.PeerData):
    """bench/peer.py's micro-batches (specdec's rows, same order), packed as speculators' DFlash pipeline packs."""

    def __init__(self, *args, block: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.block = block

    def pack(self, batch: dict, prompts: list[int], states: torch.Tensor) -> dict:
        return dflash_batch(batch, prompts, states, self.hidden, self.block)


# ---- the children: one trainer per process --------------------------------------------------------------------
def child_peer(spec: dict) -> dict:
    from specdec.models import cpu_has_native_bf16, load_tokenizer, resolve_path
    from specdec.tokens import tokenizer_pad_id

    verifier = str(Path(resolve_path(spec["target"])).resolve())
    settings = spec["settings"]
    model = build_peer(verifier, spec["layer_ids"], torch.tensor(spec["keep_ids"]), spec["block"], spec["mask"],
                       spec["seed"], spec["attn"])
    hidden = model.config.transformer_layer_config.hidden_size
    data = DFlashPeerData(Path(spec["train_data"]), spec["layer_ids"], hidden, spec["batch"], spec["seed"],
                          spec["max_length"], tokenizer_pad_id(load_tokenizer(spec["target"])), block=spec["block"])
    bf16 = cpu_has_native_bf16()  # the rule of specdec's trainer on a CPU (mixed_precision=auto)
    muon = "bf16" if bf16 or spec["muon_bf16"] else "float32"
    if settings["optimizer"] == "muon" and muon == "float32":
        peer.float32_newton_schulz()
    call = {"max_anchors": spec["max_anchors"], "per_position_loss_weight": settings["weighting"],
            "gamma": settings["gamma"], "dpace_alpha": settings["dpace_alpha"]}
    out = peer.train_peer(model, data, settings, spec["steps"],
                          (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if bf16 else None, call_kwargs=call)
    final = peer.save_peer(model, Path(spec["output_dir"]) / "final")
    return {**out, "mixed_precision": "bf16" if bf16 else "no", "final": str(final),
            **({"muon": muon} if settings["optimizer"] == "muon" else {})}


def child_main(spec: dict) -> None:
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if spec["run"] not in OURS:  # the libraries each trainer needs, before it starts: the RSS baseline
        import speculators.models.dflash  # noqa: F401

        import specdec.train.batches  # noqa: F401
    import specdec.train.distill  # noqa: F401

    imported = peer.current_rss_mb()
    out = peer.child_specdec(spec) if spec["run"] in OURS else child_peer(spec)
    out.update(peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, imports_rss_mb=imported)
    print("PEER_RESULT " + json.dumps(out), flush=True)


# ---- scoring and load checks ----------------------------------------------------------------------------------
def load_draft(folder: Path, target):
    """specdec's DFlash draft from `folder`, with the target's embeddings (and head rows) where the folder stores
    none, as the decoder and the engines take them."""
    from specdec.models import load_model

    draft = load_model(str(folder), dtype="float32", device="cpu").eval()
    draft.adopt_target(target)
    return draft


def heldout_figures(draft_dir: Path, target, heldout: Path, tokenizer, max_length: int, ks: list[int],
                    batch: int = 8) -> dict:
    """The trainer's held-out figures (train/dflash_train.py: `DFlashTraining.evaluate`) of the DFlash draft specdec
    loads from `draft_dir`, over the held-out folder's rows and recorded states."""
    from specdec.dflash.replay import block_ranks
    from specdec.tokens import tokenizer_pad_id
    from specdec.train.batches import collate, load_split
    from specdec.train.eagle3_states import States, StatesReader
    from specdec.train.eagle3_train import merge_parts

    draft = load_draft(draft_dir, target)
    hidden = draft.config.target_hidden_size
    reader = StatesReader([heldout], draft.layer_ids, (1 + len(draft.layer_ids)) * hidden)
    states = States("recorded", None, None, reader, draft.layer_ids)
    data, pad, ranks = load_split(heldout), tokenizer_pad_id(tokenizer), []
    for s in range(0, len(data), batch):
        rows = data[s:s + batch]
        b = collate(rows, pad, max_length)
        full = states.complete(b, states.read(rows, b["input_ids"].shape[1]))[..., hidden:]
        ranks += block_ranks(draft, b["input_ids"], b["attention_mask"], b["loss_mask"], max(ks), full)
    return merge_parts([{"ranks": ranks, "alphas": []}], ks)


def speculators_agrees(folder: Path, verifier: str, target, heldout: Path, max_length: int, anchors: int = 4) -> float:
    """speculators' from_pretrained loads `folder`; the largest |logit| difference between its blocks and specdec's
    at `anchors` answer positions of the first held-out row (same tokens, same states)."""
    from speculators.models.dflash import core

    from specdec.train.batches import load_split
    from specdec.train.eagle3_states import StatesReader

    config = core.DFlashSpeculatorConfig.from_pretrained(str(folder))
    config.transformer_layer_config._attn_implementation = "eager"
    config.speculators_config.verifier.name_or_path = verifier  # specdec's publish names the Hub id
    theirs = core.DFlashDraftModel.from_pretrained(str(folder), config=config).float().eval()
    mine = load_draft(folder, target)
    rows = load_split(heldout)[0:1]
    ids = torch.tensor(rows["input_ids"][0][:max_length])[None]
    hidden, s = mine.config.target_hidden_size, ids.shape[1]
    states, _ = StatesReader([heldout], mine.layer_ids, (1 + len(mine.layer_ids)) * hidden).read(rows, s)
    picked = torch.linspace(min(rows["prompt_length"][0], s - 2), s - 2, anchors).long()
    tail = theirs.block_size  # its collate's padding (document -1): its blocks index past the row's end
    padded = {"hidden_states": torch.cat([states[..., hidden:], torch.zeros(1, tail, states.shape[-1] - hidden)], 1),
              "input_ids": torch.cat([ids, torch.zeros(1, tail, dtype=torch.long)], 1),
              "loss_mask": torch.ones(1, s + tail, dtype=torch.long),
              "verifier_last_hidden_states": torch.zeros(1, s + tail, hidden),
              "document_ids": torch.cat([torch.zeros(1, s), -torch.ones(1, tail)], 1).long()}
    fixed = mock.patch.object(core, "select_anchors", lambda *_: (picked, torch.ones(anchors, dtype=torch.bool)))
    with torch.no_grad(), fixed:
        blocks = theirs._backbone_forward(**padded, max_anchors=anchors)[1]
        own = mine(ids, states[..., hidden:], picked[None])[0]
    return float((blocks[0].view_as(own) - own).abs().max())


def load_line(run: str, folder: Path, work: Path, diff: float) -> str:
    config = json.loads((folder / "config.json").read_text())
    return (f"- {run} (`{folder.relative_to(work)}`): specdec loads it as its DFlash draft; speculators loads it, max "
            f"|logit difference| to specdec's on held-out blocks {diff:.2e}; block {config['block_size']}, layers "
            f"{config['aux_hidden_state_layer_ids']}, mask token {config['mask_token_id']}, draft vocab "
            f"{config['draft_vocab_size']}, tensors {', '.join(sorted(peer.tensor_names(folder)))}")


# ---- the bench --------------------------------------------------------------------------------------------------
def settings_text(run: str, s: dict) -> str:
    if run in OURS:
        optimizer = "Muon + AdamW (specdec's)" if s.get("optimizer") == "muon" else "AdamW"
        loss = "ce on the data's tokens" if s["loss"] == "ce" else f"{s['loss']} to the target's distribution (online)"
        return (f"{optimizer} lr {LEARNING_RATE:g}, wd 0, warm-up {s['warmup_steps']}, cosine to 0; {loss}; "
                f"slot weights exp(-(j - 1) / {LOSS_DECAY:g}); {s['dflash']['num_anchors']} anchors a row at most; "
                f"final norm starting from {s['dflash'].get('norm_init', 'target')}")
    optimizer = ("Muon (2-D, lr {lr:g}, wd {muon_weight_decay:g}) + AdamW (wd {weight_decay:g})"
                 if s["optimizer"] == "muon" else "AdamW lr {lr:g}, wd {weight_decay:g}").format(**s)
    schedule = "linear, warm-up 1%" if s["schedule"] == "linear" else f"warm-up {s['warmup_steps']}, cosine to 0"
    weights = f"D-PACE (alpha {s['dpace_alpha']:g})" if s["weighting"] == "dpace" else f"exp(-(j - 1) / {s['gamma']:g})"
    return f"{optimizer}; {schedule}; {s['loss']} (eager) on the kept head rows' argmax; slot weights {weights}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="a tiny size (plumbing; its page is written in its "
                        "--work folder, not docs/results): " + json.dumps(
        {k: str(v.relative_to(ROOT)) if isinstance(v, Path) else v for k, v in QUICK.items()}))
    parser.add_argument("--work", type=Path, help=f"data and runs go here (default {FULL['work'].relative_to(ROOT)}, "
                        "the data bench/peer.py makes)")
    for name, what in (("train-prompts", "shipped training prompts to answer"), ("heldout-prompts", "held-out ones"),
                       ("max-new-tokens", "tokens the target answers"), ("steps", "optimizer steps of every run"),
                       ("batch", "samples per step of every run")):
        parser.add_argument(f"--{name}", type=int, help=f"{what} (default {FULL[name.replace('-', '_')]})")
    parser.add_argument("--block", type=int, default=8, help="slots per block: the anchor and block - 1 proposals")
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target", default=peer.TARGET, help="the target (a local folder for tests)")
    parser.add_argument("--layer-ids", type=int, nargs="+", default=[2, 15, 27], help="target layers the drafts read")
    parser.add_argument("--draft-vocab", type=int, default=4096, help="kept ids of every draft's head")
    parser.add_argument("--threads", type=int, default=1, help="threads of each trainer")
    parser.add_argument("--parallel", type=int, default=0, help="trainers at a time (default: cores / threads)")
    parser.add_argument("--attn", default="sdpa", choices=("sdpa", "eager"), help="speculators' draft attention")
    parser.add_argument("--runs", nargs="+", default=["specdec", "peer"], choices=RUNS)
    parser.add_argument("--name", default="peer-dflash", help="docs/results/<date>-<name>.md")
    parser.add_argument("--muon-bf16", action="store_true", help="bench/peer.py's flag")
    args = parser.parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.parallel = args.parallel or max(1, (os.cpu_count() or 1) // args.threads)
    if args.block < 2:
        parser.error(f"--block must be >= 2 (the anchor and a proposal), got {args.block}")
    return args


def run_specs(args, work: Path, keep: torch.Tensor, mask: int) -> dict:
    """Each run's child spec: specdec's TrainConfig, or the peer's model, data and settings."""
    specdec = {"target": args.target, "draft": "dflash", "seed": args.seed, "device": "cpu", "dtype": "float32",
               "train_data": str(work / "data"), "heldout_data": str(work / "data_heldout"),
               "max_length": args.max_length, "per_device_batch_size": args.batch, "max_steps": args.steps,
               "log_every": 20, "eval_every": 0, "save_every": 0, "eval_samples": 8,
               "eval_k": list(range(1, args.block)), "best_k": args.block - 1, "data_workers": 0,
               "draft_vocab_size": args.draft_vocab, "loss": "ce", "learning_rate": LEARNING_RATE,
               "warmup_steps": warmup(args.steps), "weight_decay": 0.0, "output_dir": str(work / "dflash-specdec"),
               "dflash": {"block_size": args.block, "num_anchors": args.max_new_tokens, "loss_decay": LOSS_DECAY,
                          "dflash_layer_ids": args.layer_ids, "dflash_layers": 1, "mask_token_id": mask,
                          "states": "recorded"}}
    specs = {run: {"run": run, "config": {**specdec, **changes, "output_dir": str(work / f"dflash-{run}"),
                                          "dflash": {**specdec["dflash"], **changes.get("dflash", {})}}}
             for run, changes in OURS.items()}
    for run, settings in (("peer", PEER_DEFAULTS), ("peer-ours", peer_ours(args.steps))):
        specs[run] = {"run": run, "target": args.target, "keep_ids": keep.tolist(), "layer_ids": args.layer_ids,
                      "settings": settings, "seed": args.seed, "attn": args.attn, "train_data": str(work / "data"),
                      "batch": args.batch, "steps": args.steps, "max_length": args.max_length, "block": args.block,
                      "mask": mask, "max_anchors": args.batch * args.max_new_tokens, "muon_bf16": args.muon_bf16,
                      "output_dir": str(work / f"dflash-{run}")}
    return {run: specs[run] for run in args.runs}


def train_all(args, specs: dict) -> dict:
    """Every run in its own process, `args.parallel` at a time: {run: its outcome}."""

    def train(run: str) -> dict:
        print(f"== {run}: {args.steps} steps x {args.batch} samples", flush=True)
        out_dir = Path(specs[run].get("output_dir") or specs[run]["config"]["output_dir"])
        shutil.rmtree(out_dir, ignore_errors=True)  # every run starts afresh
        out = peer.run_child(specs[run], args.threads, Path(__file__).resolve())
        print(f"{run}: " + json.dumps({k: v for k, v in out.items() if k != "losses"}), flush=True)
        return out

    with ThreadPoolExecutor(max_workers=args.parallel) as pool:
        return dict(zip(specs, pool.map(train, specs)))


def ratios(outcome: dict, figures: dict, k: int) -> list[str]:
    """Each of specdec's runs over each peer run: held-out tau(k), trained tokens per second, peak RSS."""
    def rate(run: str) -> float:
        return outcome[run]["tokens"] / outcome[run]["seconds"]

    lines = []
    for ours in (r for r in outcome if r in OURS):
        for run in (r for r in outcome if r not in OURS):
            tau = figures[ours]["tau"][k] / figures[run]["tau"][k]
            rss = outcome[ours]["peak_rss_mb"] / outcome[run]["peak_rss_mb"]
            lines.append(f"- {ours} / {run}: held-out tau({k}) {tau:.3f}x, trained tokens/s "
                         f"{rate(ours) / rate(run):.2f}x, peak RSS {rss:.2f}x")
    return lines


def table_row(run: str, o: dict, f: dict, ks: list[int]) -> str:
    top1 = [p.get("1", float("nan")) for p in f["top_n_agreement"]] + [float("nan")] * 3
    return (f"| {run} | {f['agreement']:.3f} | {top1[1]:.3f} | {top1[2]:.3f} | "
            + " | ".join(f"{f['tau'][k]:.3f}" for k in ks)
            + f" | {o['tokens'] / o['seconds']:.0f} | {o['tokens'] / o['cpu_seconds']:.0f} | {o['peak_rss_mb']:.0f} | "
            f"{o['peak_rss_mb'] - o['imports_rss_mb']:.0f} |")


def report_body(args, outcome: dict, specs: dict, figures: dict, loads: list[str], facts: dict) -> str:
    ks = list(range(1, args.block))
    held = json.loads((facts["heldout"] / "manifest.json").read_text()).get("counts", {}).get("examples", "?")
    epochs = args.steps * args.batch / facts["train_examples"]
    settings = {run: specs[run]["config"] if run in OURS else specs[run]["settings"] for run in outcome}
    return "\n".join([
        f"Every run: {args.steps} optimizer steps x {args.batch} samples, the same rows in the same order (specdec's "
        f"schedule); one process each, {args.threads} thread(s), {args.parallel} at a time, mixed precision "
        f"{', '.join(sorted({o['mixed_precision'] for o in outcome.values()}))}. Data: bench/peer.py's, "
        f"{facts['train_examples']} training examples from {args.train_prompts} shipped prompts and {held} held-out "
        f"examples from {args.heldout_prompts} held-out prompts, {args.max_new_tokens} new tokens (made in "
        f"{facts['data_minutes']:.1f} min this run; 0 = reused); {epochs:.1f} epochs. Every draft: block {args.block}, "
        f"one decoder layer reading layers {args.layer_ids}, {facts['keep']} kept ids (specdec's choice, shared), "
        f"mask token {facts['mask']}.", "",
        "Held-out figures by specdec's DFlash replay of each saved speculators-format folder: agreement = greedy "
        "agreement of the block's first proposal at every completion position; top-1 @2, @3 = at its 2nd and 3rd; "
        "tau(k) = mean accepted tokens per round of k proposals. Tokens/s = scored completion positions per second of "
        "the training loop, tokens/CPU-s per second of its process's CPU time; peak RSS = ru_maxrss of the trainer's "
        "process; above imports = that less its RSS once its libraries were imported.", "",
        "| run | agreement | top-1 @2 | top-1 @3 | " + " | ".join(f"tau({k})" for k in ks)
        + " | tokens/s | tokens/CPU-s | peak RSS MB | above imports MB |",
        "|---|" + "---:|" * (7 + len(ks)), *[table_row(run, outcome[run], figures[run], ks) for run in outcome], "",
        "Ratios:", "", *(ratios(outcome, figures, ks[-1]) or ["- (none: this run trained no specdec run and peer run side by side)"]), "",
        "Settings:", "", *[f"- {run}: {settings_text(run, settings[run])}"
                           + (f"; Muon's Newton-Schulz in {outcome[run]['muon']}" if "muon" in outcome[run] else "")
                           for run in outcome], "",
        "Loads:", "", *loads, "",
        "Training losses (each run's own loss, not comparable across trainers):", "",
        *[f"- {run}: " + ", ".join(f"{s}: {v:.3f}" for s, v in o["losses"]) for run, o in outcome.items()], ""])


def prepare_data(args, work: Path) -> float:
    """bench/peer.py's data folders under `work` (made once); the minutes they took this run."""
    from specdec.train.eagle3_states import recorded_layer_ids

    started = time.perf_counter()
    for folder, prompts, limit in ((work / "data", "embedded:train", args.train_prompts),
                                   (work / "data_heldout", "embedded:heldout", args.heldout_prompts)):
        peer.make_data(folder, prompts, limit, args.max_new_tokens, args.layer_ids, args.target)
        if recorded_layer_ids(folder) != args.layer_ids:
            raise ValueError(f"{folder} recorded the target's states after layers {recorded_layer_ids(folder)}, not "
                             f"--layer-ids {args.layer_ids}: pass those or another --work")
    return (time.perf_counter() - started) / 60


def main(argv: list[str] | None = None) -> Path | None:
    args = parse_args(argv)
    if args.child:
        return child_main(json.loads(args.child))

    import results  # bench/results.py
    from transformers import AutoConfig

    from specdec.models import load_model, load_tokenizer, resolve_path
    from specdec.train import publish as pub
    from specdec.train.batches import load_split

    provenance = results.header("Peer comparison: specdec's DFlash trainer against vLLM speculators 0.9.0's")
    work = args.work.resolve()
    data_minutes = prepare_data(args, work)
    tokenizer = load_tokenizer(args.target)
    verifier = str(Path(resolve_path(args.target)).resolve())
    train_ds = load_split(work / "data")
    vocab = AutoConfig.from_pretrained(verifier).vocab_size
    keep = peer.draft_vocabulary(train_ds, tokenizer, args.draft_vocab, vocab)
    specs = run_specs(args, work, keep, vocab - 1)
    outcome = train_all(args, specs)
    for ours in (r for r in outcome if r in OURS):  # the same kept ids; then speculators' layout
        chosen = json.loads((work / f"dflash-{ours}" / "draft_vocab.json").read_text())["ids"]
        assert sorted(chosen) == sorted(keep.tolist()), "specdec's trainer kept other ids than the bench"
        outcome[ours]["final"] = str(pub.publish(pub.PublishConfig(
            draft=outcome[ours]["final"], out=str(work / f"dflash-{ours}" / "speculators"), target=args.target,
            format="speculators", overwrite=True)))
    figures, loads = {}, []
    target = load_model(args.target, dtype="float32", device="cpu")
    for run, o in outcome.items():
        folder, heldout = Path(o["final"]), work / "data_heldout"
        figures[run] = heldout_figures(folder, target, heldout, tokenizer, args.max_length, list(range(1, args.block)))
        loads.append(load_line(run, folder, work, speculators_agrees(folder, verifier, target, heldout,
                                                                     args.max_length)))
    body = report_body(args, outcome, specs, figures, loads, {
        "heldout": work / "data_heldout", "data_minutes": data_minutes, "train_examples": len(train_ds),
        "keep": keep.numel(), "mask": vocab - 1})
    print(body)
    if args.quick:  # a plumbing run's figures mean nothing: its page stays beside its runs, out of docs/results
        path = work / "peer-dflash.md"
        path.write_text(provenance + body.rstrip() + "\n")
    else:
        path = results.write(args.name, "Peer comparison: specdec's DFlash trainer against speculators'", body,
                             provenance)
    print(f"\nwritten to {path}")
    return path


if __name__ == "__main__":
    main()
