"""specdec/kv.py's cache written in place (`PreallocatedLayer`, `new_cache`): every forward over it computes what it
computed over transformers' DynamicCache, bit for bit, through appends, rollbacks, a tree round's `keep_path` and
growth past the capacity it was made for; and the decoders that build it give the same tokens."""

from __future__ import annotations

import torch
from conftest import ragged_prompts, tiny_llama
from transformers import DynamicCache

import specdec.kv as kv
from specdec.decode import speculative_generate, target_generate


def _feed(model, cache, ids: torch.Tensor, start: int) -> torch.Tensor:
    positions = torch.arange(start, start + ids.shape[1])[None].expand(ids.shape[0], -1)
    return model(input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True).logits


def test_appends_rollbacks_paths_and_growth_match_dynamic_cache():
    model = tiny_llama(seed=0)
    ids = torch.randint(3, 128, (2, 40), generator=torch.Generator().manual_seed(0))
    inplace = kv.new_cache(model, capacity=12)  # smaller than what is fed: it must grow
    plain = DynamicCache(config=model.config)
    assert all(isinstance(layer, kv.PreallocatedLayer) for layer in inplace.layers)
    steps = [("feed", 8), ("feed", 3), ("rollback", 9), ("feed", 4), ("path", (9, [10, 12])), ("feed", 1),
             ("feed", 9), ("rollback", 15), ("feed", 6)]
    for what, arg in steps:
        length = inplace.get_seq_length()
        assert length == plain.get_seq_length()
        if what == "feed":
            chunk = ids[:, length: length + arg]
            assert torch.equal(_feed(model, inplace, chunk, length), _feed(model, plain, chunk, length))
        elif what == "rollback":
            kv.rollback(inplace, arg)
            kv.rollback(plain, arg)
        else:
            kv.keep_path(inplace, *arg)
            kv.keep_path(plain, *arg)
        for a, b in zip(inplace.layers, plain.layers):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    assert inplace.layers[0].capacity >= inplace.get_seq_length() > 12


def test_the_decoders_give_the_same_tokens_over_either_cache(monkeypatch):
    target, draft = tiny_llama(seed=0), tiny_llama(seed=1, layers=1)
    ids, mask = ragged_prompts(3, 128, seed=4)
    runs = {}
    for name, make in (("inplace", kv.new_cache),
                       ("dynamic", lambda model, capacity: DynamicCache(config=model.config))):
        monkeypatch.setattr(kv, "new_cache", make)
        base = target_generate(target, ids, mask, max_new_tokens=12, pad_token_id=0, top_logprobs=3)
        spec = speculative_generate(target, draft, ids, mask, num_draft_tokens=3, max_new_tokens=12, pad_token_id=0)
        tree = speculative_generate(target, draft, ids[:1, mask[0].bool()], tree="2x1x1", max_new_tokens=12)
        runs[name] = (base.sequences, base.top_logprobs, spec.sequences, tree.sequences)
    assert all(torch.equal(a, b) for a, b in zip(runs["inplace"], runs["dynamic"]))
    assert torch.equal(runs["inplace"][0], runs["inplace"][2])  # and the speculative output is the target's


def test_prefill_groups_pad_little_and_leave_long_prompts_alone():
    """Longest first; a group grows while its padded positions stay within the slack, and a long prompt goes alone."""
    assert kv.prefill_groups([50, 600, 100, 10, 95, 48]) == [[1], [2, 4], [0, 5], [3]]
    assert kv.prefill_groups([600, 590], slack=2.0) == [[0], [1]]  # at `alone` tokens, no company
    assert kv.prefill_groups([7, 7, 7]) == [[0, 1, 2]]


def test_dropping_finished_rows_decodes_as_running_every_row(monkeypatch):
    """drop_finished=True (the data stage's): rows that ended leave the batch and its cache, and every row's tokens
    and top-n log-probs up to its EOS are those of the batch that ran every row to the end; step_rows names the
    rows each step ran, narrowing as rows end."""
    target = tiny_llama(seed=0)
    ids, mask = ragged_prompts(10, 128, seed=5, min_len=2, max_len=12)
    eos = list(range(3, 40))  # common enough that the rows end at many different steps
    drops = []
    monkeypatch.setattr("specdec.decode.keep_rows", lambda cache, keep: drops.append(len(keep)) or kv.keep_rows(cache, keep))
    every = target_generate(target, ids, mask, max_new_tokens=24, eos_token_id=eos, pad_token_id=0, top_logprobs=4)
    dropped = target_generate(target, ids, mask, max_new_tokens=24, eos_token_id=eos, pad_token_id=0, top_logprobs=4,
                              drop_finished=True)
    assert every.step_rows is None and len(drops) >= 2 and drops == sorted(drops, reverse=True)
    assert [len(r) for r in dropped.step_rows][-1] < ids.shape[0]
    assert all(set(later.tolist()) <= set(earlier.tolist())
               for earlier, later in zip(dropped.step_rows, dropped.step_rows[1:]))
    assert torch.equal(every.sequences, dropped.sequences)
    width = ids.shape[1]
    for row, tokens in enumerate(every.sequences[:, width:].tolist()):
        n = next((j + 1 for j, t in enumerate(tokens) if t in eos), len(tokens))
        assert torch.equal(every.top_ids[row, :n], dropped.top_ids[row, :n])
        torch.testing.assert_close(every.top_logprobs[row, :n], dropped.top_logprobs[row, :n])
        ran = [j for j, rows in enumerate(dropped.step_rows) if row in rows.tolist()]
        assert ran[: n - 1] == list(range(n - 1))  # a row runs every step until its EOS


def test_by_row_puts_each_steps_rows_in_their_places():
    """by_row: steps that ran fewer rows as the decoding went, as one [batch, steps, ...] with zeros after a row
    left."""
    all_rows, kept = torch.arange(3), torch.tensor([0, 2])
    steps = [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([4.0, 5.0, 6.0]), torch.tensor([7.0, 8.0]),
             torch.tensor([9.0, 10.0])]
    out = kv.by_row(steps, [all_rows, all_rows, kept, kept], batch=3)
    assert out.tolist() == [[1.0, 4.0, 7.0, 9.0], [2.0, 5.0, 0.0, 0.0], [3.0, 6.0, 8.0, 10.0]]


def test_a_grouped_prefill_decodes_as_one_forward_does():
    """The prefill as one forward per group (each padded to its own longest prompt, written right-aligned into the
    batch's cache) gives, in float32, the tokens, top-n log-probs and cache entries of one forward over the batch."""
    target = tiny_llama(seed=0)
    ids, mask = ragged_prompts(6, 128, seed=5, min_len=2, max_len=24)
    lengths = mask.sum(dim=1).tolist()
    groups = kv.prefill_groups(lengths, alone=20)
    assert len(groups) > 2 and any(len(g) == 1 for g in groups)
    one = target_generate(target, ids, mask, max_new_tokens=10, pad_token_id=0, top_logprobs=4)
    grouped = target_generate(target, ids, mask, max_new_tokens=10, pad_token_id=0, top_logprobs=4,
                              prefill_groups=groups)
    assert torch.equal(one.sequences, grouped.sequences)
    torch.testing.assert_close(one.top_logprobs, grouped.top_logprobs, atol=1e-5, rtol=1e-5)
    batch = kv.Batch(ids, mask, 4, 1, None, 0)
    whole, _ = kv.prefill(target, batch, "past_key_values")
    parts, _ = kv.prefill(target, batch, "past_key_values", groups)
    real = mask.bool()[:, None, :, None]  # entries at padding are never read (the mask keeps them out)
    for a, b in zip(whole.layers, parts.layers):
        torch.testing.assert_close(a.keys * real, b.keys * real, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a.values * real, b.values * real, atol=1e-5, rtol=1e-5)
