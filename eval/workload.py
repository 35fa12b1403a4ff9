"""The fixed workload of one eval run: the prompts and their token ids, the target and the draft loaded, checked
compatible and sharing what they can, and the CPU kernels calibrated before anything is timed."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from specdec import fast_linear
from specdec.compat import check_compatible
from specdec.draft_registry import check_fits
from specdec.eval.config import EvalConfig
from specdec.eval.verify import _draft_tokenizer, first_turn, resolve_prompts_path
from specdec.models import context_length, load_model, load_tokenizer, resolve_device, share_target_embeddings
from specdec.prompts import Prompt, check_prompt_lengths, encode_prompt, read_prompts
from specdec.tokens import tokenizer_pad_id

log = logging.getLogger(__name__)


@dataclass
class Workload:
    prompts: list[Prompt]
    encoded: list[list[int]]  # token ids per prompt (its first turn, through the chat template when asked)
    target: object
    draft: object
    device: torch.device
    eos: int | list[int] | None
    pad: int
    shared_mb: float  # the draft's input embeddings served by the target's copy

    @property
    def longest(self) -> int:
        return max(map(len, self.encoded))


def encode_workload(cfg: EvalConfig, tokenizer, prompts: list[Prompt]) -> list[list[int]]:
    """Each prompt's token ids (its first turn, through the chat template when asked), none of them empty."""
    encoded = [encode_prompt(tokenizer, first_turn(p.messages), cfg.use_chat_template, cfg.chat_template_kwargs,
                             p.tools) for p in prompts]
    if any(len(e) == 0 for e in encoded):
        raise ValueError("a prompt encodes to zero tokens; remove empty prompts from the file")
    return encoded


def load_workload(cfg: EvalConfig) -> Workload:
    """Everything checked before the first forward: the prompts read and encoded, both models loaded, the draft
    checked against the target, and every prompt's length against both models' contexts."""
    device = resolve_device(cfg.device)
    prompts_path = resolve_prompts_path(cfg.prompts)
    prompts = read_prompts(prompts_path, limit=cfg.num_prompts)
    tokenizer = load_tokenizer(cfg.target)
    encoded = encode_workload(cfg, tokenizer, prompts)
    log.info("loading target %s and draft %s", cfg.target, cfg.draft)
    target = load_model(cfg.target, cfg.dtype, device)
    draft = load_model(cfg.draft, cfg.dtype, device)
    check_fits(draft, target, f"the draft {cfg.draft}", f"the target {cfg.target}")
    check_compatible(tokenizer, _draft_tokenizer(cfg.draft, tokenizer), target, draft)
    check_prompt_lengths(prompts, encoded, cfg.max_new_tokens,
                         {"the target": context_length(target), "the draft": context_length(draft)}, prompts_path)
    shared_mb = share_target_embeddings(target, draft) / 2**20
    if shared_mb:
        log.info("the draft's input embeddings equal the target's: one copy serves both (%.1f MB saved)", shared_mb)
    log.info("measuring the CPU linear kernels for every row count the decoders use (specdec/fast_linear.py)")
    fast_linear.calibrate(target, draft)  # here, so that no timed call below pays for a first measurement
    return Workload(prompts, encoded, target, draft, device, tokenizer.eos_token_id, tokenizer_pad_id(tokenizer),
                    shared_mb)
