"""backend=transformers: the target in this process, decoding batches with specdec's target_generate."""

from __future__ import annotations

import logging

import torch

from specdec.decode import target_generate
from specdec.kv import prefill_groups
from specdec.models import load_model
from specdec.sampling import SamplingConfig
from specdec.tokens import cut_at_eos, eos_ids, pad_id
from specdec.train.data.backend import Completion, GenerationBackend
from specdec.train.data.config import DataConfig
from specdec.train.data.target_states import decoded_features, recording_while_decoding

log = logging.getLogger(__name__)


class TransformersBackend(GenerationBackend):
    """Batched, left-padded decoding with specdec's target_generate, which also keeps the top-n log-probs; the
    states, when recorded, come from the decoding's own forwards."""

    def __init__(self, cfg: DataConfig, tokenizer, device=None):
        self.cfg, self.sampling = cfg, cfg.sampling()
        self.prompts_per_call = cfg.batch_size
        self.model = load_model(cfg.target, dtype=cfg.dtype, device=device if device is not None else cfg.device)
        self.device = next(self.model.parameters()).device
        log.info("target %s in %s on %s", cfg.target, self.model.dtype, self.device)
        self.eos = eos_ids(self.model, tokenizer)
        self.pad = pad_id(tokenizer.pad_token_id, self.eos)

    def generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)  # samples where the model runs

    def generate(self, prompts: list[list[int]], generator: torch.Generator,
                 sampling: SamplingConfig | None = None) -> list[Completion]:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, p in enumerate(prompts):
            ids[row, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[row, width - len(p):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        groups = prefill_groups([len(p) for p in prompts]) if self.cfg.grouped_prefill else None
        with recording_while_decoding(self.model, self.cfg.eagle_aux_layer_ids, self.cfg.record_features) as recorder:
            out = target_generate(self.model, ids, mask, sampling=sampling or self.sampling,
                                  max_new_tokens=self.cfg.max_new_tokens, eos_token_id=self.eos or None,
                                  generator=generator, pad_token_id=self.pad, top_logprobs=self.cfg.top_logprobs,
                                  prefill_groups=groups, drop_finished=self.cfg.drop_finished_rows)
        new = out.sequences[:, width:].tolist()
        completions = [Completion(cut_at_eos(row, self.eos)) for row in new]
        if recorder is not None:
            states = decoded_features(recorder, prompts, width, [len(c.tokens) for c in completions], groups,
                                      out.step_rows)
            for comp, features in zip(completions, states):
                comp.features = features
        if self.cfg.top_logprobs:
            # Taken from the decoding logits: a second forward over the sequences would nearly double the cost.
            top_ids, top_lp = out.top_ids.tolist(), out.top_logprobs.tolist()
            for row, comp in enumerate(completions):
                c = len(comp.tokens)
                comp.top_ids, comp.top_logprobs = top_ids[row][:c], top_lp[row][:c]
        return completions
