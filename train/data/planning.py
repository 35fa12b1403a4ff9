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


def uses_tools(prompt: Prompt) -> bool:
    """Whether a chat calls tools (assistant `tool_calls` or `tool` results): the target then rewrites its turns."""
    return any(m["role"] == "tool" or "tool_calls" in m for m in prompt.messages)


def tool_conversation(prompt: Prompt) -> tuple[list[dict], list[list[dict]]]:
    """A tool-calling chat as (system history, the dataset's messages before each assistant turn): the target
    writes every assistant turn (its calls and its answers) and the users' messages and the tool results are
    kept from the dataset, as a served conversation would feed them back."""
    msgs = prompt.messages
    first = next(i for i, m in enumerate(msgs) if m["role"] != "system")
    history, inserts, pending = msgs[:first], [], []
    for m in msgs[first:]:
        if m["role"] == "assistant":
            if pending:
                inserts.append(pending)
            pending = []
        else:
            pending.append(m)
    if pending:  # a last user message or tool result the dataset leaves unanswered: the target answers it
        inserts.append(pending)
    return history, inserts


def conversation(prompt: Prompt, turns: str) -> tuple[list[dict], list]:
    """Split a prompt into (fixed history, what the target answers in order: user turns, or lists of messages).

    A list of user turns with no assistant messages (Spec-Bench, MT-Bench) is a multi-turn conversation:
    the target answers turn 1, then turn 2 after its own answer, and so on (`turns="first"` keeps turn 1).
    A chat that calls tools is regenerated turn by turn (`tool_conversation`). Any other chat is one example:
    the target answers its last user message, after the history given.
    """
    if uses_tools(prompt):
        history, inserts = tool_conversation(prompt)
        return history, inserts[:1] if turns == "first" else inserts
    msgs = prompt.messages
    users = [i for i, m in enumerate(msgs) if m["role"] == "user"]
    if len(users) > 1 and not any(m["role"] == "assistant" for m in msgs):
        history = [m for m in msgs if m["role"] == "system"]
        user_turns = [msgs[i]["content"] for i in users]
        return history, user_turns[:1] if turns == "first" else user_turns
    last = users[-1]
    return msgs[:last], [msgs[last]["content"]]


def dataset_turns(prompt: Prompt) -> list[tuple[list[dict], dict]]:
    """responses=dataset: (the messages before it, the message) for each assistant answer after a user message."""
    msgs = prompt.messages
    return [(msgs[:i], m) for i, m in enumerate(msgs)
            if m["role"] == "assistant" and any(x["role"] == "user" for x in msgs[:i])]


def turn_messages(turn) -> list[dict]:
    """The dataset's messages before a target turn: a user turn's text, or a tool chat's list of messages."""
    return turn if isinstance(turn, list) else [{"role": "user", "content": turn}]


@dataclass
class Item:
    """One unit of work: a prompt, which of its samples, and the token count of its first turn.

    responses=dataset: `history` is the whole conversation and `user_turns` the user message each answer follows
    (one row each)."""

    prompt: Prompt
    sample_index: int
    history: list[dict]
    user_turns: list  # a user message's text each, or (a tool chat) the list of messages before each answer
    first_length: int
    temperature: float | None = None  # temperatures / top_ps: this item's own sampling; None: the run's
    top_p: float | None = None


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
            ids = encode_prompt(tokenizer, turns[0][0], cfg.use_chat_template, cfg.chat_template_kwargs, p.tools)
        else:
            history, user_turns = conversation(p, cfg.spec_bench_turns)
            ids = encode_prompt(tokenizer, history + turn_messages(user_turns[0]), cfg.use_chat_template,
                                cfg.chat_template_kwargs, p.tools)
        if len(ids) > limit:
            if cfg.too_long == "error":
                raise ValueError(f"prompt {p.prompt_id!r} has {len(ids)} tokens, over the limit of {limit} "
                                 f"(max_prompt_tokens, and the context minus max_new_tokens); raise "
                                 f"max_prompt_tokens or set too_long=skip")
            skipped.append(p.prompt_id)
            continue
        digest.update(json.dumps([p.prompt_id, ids, p.messages if dataset else user_turns[1:]]).encode())
        for s in range(cfg.num_samples):
            item = Item(p, s, history, user_turns, len(ids))
            if cfg.mixes_sampling:
                item.temperature, item.top_p = cfg.item_sampling(len(items), p.prompt_id, s)
            items.append(item)
    if unanswered:
        if len(unanswered) == len(prompts):
            raise ValueError(f"responses=dataset keeps the conversations' own assistant answers, but none of the "
                             f"{len(prompts)} records has one (`messages` with assistant turns, or ShareGPT "
                             f"`conversations`); use responses=target to have the target answer them")
        log.warning("responses=dataset: %d conversation(s) without an assistant answer left out: %s%s",
                    len(unanswered), ", ".join(unanswered[:5]), " ..." if len(unanswered) > 5 else "")
    if cfg.shuffle and items:
        # Every prompt's first answer before any prompt's second (each layer shuffled): a run stopped early by
        # max_minutes holds as many prompts as it had time for, not two answers to half of them.
        rng = random.Random(cfg.seed)
        layers = [[item for item in items if item.sample_index == s] for s in range(cfg.num_samples)]
        for layer in layers:
            rng.shuffle(layer)
        items = [item for layer in layers for item in layer]
        # The longest item first: a memory problem shows in the first batch, not hours in.
        longest = max(range(len(items)), key=lambda i: items[i].first_length)
        items.insert(0, items.pop(longest))
    return items, skipped, digest.hexdigest()
