"""Reasoning targets: the thinking kept in the rows with the loss over it, and the next turn's prompt rendered as a
server renders it, for chat templates of the Qwen3, DeepSeek-R1-distill and gpt-oss (Harmony) kind. The templates
are written here, after the public ones' behaviour; the tokenizer is a byte-level BPE trained on the spot."""

from __future__ import annotations

import pytest
import torch

from specdec.prompts import Prompt, encode_prompt, render_chat
from specdec.train.batches import collate
from specdec.train.data.backend import Completion, GenerationBackend, generate_shard
from specdec.train.data.backend_dataset import answer_ids
from specdec.train.data.config import DataConfig
from specdec.train.data.planning import plan_items
from specdec.train.data.reasoning import assistant_message

QWEN_SPECIALS = ["<|im_start|>", "<|im_end|>"]
R1_SPECIALS = ["<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>"]
HARMONY_SPECIALS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>",
                    "<|constrain|>"]
_LAST_QUERY = ("{% set ns = namespace(last_query=-1) %}{% for m in messages %}"
               "{% if m.role == 'user' %}{% set ns.last_query = loop.index0 %}{% endif %}{% endfor %}")
# Qwen3: thinking rendered only for assistant turns after the last user message (earlier turns' is dropped),
# taken from reasoning_content or split out of the content; enable_thinking=false pre-fills an empty think block;
# tool calls as <tool_call> JSON blocks, tool results as a user turn of <tool_response> blocks.
QWEN3_TEMPLATE = _LAST_QUERY + (
    "{% for m in messages %}"
    "{% if m.role == 'assistant' %}"
    "{% set content = m.content %}"
    "{% set reasoning = m.reasoning_content if m.reasoning_content is defined and m.reasoning_content else '' %}"
    "{% if '</think>' in content %}{% set reasoning = content.split('</think>')[0].split('<think>')[-1]"
    ".strip('\\n') %}{% set content = content.split('</think>')[-1].lstrip('\\n') %}{% endif %}"
    "<|im_start|>assistant\n"
    "{% if loop.index0 > ns.last_query %}{{ '<think>\\n' + reasoning + '\\n</think>\\n\\n' }}{% endif %}"
    "{{ content }}"
    "{% if m.tool_calls is defined %}{% for c in m.tool_calls %}"
    "{{ '<tool_call>\\n{\"name\": \"' + c.function.name + '\", \"arguments\": ' + (c.function.arguments | tojson)"
    " + '}\\n</tool_call>' }}{% endfor %}{% endif %}"
    "<|im_end|>\n"
    "{% elif m.role == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{% endif %}{% endif %}")
# DeepSeek-R1 distills: every assistant turn's thinking is dropped, the last one's too; the generation prompt
# opens the think block.
R1_TEMPLATE = (
    "<｜begin▁of▁sentence｜>{% for m in messages %}"
    "{% if m.role == 'user' %}<｜User｜>{{ m.content }}"
    "{% elif m.role == 'assistant' %}{% set content = m.content %}"
    "{% if '</think>' in content %}{% set content = content.split('</think>')[-1] %}{% endif %}"
    "<｜Assistant｜>{{ content }}<｜end▁of▁sentence｜>"
    "{% else %}{{ m.content }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<｜Assistant｜><think>\n{% endif %}")
# gpt-oss (Harmony): the analysis channel holds the thinking, kept only after the last user message; the final
# channel the answer; the last turn of a finished conversation ends in <|return|>, others in <|end|>.
HARMONY_TEMPLATE = _LAST_QUERY + (
    "{% for m in messages %}"
    "{% if m.role == 'assistant' %}"
    "{% if m.thinking is defined and m.thinking and loop.index0 > ns.last_query %}"
    "<|start|>assistant<|channel|>analysis<|message|>{{ m.thinking }}<|end|>{% endif %}"
    "<|start|>assistant<|channel|>final<|message|>{{ m.content }}"
    "{{ '<|return|>' if loop.last and not add_generation_prompt else '<|end|>' }}"
    "{% else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}")
CORPUS = ["what is the weather in Paris today", "it is sunny and warm", "let me think about the user question",
          '{"name": "get_weather", "arguments": {"city": "Paris"}}', "tool_response tool_call final analysis",
          "two plus two is four, the answer is four"]


def bpe_tokenizer(template: str, specials: list[str], eos: str):
    """A byte-level BPE tokenizer trained on a few sentences, with the template's markers as single tokens:
    `specials` special (left out by decode(skip_special_tokens=True)), the think and tool-call tags not."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=specials)
    tok.train_from_iterator(CORPUS, trainer=trainer)
    out = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token=eos)
    out.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t in ("<think>", "</think>", "<tool_call>", "</tool_call>")])
    out.chat_template = template
    return out


class ScriptedTarget(GenerationBackend):
    """A target that writes `answer_for(prompt)` for each prompt (its EOS appended); the calls are kept."""

    prompts_per_call = 4

    def __init__(self, cfg: DataConfig, tokenizer, answer_for, eos: str):
        self.cfg, self.tokenizer, self.answer_for = cfg, tokenizer, answer_for
        self.eos = [tokenizer.convert_tokens_to_ids(eos)]
        self.calls: list = []

    def generate(self, prompts, generator, sampling=None):
        self.calls.append((len(prompts), sampling))
        return [Completion(self.tokenizer(self.answer_for(p), add_special_tokens=False)["input_ids"] + self.eos)
                for p in prompts]


def _two_turns(tok, cfg, answers, eos):
    """Rows of a two-turn conversation the scripted target answers (answers[0], then answers[1])."""
    prompt = Prompt("p0", None, [{"role": "user", "content": "what is the weather in Paris"},
                                 {"role": "user", "content": "is it warm"}])
    items, _, _ = plan_items([prompt], tok, cfg, None)
    first = encode_prompt(tok, prompt.messages[:1], True, cfg.chat_template_kwargs)
    backend = ScriptedTarget(cfg, tok, lambda p: answers[0] if p == first else answers[1], eos)
    rows, counts = generate_shard(items, backend, tok, cfg, seed=0, context_limit=None)
    assert counts["examples"] == 2
    return rows


def _check_loss_mask(rows: list[dict], completions: list[list[int]]) -> None:
    """Token by token: the loss covers exactly the completion (thinking included) and nothing of the prompt."""
    batch = collate({"input_ids": [r["input_ids"] for r in rows], "prompt_length": [r["prompt_length"] for r in rows]},
                    pad_id=0, max_length=4096)
    for b, (row, completion) in enumerate(zip(rows, completions)):
        n, p = len(row["input_ids"]), row["prompt_length"]
        assert row["input_ids"][p:] == completion
        expected = [p - 1 <= t < n - 1 for t in range(batch["loss_mask"].shape[1])]
        assert batch["loss_mask"][b].tolist() == expected
        scored = batch["labels"][b][batch["loss_mask"][b]].tolist()
        assert scored == completion  # every completion token is predicted once, thinking tags included


@pytest.mark.parametrize("kind", ["qwen3", "r1"])
def test_thinking_is_trained_on_and_earlier_thinking_left_as_the_template_drops_it(kind):
    template, specials, eos = (QWEN3_TEMPLATE, QWEN_SPECIALS, "<|im_end|>") if kind == "qwen3" else \
        (R1_TEMPLATE, R1_SPECIALS, "<｜end▁of▁sentence｜>")
    tok = bpe_tokenizer(template, specials, eos)
    opener = "<think>\n" if kind == "qwen3" else ""  # R1's generation prompt opens the think block itself
    answers = [f"{opener}let me think\n</think>\n\nit is sunny", f"{opener}the user asks\n</think>\n\nit is warm"]
    cfg = DataConfig(target="unused", prompts="unused")
    rows = _two_turns(tok, cfg, answers, eos)
    eos_id = tok.convert_tokens_to_ids(eos)
    completions = [tok(a, add_special_tokens=False)["input_ids"] + [eos_id] for a in answers]
    _check_loss_mask(rows, completions)
    # The second prompt is what a server renders from the client's history (the answer's content, no thinking).
    served = [{"role": "user", "content": "what is the weather in Paris"},
              {"role": "assistant", "content": "it is sunny"}, {"role": "user", "content": "is it warm"}]
    second = rows[1]["input_ids"][: rows[1]["prompt_length"]]
    assert second == render_chat(tok, served, True)
    assert "let me think" not in tok.decode(second)
    assert "the user asks" in tok.decode(rows[1]["input_ids"][rows[1]["prompt_length"]:])


def test_enable_thinking_false_reaches_the_template_and_the_fingerprint():
    tok = bpe_tokenizer(QWEN3_TEMPLATE, QWEN_SPECIALS, "<|im_end|>")
    messages = [{"role": "user", "content": "what is the weather"}]
    thinking = tok.decode(encode_prompt(tok, messages))
    plain = tok.decode(encode_prompt(tok, messages, chat_template_kwargs={"enable_thinking": False}))
    assert thinking.endswith("<|im_start|>assistant\n")
    assert plain.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    from specdec.train.data.config import fingerprinted_settings

    assert "chat_template_kwargs" not in fingerprinted_settings(DataConfig())  # older folders still resume
    assert fingerprinted_settings(DataConfig(chat_template_kwargs={"enable_thinking": False}))[
        "chat_template_kwargs"] == {"enable_thinking": False}
    with pytest.raises(ValueError, match="chat_template_kwargs must be a mapping"):
        DataConfig(chat_template_kwargs="enable_thinking=false")
    with pytest.raises(ValueError, match="chat_template_kwargs must be a mapping"):  # eval's prompts too
        encode_prompt(tok, messages, chat_template_kwargs="enable_thinking=false")


def test_harmony_analysis_is_trained_on_and_parsed_apart_for_the_next_turn():
    tok = bpe_tokenizer(HARMONY_TEMPLATE, HARMONY_SPECIALS, "<|return|>")
    answers = ["<|channel|>analysis<|message|>let me think<|end|><|start|>assistant<|channel|>final<|message|>"
               "it is sunny",
               "<|channel|>analysis<|message|>the user asks<|end|><|start|>assistant<|channel|>final<|message|>"
               "it is warm"]
    cfg = DataConfig(target="unused", prompts="unused")
    rows = _two_turns(tok, cfg, answers, "<|return|>")
    eos_id = tok.convert_tokens_to_ids("<|return|>")
    _check_loss_mask(rows, [tok(a, add_special_tokens=False)["input_ids"] + [eos_id] for a in answers])
    message = assistant_message(tok, rows[0]["input_ids"][rows[0]["prompt_length"]:])
    assert message["content"] == "it is sunny" and message["thinking"] == "let me think"
    second = tok.decode(rows[1]["input_ids"][: rows[1]["prompt_length"]])
    assert second.endswith("<|start|>assistant<|channel|>final<|message|>it is sunny<|end|><|start|>user"
                           "<|message|>is it warm<|end|><|start|>assistant")
    assert "let me think" not in second


@pytest.mark.parametrize("field", ["content", "reasoning_content"])
def test_dataset_answers_keep_their_thinking_where_the_template_drops_it(field):
    """responses=dataset with an R1-kind template, which renders no thinking for any answer: the row holds the
    answer as the target writes it after the prompt's open think block, and the loss covers it all."""
    tok = bpe_tokenizer(R1_TEMPLATE, R1_SPECIALS, "<｜end▁of▁sentence｜>")
    eos = [tok.convert_tokens_to_ids("<｜end▁of▁sentence｜>")]
    before = [{"role": "user", "content": "what is two plus two"}]
    answer = {"role": "assistant", "content": "<think>\nthe user asks\n</think>\n\nfour"} if field == "content" \
        else {"role": "assistant", "content": "four", "reasoning_content": "the user asks"}
    cfg = DataConfig(target="unused", prompts="unused", responses="dataset")
    prompt = encode_prompt(tok, before)
    completion = answer_ids(tok, before, answer, prompt, cfg, eos)
    assert tok.decode(completion) == "the user asks\n</think>\n\nfour<｜end▁of▁sentence｜>"
    _check_loss_mask([{"input_ids": prompt + completion, "prompt_length": len(prompt)}], [completion])


def test_dataset_answers_with_a_template_that_keeps_the_last_thinking():
    tok = bpe_tokenizer(QWEN3_TEMPLATE, QWEN_SPECIALS, "<|im_end|>")
    eos = [tok.convert_tokens_to_ids("<|im_end|>")]
    before = [{"role": "user", "content": "what is two plus two"}]
    answer = {"role": "assistant", "content": "<think>\nthe user asks\n</think>\n\nfour"}
    cfg = DataConfig(target="unused", prompts="unused", responses="dataset")
    completion = answer_ids(tok, before, answer, encode_prompt(tok, before), cfg, eos)
    assert tok.decode(completion) == "<think>\nthe user asks\n</think>\n\nfour<|im_end|>"


def test_collate_masks_stay_right_when_rows_are_packed_into_a_batch():
    """The same rows batched with padding: no pad position and no prompt position is scored."""
    rows = [{"input_ids": [5, 6, 7, 8], "prompt_length": 2}, {"input_ids": [5, 6, 7, 8, 9, 10], "prompt_length": 3}]
    batch = collate({"input_ids": [r["input_ids"] for r in rows], "prompt_length": [r["prompt_length"] for r in rows]},
                    pad_id=0, max_length=64)
    assert batch["loss_mask"].tolist() == [[False, True, True, False, False, False],
                                           [False, False, True, True, True, False]]
    assert torch.equal(batch["labels"][batch["loss_mask"]], torch.tensor([7, 8, 8, 9, 10]))
