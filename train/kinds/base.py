"""The training side of a draft kind: everything `specdec train`, its memory plan and `specdec publish`'s model card
ask of a kind, declared in one place (the core side is specdec/draft_kind.py's `DraftKind`).

A training kind is an object with the attributes and methods of `TrainingKind`, registered under the core kind's
name in specdec/train/kinds/__init__.py. The trainer (train/distill.py), the plan (train/plan/memory.py), the
config (train/train_config.py) and the card (train/model_card.py) reach kind-specific behaviour only through it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from specdec.train.plan.kind import KindPlan, PlanContext


@dataclass(frozen=True)
class TrainingFacts:
    """How `specdec train` treats a kind (train/kinds/__init__.py: `check` holds a recipe against these)."""

    teachers: tuple[str, ...] = ("online", "offline", "on_policy")  # the teacher signals it trains with
    lora: bool = True  # may train LoRA adapters
    packing: bool = False  # pack=true keeps packed samples apart (attention, positions, loss)
    reads_target_states: bool = False  # reads the target's hidden states: the target runs in every step
    replicated: bool = False  # trains with DDP only: small enough to replicate, called outside its wrapped forward
    # its loss divides by the step's scored positions (`KindRun.counts`), so a micro-batch may run in slices of
    # rows (slice_tokens) with the same gradient
    row_slices: bool = False
    default_vocab_size: int = 0  # draft_vocab_size=auto over a larger vocabulary (0: the full one)


@dataclass
class KindOptions:
    """The base of a kind's options block: the `train:` keys only that kind reads, each a field with a comment
    (`specdec train --help` prints them), checked in its `__post_init__` with a ValueError that names the key."""


class KindRun(Protocol):
    """One run's draft of this kind, built by `TrainingKind.start`: what the trainer's loop calls."""

    model: torch.nn.Module  # the draft to optimise (a peft model with lora=true)
    # What the loader reads ahead per micro-batch, (rows, batch) -> anything, handed to `loss`; None: nothing
    prefetch: Callable[[dict, dict], Any] | None

    def counts(self, batch: dict) -> torch.Tensor | None:
        """The scored positions of `batch` the loss divides by (summed over the step's processes and micro-batches
        by the trainer); None: each micro-batch's loss is its own mean."""

    def loss(self, model, batch: dict, micro: int, rank: int, prefetched=None,
             denominators: torch.Tensor | None = None) -> torch.Tensor:
        """The loss of micro-batch number `micro` (collated by train/batches.py) on process `rank`."""

    def evaluate(self, model, chunks, gather) -> dict[str, Any]:
        """Held-out figures (train/heldout.py: `heldout_figures`) over `chunks` ((rows, collated batch) pairs),
        merged over processes through `gather` (accelerate's gather_object)."""


class TrainingKind(Protocol):
    """A kind's training side (see the module docstring)."""

    name: str  # the core kind's registry name (specdec/draft_registry.py): `draft: NAME` trains it
    facts: TrainingFacts
    options: type[KindOptions]  # its options block: flat in `train:` or under `train.NAME:`

    def start(self, cfg, target, tokenizer, vocabulary: Callable[[int, int], torch.Tensor], device,
              autocast, folders: list) -> KindRun:
        """Build the draft from the target (None where the kind needs none) and what its loss and held-out figures
        read. `vocabulary(vocab, size)` gives a reduced head's kept target ids; `autocast` is the run's mixed
        precision context; `folders` the data stage's folders (recorded features). Options: `cfg.options`."""

    def plan(self, context: PlanContext) -> KindPlan:
        """Its terms of the memory plan, from the configs alone (train/plan/kind.py)."""

    def card_usage(self, info, k: int) -> list[str]:
        """The model card's "## Usage" section: how the engines run this draft (train/model_card.py's
        `CardInfo`; `info.kind_facts` holds the core kind's `card_facts`; train/card_engines.py writes the
        engines' commands); k: the proposals per round the snippets use."""
