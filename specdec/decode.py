"""The decode loops: `target_generate` (the baseline) and `speculative_generate`, sharing prefill and sampling.

One round of speculative decoding, per docs/design.md:
  1. the draft proposes k tokens autoregressively (specdec/drafter.py: one interface for every kind of draft);
  2. the target scores the last emitted token and the k proposals in one forward;
  3. verification (greedy match or rejection sampling, specdec.verify) gives each row its accepted count n_i
     and its own next token (correction or bonus);
  4. every row advances by T + 1 tokens, T = min_i n_i over unfinished rows; row i's token at position T + 1
     is its own outcome there (its accepted draft token when n_i > T, else its correction or bonus), which
     keeps batched decoding exact (rule 5);
  5. both caches are cut back to the kept prefix by `specdec.kv.rollback`, the only place that discards KV.

Both caches are prefixes of one token buffer `seq` (specdec/kv.py): the target's holds all but the last
emitted token; the draft's may lag further, and the drafter reads what it has not seen first next round.
"""

from __future__ import annotations

import functools
import inspect
import logging
import time
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from specdec.draft_registry import make_drafter
from specdec.fast_linear import fast_linears
from specdec.kv import (
    Batch,
    by_row,
    cache_kwarg,
    can_keep_rows,
    forward_cached,
    forward_masked,
    keep_path,
    keep_rows,
    prefill,
    rollback,
)
from specdec.outputs import DecodeStats, GenerateOutput, RoundTrace, TreeTrace
from specdec.proposal import Proposal
from specdec.sampling import SamplingConfig, next_token, probabilities
from specdec.tokens import pad_id
from specdec.tree import TreeSpec, greedy_walk, grow, sampled_walk, verification_inputs
from specdec.verify import greedy_verify, rejection_verify

log = logging.getLogger(__name__)
GREEDY = SamplingConfig()  # frozen, so safe as a shared default
# target_generate(drop_finished=True) narrows its batch once this share of the running rows has finished: the copy
# of the kept rows' cache costs about what a step over the dropped rows would, so dropping in bunches pays at once.
DROP_SHARE = 1 / 8


@dataclass(frozen=True)
class DecodeOptions:
    """How a request decodes, apart from the models, the prompts, the proposal and the random generator: the
    keyword arguments of `target_generate` and `speculative_generate`, as one value the loops read."""

    sampling: SamplingConfig = GREEDY
    max_new_tokens: int = 64
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    timing: bool = False  # device-synchronised marks after each step, for TTFT and inter-token latency
    trace: bool = False  # keep every round (RoundTrace, TreeTrace)


def max_draft_depth(max_new_tokens: int) -> int:
    """The most draft tokens any round can propose within max_new_tokens: the prefill gives the first new token and
    a round of d proposals appends up to d + 1, so d <= max_new_tokens - 2 (at least 1; `_speculate` caps each round
    to what still fits). Positions deeper than this are never tried."""
    return max(1, max_new_tokens - 2)


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


def _check_inputs(target, input_ids, attention_mask, max_new_tokens, draft=None, num_draft_tokens=1):
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
    # No position past prompt + max_new_tokens - 1 is ever fed: a round proposes at most what still fits
    # (`_speculate`), so the proposals need no room of their own beyond max_new_tokens.
    for name, model in (("target", target), ("draft", draft)):
        if model is None:
            continue
        limit = getattr(model.config, "max_position_embeddings", None)
        needed = input_ids.shape[1] + max_new_tokens
        if limit is not None and needed > limit:
            raise ValueError(
                f"prompt ({input_ids.shape[1]} tokens) + max_new_tokens ({max_new_tokens}) exceeds the {name}'s "
                f"context of {limit}; shorten the prompt or lower max_new_tokens"
            )


class _Clock:
    """Device-synchronised timestamps, only when asked (a sync per step costs time on GPUs)."""

    def __init__(self, enabled: bool, device: torch.device):
        self.enabled, self.device, self.start, self.marks = enabled, device, time.perf_counter(), []

    def mark(self, tokens: int) -> None:
        if self.enabled:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.marks.append((time.perf_counter() - self.start, tokens))


class _TopN:
    """Collects the top-n log-probs of each step's logits (the decoding logits: no second forward)."""

    def __init__(self, n: int):
        self.n, self.ids, self.logprobs = n, [], []

    def __call__(self, logits: torch.Tensor) -> None:
        if self.n:
            top = torch.topk(torch.log_softmax(logits.float(), dim=-1), min(self.n, logits.shape[-1]), dim=-1)
            self.ids.append(top.indices)
            self.logprobs.append(top.values)

    def stacked(self, rows: list[torch.Tensor], batch: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """[batch, steps, n] each, `rows[j]` the rows of call j (`by_row`); zeros after a dropped row's EOS."""
        if not self.ids:
            return None, None
        return by_row(self.ids, rows, batch), by_row(self.logprobs, rows, batch)


@dataclass
class _Decoding:
    """One request's state from the prefill to the output, shared by the baseline, the chain and the tree loops
    and the fallback: the models' common bookkeeping lives here, once."""

    target: object
    batch: Batch
    options: DecodeOptions
    generator: torch.Generator | None
    stats: DecodeStats
    clock: _Clock
    kwarg: str = ""
    cache: object = None  # the target's KV cache, after `prefill`
    first_tokens: torch.Tensor | None = None  # live tokens before the first round (tau counts rounds' tokens)
    step_rows: list[torch.Tensor] = field(default_factory=list)  # the rows each `target_steps` step ran
    rounds: list = field(default_factory=list)  # RoundTrace / TreeTrace, when options.trace

    @classmethod
    def new(cls, target, input_ids, attention_mask, options: DecodeOptions, generator, lookahead: int,
            stats: DecodeStats) -> _Decoding:
        pad = pad_id(options.pad_token_id, options.eos_token_id)
        batch = Batch(input_ids, attention_mask, options.max_new_tokens, lookahead, options.eos_token_id, pad)
        return cls(target, batch, options, generator, stats, _Clock(options.timing, input_ids.device))

    def prefill(self, top_n: _TopN | None = None, groups: list[list[int]] | None = None) -> None:
        """The target's prefill (one forward per group of rows with `groups`) and the first token, which comes
        from it."""
        self.kwarg = cache_kwarg(self.target)
        self.cache, logits = prefill(self.target, self.batch, self.kwarg, groups)
        self.stats.target_forwards += 1
        if top_n is not None:
            top_n(logits)
        self.clock.mark(self.batch.append(next_token(logits, self.options.sampling, self.generator)[:, None]))
        self.first_tokens = self.batch.live_appended.clone()

    def target_steps(self, top_n: _TopN | None = None, drop_finished: bool = False) -> None:
        """Target-only decoding from the current state until done: the baseline, and the fallback. With
        `drop_finished`, finished rows leave the batch in bunches (DROP_SHARE); `step_rows` says which rows each
        step ran."""
        batch = self.batch
        drop_finished = drop_finished and can_keep_rows(self.cache)
        while not batch.done():
            if drop_finished and int(batch.finished.sum()) >= max(1, DROP_SHARE * len(batch.rows)):
                keep_rows(self.cache, batch.drop_finished())
            logits = forward_cached(self.target, self.cache, batch, batch.length, 1, self.kwarg)[:, -1]  # [B, V]
            self.stats.target_forwards += 1
            self.step_rows.append(batch.rows)
            if top_n is not None:
                top_n(logits)
            self.clock.mark(batch.append(next_token(logits, self.options.sampling, self.generator)[:, None]))

    def keep(self, appended: int, trace) -> None:
        """After a round appended its tokens: the time mark, the target's cache cut to the kept prefix (a cut at
        max_new_tokens may have appended less than was accepted), the trace."""
        self.clock.mark(appended)
        rollback(self.cache, self.batch.length - 1)
        if self.options.trace:
            self.rounds.append(trace)

    def finish(self) -> GenerateOutput:
        """The output after the last round: tau's numerator counts the tokens the rounds appended."""
        self.stats.emitted = int(self.batch.live_appended - self.first_tokens)
        return self._output()

    def _output(self) -> GenerateOutput:
        return GenerateOutput(self.batch.sequences(), self.stats, self.batch.prompt_length, self.rounds,
                              self.clock.marks)

    def fall_back(self, err: Exception) -> GenerateOutput:
        """Finish the request target-only after a draft failure (functional fallback, rule 7)."""
        log.warning("draft failed (%s: %s); finishing this request with the target alone", type(err).__name__, err)
        self.stats.fallback, self.stats.fallback_reason = True, f"{type(err).__name__}: {err}"
        self.stats.emitted = int(self.batch.live_appended - self.first_tokens)
        rollback(self.cache, self.batch.length - 1)
        self.batch.seq[:, self.batch.length :] = self.batch.pad_token_id  # clear any proposals written past the end
        self.target_steps()
        return self._output()


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
    top_logprobs: int = 0,
    prefill_groups: list[list[int]] | None = None,
    drop_finished: bool = False,
    **options,
) -> GenerateOutput:
    """Target-only decoding with a KV cache: the baseline that speculative decoding must match.

    `top_logprobs=n` also keeps the n most likely ids and log-probs at every generated position (the
    distillation teacher signal), taken from the decoding logits themselves. `prefill_groups` (the data stage's,
    specdec.kv.prefill_groups): the prefill as one forward per group of rows, less padding computed; its rounding
    may differ from the one forward's, so the baseline that speculative decoding is checked against leaves it
    None. `drop_finished` (the data stage's): finished rows leave the running batch, so later steps compute only
    the rows still generating; the output is every row's as without, `step_rows` says which rows each step ran
    (what a recorder of the steps' states needs), and the rounding may differ as with `prefill_groups`.
    `options`: the rest of `DecodeOptions` (pad_token_id, timing).
    """
    settings = DecodeOptions(sampling, max_new_tokens, eos_token_id, **options)
    _check_inputs(target, input_ids, attention_mask, max_new_tokens)
    if top_logprobs < 0:
        raise ValueError(f"top_logprobs must be >= 0 (0 = off), got {top_logprobs}")
    state = _Decoding.new(target, input_ids, attention_mask, settings, generator, 0, DecodeStats())
    top_n = _TopN(top_logprobs)
    state.prefill(top_n, prefill_groups)
    every_row = state.batch.rows
    state.target_steps(top_n, drop_finished)
    top_ids, top_lp = top_n.stacked([every_row, *state.step_rows], input_ids.shape[0])
    return GenerateOutput(state.batch.sequences(), state.stats, state.batch.prompt_length, timings=state.clock.marks,
                          top_ids=top_ids, top_logprobs=top_lp,
                          step_rows=state.step_rows if drop_finished and state.step_rows else None)


@torch.inference_mode()
@_with_fast_linears("target", "draft")
def speculative_generate(
    target,
    draft,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    num_draft_tokens: int | Proposal = 4,
    sampling: SamplingConfig = GREEDY,
    max_new_tokens: int = 64,
    eos_token_id: int | list[int] | None = None,
    generator: torch.Generator | None = None,
    tree: TreeSpec | str | None = None,
    **options,
) -> GenerateOutput:
    """Speculative decoding, exact: greedy output equals `target_generate`'s; sampled output is distributed as p.

    Each round proposes a chain of `num_draft_tokens` (or what a `Proposal` given there says), or with `tree` (a
    shape such as "3x1x1" or "dyn8", or a `TreeSpec`) a draft tree (specdec/tree.py), one prompt at a time; a
    width-1 tree is the chain.
    `options`: the rest of `DecodeOptions` (pad_token_id, timing, trace)."""
    settings = DecodeOptions(sampling, max_new_tokens, eos_token_id, **options)
    proposal = Proposal.of(num_draft_tokens if tree is None else tree)
    if proposal.is_tree:
        input_ids, attention_mask = _tree_inputs(target, draft, input_ids, attention_mask, proposal)
    k = proposal.depth
    _check_inputs(target, input_ids, attention_mask, max_new_tokens, draft, k)
    state = _Decoding.new(target, input_ids, attention_mask, settings, generator, k + 1,
                          DecodeStats.for_proposal(proposal))
    try:
        drafter = make_drafter(draft, target, sampling)  # before the prefill: it may read the target's forwards
    except Exception as err:  # noqa: BLE001 - any draft failure means target-only, never a failed request
        state.prefill()
        return state.fall_back(err)
    try:
        state.prefill()
        try:
            drafter.start(state.batch)
        except Exception as err:  # noqa: BLE001 - any draft failure means target-only for the rest
            return state.fall_back(err)
        if proposal.is_tree:
            return _speculate(state, drafter, proposal, _propose_tree, _verify_tree)
        return _speculate(state, drafter, proposal, _propose_chain, _verify_chain)
    finally:
        drafter.close()


TREE_ATTENTION = ("eager", "sdpa")  # the implementations that read a 4D tensor mask as given (kv.forward_masked)


def _tree_inputs(target, draft, input_ids, attention_mask, proposal: Proposal):
    """One prompt, its padding dropped; models whose attention reads the tree's 4D mask."""
    for name, model in (("target", target), ("draft", draft)):
        attention = getattr(model.config, "_attn_implementation", None)
        if isinstance(model, PreTrainedModel) and attention not in TREE_ATTENTION:
            raise ValueError(f"tree decoding passes a 4D attention mask, which {' and '.join(TREE_ATTENTION)} "
                             f"attention read; the {name} uses {attention!r}: load it with "
                             f"attn_implementation='sdpa'")
    if input_ids.dim() == 2 and input_ids.shape[0] > 1:
        raise ValueError(f"tree decoding (tree={proposal.tree}) takes one prompt at a time, got a batch of "
                         f"{input_ids.shape[0]}: loop over the prompts, or decode the batch with a chain "
                         f"(num_draft_tokens=k, no tree)")
    if attention_mask is not None and input_ids.dim() == 2 and attention_mask.shape == input_ids.shape:
        input_ids, attention_mask = input_ids[:, attention_mask[0].bool()], None  # one row: drop its padding
    return input_ids, attention_mask


def _speculate(state: _Decoding, drafter, proposal: Proposal, propose, verify) -> GenerateOutput:
    """The rounds until done: `propose` (the draft's chain or tree; any failure there means target-only for the
    rest), then `verify` (one target forward, the accepted tokens appended, both caches cut back, counted)."""
    batch, vocab = state.batch, state.target.get_output_embeddings().out_features
    while not batch.done():
        depth = max(1, min(proposal.depth, batch.max_length - batch.length - 1))  # no proposals past max_new_tokens
        try:
            proposed, lowest, highest = propose(state, drafter, proposal, depth)
            if lowest < 0 or highest >= vocab:
                raise RuntimeError("draft proposed token ids outside the target's vocabulary")
        except Exception as err:  # noqa: BLE001
            return state.fall_back(err)
        verify(state, drafter, proposed, depth)
    return state.finish()


def _propose_chain(state: _Decoding, drafter, proposal: Proposal, k: int):
    """1. the draft proposes k tokens: ((drafted [B, k], q [B, k, V] | None), lowest id, highest id)."""
    drafted, q = drafter.propose(state.batch, k, state.generator, state.stats)
    return (drafted, q), int(drafted.min()), int(drafted.max())


def _verify_chain(state: _Decoding, drafter, proposed, k: int) -> None:
    """2.-5. of the module docstring, for a batch of chains."""
    (drafted, q), batch, sampling = proposed, state.batch, state.options.sampling
    length, active = batch.length, ~batch.finished
    # 2. the target scores [last token, d_1..d_k] in one forward.
    p_logits = forward_cached(state.target, state.cache, batch, length + k, 0, state.kwarg)  # [B, k+1, V]
    state.stats.target_forwards += 1
    drafter.observe(length - 1)
    # 3. verification.
    if sampling.greedy:
        verdict = greedy_verify(drafted, p_logits)
    else:
        verdict = rejection_verify(drafted, q, probabilities(p_logits, sampling), state.generator)
    # 4. advance every row by T + 1, each row's token at T + 1 being its own outcome there (rule 5).
    n_host, active_host = torch.stack([verdict.num_accepted, active.long()]).tolist()  # the round's one sync
    n_active = [n for n, a in zip(n_host, active_host) if a]
    t_min = min(n_active)
    own = verdict.next_token
    if t_min < k:
        own = torch.where(verdict.num_accepted > t_min, drafted[:, t_min], verdict.next_token)
    appended = batch.append(torch.cat([drafted[:, :t_min], own[:, None]], dim=1))  # [B, T+1]
    # 5. roll both caches back to the kept prefix; the draft reads what it has not seen next round.
    state.keep(appended, RoundTrace(drafted, verdict.num_accepted, verdict.next_token, appended))
    drafter.rollback(batch)
    state.stats.observe_round(n_active, k)


def _propose_tree(state: _Decoding, drafter, proposal: Proposal, depth: int):
    """The round's tree (batch 1), at most `depth` deep: (tree, lowest id, highest id)."""
    tree = grow(drafter, state.batch, proposal.tree, depth, state.stats)
    return tree, min(tree.tokens), max(tree.tokens)


def _verify_tree(state: _Decoding, drafter, tree, depth: int) -> None:
    """Verify the tree in one target forward with its tree mask, walk it, keep the accepted path's KV."""
    batch, sampling, device = state.batch, state.options.sampling, state.batch.seq.device
    length = batch.length
    ids, positions, allowed = verification_inputs(tree, int(batch.seq[0, length - 1]),
                                                  length - 1 - int(batch.left_pad[0]), length - 1, device)
    p_logits = forward_masked(state.target, state.cache, ids, positions, allowed, state.kwarg)[0]  # [1+N, V]
    state.stats.target_forwards += 1
    if sampling.greedy:
        path, token = greedy_walk(tree, p_logits)
    else:
        path, token = sampled_walk(tree, probabilities(p_logits, sampling), state.generator)
    drafter.observe(length - 1, keep=[0, *(1 + i for i in path)])
    keep_path(state.cache, length, [length + i for i in path])
    appended = batch.append(torch.tensor([[*(tree.tokens[i] for i in path), token]], device=device))
    state.keep(appended, TreeTrace(tree, path, token, appended))
    drafter.tree_rollback()
    state.stats.observe_round([len(path)], depth, nodes=len(tree))
