"""Activation bytes of one micro-batch, per draft kind, and of a target forward without grad: what autograd keeps
per position, counted from the code (each docstring lists the tensors). tests/test_plan.py checks them against
measured peaks of real training steps."""

from __future__ import annotations

from specdec.eagle3.attention import chunk_size
from specdec.train.eagle3_train import LOSS_CHUNK_VALUES
from specdec.train.plan.target import Widths


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
    attention = (12 if half else 16) * batch * w.heads * min(heads_chunk, n) * n
    backward_attention = kept - positions * after_attention + steps * positions * 4 * hid + attention
    backward_mlp = kept + steps * positions * 4 * hid + 3 * positions * inter * 4
    backward = max(backward_loss, backward_attention, backward_mlp)
    return {"kept": kept, "loss": loss_kept, "forward": forward, "backward": backward,
            "peak": max(forward, backward)}


def _eagle3_loss_bytes(positions: int, steps: int, hid: int, v: int, half: bool, teacher: str, loss: str,
                       top_n: int) -> tuple[int, int, int]:
    """The unrolled loss's bytes (`eagle3_activations`' docstring): (kept across steps, the forward's peak above
    them, the backward's recomputed chunk above what the steps keep: 0 when each step fits one chunk)."""
    divergence = loss != "ce"
    logit_bytes = (41 if divergence else 12) * v  # the loss's peak per row in [rows, V] float32 blocks
    logit_kept = (9 if divergence else 4) * v
    teacher_in = 4 * hid if teacher == "online" else 12 * top_n if teacher == "offline" else 0
    norm = (10 if half else 12) * hid
    rows = max(1, LOSS_CHUNK_VALUES // v)
    if positions > rows:  # checkpointed chunks: only their inputs stay; one chunk's logits at a time
        loss_kept = steps * positions * (4 * hid + teacher_in + 8)
        loss_peak = rows * (logit_bytes + norm)
        return loss_kept, loss_peak, loss_kept + loss_peak
    return steps * positions * (norm + logit_kept), positions * (logit_bytes - logit_kept + teacher_in), 0


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
