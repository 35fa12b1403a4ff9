"""Prompt files: one reader for every tool (data generation, eval, demo).

Accepted record shapes (one JSON object per line of a .jsonl file, or a JSON list of them):

    {"prompt": "..."}                                               plain prompt
    {"messages": [{"role": "user", "content": "..."}, ...]}          chat
    {"conversations": [{"from": "human", "value": "..."}, ...]}      ShareGPT
    {"question_id": 81, "category": "writing", "turns": ["...", ...]} Spec-Bench / MT-Bench

Optional `prompt_id` / `id` and `category` keys are kept. A `column_map` renames a data set's own columns
to these keys first, e.g. `{"instruction": "prompt"}`.

Chats may hold tool calls in the OpenAI message format: an assistant message with `tool_calls` (its content may be
empty), `tool` messages with the results, and a record-level `tools` list (the functions offered, passed to the
chat template). An assistant message's `reasoning_content` (or `thinking`) is kept for templates that render it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ACCEPTED_FORMATS = (
    '{"prompt": str}, {"messages": [{"role", "content"}, ...]}, '
    '{"conversations": [{"from", "value"}, ...]} (ShareGPT) or {"question_id", "category", "turns": [str, ...]} '
    "(Spec-Bench); use column_map to rename other columns, e.g. column_map={instruction: prompt}"
)
_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                   "chatgpt": "assistant", "bard": "assistant", "bing": "assistant", "system": "system"}
_ROLES = ("system", "user", "assistant", "tool")
# Keys of a chat message kept beside role and content (tool calls and results, reasoning).
_MESSAGE_EXTRAS = ("tool_calls", "tool_call_id", "name", "reasoning_content", "thinking")


@dataclass
class Prompt:
    """One prompt: an id, an optional category and its chat messages (user turns only for turn lists)."""

    prompt_id: str
    category: str | None
    messages: list[dict]
    line: int | None = field(default=None, compare=False)  # its line in a .jsonl file (for errors that name it)
    tools: list[dict] | None = None  # the functions a tool-calling chat offers (OpenAI format), for the template

    @property
    def turns(self) -> list[str]:
        """The user messages' contents, in order."""
        return [m["content"] for m in self.messages if m["role"] == "user"]


def _check_text(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{where} must be a non-empty string, got {value!r}")
    return value


def _check_tool_calls(calls: Any, where: str) -> list[dict]:
    """An assistant message's `tool_calls`: a non-empty list of {type: function, function: {name, arguments}}."""
    if not isinstance(calls, list) or not calls:
        raise ValueError(f"{where}: 'tool_calls' must be a non-empty list of {{type: function, function: "
                         f"{{name, arguments}}}} objects (OpenAI format), got {calls!r}")
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise ValueError(f"{where}: tool call {j} must be {{type: function, function: {{name, arguments}}}} "
                             f"with a non-empty name (OpenAI format), got {call!r}")
        if call.get("type", "function") != "function":
            raise ValueError(f"{where}: tool call {j} has type {call['type']!r}; only type 'function' is supported")
    return calls


def _chat_message(m: Any, where: str) -> dict:
    """One checked chat message: role and content, and the extras a template reads (tool calls, reasoning)."""
    if not isinstance(m, dict) or "role" not in m or ("content" not in m and "tool_calls" not in m):
        raise ValueError(f"{where} must be an object with 'role' and 'content', got {m!r}")
    if m["role"] not in _ROLES:
        raise ValueError(f"{where} has role {m['role']!r}; use one of {', '.join(_ROLES)}")
    out = {"role": m["role"]}
    if m.get("tool_calls") is not None:
        if m["role"] != "assistant":
            raise ValueError(f"{where}: only an assistant message may hold 'tool_calls', not a {m['role']} one")
        out["tool_calls"] = _check_tool_calls(m["tool_calls"], where)
        content = m.get("content")
        out["content"] = "" if content is None else content
        if not isinstance(out["content"], str):
            raise ValueError(f"{where} content must be a string (or empty beside tool_calls), got {content!r}")
    else:
        out["content"] = _check_text(m["content"], f"{where} content")
    for key in _MESSAGE_EXTRAS:
        if key != "tool_calls" and m.get(key) is not None:
            out[key] = m[key]
    return out


def _chat_messages(raw: Any, where: str) -> list[dict]:
    if not isinstance(raw, list) or not raw:
        raise ValueError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
    out = [_chat_message(m, f"{where}: message {i}") for i, m in enumerate(raw)]
    for i, m in enumerate(out):
        if m["role"] == "tool" and (i == 0 or out[i - 1]["role"] not in ("assistant", "tool")
                                    or not any("tool_calls" in x for x in out[:i])):
            raise ValueError(f"{where}: message {i} is a tool result with no assistant tool call before it; a "
                             f"'tool' message follows an assistant message with 'tool_calls' (or another result)")
    return out


def _sharegpt_messages(raw: Any, where: str) -> list[dict]:
    if not isinstance(raw, list) or not raw:
        raise ValueError(f"{where}: 'conversations' must be a non-empty list of {{from, value}} objects")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or "from" not in m or "value" not in m:
            raise ValueError(f"{where}: conversation entry {i} must have 'from' and 'value', got {m!r}")
        role = _SHAREGPT_ROLES.get(str(m["from"]).lower())
        if role is None:
            raise ValueError(f"{where}: conversation entry {i} has from={m['from']!r}; "
                             f"expected one of {', '.join(sorted(_SHAREGPT_ROLES))}")
        out.append({"role": role, "content": _check_text(m["value"], f"{where}: conversation entry {i} value")})
    return out


def normalise_record(record: dict, index: int, column_map: dict | None = None) -> Prompt:
    """Turn one record of any accepted shape into a Prompt (ValueError naming the keys found otherwise)."""
    where = f"record {index}"
    if not isinstance(record, dict):
        raise ValueError(f"{where} is a {type(record).__name__}, not an object; accepted formats: {ACCEPTED_FORMATS}")
    if column_map:
        missing = [src for src in column_map if src not in record]
        if missing:
            raise ValueError(f"{where}: column_map names column(s) {missing} that are not in the record "
                             f"(keys found: {sorted(record)})")
        record = {column_map.get(k, k): v for k, v in record.items()}

    prompt_id = record.get("prompt_id", record.get("question_id", record.get("id")))
    prompt_id = str(index) if prompt_id is None else str(prompt_id)
    category = record.get("category")
    category = None if category is None else str(category)

    if "messages" in record:
        messages = _chat_messages(record["messages"], where)
    elif "conversations" in record:
        messages = _sharegpt_messages(record["conversations"], where)
    elif "turns" in record:
        turns = record["turns"]
        if isinstance(turns, str):
            turns = [turns]
        if not isinstance(turns, list) or not turns:
            raise ValueError(f"{where}: 'turns' must be a non-empty list of strings")
        messages = [{"role": "user", "content": _check_text(t, f"{where}: turn {i}")} for i, t in enumerate(turns)]
    elif "prompt" in record:
        messages = [{"role": "user", "content": _check_text(record["prompt"], f"{where}: 'prompt'")}]
    else:
        raise ValueError(f"{where} has keys {sorted(record)}, none of which holds a prompt; "
                         f"accepted formats: {ACCEPTED_FORMATS}")
    if not any(m["role"] == "user" for m in messages):
        raise ValueError(f"{where} has no user message")
    tools = record.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise ValueError(f"{where}: 'tools' must be a list of function definitions (OpenAI format), got {tools!r}")
    return Prompt(prompt_id=prompt_id, category=category, messages=messages, tools=tools or None)


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        line = path.read_bytes()[: err.start].count(b"\n") + 1
        raise ValueError(f"prompt file {path} is not UTF-8 text (byte {err.object[err.start]:#04x} on line {line}); "
                         f"save it as UTF-8, e.g. iconv -f latin1 -t utf-8") from None
    except OSError as err:
        raise ValueError(f"could not read prompt file {path}: {err.strerror or err}") from None


def _read_records(path: Path) -> list[tuple[int | None, dict]]:
    """(line number in a .jsonl file, or None in a .json one; record) for each record."""
    text = _read_text(path)
    if not text.strip():
        raise ValueError(f"prompt file {path} is empty")
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not valid JSON ({err}); a .json prompt file holds a list of records") from err
        if isinstance(data, dict):
            data = [data]
        if not isinstance(data, list):
            raise ValueError(f"{path}: a .json prompt file must hold a list of records")
        return [(None, record) for record in data]
    records = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append((lineno, json.loads(line)))
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: line {lineno} is not valid JSON ({err.msg}); each line must be one "
                             f"JSON object") from err
    return records


def read_prompts(path: str | Path, column_map: dict | None = None, limit: int | None = None) -> list[Prompt]:
    """Read a local .jsonl or .json prompt file into Prompts (ValueError on a missing, empty or bad file)."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"prompt file {path} is a folder; pass a .jsonl/.json file (e.g. {path / 'prompts.jsonl'})")
    if not path.is_file():
        raise ValueError(f"prompt file {path} does not exist; pass a local .jsonl/.json file")
    if path.suffix not in (".jsonl", ".json"):
        raise ValueError(f"prompt file {path} must end in .jsonl or .json")
    records = _read_records(path)
    if not records:
        raise ValueError(f"prompt file {path} holds no records")
    if limit is not None:
        records = records[:limit]
    prompts = [normalise_record(r, i, column_map) for i, (_, r) in enumerate(records)]
    for prompt, (line, _) in zip(prompts, records):
        prompt.line = line
    ids = [p.prompt_id for p in prompts]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise ValueError(f"{path}: prompt_id {dup!r} appears more than once; prompt ids must be unique")
    return prompts


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool, tokenize: bool = True,
                chat_template_kwargs: dict | None = None, tools: list[dict] | None = None):
    """The chat template applied to `messages` (token ids, or the text with tokenize=False); `chat_template_kwargs`
    (e.g. {enable_thinking: false}) and `tools` go to the template."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template; set "
            "use_chat_template=false to encode prompts as plain text"
        )
    if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
        raise ValueError(f"chat_template_kwargs must be a mapping such as {{enable_thinking: false}}, "
                         f"got {chat_template_kwargs!r}")
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=tokenize,
                                        return_dict=False, tools=tools, **(chat_template_kwargs or {}))
    if not tokenize:
        return out
    # Some tokenizers still return a batch of one for a single conversation.
    if out and isinstance(out[0], list):
        out = out[0]
    return [int(i) for i in out]


def encode_prompt(tokenizer, messages: list[dict], use_chat_template: bool = True,
                  chat_template_kwargs: dict | None = None, tools: list[dict] | None = None) -> list[int]:
    """Token ids of `messages`: the chat template with the assistant header (given `chat_template_kwargs`, e.g.
    {enable_thinking: false}, and the `tools` offered), or the contents joined by blank lines."""
    if use_chat_template:
        return render_chat(tokenizer, messages, True, True, chat_template_kwargs, tools)
    text = "\n\n".join(m["content"] for m in messages)
    return [int(i) for i in tokenizer(text)["input_ids"]]


def check_prompt_lengths(prompts: list[Prompt], encoded: list[list[int]], max_new_tokens: int,
                         contexts: dict[str, int | None], source: str | Path) -> None:
    """Before any forward: a ValueError naming the first prompt whose tokens plus max_new_tokens do not fit the
    smallest of `contexts` (a model's name -> its context in positions; None: not declared), with its length and the
    fix. A decoder only finds out after a forward over the whole prompt, which for a long one takes minutes."""
    known = {name: n for name, n in contexts.items() if n is not None}
    if not known:
        return
    model, context = min(known.items(), key=lambda item: item[1])
    room = context - max_new_tokens  # the longest prompt that fits
    too_long = [i for i, ids in enumerate(encoded) if len(ids) > room]
    if not too_long:
        return
    i = too_long[0]
    p, n = prompts[i], len(encoded[i])
    where = f"line {p.line} of {source}" if p.line is not None else f"record {i} of {source}"
    if room < 1:
        fix = f"lower max_new_tokens below {context}"
    else:
        fix = f"drop it from the file, shorten it to at most {room:,} tokens"
        fix += f", or lower max_new_tokens to at most {context - n:,}" if n < context else ""
    more = f" ({len(too_long) - 1} more prompt(s) are too long as well)" if len(too_long) > 1 else ""
    raise ValueError(f"prompt {p.prompt_id} ({where}) has {n:,} tokens: with max_new_tokens={max_new_tokens} it needs "
                     f"{n + max_new_tokens:,} positions, more than {model}'s context of {context:,}; {fix}{more}")
