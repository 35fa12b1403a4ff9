"""The scoped CPU linear fast path: same outputs as nn.Linear, kernels chosen by measurement, patched only inside
the block, never clobbering."""

import time

import pytest
import torch
from conftest import tiny_llama

import specdec.fast_linear as fl
from specdec.fast_linear import F_LINEAR, MAX_ROWS, PACKED, calibrate, choose, fast_linears, linear_forward

needs_onednn = pytest.mark.skipif(not fl._packing_available(), reason="this torch build has no oneDNN")


@pytest.fixture(autouse=True)
def fresh_choices(monkeypatch):
    """Each test measures for itself: the process-wide choices and reordered weights are emptied, and restored."""
    monkeypatch.setattr(fl, "_choices", {})
    monkeypatch.setattr(fl, "_packed", {})
    monkeypatch.setattr(fl, "_skipped", set())


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 7, MAX_ROWS])
@pytest.mark.parametrize("bias", [False, True])
def test_every_plan_equals_linear(rows, bias):
    torch.manual_seed(rows)
    layer = torch.nn.Linear(24, 300, bias=bias)
    x = torch.randn(1, rows, 24)
    plans = [F_LINEAR, rows, rows + 1, rows + 4] + ([PACKED] if fl._packing_available() else [])
    for plan in plans:  # F.linear, W @ x^T, padded by one row and by more, oneDNN on the reordered weight
        torch.testing.assert_close(linear_forward(layer, x, plan), layer(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(linear_forward(layer, x[0], plan), layer(x[0]), rtol=1e-5, atol=1e-5)


def test_padded_plans_compute_the_padded_rows(monkeypatch):
    """A padded plan runs the product on `plan` rows, and only the real ones come back."""
    widths, matmul = [], fl._matmul
    monkeypatch.setattr(fl, "_matmul", lambda w, xt: widths.append(xt.shape[-1]) or matmul(w, xt))
    layer = torch.nn.Linear(16, 40)
    x = torch.randn(3, 16)
    out = linear_forward(layer, x, 4)
    assert widths == [4] and out.shape == (3, 40)
    torch.testing.assert_close(out, layer(x), rtol=1e-5, atol=1e-5)


def test_choose_keeps_f_linear_unless_another_clearly_wins():
    assert choose({F_LINEAR: 1.0, 3: 0.5, 4: 0.7}) == 3
    assert choose({F_LINEAR: 1.0, 3: 0.97}) == F_LINEAR  # within the margin: not worth a different kernel
    assert choose({F_LINEAR: 1.0, 3: 1.4}) == F_LINEAR


def _slowed(kernel, seconds):
    def slow(*args):
        time.sleep(seconds)
        return kernel(*args)
    return slow


KERNELS = {"F.linear": "_linear", "W@x^T": "_matmul", "oneDNN packed": "_packed_linear"}


@pytest.mark.parametrize("fast", ["F.linear", "W@x^T", pytest.param("oneDNN packed", marks=needs_onednn)])
def test_the_measured_faster_kernel_is_kept(fast, monkeypatch):
    """With the other kernels made slow the measurement picks this one, at every row count it is asked about."""
    for kernel, name in KERNELS.items():
        if kernel != fast:
            monkeypatch.setattr(fl, name, _slowed(getattr(fl, name), 0.002))
    model = tiny_llama(seed=0).float()  # oneDNN has float32 kernels, not float64
    with torch.inference_mode(), fast_linears(model):
        model(input_ids=torch.tensor([[5, 9, 11]]))  # 3 rows
        model(input_ids=torch.tensor([[5]]))
    kept = {entry["kernel"] for entry in fl.choices()}
    assert {entry["rows"] for entry in fl.choices()} == {1, 3}
    if fast == "W@x^T":  # 1 and 3 rows are odd: padded by a row or not, both run W @ x^T
        assert kept and kept <= {"W@x^T", "W@x^T padded"}
    else:
        assert kept == {fast}
    assert "CPU linear kernels kept" in fl.summary()
    # reordered copies are held for exactly the layers that run on them
    assert (fl.packed_mb(model) > 0) == (fast == "oneDNN packed") and (fl.packed_mb() > 0) == (fast == "oneDNN packed")


@needs_onednn
def test_a_reordered_weight_follows_its_weight():
    """Made again after an in-place change, shared by layers that share the weight, dropped with the weight."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(32, 64)
    x = torch.randn(4, 32)
    with torch.inference_mode():
        before = linear_forward(layer, x, PACKED)
    with torch.no_grad():
        layer.weight.mul_(2)  # as an optimizer step or a load_state_dict would
    with torch.inference_mode():
        after = linear_forward(layer, x, PACKED)
    torch.testing.assert_close(after, layer(x), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(before, after)
    twin = torch.nn.Linear(32, 64)
    twin.weight = layer.weight  # tied, as a draft's lm_head to the target's
    with torch.inference_mode():
        linear_forward(twin, x, PACKED)
    assert len(fl._packed) == 1 and fl.packed_mb(twin) == fl.packed_mb(layer) == 64 * 32 * 4 / 2**20
    del layer, twin
    assert fl._packed == {}


@needs_onednn
def test_the_packed_plan_trains_through_f_linear():
    """oneDNN's op has no backward: with gradients on, the plan computes F.linear, and gradients flow."""
    layer = torch.nn.Linear(8, 4)
    out = linear_forward(layer, torch.randn(3, 8), PACKED)
    out.sum().backward()
    assert layer.weight.grad is not None and fl._packed == {}


@needs_onednn
def test_no_reordered_copies_where_they_would_not_fit(monkeypatch):
    """Copies that would take PACK_SHARE of the available memory or more are never made, even where oneDNN is the
    fastest kernel: that shape runs on another, stays so, and the reports say so; the shapes that fit are packed."""
    for name in ("_linear", "_matmul"):  # oneDNN on the reordered weight wins wherever it is a candidate
        monkeypatch.setattr(fl, name, _slowed(getattr(fl, name), 0.002))
    model = tiny_llama(seed=0, vocab_size=1024).float()  # the head's copies the largest of any shape
    layers = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    head = [m for m in layers if m.out_features == model.config.vocab_size]
    others = [m for m in layers if m not in head]
    available = sum(m.weight.numel() * 4 for m in head) / fl.PACK_SHARE  # too little for the head's, not the rest
    monkeypatch.setattr(fl.psutil, "virtual_memory", lambda: type("Memory", (), {"available": available})())
    fl.calibrate(model, rows=[2, 3])
    assert fl._skipped == {fl._shape_key(head[0])}
    assert not any(id(m.weight) in fl._packed for m in head) and all(id(m.weight) in fl._packed for m in others)
    kernels = {(e["out_features"], e["rows"]): e["kernel"] for e in fl.choices()}
    assert {kernels[(1024, n)] for n in (2, 3)} <= {"W@x^T", "W@x^T padded", "F.linear"}  # refused at each count
    assert {k for (out, _), k in kernels.items() if out != 1024} == {"oneDNN packed"}
    entry = fl.skipped_for_memory()
    assert entry == [{"out_features": 1024, "in_features": model.config.hidden_size, "dtype": "float32",
                      "bias": False}]
    assert "1 layer shapes not reordered" in fl.summary()
    assert "not reordered" in fl.summary(fl.choices(), entry) and "not reordered" not in fl.summary(fl.choices())


def test_float64_layers_are_never_reordered():
    assert PACKED not in fl._candidates(3, torch.float64)


def test_each_shape_and_row_count_is_measured_once(monkeypatch):
    measured, measure = [], fl._measure
    monkeypatch.setattr(fl, "_measure", lambda layers, rows: measured.append((len(layers), rows)) or
                        measure(layers, rows))
    model = tiny_llama(seed=0, layers=3)
    ids = torch.tensor([[5, 9]])
    with torch.inference_mode(), fast_linears(model, model):
        ref = model(input_ids=ids).logits
        model(input_ids=ids)
    with torch.inference_mode(), fast_linears(model):
        torch.testing.assert_close(model(input_ids=ids).logits, ref)
    shapes = {(m.out_features, m.in_features) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    assert len(measured) == len(shapes) and {rows for _, rows in measured} == {2}
    assert sum(count for count, _ in measured) == sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    calibrate(model, rows=[2, MAX_ROWS + 1])  # already known, and beyond MAX_ROWS: nothing new
    assert len(measured) == len(shapes)
    calibrate(model, rows=[4])
    assert len(measured) == 2 * len(shapes)


def test_measuring_leaves_the_global_rng_alone():
    model = tiny_llama(seed=0)
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    calibrate(model, rows=[1, 2, 3])
    assert fl.choices() and torch.equal(torch.rand(3), expected)


def test_a_bad_switch_value_says_what_to_use(monkeypatch):
    monkeypatch.setenv("SPECDEC_FAST_LINEAR", "yes")
    with pytest.raises(ValueError, match="use 1 .* or 0"):
        with fast_linears(tiny_llama(seed=0)):
            pass


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


def test_the_decoders_use_the_fast_path_and_restore_it(monkeypatch):
    from specdec import speculative_generate, target_generate

    calls = []

    def counting(self, x, plan=F_LINEAR):
        calls.append(x.reshape(-1, x.shape[-1]).shape[0])
        return linear_forward(self, x, plan)

    target, draft = tiny_llama(seed=0), tiny_llama(seed=1, layers=1)
    calibrate(target, draft, rows=range(1, 5))  # measured first, so only the decoders' own calls are counted
    monkeypatch.setattr(fl, "linear_forward", counting)
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
