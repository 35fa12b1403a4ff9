"""A peer comparison: specdec's EAGLE-3 trainer against vLLM speculators 0.9.0's own, same data, same budget.

    python bench/peer.py                                       # 160 steps x 4 rows; data made once under runs/peer
    python bench/peer.py --steps 1000 --batch 16 --train-prompts 512 --heldout-prompts 96 --work runs/peer-large
    python bench/peer.py --runs specdec peer-ours              # some of the runs only
    python bench/peer.py --vllm-serve 4                        # and each draft decoding in vLLM (~2 min a draft)

Data: specdec's own data stage on the embedded target (SmolLM2-135M-Instruct, float32, greedy, 64 new tokens),
recording the target's final hidden state and its residual streams after layers 2, 15 and 27 (bf16), for
`--train-prompts` of the shipped training prompts and `--heldout-prompts` of the held-out ones (topics absent from
training). Each folder is made once and reused.

Four drafts train on the same rows, in the same order (specdec's batch schedule), for the same optimizer steps,
each in its own process (its peak RSS is ru_maxrss there; one thread each, two at a time on a 2-core machine), with
the same autocast rule (bf16 only where the CPU computes it natively, as specdec's trainer decides):

- `specdec`: `specdec.train.distill.run(TrainConfig(...))`, the recipe recipes/smollm2-135m-eagle3.yaml's train
  settings (learning rate, warm-up, cosine schedule, ttt_steps, ttt_decay, loss, draft vocabulary) at this budget.
- `specdec-frozen-head`: the same with `freeze_head=true`, as speculators keeps its head (the target's rows).
- `peer-defaults`: speculators' `Eagle3DraftModel`, built as its `from_training_args` builds it, trained by its
  own forward and loss (`kl_div`, its eager implementation: the default one needs Triton) at its trainer's
  defaults (speculators/train/config/schema.py and trainer.py of 0.9.0): Muon on the 2-D weights and AdamW on the
  rest (lr 1e-3, weight decay 0.1 / 0.01), linear decay after a 1% warm-up, gradient clipping at 1.0,
  ttt_steps 3 with ttt_step_loss_decay 1.0, norm_before_residual true. torch's Muon orthogonalises each update in
  bf16 (a GPU's fast path); on a CPU without native bf16 (about 10x slower there than float32 for these shapes)
  the bench runs the same Newton-Schulz iteration in float32 (`--muon-bf16` keeps torch's).
- `peer-ours`: the same model, forward and loss at specdec's settings: AdamW (weight decay 0), the recipe's learning
  rate, warm-up and cosine schedule to zero, its ttt_steps and ttt_decay, norm_before_residual false.

speculators' trainer wants a GPU, so a minimal loop here drives the model as its `Trainer.train_epoch` does:
`_, loss, metrics = model(**batch, ttt_steps=, ttt_step_loss_decay=, loss_config=)`, backward, clip, step each
optimizer, step each scheduler. Each micro-batch is what its data pipeline would hand it: every sample cut to its
recorded positions, aligned by its `shift_batch` (input x_{t+1}, states at t, the verifier's last hidden state at
t + 1, its assistant-token loss mask) and packed into one row with `document_ids` (it pads rows to
`total_seq_len` with document -1, which changes no loss, so here nothing is padded). Three departures, each
needed by this data or this machine: the recorded final hidden state is already normed, so its frozen
`verifier_norm` is replaced by the identity (its targets stay `verifier_lm_head` of the normed state); its
draft layer uses full attention, not its CLI's 2048-token sliding window (the rows here are shorter); its CLI's
"Eagle 3.1" flags `norm_before_fc` and `norm_output` (true by default there, false in its model config) stay
false, since specdec's decoder cannot replay them (vLLM 0.32 serves both).

Then every draft is saved in speculators' format (specdec's through `specdec publish format=speculators`, the
peer's by its own `save_pretrained`, unchanged: its `target_hidden_size: null` means the draft's hidden size to
specdec as to vLLM), loaded by specdec, and scored on the held-out folder by the
trainer's own held-out replay (train/eagle3_train.py: `evaluate_part`, `merge_parts`; specdec/replay.py):
greedy agreement of the first proposal, top-1 agreement at round positions 2 and 3, tau(1..4), alpha (a lower
bound from the stored top-20). Each saved folder is also checked the way the engines read it: speculators'
`Eagle3DraftModel.from_pretrained` loads it and its first-step logits are compared with specdec's on a held-out
row, and vLLM's own speculators-config parser (in vLLM's environment, where one exists: `make vllm-env`)
converts its config.json, whose flags and tensor names are checked against what vLLM's `Eagle3LlamaForCausalLM`
loads; `--vllm-serve N` also has vLLM decode N held-out prompts with it (greedy identity, vLLM's own acceptance
counters beside specdec's replay of the same rows). Writes docs/results/<date>-peer-speculators.md.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "smollm2-135m-eagle3.yaml"
TARGET = "embedded:smollm2-135m-instruct"
RUNS = ("specdec", "specdec-frozen-head", "peer-defaults", "peer-ours")
SPECDEC_RUNS = {"specdec": {}, "specdec-frozen-head": {"freeze_head": True}}  # TrainConfig overrides
KS = [1, 2, 3, 4]

# speculators 0.9.0's trainer defaults (train/config/schema.py, train/trainer.py): Muon on the 2-D weights, AdamW on
# the rest, linear decay after warm-up = 1% of the steps, clipping at 1.0, kl_div, ttt_steps 3, decay 1.0, and
# norm_before_residual true in its CLI.
PEER_DEFAULTS = {"optimizer": "muon", "lr": 1e-3, "weight_decay": 0.01, "muon_lr": 1e-3, "muon_momentum": 0.95,
                 "muon_weight_decay": 0.1, "muon_ns_steps": 5, "muon_adjust_lr_fn": "match_rms_adamw",
                 "schedule": "linear", "warmup_steps": None, "ttt_steps": 3, "ttt_decay": 1.0,
                 "norm_before_residual": True, "loss": "kl_div", "max_grad_norm": 1.0}


def recipe_train() -> dict:
    """The demo recipe's train: section (the settings `specdec` and `peer-ours` share)."""
    from specdec.config import read_recipe

    return dict(read_recipe(RECIPE).get("train") or {})


def peer_ours(train: dict) -> dict:
    """speculators' model, forward and loss at specdec's recipe settings."""
    return {"optimizer": "adamw", "lr": float(train["learning_rate"]), "weight_decay": 0.0,
            "schedule": "cosine-to-end", "warmup_steps": int(train["warmup_steps"]), "ttt_steps": int(train["ttt_steps"]),
            "ttt_decay": float(train["ttt_decay"]), "norm_before_residual": False, "loss": "kl_div",
            "max_grad_norm": 1.0}


# ---- the data -----------------------------------------------------------------------------------------------
def make_data(folder: Path, prompts: str, limit: int, max_new_tokens: int, layer_ids: list[int],
              target: str = TARGET) -> None:
    """`specdec data` with recorded states into `folder` (resumable: a complete folder is left as it is)."""
    manifest = folder / "manifest.json"
    if manifest.is_file() and json.loads(manifest.read_text()).get("complete"):
        return
    args = [f"target={target}", f"prompts={prompts}", f"limit={limit}", f"max_new_tokens={max_new_tokens}",
            "record_features=true", f"eagle_aux_layer_ids={json.dumps(layer_ids)}", "dtype=float32", "device=cpu",
            "top_logprobs=20", "batch_size=64", f"output_dir={folder}"]
    print(f"specdec data {' '.join(args)}", flush=True)
    subprocess.run([sys.executable, "-m", "specdec.train.data", *args], cwd=ROOT, check=True)


def draft_vocabulary(train_ds, tokenizer, size: int, vocab: int) -> torch.Tensor:
    """The kept target ids as specdec's trainer picks them (train/draft.py: `frequent_ids`; checked against its run)."""
    from specdec.tokens import tokenizer_pad_id
    from specdec.train.draft import frequent_ids

    return frequent_ids(train_ds, size, vocab, [tokenizer.eos_token_id, tokenizer.bos_token_id,
                                                tokenizer_pad_id(tokenizer)])


# ---- speculators' draft, its batches and its loop -------------------------------------------------------------
def layer_config(verifier: str, attn: str):
    """The draft layer's config as speculators' CLI derives it from the verifier (train/cli.py:
    `create_transformer_layer_config`, llama), with full attention instead of its sliding window."""
    from transformers import AutoConfig, LlamaConfig

    v = AutoConfig.from_pretrained(verifier)
    config = LlamaConfig(
        vocab_size=v.vocab_size, hidden_size=v.hidden_size, intermediate_size=v.intermediate_size, num_hidden_layers=1,
        num_attention_heads=v.num_attention_heads, num_key_value_heads=v.num_key_value_heads, hidden_act=v.hidden_act,
        max_position_embeddings=v.max_position_embeddings, initializer_range=v.initializer_range,
        rms_norm_eps=v.rms_norm_eps, head_dim=getattr(v, "head_dim", None) or v.hidden_size // v.num_attention_heads,
        tie_word_embeddings=False, rope_parameters=copy.deepcopy(v.rope_parameters))
    config._attn_implementation = attn  # its flex default fails on a CPU
    return config


def vocab_maps(keep_ids: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(t2d [vocab] bool, d2t [draft] offsets) of the kept ids, in ascending order as the engines read them."""
    keep = keep_ids.long().sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[keep] = True
    return t2d, keep - torch.arange(keep.numel())


def build_peer(verifier: str, layer_ids: list[int], keep_ids: torch.Tensor, settings: dict, seed: int,
               attn: str = "sdpa"):
    """speculators' Eagle3DraftModel as its `from_training_args` builds it: random fc and layer (its init), the
    verifier's embeddings and head rows (both frozen), the vocabulary maps."""
    from speculators.models.eagle3 import Eagle3DraftModel

    layer = layer_config(verifier, attn)
    t2d, d2t = vocab_maps(keep_ids, layer.vocab_size)
    torch.manual_seed(seed)
    model = Eagle3DraftModel.from_training_args(
        verifier_config=layer, t2d=t2d, d2t=d2t, verifier_name_or_path=verifier, target_layer_ids=list(layer_ids),
        draft_attn_impl=attn, draft_vocab_size=int(keep_ids.numel()),
        norm_before_residual=settings["norm_before_residual"], norm_before_fc=False, fc_norm=False, norm_output=False,
        embed_requires_grad=False, ttt_steps=settings["ttt_steps"])
    # The recorded final hidden state is the final norm's output already (specdec/eagle3/states.py: HiddenStateRecorder):
    # its targets are then verifier_lm_head(state), as they are of the un-normed state it records itself.
    model.verifier_norm = torch.nn.Identity()
    return model.float().train()


def peer_batch(batch: dict, prompt_lengths: list[int], states: torch.Tensor, hidden: int) -> dict:
    """A collated micro-batch (train/batches.py: `collate`) and its recorded states [B, S, 4H] as speculators'
    pipeline feeds them: each sample its recorded positions (the last token was never fed), with the assistant
    tokens as loss mask, aligned by its `shift_batch`, packed into one row with document_ids."""
    from speculators.models.eagle3.data import shift_batch

    parts = []
    for b, prompt in enumerate(prompt_lengths):
        n = int(batch["attention_mask"][b].sum()) - 1
        sample = {"input_ids": batch["input_ids"][b, :n], "hidden_states": states[b, :n, hidden:],
                  "verifier_last_hidden_states": states[b, :n, :hidden],
                  "loss_mask": (torch.arange(n) >= max(prompt, 1)).long(), "lengths": torch.tensor([n]),
                  "position_ids": torch.arange(n)}
        parts.append(shift_batch(sample))
    lengths = torch.cat([p["lengths"] for p in parts])
    packed = {k: torch.cat([p[k] for p in parts])[None] for k in ("input_ids", "hidden_states",
                                                                  "verifier_last_hidden_states", "loss_mask",
                                                                  "position_ids")}
    packed["document_ids"] = torch.repeat_interleave(torch.arange(len(parts)), lengths)[None]
    return packed


def peer_optimizers(model, settings: dict, steps: int):
    """speculators' own optimizers (train/optimizers.py: `build_optimizers`) and one scheduler each: its linear
    warm-up and decay (transformers', as its trainer), or specdec's cosine to zero (train/budget.py)."""
    from types import SimpleNamespace

    from speculators.train.optimizers import build_optimizers
    from transformers import get_linear_schedule_with_warmup

    from specdec.train.budget import CosineToEnd

    config = SimpleNamespace(**{k: settings.get(k) for k in ("optimizer", "lr", "weight_decay", "muon_lr",
                                                              "muon_momentum", "muon_weight_decay", "muon_ns_steps",
                                                              "muon_adjust_lr_fn")})
    optimizers = build_optimizers(model, config)
    if settings["schedule"] == "linear":
        warmup = settings["warmup_steps"] if settings["warmup_steps"] is not None else steps // 100
        schedulers = [get_linear_schedule_with_warmup(o, warmup, steps) for o in optimizers]
    else:
        schedulers = [torch.optim.lr_scheduler.LambdaLR(o, CosineToEnd(settings["warmup_steps"], steps))
                      for o in optimizers]
    return optimizers, schedulers


class PeerData:
    """specdec's micro-batches (same rows, same order: train/batches.py's schedule), their recorded states, and
    each as speculators' packed batch."""

    def __init__(self, train_folder: Path, layer_ids: list[int], hidden: int, batch: int, seed: int,
                 max_length: int, pad_id: int):
        from specdec.train.batches import Schedule, load_split, row_lengths
        from specdec.train.eagle3_states import StatesReader

        self.dataset = load_split(train_folder)
        self.schedule = Schedule(row_lengths(self.dataset, max_length), batch, seed, True)
        self.reader = StatesReader([train_folder], layer_ids, (1 + len(layer_ids)) * hidden)
        self.hidden, self.max_length, self.pad_id = hidden, max_length, pad_id

    def __call__(self, m: int) -> tuple[dict, int]:
        """Micro-batch m as speculators' packed batch, and the completion positions specdec scores in it."""
        from specdec.train.batches import collate

        rows = self.dataset[self.schedule(m)]
        batch = collate(rows, self.pad_id, self.max_length)
        states, found = self.reader.read(rows, batch["input_ids"].shape[1])
        if not all(found):
            raise ValueError("the training folder has rows without recorded states: rerun its data stage")
        prompts = [int(p) for p in rows["prompt_length"]]
        return self.pack(batch, prompts, states), batch["n_tokens"]

    def pack(self, batch: dict, prompts: list[int], states: torch.Tensor) -> dict:
        """speculators' packed batch of a collated micro-batch (bench/peer_dflash.py packs DFlash's)."""
        return peer_batch(batch, prompts, states, self.hidden)


def train_peer(model, data: PeerData, settings: dict, steps: int, autocast=None, log_every: int = 20,
               call_kwargs: dict | None = None) -> dict:
    """speculators' training step (its Trainer.train_epoch, on the CPU) `steps` times; the model's forward takes
    `call_kwargs` (default: EAGLE-3's ttt settings) and the loss.  -> loop wall and CPU seconds, scored tokens, the
    logged losses and its own full accuracies of the last step"""
    from speculators.losses import resolve_loss_config

    loss_config = resolve_loss_config(settings["loss"], "eager")
    if call_kwargs is None:
        call_kwargs = {"ttt_steps": settings["ttt_steps"], "ttt_step_loss_decay": settings["ttt_decay"]}
    optimizers, schedulers = peer_optimizers(model, settings, steps)
    tokens, losses, start, cpu = 0, [], time.perf_counter(), time.process_time()
    for m in range(steps):
        batch, scored = data(m)
        with autocast() if autocast is not None else torch.autocast("cpu", enabled=False):
            _, loss, metrics = model(**batch, **call_kwargs, loss_config=loss_config)
        for o in optimizers:
            o.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), settings["max_grad_norm"])
        for o in optimizers:
            o.step()
        for s in schedulers:
            s.step()
        tokens += scored
        if m == 0 or (m + 1) % log_every == 0 or m + 1 == steps:
            losses.append((m + 1, float(loss.detach())))
            print(f"peer step {m + 1} loss {losses[-1][1]:.4f} lr {schedulers[0].get_last_lr()[0]:.2e}", flush=True)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
    accuracy = {k: float(v) / max(float(metrics[k.replace("_sum", "_total")]), 1.0)
                for k, v in metrics.items() if k.startswith("full_acc_") and k.endswith("_sum")}
    return {"seconds": seconds, "cpu_seconds": cpu_seconds, "tokens": tokens, "losses": losses,
            "last_full_acc": accuracy}


def save_peer(model, out: Path) -> Path:
    """The peer's own save_pretrained, unchanged: specdec reads its `target_hidden_size: null` as the peer does (the
    draft's hidden size)."""
    model.save_pretrained(str(out))
    return out


# ---- the children: one trainer per process --------------------------------------------------------------------
def float32_newton_schulz() -> None:
    """torch's Muon (torch/optim/_muon.py) with its Newton-Schulz iteration in float32 instead of bf16."""
    import torch.optim._muon as muon

    def newton_schulz(grad, ns_coefficients, ns_steps, eps):
        a, b, c = ns_coefficients
        x = grad.float().T if grad.size(0) > grad.size(1) else grad.float()
        x = x / x.norm().clamp(min=eps)  # not in place: x may be the gradient itself
        for _ in range(ns_steps):
            gram = x @ x.T
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
        return x.T if grad.size(0) > grad.size(1) else x

    muon._zeropower_via_newtonschulz = newton_schulz


def child_peer(spec: dict) -> dict:
    from specdec.models import cpu_has_native_bf16, load_tokenizer, resolve_path
    from specdec.tokens import tokenizer_pad_id

    verifier = str(Path(resolve_path(spec["target"])).resolve())
    tokenizer = load_tokenizer(spec["target"])
    keep = torch.tensor(spec["keep_ids"])
    model = build_peer(verifier, spec["layer_ids"], keep, spec["settings"], spec["seed"], spec["attn"])
    hidden = model.config.transformer_layer_config.hidden_size
    data = PeerData(Path(spec["train_data"]), spec["layer_ids"], hidden, spec["batch"], spec["seed"],
                    spec["max_length"], tokenizer_pad_id(tokenizer))
    bf16 = cpu_has_native_bf16()  # the rule of specdec's trainer on a CPU (mixed_precision=auto)
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if bf16 else None
    muon_dtype = "bf16" if bf16 or spec["muon_bf16"] else "float32"
    if spec["settings"]["optimizer"] == "muon" and muon_dtype == "float32":
        float32_newton_schulz()
    out = train_peer(model, data, spec["settings"], spec["steps"], autocast)
    save_peer(model, Path(spec["output_dir"]) / "final")
    return {**out, "mixed_precision": "bf16" if bf16 else "no", "final": str(Path(spec["output_dir"]) / "final"),
            **({"muon": muon_dtype} if spec["settings"]["optimizer"] == "muon" else {})}


def child_specdec(spec: dict) -> dict:
    from specdec.train import distill

    clock: list[tuple[float, float, int, float, float]] = []
    losses: list[tuple[int, float]] = []
    step = distill.Distiller.train_step

    def timed(self, number, *a, **k):  # times the real step and keeps its loss at log steps; changes nothing
        start, cpu = time.perf_counter(), time.process_time()
        out = step(self, number, *a, **k)
        clock.append((start, time.perf_counter(), out[1], cpu, time.process_time()))
        if number == 1 or number % self.cfg.log_every == 0 or number == self.cfg.max_steps:
            losses.append((number, float(out[0])))
        return out

    distill.Distiller.train_step = timed
    cfg = distill.TrainConfig(**spec["config"])
    final = distill.run(cfg)
    summary = json.loads((Path(cfg.output_dir) / "train_summary.json").read_text())
    return {"seconds": clock[-1][1] - clock[0][0], "cpu_seconds": clock[-1][4] - clock[0][3],
            "tokens": sum(c[2] for c in clock), "final": str(final),
            "losses": losses, "mixed_precision": summary["mixed_precision"]}


def run_child(spec: dict, threads: int, script: Path | None = None) -> dict:
    """One trainer in its own process (`script --child SPEC`, this one by default); its result and peak RSS
    (ru_maxrss of that process)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([sys.executable, str(script or Path(__file__).resolve()), "--child", json.dumps(spec)],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{spec['run']} failed:\n{proc.stderr[-4000:]}")
    line = [x for x in proc.stdout.splitlines() if x.startswith("PEER_RESULT ")][-1]
    return json.loads(line.removeprefix("PEER_RESULT "))


def current_rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def child_main(spec: dict) -> None:
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if spec["run"] not in SPECDEC_RUNS:  # the libraries each trainer needs, before it starts: the RSS baseline
        import speculators.models.eagle3  # noqa: F401

        import specdec.train.batches  # noqa: F401
    import specdec.train.distill  # noqa: F401

    imported = current_rss_mb()
    out = child_specdec(spec) if spec["run"] in SPECDEC_RUNS else child_peer(spec)
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out["imports_rss_mb"] = imported
    print("PEER_RESULT " + json.dumps(out), flush=True)


# ---- scoring and load checks ----------------------------------------------------------------------------------
def heldout_figures(draft_dir: Path, heldout: Path, tokenizer, max_length: int, ks=KS, batch: int = 8,
                    limit: int | None = None) -> dict:
    """The trainer's held-out figures (train/eagle3_train.py) of the draft specdec loads from `draft_dir`, over the
    folder's rows (its first `limit`)."""
    from specdec.models import load_model
    from specdec.tokens import tokenizer_pad_id
    from specdec.train.batches import collate, load_split
    from specdec.train.eagle3_states import States, StatesReader
    from specdec.train.eagle3_train import evaluate_part, merge_parts

    draft = load_model(str(draft_dir), dtype="float32", device="cpu")
    width = (1 + len(draft.layer_ids)) * draft.config.target_hidden_size
    states = States("recorded", None, None, StatesReader([heldout], draft.layer_ids, width), draft.layer_ids)
    data = load_split(heldout)
    data = data if limit is None else data.select(range(min(limit, len(data))))
    pad = tokenizer_pad_id(tokenizer)

    def chunks():
        for s in range(0, len(data), batch):
            rows = data[s:s + batch]
            yield rows, collate(rows, pad, max_length)

    return merge_parts([evaluate_part(draft, states, chunks(), ks)], ks)


def speculators_agrees(folder: Path, verifier: str, heldout: Path, max_length: int) -> float:
    """speculators' from_pretrained loads `folder`; the largest |logit| difference between its first-step
    logits and specdec's on the first held-out row (same states, same tokens)."""
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    from specdec.models import load_model
    from specdec.train.batches import load_split
    from specdec.train.eagle3_states import StatesReader

    config = Eagle3SpeculatorConfig.from_pretrained(str(folder))
    config.transformer_layer_config._attn_implementation = "eager"
    config.speculators_config.verifier.name_or_path = verifier  # specdec's publish names the Hub id
    theirs = Eagle3DraftModel.from_pretrained(str(folder), config=config).float().eval()
    mine = load_model(str(folder), dtype="float32", device="cpu")
    data = load_split(heldout)
    rows = data[0:1]
    ids = torch.tensor(rows["input_ids"][0][:max_length])[None]
    hidden = mine.config.target_hidden_size
    states, _ = StatesReader([heldout], mine.layer_ids, (1 + len(mine.layer_ids)) * hidden).read(rows, ids.shape[1])
    aux = states[:, :-1, hidden:]  # the target's states at 0..T-2, read with tokens 1..T-1
    t = aux.shape[1]
    captured = {}
    hook = theirs.lm_head.register_forward_hook(lambda _m, _i, out: captured.setdefault("logits", out))
    with torch.no_grad():
        theirs(hidden_states=aux, input_ids=ids[:, 1:], document_ids=torch.zeros(1, t, dtype=torch.long),
               position_ids=torch.arange(t)[None], ttt_steps=1)
        own = mine(ids[:, 1:], aux, torch.arange(t)[None])[1]
    hook.remove()
    return float((captured["logits"].float() - own.float()).abs().max())


# The tensors vLLM 0.32's Eagle3LlamaForCausalLM.load_weights takes from a speculators folder (t2d it skips).
VLLM_TENSORS = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "embed_tokens.weight",
                *(f"layers.0.{n}.weight" for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm",
                                                   "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                   "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                                                   "mlp.down_proj"))}
VLLM_CHECK = """
import json, sys
from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig
out = {}
for folder in sys.argv[1:]:
    raw = json.load(open(folder + "/config.json"))
    config = SpeculatorsConfig.extract_transformers_pre_trained_config(json.loads(json.dumps(raw)))
    method = SpeculatorsConfig.extract_vllm_speculative_config(raw)
    out[folder] = {k: config.get(k) for k in ("architectures", "draft_vocab_size", "target_hidden_size",
                   "norm_before_residual", "norm_before_fc", "fc_norm", "norm_output",
                   "eagle_aux_hidden_state_layer_ids")} | {"method": method}
print("VLLM " + json.dumps(out))
"""


VLLM_SERVE = """
import json, sys
if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    target, draft, k, max_tokens, prompts = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    llm = LLM(model=target, dtype="float32", distributed_executor_backend="uni", disable_log_stats=False, seed=0,
              max_model_len=1024, speculative_config={"model": draft, "method": "eagle3", "num_speculative_tokens": k})
    outs = llm.generate([{"prompt_token_ids": p} for p in json.loads(prompts)],
                        SamplingParams(temperature=0, max_tokens=max_tokens))
    metrics = {m.name: getattr(m, "values", None) or getattr(m, "value", None) for m in llm.get_metrics()
               if "spec_decode" in m.name}
    print("VLLM " + json.dumps({"metrics": metrics, "outputs": [list(o.outputs[0].token_ids) for o in outs]}))
"""


def vllm_serves(target: str, folder: Path, heldout: Path, prompts: int, k: int, max_tokens: int) -> dict:
    """vLLM (its own environment) decodes the first `prompts` held-out prompts greedily, float32, with `folder` as its
    eagle3 draft: its mean accepted tokens (1 + accepted / drafts), per-position acceptance, and whether every
    output equals the target's own completion in the data."""
    from specdec.train.batches import load_split
    from specdec.vllm_env import find_vllm_python

    python = find_vllm_python()
    if python is None:
        return {"error": "vLLM's environment not found (make vllm-env)"}
    rows = load_split(heldout).select(range(prompts))
    inputs = [ids[:p] for ids, p in zip(rows["input_ids"], rows["prompt_length"])]
    env = {k_: v for k_, v in os.environ.items() if k_ not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
    proc = subprocess.run([str(python), "-c", VLLM_SERVE, target, str(folder), str(k), str(max_tokens),
                           json.dumps(inputs)], capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        return {"error": proc.stderr[-2000:]}
    out = json.loads([x for x in proc.stdout.splitlines() if x.startswith("VLLM ")][-1].removeprefix("VLLM "))
    m = out["metrics"]
    drafts, accepted = m["vllm:spec_decode_num_drafts"], m["vllm:spec_decode_num_accepted_tokens"]
    identical = all(o == ids[p:p + len(o)] for o, ids, p in zip(out["outputs"], rows["input_ids"],
                                                               rows["prompt_length"]))
    return {"tau": 1 + accepted / max(drafts, 1), "drafts": drafts,
            "per_position": [a / max(drafts, 1) for a in m["vllm:spec_decode_num_accepted_tokens_per_pos"]],
            "identical": identical}


def vllm_reads(folders: list[Path]) -> dict | None:
    """What vLLM's own parser makes of each folder's config.json (in vLLM's environment); None without one."""
    from specdec.vllm_env import find_vllm_python

    python = find_vllm_python()
    if python is None:
        return None
    proc = subprocess.run([str(python), "-c", VLLM_CHECK, *map(str, folders)], capture_output=True, text=True,
                          timeout=600, env=dict(os.environ, VLLM_LOGGING_LEVEL="ERROR"))
    if proc.returncode != 0:
        return {"error": proc.stderr[-2000:]}
    return json.loads([x for x in proc.stdout.splitlines() if x.startswith("VLLM ")][-1].removeprefix("VLLM "))


def tensor_names(folder: Path) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return set(f.keys())


# ---- the bench --------------------------------------------------------------------------------------------------
def settings_text(name: str, s: dict) -> str:
    if name in SPECDEC_RUNS:
        optimizer = "Muon (2-D) + AdamW" if s.get("optimizer") == "muon" else "AdamW"
        return (f"{optimizer} lr {s['learning_rate']:g}, wd {s['weight_decay']:g}, warm-up {s['warmup_steps']}, "
                f"{s.get('lr_schedule', 'cosine')} to 0; ttt {s['ttt_steps']}, decay {s['ttt_decay']:g}; {s['loss']}; "
                f"layer {s.get('layer_init', 'random')}, fc {s.get('fc_init', 'random')}, norm_before_residual "
                f"{str(s.get('norm_before_residual', False)).lower()}; head "
                f"{'frozen (freeze_head=true)' if s.get('freeze_head') else 'trained'}")
    opt = ("Muon (2-D, lr {lr:g}, wd {muon_weight_decay:g}) + AdamW (wd {weight_decay:g})" if s["optimizer"] == "muon"
           else "AdamW lr {lr:g}, wd {weight_decay:g}").format(**s)
    sched = ("linear, warm-up 1%" if s["schedule"] == "linear" and s["warmup_steps"] is None else
             f"warm-up {s['warmup_steps']}, cosine to 0" if s["schedule"] != "linear" else
             f"linear, warm-up {s['warmup_steps']}")
    return (f"{opt}; {sched}; ttt {s['ttt_steps']}, decay {s['ttt_decay']:g}; {s['loss']} (eager); "
            f"norm_before_residual {str(s['norm_before_residual']).lower()}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / "peer", help="data and runs go here")
    parser.add_argument("--train-prompts", type=int, default=192, help="shipped training prompts to answer")
    parser.add_argument("--heldout-prompts", type=int, default=48, help="shipped held-out prompts to answer")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--steps", type=int, default=160, help="optimizer steps of every run")
    parser.add_argument("--batch", type=int, default=4, help="samples per step of every run")
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="threads of each trainer (two OpenMP threads on a "
                        "shared 2-core machine stall whenever another process takes a core)")
    parser.add_argument("--parallel", type=int, default=0, help="trainers run at a time (default: the cores "
                        "over --threads)")
    parser.add_argument("--attn", default="sdpa", choices=("sdpa", "eager"), help="speculators' draft attention")
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=RUNS)
    parser.add_argument("--vllm-serve", type=int, default=0, metavar="N",
                        help="also decode N held-out prompts with each draft in vLLM (its environment; ~2 min a draft "
                        "on 2 cores): greedy identity and vLLM's mean accepted tokens at k = 3")
    parser.add_argument("--muon-bf16", action="store_true", help="keep torch Muon's bf16 Newton-Schulz on a CPU "
                        "without native bf16 (default there: the same iteration in float32)")
    args = parser.parse_args()
    args.parallel = args.parallel or max(1, (os.cpu_count() or 1) // args.threads)
    return args


def run_settings(args, train: dict, data: Path, heldout: Path) -> tuple[dict, dict]:
    """specdec's TrainConfig for its runs (the recipe's settings, the bench's schedule), and every run's settings."""
    specdec_cfg = {
        "target": TARGET, "draft": "eagle3", "seed": args.seed,
        "device": "cpu", "dtype": "float32", "train_data": str(data), "heldout_data": str(heldout),
        "max_length": args.max_length, "per_device_batch_size": args.batch, "max_steps": args.steps,
        "log_every": 20, "eval_every": 0, "save_every": 0, "eval_samples": 8, "eval_k": KS, "best_k": 3,
        "states": "recorded", "data_workers": 0,  # both loops read their states in-process
        **{k: train[k] for k in ("eagle_aux_layer_ids", "draft_vocab_size", "ttt_steps", "ttt_decay", "teacher",
                                 "loss", "learning_rate", "warmup_steps", "optimizer", "lr_schedule", "layer_init",
                                 "fc_init", "norm_before_residual") if k in train}}
    settings = {**{run: {"weight_decay": 0.0, **specdec_cfg, **extra} for run, extra in SPECDEC_RUNS.items()},
                "peer-defaults": PEER_DEFAULTS, "peer-ours": peer_ours(train)}
    return specdec_cfg, settings


def train_all(args, work: Path, data: Path, specdec_cfg: dict, settings: dict, keep, layer_ids) -> dict:
    """Every run of `args.runs`, each in its own process, `args.parallel` at a time: {run: its outcome}."""

    def train(run: str) -> dict:
        print(f"== {run}: {args.steps} steps x {args.batch} samples", flush=True)
        spec = {"run": run, "config": {**specdec_cfg, **SPECDEC_RUNS[run], "output_dir": str(work / f"run-{run}")}} \
            if run in SPECDEC_RUNS else {
            "run": run, "target": TARGET, "keep_ids": keep.tolist(), "layer_ids": layer_ids,
            "settings": settings[run], "seed": args.seed, "attn": args.attn, "train_data": str(data),
            "batch": args.batch, "steps": args.steps, "max_length": args.max_length,
            "output_dir": str(work / f"run-{run}"), "muon_bf16": args.muon_bf16}
        shutil.rmtree(work / f"run-{run}", ignore_errors=True)  # every run starts afresh
        out = run_child(spec, args.threads)
        print(f"{run}: " + json.dumps({k: v for k, v in out.items() if k != "losses"}), flush=True)
        return out

    with ThreadPoolExecutor(max_workers=args.parallel) as pool:  # the slowest first
        order = sorted(args.runs, key=lambda r: ("peer-defaults", "peer-ours").index(r) if r.startswith("peer") else 2)
        done = dict(zip(order, pool.map(train, order)))
    return {run: done[run] for run in args.runs}


def vllm_line(args, engines: dict | None, folder: Path, verifier: str, heldout: Path, tokenizer) -> str:
    """What vLLM makes of a saved folder: its config parser's reading and, with --vllm-serve, its serving."""
    read = (engines or {}).get(str(folder))
    line = ("vLLM's environment not found: config not parsed by vLLM" if engines is None else
            f"vLLM parse failed: {engines['error'][-300:]}" if "error" in engines else
            f"vLLM reads {read['method']}, {read['architectures']}, draft vocab {read['draft_vocab_size']}, "
            f"target hidden {read['target_hidden_size']}, layers {read['eagle_aux_hidden_state_layer_ids']}, "
            f"norm_before_residual {read['norm_before_residual']}, norm_before_fc {read['norm_before_fc']}, "
            f"norm_output {read['norm_output']}")
    if args.vllm_serve:
        served = vllm_serves(verifier, folder, heldout, args.vllm_serve, 3, args.max_new_tokens)
        replayed = heldout_figures(folder, heldout, tokenizer, args.max_length, limit=args.vllm_serve)["tau"][3]
        line += ("; vLLM serving failed: " + served["error"][-300:] if "error" in served else
                 f"; vLLM serves it ({args.vllm_serve} held-out prompts, k = 3, greedy, float32): output "
                 f"{'identical to' if served['identical'] else 'DIFFERENT from'} the target's, mean accepted "
                 f"tokens {served['tau']:.3f} over {served['drafts']} rounds (specdec's replay of the same "
                 f"rows: tau(3) {replayed:.3f}), accepted per position "
                 + ", ".join(f"{a:.3f}" for a in served["per_position"]))
    return line


def score_all(args, outcome: dict, work: Path, heldout: Path, tokenizer, verifier: str) -> tuple[list, list]:
    """Each saved folder's held-out figures (a table row) and how specdec, speculators and vLLM read it."""
    folders = {run: Path(o["final"]) for run, o in outcome.items()}
    engines = vllm_reads(list(folders.values()))
    rows, checks = [], []
    for run, folder in folders.items():
        figures = heldout_figures(folder, heldout, tokenizer, args.max_length)
        top1 = [p.get("1", float("nan")) for p in figures["top_n_agreement"]]
        o = outcome[run]
        rows.append(f"| {run} | {figures['agreement']:.3f} | {top1[1]:.3f} | {top1[2]:.3f} | "
                    + " | ".join(f"{figures['tau'][k]:.3f}" for k in KS)
                    + f" | {figures['alpha']:.3f} | {o['tokens'] / o['seconds']:.0f} | "
                    f"{o['tokens'] / o['cpu_seconds']:.0f} | {o['peak_rss_mb']:.0f} | "
                    f"{o['peak_rss_mb'] - o['imports_rss_mb']:.0f} |")
        diff = speculators_agrees(folder, verifier, heldout, args.max_length)
        names = tensor_names(folder)
        checks.append(f"- {run} (`{folder.relative_to(work)}`): specdec loads it; speculators loads it, max |logit "
                      f"difference| to specdec's on a held-out row {diff:.2e}; tensors "
                      f"{'all among' if names <= VLLM_TENSORS else 'NOT all among'} those vLLM loads"
                      f"{'' if names <= VLLM_TENSORS else ' (extra: ' + ', '.join(sorted(names - VLLM_TENSORS)) + ')'}"
                      f"; {vllm_line(args, engines, folder, verifier, heldout, tokenizer)}")
        print(rows[-1], flush=True)
    return rows, checks


def report_body(args, outcome: dict, settings: dict, rows: list, checks: list, facts: dict) -> str:
    """The results page's text; `facts`: data, heldout, data_minutes, train_examples, keep, layer_ids."""
    curves = {run: o.get("losses") for run, o in outcome.items() if o.get("losses")}
    manifest = json.loads((facts["data"] / "manifest.json").read_text())
    held = json.loads((facts["heldout"] / "manifest.json").read_text())
    return "\n".join([
        f"Every run: {args.steps} optimizer steps x {args.batch} samples, the same rows in the same order ("
        f"specdec's schedule); one process each, {args.threads} thread(s), {args.parallel} at a time, mixed "
        f"precision {', '.join(sorted({o['mixed_precision'] for o in outcome.values()}))}. Data: specdec's data stage on "
        f"the embedded target, float32 greedy, {args.max_new_tokens} new tokens: "
        f"{manifest.get('counts', {}).get('examples', facts['train_examples'])} training examples from "
        f"{args.train_prompts} shipped prompts, {held.get('counts', {}).get('examples', '?')} held-out examples "
        f"from {args.heldout_prompts} held-out prompts (data made in {facts['data_minutes']:.1f} min this run; 0 = "
        f"reused); {args.steps * args.batch / facts['train_examples']:.1f} epochs. "
        f"Draft vocabulary {facts['keep'].numel()} ids (specdec's choice, shared), layers {facts['layer_ids']}.", "",
        "Held-out figures by specdec's replay of each saved speculators-format folder: agreement = greedy agreement of "
        "the first proposal at every completion position; top-1 @2, @3 = at the round's 2nd and 3rd proposal "
        "(teacher-forced); tau(k) = mean accepted tokens per round, chain of k; alpha = expected acceptance (a lower "
        "bound from the stored top-20). Tokens/s = scored completion positions per second of the training loop "
        "(first step's start to last step's end), tokens/CPU-s the same per second of the process's CPU time (less "
        "sensitive to other users of the machine); peak RSS = ru_maxrss of the trainer's process; above imports = "
        "that peak less the process's RSS once its libraries were imported, before any model or data.", "",
        "| run | agreement | top-1 @2 | top-1 @3 | " + " | ".join(f"tau({k})" for k in KS)
        + " | alpha | tokens/s | tokens/CPU-s | peak RSS MB | above imports MB |",
        "|---|" + "---:|" * (8 + len(KS)), *rows, "",
        "Settings:", "", *[f"- {run}: {settings_text(run, settings[run])}"
                           + (f"; Muon's Newton-Schulz in {outcome[run]['muon']}" if "muon" in outcome[run] else "")
                           for run in outcome], "",
        "Loads:", "", *checks, "",
        "Training losses (each run's own loss, not comparable across trainers):", "",
        *[f"- {run}: " + ", ".join(f"{s}: {v:.3f}" for s, v in c) for run, c in curves.items()], ""])


def main() -> None:
    args = parse_args()
    if args.child:
        return child_main(json.loads(args.child))

    import results  # bench/results.py (this script runs with bench/ on its path)

    from specdec.models import load_tokenizer, resolve_path
    from specdec.train import publish as pub
    from specdec.train.batches import load_split

    provenance = results.header("Peer comparison: specdec's EAGLE-3 trainer against vLLM speculators 0.9.0's")
    train = recipe_train()
    layer_ids = list(train["eagle_aux_layer_ids"])
    work = args.work.resolve()
    data, heldout = work / "data", work / "data_heldout"
    started = time.perf_counter()
    make_data(data, "embedded:train", args.train_prompts, args.max_new_tokens, layer_ids)
    make_data(heldout, "embedded:heldout", args.heldout_prompts, args.max_new_tokens, layer_ids)
    data_minutes = (time.perf_counter() - started) / 60
    tokenizer = load_tokenizer(TARGET)
    verifier = str(Path(resolve_path(TARGET)).resolve())
    train_ds = load_split(data)
    if int(train.get("draft_vocab_size", 0)) < 1:
        raise ValueError(f"{RECIPE.name} names no explicit draft_vocab_size: the bench gives both trainers that many "
                         "ids (set it there, e.g. 4096)")
    keep = draft_vocabulary(train_ds, tokenizer, int(train["draft_vocab_size"]), len(tokenizer))
    specdec_cfg, settings = run_settings(args, train, data, heldout)
    outcome = train_all(args, work, data, specdec_cfg, settings, keep, layer_ids)
    for run in SPECDEC_RUNS.keys() & outcome.keys():  # the same kept ids; then specdec's speculators layout
        chosen = json.loads((work / f"run-{run}" / "draft_vocab.json").read_text())["ids"]
        assert sorted(chosen) == sorted(keep.tolist()), "specdec's trainer kept other ids than the bench"
        outcome[run]["final"] = str(pub.publish(pub.PublishConfig(
            draft=outcome[run]["final"], out=str(work / f"run-{run}" / "speculators"), target=TARGET,
            format="speculators", overwrite=True)))
    rows, checks = score_all(args, outcome, work, heldout, tokenizer, verifier)
    body = report_body(args, outcome, settings, rows, checks, {
        "data": data, "heldout": heldout, "data_minutes": data_minutes, "train_examples": len(train_ds),
        "keep": keep, "layer_ids": layer_ids})
    print(body)
    print(f"\nwritten to {results.write('peer-speculators', 'Peer comparison: specdec against speculators', body, provenance)}")


if __name__ == "__main__":
    main()
