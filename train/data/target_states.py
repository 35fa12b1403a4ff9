"""The target's recorded states (specdec/eagle3/: the final norm's output, then the residual stream after each
of eagle_aux_layer_ids) at each row's fed positions, [prompt + completion - 1, W] bfloat16: recorded while the
transformers backend decodes, or by one batched prefill over finished sequences (vLLM's `prefill` states,
responses=dataset). Every forward of the target's hidden states in the data stage is in this module."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from specdec.eagle3 import RECORDED_STATES_DTYPE, HiddenStateRecorder, target_states
from specdec.kv import by_row


def recording_while_decoding(model, layer_ids: list[int], record: bool):
    """A context that records every decoding forward's states (its recorder), or does nothing (None)."""
    if not record:
        return contextlib.nullcontext()
    return HiddenStateRecorder(model, layer_ids, final=True, history=True)


def decoded_features(recorder, prompts: list[list[int]], width: int, lengths: list[int],
                     groups: list[list[int]] | None = None,
                     step_rows: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Each row's states from a recorded left-padded decoding of `prompts` (padded to `width`), over its prompt and
    all but the last of its `lengths[row]` completion tokens; `groups`: the rows of each prefill forward, in order
    (a grouped prefill), None for one prefill forward over the batch; `step_rows`: the rows each decoding step ran
    (a decoding that dropped finished rows), None for all of them."""
    # history: the prefill's forwards ([B, width, W], or one [rows, its width, W] per group), then one [B, 1, W]
    # per step (the step feeding completion token j), [len(step_rows[j]), 1, W] when rows were dropped.
    if not groups or recorder.history[0].shape[0] == len(prompts):  # one forward: no groups asked for, or a model
        groups = [list(range(len(prompts)))]                          # that kv.prefill prefills whole
    prefill_of = {row: (forward, place) for forward, group in enumerate(groups) for place, row in enumerate(group)}
    steps = recorder.history[len(groups):]
    if not steps:
        steps = None  # one new token a row, from the prefill alone
    elif step_rows is None:
        steps = torch.cat(steps, 1)
    else:  # a row runs every step until its EOS, so its first n - 1 steps are all there
        steps = by_row([h[:, 0] for h in steps], step_rows, len(prompts))
    out = []
    for row, (p, n) in enumerate(zip(prompts, lengths)):
        forward, place = prefill_of[row]
        states = recorder.history[forward][place]
        fed = states[states.shape[0] - len(p):]
        out.append(fed if steps is None else torch.cat([fed, steps[row, : n - 1]]))
    return out


def prefill_features(model, sequences: list[list[int]], layer_ids: list[int], batch_size: int,
                     pad: int) -> list[Any]:
    """The target's features at each sequence's fed positions (all but its last token), [len - 1, W] bf16 on the
    CPU, as the transformers backend records them while decoding; from batched, right-padded prefills."""
    return [f for f, _, _ in prefill(model, sequences, layer_ids, batch_size, pad)]


def _right_padded(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for row, tokens in enumerate(rows):
        # Right padding keeps each row's positions 0..n-1, and causal attention keeps pads out of real rows.
        ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        mask[row, : len(tokens)] = 1
    return ids, mask


def _top_logprobs(model, states: torch.Tensor, top_n: int) -> tuple[list, list]:
    """The n most likely ids and their log-probs (log_softmax of the raw logits) from final states [c, >= H]."""
    text_config = model.config.get_text_config()
    logits = model.get_output_embeddings()(states[:, : text_config.hidden_size]).float()  # [c, V]
    softcap = getattr(text_config, "final_logit_softcapping", None)
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    best = torch.log_softmax(logits, dim=-1).topk(top_n, dim=-1)
    return best.indices.tolist(), best.values.tolist()


def prefill(model, sequences: list[list[int]], layer_ids: list[int] | None, batch_size: int, pad: int,
            top_n: int = 0, prompt_lengths: list[int] | None = None) -> list[tuple[Any, Any, Any]]:
    """Per sequence, from batched, right-padded prefills of its fed positions (all but its last token): its
    features ([len - 1, W] bf16 on the CPU, as the transformers backend records them while decoding; None when
    `layer_ids` is None) and, with top_n, the n most likely ids and their log-probs (log_softmax of the raw
    logits) at each position from prompt_lengths[i] - 1 on, the ones that predict its completion tokens."""
    device = next(model.parameters()).device
    fed = [seq[:-1] for seq in sequences]
    order = sorted(range(len(fed)), key=lambda i: -len(fed[i]))  # similar lengths together: less padding
    out: list[tuple[Any, Any, Any]] = [(None, None, None)] * len(fed)
    with torch.inference_mode():
        for start in range(0, len(order), batch_size):
            chunk = order[start: start + batch_size]
            ids, mask = _right_padded([fed[i] for i in chunk], pad)
            # [b, width, W]; the final norm's output first
            latest = target_states(model, ids.to(device), mask.to(device), layer_ids or [], final=True)
            for row, i in enumerate(chunk):
                features = top_ids = top_lp = None
                if layer_ids is not None:
                    features = latest[row, : len(fed[i])].to("cpu", RECORDED_STATES_DTYPE)
                if top_n:
                    top_ids, top_lp = _top_logprobs(model, latest[row, prompt_lengths[i] - 1: len(fed[i])], top_n)
                out[i] = (features, top_ids, top_lp)
    return out
