"""The decode loops: `target_generate` (the baseline) and `speculative_generate`, sharing prefill and sampling.

One round of speculative decoding, per DESIGN.md:
  1. the draft proposes k tokens autoregressively from its own KV cache (it never re-reads the accepted prefix);
  2. the target scores the last emitted token and the k proposals in one forward;
  3. verification (greedy match or rejection sampling, specdec.verify) gives each row its accepted count n_i
     and its own next token (correction or bonus);
  4. every row advances by T + 1 tokens, T = min_i n_i over unfinished rows; row i's token at position T + 1
     is its own outcome there (its accepted draft token when n_i > T, else its correction or bonus), which
     keeps batched decoding exact (rule 5);
  5. both caches are cut back to the new sequence length in `_rollback`, the only place that discards KV.

Both caches are prefixes of one token buffer `seq`: the target's holds all but the last emitted token, the
draft's may lag one token more (after a full accept it has not seen the k-th proposal); `pending` is what the
draft reads first next round.
"""

from __future__ import annotations

import functools
import inspect
import logging
import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from specdec.fast_linear import fast_linears
from specdec.feature_draft import FeatureRecorder
from specdec.sampling import SamplingConfig, next_token, probabilities, sample_from
from specdec.verify import greedy_verify, rejection_verify
from specdec.vocab import draft_to_target_map

log = logging.getLogger(__name__)
GREEDY = SamplingConfig()  # frozen, so safe as a shared default


@dataclass
class DecodeStats:
    """Counts over all rounds and unfinished rows; names as in DESIGN.md."""

    num_draft_tokens: int = 0
    rounds: int = 0  # verification forwards of the target (batch-wide)
    row_rounds: int = 0  # rounds x rows still generating: the denominator of the per-row means
    proposed: int = 0
    accepted: int = 0
    emitted: int = 0  # tokens appended during rounds (corrections and bonuses included)
    corrections: int = 0
    bonus: int = 0
    target_forwards: int = 0
    draft_forwards: int = 0
    position_tried: list[int] = field(default_factory=list)  # [k] rounds that reached draft position i
    position_accepted: list[int] = field(default_factory=list)  # [k] ... and accepted it
    fallback: bool = False
    fallback_reason: str | None = None

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_accepted_tokens(self) -> float:
        """tau: tokens emitted per round per row, the correction or bonus token included."""
        return self.emitted / self.row_rounds if self.row_rounds else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        """P(draft token i accepted | tokens < i accepted), i = 1..k."""
        return [a / t if t else 0.0 for a, t in zip(self.position_accepted, self.position_tried)]

    def as_dict(self) -> dict:
        return {
            "rounds": self.rounds,
            "proposed": self.proposed,
            "accepted": self.accepted,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_tokens": self.mean_accepted_tokens,
            "per_position_acceptance": self.per_position_acceptance,
            "corrections": self.corrections,
            "bonus": self.bonus,
            "emitted": self.emitted,
            "target_forwards": self.target_forwards,
            "draft_forwards": self.draft_forwards,
            "fallback": self.fallback,
            "fallback_reason": self.fallback_reason,
        }


@dataclass
class RoundTrace:
    """One round, per row: what was proposed, how much was accepted, and the target's own token."""

    proposed: torch.Tensor  # [B, k]
    num_accepted: torch.Tensor  # [B]
    next_token: torch.Tensor  # [B] correction (num_accepted < k) or bonus (== k)
    advanced: int  # T + 1 tokens appended to every row


@dataclass
class GenerateOutput:
    sequences: torch.Tensor  # [B, prompt_len + new] rows padded after their EOS
    stats: DecodeStats
    prompt_length: int
    trace: list[RoundTrace] = field(default_factory=list)
    # (seconds since the call began, tokens appended to each row) after the first token and each step;
    # filled when timing=True (device-synchronised), for TTFT and inter-token latency.
    timings: list[tuple[float, int]] = field(default_factory=list)
    # target_generate(top_logprobs=n): the target's n most likely ids and their log-softmax (raw logits,
    # temperature 1, no warping) at each generated position, [B, new, n]; None otherwise.
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None


class _Batch:
    """The running sequences: a preallocated token buffer, left-padding offsets and finished rows."""

    def __init__(self, input_ids, attention_mask, max_new_tokens, lookahead, eos_token_id, pad_token_id):
        batch, prompt_len = input_ids.shape
        device = input_ids.device
        capacity = prompt_len + max_new_tokens + lookahead
        self.prompt_length = prompt_len
        self.max_length = prompt_len + max_new_tokens
        self.length = prompt_len
        self.seq = torch.full((batch, capacity), pad_token_id, dtype=torch.long, device=device)
        self.seq[:, :prompt_len] = input_ids
        self.pad_token_id = pad_token_id
        if attention_mask is None or bool(attention_mask.all()):
            self.mask = None  # no padding: the models' plain causal path, and no mask to build each step
            self.left_pad = torch.zeros(batch, dtype=torch.long, device=device)
        else:
            self.mask = torch.ones(batch, capacity, dtype=torch.long, device=device)
            self.mask[:, :prompt_len] = attention_mask
            self.left_pad = (attention_mask == 0).sum(dim=1)
        eos = [] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) else eos_token_id
        self.eos = torch.tensor(list(eos), dtype=torch.long, device=device)
        self.finished = torch.zeros(batch, dtype=torch.bool, device=device)
        self.live_appended = torch.zeros((), dtype=torch.long, device=device)
        self.ends = torch.full((batch,), capacity, dtype=torch.long, device=device)  # length at each row's EOS

    def model_inputs(self, start: int, stop: int) -> dict:
        """Positions and attention mask for feeding seq[:, start:stop] after a cache of length `start`."""
        positions = torch.arange(start, stop, device=self.seq.device)[None, :] - self.left_pad[:, None]
        mask = None if self.mask is None else self.mask[:, :stop]
        return {"position_ids": positions.clamp_min(0), "attention_mask": mask}

    def append(self, new: torch.Tensor) -> int:
        """Append [B, m] tokens (cut at max_new_tokens); tokens after a row's EOS become padding."""
        new = new[:, : self.max_length - self.length]
        self.finished_before = self.finished.clone()
        if self.eos.numel():
            is_eos = torch.isin(new, self.eos)
            after_eos = (is_eos.long().cumsum(dim=1) - is_eos.long()) > 0
            new = new.masked_fill(after_eos | self.finished_before[:, None], self.pad_token_id)
            first_eos = is_eos.long().argmax(dim=1)  # [B]
            newly = is_eos.any(dim=1) & ~self.finished_before
            self.ends = torch.where(newly, self.length + first_eos + 1, self.ends)
            self.finished |= newly
        else:
            after_eos = torch.zeros_like(new, dtype=torch.bool)
        # Real tokens appended (not padding after an EOS): an on-device count, read once at the end.
        self.live_appended += (~after_eos).sum(dim=1).masked_fill(self.finished_before, 0).sum()
        m = new.shape[1]
        self.seq[:, self.length : self.length + m] = new
        self.length += m
        return m

    def sequences(self) -> torch.Tensor:
        """The generated batch, cut after the last row's EOS (a round may have appended past it).  [B, S]"""
        width = self.length
        if self.eos.numel() and bool(self.finished.all()):
            width = min(width, int(self.ends.max()))
        return self.seq[:, :width]

    def done(self) -> bool:
        return self.length >= self.max_length or (self.eos.numel() > 0 and bool(self.finished.all()))


def _with_fast_linears(*names: str):
    """Run the decorated decoder with the CPU linear fast path on the named models (specdec/fast_linear.py)."""

    def decorate(fn):
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            bound = signature.bind_partial(*args, **kwargs).arguments
            with fast_linears(*(bound.get(name) for name in names)):
                return fn(*args, **kwargs)

        return wrapper

    return decorate


def cache_kwarg(model) -> str:
    # transformers 5.x renamed `past_key_values` to `cache` in forward(); accept either.
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _forward(model, cache: DynamicCache, batch: _Batch, stop: int, logits_to_keep: int, kwarg: str) -> torch.Tensor:
    """Feed seq[:, cache_len:stop] to `model` and return its last `logits_to_keep` logits.  -> [B, n, V]"""
    start = cache.get_seq_length()
    out = model(
        input_ids=batch.seq[:, start:stop],
        **batch.model_inputs(start, stop),
        **{kwarg: cache},
        use_cache=True,
        logits_to_keep=logits_to_keep,
    )
    return out.logits


def _rollback(cache: DynamicCache, length: int) -> None:
    """Drop cached positions >= length: rejected proposals. The only place KV entries are discarded."""
    excess = cache.get_seq_length() - length
    if excess > 0:
        cache.crop(-excess)


def _check_inputs(target, input_ids, attention_mask, max_new_tokens, lookahead, draft=None, num_draft_tokens=1):
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
        raise ValueError("input_ids must be a LongTensor of shape [batch, prompt_len] (use tokenizer(..., return_tensors='pt'))")
    if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise ValueError("input_ids is empty: give at least one prompt of at least one token")
    if num_draft_tokens < 1:
        raise ValueError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    device = next(target.parameters()).device
    if input_ids.device != device:
        raise ValueError(f"input_ids are on {input_ids.device} but the target is on {device}; move them with .to()")
    if attention_mask is not None:
        if attention_mask.shape != input_ids.shape or attention_mask.device != device:
            raise ValueError("attention_mask must have input_ids' shape and device")
        if bool((attention_mask.sum(dim=1) == 0).any()):
            raise ValueError("a prompt in the batch is empty (its attention_mask is all zeros); drop it")
        if bool((attention_mask[:, 1:] < attention_mask[:, :-1]).any()):
            raise ValueError("prompts must be left-padded (tokenizer.padding_side = 'left'); right padding found")
    if draft is not None:
        d_param = next(draft.parameters())
        t_param = next(target.parameters())
        if d_param.device != t_param.device:
            raise ValueError(f"draft is on {d_param.device} but the target on {t_param.device}; put both on one device")
        if d_param.dtype != t_param.dtype:
            raise ValueError(f"draft dtype {d_param.dtype} differs from the target's {t_param.dtype}; load both in one dtype")
    for model in (target, draft):
        if model is None:
            continue
        limit = getattr(model.config, "max_position_embeddings", None)
        needed = input_ids.shape[1] + max_new_tokens + lookahead
        if limit is not None and needed > limit:
            raise ValueError(
                f"prompt ({input_ids.shape[1]} tokens) + max_new_tokens ({max_new_tokens}) + {lookahead} lookahead "
                f"exceeds the model's context of {limit}; shorten the prompt or lower max_new_tokens"
            )


def _pad_id(pad_token_id, eos_token_id) -> int:
    if pad_token_id is not None:
        return int(pad_token_id)
    if eos_token_id is None:
        return 0
    return int(eos_token_id if isinstance(eos_token_id, int) else eos_token_id[0])


class _Clock:
    """Device-synchronised timestamps, only when asked (a sync per step costs time on GPUs)."""

    def __init__(self, enabled: bool, device: torch.device):
        self.enabled, self.device, self.start, self.marks = enabled, device, time.perf_counter(), []

    def mark(self, tokens: int) -> None:
        if self.enabled:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.marks.append((time.perf_counter() - self.start, tokens))


def _prefill(model, batch: _Batch, kwarg: str) -> tuple[DynamicCache, torch.Tensor]:
    """Run the prompt through `model`; returns its cache and the last position's logits [B, V]."""
    cache = DynamicCache(config=model.config)
    logits = _forward(model, cache, batch, batch.prompt_length, 1, kwarg)
    return cache, logits[:, -1]


class _TopN:
    """Collects the top-n log-probs of each step's logits (the decoding logits: no second forward)."""

    def __init__(self, n: int):
        self.n, self.ids, self.logprobs = n, [], []

    def __call__(self, logits: torch.Tensor) -> None:
        if self.n:
            top = torch.topk(torch.log_softmax(logits.float(), dim=-1), min(self.n, logits.shape[-1]), dim=-1)
            self.ids.append(top.indices)
            self.logprobs.append(top.values)

    def stacked(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if not self.ids:
            return None, None
        return torch.stack(self.ids, dim=1), torch.stack(self.logprobs, dim=1)


def _target_steps(target, cache, batch, sampling, generator, stats, clock, kwarg, top_n=None) -> None:
    """Target-only decoding from the current state until done: the baseline, and the fallback."""
    while not batch.done():
        logits = _forward(target, cache, batch, batch.length, 1, kwarg)[:, -1]  # [B, V]
        stats.target_forwards += 1
        if top_n is not None:
            top_n(logits)
        clock.mark(batch.append(next_token(logits, sampling, generator)[:, None]))


@torch.inference_mode()
@_with_fast_linears("target")
def target_generate(
    target,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    sampling: SamplingConfig = GREEDY,
    max_new_tokens: int = 64,
    eos_token_id: int | list[int] | None = None,
    generator: torch.Generator | None = None,
    pad_token_id: int | None = None,
    timing: bool = False,
    top_logprobs: int = 0,
) -> GenerateOutput:
    """Target-only decoding with a KV cache: the baseline that speculative decoding must match.

    `top_logprobs=n` also keeps the n most likely ids and log-probs at every generated position (the
    distillation teacher signal), taken from the decoding logits themselves.
    """
    _check_inputs(target, input_ids, attention_mask, max_new_tokens, lookahead=0)
    if top_logprobs < 0:
        raise ValueError(f"top_logprobs must be >= 0 (0 = off), got {top_logprobs}")
    batch = _Batch(input_ids, attention_mask, max_new_tokens, 0, eos_token_id, _pad_id(pad_token_id, eos_token_id))
    stats, clock, kwarg = DecodeStats(), _Clock(timing, input_ids.device), cache_kwarg(target)
    top_n = _TopN(top_logprobs)
    cache, logits = _prefill(target, batch, kwarg)
    stats.target_forwards += 1
    top_n(logits)
    clock.mark(batch.append(next_token(logits, sampling, generator)[:, None]))
    _target_steps(target, cache, batch, sampling, generator, stats, clock, kwarg, top_n)
    top_ids, top_lp = top_n.stacked()
    return GenerateOutput(batch.sequences(), stats, batch.prompt_length, timings=clock.marks,
                          top_ids=top_ids, top_logprobs=top_lp)


class _Draft:
    """The draft side of a round: its cache, its vocabulary map, and proposal of k tokens."""

    def __init__(self, draft, target_vocab: int, batch: _Batch, sampling: SamplingConfig):
        self.model, self.sampling = draft, sampling
        self.vocab = target_vocab
        rows = draft.get_output_embeddings().out_features
        id_map = draft_to_target_map(draft)
        if id_map is None and rows < target_vocab:
            id_map = torch.arange(rows)  # a smaller padded vocabulary: the first `rows` ids, q = 0 beyond
        self.rows = rows if id_map is not None else min(rows, target_vocab)
        self.id_map = None if id_map is None else id_map.to(batch.seq.device)
        self.start_cache(batch)

    def start_cache(self, batch: _Batch) -> None:
        self.kwarg = cache_kwarg(self.model)
        self.cache, _ = _prefill(self.model, batch, self.kwarg)

    def rollback(self, batch: _Batch) -> None:
        """After verification: keep what the draft has read of the accepted sequence (it may lag one token)."""
        _rollback(self.cache, min(self.cache.get_seq_length(), batch.length - 1))

    def _pick(self, logits: torch.Tensor, batch: _Batch, generator, qs: list) -> torch.Tensor:
        """The draft's token (target ids) from its last logits [B, n, V_draft]; appends q when sampling."""
        if logits.dim() != 3 or logits.shape[0] != batch.seq.shape[0] or logits.shape[-1] < self.rows:
            raise RuntimeError(f"draft returned logits of shape {tuple(logits.shape)}")
        logits = logits[:, -1, : self.rows]  # [B, V_draft]
        if self.sampling.greedy:
            local = logits.argmax(dim=-1)
        else:
            q_local = probabilities(logits, self.sampling)
            local = sample_from(q_local, generator)
            qs.append(self._to_target_space(q_local))
        return local if self.id_map is None else self.id_map[local]

    def _to_target_space(self, q_local: torch.Tensor) -> torch.Tensor:
        """q over the draft's head -> q over the target's vocabulary, zero outside the draft's ids.  [B, V]"""
        if self.id_map is None:
            return q_local
        q = q_local.new_zeros(q_local.shape[0], self.vocab)
        return q.index_copy_(1, self.id_map, q_local)

    def propose(self, batch: _Batch, k: int, generator, stats: DecodeStats):
        """k draft tokens [B, k] (target ids) and, when sampling, their q [B, k, V]; extends the draft cache."""
        tokens, qs = [], []
        stop = batch.length
        for _ in range(k):
            logits = _forward(self.model, self.cache, batch, stop, 1, self.kwarg)
            stats.draft_forwards += 1
            token = self._pick(logits, batch, generator, qs)
            tokens.append(token)
            # Proposals live in the buffer past the sequence end; verification overwrites what it rejects.
            batch.seq[:, stop] = token
            stop += 1
        return torch.stack(tokens, dim=1), (torch.stack(qs, dim=1) if qs else None)


class _FeatureWindow:
    """The target's features f at the positions the draft has yet to read, [B, n, W] from position `start`.

    Written after each target forward (prompt, then each verification), read once per round; what the draft
    has read is dropped then, since its KV cache holds it: the buffer stays a few positions long instead of
    growing with the sequence (about 2.8 MB less at 300 positions of SmolLM2 with three auxiliary layers)."""

    def __init__(self, prompt_features: torch.Tensor):
        self.start, self.values = 0, prompt_features

    def write(self, position: int, values: torch.Tensor) -> None:
        """f from `position` on (later positions, read with guessed features, are replaced)."""
        self.values = torch.cat([self.values[:, : position - self.start], values], dim=1)

    def read(self, start: int, stop: int) -> torch.Tensor:
        """f at positions start..stop-1; positions before `stop` are then dropped (the next round starts there)."""
        out = self.values[:, start - self.start : stop - self.start]
        self.values, self.start = self.values[:, stop - self.start :], stop
        return out


class _FeatureDraft(_Draft):
    """The drafter of a feature-conditioned draft (specdec/feature_draft.py, EAGLE's scheme).

    Draft position t reads the target's feature f_t and the token x_{t+1}. `features` (a _FeatureWindow) holds
    the target's f for the positions it has yet to read (filled after each target forward). A round starting
    at length L first feeds the positions the draft has not read with true features, up to L - 2, then feeds
    back its own predicted feature for each further proposal. Those guessed positions are dropped afterwards
    (`rollback`): the next round re-reads them with the target's true features.
    """

    def __init__(self, draft, target_vocab: int, batch: _Batch, sampling: SamplingConfig, features: _FeatureWindow):
        self.features = features
        self.round_length = 1
        super().__init__(draft, target_vocab, batch, sampling)

    def start_cache(self, batch: _Batch) -> None:
        self.cache = DynamicCache(config=self.model.config)  # filled by the first round, once f is known

    def rollback(self, batch: _Batch) -> None:
        _rollback(self.cache, self.round_length - 1)  # positions from L - 1 on were read with guessed features

    def propose(self, batch: _Batch, k: int, generator, stats: DecodeStats):
        length = self.round_length = batch.length
        start = self.cache.get_seq_length()
        ids, feats = batch.seq[:, start + 1 : length], self.features.read(start, length - 1)
        inputs = batch.model_inputs(start, length - 1)
        tokens, qs = [], []
        for j in range(k):
            hidden, logits = self.model(ids, feats, cache=self.cache, logits_to_keep=1, **inputs)
            stats.draft_forwards += 1
            token = self._pick(logits, batch, generator, qs)
            tokens.append(token)
            batch.seq[:, length + j] = token
            ids, feats = token[:, None], hidden[:, -1:]
            inputs = batch.model_inputs(length - 1 + j, length + j)
        return torch.stack(tokens, dim=1), (torch.stack(qs, dim=1) if qs else None)


@torch.inference_mode()
@_with_fast_linears("target", "draft")
def speculative_generate(
    target,
    draft,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    num_draft_tokens: int = 4,
    sampling: SamplingConfig = GREEDY,
    max_new_tokens: int = 64,
    eos_token_id: int | list[int] | None = None,
    generator: torch.Generator | None = None,
    pad_token_id: int | None = None,
    timing: bool = False,
    trace: bool = False,
) -> GenerateOutput:
    """Speculative decoding, exact: greedy output equals `target_generate`'s; sampled output is distributed as p."""
    k = num_draft_tokens
    _check_inputs(target, input_ids, attention_mask, max_new_tokens, k + 1, draft, k)
    batch = _Batch(input_ids, attention_mask, max_new_tokens, k + 1, eos_token_id, _pad_id(pad_token_id, eos_token_id))
    stats = DecodeStats(num_draft_tokens=k, position_tried=[0] * k, position_accepted=[0] * k)
    # A feature-conditioned draft reads the target's hidden states: record them from its forwards.
    recorder = FeatureRecorder(target, draft.aux_layers) if getattr(draft, "is_feature_draft", False) else None
    try:
        return _speculate(target, draft, batch, k, sampling, generator, stats, _Clock(timing, input_ids.device),
                          trace, recorder)
    finally:
        if recorder is not None:
            recorder.close()


def _speculate(target, draft, batch, k, sampling, generator, stats, clock, trace, recorder) -> GenerateOutput:
    kwarg, rounds = cache_kwarg(target), []
    t_cache, logits = _prefill(target, batch, kwarg)
    stats.target_forwards += 1
    features = None
    if recorder is not None:  # f of the positions the draft has yet to read, written as the target computes it
        features = _FeatureWindow(recorder.latest)  # `latest` concatenates on each read: read once
    clock.mark(batch.append(next_token(logits, sampling, generator)[:, None]))
    first_tokens = batch.live_appended.clone()  # tau counts tokens from rounds only
    vocab = target.get_output_embeddings().out_features
    try:
        drafter = (_Draft(draft, vocab, batch, sampling) if features is None
                   else _FeatureDraft(draft, vocab, batch, sampling, features))
    except Exception as err:  # noqa: BLE001 - any draft failure means target-only, never a failed request
        return _fall_back(err, target, t_cache, batch, sampling, generator, stats, clock, kwarg, rounds)

    while not batch.done():
        length = batch.length
        k_round = max(1, min(k, batch.max_length - length - 1))  # no proposals past max_new_tokens
        active = ~batch.finished
        try:
            drafted, q = drafter.propose(batch, k_round, generator, stats)  # [B, k], [B, k, V] | None
            if int(drafted.min()) < 0 or int(drafted.max()) >= vocab:
                raise RuntimeError("draft proposed token ids outside the target's vocabulary")
        except Exception as err:  # noqa: BLE001
            stats.emitted = int(batch.live_appended - first_tokens)
            return _fall_back(err, target, t_cache, batch, sampling, generator, stats, clock, kwarg, rounds)

        # 2. the target scores [last token, d_1..d_k] in one forward.
        p_logits = _forward(target, t_cache, batch, length + k_round, 0, kwarg)  # [B, k+1, V]
        stats.target_forwards += 1
        if features is not None:
            features.write(length - 1, recorder.latest)
        # 3. verification.
        if sampling.greedy:
            verdict = greedy_verify(drafted, p_logits)
        else:
            verdict = rejection_verify(drafted, q, probabilities(p_logits, sampling), generator)
        # 4. advance every row by T + 1, each row's token at T + 1 being its own outcome there (rule 5).
        n_host, active_host = torch.stack([verdict.num_accepted, active.long()]).tolist()  # the round's one sync
        n_active = [n for n, a in zip(n_host, active_host) if a]
        t_min = min(n_active)
        own = verdict.next_token
        if t_min < k_round:
            own = torch.where(verdict.num_accepted > t_min, drafted[:, t_min], verdict.next_token)
        new = torch.cat([drafted[:, :t_min], own[:, None]], dim=1)  # [B, T+1]
        appended = batch.append(new)
        clock.mark(appended)
        # 5. roll both caches back to the kept prefix; the draft reads what it has not seen next round.
        _rollback(t_cache, batch.length - 1)
        drafter.rollback(batch)
        _count_round(stats, n_active, k_round)
        if trace:
            rounds.append(RoundTrace(drafted, verdict.num_accepted, verdict.next_token, appended))

    stats.emitted = int(batch.live_appended - first_tokens)
    return GenerateOutput(batch.sequences(), stats, batch.prompt_length, rounds, clock.marks)


def _count_round(stats: DecodeStats, n_active: list[int], k: int) -> None:
    stats.rounds += 1
    stats.row_rounds += len(n_active)
    stats.proposed += k * len(n_active)
    stats.accepted += sum(n_active)
    for n in n_active:
        stats.bonus += n == k
        stats.corrections += n < k
        for i in range(min(n + 1, k)):
            stats.position_tried[i] += 1
            stats.position_accepted[i] += i < n


def _fall_back(err, target, t_cache, batch, sampling, generator, stats, clock, kwarg, rounds) -> GenerateOutput:
    """Finish the request target-only after a draft failure (functional fallback, rule 7)."""
    log.warning("draft failed (%s: %s); finishing this request with the target alone", type(err).__name__, err)
    stats.fallback, stats.fallback_reason = True, f"{type(err).__name__}: {err}"
    _rollback(t_cache, batch.length - 1)
    batch.seq[:, batch.length :] = batch.pad_token_id  # clear any proposals written past the end
    _target_steps(target, t_cache, batch, sampling, generator, stats, clock, kwarg)
    return GenerateOutput(batch.sequences(), stats, batch.prompt_length, rounds, clock.marks)
