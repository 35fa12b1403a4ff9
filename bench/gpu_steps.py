"""The measured steps of bench/gpu_check.py, each run in its own process (`gpu_check.py --child NAME`): specdec's
trainer at the 8B EAGLE-3 recipe's shapes, the peer (speculators 0.9.0) on the same rows, and the decoder's costs.
Each writes its figures, or its error, to WORK/NAME.json; bench/gpu_check.py's docstring says what each measures."""

from __future__ import annotations

import json
import logging
import shutil
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # conftest's tiny tokenizer, as bench/train_memory.py uses it
RECIPE = ROOT / "recipes" / "llama3.1-8b-eagle3.yaml"
GiB = 2**30
# 32 layers, so that the recipe's eagle_aux_layer_ids [2, 16, 29] apply unchanged.
TINY_TARGET = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 32, "num_attention_heads": 4,
               "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 512, "max_position_embeddings": 256,
               "tie_word_embeddings": False}


def recipe_train() -> dict:
    from specdec.config import read_recipe

    return dict(read_recipe(RECIPE)["train"])


def shapes(tiny: bool) -> dict:
    """What the steps build: the target's config, the rows, the draft vocabulary, how many steps and repeats."""
    train = recipe_train()
    if tiny:
        return {"target": TINY_TARGET, "max_length": 128, "draft_vocab_size": 96, "rows": 6, "warmup": 1, "steps": 2,
                "repeats": 2, "context": 24, "new_tokens": 8, "layer_ids": train["eagle_aux_layer_ids"]}
    import plan as plan_bench  # bench/plan.py: the published config of the recipe's target

    return {"target": plan_bench.TARGETS["recipes/llama3.1-8b-eagle3.yaml"], "max_length": train["max_length"],
            "draft_vocab_size": train["draft_vocab_size"], "rows": 16, "warmup": 2, "steps": 10, "repeats": 20,
            "context": 512, "new_tokens": 64, "layer_ids": train["eagle_aux_layer_ids"]}


# ---- shared by the steps -----------------------------------------------------------------------------
def target_config(shape: dict):
    from specdec.train.plan import config_from_dict

    return config_from_dict(shape["target"])


def random_target(shape: dict, device: torch.device):
    """The random bf16 target, its weights drawn on the device (bench/costs.py: never an 8B init on a CPU)."""
    import costs as costs_bench

    return costs_bench.random_model(target_config(shape), torch.bfloat16, device)


def memory_gib(device: torch.device) -> float:
    """Memory in use now: CUDA's allocated bytes, or the process's RSS."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / GiB
    import psutil

    return psutil.Process().memory_info().rss / GiB


def bf16_autocast(device: torch.device):
    """The trainer's rule (mixed_precision=auto): bf16 on CUDA and on CPUs that compute it natively; else None."""
    from specdec.models import cpu_has_native_bf16

    if device.type == "cuda" or cpu_has_native_bf16():
        return lambda: torch.autocast(device.type, dtype=torch.bfloat16)
    return None


def prepare(work: Path, shape: dict) -> tuple[Path, Path]:
    """The target's folder (config and a tokenizer, no weights) and a `specdec data` folder of random rows of
    max_length tokens with a one-token prompt (every position scored, the plan's upper bound); made once."""
    from conftest import tiny_tokenizer

    from specdec.train.data import write_shard

    target, data = work / "target", work / "data"
    if (data / "manifest.json").is_file():
        return target, data
    target_config(shape).save_pretrained(target)
    tiny_tokenizer().save_pretrained(target)
    g = torch.Generator().manual_seed(0)
    vocab, length = shape["target"]["vocab_size"], shape["max_length"]
    rows = [{"prompt_id": f"gpu-check-{i}", "category": "synthetic", "sample_index": 0, "turn": 0,
             "input_ids": torch.randint(3, vocab, (length,), generator=g).tolist(), "prompt_length": 1}
            for i in range(shape["rows"])]
    (data / "shards").mkdir(parents=True)
    write_shard(rows, data / "shards" / "shard-00000.parquet", top_logprobs=False)
    (data / "manifest.json").write_text(json.dumps({
        "format": "specdec-data/1", "complete": True, "num_shards": 1, "fingerprint": f"gpu-check-{length}",
        "shards": [{"index": 0, "file": "shards/shard-00000.parquet", "examples": len(rows)}]}))
    return target, data


# ---- b. the trainer -----------------------------------------------------------------------------------------------
def train_config(shape: dict, device: torch.device, target: Path, data: Path, out: Path):
    """The recipe's train settings at these shapes, for a short timed run (no held-out scoring)."""
    from specdec.config import load_config
    from specdec.train.distill import TrainConfig

    steps = shape["warmup"] + shape["steps"]
    overrides = {"target": target, "output_dir": out, "train_data": data, "heldout_data": data,
                 "device": "auto" if device.type == "cuda" else "cpu", "max_length": shape["max_length"],
                 "draft_vocab_size": shape["draft_vocab_size"], "pack": "true", "max_steps": steps,
                 "warmup_steps": 1, "log_every": steps, "eval_every": 0, "save_every": 0, "eval_samples": 0}
    return load_config(TrainConfig, RECIPE, [f"{k}={v}" for k, v in overrides.items()], section="train")


def run_trainer(cfg, target, device: torch.device):
    """The Distiller on `cfg` with `target` (already on the device) as the target it loads; -> (the trainer,
    [(start, end, tokens) per optimizer step])."""
    from specdec.eval.timing import sync
    from specdec.train import distill

    clock: list[tuple[float, float, int]] = []

    class Measured(distill.Distiller):
        """The trainer as it runs, timed per optimizer step; no checkpoint or final export (gigabytes of disk at
        these shapes, and not what is measured)."""

        def train_step(self, step, micro_batches):
            start = time.perf_counter()
            out = super().train_step(step, micro_batches)
            sync(device)
            clock.append((start, time.perf_counter(), out[1]))
            return out

        def save(self, step):
            return None

        def export(self, step, end):
            return self.out / "final"

    loads = distill.load_model
    distill.load_model = lambda *_a, **_k: target  # the weights drawn on the device stand in for a checkpoint
    try:
        trainer = Measured(cfg)
        trainer.run()
    finally:
        distill.load_model = loads
    return trainer, clock


def trainer_step(work: Path, shape: dict, device: torch.device) -> dict:
    from specdec.eval.timing import PeakMemory
    from specdec.train import plan

    target_dir, data = prepare(work, shape)
    cfg = train_config(shape, device, target_dir, data, work / "run-trainer")
    target = random_target(shape, device)
    weights = memory_gib(device)
    peak = PeakMemory(device)
    peak.reset()
    trainer, clock = run_trainer(cfg, target, device)
    peak_gib = peak.read_mb() / 1024
    mixed = trainer.accelerator.mixed_precision
    predicted = plan.plan_run(cfg, target_config(shape), device_type=device.type, mixed_precision=mixed, devices=1)
    # CUDA's allocator does not see the CUDA context and workspaces (the plan's runtime term); a CPU's RSS holds
    # the libraries the plan's runtime term stands for.
    compared = predicted.total - (predicted.term("runtime").bytes if device.type == "cuda" else 0)
    timed = clock[shape["warmup"]:]
    seconds = timed[-1][1] - timed[0][0]
    ratio = peak_gib * GiB / compared
    return {"mixed_precision": mixed, "rows": cfg.per_device_batch_size, "row_tokens": cfg.max_length,
            "ttt_steps": cfg.ttt_steps, "draft_vocab": cfg.draft_vocab_size, "timed_steps": len(timed),
            "first_step_s": clock[0][1] - clock[0][0], "steps_per_s": len(timed) / seconds,
            "tokens_per_s": sum(t[2] for t in timed) / seconds, "peak_gib": peak_gib,
            "reserved_gib": torch.cuda.max_memory_reserved(device) / GiB if device.type == "cuda" else None,
            "above_target_gib": peak_gib - weights, "plan_total_gib": predicted.total / GiB,
            "plan_compared_gib": compared / GiB, "plan_peak_phase": predicted.peak_phase, "ratio": ratio,
            "within_15": abs(ratio - 1) <= 0.15}


# ---- c. the peer ----------------------------------------------------------------------------------------------------
def write_verifier(folder: Path, target_dir: Path, target) -> Path:
    """What speculators reads of its verifier: config, tokenizer and the three tensors it copies (embeddings, head,
    final norm), saved from the random target."""
    from safetensors.torch import save_file

    shutil.copytree(target_dir, folder, dirs_exist_ok=True)
    tensors = {"model.embed_tokens.weight": target.get_input_embeddings().weight,
               "lm_head.weight": target.get_output_embeddings().weight,
               "model.norm.weight": target.get_decoder().norm.weight}
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    return folder


def peer_batches(target, data: Path, shape: dict, device: torch.device, autocast) -> tuple[list, float]:
    """The trainer's first micro-batches (its schedule: same rows, same order) as speculators' packed batches on the
    device, with the target's states computed now; -> (batches, median seconds of one target forward)."""
    import peer as peer_bench

    from specdec.eagle3 import target_states
    from specdec.eval.timing import sync
    from specdec.models import load_tokenizer
    from specdec.tokens import tokenizer_pad_id
    from specdec.train.batches import Schedule, collate, load_split, row_lengths

    rows_ds = load_split(data)
    schedule = Schedule(row_lengths(rows_ds, shape["max_length"]), 1, 0, True)
    pad = tokenizer_pad_id(load_tokenizer(str(data.parent / "target")))
    hidden, batches, forward_s = target.config.hidden_size, [], []
    for m in range(min(4, shape["warmup"] + shape["steps"])):
        rows = rows_ds[schedule(m)]
        batch = collate(rows, pad, shape["max_length"])
        ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
        sync(device)
        start = time.perf_counter()
        with torch.no_grad(), (autocast() if autocast else torch.autocast(device.type, enabled=False)):
            states = target_states(target, ids, mask, shape["layer_ids"], final=True).float()
        sync(device)
        forward_s.append(time.perf_counter() - start)
        packed = peer_bench.peer_batch(batch, [int(p) for p in rows["prompt_length"]], states.cpu(), hidden)
        batches.append(({k: v.to(device) for k, v in packed.items()}, batch["n_tokens"]))
    return batches, statistics.median(forward_s[1:] or forward_s)


def peer_step(work: Path, shape: dict, device: torch.device, attn: str) -> dict:
    import peer as peer_bench

    from specdec.eval.timing import PeakMemory
    from specdec.models import load_tokenizer
    from specdec.train.batches import load_split

    target_dir, data = prepare(work, shape)
    target = random_target(shape, device)
    keep = peer_bench.draft_vocabulary(load_split(data), load_tokenizer(str(target_dir)), shape["draft_vocab_size"],
                                       shape["target"]["vocab_size"])  # the ids specdec's trainer keeps
    verifier = write_verifier(work / "verifier", target_dir, target)
    autocast = bf16_autocast(device)
    batches, forward_s = peer_batches(target, data, shape, device, autocast)
    settings = peer_bench.peer_ours(recipe_train())  # its model, forward and loss at the recipe's settings
    before = memory_gib(device)
    peak = PeakMemory(device)
    peak.reset()
    model = peer_bench.build_peer(str(verifier), shape["layer_ids"], keep, settings, seed=0, attn=attn).to(device)

    def data_fn(m):
        return batches[m % len(batches)]

    peer_bench.train_peer(model, data_fn, settings, shape["warmup"], autocast, log_every=10**9)  # warm-up
    out = peer_bench.train_peer(model, data_fn, settings, shape["steps"], autocast, log_every=10**9)
    peak_gib = peak.read_mb() / 1024
    return {"attention": attn, "ttt_steps": settings["ttt_steps"], "timed_steps": shape["steps"],
            "tokens_per_s": out["tokens"] / out["seconds"], "steps_per_s": shape["steps"] / out["seconds"],
            "target_forward_s": forward_s,
            "tokens_per_s_with_forward": out["tokens"] / (out["seconds"] + shape["steps"] * forward_s),
            "peak_gib": peak_gib, "above_target_gib": peak_gib - before + batch_gib(batches[0][0])}


def batch_gib(batch: dict) -> float:
    """A batch's bytes. The cached batches are in `before`; one of them is added back to the peer's share, as
    specdec's share holds its micro-batch's states."""
    return sum(t.numel() * t.element_size() for t in batch.values() if torch.is_tensor(t)) / GiB


# ---- d. the decoder's costs -----------------------------------------------------------------------------------------
def costs_step(work: Path, shape: dict, device: torch.device) -> dict:
    from specdec import speculative_generate, target_generate
    from specdec.eagle3 import Eagle3Draft
    from specdec.eval.timing import measure_costs, sync

    target = random_target(shape, device)
    draft = Eagle3Draft.from_target(target, shape["layer_ids"], torch.arange(shape["draft_vocab_size"]),
                                    seed=0).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, shape["target"]["vocab_size"], (1, shape["context"]), generator=g).to(device)
    costs = measure_costs(target, draft, ids, list(range(1, 16)), shape["repeats"])  # v(k + 1), k = 1..15
    figures = {"context": shape["context"], "repeats": shape["repeats"], "target_step_ms": costs["target_step_ms"],
               "draft_step_ms": costs["draft_step_ms"], "c": costs["c"],
               "v": {"1": 1.0, **{str(int(k) + 1): v for k, v in costs["v"].items()}}}
    runs = {}
    for name, call in (("target-only", lambda: target_generate(target, ids, max_new_tokens=shape["new_tokens"])),
                       ("speculative", lambda: speculative_generate(target, draft, ids, num_draft_tokens=3,
                                                                    max_new_tokens=shape["new_tokens"]))):
        with torch.inference_mode():
            sync(device)
            start = time.perf_counter()
            runs[name] = call()
            sync(device)
            figures[f"{name}_tokens_per_s"] = shape["new_tokens"] / (time.perf_counter() - start)
    stats = runs["speculative"].stats
    figures.update(new_tokens=shape["new_tokens"], acceptance_rate=stats.acceptance_rate,
                   mean_accepted_tokens=stats.mean_accepted_tokens, fallback=bool(stats.fallback),
                   identical=bool(torch.equal(runs["speculative"].sequences, runs["target-only"].sequences)))
    return figures



def child_main(name: str, work: Path, tiny: bool, peer_attn: str) -> None:
    """Step `name` in this process: its figures, or its traceback, to WORK/NAME.json."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    device = torch.device("cuda" if torch.cuda.is_available() and not tiny else "cpu")
    shape, saved = shapes(tiny), work / f"{name}.json"
    try:
        figures = (trainer_step(work, shape, device) if name == "trainer" else
                   peer_step(work, shape, device, peer_attn) if name == "peer" else costs_step(work, shape, device))
    except Exception:
        saved.write_text(json.dumps({"error": traceback.format_exc()[-3000:]}))
        raise
    saved.write_text(json.dumps({"figures": figures}))
