"""The chunked attention of EAGLE-3's unrolled training-time test (specdec/eagle3/attention.py): equal to the
dense computation it replaces (outputs and gradients), the same `unrolled` outputs, packed documents equal to
each document alone, and what autograd keeps growing linearly in n."""

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_llama
from transformers.models.llama.modeling_llama import repeat_kv

from specdec.eagle3 import Eagle3Draft
from specdec.eagle3 import model as eagle3_model
from specdec.eagle3.attention import unrolled_attention

HEADS, KV_HEADS, DIM = 4, 2, 8
# The softmax runs in float32 whatever the inputs' dtype (as before): float32 rounding, summed in other orders.
TOL = {"rtol": 1e-5, "atol": 1e-6}


def dense_reference(q, first_keys, first_values, diagonal_keys, diagonal_values, valid, document_ids=None,
                    chunk=None):
    """The dense computation `Eagle3Draft.unrolled` made before (all [B, heads, n, n] scores at once), plus the
    document mask."""
    n, step = q.shape[2], len(diagonal_keys) + 1
    rep = q.shape[1] // first_keys.shape[1]
    first_keys, first_values = repeat_kv(first_keys, rep), repeat_kv(first_values, rep)
    scale = 1.0 / math.sqrt(q.shape[-1])
    query_pos = torch.arange(n, device=q.device)[:, None]
    key_pos = torch.arange(n, device=q.device)[None, :]
    allowed = (key_pos <= query_pos - (step - 1))[None, None] & valid[:, None, None, :]
    if document_ids is not None:
        allowed = allowed & (document_ids[:, None, :] == document_ids[:, :, None])[:, None]
    scores = (q @ first_keys.transpose(-1, -2)) * scale  # [B, heads, n, n]
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    shifted_k = [_shift(repeat_kv(dk, rep), step - i) for i, dk in enumerate(diagonal_keys, start=2)]
    shifted_v = [_shift(repeat_kv(dv, rep), step - i) for i, dv in enumerate(diagonal_values, start=2)]
    diag = [(q * sk).sum(-1, keepdim=True) * scale for sk in shifted_k]  # each [B, heads, n, 1]
    reach = [(query_pos >= step - i)[None, None] for i in range(2, step + 1)]
    if document_ids is not None:
        reach = [r & (_shift(document_ids[:, None, :, None], step - i, fill=-1) == document_ids[:, None, :, None])
                 for r, i in zip(reach, range(2, step + 1))]
    diag = [d.masked_fill(~r, torch.finfo(d.dtype).min) for d, r in zip(diag, reach)]
    weights = torch.softmax(torch.cat([scores, *diag], dim=-1).float(), dim=-1).to(q.dtype)
    attended = weights[..., :n] @ first_values
    for j, sv in enumerate(shifted_v):
        attended = attended + weights[..., n + j : n + j + 1] * sv
    return attended


def _shift(x, by: int, fill=0):
    """x at position t - by along dim 2 (`fill` before the start)."""
    return x if by == 0 else F.pad(x[:, :, :-by], (0, 0, by, 0), value=fill)


def random_inputs(batch: int, n: int, steps: int, lengths=None, seed: int = 0, dtype=torch.float64):
    """q and keys/values of `steps` steps (leaves that require grad), and `valid` for right-padded rows."""
    g = torch.Generator().manual_seed(seed)

    def leaf(heads):
        return torch.randn(batch, heads, n, DIM, generator=g, dtype=dtype).requires_grad_()

    q = leaf(HEADS)
    keys = [leaf(KV_HEADS) for _ in range(steps)]
    values = [leaf(KV_HEADS) for _ in range(steps)]
    lengths = lengths or [n] * batch
    valid = torch.arange(n)[None] < torch.tensor(lengths)[:, None]
    return q, keys, values, valid


def both(q, keys, values, valid, docs=None, chunk=None):
    """(chunked, dense) outputs and the gradients of every input under the same random upstream gradient."""
    results = []
    upstream = torch.randn(q.shape, generator=torch.Generator().manual_seed(9), dtype=q.dtype).to(q.device)
    for fn in (unrolled_attention, dense_reference):
        out = fn(q, keys[0], values[0], keys[1:], values[1:], valid, docs, chunk)
        grads = torch.autograd.grad(out, [q, *keys, *values], upstream)
        results.append((out.detach(), grads))
    return results


@pytest.mark.parametrize("n,chunk", [(5, 8), (8, 8), (21, 8), (40, 32), (4, 2)],
                         ids=["n<C", "n=C", "n%C!=0", "n>C", "a chunk without step-1 keys"])
@pytest.mark.parametrize("steps", [1, 2, 3, 4])
def test_chunked_equals_dense_with_gradients(n, chunk, steps):
    q, keys, values, valid = random_inputs(3, n, steps, lengths=[n, max(1, n - 3), min(n, 2)], seed=n + steps)
    (out, grads), (ref, ref_grads) = both(q, keys, values, valid, chunk=chunk)
    torch.testing.assert_close(out, ref, **TOL)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, **TOL)


@pytest.mark.parametrize("steps", [1, 3])
def test_document_ids_restrict_keys_as_a_dense_mask_does(steps):
    n = 19
    q, keys, values, valid = random_inputs(2, n, steps, lengths=[n, 15], seed=steps)
    docs = torch.tensor([[0] * 6 + [1] * 9 + [2] * 4, [5] * 3 + [7] * 16])  # row 1: padding in the last document
    (out, grads), (ref, ref_grads) = both(q, keys, values, valid, docs, chunk=8)
    torch.testing.assert_close(out, ref, **TOL)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, **TOL)


def test_float32_and_default_chunk_equal_dense():
    q, keys, values, valid = random_inputs(2, 300, 3, lengths=[300, 123], dtype=torch.float32)
    (out, grads), (ref, ref_grads) = both(q, keys, values, valid)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_step_one_over_right_padded_rows_is_the_fused_causal_kernel(dtype, device, monkeypatch):
    """Without a chunk, step 1 over right-padded rows without documents runs torch's fused causal attention: equal to
    the dense computation at every real query, gradients included (the loss scores no other), and taken only there."""
    calls = []
    fused = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **k: calls.append(1) or fused(*a, **k))
    q, keys, values, valid = random_inputs(3, 37, 1, lengths=[37, 20, 1], seed=5, dtype=dtype)
    q, keys, values = (t.detach().to(device).requires_grad_() for t in (q, keys[0], values[0]))
    keys, values, valid = [keys], [values], valid.to(device)
    upstream = (torch.randn(q.shape, generator=torch.Generator().manual_seed(9), dtype=dtype).to(device)
                * valid[:, None, :, None])
    results = []
    for fn in (unrolled_attention, dense_reference):
        out = fn(q, keys[0], values[0], [], [], valid)
        results.append((out.detach(), torch.autograd.grad(out, [q, keys[0], values[0]], upstream)))
    (out, grads), (ref, ref_grads) = results
    assert calls == [1]
    tol = TOL if dtype == torch.float64 else {"rtol": 1e-4, "atol": 1e-5}
    real = valid[:, None, :, None].expand_as(out)
    torch.testing.assert_close(out[real], ref[real], **tol)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, **tol)
    # Not taken: a given chunk, a later step, packed documents, or rows that are not right-padded.
    left_padded = valid.flip(1)
    unrolled_attention(q, keys[0], values[0], [], [], valid, chunk=8)
    unrolled_attention(q, keys[0], values[0], [keys[0]], [values[0]], valid)
    unrolled_attention(q, keys[0], values[0], [], [], valid, torch.zeros(3, 37, dtype=torch.long, device=device))
    unrolled_attention(q, keys[0], values[0], [], [], left_padded)
    assert calls == [1]


def test_rows_without_an_allowed_key_stay_finite():
    """Step 1 of an all-padding row, and a padding position whose document holds no real key."""
    q, keys, values, valid = random_inputs(2, 12, 1, lengths=[0, 7])
    docs = torch.tensor([[0] * 12, [0] * 7 + [-1] * 5])  # row 1's padding in a document of its own
    out = unrolled_attention(q, keys[0], values[0], [], [], valid, docs, chunk=5)
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(q.grad).all() and torch.isfinite(keys[0].grad).all()


def saved_bytes(fn, n: int) -> int:
    """Bytes of the distinct storages autograd keeps for backward while `fn` runs on inputs projected from one
    leaf (what a draft's training step keeps). Storages, not tensors: each checkpointed chunk keeps the same
    q, keys and values, which cost their memory once."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, n, 16, generator=g, requires_grad=True)
    weights = [torch.randn(16, h * DIM, generator=g) for h in (HEADS, KV_HEADS, KV_HEADS, KV_HEADS, KV_HEADS)]
    kept = {}

    def pack(t):
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()  # held below: no address reused
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        q, k1, v1, k2, v2 = ((x @ w).view(2, n, -1, DIM).transpose(1, 2) for w in weights)
        out = fn(q, k1, v1, [k2, k2], [v2, v2], torch.ones(2, n, dtype=torch.bool), None, 64)
    out.sum().backward()
    return sum(kept.values())


def test_memory_kept_for_backward_grows_linearly_in_n():
    """Doubling n at most doubles what the chunked attention keeps (plus slack); the dense one quadruples."""
    n = 512
    assert saved_bytes(unrolled_attention, 2 * n) <= 2.2 * saved_bytes(unrolled_attention, n)
    assert saved_bytes(dense_reference, 2 * n) > 3 * saved_bytes(dense_reference, n)  # the test can fail


# ---- Eagle3Draft.unrolled
@pytest.fixture(scope="module")
def small_draft():
    target = tiny_llama(seed=0, layers=4, dtype=torch.float32)
    return target, Eagle3Draft.from_target(target, [1, 2, 3], seed=3)


def draft_inputs(target, batch: int, length: int, lengths, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 128, (batch, length), generator=g)
    mask = (torch.arange(length)[None] < torch.tensor(lengths)[:, None]).long()
    states = torch.randn(batch, length, 3 * target.config.hidden_size, generator=g)
    return ids, mask, states


def test_unrolled_equals_the_dense_implementation_with_gradients(small_draft, monkeypatch):
    target, draft = small_draft
    ids, mask, states = draft_inputs(target, 3, 23, [23, 17, 9], seed=1)

    real = mask[:, 1:].bool()  # draft positions of real tokens: step 1's padding outputs are never read or scored

    def run():
        draft.zero_grad()
        outs = draft.unrolled(ids, states, mask, 3)
        sum((o[real] * (j + 1)).sum() for j, o in enumerate(outs)).backward()
        return [o.detach() for o in outs], {k: p.grad.clone() for k, p in draft.named_parameters() if p.grad is not None}

    outs, grads = run()
    monkeypatch.setattr(eagle3_model, "unrolled_attention", dense_reference)
    ref, ref_grads = run()
    for o, r in zip(outs, ref):
        torch.testing.assert_close(o[real], r[real], rtol=1e-5, atol=1e-5)
    assert "fc.weight" in grads and "midlayer.self_attn.q_proj.weight" in grads  # the gradients reach upstream
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-4, atol=1e-5, msg=name)


def test_a_packed_row_gives_each_document_its_outputs_alone(small_draft):
    target, draft = small_draft
    lengths = (9, 12)
    ids, mask, states = draft_inputs(target, 1, sum(lengths) + 3, [sum(lengths)], seed=2)  # right-padded by 3
    docs = torch.tensor([[0] * lengths[0] + [1] * (lengths[1] + 3)])
    with torch.no_grad():
        packed = draft.unrolled(ids, states, mask, 4, document_ids=docs)
        start = 0
        for length in lengths:
            part = slice(start, start + length)
            alone = draft.unrolled(ids[:, part], states[:, part], mask[:, part], 4)
            # draft position t of the document alone is packed position start + t, for t < length - 1
            for a, p in zip(alone, packed):
                torch.testing.assert_close(p[:, start : start + length - 1], a, rtol=1e-5, atol=1e-6)
            start += length


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_chunked_equals_dense_and_keeps_no_quadratic_memory():
    q, keys, values, valid = random_inputs(2, 130, 3, lengths=[130, 77], dtype=torch.float32)
    cuda = [t.detach().cuda().requires_grad_() for t in [q, *keys, *values]]
    q, keys, values = cuda[0], cuda[1:4], cuda[4:]
    (out, grads), (ref, ref_grads) = both(q, keys, values, valid.cuda(), chunk=32)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)
    n = 4096
    big = [torch.randn(1, h, n, DIM, device="cuda", requires_grad=True) for h in (HEADS, KV_HEADS, KV_HEADS)]
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    unrolled_attention(big[0], big[1], big[2], [], [], torch.ones(1, n, dtype=torch.bool, device="cuda"),
                       chunk=128).sum().backward()
    dense_scores = HEADS * n * n * 4  # bytes of one dense float32 [1, heads, n, n] block
    assert torch.cuda.max_memory_allocated() - before < dense_scores / 4
