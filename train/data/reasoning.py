"""The target's answer as the next turn's history sees it: its thinking and its tool calls parsed out of the tokens
it wrote, in the OpenAI message format the chat templates read (`reasoning_content` for Qwen3-style templates,
`thinking` for gpt-oss's Harmony one, `tool_calls`).

A training row keeps the tokens exactly as written, thinking included (the draft proposes thinking tokens at
serving time too); only the history a later turn is rendered from goes through here, so that a template that drops
earlier turns' thinking (Qwen3, DeepSeek-R1 distills) renders the next prompt as a server would.
"""

from __future__ import annotations

import json
import re

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_HARMONY_CHANNEL = "<|channel|>"
# One Harmony message: <|channel|>NAME[ to=functions.TOOL][ <|constrain|>json]<|message|>TEXT, ended by
# <|end|> (more follows), <|call|> (a tool call) or <|return|> (the final answer), or the text's end (cut off).
_HARMONY_MESSAGE = re.compile(
    r"<\|channel\|>(?P<channel>\w+)(?:\s+to=(?P<to>[\w.\-]+))?[^<]*(?:<\|constrain\|>\w+)?<\|message\|>"
    r"(?P<text>.*?)(?:<\|end\|>|<\|call\|>|<\|return\|>|$)", re.S)
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def _without_specials(text: str, specials: list[str]) -> str:
    for token in specials:
        if token not in (THINK_OPEN, THINK_CLOSE):
            text = text.replace(token, "")
    return text


def _tool_call(name: str, arguments) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def _parsed_arguments(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text  # kept as written: the template renders a string as it is


def _harmony_message(raw: str) -> dict:
    """gpt-oss: the analysis channel is the thinking, a commentary message to=functions.NAME a tool call, the
    final channel the answer."""
    thinking, content, calls = [], [], []
    for m in _HARMONY_MESSAGE.finditer(raw):
        to, text = m.group("to"), m.group("text")
        if to and to.startswith("functions."):
            calls.append(_tool_call(to.removeprefix("functions."), _parsed_arguments(text.strip())))
        elif m.group("channel") == "analysis":
            thinking.append(text)
        else:
            content.append(text)
    message = {"role": "assistant", "content": "".join(content)}
    if thinking:
        message["thinking"] = message["reasoning_content"] = "".join(thinking)
    if calls:
        message["tool_calls"] = calls
    return message


def _hermes_calls(content: str) -> tuple[str, list[dict]]:
    """Qwen-style <tool_call>{"name": ..., "arguments": ...}</tool_call> blocks taken out of the content."""
    calls = []
    for block in _HERMES_CALL.findall(content):
        parsed = _parsed_arguments(block)
        if isinstance(parsed, dict) and isinstance(parsed.get("name"), str):
            calls.append(_tool_call(parsed["name"], parsed.get("arguments", {})))
    if not calls:
        return content, []
    return _HERMES_CALL.sub("", content).strip(), calls


def assistant_message(tokenizer, tokens: list[int]) -> dict:
    """The target's completion `tokens` as an assistant message for the history of its next turn."""
    raw = tokenizer.decode(tokens, skip_special_tokens=False)
    if _HARMONY_CHANNEL in raw:
        return _harmony_message(raw)
    reasoning = None
    if THINK_CLOSE in raw:
        thought, after = raw.split(THINK_CLOSE, 1)
        reasoning = _without_specials(thought.split(THINK_OPEN)[-1], tokenizer.all_special_tokens).strip("\n")
        content = _without_specials(after, tokenizer.all_special_tokens).lstrip("\n")
    else:  # no thinking: the text as before, special tokens left out
        content = tokenizer.decode(tokens, skip_special_tokens=True)
    content, calls = _hermes_calls(content)
    message = {"role": "assistant", "content": content}
    if reasoning is not None:
        message["reasoning_content"] = message["thinking"] = reasoning
    if calls:
        message["tool_calls"] = calls
    return message
