"""Can this draft propose tokens for this target? Same vocabulary (token -> id) and special tokens."""

from __future__ import annotations

import torch

from specdec.vocab import draft_to_target_map

_SPECIAL = ("eos_token", "bos_token", "unk_token")


def vocab_differences(target_tokenizer, draft_tokenizer, limit: int = 5) -> list[str]:
    """Up to `limit` human-readable differences between two tokenizers' vocabularies and special tokens."""
    diffs: list[str] = []
    t_vocab, d_vocab = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    for token, d_id in sorted(d_vocab.items(), key=lambda kv: kv[1]):
        t_id = t_vocab.get(token)
        if t_id != d_id:
            where = "missing from the target" if t_id is None else f"target id {t_id}"
            diffs.append(f"token {token!r}: draft id {d_id}, {where}")
            if len(diffs) >= limit:
                break
    if len(diffs) < limit and len(t_vocab) != len(d_vocab):
        diffs.append(f"vocabulary sizes differ: target {len(t_vocab)}, draft {len(d_vocab)}")
    for name in _SPECIAL:
        t_tok, d_tok = getattr(target_tokenizer, name, None), getattr(draft_tokenizer, name, None)
        if t_tok != d_tok:
            diffs.append(f"{name}: target {t_tok!r}, draft {d_tok!r}")
    return diffs[: limit + len(_SPECIAL)]


def check_compatible(target_tokenizer, draft_tokenizer, target_model=None, draft_model=None) -> None:
    """Raise ValueError naming the first differences when the draft cannot serve this target.

    The tokenizers must agree exactly. The models may differ in padded vocabulary size (e.g. 151,936 vs
    152,064 rows for one tokenizer), and a reduced-vocabulary draft declares the target ids it covers.
    """
    diffs = vocab_differences(target_tokenizer, draft_tokenizer)
    if diffs:
        raise ValueError(
            "the draft's tokenizer differs from the target's, so its tokens cannot be verified:\n  - "
            + "\n  - ".join(diffs)
            + "\nUse a draft trained with the target's tokenizer (or derive one from the target: specdec train)."
        )
    if target_model is None or draft_model is None:
        return
    t_rows = target_model.get_output_embeddings().out_features
    d_embed = draft_model.get_input_embeddings().num_embeddings
    if d_embed < len(target_tokenizer):
        raise ValueError(
            f"the draft embeds {d_embed} ids but the tokenizer has {len(target_tokenizer)} tokens; "
            "the draft cannot read every target token"
        )
    id_map = draft_to_target_map(draft_model)
    if id_map is not None and int(torch.as_tensor(id_map).max()) >= t_rows:
        raise ValueError(f"the draft's reduced vocabulary names ids beyond the target's {t_rows} logits")
