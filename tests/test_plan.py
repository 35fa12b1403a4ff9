"""The memory and disk plan (train/plan/): its activation formula against the measured peaks of real EAGLE-3
training steps, its parameter counts against the modules, the refusal of a run that cannot fit, and `--plan`.

A measured step runs in a child process (this file run as a script) with glibc's mmap threshold fixed, so that
freed blocks go back to the system and the resident set follows the live tensors: the peak RSS of one
optimizer step (after a first step on the same batch has made AdamW's state) over the RSS just before it is what
the step adds, the plan's gradients + autocast copies + activations. The first step at a batch width adds more
on a CPU with native bf16, under bf16 autocast: oneDNN's kernels for its shapes, which the process then keeps
(the plan's resident "oneDNN kernel caches", measured on its own below).
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specdec.train import plan
from specdec.train.distill import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
LAYER_IDS = [2, 4, 5]


def tiny_target(hidden: int, heads: int, kv_heads: int, intermediate: int, vocab: int) -> dict:
    """A Llama config dict (no weights) for the plan and the measured draft."""
    return {"model_type": "llama", "hidden_size": hidden, "num_hidden_layers": 8, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "intermediate_size": intermediate, "vocab_size": vocab,
            "max_position_embeddings": 4096, "tie_word_embeddings": False}


def eagle3_cfg(batch: int, length: int, steps: int, vocab: int, teacher: str = "online", **kw) -> TrainConfig:
    kw = {"states": "recorded", **kw}
    return TrainConfig(draft="eagle3", target="tiny", device="cpu", teacher=teacher, per_device_batch_size=batch,
                       max_length=length, ttt_steps=steps, draft_vocab_size=vocab, eagle_aux_layer_ids=LAYER_IDS, **kw)


# ---- the measured steps (child process) ---------------------------------------------------------------


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def shape_cfg(shape: dict) -> TrainConfig:
    """The TrainConfig of a measured shape: an EAGLE-3 draft, or (`plain`) a draft of the target's first and last
    layers with an offline teacher."""
    precision = shape.get("mixed_precision", "no")
    if shape.get("plain"):
        return TrainConfig(target="tiny", device="cpu", draft_layers=[0, -1], teacher="offline",
                           mixed_precision=precision, per_device_batch_size=shape["batch"], max_length=shape["length"])
    return eagle3_cfg(shape["batch"], shape["length"], shape["steps"], shape["vocab"], shape.get("teacher", "online"),
                      mixed_precision=precision)


def _eagle3_step(cfg: TrainConfig, config, b: int, s: int):
    """(draft, loss of (draft, batch)) for an EAGLE-3 shape; the batch carries its target states."""
    from specdec.eagle3 import Eagle3Draft, draft_config
    from specdec.train.eagle3_train import eagle3_loss

    vocab, hidden, full = cfg.draft_vocab_size, config.hidden_size, config.vocab_size
    draft = Eagle3Draft(draft_config(config, LAYER_IDS, vocab))
    draft.set_vocabulary(torch.randperm(full)[:vocab])
    draft.embed_tokens.weight.requires_grad_(False)
    head = torch.nn.Linear(hidden, vocab, bias=False).requires_grad_(False) if cfg.teacher == "online" else None
    inv_map = torch.full((full,), -1, dtype=torch.long)
    inv_map[draft.draft_to_target] = torch.arange(vocab)
    extra = {"states": torch.randn(b, s, (1 + len(LAYER_IDS)) * hidden),
             "input_ids": draft.draft_to_target[torch.randint(0, vocab, (b, s))]}

    def loss(model, batch):
        return eagle3_loss(cfg, model, batch, batch["states"], head, inv_map)

    return draft, loss, extra


def _plain_step(cfg: TrainConfig, config, b: int, s: int):
    """(draft, loss of (draft, batch)) for a plain shape, as PlainTraining computes it with an offline teacher."""
    from transformers import AutoModelForCausalLM

    from specdec.train import plain_train
    from specdec.train.draft import _subset_layer_config

    draft = AutoModelForCausalLM.from_config(_subset_layer_config(config, [0, config.num_hidden_layers - 1]))

    def loss(model, batch):
        teacher = plain_train.teacher_logits(None, batch, config.vocab_size, None, None)
        return plain_train.compute_loss(cfg, plain_train._forward(model, batch), teacher, batch, None)

    return draft, loss, {}


def measure_step(shape: dict) -> int:
    """Bytes one optimizer step adds at its peak (forward, backward, AdamW), as the trainer runs it: an
    accelerate-prepared draft, the kind's loss under the accelerator's autocast, every position scored."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    torch.manual_seed(0)
    cfg, config = shape_cfg(shape), plan.config_from_dict(shape["target"])
    b, s, full = cfg.per_device_batch_size, cfg.max_length, config.vocab_size
    draft, loss_of, extra = (_plain_step if shape.get("plain") else _eagle3_step)(cfg, config, b, s)
    ids = extra.pop("input_ids", torch.randint(0, full, (b, s)))
    loss_mask = torch.ones_like(ids, dtype=torch.bool)
    loss_mask[:, 0] = loss_mask[:, -1] = False
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": loss_mask,
             "labels": torch.roll(ids, -1, dims=1), **extra}
    if cfg.teacher == "offline":
        batch["top_ids"] = torch.randint(0, full, (b, s, 20))
        batch["top_logprobs"] = torch.randn(b, s, 20).log_softmax(-1)
    AcceleratorState._reset_state(reset_partial_state=True)  # one process measures every shape
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True, mixed_precision=cfg.mixed_precision)
    model, optimizer = accelerator.prepare(draft, torch.optim.AdamW(
        [p for p in draft.parameters() if p.requires_grad], lr=1e-5))

    def step(batch: dict) -> None:
        with accelerator.autocast():
            loss = loss_of(model, batch)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    # A first step on the same batch makes AdamW's state, every lazy buffer and oneDNN's kernels for the step's
    # shapes (bf16 autocast on a CPU with native bf16: tens of MiB, kept), as any later step at that width finds them.
    step(batch)
    gc.collect()
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets the peak RSS (VmHWM) to the current RSS
    except OSError:
        return _profiled_peak(lambda: step(batch))
    before = _status("VmRSS")
    step(batch)
    return _status("VmHWM") - before


def _profiled_peak(step) -> int:
    """The step's peak of allocated bytes over the start, from the profiler's memory events (where the peak RSS
    cannot be reset)."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = [e["args"] for e in json.loads(trace.read_text())["traceEvents"] if e.get("name") == "[memory]"]
    start = events[0]["Total Allocated"] - events[0]["Bytes"]
    return max(e["Total Allocated"] for e in events) - start


def planned_step(shape: dict) -> int:
    """What the plan says one step adds: the train-step phase less its inputs (made before the measured step)."""
    cfg = shape_cfg(shape)
    p = plan.plan_run(cfg, plan.config_from_dict(shape["target"]), device_type="cpu",
                      mixed_precision=cfg.mixed_precision)
    return sum(t.bytes for t in p.phases["train step"] if "(input)" not in t.name)


# EAGLE-3's three regimes: the loss's logits kept per step (float32, offline teacher); the loss over checkpointed
# chunks (a 16384-id head at 1,099 positions: beyond one chunk, online teacher); the attention's backward blocks
# under bf16 autocast (long rows, 8 heads, a 64-id head). And a plain two-layer draft whose MLP outweighs its head.
SHAPES = {
    "kept-logits-fp32": {"batch": 2, "length": 512, "steps": 3, "vocab": 256, "teacher": "offline",
                         "target": tiny_target(64, 4, 2, 128, 512)},
    "chunked-loss-fp32": {"batch": 1, "length": 1100, "steps": 1, "vocab": 16384,
                          "target": tiny_target(32, 4, 2, 64, 32768)},
    "attention-bf16": {"batch": 1, "length": 2048, "steps": 2, "vocab": 64, "mixed_precision": "bf16",
                       "target": tiny_target(64, 8, 2, 256, 128)},
    "plain-layers-fp32": {"plain": True, "batch": 4, "length": 1024, "target": tiny_target(128, 4, 2, 512, 64)},
}


@pytest.fixture(scope="module")
def measured() -> dict[str, int]:
    """Every shape's measured step, in one child process (one import of torch and transformers)."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, __file__, json.dumps(SHAPES)], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", list(SHAPES))
def test_activation_plan_within_20_percent_of_the_measured_step(name, measured):
    got, want = measured[name], planned_step(SHAPES[name])
    assert 0.8 * got <= want <= 1.2 * got, f"{name}: planned {want / 2**20:.1f} MiB, measured {got / 2**20:.1f} MiB"


def measure_onednn_shape_bytes(shapes: int = 48) -> float:
    """The resident bytes each new matmul shape adds under bf16 autocast on a CPU (oneDNN's compiled kernels, kept
    in its caches): the RSS after `shapes` distinct row counts over the RSS before, per shape."""
    w, x = torch.randn(64, 64), torch.randn(16 + shapes, 64)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        x[:3] @ w  # oneDNN's one-off set-up
        gc.collect()
        before = _status("VmRSS")
        for rows in range(16, 16 + shapes):
            x[:rows] @ w
    return (_status("VmRSS") - before) / shapes


def test_onednn_kernel_caches_hold_what_bf16_matmul_shapes_keep(monkeypatch):
    """The resident term for a CPU run under bf16 autocast: its per-shape bytes against the RSS that new matmul
    shapes keep, within 20% where oneDNN runs bf16 natively (the CPU's flags, not SPECDEC_CPU_BF16, which changes
    what specdec chooses and not which kernels oneDNN runs; and oneDNN's own answer, which ONEDNN_MAX_CPU_ISA can
    lower), an upper bound elsewhere; its capacity from the libraries' variables; no such term in float32 or on
    CUDA."""
    from specdec.models import cpu_flags_have_bf16
    from specdec.train.plan.memory import ONEDNN_CACHE_CAPACITY

    onednn_bf16 = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)

    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    for name in ONEDNN_CACHE_CAPACITY:
        env.pop(name, None)
        monkeypatch.delenv(name, raising=False)
    out = subprocess.run([sys.executable, __file__, "onednn"], capture_output=True, text=True, env=env, cwd=ROOT,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    measured = float(out.stdout.strip().splitlines()[-1])
    target = plan.config_from_dict(tiny_target(64, 4, 2, 128, 512))

    def caches(device_type: str = "cpu", precision: str = "bf16") -> float:
        p = plan.plan_run(eagle3_cfg(1, 256, 2, 64), target, device_type=device_type, mixed_precision=precision)
        return sum(t.bytes for t in p.resident if t.name == "oneDNN kernel caches")

    per_shape = caches() / 1024
    assert measured <= 1.2 * per_shape, f"measured {measured / 1024:.0f} KiB a shape"
    if cpu_flags_have_bf16() and onednn_bf16():
        assert measured >= 0.8 * per_shape, f"measured {measured / 1024:.0f} KiB a shape"
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "64")
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "16")
    assert caches() == 64 * per_shape
    assert caches(precision="no") == caches(device_type="cuda") == 0


# ---- pure parts ---------------------------------------------------------------------------------------------


def test_parameter_counts_equal_the_built_draft():
    from specdec.eagle3 import Eagle3Draft, draft_config

    target = plan.config_from_dict(tiny_target(64, 4, 2, 128, 512))
    cfg = eagle3_cfg(2, 64, 3, 100)
    p = plan.plan_run(cfg, target, device_type="cpu", mixed_precision="no")
    draft = Eagle3Draft(draft_config(target, LAYER_IDS, 100))
    trainable = sum(x.numel() for n, x in draft.named_parameters() if n != "embed_tokens.weight")
    assert p.term("draft trainable weights").bytes == 4 * trainable
    assert p.term("draft frozen parts").bytes == 4 * draft.embed_tokens.weight.numel()
    assert p.term("AdamW state").bytes == 8 * trainable and p.term("gradients").bytes == 4 * trainable
    # states recorded: only the target's embedding, head and final norm, float32 on a CPU (tests/test_big_target.py)
    assert p.term("target weights").bytes == 4 * (2 * 512 * 64 + 64)
    # recorded states: (1 + 3 layers) x hidden x 2 bytes (bf16) per token
    assert p.reads[0].bytes == 4 * 64 * 2


def test_terms_follow_the_settings():
    target = plan.config_from_dict(tiny_target(64, 4, 2, 128, 512))
    base = plan.plan_run(eagle3_cfg(2, 256, 2, 256), target, device_type="cpu", mixed_precision="no")
    for change in ({"batch": 4}, {"length": 512}, {"steps": 4}, {"vocab": 512}):
        args = {"batch": 2, "length": 256, "steps": 2, "vocab": 256, **change}
        bigger = plan.plan_run(eagle3_cfg(**args), target, device_type="cpu", mixed_precision="no")
        assert bigger.term("activations").bytes > base.term("activations").bytes, change
    two = plan.plan_run(eagle3_cfg(2, 256, 2, 256), target, device_type="cpu", mixed_precision="no", devices=2)
    assert two.term("DDP gradient buckets").bytes == base.term("gradients").bytes
    online = plan.plan_run(eagle3_cfg(2, 256, 2, 256, states="online"), target, device_type="cpu",
                           mixed_precision="no")
    assert "target forward (online states)" in online.phases and "target forward (online states)" not in base.phases


def test_plain_draft_plan_counts_its_layers_and_head():
    target = plan.config_from_dict(tiny_target(64, 4, 2, 128, 512))
    cfg = TrainConfig(target="tiny", device="cpu", draft_layers=[0, -1], draft_vocab_size=100, teacher="offline",
                      per_device_batch_size=2, max_length=128)
    p = plan.plan_run(cfg, target, device_type="cpu", mixed_precision="no")
    layer = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64  # q, o; k, v; MLP; norms
    assert p.term("draft trainable weights").bytes == 4 * (2 * layer + 512 * 64 + 64 + 100 * 64)
    assert "target weights" not in [t.name for t in p.resident]  # an offline teacher needs no target
    assert p.term("stored top-n (input)").bytes > 0


def test_disk_of_the_data_stage():
    from specdec.train.data import DataConfig

    target = plan.config_from_dict(tiny_target(64, 4, 2, 128, 512))
    data = DataConfig(top_logprobs=5, record_features=True, eagle_aux_layer_ids=LAYER_IDS, limit=10)
    p = plan.plan_run(eagle3_cfg(2, 256, 2, 256), target, device_type="cpu", mixed_precision="no", data=data,
                      mean_length=100)
    disk = {t.name: t.bytes for t in p.disk}
    tokens = 10 * 100
    assert disk["token ids"] == 8 * tokens and disk["top-5 log-probs"] == 5 * 12 * tokens
    assert disk["recorded states"] == 4 * 64 * 2 * tokens
    assert disk["total"] == sum(v for k, v in disk.items() if k != "total")


def test_a_run_that_cannot_fit_is_refused_with_the_largest_term_and_its_fix():
    target = plan.config_from_dict(tiny_target(64, 4, 2, 128, 512))
    p = plan.plan_run(eagle3_cfg(8, 2048, 4, 256), target, device_type="cpu", mixed_precision="no",
                      memory=64 * 2**20, memory_source="plan_device_gb=0.0625")
    assert p.largest.name == "activations"
    with pytest.raises(ValueError, match="largest term is activations.*per_device_batch_size.*max_length"
                                         ".*ttt_steps.*draft_vocab_size"):
        p.check()
    plan.plan_run(eagle3_cfg(1, 64, 1, 256), target, device_type="cpu", mixed_precision="no",
                  memory=2**30, memory_source="1 GiB").check()


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_a_run_is_refused_before_it_loads_anything(tmp_path):
    from specdec.train import distill

    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text(json.dumps(tiny_target(64, 4, 2, 128, 512)))
    cfg = eagle3_cfg(8, 2048, 4, 256, output_dir=str(tmp_path / "run"), mixed_precision="no")
    cfg.target, cfg.plan_device_gb = str(tmp_path / "target"), 0.0625
    # No training data exists: the plan's refusal comes first.
    with pytest.raises(ValueError, match="largest term is activations"):
        distill.run(cfg)


def test_split_plan_args_and_the_cli(tmp_path, capsys):
    options, rest = plan.split_plan_args(["--plan", "--config", "r.yaml", "--target-config", "{}", "plan_samples=5",
                                          "max_length=64"])
    assert options.plan and options.target_config == "{}" and options.plan_samples == 5
    assert rest == ["--config", "r.yaml", "max_length=64"]
    from specdec.train import distill

    config = json.dumps(tiny_target(64, 4, 2, 128, 512))
    code = distill.main(["--plan", "draft=eagle3", f"eagle_aux_layer_ids={LAYER_IDS}", "states=recorded",
                         "device=cpu", "max_length=128", "plan_device_gb=80", "--target-config", config])
    text = capsys.readouterr().out
    assert code == 0 and "activations" in text and "fits" in text and "recorded states" in text
    code = distill.main(["--plan", "draft=eagle3", f"eagle_aux_layer_ids={LAYER_IDS}", "states=recorded",
                         "device=cpu", "max_length=2048", "per_device_batch_size=64", "plan_device_gb=0.5",
                         "--target-config", config])
    assert code == 1 and "does not fit" in capsys.readouterr().out


if __name__ == "__main__":
    torch.set_num_threads(1)
    if sys.argv[1] == "onednn":
        print(measure_onednn_shape_bytes())
    else:
        print(json.dumps({name: measure_step(shape) for name, shape in json.loads(sys.argv[1]).items()}))
