"""Tool-calling conversations (OpenAI message format): the target writes every assistant turn, its calls
included, and the tool results are kept from the dataset; bad messages are refused naming the record."""

from __future__ import annotations

import json

import pytest
from test_reasoning import QWEN3_TEMPLATE, QWEN_SPECIALS, ScriptedTarget, bpe_tokenizer

from specdec.prompts import encode_prompt, normalise_record, render_chat
from specdec.train.data.backend import generate_shard
from specdec.train.data.config import DataConfig
from specdec.train.data.planning import conversation, plan_items
from specdec.train.data.reasoning import assistant_message
from specdec.train.data.sources import load_prompt_set

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
DATASET_CALL = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]}
RECORD = {"id": "w1", "tools": TOOLS, "messages": [
    {"role": "system", "content": "you answer with tools"},
    {"role": "user", "content": "what is the weather in Paris"},
    DATASET_CALL,
    {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": "sunny"},
    {"role": "assistant", "content": "it is sunny in Rome"}]}
TARGET_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_tool_conversation_is_regenerated_with_the_datasets_results():
    tok = bpe_tokenizer(QWEN3_TEMPLATE, QWEN_SPECIALS, "<|im_end|>")
    prompt = normalise_record(RECORD, 0)
    history, inserts = conversation(prompt, "all")
    assert [m["role"] for m in history] == ["system"]
    assert [[m["role"] for m in turn] for turn in inserts] == [["user"], ["tool"]]
    cfg = DataConfig(target="unused", prompts="unused")
    items, _, _ = plan_items([prompt], tok, cfg, None)
    first = encode_prompt(tok, RECORD["messages"][:2], tools=TOOLS)
    backend = ScriptedTarget(cfg, tok, lambda p: TARGET_CALL if p == first else "it is sunny in Paris",
                             "<|im_end|>")
    rows, counts = generate_shard(items, backend, tok, cfg, seed=0, context_limit=None)
    assert counts["examples"] == 2 and [r["turn"] for r in rows] == [0, 1]
    assert rows[0]["input_ids"][: rows[0]["prompt_length"]] == first
    # Turn 2's prompt: the target's own call (parsed as a server's tool parser would), then the dataset's result.
    own_call = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    served = RECORD["messages"][:2] + [own_call, RECORD["messages"][3]]
    second = rows[1]["input_ids"][: rows[1]["prompt_length"]]
    assert second == render_chat(tok, served, True, tools=TOOLS)
    text = tok.decode(second)
    assert "sunny" in text and "Rome" not in text  # the dataset's result, not its call
    assert tok.decode(rows[1]["input_ids"][rows[1]["prompt_length"]:]) == "it is sunny in Paris<|im_end|>"


def test_a_call_the_target_writes_is_parsed_into_tool_calls():
    tok = bpe_tokenizer(QWEN3_TEMPLATE, QWEN_SPECIALS, "<|im_end|>")
    tokens = tok("<think>\nthe user asks\n</think>\n\n" + TARGET_CALL, add_special_tokens=False)["input_ids"]
    message = assistant_message(tok, tokens + [tok.convert_tokens_to_ids("<|im_end|>")])
    assert message["reasoning_content"] == "the user asks" and message["content"] == ""
    assert message["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Paris"}}


@pytest.mark.parametrize("messages, error", [
    ([{"role": "user", "content": "hi"}, {"role": "tool", "content": "sunny"}],
     "record 3: message 1 is a tool result with no assistant tool call before it"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}],
     "record 3: message 1: tool call 0 must be"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": "get_weather"}],
     "record 3: message 1: 'tool_calls' must be a non-empty list"),
    ([{"role": "user", "content": "hi", "tool_calls": [{"function": {"name": "f"}}]}],
     "record 3: message 0: only an assistant message may hold 'tool_calls'"),
    ([{"role": "user", "content": "hi"}, {"role": "function", "content": "x"}],
     "record 3: message 1 has role 'function'"),
    ([{"role": "user", "content": "hi"},
      {"role": "assistant", "tool_calls": [{"type": "code", "function": {"name": "f"}}]}],
     "only type 'function' is supported"),
])
def test_bad_tool_messages_name_the_row(tmp_path, messages, error):
    path = tmp_path / "chats.jsonl"
    good = {"messages": [{"role": "user", "content": "hi"}]}
    path.write_text("".join(json.dumps(r) + "\n" for r in [good, good, good, {"messages": messages}]))
    with pytest.raises(ValueError, match=error.replace("(", r"\(").replace("'", "'")):
        load_prompt_set(DataConfig(prompts=str(path), output_dir=str(tmp_path / "out")))


def test_tools_must_be_a_list_of_definitions():
    with pytest.raises(ValueError, match="record 0: 'tools' must be a list"):
        normalise_record({"tools": "get_weather", "prompt": "hi"}, 0)
