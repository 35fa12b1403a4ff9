"""specdec.train.data (target-generated data, resumable) and its embedded prompt set (prompt_templates)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import weakref
from pathlib import Path

import pytest
import torch
from conftest import kill_data_run_after, tiny_llama, tiny_tokenizer

from specdec.decode import target_generate
from specdec.eagle3 import HiddenStateRecorder
from specdec.prompts import encode_prompt, read_prompts
from specdec.train import data as gen
from specdec.train import prompt_templates
from specdec.train.data import (
    DataConfig,
    conversation,
    load_generated,
    plan_items,
    run,
    run_loop,
    vllm_client,
)
from specdec.train.data.config import fingerprinted_settings
from specdec.train.data.processes import Processes
from specdec.train.prompt_templates import (
    EMBEDDED_HELDOUT_PROMPTS,
    EMBEDDED_TRAIN_PROMPTS,
    HELDOUT_TOTAL,
    SHARED_STREAM_KINDS,
    TRAIN_PER_KIND,
    build_prompt_sets,
)

REPO = Path(__file__).resolve().parents[1]
from conftest import SPEC_BENCH, needs_spec_bench  # noqa: E402

WORDS = "the a of to and is explain write sum number city water food book list simple clear".split()



@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory) -> Path:
    """A tiny random Llama + word-level tokenizer saved as a checkpoint folder (float64: no argmax ties)."""
    folder = tmp_path_factory.mktemp("tiny-target")
    tiny_llama(seed=0).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def _write_prompts(path: Path, n: int = 12, multi_turn: bool = True, seed: int = 0) -> Path:
    g = torch.Generator().manual_seed(seed)
    with path.open("w") as f:
        for i in range(n):
            k = int(torch.randint(2, 14, (1,), generator=g))
            words = [WORDS[int(j)] for j in torch.randint(0, len(WORDS), (k,), generator=g)]
            f.write(json.dumps({"prompt": " ".join(words), "category": f"c{i % 3}"}) + "\n")
        if multi_turn:
            f.write(json.dumps({"question_id": 900, "category": "mt", "turns": ["explain the sum", "write a list"]}) + "\n")
    return path


def _cfg(target: Path, prompts: Path, out: Path, **kw) -> DataConfig:
    base = dict(target=str(target), prompts=str(prompts), output_dir=str(out), max_new_tokens=6, batch_size=3,
                shard_size=4, dtype="float64", device="cpu", spec_bench_turns="all")
    base.update(kw)
    return DataConfig(**base)


def full_features(model, ids: list[int], layer_ids: list[int]) -> torch.Tensor:
    """The target's states over a whole sequence in one unpadded forward (final norm, then after each layer id),
    [len, W]."""
    with HiddenStateRecorder(model, layer_ids, final=True) as rec, torch.no_grad():
        model.get_decoder()(input_ids=torch.tensor([ids]))
        return rec.latest[0]


def _rows(out: Path) -> list[dict]:
    return sorted(load_generated(out).to_list(), key=lambda r: (r["prompt_id"], r["sample_index"], r["turn"]))


# ---- pure parts ---------------------------------------------------------------------------------------------


def test_config_validation():
    with pytest.raises(ValueError, match="too_long"):
        DataConfig(too_long="truncate")
    with pytest.raises(ValueError, match="backend"):
        DataConfig(backend="tgi")
    with pytest.raises(ValueError, match="temperature"):
        DataConfig(temperature=-1)
    with pytest.raises(ValueError, match="shard_size"):
        DataConfig(shard_size=0)
    with pytest.raises(ValueError, match="unknown dtype"):
        DataConfig(dtype="bf15")
    with pytest.raises(ValueError, match="backend=vllm computes in float32.*backend=transformers"):
        DataConfig(backend="vllm", dtype="float64")
    with pytest.raises(ValueError, match="vllm_args must be a mapping"):
        DataConfig(vllm_args="enforce_eager")
    with pytest.raises(ValueError, match="batch_tokens must be >= 0"):
        DataConfig(batch_tokens=-1)


def test_conversation_split():
    from specdec.prompts import Prompt

    turns = Prompt("1", None, [{"role": "system", "content": "s"}, {"role": "user", "content": "a"},
                               {"role": "user", "content": "b"}])
    assert conversation(turns, "all") == ([{"role": "system", "content": "s"}], ["a", "b"])
    assert conversation(turns, "first") == ([{"role": "system", "content": "s"}], ["a"])
    chat = Prompt("2", None, [{"role": "user", "content": "a"}, {"role": "assistant", "content": "x"},
                              {"role": "user", "content": "b"}, {"role": "assistant", "content": "old answer"}])
    history, user_turns = conversation(chat, "all")
    assert user_turns == ["b"] and [m["content"] for m in history] == ["a", "x"]


def test_plan_skips_or_rejects_long_prompts(tmp_path):
    tok = tiny_tokenizer()
    prompts = read_prompts(_write_prompts(tmp_path / "p.jsonl", multi_turn=False))
    lengths = {p.prompt_id: len(encode_prompt(tok, p.messages)) for p in prompts}
    cut = sorted(lengths.values())[len(lengths) // 2]
    cfg = DataConfig(max_prompt_tokens=cut, num_samples=2)
    items, skipped, _ = plan_items(prompts, tok, cfg, context_limit=None)
    assert sorted(skipped) == sorted(i for i, n in lengths.items() if n > cut)
    assert len(items) == 2 * (len(prompts) - len(skipped))
    # Shuffled (seeded), the longest first: any run of shards is a uniform sample of the work list.
    assert items[0].first_length == max(it.first_length for it in items)
    assert [it.first_length for it in items] != sorted((it.first_length for it in items), reverse=True)
    again = plan_items(prompts, tok, cfg, context_limit=None)[0]
    assert [(it.prompt.prompt_id, it.sample_index) for it in again] == [(it.prompt.prompt_id, it.sample_index)
                                                                        for it in items]
    in_order = plan_items(prompts, tok, dataclasses.replace(cfg, shuffle=False), context_limit=None)[0]
    assert [it.prompt.prompt_id for it in in_order] == [p.prompt_id for p in prompts if p.prompt_id not in skipped
                                                        for _ in range(2)]
    with pytest.raises(ValueError, match="too_long=skip"):
        plan_items(prompts, tok, DataConfig(max_prompt_tokens=cut, too_long="error"), context_limit=None)
    # The model's context bounds prompts too: prompt + max_new_tokens must fit.
    _, skipped_ctx, _ = plan_items(prompts, tok, DataConfig(max_new_tokens=8), context_limit=8 + cut)
    assert skipped_ctx == skipped


# ---- generation ---------------------------------------------------------------------------------------------


def test_generated_rows_match_the_target(tiny_target, tmp_path):
    prompts = _write_prompts(tmp_path / "p.jsonl")
    out = tmp_path / "out"
    manifest = run(_cfg(tiny_target, prompts, out, top_logprobs=3))
    assert manifest["complete"] and manifest["num_shards"] == 4  # 13 items, 4 per shard
    assert sorted(p.name for p in (out / "shards").iterdir()) == [f"shard-{i:05d}.parquet" for i in range(4)]
    rows = _rows(out)
    assert len(rows) == 14 and manifest["counts"]["examples"] == 14  # 12 single-turn + 2 turns
    assert manifest["counts"]["generated_tokens"] == sum(len(r["input_ids"]) - r["prompt_length"] for r in rows)
    model, tok = tiny_llama(seed=0), tiny_tokenizer()
    for r in rows:
        prompt, completion = r["input_ids"][: r["prompt_length"]], r["input_ids"][r["prompt_length"]:]
        assert 1 <= len(completion) <= 6
        if 2 in completion:  # EOS ends a completion and is kept
            assert completion.index(2) == len(completion) - 1
        # Each row equals unbatched greedy decoding of its prompt (batching and padding change nothing).
        ref = target_generate(model, torch.tensor([prompt]), max_new_tokens=6, eos_token_id=2)
        assert ref.sequences[0, len(prompt):].tolist()[: len(completion)] == completion
        # Top-n log-probs: one list of n per completion token, sorted, the greedy token first.
        assert len(r["top_ids"]) == len(r["top_logprobs"]) == len(completion)
        for j, token in enumerate(completion):
            assert r["top_ids"][j][0] == token and len(r["top_ids"][j]) == 3
            lp = r["top_logprobs"][j]
            assert lp == sorted(lp, reverse=True) and lp[0] <= 0.0
        if r["prompt_id"] != "900":
            text = json.loads((prompts.read_text().splitlines())[int(r["prompt_id"])])["prompt"]
            assert prompt == encode_prompt(tok, [{"role": "user", "content": text}])
    turns = [r for r in rows if r["prompt_id"] == "900"]
    assert [r["turn"] for r in turns] == [0, 1] and turns[1]["prompt_length"] > len(turns[0]["input_ids"])
    assert {r["category"] for r in rows} == {"c0", "c1", "c2", "mt"}


def test_recorded_features_equal_the_targets_own_on_the_whole_sequence(tiny_target, tmp_path):
    """record_features=true keeps, per row, what a full forward over the row would give at every fed position
    (batched, left-padded, multi-turn rows included), in the rows' order, beside each shard."""
    out = tmp_path / "out"
    manifest = run(_cfg(tiny_target, _write_prompts(tmp_path / "p.jsonl"), out, record_features=True,
                        eagle_aux_layer_ids=[1]))
    assert manifest["features"]["layer_ids"] == [1]
    model = tiny_llama(seed=0)
    checked = 0
    for columns, feats in gen.recorded_features(out):
        assert len(feats) == len(columns["input_ids"])
        for ids, f in zip(columns["input_ids"], feats):
            assert f.dtype == torch.bfloat16 and f.shape == (len(ids) - 1, 2 * model.config.hidden_size)
            full = full_features(model, ids, [1])
            torch.testing.assert_close(f.float(), full[:-1].float(), atol=2e-3, rtol=8e-3)  # bf16 storage
            checked += 1
    assert checked == manifest["counts"]["examples"] == 14
    assert sorted(p.name for p in (out / "shards").iterdir())[:2] == ["shard-00000.features.safetensors",
                                                                      "shard-00000.parquet"]


def test_a_grouped_prefill_keeps_the_rows_and_their_states(tiny_target, tmp_path, monkeypatch):
    """grouped_prefill (on by default) prefills each batch as several forwards: the same rows, top-n log-probs and
    recorded states as one forward padded to the batch's longest prompt (float64 here, so equal to rounding)."""
    import specdec.kv as kv
    used = []
    real = kv.prefill_groups
    monkeypatch.setattr(gen.backend_transformers, "prefill_groups", lambda lengths: used.append(real(lengths)) or used[-1])
    prompts = _write_prompts(tmp_path / "p.jsonl", n=9, multi_turn=False, seed=3)
    runs = {}
    for grouped in (True, False):
        out = tmp_path / f"out-{grouped}"
        run(_cfg(tiny_target, prompts, out, batch_size=9, shard_size=9, top_logprobs=3, record_features=True,
                 eagle_aux_layer_ids=[1], grouped_prefill=grouped))
        runs[grouped] = (_rows(out), [f for _, feats in gen.recorded_features(out) for f in feats])
    assert len(used) == 1 and len(used[0]) > 1  # the grouped run prefilled one batch as several forwards
    (rows, feats), (rows_one, feats_one) = runs[True], runs[False]
    assert [r["input_ids"] for r in rows] == [r["input_ids"] for r in rows_one]
    for r, r_one in zip(rows, rows_one):
        assert r["top_ids"] == r_one["top_ids"]
        torch.testing.assert_close(torch.tensor(r["top_logprobs"]), torch.tensor(r_one["top_logprobs"]))
    for f, f_one in zip(feats, feats_one):
        torch.testing.assert_close(f.float(), f_one.float())


def test_dropping_finished_rows_keeps_the_rows_and_their_states(tmp_path, monkeypatch):
    """drop_finished_rows (on by default): a row whose answer ended leaves the decoding batch; the same rows, top-n
    log-probs and recorded states as a batch that runs every row to its longest answer (float64)."""
    import specdec.decode as decode
    target = tiny_llama(seed=0)
    target.generation_config.eos_token_id = list(range(3, 40))  # answers that end at many different lengths
    tiny_target = tmp_path / "target"
    target.save_pretrained(tiny_target)
    tiny_tokenizer().save_pretrained(tiny_target)
    drops = []
    real = decode.keep_rows
    monkeypatch.setattr(decode, "keep_rows", lambda cache, keep: drops.append(len(keep)) or real(cache, keep))
    prompts = _write_prompts(tmp_path / "p.jsonl", n=9, multi_turn=False, seed=3)
    runs = {}
    for drop in (True, False):
        out = tmp_path / f"out-{drop}"
        run(_cfg(tiny_target, prompts, out, batch_size=9, shard_size=9, top_logprobs=3, record_features=True,
                 eagle_aux_layer_ids=[1], drop_finished_rows=drop, max_new_tokens=24))
        runs[drop] = (_rows(out), [f for _, feats in gen.recorded_features(out) for f in feats])
    assert drops  # the dropping run narrowed its batch at least once
    (rows, feats), (rows_all, feats_all) = runs[True], runs[False]
    assert [r["input_ids"] for r in rows] == [r["input_ids"] for r in rows_all]
    assert len({len(r["input_ids"]) - r["prompt_length"] for r in rows}) > 1  # answers of different lengths
    for r, r_all in zip(rows, rows_all):
        assert r["top_ids"] == r_all["top_ids"]
        torch.testing.assert_close(torch.tensor(r["top_logprobs"]), torch.tensor(r_all["top_logprobs"]))
    for f, f_all in zip(feats, feats_all):
        torch.testing.assert_close(f.float(), f_all.float())


def test_decoded_features_read_steps_that_ran_fewer_rows():
    """With step_rows (a decoding that dropped finished rows), a row's step states come from the steps it ran."""
    from types import SimpleNamespace

    from specdec.train.data.target_states import decoded_features
    prompts = [[5], [6], [7]]
    prefill = torch.tensor([[1.0], [2.0], [3.0]])[:, :, None]
    steps = [torch.tensor([10.0, 20.0, 30.0])[:, None, None], torch.tensor([11.0, 31.0])[:, None, None]]
    recorder = SimpleNamespace(history=[prefill, *steps])
    rows = decoded_features(recorder, prompts, width=1, lengths=[3, 2, 3],
                            step_rows=[torch.arange(3), torch.tensor([0, 2])])
    assert [r[:, 0].tolist() for r in rows] == [[1.0, 10.0, 11.0], [2.0, 20.0], [3.0, 30.0, 31.0]]


def test_decoded_features_read_a_grouped_prefill_with_and_without_decoding_steps():
    """Each row's states come from its own group's forward (right-aligned there) and then from the steps; a batch
    whose rows all ended at the prefill's token (no step ran) reads its prompts' states alone."""
    from types import SimpleNamespace

    from specdec.train.data.target_states import decoded_features
    prompts = [[5, 6], [7, 8, 9], [4]]
    groups = [[1], [0, 2]]  # the longest alone, then a group two wide
    alone = torch.arange(3.0)[None, :, None]  # row 1: positions 0, 1, 2
    pair = torch.tensor([[10.0, 11.0], [-1.0, 20.0]])[:, :, None]  # row 0 (2 tokens), row 2 (1 token, left-padded)
    step = torch.tensor([100.0, 101.0, 102.0])[:, None, None]
    recorder = SimpleNamespace(history=[alone, pair, step])
    rows = decoded_features(recorder, prompts, width=3, lengths=[2, 2, 2], groups=groups)
    assert [r[:, 0].tolist() for r in rows] == [[10.0, 11.0, 100.0], [0.0, 1.0, 2.0, 101.0], [20.0, 102.0]]
    recorder = SimpleNamespace(history=[alone, pair])
    rows = decoded_features(recorder, prompts, width=3, lengths=[1, 1, 1], groups=groups)
    assert [r[:, 0].tolist() for r in rows] == [[10.0, 11.0], [0.0, 1.0, 2.0], [20.0]]


def test_recorded_layers_and_record_features_go_together():
    with pytest.raises(ValueError, match="record_features=true keeps the target's states"):
        DataConfig(eagle_aux_layer_ids=[1])
    with pytest.raises(ValueError, match="set both, or neither"):
        DataConfig(record_features=True)
    DataConfig(record_features=True, eagle_aux_layer_ids=[1], backend="vllm")  # states from vLLM's own forwards
    with pytest.raises(ValueError, match="vllm_states"):
        DataConfig(vllm_states="both")


def test_features_held_in_memory_are_one_generation_batch(tiny_target, tmp_path, monkeypatch):
    """A shard of 8 items in batches of 2: each batch's features are written out (to the shard's spool) before the
    next batch starts, so a process never holds more rows' features than one batch, whatever the shard size; and
    the features file assembled from the spool reads as before, row by row."""
    alive, held = [], []
    real = gen.TransformersBackend.generate

    def generate(self, prompts, generator):
        held.append(sum(ref() is not None for ref in alive))  # features of earlier batches still in memory
        completions = real(self, prompts, generator)
        alive.extend(weakref.ref(c.features) for c in completions)
        return completions

    monkeypatch.setattr(gen.TransformersBackend, "generate", generate)
    out = tmp_path / "out"
    manifest = run(_cfg(tiny_target, _write_prompts(tmp_path / "p.jsonl", multi_turn=False), out, shard_size=8,
                        batch_size=2, record_features=True, eagle_aux_layer_ids=[1]))
    assert manifest["num_shards"] == 2 and len(held) == 6 and max(held) == 0
    assert not any(ref() is not None for ref in alive)
    assert not list((out / "shards").glob(".*"))  # no spool left behind
    model, checked = tiny_llama(seed=0), 0
    for columns, feats in gen.recorded_features(out):
        for ids, f in zip(columns["input_ids"], feats):
            torch.testing.assert_close(f.float(), full_features(model, ids, [1])[:-1].float(), atol=2e-3, rtol=8e-3)
            checked += 1
    assert checked == 12


def test_batches_keep_to_the_padded_token_budget(tiny_target, tmp_path, monkeypatch):
    """batch_tokens bounds each generate() call's rows x (longest prompt + max_new_tokens), one prompt at least,
    and batch_size its rows; the rows are the same as from batches bounded by batch_size alone."""
    from specdec.train.data.backend import _batches

    cfg = DataConfig(max_new_tokens=10, batch_size=4, batch_tokens=60)
    lengths = {0: 40, 1: 12, 2: 11, 3: 10, 4: 5, 5: 5, 6: 5, 7: 5, 8: 5}
    prompts = {i: [0] * n for i, n in lengths.items()}
    assert _batches(list(prompts), prompts, 4, cfg) == [[0], [1, 2], [3, 4, 5], [6, 7, 8]]
    assert _batches(list(prompts), prompts, 4, dataclasses.replace(cfg, batch_tokens=0)) == [
        [0, 1, 2, 3], [4, 5, 6, 7], [8]]
    assert _batches(list(prompts), prompts, None, cfg) == [list(prompts)]  # an engine that batches itself

    calls = []
    real = gen.TransformersBackend.generate

    def generate(self, batch, generator):
        calls.append((len(batch), max(map(len, batch)) + self.cfg.max_new_tokens))
        return real(self, batch, generator)

    monkeypatch.setattr(gen.TransformersBackend, "generate", generate)
    prompts_file = _write_prompts(tmp_path / "p.jsonl", multi_turn=False)
    run(_cfg(tiny_target, prompts_file, tmp_path / "budget", batch_size=4, shard_size=12, batch_tokens=60))
    assert all(rows == 1 or rows * width <= 60 for rows, width in calls) and max(r for r, _ in calls) > 1
    assert any(rows < 4 for rows, _ in calls[:-1])  # the budget, not batch_size, cut some batch
    run(_cfg(tiny_target, prompts_file, tmp_path / "rows", batch_size=4, shard_size=12, batch_tokens=0))
    strip = [{k: r[k] for k in ("prompt_id", "input_ids")} for r in _rows(tmp_path / "budget")]
    assert strip == [{k: r[k] for k in ("prompt_id", "input_ids")} for r in _rows(tmp_path / "rows")]


def test_feature_spool_writes_safetensors_in_the_order_asked(tmp_path):
    from safetensors import safe_open

    spool = gen.FeatureSpool(tmp_path / "f.safetensors")
    tensors = {("a", 0, 0): torch.randn(3, 4).bfloat16(), ("b", 0, 0): torch.randn(1, 4).bfloat16(),
               ("a", 0, 1): torch.randn(5, 4).float()}
    for key, t in tensors.items():
        spool.add(key, t)
    order = [("a", 0, 1), ("b", 0, 0), ("a", 0, 0)]
    spool.write(order, tmp_path / "f.safetensors")
    assert [p.name for p in tmp_path.iterdir()] == ["f.safetensors"]
    with safe_open(str(tmp_path / "f.safetensors"), "pt") as f:
        assert sorted(f.keys()) == ["0", "1", "2"]
        for i, key in enumerate(order):
            assert torch.equal(f.get_tensor(str(i)), tensors[key])


def test_dataset_responses_keep_the_conversations_own_answers(tiny_target, tmp_path):
    """responses=dataset: a row per assistant answer (chat `messages` and ShareGPT `conversations`), the dataset's
    own tokens (the chat template over the conversation, cut at the answer's EOS), prompt_length where the answer
    starts; features and top log-probs equal a full forward's over the row. A record without an answer is left
    out."""
    convs = [
        {"id": "chat", "messages": [{"role": "system", "content": "be simple"},
                                    {"role": "user", "content": "explain the sum"},
                                    {"role": "assistant", "content": "the sum of two numbers"},
                                    {"role": "user", "content": "write a list"},
                                    {"role": "assistant", "content": "first water then food"}]},
        {"id": "sharegpt", "conversations": [{"from": "human", "value": "what is a city"},
                                             {"from": "gpt", "value": "a city is big"}]},
        {"id": "unanswered", "prompt": "write a short poem"},
    ]
    prompts = tmp_path / "conv.jsonl"
    prompts.write_text("".join(json.dumps(c) + "\n" for c in convs))
    out = tmp_path / "out"
    manifest = run(_cfg(tiny_target, prompts, out, responses="dataset", top_logprobs=3, record_features=True,
                        eagle_aux_layer_ids=[1], batch_size=2))
    assert manifest["complete"] and manifest["counts"]["examples"] == 3
    assert manifest["generation"]["responses"] == "dataset"
    tok, model = tiny_tokenizer(), tiny_llama(seed=0)
    msgs = [{"role": "system", "content": "be simple"}, {"role": "user", "content": "explain the sum"},
            {"role": "assistant", "content": "the sum of two numbers"}, {"role": "user", "content": "write a list"}]
    expected = {("chat", 0): (msgs[:2], "the sum of two numbers"), ("chat", 1): (msgs, "first water then food"),
                ("sharegpt", 0): ([{"role": "user", "content": "what is a city"}], "a city is big")}
    rows = _rows(out)
    assert [(r["prompt_id"], r["turn"]) for r in rows] == sorted(expected)
    feats = {(pid, turn): f for columns, fs in gen.recorded_features(out)
             for pid, turn, f in zip(columns["prompt_id"], columns["turn"], fs)}
    for r in rows:
        before, answer = expected[(r["prompt_id"], r["turn"])]
        prompt = encode_prompt(tok, before)
        completion = tok(answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        assert r["input_ids"] == prompt + completion and r["prompt_length"] == len(prompt)
        torch.testing.assert_close(feats[(r["prompt_id"], r["turn"])].float(),
                                   full_features(model, r["input_ids"], [1])[:-1].float(), atol=2e-3, rtol=8e-3)
        with torch.no_grad():
            logits = model(torch.tensor([r["input_ids"]])).logits[0, len(prompt) - 1: -1]
        best = torch.log_softmax(logits.float(), -1).topk(3)
        assert r["top_ids"] == best.indices.tolist()
        torch.testing.assert_close(torch.tensor(r["top_logprobs"]), best.values.float(), atol=1e-5, rtol=0)
    assert run(_cfg(tiny_target, prompts, out, responses="dataset", top_logprobs=3, record_features=True,
                    eagle_aux_layer_ids=[1], batch_size=1))["complete"]  # batch_size may change: a resume
    with pytest.raises(ValueError, match="num_samples=1"):
        DataConfig(responses="dataset", num_samples=2)
    with pytest.raises(ValueError, match="none of the 2 records has one"):
        run(_cfg(tiny_target, _write_prompts(tmp_path / "p.jsonl", n=2, multi_turn=False), tmp_path / "o2",
                 responses="dataset"))
    # Tokens only (no features, no top log-probs): no model is loaded.
    plain = run(_cfg(tiny_target, prompts, tmp_path / "o3", responses="dataset"))
    assert [r["input_ids"] for r in _rows(tmp_path / "o3")] == [r["input_ids"] for r in rows]
    assert plain["counts"]["generated_tokens"] == sum(len(r["input_ids"]) - r["prompt_length"] for r in rows)


def test_vllm_states_way_and_cpu_shares(monkeypatch):
    """How backend=vllm gets the states: extracted where greedy or on a GPU, a prefill when sampling on a CPU; and
    how data-parallel processes split a CPU machine's cores for their engines."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    record = dict(record_features=True, eagle_aux_layer_ids=[1], backend="vllm")
    assert gen.states_mode(DataConfig(backend="vllm"), cpu) is None
    assert gen.states_mode(DataConfig(**record), cpu) == "extract"
    assert gen.states_mode(DataConfig(temperature=1.0, **record), cpu) == "prefill"
    assert gen.states_mode(DataConfig(temperature=1.0, **record), cuda) == "extract"
    assert gen.states_mode(DataConfig(vllm_states="prefill", **record), cuda) == "prefill"
    with pytest.raises(ValueError, match="vllm_states=prefill"):
        gen.states_mode(DataConfig(temperature=1.0, vllm_states="extract", **record), cpu)
    monkeypatch.setattr(vllm_client.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4}, raising=False)
    assert [vllm_client.cpu_share(i, 2, None) for i in (0, 1)] == [[0, 1], [2, 3, 4]]
    assert [vllm_client.cpu_share(i, 3, "auto") for i in (0, 1, 2)] == [[0], [1, 2], [3, 4]]
    assert vllm_client.cpu_share(1, 2, "0-3,8|4-7,9") == [4, 5, 6, 7, 9]
    assert vllm_client.cpu_share(6, 7, None) == [1]  # more processes than cores: they share them round the cores
    args, env = vllm_client.engine_settings(DataConfig(**record), cpu, "float32", False, Processes(1, 2, False),
                                             Path("states"), [1, 2])
    assert env["SPECDEC_VLLM_CPUS"] == env["VLLM_CPU_OMP_THREADS_BIND"] == "2,3,4" and env["OMP_NUM_THREADS"] == "3"
    assert args["speculative_config"]["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2]
    assert args["kv_transfer_config"]["kv_connector_extra_config"]["shared_storage_path"] == "states"
    assert not {"RANK", "WORLD_SIZE", "MASTER_PORT"} & set(env)


def test_settings_added_later_keep_old_folders_resumable():
    """A setting added later, at its default, is left out of the fingerprint (and vllm_states never counts)."""
    settings = fingerprinted_settings(DataConfig())
    assert "responses" not in settings and "vllm_states" not in settings
    assert fingerprinted_settings(DataConfig(responses="dataset"))["responses"] == "dataset"


def test_sampling_is_seeded_and_samples_differ(tiny_target, tmp_path):
    prompts = _write_prompts(tmp_path / "p.jsonl", n=4, multi_turn=False)
    kw = dict(temperature=1.0, num_samples=3, spec_bench_turns="first")
    run(_cfg(tiny_target, prompts, tmp_path / "a", **kw))
    run(_cfg(tiny_target, prompts, tmp_path / "b", **kw))
    a, b = _rows(tmp_path / "a"), _rows(tmp_path / "b")
    assert len(a) == 12 and [r["sample_index"] for r in a[:3]] == [0, 1, 2]
    assert [r["input_ids"] for r in a] == [r["input_ids"] for r in b]
    assert len({tuple(r["input_ids"]) for r in a}) > 4  # samples of one prompt are not all the same


def test_resume_after_lost_manifest_entry(tiny_target, tmp_path):
    prompts = _write_prompts(tmp_path / "p.jsonl")
    out = tmp_path / "out"
    cfg = _cfg(tiny_target, prompts, out)
    run(cfg)
    before = _rows(out)
    # Simulate a kill after a shard was renamed into place but before the manifest listed it, plus a stray tmp file.
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["shards"] = manifest["shards"][:2]
    manifest["complete"] = False
    (out / "manifest.json").write_text(json.dumps(manifest))
    (out / "shards" / "shard-00003.parquet").unlink()
    (out / "shards" / ".shard-00003.parquet.tmp-1").write_text("half")
    assert load_generated(out).num_rows < len(before)  # an incomplete folder loads its finished shards
    with pytest.raises(ValueError, match="incomplete"):
        load_generated(out, require_complete=True)
    again = run(cfg)
    assert again["complete"] and _rows(out) == before
    assert not list((out / "shards").glob(".*"))


def test_max_minutes_stops_between_shards_and_a_rerun_finishes(tiny_target, tmp_path, monkeypatch):
    prompts = _write_prompts(tmp_path / "p.jsonl")
    run(_cfg(tiny_target, prompts, tmp_path / "whole"))
    out = tmp_path / "out"
    # Each shard takes over a second (the pause): after the first, another would end past 1.5 s.
    monkeypatch.setenv(run_loop.PAUSE_ENV, "1.0")
    first = run(_cfg(tiny_target, prompts, out, max_minutes=1.5 / 60))
    assert not first["complete"] and len(first["shards"]) == 1 < first["num_shards"]
    assert load_generated(out).num_rows == first["shards"][0]["examples"]
    assert len(run(_cfg(tiny_target, prompts, out, max_minutes=1e-6))["shards"]) == 2  # a run always adds one
    monkeypatch.delenv(run_loop.PAUSE_ENV)
    again = run(_cfg(tiny_target, prompts, out))  # max_minutes may change between runs
    assert again["complete"] and _rows(out) == _rows(tmp_path / "whole")


def test_killed_subprocess_resumes_exactly_once(tiny_target, tmp_path):
    prompts = _write_prompts(tmp_path / "p.jsonl", n=15)
    out, ref = tmp_path / "out", tmp_path / "ref"
    args = [f"target={tiny_target}", f"prompts={prompts}", f"output_dir={out}", "max_new_tokens=6", "batch_size=2",
            "shard_size=2", "dtype=float64", "device=cpu", "spec_bench_turns=all", "top_logprobs=2"]
    env = dict(os.environ, OMP_NUM_THREADS="1", **{run_loop.PAUSE_ENV: "0.5"})
    kill_data_run_after(args, env, out, shards=2, timeout=120, poll=0.05)
    partial = json.loads((out / "manifest.json").read_text())
    assert not partial["complete"] and 2 <= len(partial["shards"]) < partial["num_shards"] == 8
    cfg = _cfg(tiny_target, prompts, out, batch_size=2, shard_size=2, top_logprobs=2)
    assert run(cfg)["complete"]
    rows = _rows(out)
    keys = [(r["prompt_id"], r["sample_index"], r["turn"]) for r in rows]
    assert len(keys) == len(set(keys)) == 15 + 2  # every prompt exactly once (the 2-turn one twice)
    run(_cfg(tiny_target, prompts, ref, batch_size=2, shard_size=2, top_logprobs=2))
    assert rows == _rows(ref)  # and identical to an uninterrupted run


def test_processes_take_disjoint_shards(tiny_target, tmp_path, monkeypatch):
    prompts = _write_prompts(tmp_path / "p.jsonl")
    out = tmp_path / "out"
    cfg = _cfg(tiny_target, prompts, out, shard_size=2)
    written = []
    real_write = run_loop.write_shard
    monkeypatch.setattr(run_loop, "write_shard", lambda rows, path, top: (written.append(path.name), real_write(rows, path, top)))
    for index in (0, 1):
        monkeypatch.setattr(run_loop, "processes", lambda cfg, i=index: Processes(i, 2, i == 0))
        monkeypatch.setattr(Processes, "barrier", lambda self: None)
        run(cfg)
    assert written == [f"shard-{i:05d}.parquet" for i in (0, 2, 4, 6, 1, 3, 5)]
    monkeypatch.setattr(run_loop, "processes", lambda cfg: Processes())
    assert run(cfg)["complete"] and len(written) == 7  # nothing left to do; the main process marks it complete


def test_other_settings_in_existing_output_dir(tiny_target, tmp_path):
    prompts = _write_prompts(tmp_path / "p.jsonl", n=3, multi_turn=False)
    out = tmp_path / "out"
    run(_cfg(tiny_target, prompts, out))
    with pytest.raises(ValueError, match="max_new_tokens.*overwrite=true"):
        run(_cfg(tiny_target, prompts, out, max_new_tokens=4))
    run(_cfg(tiny_target, prompts, out, batch_size=1))  # batch size does not change the data: a resume
    m = run(_cfg(tiny_target, prompts, out, max_new_tokens=4, overwrite=True))
    assert m["complete"] and m["settings"]["max_new_tokens"] == 4
    assert all(len(r["input_ids"]) - r["prompt_length"] <= 4 for r in _rows(out))


def test_parquet_and_csv_sources_with_column_map(tiny_target, tmp_path):
    import datasets

    ds = datasets.Dataset.from_dict({"instruction": ["explain the sum", "write a list"], "kind": ["a", "b"]})
    ds.to_parquet(str(tmp_path / "p.parquet"))
    ds.to_csv(str(tmp_path / "p.csv"), index=False)
    for name in ("p.parquet", "p.csv"):
        out = tmp_path / name.replace(".", "_")
        run(_cfg(tiny_target, tmp_path / name, out, column_map={"instruction": "prompt", "kind": "category"}))
        assert [r["category"] for r in _rows(out)] == ["a", "b"]


# ---- bad input ----------------------------------------------------------------------------------------------


def test_bad_inputs(tiny_target, tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        run(_cfg(tiny_target, tmp_path / "missing.jsonl", tmp_path / "o1"))
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        run(_cfg(tiny_target, tmp_path / "empty.jsonl", tmp_path / "o2"))
    (tmp_path / "odd.jsonl").write_text(json.dumps({"text": "hello", "label": 1}) + "\n")
    with pytest.raises(ValueError, match=r"keys \['label', 'text'\].*column_map"):
        run(_cfg(tiny_target, tmp_path / "odd.jsonl", tmp_path / "o3"))
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\n{"prompt": \n')
    with pytest.raises(ValueError, match="line 2"):
        run(_cfg(tiny_target, tmp_path / "bad.jsonl", tmp_path / "o4"))
    prompts = _write_prompts(tmp_path / "p.jsonl", n=3, multi_turn=False)
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        run(_cfg(tiny_target, prompts, tmp_path / "o5", max_prompt_tokens=2))
    with pytest.raises(ValueError, match="no manifest.json"):
        load_generated(tmp_path)


def test_too_long_prompts_are_counted_and_empty_datasets_rejected(tiny_target, tmp_path):
    import datasets

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{n}", "prompt": " ".join(["the"] * n)}) + "\n" for n in (2, 9, 3, 12)))
    m = run(_cfg(tiny_target, prompts, tmp_path / "out", max_prompt_tokens=8))  # chat markup adds 3 tokens
    assert m["counts"]["skipped_too_long"] == 2 and m["skipped_prompt_ids"] == ["p9", "p12"]
    assert sorted(r["prompt_id"] for r in _rows(tmp_path / "out")) == ["p2", "p3"]
    datasets.Dataset.from_dict({"prompt": []}, features=datasets.Features({"prompt": datasets.Value("string")})
                               ).to_parquet(str(tmp_path / "empty.parquet"))
    with pytest.raises(ValueError, match="holds no rows|empty"):
        run(_cfg(tiny_target, tmp_path / "empty.parquet", tmp_path / "out2"))


def test_missing_chat_template(tmp_path):
    folder = tmp_path / "model"
    tiny_llama(seed=0).save_pretrained(folder)
    tiny_tokenizer(chat_template=False).save_pretrained(folder)
    prompts = _write_prompts(tmp_path / "p.jsonl", n=2, multi_turn=False)
    with pytest.raises(ValueError, match="use_chat_template=false"):
        run(_cfg(folder, prompts, tmp_path / "out"))
    assert run(_cfg(folder, prompts, tmp_path / "out2", use_chat_template=False))["complete"]


def test_vllm_environment_missing_says_how_to_make_it(tiny_target, tmp_path, monkeypatch):
    """backend=vllm without vLLM's environment: the fix (`make vllm-env`) before any prompt is read;
    backend=auto then falls back to transformers."""
    from specdec import vllm_env

    missing = tmp_path / "no-such-prompts.jsonl"  # the environment is checked first
    with pytest.raises(ValueError, match=r"vllm_python=.*does not exist.*make vllm-env"):
        run(DataConfig(backend="vllm", vllm_python=str(tmp_path / "nowhere" / "python"), prompts=str(missing)))
    monkeypatch.setenv(vllm_env.ENV_VAR, str(tmp_path / "bogus" / "python"))
    monkeypatch.setattr(vllm_env, "_CHECKOUT", tmp_path)  # no .venv-vllm beside this checkout either
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"no Python with vLLM found \(tried .*bogus.*make vllm-env"):
        run(DataConfig(backend="vllm", prompts=str(missing)))
    with pytest.raises(ValueError, match="make vllm-env"):
        gen.VLLMBackend(DataConfig(backend="vllm"), tokenizer=None)
    prompts = _write_prompts(tmp_path / "p.jsonl", n=2, multi_turn=False)
    manifest = run(_cfg(tiny_target, prompts, tmp_path / "out", backend="auto"))
    assert manifest["complete"] and manifest["settings"]["backend"] == "transformers"


def test_cli_entry_point(tiny_target, tmp_path, capsys):
    from specdec.cli import main as cli

    prompts = _write_prompts(tmp_path / "p.jsonl", n=2, multi_turn=False)
    assert cli(["data", f"--target={tiny_target}", "--prompts", str(prompts), f"output_dir={tmp_path / 'o'}",
                "max_new_tokens=3", "dtype=float64"]) == 0
    assert "2 examples" in capsys.readouterr().out
    assert cli(["data", "prompts=nothing.jsonl", f"output_dir={tmp_path / 'x'}"]) == 2
    assert "does not exist" in capsys.readouterr().err


# ---- the embedded prompt set --------------------------------------------------------------------------------


def _norm(text: str) -> str:
    return " ".join(re.findall(r"[a-z0-9']+", text.lower()))


def test_embedded_prompt_files_are_what_the_generator_makes():
    train, heldout = build_prompt_sets()
    assert EMBEDDED_TRAIN_PROMPTS.read_text(encoding="utf-8") == "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in train)
    assert EMBEDDED_HELDOUT_PROMPTS.read_text(encoding="utf-8") == "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in heldout)


def test_embedded_prompt_set_shape():
    train, heldout = read_prompts(EMBEDDED_TRAIN_PROMPTS), read_prompts(EMBEDDED_HELDOUT_PROMPTS)
    kinds = {p.category for p in train}
    assert {"translation", "reading-comprehension", "long-summarisation"} < kinds and len(kinds) >= 16
    assert len(train) == TRAIN_PER_KIND * len(kinds) and len(heldout) == HELDOUT_TOTAL
    assert {p.category for p in heldout} == kinds
    texts = ["\n\n".join(p.turns) for p in train]
    assert len(set(texts)) == len(texts)
    assert not {"\n\n".join(p.turns) for p in heldout} & set(texts)
    train_turns = {_norm(t) for p in train for t in p.turns if len(p.turns) == 1}
    assert not any(_norm(t) in train_turns for p in heldout for t in p.turns)
    assert any(len(p.turns) == 2 for p in train)


def test_a_kind_added_later_changes_no_other_kinds_prompts(tmp_path, monkeypatch):
    """The first kinds share one stream; each later kind has its own: dropping a later kind leaves the others'
    train prompts (and their held-out prompts, up to the held-out share) as they were."""
    train, heldout = build_prompt_sets()
    data = json.loads(prompt_templates.TEMPLATES.read_text(encoding="utf-8"))
    later = [k for k in data["kinds"] if k not in SHARED_STREAM_KINDS]
    assert later and list(data["kinds"])[: len(SHARED_STREAM_KINDS)] == list(SHARED_STREAM_KINDS)
    dropped = later[0]
    del data["kinds"][dropped]
    (tmp_path / "templates.json").write_text(json.dumps(data), encoding="utf-8")
    monkeypatch.setattr(prompt_templates, "TEMPLATES", tmp_path / "templates.json")
    fewer_train, fewer_heldout = build_prompt_sets()
    assert fewer_train == [r for r in train if r["category"] != dropped]
    for kind in data["kinds"]:
        mine = [r for r in heldout if r["category"] == kind]
        theirs = [r for r in fewer_heldout if r["category"] == kind]
        n = min(len(mine), len(theirs))
        assert n >= 11 and mine[:n] == theirs[:n]


@needs_spec_bench
def test_embedded_prompt_set_has_no_spec_bench_text():
    ours = [_norm(t) for f in (EMBEDDED_TRAIN_PROMPTS, EMBEDDED_HELDOUT_PROMPTS) for p in read_prompts(f) for t in p.turns]
    theirs = [_norm(t) for p in read_prompts(SPEC_BENCH) for t in p.turns]

    def grams(text: str, n: int = 8) -> set[tuple[str, ...]]:
        words = text.split()
        return {tuple(words[i: i + n]) for i in range(len(words) - n + 1)}

    assert not set(ours) & set(theirs)
    their_grams = set().union(*(grams(t) for t in theirs))
    shared = [t for t in ours if grams(t) & their_grams]
    assert not shared, shared[:3]


@pytest.mark.slow
def test_embedded_target_rows_match_hf_generate(tmp_path):
    """The real SmolLM2 target: batched data-stage completions equal unbatched transformers greedy decoding."""
    from specdec.models import EMBEDDED_TARGET, load_model, load_tokenizer

    records = [json.loads(line) for line in EMBEDDED_HELDOUT_PROMPTS.read_text().splitlines()[:3]]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = DataConfig(target=EMBEDDED_TARGET, prompts=str(prompts), output_dir=str(tmp_path / "out"), max_new_tokens=8,
                     batch_size=3, device="cpu", dtype="float32", top_logprobs=2)
    assert run(cfg)["complete"]
    model, tok = load_model(EMBEDDED_TARGET, dtype="float32", device="cpu"), load_tokenizer(EMBEDDED_TARGET)
    rows = {r["prompt_id"]: r for r in load_generated(cfg.output_dir)}
    for rec in records:
        ids = torch.tensor([encode_prompt(tok, rec["messages"])])
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                             temperature=None, top_p=None, top_k=None)
        row = rows[rec["prompt_id"]]
        assert row["input_ids"][: row["prompt_length"]] == ids[0].tolist()
        assert row["input_ids"][row["prompt_length"]:] == ref[0, ids.shape[1]:].tolist()
        assert [t[0] for t in row["top_ids"]] == ref[0, ids.shape[1]:].tolist()
