"""DFlash's terms of the memory plan (train/plan/kind.py: `KindPlan`): its draft on the meta device, the target's
states as the step's input (or the online forward that computes them), the anchored blocks' activations, the
online teacher's head rows and its held-out block replay. The states' reads and disk are EAGLE-3's (the same
recording)."""

from __future__ import annotations

from specdec.dflash import DFlashDraft, default_layer_ids, draft_config
from specdec.dflash.model import attention_group
from specdec.dflash.replay import ANCHORS_PER_FORWARD
from specdec.eagle3 import check_layer_ids
from specdec.train.eagle3_train import LOSS_CHUNK_VALUES
from specdec.train.kinds.eagle3_plan import states_online, teacher_and_states_terms
from specdec.train.plan.activations import loss_row_bytes, target_forward_bytes
from specdec.train.plan.kind import KindPlan, PlanContext
from specdec.train.plan.report import Term
from specdec.train.plan.target import Widths, on_meta, text_config


def dflash_plan(ctx: PlanContext) -> KindPlan:
    cfg, tw, b, s = ctx.cfg, ctx.tw, ctx.cfg.per_device_batch_size, ctx.cfg.max_length
    opts = cfg.options
    layers = text_config(ctx.target_cfg).num_hidden_layers
    ids = check_layer_ids(opts.dflash_layer_ids or default_layer_ids(layers), layers, "dflash_layer_ids")
    config = draft_config(ctx.target_cfg, ids, ctx.draft_vocab, opts.dflash_layers, opts.block_size, 0)
    model = on_meta(lambda: DFlashDraft(config))
    model.embed_tokens.weight.requires_grad_(False)
    model.lm_head.weight.requires_grad_(False)
    dw, width = Widths.of(config), (1 + len(ids)) * tw.hidden
    online, states_why = states_online(cfg)
    fix = ctx.activation_fix(f", num_anchors (now {opts.num_anchors}), block_size (now {opts.block_size}) or "
                             f"slice_tokens (now {cfg.slice_tokens})")
    rows = ctx.forward_rows  # what one forward and backward holds (slice_tokens)
    acts = dflash_activations(rows, s, opts.num_anchors, opts.block_size, opts.dflash_layers, dw, len(ids),
                              ctx.draft_vocab, ctx.half, cfg.loss)
    plan = KindPlan(model, fix, _heldout_bytes(ctx, dw, len(ids), online), frozen_note=": the target's "
                    "embedding table and head rows", target_why="loaded whole where its states are computed "
                    "online (recorded states: its embedding, norm and head only)")
    plan.step = [Term("target states (input)", 4 * b * s * width, f"float32 [B, S, {width}]", fix),
                 Term("activations", acts, f"B={rows}, S={s}, num_anchors={opts.num_anchors}, block_size="
                      f"{opts.block_size}, {opts.dflash_layers} layers, draft vocab {ctx.draft_vocab}", fix)]
    teacher_and_states_terms(ctx, plan, len(ids), online, states_why)
    return plan


def dflash_activations(batch: int, length: int, anchors: int, block: int, layers: int, w: Widths, aux: int,
                       draft_vocab: int, half: bool, loss: str = "fkl") -> int:
    """Peak bytes of one micro-batch's forward and backward (`dflash_train.dflash_loss`), an upper bound.

    Q = batch x min(anchors, length) x block query slots, C = batch x length context positions. Autograd keeps,
    per layer: for each slot 16 H + 8 Q + 8 K + 16 I bytes in float32 (the residual, two norms, q, k, v after
    their norms and rotary, o_proj's input, gate, up, silu(gate), their product; half autocast about half), for
    each context position its keys and values (8 K float32) and, once, fc's input, output and hidden_norm's
    (aux H + 2 H). The attention's boolean mask, compact (each block's context positions, [A, S] a row) and
    dense ([q, S + q] a row) for one group's q slots at a time, or for every slot once when one call attends them
    all; a memory-efficient kernel's float32 output and log-sum-exp per head; its keys and values repeated to
    every head (2 Q_heads each): kept by every layer when one call attends every slot, one group's at a time
    (with their gradients) when the slots attend in groups (`attention_group`, recomputed in backward); the
    loss's chunked logits (2^24 values at the loss's peak bytes each, train/plan/activations.py `loss_row_bytes`)
    and the scored rows' inputs (4 H + 4 H_target each)."""
    act = 2 if half else 4
    row_anchors = min(anchors, length)
    row_slots = row_anchors * block
    slots, context = batch * row_slots, batch * length
    per_slot = layers * (4 * w.hidden + 2 * w.q + 2 * w.kv + 4 * w.intermediate) * act + 4 * w.hidden
    per_context = layers * 2 * w.kv * act + (aux + 2) * w.hidden * 4
    group = min(attention_group(length, row_anchors, block), row_slots)  # row_slots: one call attends every slot
    mask = batch * (row_anchors * length + group * (length + group))
    repeated = batch * 2 * w.q * act  # a key and a value per head, per key position
    attention = batch * w.heads * row_slots * 8 + repeated * (
        layers * (length + row_slots) if group == row_slots else 2 * (length + group))
    logits = loss_row_bytes(loss)[0] * min(slots, LOSS_CHUNK_VALUES // draft_vocab + 1) * draft_vocab
    loss = slots * 8 * w.hidden + logits
    return slots * per_slot + context * per_context + mask + attention + loss


def _heldout_bytes(ctx: PlanContext, dw: Widths, aux: int, online: bool) -> int:
    """The block replay's peak: one row's states and context keys, ANCHORS_PER_FORWARD blocks of
    max(block_size, max(eval_k) + 1) slots at a time (no grad: a layer's activations, the mask, the logits)."""
    cfg, tw, v = ctx.cfg, ctx.tw, ctx.draft_vocab
    s = cfg.max_length
    slots = min(s, ANCHORS_PER_FORWARD) * max(cfg.options.block_size, max(cfg.eval_k) + 1)
    states = 4 * cfg.eval_batch_size * s * (1 + aux) * tw.hidden
    replay = s * cfg.options.dflash_layers * 8 * dw.kv + slots * (4 * dw.intermediate + 8 * dw.hidden + 4 * v) \
        + slots * (s + slots)
    forward = target_forward_bytes(cfg.eval_batch_size, s, tw, ctx.tbytes, (1 + aux) * tw.hidden) if online else 0
    return max(states + replay, forward)
