"""Draft construction: derived from the target, from a config, reduced vocabulary, LoRA merge, round trips."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_llama
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from specdec.compat import check_compatible
from specdec.models import load_model, save_model
from specdec.train import draft as draft_lib
from specdec.vocab import draft_to_target_map


def _tied_target(layers: int = 4) -> LlamaForCausalLM:
    torch.manual_seed(3)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=True)
    return LlamaForCausalLM(config).eval()


def test_derived_with_every_layer_is_the_target():
    target = tiny_llama(seed=0, layers=2, dtype=torch.float32)
    derived = draft_lib.derive_draft(target, [0, 1]).eval()
    ids = torch.randint(3, 128, (2, 7))
    assert torch.allclose(derived(ids).logits, target(ids).logits, atol=1e-5)


def test_derived_picks_the_chosen_layers_and_round_trips(tmp_path):
    target = _tied_target(layers=4)
    derived = draft_lib.derive_draft(target, [0, -1])
    assert derived.config.num_hidden_layers == 2
    t_state, d_state = target.state_dict(), derived.state_dict()
    assert torch.equal(d_state["model.layers.1.mlp.up_proj.weight"], t_state["model.layers.3.mlp.up_proj.weight"])
    assert torch.equal(d_state["model.layers.0.self_attn.q_proj.weight"],
                       t_state["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(d_state["model.norm.weight"], t_state["model.norm.weight"])
    # The tied head stays tied to the copied embeddings.
    assert derived.lm_head.weight.data_ptr() == derived.model.embed_tokens.weight.data_ptr()
    derived.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(3, 128, (1, 6))
    assert torch.allclose(again(ids).logits, derived.eval()(ids).logits, atol=1e-6)


@pytest.mark.parametrize("layers", [[], [0, 0], [4], [-5]])
def test_derived_rejects_bad_layer_lists(layers):
    with pytest.raises(ValueError, match="draft_layers"):
        draft_lib.derive_draft(_tied_target(layers=4), layers)


def test_from_config_copies_embeddings_and_checks_hidden_size():
    target = tiny_llama(seed=0, layers=2, dtype=torch.float32)
    model = draft_lib.draft_from_config(target, {"num_hidden_layers": 1, "intermediate_size": 16}, seed=1)
    assert model.config.num_hidden_layers == 1 and model.config.intermediate_size == 16
    assert torch.equal(model.model.embed_tokens.weight, target.model.embed_tokens.weight)
    assert torch.equal(model.lm_head.weight, target.lm_head.weight)
    with pytest.raises(ValueError, match="hidden_size"):
        draft_lib.draft_from_config(target, {"hidden_size": 64})
    with pytest.raises(ValueError, match="not a field"):
        draft_lib.draft_from_config(target, {"no_such_key": 1})


def test_select_vocab_keeps_most_frequent_and_forced_ids():
    rows = [{"input_ids": [5, 5, 9, 7, 7, 7, 3], "prompt_length": 2},  # prompt tokens 5 5 are not counted
            {"input_ids": [4, 9, 9], "prompt_length": 1}]
    counts = draft_lib.completion_token_counts(rows, 12)
    assert counts[9] == 3 and counts[7] == 3 and counts[5] == 0 and counts[3] == 1
    keep = draft_lib.select_vocab(counts, 3, always_keep=[2])
    assert keep.tolist() == [2, 7, 9]
    with pytest.raises(ValueError, match="draft_vocab_size"):
        draft_lib.select_vocab(counts, 13)


def test_completion_coverage_counts_completion_tokens_only():
    rows = [{"input_ids": [5, 5, 9, 7, 7, 7, 3], "prompt_length": 2},  # completion 9 7 7 7 3
            {"input_ids": [4, 9, 9], "prompt_length": 1}]  # completion 9 9
    assert draft_lib.completion_coverage(rows, torch.tensor([7, 9]), 12) == pytest.approx(6 / 7)
    assert draft_lib.completion_coverage(rows, torch.tensor([5]), 12) == 0.0  # prompt tokens are not counted
    assert draft_lib.completion_coverage([{"input_ids": [1, 2], "prompt_length": 2}], torch.tensor([1]), 12) is None


def test_reduced_draft_round_trips_through_save_and_load(tmp_path, tiny_tok):
    target = _tied_target(layers=3)
    derived = draft_lib.derive_draft(target, [0, 2])
    keep = torch.tensor([0, 1, 2, 5, 9, 17, 33, 64, 100])
    draft_lib.reduce_vocab(derived, keep)
    check_compatible(tiny_tok, tiny_tok, target, derived)
    save_model(derived, tiny_tok, tmp_path)
    again = load_model(str(tmp_path), dtype="float32", device="cpu")
    assert torch.equal(draft_to_target_map(again), keep)
    ids = torch.randint(3, 128, (2, 5))
    assert again(ids).logits.shape[-1] == keep.numel()
    assert torch.allclose(again(ids).logits, derived.eval()(ids).logits, atol=1e-6)


def test_lora_merges_into_a_plain_model(tmp_path, tiny_tok):
    target = tiny_llama(seed=0, layers=2, dtype=torch.float32)
    base = draft_lib.derive_draft(target, [0])
    peft_model = draft_lib.add_lora(base, r=4, alpha=8, dropout=0.0, target_modules=["q_proj", "v_proj", "nope"])
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    with torch.no_grad():  # make the adapters non-trivial so that merging matters
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    plain = draft_lib.merged(peft_model)
    assert not hasattr(plain, "peft_config")
    ids = torch.randint(3, 128, (1, 6))
    peft_model.eval()
    assert torch.allclose(plain.eval()(ids).logits, peft_model(ids).logits, atol=1e-5)
    save_model(plain, tiny_tok, tmp_path)
    again = load_model(str(tmp_path), dtype="float32", device="cpu")
    assert torch.allclose(again(ids).logits, plain(ids).logits, atol=1e-5)
    with pytest.raises(ValueError, match="lora_target_modules"):
        draft_lib.add_lora(draft_lib.derive_draft(target, [0]), 4, 8, 0.0, ["nope"])


def test_lora_on_a_reduced_draft_trains_the_new_head():
    target = tiny_llama(seed=0, layers=2, dtype=torch.float32)
    base = draft_lib.reduce_vocab(draft_lib.derive_draft(target, [1]), torch.arange(0, 128, 2))
    peft_model = draft_lib.add_lora(base, r=2, alpha=4, dropout=0.0)
    assert any("lm_head" in n and p.requires_grad for n, p in peft_model.named_parameters())
    plain = draft_lib.merged(peft_model)
    assert torch.equal(draft_to_target_map(plain), torch.arange(0, 128, 2))


def test_build_draft_dispatch(tmp_path):
    target = tiny_llama(seed=0, layers=2, dtype=torch.float32)
    assert draft_lib.build_draft("derived", target, [1]).config.num_hidden_layers == 1
    assert draft_lib.build_draft("scratch", target, config_overrides={"num_hidden_layers": 1}).config.num_hidden_layers == 1
    with pytest.raises(ValueError, match="needs the target"):
        draft_lib.build_draft("derived", None)
    tiny_llama(seed=5, layers=1, dtype=torch.float32).save_pretrained(tmp_path)
    pretrained = draft_lib.build_draft(str(tmp_path), target)
    assert pretrained.training and pretrained.dtype == torch.float32


@pytest.mark.slow
def test_embedded_default_draft_derives_reduces_and_round_trips(tmp_path):
    """The embedded default's draft: SmolLM2-135M layers 0, 1, 29 + an 8192-id head, a plain checkpoint."""
    from specdec.models import EMBEDDED_TARGET, load_tokenizer

    target = load_model(EMBEDDED_TARGET, dtype="float32", device="cpu")
    tok = load_tokenizer(EMBEDDED_TARGET)
    derived = draft_lib.derive_draft(target, [0, 1, 29])
    assert derived.config.num_hidden_layers == 3
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    keep = torch.unique(torch.cat([torch.arange(8192 - ids.numel()), ids.flatten()]))[:8192]
    draft_lib.reduce_vocab(derived, keep)
    check_compatible(tok, tok, target, derived)
    save_model(derived, tok, tmp_path)
    again = load_model(str(tmp_path), dtype="float32", device="cpu")
    assert torch.allclose(again(ids).logits, derived.eval()(ids).logits, atol=1e-5)
    assert torch.equal(draft_to_target_map(again), keep)


def test_an_eagle3_draft_over_a_large_vocabulary_keeps_32k_ids_by_default():
    from specdec.train.distill import TrainConfig

    assert draft_lib.kept_vocab_size(TrainConfig(draft="eagle3"), 128_256) == 32_000
    assert draft_lib.kept_vocab_size(TrainConfig(draft="eagle3"), 4096) == 0  # a small vocabulary stays whole
    assert draft_lib.kept_vocab_size(TrainConfig(draft="derived"), 128_256) == 0  # token-only drafts: full
    assert draft_lib.kept_vocab_size(TrainConfig(draft="eagle3", draft_vocab_size=0), 128_256) == 0
    assert draft_lib.kept_vocab_size(TrainConfig(draft="eagle3", draft_vocab_size=500), 128_256) == 500
    with pytest.raises(ValueError, match="draft_vocab_size"):
        TrainConfig(draft_vocab_size=-2)
