"""EAGLE-3's terms of the memory plan (train/plan/kind.py: `KindPlan`): its draft on the meta device, the target's
states as the step's input (or the online target forward that computes them), the unrolled training-time test's
activations, the online teacher's head rows, its held-out replay and the recorded states it reads."""

from __future__ import annotations

import torch

from specdec.eagle3 import (
    RECORDED_STATES_DTYPE,
    Eagle3Draft,
    check_layer_ids,
    default_layer_ids,
    draft_config,
)
from specdec.eagle3.attention import chunk_size
from specdec.train.batches import data_folders
from specdec.train.eagle3_states import recorded_layer_ids
from specdec.train.eagle3_train import LOSS_CHUNK_VALUES
from specdec.train.plan.activations import loss_row_bytes, target_forward_bytes
from specdec.train.plan.kind import KindPlan, PlanContext
from specdec.train.plan.report import Term, gib
from specdec.train.plan.target import Widths, on_meta, text_config


def eagle3_plan(ctx: PlanContext) -> KindPlan:
    cfg, tw, b, s = ctx.cfg, ctx.tw, ctx.cfg.per_device_batch_size, ctx.cfg.max_length
    opts = cfg.options
    layers = text_config(ctx.target_cfg).num_hidden_layers
    ids = check_layer_ids(opts.eagle_aux_layer_ids or default_layer_ids(layers), layers)
    config = draft_config(ctx.target_cfg, ids, ctx.draft_vocab)
    model = on_meta(lambda: Eagle3Draft(config))
    model.embed_tokens.weight.requires_grad_(False)
    if cfg.freeze_head:
        model.lm_head.requires_grad_(False)
    dw, aux, width = Widths.of(config), len(ids), (1 + len(ids)) * tw.hidden
    online, states_why = states_online(cfg)
    fix = ctx.activation_fix(f", ttt_steps (now {opts.ttt_steps}) or slice_tokens (now {cfg.slice_tokens})")
    rows = ctx.forward_rows  # what one forward and backward holds (slice_tokens)
    acts = eagle3_activations(rows, s, opts.ttt_steps, dw, ctx.draft_vocab, aux, ctx.half, cfg.teacher, cfg.loss,
                              ctx.top_n, packed=cfg.pack)
    plan = KindPlan(model, fix, _heldout_bytes(ctx, dw, aux, online), frozen_note=": the target's embedding table",
                    target_why="loaded whole where its states are computed online (recorded states: its "
                    "embedding, norm and head only)")
    plan.step = [Term("target states (input)", 4 * b * s * width, f"float32 [B, S, {width}]", fix),
                 Term("activations", acts["peak"],
                      f"B={rows}, S={s}, ttt_steps={opts.ttt_steps}, draft vocab {ctx.draft_vocab}", fix)]
    teacher_and_states_terms(ctx, plan, aux, online, states_why)
    return plan


def teacher_and_states_terms(ctx: PlanContext, plan: KindPlan, aux: int, online: bool, states_why: str) -> None:
    """The terms of every draft that reads the target's states (EAGLE-3, DFlash): the online teacher's head rows,
    the online target forward that computes the states, and the recorded states' reads and disk."""
    cfg, tw, b, s = ctx.cfg, ctx.tw, ctx.cfg.per_device_batch_size, ctx.cfg.max_length
    width, rows = (1 + aux) * tw.hidden, ctx.forward_rows  # a slice's rows run the target (slice_tokens)
    if cfg.teacher == "online":
        plan.resident.append(Term("online teacher head rows", ctx.tbytes * ctx.draft_vocab * tw.hidden,
                                  f"[{ctx.draft_vocab}, {tw.hidden}] {str(ctx.target_dtype)[6:]}",
                                  f"draft_vocab_size (now {ctx.draft_vocab})"))
    if online:
        plan.phases["target forward (online states)"] = [Term(
            "target forward", target_forward_bytes(rows, s, tw, ctx.tbytes, width) + rows * s * width * (ctx.tbytes + 4),
            f"{states_why}; without grad, its states cast to float32",
            "record the states in the data stage (record_features=true, then states=recorded) or lower "
            f"per_device_batch_size (now {b}) / max_length (now {s})")]
    _states_on_disk(ctx, plan, aux, online)


def states_online(cfg) -> tuple[bool, str]:
    """Whether the run computes the target's states online, and why."""
    states = cfg.options.states
    if states != "auto":
        return states == "online", f"states={states}"
    try:
        folders, _ = data_folders(cfg)
        recorded = all(recorded_layer_ids(f) is not None for f in folders)
    except (ValueError, OSError, KeyError):
        return True, "states=auto and no training data yet: planned as online"
    return (not recorded), ("states=auto: the data recorded them" if recorded else "states=auto: not recorded")


def _heldout_bytes(ctx: PlanContext, dw: Widths, aux: int, online: bool) -> int:
    """The held-out replay's peak: the draft unrolled max(eval_k) deep over eval_batch_size rows (float32, no grad:
    each step's output, keys and values kept; one step's logits and their comparison at a time) and, where the data
    stored top-n log-probs, the first proposal's q at those ids, a chunk of positions at a time."""
    cfg, tw, v = ctx.cfg, ctx.tw, ctx.draft_vocab
    b, s = cfg.eval_batch_size, cfg.max_length
    positions, width = b * s, (1 + aux) * tw.hidden
    states = 4 * positions * width
    replay = max(cfg.eval_k) * positions * (4 * dw.hidden + 8 * dw.kv) + positions * 5 * v
    # alpha reads q at the stored top-n ids only, over chunks of positions (train/eagle3_train.py)
    chunk = min(positions, max(1, LOSS_CHUNK_VALUES // v))
    alpha = positions * 8 * dw.hidden + chunk * 12 * v if ctx.stored_topn else 0
    forward = target_forward_bytes(b, s, tw, ctx.tbytes, width) + positions * width * (ctx.tbytes + 4) if online else 0
    return max(states + max(replay, alpha), forward)


def _states_on_disk(ctx: PlanContext, plan: KindPlan, aux: int, online: bool) -> None:
    """The recorded states' read rate per step, and their disk per token."""
    cfg, tw = ctx.cfg, ctx.tw
    state_bytes = torch.finfo(RECORDED_STATES_DTYPE).bits // 8
    per_token = (1 + aux) * tw.hidden * state_bytes
    step_tokens = cfg.per_device_batch_size * cfg.max_length
    read_note = " (this config computes them online: none read)" if online else ""
    per_step = per_token * step_tokens * ctx.devices * cfg.grad_accum_steps
    plan.reads.append(Term("recorded states", per_token,
                           f"{per_token / 1024:.1f} KiB per trained token ((1 + {aux}) x {tw.hidden} x "
                           f"{state_bytes} bytes); {gib(per_token * step_tokens)} per device and micro-batch, "
                           f"{gib(per_step)} per optimizer step over {ctx.devices} device(s){read_note}"))
    recorded = ctx.data is not None and ctx.data.record_features
    plan.disk_per_token.append(Term("recorded states", per_token, "record_features=true" if recorded
                                    else "only with record_features=true (not set)"))


def eagle3_activations(batch: int, length: int, steps: int, w: Widths, draft_vocab: int, aux_layers: int,
                       half: bool, teacher: str, loss: str = "fkl", top_n: int = 0,
                       packed: bool = False) -> dict[str, int]:
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
    step fits one chunk, each step keeps its norm chain (12 H, half 10 H) and the loss's kept bytes per row and
    vocabulary value (train/plan/activations.py `loss_row_bytes`: forward KL 8 V, log q and p), and the last
    step's chunk peaks at the loss's peak (forward KL 29 V); beyond one chunk, each step keeps only its chunks'
    inputs (the output rows, the teacher's input rows or stored top-n) and one chunk at a time peaks at the loss's
    peak, in the forward and again when backward recomputes it. The backward of the last step's MLP adds three [I]
    float32 gradients.
    The attention (specdec/eagle3/attention.py) scores C queries at a time against up to n keys in float32 for
    steps 2 on, and for step 1 of packed rows: its backward holds four such [B, heads, C, n] blocks (the
    recomputed softmax, two zero-padded slice gradients, a bmm's gradient; under half autocast three float32 ones:
    the softmax, its gradient cast back to float32 and softmax's backward), while the step's MLP part is already
    freed and each step's output gradient [P, H] waits. Step 1 of unpacked rows runs torch's fused causal kernel,
    which holds no such block.
    """

    hid, q, k, inter = w.hidden, w.q, w.kv, w.intermediate
    n = max(length - 1, 1)
    positions = batch * n
    act = 2 if half else 4
    per_step = (36 * hid + 4 * q + 4 * k + 8 * inter) if half else (32 * hid + 8 * q + 8 * k + 16 * inter)
    after_attention = (8 * inter + 12 * hid + 2 * q) if half else (16 * inter + 12 * hid + 4 * q)
    once = aux_layers * hid * act + 2 * w.head_dim * act + 8 * steps + 16  # + the per-step masks and ids
    kept = positions * (once + steps * per_step)
    loss_kept, loss_peak, backward_loss = _eagle3_loss_bytes(positions, steps, hid, draft_vocab, half, teacher, loss,
                                                             top_n)
    if backward_loss:
        backward_loss += kept  # backward recomputes a chunk with everything still kept
    forward = kept + loss_kept + loss_peak
    heads_chunk = chunk_size(batch, w.heads, n)
    chunked = steps > 1 or packed  # step 1 alone over unpacked rows: the fused kernel, no [C, n] blocks
    attention = (12 if half else 16) * batch * w.heads * min(heads_chunk, n) * n if chunked else 0
    backward_attention = kept - positions * after_attention + steps * positions * 4 * hid + attention
    backward_mlp = kept + steps * positions * 4 * hid + 3 * positions * inter * 4
    backward = max(backward_loss, backward_attention, backward_mlp)
    return {"kept": kept, "loss": loss_kept, "forward": forward, "backward": backward,
            "peak": max(forward, backward)}


def _eagle3_loss_bytes(positions: int, steps: int, hid: int, v: int, half: bool, teacher: str, loss: str,
                       top_n: int) -> tuple[int, int, int]:
    """The unrolled loss's bytes (`eagle3_activations`' docstring): (kept across steps, the forward's peak above
    them, the backward's recomputed chunk above what the steps keep: 0 when each step fits one chunk)."""
    peak, kept = loss_row_bytes(loss)
    logit_bytes, logit_kept = peak * v, kept * v  # per row, in [rows, V] float32 blocks
    teacher_in = 4 * hid if teacher == "online" else 12 * top_n if teacher == "offline" else 0
    norm = (10 if half else 12) * hid
    rows = max(1, LOSS_CHUNK_VALUES // v)
    if positions > rows:  # checkpointed chunks: only their inputs stay; one chunk's logits at a time
        loss_kept = steps * positions * (4 * hid + teacher_in + 8)
        loss_peak = rows * (logit_bytes + norm)
        return loss_kept, loss_peak, loss_kept + loss_peak
    return steps * positions * (norm + logit_kept), positions * (logit_bytes - logit_kept + teacher_in), 0
