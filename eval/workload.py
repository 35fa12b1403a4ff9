"""The fixed workload of one eval run: the prompts and their token ids, the target and the draft loaded, checked
compatible and sharing what they can, and the CPU kernels calibrated before anything is timed."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from specdec import fast_linear
from specdec.compat import check_compatible
from specdec.eval.config import EvalConfig
from specdec.eval.verify import _draft_tokenizer, first_turn, resolve_prompts_path
from specdec.models import load_model, load_tokenizer, resolve_device, share_target_embeddings
from specdec.prompts import Prompt, encode_prompt, read_prompts
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


def load_workload(cfg: EvalConfig) -> Workload:
    device = resolve_device(cfg.device)
    prompts = read_prompts(resolve_prompts_path(cfg.prompts), limit=cfg.num_prompts)
    tokenizer = load_tokenizer(cfg.target)
    log.info("loading target %s and draft %s", cfg.target, cfg.draft)
    target = load_model(cfg.target, cfg.dtype, device)
    draft = load_model(cfg.draft, cfg.dtype, device)
    check_compatible(tokenizer, _draft_tokenizer(cfg.draft, tokenizer), target, draft)
    shared_mb = share_target_embeddings(target, draft) / 2**20
    if shared_mb:
        log.info("the draft's input embeddings equal the target's: one copy serves both (%.1f MB saved)", shared_mb)
    encoded = [encode_prompt(tokenizer, first_turn(p.messages), cfg.use_chat_template) for p in prompts]
    if any(len(e) == 0 for e in encoded):
        raise ValueError("a prompt encodes to zero tokens; remove empty prompts from the file")
    log.info("measuring the CPU linear kernels for every row count the decoders use (specdec/fast_linear.py)")
    fast_linear.calibrate(target, draft)  # here, so that no timed call below pays for a first measurement
    return Workload(prompts, encoded, target, draft, device, tokenizer.eos_token_id, tokenizer_pad_id(tokenizer),
                    shared_mb)
