"""The scoped CPU linear fast path: same outputs as nn.Linear, patched only inside the block, never clobbering."""

import pytest
import torch
from conftest import tiny_llama

from specdec.fast_linear import MAX_HEAD_ROWS, MAX_ROWS, PAD_ROWS, fast_linears, linear_forward


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 7, MAX_ROWS, MAX_ROWS + 1, MAX_HEAD_ROWS + 1, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_forward_equals_linear(rows, bias):
    torch.manual_seed(rows)
    layer = torch.nn.Linear(24, 300, bias=bias)
    x = torch.randn(1, rows, 24)
    for max_rows in (MAX_ROWS, MAX_HEAD_ROWS):
        torch.testing.assert_close(linear_forward(layer, x, max_rows), layer(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(linear_forward(layer, x[0, :1], max_rows), layer(x[0, :1]), rtol=1e-5, atol=1e-5)


def _patched(model) -> list[str]:
    return [name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "forward" in m.__dict__]


def test_fast_linears_is_scoped_and_leaves_patched_layers_alone():
    model = tiny_llama(seed=0)
    head = model.get_output_embeddings()
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    ids = torch.tensor([[5, 9, 11]])
    ref = model(input_ids=ids).logits
    with fast_linears(model, model):  # the same model twice (draft == target) is patched once
        assert len(_patched(model)) == len(linears) > 1  # every layer, not only the head
        torch.testing.assert_close(model(input_ids=ids).logits, ref)
    assert _patched(model) == []

    def wrapped(x):
        return torch.nn.Linear.forward(head, x)

    head.forward = wrapped  # someone else's wrapper (an accelerate hook, a test spy) is kept as is
    with fast_linears(model):
        assert head.forward is wrapped
        assert len(_patched(model)) == len(linears)  # the others are patched
    assert head.forward is wrapped and _patched(model) == ["lm_head"]


def test_fast_linears_skips_other_dtypes():
    model = tiny_llama(seed=0, dtype=torch.bfloat16)
    with fast_linears(model):
        assert _patched(model) == []


def test_fast_linears_can_be_switched_off(monkeypatch):
    model = tiny_llama(seed=0)
    monkeypatch.setenv("SPECDEC_FAST_LINEAR", "0")
    with fast_linears(model):
        assert _patched(model) == []


def test_the_head_keeps_more_rows_on_the_fast_path(monkeypatch):
    import specdec.fast_linear as fl

    limits = {}

    def recording(self, x, max_rows):
        limits[self] = max_rows
        return torch.nn.functional.linear(x, self.weight, self.bias)

    monkeypatch.setattr(fl, "linear_forward", recording)
    model = tiny_llama(seed=0)
    with fast_linears(model):
        model(input_ids=torch.tensor([[5, 9]]))
    assert limits.pop(model.get_output_embeddings()) == MAX_HEAD_ROWS
    assert limits and set(limits.values()) == {MAX_ROWS}


def test_the_decoders_use_the_fast_path_and_restore_it(monkeypatch):
    import specdec.fast_linear as fl
    from specdec import speculative_generate, target_generate

    calls = []

    def counting(self, x, max_rows):
        calls.append(x.reshape(-1, x.shape[-1]).shape[0])
        return linear_forward(self, x, max_rows)

    monkeypatch.setattr(fl, "linear_forward", counting)
    target, draft = tiny_llama(seed=0), tiny_llama(seed=1, layers=1)
    ids = torch.tensor([[5, 9, 11]])
    linears = [m for m in target.modules() if isinstance(m, torch.nn.Linear)]
    ref = target_generate(target=target, input_ids=ids, max_new_tokens=6)  # keywords bind too
    assert len(linears) > 1 and len(calls) == 6 * len(linears)  # prefill + 5 steps, through every layer
    assert _patched(target) == []
    calls.clear()
    out = speculative_generate(target, draft, ids, num_draft_tokens=3, max_new_tokens=6)
    assert torch.equal(out.sequences, ref.sequences)
    assert 4 in calls  # a verification forward of k + 1 rows went through the fast path
    assert _patched(target) == [] and _patched(draft) == []


@pytest.mark.parametrize("rows", [1, 3, 7])
def test_slow_row_counts_are_computed_padded_to_the_next_even_one(rows, monkeypatch):
    """1, 3 and 7 rows take a slower BLAS kernel than 2, 4 and 8 (PAD_ROWS): the product runs on the padded
    rows, and only the real ones come back."""
    widths, matmul = [], torch.matmul

    def recording(a, b):
        widths.append(b.shape[-1])
        return matmul(a, b)

    monkeypatch.setattr(torch, "matmul", recording)
    layer = torch.nn.Linear(16, 40)
    x = torch.randn(rows, 16)
    out = linear_forward(layer, x)
    assert widths == [PAD_ROWS[rows]] and out.shape == (rows, 40)
    torch.testing.assert_close(out, torch.nn.functional.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
