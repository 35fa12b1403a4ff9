"""The work list: prompt x sample items, the turns each item's target answers, shuffled and fingerprinted."""

from __future__ import annotations

import hashlib
import json
import logging
import random
from dataclasses import dataclass

from specdec.prompts import Prompt, encode_prompt
from specdec.train.data.config import DataConfig

log = logging.getLogger(__name__)


def conversation(prompt: Prompt, turns: str) -> tuple[list[dict], list[str]]:
    """Split a prompt into (fixed history, user turns the target answers in order).

    A list of user turns with no assistant messages (Spec-Bench, MT-Bench) is a multi-turn conversation:
    the target answers turn 1, then turn 2 after its own answer, and so on (`turns="first"` keeps turn 1).
    Any other chat is one example: the target answers its last user message, after the history given.
    """
    msgs = prompt.messages
    users = [i for i, m in enumerate(msgs) if m["role"] == "user"]
    if len(users) > 1 and not any(m["role"] == "assistant" for m in msgs):
        history = [m for m in msgs if m["role"] == "system"]
        user_turns = [msgs[i]["content"] for i in users]
        return history, user_turns[:1] if turns == "first" else user_turns
    last = users[-1]
    return msgs[:last], [msgs[last]["content"]]


def dataset_turns(prompt: Prompt) -> list[tuple[list[dict], str]]:
    """responses=dataset: (the messages before it, its text) for each assistant answer that follows a user message."""
    msgs = prompt.messages
    return [(msgs[:i], m["content"]) for i, m in enumerate(msgs)
            if m["role"] == "assistant" and any(x["role"] == "user" for x in msgs[:i])]


@dataclass
class Item:
    """One unit of work: a prompt, which of its samples, and the token count of its first turn.

    responses=dataset: `history` is the whole conversation and `user_turns` the user message each answer follows
    (one row each)."""

    prompt: Prompt
    sample_index: int
    history: list[dict]
    user_turns: list[str]
    first_length: int


def plan_items(prompts: list[Prompt], tokenizer, cfg: DataConfig, context_limit: int | None) -> tuple[list[Item], list[str], str]:
    """Work list (prompt x sample, shuffled when `shuffle`), ids skipped as too long, and its fingerprint."""
    dataset = cfg.responses == "dataset"
    limit = cfg.max_prompt_tokens
    if context_limit is not None:
        # responses=dataset generates nothing: a prompt need only leave room for its answer's first token
        limit = min(limit, context_limit - (1 if dataset else cfg.max_new_tokens))
        if limit < 1:
            raise ValueError(f"max_new_tokens={cfg.max_new_tokens} leaves no room for a prompt in the target's "
                             f"context of {context_limit} tokens; lower max_new_tokens")
    items, skipped, unanswered = [], [], []
    digest = hashlib.sha256()
    for p in prompts:
        if dataset:
            turns = dataset_turns(p)
            if not turns:
                unanswered.append(p.prompt_id)
                continue
            history = p.messages
            user_turns = [next(m["content"] for m in reversed(before) if m["role"] == "user") for before, _ in turns]
            ids = encode_prompt(tokenizer, turns[0][0], cfg.use_chat_template)
        else:
            history, user_turns = conversation(p, cfg.spec_bench_turns)
            ids = encode_prompt(tokenizer, history + [{"role": "user", "content": user_turns[0]}],
                                cfg.use_chat_template)
        if len(ids) > limit:
            if cfg.too_long == "error":
                raise ValueError(f"prompt {p.prompt_id!r} has {len(ids)} tokens, over the limit of {limit} "
                                 f"(max_prompt_tokens, and the context minus max_new_tokens); raise "
                                 f"max_prompt_tokens or set too_long=skip")
            skipped.append(p.prompt_id)
            continue
        digest.update(json.dumps([p.prompt_id, ids, p.messages if dataset else user_turns[1:]]).encode())
        items += [Item(p, s, history, user_turns, len(ids)) for s in range(cfg.num_samples)]
    if unanswered:
        if len(unanswered) == len(prompts):
            raise ValueError(f"responses=dataset keeps the conversations' own assistant answers, but none of the "
                             f"{len(prompts)} records has one (`messages` with assistant turns, or ShareGPT "
                             f"`conversations`); use responses=target to have the target answer them")
        log.warning("responses=dataset: %d conversation(s) without an assistant answer left out: %s%s",
                    len(unanswered), ", ".join(unanswered[:5]), " ..." if len(unanswered) > 5 else "")
    if cfg.shuffle and items:
        random.Random(cfg.seed).shuffle(items)
        # The longest item first: a memory problem shows in the first batch, not hours in.
        longest = max(range(len(items)), key=lambda i: items[i].first_length)
        items.insert(0, items.pop(longest))
    return items, skipped, digest.hexdigest()
