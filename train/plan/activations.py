"""Activation bytes of one micro-batch of a causal-LM draft, and of a target forward without grad: what autograd
keeps per position, counted from the code (each docstring lists the tensors). A kind with its own computation counts
its own in its kind's folder (train/kinds/); tests/test_plan.py checks them against measured peaks of real training steps."""

from __future__ import annotations

from specdec.train.plan.target import Widths


def loss_row_bytes(loss: str) -> tuple[int, int]:
    """Bytes per draft-vocabulary value of one scored row: (the loss's peak, what it keeps for backward).

    Forward KL (train/losses.py `_ForwardKL`, its gradient written by hand): the float32 student and teacher logits,
    log q, log p, p, p == 0, log p - log q, its product with p and the where at the peak (29), log q and p kept (8).
    The other divergences through autograd: the logits, their kept rows, log q, log p, p, the mask, log p - log q,
    zeros, the where (41), log q, p and the mask kept (9). Cross-entropy alone: 12 and 4."""
    if loss == "fkl":
        return 29, 8
    return (12, 4) if loss == "ce" else (41, 9)


def plain_activations(batch: int, length: int, w: Widths, layers: int, vocab: int, half: bool,
                      loss: str = "fkl") -> dict[str, int]:
    """Peak bytes of one plain draft micro-batch's forward and backward (a Llama-like causal LM, sdpa
    attention), beyond its inputs and the parameters' gradients.  -> {kept, forward, peak}

    Per position and decoder layer autograd keeps 24 H + 12 Q + 8 K + 16 I bytes in float32 (the layer's input,
    both RMSNorms' normalised rows and outputs, the residual after attention, q and k after rotary, v,
    sdpa's output and o_proj's input, the MLP's four [I] tensors) and 26 H + 6 Q + 4 K + 8 I under half
    autocast (float32 residual stream, a cast of each projection's input); the final norm 12 H (10 H). The loss
    then holds the logits of the whole micro-batch (float32: accelerate returns them so) and, per scored
    position, the loss's peak bytes per vocabulary value (`loss_row_bytes`)."""
    hid, q, k, inter = w.hidden, w.q, w.kv, w.intermediate
    positions = batch * length
    per_layer = (26 * hid + 6 * q + 4 * k + 8 * inter) if half else (24 * hid + 12 * q + 8 * k + 16 * inter)
    kept = positions * (layers * per_layer + (10 if half else 12) * hid + 16)
    logit_bytes = loss_row_bytes(loss)[0] * vocab
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
