"""responses=dataset: nothing generated. Each assistant answer of a conversation becomes a row of the dataset's
own tokens; the target is loaded only to prefill each row once, for its features and top log-probs, when either is
asked for."""

from __future__ import annotations

import logging
from typing import Any

from specdec.models import load_model, resolve_path
from specdec.prompts import encode_prompt, render_chat
from specdec.tokens import cut_at_eos, eos_ids, pad_id
from specdec.train.data.backend import Backend, CheckpointGenerationConfig
from specdec.train.data.config import DataConfig
from specdec.train.data.features import FeatureSpool, keep_features
from specdec.train.data.planning import Item, dataset_turns
from specdec.train.data.reasoning import THINK_CLOSE, THINK_OPEN
from specdec.train.data.target_states import prefill

log = logging.getLogger(__name__)


class DatasetBackend(Backend):
    """The conversations' own answers as rows; a prefill of each row for its features and top log-probs."""

    def __init__(self, cfg: DataConfig, tokenizer, device=None):
        self.cfg = cfg
        self.model = None
        if cfg.record_features or cfg.top_logprobs:
            self.model = load_model(cfg.target, dtype=cfg.dtype, device=device if device is not None else cfg.device)
            log.info("target %s in %s on %s (a prefill of the dataset's answers)", cfg.target, self.model.dtype,
                     next(self.model.parameters()).device)
        model = self.model if self.model is not None else CheckpointGenerationConfig(resolve_path(cfg.target))
        self.eos = eos_ids(model, tokenizer)
        self.pad = pad_id(tokenizer.pad_token_id, self.eos)

    def score(self, sequences: list[list[int]], prompt_lengths: list[int]) -> list[tuple[Any, Any, Any]]:
        """(features, top_ids, top_logprobs) per row, each None where not asked for."""
        if self.model is None:
            return [(None, None, None)] * len(sequences)
        layers = self.cfg.eagle_aux_layer_ids if self.cfg.record_features else None
        return prefill(self.model, sequences, layers, self.cfg.batch_size, self.pad, self.cfg.top_logprobs,
                       prompt_lengths)

    def shard_rows(self, items: list[Item], tokenizer, seed: int, context_limit: int | None, progress=None,
                   features: FeatureSpool | None = None) -> tuple[list[dict], dict]:
        return dataset_shard(items, self, tokenizer, self.cfg, context_limit, progress, features)


def _with_reasoning(answer: dict) -> dict:
    """The answer with `<think>...</think>` in its content moved to the fields templates read its thinking from."""
    reasoning = answer.get("reasoning_content", answer.get("thinking"))
    content = answer["content"]
    if reasoning is None and THINK_CLOSE in content:
        reasoning, content = content.split(THINK_CLOSE, 1)
        reasoning, content = reasoning.split(THINK_OPEN)[-1].strip("\n"), content.lstrip("\n")
    message = {k: v for k, v in answer.items() if k not in ("reasoning_content", "thinking")}
    message["content"] = content
    if reasoning is not None:
        message["reasoning_content"] = message["thinking"] = reasoning
    return message


def _as_written(message: dict, prompt_text: str) -> str:
    """The answer's text as the target writes it after the prompt: its thinking in think tags before the content,
    less whatever the prompt already opened (e.g. a generation prompt ending in "<think>\n")."""
    reasoning = message.get("reasoning_content")
    text = message["content"] if reasoning is None else \
        f"{THINK_OPEN}\n{reasoning}\n{THINK_CLOSE}\n\n{message['content']}"
    overlap = next((k for k in range(min(len(text), len(prompt_text)), 0, -1)
                    if prompt_text.endswith(text[:k])), 0)
    return text[overlap:]


def answer_ids(tokenizer, before: list[dict], answer: dict, prompt: list[int], cfg: DataConfig, eos: list[int],
               tools: list[dict] | None = None) -> list[int]:
    """The tokens of a dataset's `answer` message to the conversation `before` (whose encoded prompt is `prompt`), up
    to and including the end of its turn (its first EOS), as the target's own completion would be: its thinking
    included, also where the template drops the answer's thinking or rewrites earlier turns (then the answer's
    text written after the prompt, and the end of the turn)."""
    if not cfg.use_chat_template:
        return tokenizer("\n\n" + answer["content"], add_special_tokens=False)["input_ids"] + eos[:1]
    message = _with_reasoning(answer)
    full = render_chat(tokenizer, before + [message], False, True, cfg.chat_template_kwargs, tools)
    reasoning = message.get("reasoning_content")
    if full[: len(prompt)] == prompt and (
            not reasoning or reasoning.strip() in tokenizer.decode(full[len(prompt):], skip_special_tokens=False)):
        return cut_at_eos(full[len(prompt):], eos)
    if "tool_calls" in message:
        raise ValueError("responses=dataset: the chat template renders an answer with tool calls differently from "
                         "its prompt followed by the answer (it rewrites earlier turns), so its tokens cannot be "
                         "marked; use responses=target to have the target write the calls")
    prompt_text = render_chat(tokenizer, before, True, False, cfg.chat_template_kwargs, tools)
    return tokenizer(_as_written(message, prompt_text), add_special_tokens=False)["input_ids"] + eos[:1]


def dataset_shard(items: list[Item], backend: DatasetBackend, tokenizer, cfg: DataConfig,
                  context_limit: int | None, progress=None, features=None) -> tuple[list[dict], dict]:
    """responses=dataset: a row per answer of each item's conversation (the dataset's own tokens), in the items'
    order; features and top log-probs from one prefill of each row, batch_size rows at a time."""
    rows: list[dict] = []
    counts = {"examples": 0, "generated_tokens": 0, "dropped_turns": 0}
    for it in items:
        turns = dataset_turns(it.prompt)
        for turn, (before, answer) in enumerate(turns):
            prompt = encode_prompt(tokenizer, before, cfg.use_chat_template, cfg.chat_template_kwargs, it.prompt.tools)
            completion = answer_ids(tokenizer, before, answer, prompt, cfg, backend.eos, it.prompt.tools)
            if context_limit is not None and len(prompt) + len(completion) > context_limit:
                counts["dropped_turns"] += len(turns) - turn
                break  # the conversation outgrew the context: its later turns are dropped
            rows.append({"prompt_id": it.prompt.prompt_id, "category": it.prompt.category or "",
                         "sample_index": it.sample_index, "turn": turn, "input_ids": prompt + completion,
                         "prompt_length": len(prompt)})
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i]["input_ids"])) if cfg.sort_by_length \
        else list(range(len(rows)))
    for start in range(0, len(order), cfg.batch_size):
        chunk = [rows[i] for i in order[start: start + cfg.batch_size]]
        scored = backend.score([r["input_ids"] for r in chunk], [r["prompt_length"] for r in chunk])
        for row, (feats, top_ids, top_lp) in zip(chunk, scored):
            if cfg.top_logprobs:
                row["top_ids"], row["top_logprobs"] = top_ids, top_lp
            if cfg.record_features:
                keep_features(row, feats, features)
            counts["examples"] += 1
            counts["generated_tokens"] += len(row["input_ids"]) - row["prompt_length"]
            if progress is not None:
                progress(1, len(row["input_ids"]) - row["prompt_length"])
        del scored
    return rows, counts
