"""The draft-kind interface: everything specdec asks of a kind of draft, declared in one place.

A kind is an object with the attributes and methods of `DraftKind`, registered by name in specdec/draft_registry.py
(as speculators registers its draft model classes). The decoder, the held-out replay, the loader, the publisher,
the model card and the trainer reach kind-specific behaviour only through it, so adding a kind means writing its
own module and one `register` call. The built-in kinds: plain (specdec/plain_draft.py, any causal LM over the
target's tokenizer) and EAGLE-3 (specdec/eagle3/kind.py).

Training is the other side of a kind, declared in `specdec.train` (train/kinds/base.py: `TrainingKind`: building
the draft, its loss, held-out figures, memory plan, card usage and options) and registered there under the same
name: the core never imports `specdec.train`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass(frozen=True)
class PublishContext:
    """What a publish format may need besides the draft."""

    verifier: Callable[[], str]  # the target as the published config names it (computed only when a format needs it)
    num_draft_tokens: int  # the k the evaluation measured (or the card's default)


class DraftKind(Protocol):
    """A kind of draft (see the module docstring)."""

    name: str  # the registry's key; `draft: NAME` in a recipe builds one (the plain kind takes every other value)
    vllm_method: str  # vLLM's speculative method (speculative_config's "method")
    sglang_algorithm: str  # SGLang's --speculative-algorithm
    formats: tuple[str, ...]  # the checkpoint layouts `specdec publish format=` writes, the default first
    maps_vocabulary: bool  # the serving engines read its reduced vocabulary themselves (no head expansion)

    def recognises(self, config: dict) -> bool:
        """Whether a checkpoint's config.json is a draft of this kind."""

    def owns(self, model: torch.nn.Module) -> bool:
        """Whether a loaded model is a draft of this kind."""

    def needs_snapshot(self, config: dict) -> bool:
        """Whether a Hub checkpoint with this config must be downloaded whole before `load` (its own loader)."""

    def load(self, path: str, dtype: torch.dtype) -> torch.nn.Module:
        """The draft in a local checkpoint folder (or a Hub id the kind's loader resolves itself)."""

    def save(self, model: torch.nn.Module, out_dir, format: str = "", context: PublishContext | None = None,
             state_dict: dict | None = None) -> None:
        """Write the draft to `out_dir` in `format` (one of `formats`; "" = the default); `state_dict` = a gathered
        one (FSDP, DeepSpeed)."""

    def drafter(self, draft: torch.nn.Module, target: torch.nn.Module, sampling) -> Any:
        """The decoder's side of this draft: a specdec.drafter.Drafter, made before the target's prefill."""

    def target_states(self, draft, target, input_ids: torch.Tensor,
                      attention_mask: torch.Tensor) -> torch.Tensor | None:
        """What the draft reads from the target besides the tokens, for `replay_ranks` (None: nothing)."""

    def replay_ranks(self, draft, input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor,
                     steps: int, states: torch.Tensor | None) -> list[list[list[int]]]:
        """The held-out replay's ranks (specdec/replay.py: replay_ranks), computed as the decoder proposes."""

    def draft_forwards(self, proposal) -> int:
        """Draft forwards one round of `proposal` (specdec/proposal.py) costs: its depth for a kind that proposes a
        token a forward (a tree feeds each level's nodes at once); 1 for a block or parallel draft, which proposes
        the whole round in one forward. choose_k's cost model reads it: tau / (forwards c + v(n + 1))."""

    # Optional: `vllm_speculative_config(self, model) -> dict`, the keys this kind adds to vLLM's speculative_config
    # (`model`: the draft's config.json as a dict, what the serving engine knows of it; e.g. the parallel kind's
    # {"parallel_drafting": true}); eval/engine/vllm.py reads it with getattr, so a kind without it adds nothing.

    def card_facts(self, model: torch.nn.Module) -> dict[str, Any]:
        """Facts about this draft its model card's usage section states (train/model_card.py: CardInfo.kind_facts,
        read by the kind's training side), e.g. EAGLE-3's layer ids."""
