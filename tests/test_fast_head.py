"""The scoped CPU head fast path: same logits as nn.Linear, patched only inside the block, never clobbering."""

import pytest
import torch
from conftest import tiny_llama

from specdec.fast_head import MAX_ROWS, fast_heads, head_forward


@pytest.mark.parametrize("rows", [1, 2, 3, 5, MAX_ROWS, MAX_ROWS + 1, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_head_forward_equals_linear(rows, bias):
    torch.manual_seed(rows)
    head = torch.nn.Linear(24, 300, bias=bias)
    x = torch.randn(1, rows, 24)
    torch.testing.assert_close(head_forward(head, x), head(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(head_forward(head, x[0, :1]), head(x[0, :1]), rtol=1e-5, atol=1e-5)


def test_fast_heads_is_scoped_and_leaves_patched_heads_alone():
    model = tiny_llama(seed=0)
    head = model.get_output_embeddings()
    ids = torch.tensor([[5, 9, 11]])
    ref = model(input_ids=ids).logits
    with fast_heads(model, model):  # the same model twice (draft == target) is patched once
        assert "forward" in head.__dict__
        torch.testing.assert_close(model(input_ids=ids).logits, ref)
    assert "forward" not in head.__dict__

    def wrapped(x):
        return torch.nn.Linear.forward(head, x)

    head.forward = wrapped  # someone else's wrapper (an accelerate hook, a test spy) is kept as is
    with fast_heads(model):
        assert head.forward is wrapped
    assert head.forward is wrapped


def test_fast_heads_skips_other_dtypes():
    model = tiny_llama(seed=0, dtype=torch.bfloat16)
    with fast_heads(model):
        assert "forward" not in model.get_output_embeddings().__dict__


def test_fast_heads_can_be_switched_off(monkeypatch):
    model = tiny_llama(seed=0)
    monkeypatch.setenv("SPECDEC_FAST_HEAD", "0")
    with fast_heads(model):
        assert "forward" not in model.get_output_embeddings().__dict__


def test_the_decoders_use_the_fast_head_and_restore_it(monkeypatch):
    import specdec.fast_head as fh
    from specdec import speculative_generate, target_generate

    calls = []

    def counting(self, x):
        calls.append(x.reshape(-1, x.shape[-1]).shape[0])
        return head_forward(self, x)

    monkeypatch.setattr(fh, "head_forward", counting)
    target, draft = tiny_llama(seed=0), tiny_llama(seed=1, layers=1)
    ids = torch.tensor([[5, 9, 11]])
    ref = target_generate(target=target, input_ids=ids, max_new_tokens=6)  # keywords bind too
    assert len(calls) == 6 and "forward" not in target.get_output_embeddings().__dict__
    calls.clear()
    out = speculative_generate(target, draft, ids, num_draft_tokens=3, max_new_tokens=6)
    assert torch.equal(out.sequences, ref.sequences)
    assert 4 in calls  # a verification forward of k + 1 rows went through the fast head
    assert all("forward" not in m.get_output_embeddings().__dict__ for m in (target, draft))
