"""specdec.prompts: record shapes, file errors and prompt encoding."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import (
    SPEC_BENCH,  # noqa: E402
    needs_spec_bench,
    tiny_tokenizer,
)

from specdec.prompts import Prompt, encode_prompt, normalise_record, read_prompts


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def test_plain_prompt():
    p = normalise_record({"prompt": "hello there"}, 7)
    assert p == Prompt("7", None, [{"role": "user", "content": "hello there"}])
    assert p.turns == ["hello there"]


def test_chat_messages_keep_ids_and_category():
    rec = {"id": "a1", "category": "math", "messages": [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"}]}
    p = normalise_record(rec, 0)
    assert p.prompt_id == "a1" and p.category == "math"
    assert [m["role"] for m in p.messages] == ["system", "user", "assistant", "user"]
    assert p.turns == ["q1", "q2"]


def test_sharegpt_roles_are_mapped():
    rec = {"conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "hi"},
                             {"from": "gpt", "value": "hello"}]}
    p = normalise_record(rec, 3)
    assert p.messages == [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"},
                          {"role": "assistant", "content": "hello"}]


def test_spec_bench_record_turns_are_user_messages():
    p = normalise_record({"question_id": 81, "category": "writing", "turns": ["one", "two"]}, 0)
    assert p.prompt_id == "81" and p.category == "writing"
    assert p.messages == [{"role": "user", "content": "one"}, {"role": "user", "content": "two"}]


def test_column_map_renames_user_columns():
    p = normalise_record({"instruction": "do x", "kind": "k"}, 0, {"instruction": "prompt", "kind": "category"})
    assert p.turns == ["do x"] and p.category == "k"
    with pytest.raises(ValueError, match="column_map names column"):
        normalise_record({"text": "x"}, 0, {"instruction": "prompt"})


def test_unknown_shape_names_keys_and_formats():
    with pytest.raises(ValueError, match=r"keys \['foo', 'text'\].*accepted formats"):
        normalise_record({"text": "x", "foo": 1}, 0)


@pytest.mark.parametrize("record", [
    {"prompt": ""}, {"messages": []}, {"messages": [{"role": "robot", "content": "x"}]},
    {"messages": [{"role": "assistant", "content": "only an answer"}]}, {"turns": []},
    {"conversations": [{"from": "alien", "value": "x"}]},
])
def test_bad_records(record):
    with pytest.raises(ValueError):
        normalise_record(record, 0)


@needs_spec_bench
def test_spec_bench_file_parses():
    prompts = read_prompts(SPEC_BENCH)
    assert len(prompts) == 80
    assert len({p.category for p in prompts}) == 8
    assert all(len(p.turns) == 2 for p in prompts)


def test_read_prompts_limit_and_json(tmp_path):
    f = _write(tmp_path / "p.jsonl", [json.dumps({"prompt": f"p{i}"}) for i in range(5)])
    assert [p.prompt_id for p in read_prompts(f, limit=2)] == ["0", "1"]
    j = tmp_path / "p.json"
    j.write_text(json.dumps([{"prompt": "a"}, {"messages": [{"role": "user", "content": "b"}]}]))
    assert [p.turns for p in read_prompts(j)] == [["a"], ["b"]]


def test_read_prompts_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        read_prompts(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="empty"):
        read_prompts(_write(tmp_path / "empty.jsonl", [""]))
    with pytest.raises(ValueError, match="line 2"):
        read_prompts(_write(tmp_path / "bad.jsonl", ['{"prompt": "a"}', "{not json"]))
    with pytest.raises(ValueError, match="appears more than once"):
        read_prompts(_write(tmp_path / "dup.jsonl", ['{"id": 1, "prompt": "a"}', '{"id": 1, "prompt": "b"}']))


def test_encode_prompt_with_and_without_template():
    tok = tiny_tokenizer()
    messages = [{"role": "user", "content": "explain the sum"}]
    ids = encode_prompt(tok, messages)
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|assistant|>")
    assert ids == tok(text, add_special_tokens=False)["input_ids"]
    assert ids[-1] == tok.convert_tokens_to_ids("<|assistant|>")
    two = [{"role": "user", "content": "explain"}, {"role": "user", "content": "the sum"}]
    assert encode_prompt(tok, two, use_chat_template=False) == tok("explain\n\nthe sum")["input_ids"]


def test_encode_prompt_missing_template_says_what_to_do():
    with pytest.raises(ValueError, match="use_chat_template=false"):
        encode_prompt(tiny_tokenizer(chat_template=False), [{"role": "user", "content": "x"}])
