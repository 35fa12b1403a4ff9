"""A training run's memory and disk plan, from the configs alone (no weights loaded), and the check that refuses
a run that cannot fit before it starts.

    specdec train --plan --config recipes/llama3.1-8b-eagle3.yaml plan_device_gb=80 plan_devices=8
    specdec train --plan --config recipes/X.yaml --target-config target.json      # a config.json, or inline JSON
    specdec train --plan --config recipes/X.yaml plan_samples=8000 plan_mean_length=1500

Every run logs the same plan first and stops with the fix when its total exceeds the device's memory (CUDA: the
device's total memory; CPU: the RAM available now, shared by the processes on this machine). `plan_device_gb`
(GiB) replaces the device's figure, to plan for another machine or to pass a check known to be wrong.

Per device, the plan adds to what a run holds throughout (`resident`) the largest of its phases (`phases`), since
a phase's tensors are freed before the next phase starts:

    resident        draft weights (trainable float32; frozen: its embedding copy, float32, and the online
                    teacher's head rows in the target's dtype), AdamW state (2 x float32 per trainable parameter),
                    DDP's gradient buckets (float32 per trainable parameter, with more than one process), the
                    target's weights where the trainer puts it on the device, the runtime (CUDA context, libraries)
    train step      gradients (float32 per trainable parameter), autocast's half copies of the matmul weights
                    (kept for backward), the micro-batch's inputs (an EAGLE-3 draft's target states, float32),
                    activations (`eagle3_activations`, `plain_activations`)
    target forward  states computed online: the target's forward over a micro-batch, without grad
    held-out        the held-out replay over `eval_batch_size` rows of `max_length`
    optimizer step  gradients and one float32 temporary per trainable parameter (AdamW's foreach update)

Sizes are upper bounds where the data decides: every row `max_length` long, every position scored. Parameter
counts come from the draft (and target) modules built on the meta device, so they follow the code exactly.
The activation formulas count what autograd keeps per position (docstrings below); tests/test_plan.py checks them
against measured peaks of real training steps. The recorded states' read rate and the data stage's disk size
(token ids, top-n log-probs, recorded states) are reported beside, not added to memory.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch

from specdec import models
from specdec.config import _build, _CliText, help_text, load_config, split_cli
from specdec.eagle3 import (
    RECORDED_STATES_DTYPE,
    Eagle3Draft,
    check_layer_ids,
    default_layer_ids,
    draft_config,
)
from specdec.eagle3.attention import chunk_size
from specdec.models import is_embedded, resolve_device, resolve_dtype, resolve_mixed_precision
from specdec.train.batches import data_folders
from specdec.train.data import DataConfig
from specdec.train.draft import (
    DERIVED,
    EAGLE3,
    SCRATCH,
    _resolve_layers,
    _subset_layer_config,
    kept_vocab_size,
)
from specdec.train.eagle3_states import recorded_layer_ids
from specdec.train.eagle3_train import LOSS_CHUNK_VALUES

log = logging.getLogger(__name__)

GiB = 2**30
CUDA_RUNTIME = 1 * GiB  # the CUDA context, cuBLAS workspaces and the caching allocator's slack (about)
CPU_RUNTIME = GiB // 2  # a trainer process's libraries (torch, transformers, accelerate): its RSS before any model
HALF = ("bf16", "fp16")


# ---- the target's config, without weights ---------------------------------------------------------------


def config_from_dict(values: dict):
    """A transformers config from a plain dict with `model_type` (a config.json's content)."""
    from transformers import CONFIG_MAPPING

    values = dict(values)
    kind = values.pop("model_type", None)
    if kind not in CONFIG_MAPPING:
        raise ValueError(f"the target config needs a model_type transformers knows (llama, qwen3, ...), got {kind!r}")
    return CONFIG_MAPPING[kind](**values)


def target_config(target: str, override: str | dict | None = None, convert_embedded: bool = False):
    """The target's transformers config: `override` (a dict, inline JSON or a config.json path) when given, else
    from the target's folder or Hub id; the embedded target's from its cache or its GGUF file's metadata (or
    converted once with `convert_embedded`, as a run does anyway)."""
    from transformers import AutoConfig

    if override:
        if isinstance(override, dict):
            return config_from_dict(override)
        text = override.strip()
        if not text.startswith("{"):
            path = Path(text)
            if path.is_dir():
                path = path / "config.json"
            if not path.is_file():
                raise ValueError(f"target_config {override!r}: neither inline JSON nor a config.json file")
            text = path.read_text()
        return config_from_dict(json.loads(text))
    if is_embedded(target):

        cache = models.cache_root() / "smollm2-135m-instruct"
        if convert_embedded or (cache / "config.json").is_file():
            return AutoConfig.from_pretrained(models.embedded_checkpoint())
        return AutoConfig.from_pretrained(models._gguf_dir(), gguf_file=models._GGUF_FILE)
    try:
        return AutoConfig.from_pretrained(target)
    except (OSError, ValueError) as err:
        raise ValueError(f"could not read the config of target {target!r} ({err}); pass its config instead: "
                         "--target-config config.json (or inline JSON with model_type, hidden_size, ...)") from err


def _text(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


@dataclass(frozen=True)
class Widths:
    """The sizes of a decoder stack that the formulas read."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @classmethod
    def of(cls, config) -> Widths:
        text = _text(config)
        heads = text.num_attention_heads
        return cls(hidden=text.hidden_size, layers=text.num_hidden_layers, heads=heads,
                   kv_heads=getattr(text, "num_key_value_heads", None) or heads,
                   head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
                   intermediate=text.intermediate_size, vocab=text.vocab_size)

    @property
    def q(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv(self) -> int:
        return self.kv_heads * self.head_dim


def _meta_counts(module: torch.nn.Module) -> tuple[int, int]:
    """(trainable, frozen) parameter counts, each storage once (tied weights)."""
    seen, trainable, frozen = set(), 0, 0
    for p in module.parameters():
        key = id(p)
        if key in seen:
            continue
        seen.add(key)
        if p.requires_grad:
            trainable += p.numel()
        else:
            frozen += p.numel()
    return trainable, frozen


def _on_meta(build):
    with torch.device("meta"):
        return build()


def target_parameters(config) -> int:
    """The target's parameter count, from its module built on the meta device."""
    from transformers import AutoModelForCausalLM

    return sum(_meta_counts(_on_meta(lambda: AutoModelForCausalLM.from_config(config))))


# ---- activations -----------------------------------------------------------------------------------------


def eagle3_activations(batch: int, length: int, steps: int, w: Widths, draft_vocab: int, aux_layers: int,
                       half: bool, teacher: str, loss: str = "fkl", top_n: int = 0) -> dict[str, int]:
    """Peak bytes of one EAGLE-3 micro-batch's forward and backward (`eagle3_train.eagle3_loss` through the
    prepared draft), beyond its inputs and the parameters' gradients.  -> {kept, loss, forward, backward, peak}

    Per position (P = batch x (length - 1) draft positions, all scored: an upper bound) and unrolled step, with
    H, Q, K, I the hidden, query, key/value and MLP widths, autograd keeps:

        float32:  32 H + 8 Q + 8 K + 16 I bytes
                  h (the step's input, saved by hidden_norm), hidden_norm's and input_layernorm's outputs,
                  cat(.) [2H] (q/k/v's input), q and k after rotary, v (the attention's checkpointed chunks keep
                  their inputs), o_proj's input, the residual r and its norm, MLP gate, up, silu(gate),
                  silu(gate) * up, and the step's output
        bf16/fp16 autocast:  36 H + 4 Q + 4 K + 8 I
                  the same in half precision, except for float32 copies made by the RMSNorms (h, r) and
                  input_layernorm (the embeddings are float32), and autocast's casts of an input that each
                  projection makes anew: cat(.) three times (q, k, v), the MLP's input twice (gate, up); the
                  outputs come back as float32 (accelerate's convert_outputs_to_fp32)

    once per position: fc's input (the aux states, a contiguous copy / a half cast) and the rotary tables.
    The loss (`LOSS_CHUNK_VALUES`): each step scores its positions in chunks of R = 2^24 / draft_vocab rows. When a
    step fits one chunk, each step keeps its norm chain (12 H, half 10 H) and 9 V bytes per row (forward KL:
    log q, p, the where mask), and the last step's chunk peaks at 41 V (student and teacher logits, their kept
    rows, log q, log p, p, the mask, log p - log q, zeros, the where; cross-entropy alone: 4 V kept, 12 V at
    the peak); beyond one chunk, each step keeps only its chunks' inputs (the output rows, the teacher's input
    rows or stored top-n) and one chunk at a time peaks at 41 V per row, in the forward and again when backward
    recomputes it. The backward of the last step's MLP adds three [I] float32 gradients.
    The attention (specdec/eagle3/attention.py) scores C queries at a time against up to n keys in float32: its
    backward holds four such [B, heads, C, n] blocks (the recomputed softmax, two zero-padded slice gradients, a
    bmm's gradient; under half autocast three float32 ones: the softmax, its gradient cast back to float32 and
    softmax's backward), while the step's MLP part is already freed and each step's output gradient [P, H] waits.
    """

    hid, q, k, inter, v = w.hidden, w.q, w.kv, w.intermediate, draft_vocab
    n = max(length - 1, 1)
    positions = batch * n
    act = 2 if half else 4
    per_step = (36 * hid + 4 * q + 4 * k + 8 * inter) if half else (32 * hid + 8 * q + 8 * k + 16 * inter)
    after_attention = (8 * inter + 12 * hid + 2 * q) if half else (16 * inter + 12 * hid + 4 * q)
    once = aux_layers * hid * act + 2 * w.head_dim * act + 8 * steps + 16  # + the per-step masks and ids
    kept = positions * (once + steps * per_step)
    divergence = loss != "ce"
    logit_bytes = (41 if divergence else 12) * v  # the loss's peak per row in [rows, V] float32 blocks
    logit_kept = (9 if divergence else 4) * v
    teacher_in = 4 * hid if teacher == "online" else 12 * top_n if teacher == "offline" else 0
    norm = (10 if half else 12) * hid
    rows = max(1, LOSS_CHUNK_VALUES // v)
    if positions > rows:  # checkpointed chunks: only their inputs stay; one chunk's logits at a time
        loss_kept = steps * positions * (4 * hid + teacher_in + 8)
        loss_peak = rows * (logit_bytes + norm)
        backward_loss = kept + loss_kept + loss_peak  # backward recomputes a chunk with everything still kept
    else:
        loss_kept = steps * positions * (norm + logit_kept)
        loss_peak = positions * (logit_bytes - logit_kept + teacher_in)
        backward_loss = 0
    forward = kept + loss_kept + loss_peak
    heads_chunk = chunk_size(batch, w.heads, n)
    attention = (12 if half else 16) * batch * w.heads * min(heads_chunk, n) * n
    backward_attention = kept - positions * after_attention + steps * positions * 4 * hid + attention
    backward_mlp = kept + steps * positions * 4 * hid + 3 * positions * inter * 4
    backward = max(backward_loss, backward_attention, backward_mlp)
    return {"kept": kept, "loss": loss_kept, "forward": forward, "backward": backward,
            "peak": max(forward, backward)}


def plain_activations(batch: int, length: int, w: Widths, layers: int, vocab: int, half: bool,
                      loss: str = "fkl") -> dict[str, int]:
    """Peak bytes of one plain draft micro-batch's forward and backward (a Llama-like causal LM, sdpa
    attention), beyond its inputs and the parameters' gradients.  -> {kept, forward, peak}

    Per position and decoder layer autograd keeps 24 H + 12 Q + 8 K + 16 I bytes in float32 (the layer's input,
    both RMSNorms' normalised rows and outputs, the residual after attention, q and k after rotary, v,
    sdpa's output and o_proj's input, the MLP's four [I] tensors) and 26 H + 6 Q + 4 K + 8 I under half
    autocast (float32 residual stream, a cast of each projection's input); the final norm 12 H (10 H). The loss
    then holds the logits of the whole micro-batch (float32: accelerate returns them so) and, per scored
    position, forward KL's 41 V bytes (as in `eagle3_activations`)."""
    hid, q, k, inter = w.hidden, w.q, w.kv, w.intermediate
    positions = batch * length
    per_layer = (26 * hid + 6 * q + 4 * k + 8 * inter) if half else (24 * hid + 12 * q + 8 * k + 16 * inter)
    kept = positions * (layers * per_layer + (10 if half else 12) * hid + 16)
    logit_bytes = (41 if loss != "ce" else 12) * vocab
    forward = kept + positions * (4 * vocab + logit_bytes)
    backward = kept + positions * (4 * vocab + 4 * hid) + 2 * positions * inter * 4  # the MLP's [I] gradients
    return {"kept": kept, "forward": forward, "peak": max(forward, backward)}


def target_forward_bytes(batch: int, length: int, w: Widths, dtype_bytes: int, kept_width: int = 0) -> int:
    """Peak bytes of a target forward without grad over [batch, length]: one layer's transient (hidden,
    residual, norm, q/k/v, attention output, MLP) plus what hooks keep (`kept_width` values per position) and
    the padded batch's [B, 1, S, S] boolean mask."""
    positions = batch * length
    layer = (4 * w.hidden + 2 * w.q + 2 * w.kv + 3 * w.intermediate) * dtype_bytes
    return positions * (layer + kept_width * dtype_bytes) + batch * length * length


# ---- the plan ---------------------------------------------------------------------------------------------


@dataclass
class Term:
    """One line of the plan: bytes, what they are, and what to change when they are the largest."""

    name: str
    bytes: float
    detail: str = ""
    fix: str = ""


@dataclass
class Plan:
    """Per device: `resident` terms for the whole run plus the largest phase; reads and disk beside."""

    title: str
    devices: int
    resident: list[Term]
    phases: dict[str, list[Term]]
    reads: list[Term] = field(default_factory=list)
    disk: list[Term] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    memory: int = 0  # the device's bytes the plan is checked against (0: unknown)
    memory_source: str = ""

    def phase_total(self, name: str) -> float:
        return sum(t.bytes for t in self.phases[name])

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phase_total)

    @property
    def total(self) -> float:
        """Bytes per device at the peak."""
        return sum(t.bytes for t in self.resident) + (self.phase_total(self.peak_phase) if self.phases else 0)

    def term(self, name: str) -> Term:
        """A term of the resident set or of any phase, by name."""
        for t in [*self.resident, *(t for terms in self.phases.values() for t in terms)]:
            if t.name == name:
                return t
        raise KeyError(name)

    @property
    def largest(self) -> Term:
        """The largest term of the peak (resident terms and the peak phase's)."""
        return max([*self.resident, *self.phases.get(self.peak_phase, [])], key=lambda t: t.bytes)

    def fits(self) -> bool:
        return not self.memory or self.total <= self.memory

    def render(self) -> str:
        """The plan as text: one line per term, GiB."""
        lines = [self.title, "  resident (whole run)"]
        lines += [_line(t) for t in self.resident]
        for name in self.phases:
            mark = "  <- peak" if name == self.peak_phase else ""
            lines.append(f"  phase {name}: {_gib(self.phase_total(name))}{mark}")
            lines += [_line(t) for t in self.phases[name]]
        verdict = ""
        if self.memory:
            share = self.total / self.memory
            verdict = (f" of {_gib(self.memory)} ({self.memory_source}): "
                       f"{'fits' if self.fits() else 'DOES NOT FIT'}, {share:.0%}")
        lines.append(f"  total per device: {_gib(self.total)}{verdict}; largest term: {self.largest.name}")
        if self.reads:
            lines.append("  reads")
            lines += [_line(t, unit="rate") for t in self.reads]
        if self.disk:
            lines.append("  disk (data stage)")
            lines += [_line(t) for t in self.disk]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def check(self) -> None:
        """Refuse a plan whose total exceeds the device's memory, naming the largest term and its fix."""
        if self.fits():
            return
        big = self.largest
        raise ValueError(
            f"this run needs about {_gib(self.total)} per device but {self.memory_source} has {_gib(self.memory)}: "
            f"the largest term is {big.name} ({_gib(big.bytes)}{', ' + big.detail if big.detail else ''}). "
            f"{big.fix or 'Use a device with more memory.'} (`specdec train --plan --config ...` prints the plan; "
            f"plan_device_gb=N checks against N GiB instead.)")


def _gib(n: float) -> str:
    """Bytes as GiB (MiB below one GiB, so small runs read too)."""
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / 2**20:.1f} MiB"


def _count(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.1f}k" if n >= 1e3 else str(n)


def _line(t: Term, unit: str = "bytes") -> str:
    value = t.detail if unit == "rate" else _gib(t.bytes)
    extra = f"  ({t.detail})" if t.detail and unit != "rate" else ""
    return f"    {t.name:<34} {value}{extra}"


@dataclass
class PlanOptions:
    """`specdec train --plan` options that are not training settings (the shape of the data to plan disk for,
    the target's config where it cannot be read)."""

    plan: bool = False  # print the plan and exit
    target_config: str = ""  # the target's config.json path or inline JSON, when the target cannot be resolved
    plan_samples: int = 0  # data stage: samples to plan disk for; 0 = the recipe's data limit x num_samples
    plan_mean_length: int = 0  # data stage: mean tokens per sample (prompt + completion); 0 = half of max_length


def split_plan_args(argv: list[str]) -> tuple[PlanOptions, list[str]]:
    """Take `--plan` and the `PlanOptions` keys out of a `specdec train` command line. -> (options, the rest)"""
    names = {f.name for f in fields(PlanOptions)}
    values, rest, i = {}, [], 0
    while i < len(argv):
        arg = argv[i]
        key, sep, value = arg.lstrip("-").partition("=")
        key = key.replace("-", "_")
        if arg == "--plan":
            values["plan"] = True
        elif key in names and (sep or arg.startswith("--")):
            if not sep:  # --target-config VALUE
                if i + 1 >= len(argv):
                    raise ValueError(f"{arg} needs a value")
                value, i = argv[i + 1], i + 1
            values[key] = value
        else:
            rest.append(arg)
        i += 1

    return _build(PlanOptions, {k: v if isinstance(v, bool) else _CliText(v) for k, v in values.items()}), rest


def _draft_module(cfg, target_cfg, draft_vocab: int):
    """The draft as the trainer builds it, on the meta device (its parameters' shapes and requires_grad)."""

    if cfg.draft == EAGLE3:

        layers = _text(target_cfg).num_hidden_layers
        ids = check_layer_ids(cfg.eagle_aux_layer_ids or default_layer_ids(layers), layers)
        config = draft_config(target_cfg, ids, draft_vocab)
        model = _on_meta(lambda: Eagle3Draft(config))
        model.embed_tokens.weight.requires_grad_(False)
        if cfg.freeze_head:
            model.lm_head.requires_grad_(False)
        return model, len(ids), Widths.of(config), 1
    import copy

    from transformers import AutoConfig, AutoModelForCausalLM

    if cfg.draft == DERIVED:
        chosen = _resolve_layers(cfg.draft_layers, _text(target_cfg).num_hidden_layers)
        config = _subset_layer_config(target_cfg, chosen)
    elif cfg.draft == SCRATCH:
        config = copy.deepcopy(target_cfg)
        for key, value in cfg.draft_config.items():
            setattr(config, key, value)
    else:
        config = AutoConfig.from_pretrained(cfg.draft)
    model = _on_meta(lambda: AutoModelForCausalLM.from_config(config))
    if kept_vocab_size(cfg, draft_vocab):
        head = model.get_output_embeddings()
        model.set_output_embeddings(_on_meta(lambda: torch.nn.Linear(head.in_features, draft_vocab,
                                                                    bias=head.bias is not None)))
    if cfg.freeze_embeddings:
        model.get_input_embeddings().weight.requires_grad_(False)
    if cfg.freeze_head:
        model.get_output_embeddings().requires_grad_(False)
    if cfg.lora:
        trainable = _lora_parameters(model, cfg.lora_r, cfg.lora_target_modules)
        if kept_vocab_size(cfg, draft_vocab):
            trainable += model.get_output_embeddings().weight.numel()
        model.requires_grad_(False)
        model.lora_trainable = trainable
    return model, 0, Widths.of(config), _text(config).num_hidden_layers


def _lora_parameters(model, r: int, modules) -> int:
    return sum(r * (m.in_features + m.out_features) for name, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in modules)


def _states_online(cfg) -> tuple[bool, str]:
    """Whether an EAGLE-3 run computes the target's states online, and why."""
    if cfg.states != "auto":
        return cfg.states == "online", f"states={cfg.states}"
    try:

        folders, _ = data_folders(cfg)
        recorded = all(recorded_layer_ids(f) is not None for f in folders)
    except (ValueError, OSError, KeyError):
        return True, "states=auto and no training data yet: planned as online"
    return (not recorded), ("states=auto: the data recorded them" if recorded else "states=auto: not recorded")


def plan_run(cfg, target_cfg, *, device_type: str, mixed_precision: str, devices: int = 1, memory: int = 0,
             memory_source: str = "", data=None, samples: int = 0, mean_length: int = 0) -> Plan:
    """The plan of `cfg` (a TrainConfig) over a target of config `target_cfg`, on `devices` devices of
    `device_type` ("cuda" or "cpu") under `mixed_precision` ("no", "bf16", "fp16"). `data` (a DataConfig) and
    `samples`/`mean_length` size the data stage's disk."""

    half = mixed_precision in HALF
    tw = Widths.of(target_cfg)
    draft_vocab = kept_vocab_size(cfg, tw.vocab) or tw.vocab
    draft, aux, dw, draft_layers = _draft_module(cfg, target_cfg, draft_vocab)
    trainable, frozen = _meta_counts(draft)
    if cfg.lora and hasattr(draft, "lora_trainable"):
        trainable = draft.lora_trainable
    eagle = cfg.draft == EAGLE3
    target_dtype = resolve_dtype(cfg.dtype, torch.device(device_type))
    tbytes = torch.finfo(target_dtype).bits // 8
    b, s = cfg.per_device_batch_size, cfg.max_length
    shape = f"B={b}, S={s}" + (f", ttt_steps={cfg.ttt_steps}" if eagle else "") + f", draft vocab {draft_vocab}"
    top_n = (data.top_logprobs if data is not None else 0) or 20  # an offline teacher's stored n (20: usual)
    online, states_why = _states_online(cfg) if eagle else (False, "")
    resident = [
        Term("draft trainable weights", 4 * trainable, f"{_count(trainable)} float32",
             f"a smaller head: draft_vocab_size (now {draft_vocab})"),
        Term("draft frozen parts", 4 * frozen, f"{_count(frozen)} float32"
             + (": the target's embedding table" if eagle or cfg.freeze_embeddings else ""),
             "the frozen embedding copy is the target's whole table: a device with more memory"),
        Term("AdamW state", 8 * trainable, "2 x float32 per trainable parameter",
             f"a smaller head: draft_vocab_size (now {draft_vocab})"),
    ]
    if cfg.teacher == "online" and eagle:
        resident.append(Term("online teacher head rows", tbytes * draft_vocab * tw.hidden,
                             f"[{draft_vocab}, {tw.hidden}] {str(target_dtype)[6:]}",
                             f"draft_vocab_size (now {draft_vocab})"))
    if devices > 1:
        resident.append(Term("DDP gradient buckets", 4 * trainable, "float32 per trainable parameter",
                             "fewer trainable parameters (draft_vocab_size)"))
    if cfg.needs_target:
        why = ("the trainer loads it for every EAGLE-3 run (draft construction, online states)" if eagle
               else f"teacher={cfg.teacher}")
        fix = ("dtype=bfloat16" if tbytes > 2 else "a device with more memory") + (
            "" if eagle else "; teacher=offline (the data's stored top-n) needs no target on the device")
        resident.append(Term("target weights", tbytes * target_parameters(target_cfg),
                             f"{str(target_dtype)[6:]}; {why}", fix))
    resident.append(Term("runtime", CUDA_RUNTIME if device_type == "cuda" else CPU_RUNTIME,
                         "CUDA context and workspaces" if device_type == "cuda" else "the process's libraries"))

    fix_acts = (f"lower per_device_batch_size (now {b}; raise grad_accum_steps to keep the global batch), "
                f"max_length (now {s})" + (f" or ttt_steps (now {cfg.ttt_steps})" if eagle else "")
                + f"; the loss's logits grow with draft_vocab_size (now {draft_vocab})")
    step = [Term("gradients", 4 * trainable, "float32 per trainable parameter",
                 f"a smaller head: draft_vocab_size (now {draft_vocab})")]
    if half:  # every linear layer's weight, frozen ones (LoRA's base) included: backward needs them all
        matmul = sum(m.weight.numel() for m in draft.modules() if isinstance(m, torch.nn.Linear))
        step.append(Term("autocast weight copies", 2 * matmul, "half copies kept for backward", fix_acts))
    if eagle:
        width = (1 + aux) * tw.hidden
        step.append(Term("target states (input)", 4 * b * s * width, f"float32 [B, S, {width}]", fix_acts))
        acts = eagle3_activations(b, s, cfg.ttt_steps, dw, draft_vocab, aux, half, cfg.teacher, cfg.loss, top_n)
    else:
        acts = plain_activations(b, s, dw, draft_layers, draft_vocab, half, cfg.loss)
    if cfg.teacher == "offline":
        step.append(Term("stored top-n (input)", 12 * b * s * top_n, f"int64 ids + float32 log-probs, n={top_n}",
                         fix_acts))
    step.append(Term("activations", acts["peak"], shape, fix_acts))
    if not eagle and cfg.teacher in ("online", "on_policy"):
        teacher = target_forward_bytes(b, s, tw, tbytes) + b * s * (tbytes * tw.vocab + 4 * draft_vocab)
        step.append(Term("online teacher logits", teacher, "the target's forward and head, without grad",
                         "teacher=offline (stored top-n) or a lower per_device_batch_size / max_length"))
    phases = {"train step": step}
    if online:
        width = (1 + aux) * tw.hidden
        phases["target forward (online states)"] = [Term(
            "target forward", target_forward_bytes(b, s, tw, tbytes, width) + b * s * width * (tbytes + 4),
            f"{states_why}; without grad, its states cast to float32",
            "record the states in the data stage (record_features=true, then states=recorded) or lower "
            f"per_device_batch_size (now {b}) / max_length (now {s})")]
    phases["held-out"] = [Term("held-out replay", _heldout_bytes(cfg, tw, dw, draft_vocab, aux, online,
                                                                  data is not None and data.top_logprobs > 0, tbytes),
                               f"eval_batch_size={cfg.eval_batch_size} x S={s}",
                               f"lower eval_batch_size (now {cfg.eval_batch_size}) or max_length (now {s})")]
    phases["optimizer step"] = [Term("gradients + update temporaries", 8 * trainable, "AdamW's foreach update")]

    title = (f"plan: draft {cfg.draft} over {cfg.target} (hidden {tw.hidden}, {tw.layers} layers, vocab {tw.vocab}), "
             f"{device_type}, {'mixed precision ' + mixed_precision if half else 'float32'}, {devices} device(s), "
             "per device")
    plan = Plan(title, devices, resident, phases, memory=memory, memory_source=memory_source)
    plan.reads, plan.disk, plan.notes = _reads_and_disk(cfg, tw, aux, devices, online, data, samples, mean_length)
    plan.notes.append("upper bounds where the data decides: every row max_length long, every position scored")
    return plan


def _heldout_bytes(cfg, tw: Widths, dw: Widths, draft_vocab: int, aux: int, online: bool, topn: bool,
                   tbytes: int) -> int:
    """The held-out replay's peak: an EAGLE-3 draft unrolled max(eval_k) deep over eval_batch_size rows
    (float32, no grad: each step's output, keys and values kept; one step's logits and their comparison at a
    time) and, where the data stored top-n log-probs, the first proposal's q at those ids, a chunk of positions
    at a time; a plain draft's logits and (online) the target's, with alpha's
    [rows, target vocabulary] blocks."""

    b, s, v, e = cfg.eval_batch_size, cfg.max_length, draft_vocab, tw.vocab
    positions = b * s
    if cfg.draft == EAGLE3:
        width = (1 + aux) * tw.hidden
        states = 4 * positions * width
        replay = max(cfg.eval_k) * positions * (4 * dw.hidden + 8 * dw.kv) + positions * 5 * v
        # alpha reads q at the stored top-n ids only, over chunks of positions (train/eagle3_train.py)
        chunk = min(positions, max(1, LOSS_CHUNK_VALUES // v))
        alpha = positions * 8 * dw.hidden + chunk * 12 * v if topn else 0
        forward = target_forward_bytes(b, s, tw, tbytes, width) + positions * width * (tbytes + 4) if online else 0
        return max(states + max(replay, alpha), forward)
    logits = positions * 8 * v
    alpha = positions * (16 * e + 12 * v) if cfg.needs_target else positions * (4 * e + 12 * v) if topn else 0
    forward = target_forward_bytes(b, s, tw, tbytes) if cfg.needs_target else 0
    return logits + max(alpha, forward)


def _reads_and_disk(cfg, tw: Widths, aux: int, devices: int, online: bool, data, samples: int,
                    mean_length: int) -> tuple[list[Term], list[Term], list[str]]:

    reads, disk, notes = [], [], []
    state_bytes = torch.finfo(RECORDED_STATES_DTYPE).bits // 8
    per_token = (1 + aux) * tw.hidden * state_bytes if cfg.draft == EAGLE3 else 0
    if per_token:
        step_tokens = cfg.per_device_batch_size * cfg.max_length
        read_note = " (this config computes them online: none read)" if online else ""
        per_step = per_token * step_tokens * devices * cfg.grad_accum_steps
        reads.append(Term("recorded states", per_token,
                          f"{per_token / 1024:.1f} KiB per trained token ((1 + {aux}) x {tw.hidden} x "
                          f"{state_bytes} bytes); {_gib(per_token * step_tokens)} per device and micro-batch, "
                          f"{_gib(per_step)} per optimizer step over {devices} device(s){read_note}"))
    if data is not None and not samples:
        samples = (data.limit or 0) * data.num_samples
    if not samples:
        return reads, disk, notes
    assumed = "" if mean_length else " (assumed: half of max_length; set plan_mean_length)"
    mean_length = mean_length or cfg.max_length // 2
    tokens = samples * mean_length
    disk.append(Term("token ids", 8 * tokens, f"{samples} samples x {mean_length} tokens{assumed}, int64"))
    top_n = data.top_logprobs if data is not None else 0
    if top_n:
        disk.append(Term(f"top-{top_n} log-probs", 12 * top_n * tokens, "int64 id + float32 log-prob per entry"))
    if per_token:
        recorded = data is not None and data.record_features
        disk.append(Term("recorded states", per_token * tokens,
                         "record_features=true" if recorded else "only with record_features=true (not set)"))
    total = sum(t.bytes for t in disk if "not set" not in t.detail)
    disk.append(Term("total", total, "uncompressed parquet and safetensors: an upper bound"))
    return reads, disk, notes


# ---- the device ---------------------------------------------------------------------------------------


def device_memory(device: torch.device, override_gb: float = 0.0, local_processes: int = 1) -> tuple[int, str]:
    """The bytes one process may plan for, and where the figure comes from: `override_gb` GiB when given; a
    CUDA device's total memory; on a CPU the RAM available now, shared by this machine's processes."""
    if override_gb:
        return int(override_gb * GiB), f"plan_device_gb={override_gb:g}"
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return int(props.total_memory), f"{props.name}"
    try:
        import psutil

        available = psutil.virtual_memory().available
    except ImportError:
        available = 0
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    if not available:
        return 0, "unknown"
    share = f", shared by {local_processes} processes" if local_processes > 1 else ""
    return available // max(local_processes, 1), f"this machine's available RAM{share}"


def plan_for(cfg, options: PlanOptions | None = None, *, device: torch.device | None = None,
             mixed_precision: str | None = None, devices: int | None = None, data=None,
             convert_embedded: bool = False) -> Plan:
    """The plan of `cfg` on this machine (or the one `plan_device_gb` / `plan_devices` describe)."""

    options = options or PlanOptions()
    if cfg.plan_device_gb < 0 or cfg.plan_devices < 0:
        raise ValueError(f"plan_device_gb and plan_devices must be >= 0 (0 = this machine's), got "
                         f"{cfg.plan_device_gb} and {cfg.plan_devices}")
    if device is None:
        if cfg.plan_device_gb:  # planning another machine: device=auto means a GPU's
            device = torch.device("cuda" if cfg.device == "auto" else cfg.device)
        else:
            device = resolve_device(cfg.device)
    if mixed_precision is None:
        here = device.type == "cpu" or torch.cuda.is_available()
        auto_elsewhere = "bf16" if cfg.mixed_precision == "auto" else cfg.mixed_precision  # a GPU's, planned
        mixed_precision = resolve_mixed_precision(cfg.mixed_precision, cfg.device) if here else auto_elsewhere
    devices = devices or cfg.plan_devices or int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if device.type == "cpu" else 1
    memory, source = device_memory(device, cfg.plan_device_gb, local)
    target_cfg = target_config(cfg.target, options.target_config or None, convert_embedded)
    return plan_run(cfg, target_cfg, device_type=device.type, mixed_precision=mixed_precision, devices=devices,
                    memory=memory, memory_source=source, data=data, samples=options.plan_samples,
                    mean_length=options.plan_mean_length)


def recipe_data_config(path: str | None):
    """The recipe's `data:` section (None without a recipe or one that does not validate here)."""
    if not path:
        return None

    try:
        return load_config(DataConfig, path, section="data")
    except ValueError as err:
        log.warning("plan: the recipe's data section is not read (%s); disk is planned without it", err)
        return None


# ---- the entry points: `specdec train --plan` and every run's first lines ------------------------------------


def check_run(cfg, device: torch.device, mixed_precision: str, world: int, main: bool) -> None:
    """A run's plan, logged by the main process, and its check: raises (on every process) when the total
    exceeds the device's memory. A plan that cannot be made (an unreadable config) only warns."""
    try:
        plan = plan_for(cfg, device=device, mixed_precision=mixed_precision, devices=world, convert_embedded=True)
    except Exception as err:  # noqa: BLE001 - the plan informs; loading reports the real error
        log.warning("no memory plan for this run (%s)", err)
        return
    if main:
        log.info("%s", plan.render())
    plan.check()


def show(cfg, options: PlanOptions, argv: list[str]) -> int:
    """`specdec train --plan`: print the plan (with the recipe's data section for disk); 1 when it does not fit."""

    path, _ = split_cli(argv, type(cfg))
    plan = plan_for(cfg, options, data=recipe_data_config(path))
    print(plan.render())
    if not plan.fits():
        big = plan.largest
        print(f"does not fit: the largest term is {big.name}. {big.fix}")
        return 1
    return 0


def help_lines() -> str:
    """`specdec train --help`'s lines for the plan options."""

    text = help_text(PlanOptions, "", "plan: `specdec train --plan` (also reads plan_device_gb, plan_devices)")
    return "\n" + "\n".join(text.splitlines()[2:-2])
