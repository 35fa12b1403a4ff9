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
from specdec.kv import Batch, cache_kwarg, forward_cached, forward_masked, keep_path, prefill, rollback
from specdec.sampling import SamplingConfig, next_token, probabilities
from specdec.tokens import pad_id
from specdec.tree import Tree, TreeSpec, describe_round, greedy_walk, grow, sampled_walk, verification_inputs
from specdec.verify import greedy_verify, rejection_verify

log = logging.getLogger(__name__)
GREEDY = SamplingConfig()  # frozen, so safe as a shared default


@dataclass
class DecodeStats:
    """Counts over all rounds and unfinished rows; names as in docs/design.md."""

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
    tree: str | None = None  # the tree shape (specdec/tree.py), None for a chain
    tree_nodes: int = 0  # nodes verified over all rounds (a chain's: proposed)

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
            "tree": self.tree,
            "tree_nodes": self.tree_nodes,
        }


@dataclass
class RoundTrace:
    """One round, per row: what was proposed, how much was accepted, and the target's own token."""

    proposed: torch.Tensor  # [B, k]
    num_accepted: torch.Tensor  # [B]
    next_token: torch.Tensor  # [B] correction (num_accepted < k) or bonus (== k)
    advanced: int  # T + 1 tokens appended to every row


@dataclass
class TreeTrace:
    """One tree round (batch 1): the tree, the accepted path (node indices) and the target's own token."""

    tree: Tree
    path: list[int]
    next_token: int  # correction (no child matched) or bonus (a leaf was reached)
    advanced: int

    def describe(self, decode=str) -> str:
        """The tree, the accepted path (*) and the correction or bonus, as text (`decode`: id -> str)."""
        return describe_round(self.tree, self.path, self.next_token, decode)


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

    def stacked(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if not self.ids:
            return None, None
        return torch.stack(self.ids, dim=1), torch.stack(self.logprobs, dim=1)


def _target_steps(target, cache, batch, sampling, generator, stats, clock, kwarg, top_n=None) -> None:
    """Target-only decoding from the current state until done: the baseline, and the fallback."""
    while not batch.done():
        logits = forward_cached(target, cache, batch, batch.length, 1, kwarg)[:, -1]  # [B, V]
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
    batch = Batch(input_ids, attention_mask, max_new_tokens, 0, eos_token_id, pad_id(pad_token_id, eos_token_id))
    stats, clock, kwarg = DecodeStats(), _Clock(timing, input_ids.device), cache_kwarg(target)
    top_n = _TopN(top_logprobs)
    cache, logits = prefill(target, batch, kwarg)
    stats.target_forwards += 1
    top_n(logits)
    clock.mark(batch.append(next_token(logits, sampling, generator)[:, None]))
    _target_steps(target, cache, batch, sampling, generator, stats, clock, kwarg, top_n)
    top_ids, top_lp = top_n.stacked()
    return GenerateOutput(batch.sequences(), stats, batch.prompt_length, timings=clock.marks,
                          top_ids=top_ids, top_logprobs=top_lp)


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
    tree: TreeSpec | str | None = None,
) -> GenerateOutput:
    """Speculative decoding, exact: greedy output equals `target_generate`'s; sampled output is distributed as p.

    `tree` (a `TreeSpec` or its text, e.g. "3x1x1" or "dyn8") proposes a draft tree each round instead of a
    chain of `num_draft_tokens` (specdec/tree.py); one prompt at a time. A width-1 tree is the chain."""
    spec = TreeSpec.parse(tree) if isinstance(tree, str) else tree
    if spec is not None and spec.is_chain:
        num_draft_tokens, spec = spec.max_depth, None
    k = num_draft_tokens if spec is None else spec.max_depth
    if spec is not None:
        input_ids, attention_mask = _tree_inputs(target, draft, input_ids, attention_mask, spec)
    _check_inputs(target, input_ids, attention_mask, max_new_tokens, k + 1, draft, k)
    batch = Batch(input_ids, attention_mask, max_new_tokens, k + 1, eos_token_id, pad_id(pad_token_id, eos_token_id))
    stats = DecodeStats(num_draft_tokens=k, position_tried=[0] * k, position_accepted=[0] * k,
                        tree=None if spec is None else str(spec))
    clock = _Clock(timing, input_ids.device)
    try:
        drafter = make_drafter(draft, target, sampling)  # before the prefill: it may read the target's forwards
    except Exception as err:  # noqa: BLE001 - any draft failure means target-only, never a failed request
        return _target_only_after(err, target, batch, sampling, generator, stats, clock)
    try:
        if spec is not None:
            return _speculate_tree(target, drafter, batch, spec, sampling, generator, stats, clock, trace)
        return _speculate(target, drafter, batch, k, sampling, generator, stats, clock, trace)
    finally:
        drafter.close()


TREE_ATTENTION = ("eager", "sdpa")  # the implementations that read a 4D tensor mask as given (kv.forward_masked)


def _tree_inputs(target, draft, input_ids, attention_mask, spec: TreeSpec):
    """One prompt, its padding dropped; models whose attention reads the tree's 4D mask."""
    for name, model in (("target", target), ("draft", draft)):
        attention = getattr(model.config, "_attn_implementation", None)
        if isinstance(model, PreTrainedModel) and attention not in TREE_ATTENTION:
            raise ValueError(f"tree decoding passes a 4D attention mask, which {' and '.join(TREE_ATTENTION)} "
                             f"attention read; the {name} uses {attention!r}: load it with "
                             f"attn_implementation='sdpa'")
    if input_ids.dim() == 2 and input_ids.shape[0] > 1:
        raise ValueError(f"tree decoding (tree={spec}) takes one prompt at a time, got a batch of "
                         f"{input_ids.shape[0]}: loop over the prompts, or decode the batch with a chain "
                         f"(num_draft_tokens=k, no tree)")
    if attention_mask is not None and input_ids.dim() == 2 and attention_mask.shape == input_ids.shape:
        input_ids, attention_mask = input_ids[:, attention_mask[0].bool()], None  # one row: drop its padding
    return input_ids, attention_mask


def _begin(target, drafter, batch, sampling, generator, stats, clock):
    """The target's prefill and first token, then the drafter's start: (cache kwarg, target cache, live tokens
    so far (tau counts tokens from rounds only), target vocabulary, the drafter's failure or None)."""
    kwarg = cache_kwarg(target)
    t_cache, logits = prefill(target, batch, kwarg)
    stats.target_forwards += 1
    clock.mark(batch.append(next_token(logits, sampling, generator)[:, None]))
    first_tokens, vocab = batch.live_appended.clone(), target.get_output_embeddings().out_features
    try:
        drafter.start(batch)
    except Exception as err:  # noqa: BLE001 - any draft failure means target-only for the rest
        return kwarg, t_cache, first_tokens, vocab, err
    return kwarg, t_cache, first_tokens, vocab, None


def _speculate(target, drafter, batch, k, sampling, generator, stats, clock, trace) -> GenerateOutput:
    rounds = []
    kwarg, t_cache, first_tokens, vocab, err = _begin(target, drafter, batch, sampling, generator, stats, clock)
    if err is not None:
        return _fall_back(err, target, t_cache, batch, sampling, generator, stats, clock, kwarg, rounds)

    while not batch.done():
        length = batch.length
        k_round = max(1, min(k, batch.max_length - length - 1))  # no proposals past max_new_tokens
        active = ~batch.finished
        try:
            # 1. the draft proposes k tokens.
            drafted, q = drafter.propose(batch, k_round, generator, stats)  # [B, k], [B, k, V] | None
            if int(drafted.min()) < 0 or int(drafted.max()) >= vocab:
                raise RuntimeError("draft proposed token ids outside the target's vocabulary")
        except Exception as err:  # noqa: BLE001
            stats.emitted = int(batch.live_appended - first_tokens)
            return _fall_back(err, target, t_cache, batch, sampling, generator, stats, clock, kwarg, rounds)

        # 2. the target scores [last token, d_1..d_k] in one forward.
        p_logits = forward_cached(target, t_cache, batch, length + k_round, 0, kwarg)  # [B, k+1, V]
        stats.target_forwards += 1
        drafter.observe(length - 1)
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
        rollback(t_cache, batch.length - 1)
        drafter.rollback(batch)
        _count_round(stats, n_active, k_round)
        if trace:
            rounds.append(RoundTrace(drafted, verdict.num_accepted, verdict.next_token, appended))

    stats.emitted = int(batch.live_appended - first_tokens)
    return GenerateOutput(batch.sequences(), stats, batch.prompt_length, rounds, clock.marks)


def _speculate_tree(target, drafter, batch, spec, sampling, generator, stats, clock, trace) -> GenerateOutput:
    """Tree rounds (batch 1): grow the tree, verify it in one target forward, keep the accepted path's KV."""
    rounds, device = [], batch.seq.device
    kwarg, t_cache, first_tokens, vocab, err = _begin(target, drafter, batch, sampling, generator, stats, clock)
    if err is not None:
        return _fall_back(err, target, t_cache, batch, sampling, generator, stats, clock, kwarg, rounds)

    while not batch.done():
        length = batch.length
        depth = max(1, min(spec.max_depth, batch.max_length - length - 1))  # no proposals past max_new_tokens
        try:
            tree = grow(drafter, batch, spec, depth, stats)
            if min(tree.tokens) < 0 or max(tree.tokens) >= vocab:
                raise RuntimeError("draft proposed token ids outside the target's vocabulary")
        except Exception as err:  # noqa: BLE001
            stats.emitted = int(batch.live_appended - first_tokens)
            return _fall_back(err, target, t_cache, batch, sampling, generator, stats, clock, kwarg, rounds)
        ids, positions, allowed = verification_inputs(tree, int(batch.seq[0, length - 1]),
                                                      length - 1 - int(batch.left_pad[0]), length - 1, device)
        p_logits = forward_masked(target, t_cache, ids, positions, allowed, kwarg)[0]  # [1+N, V]
        stats.target_forwards += 1
        if sampling.greedy:
            path, token = greedy_walk(tree, p_logits)
        else:
            path, token = sampled_walk(tree, probabilities(p_logits, sampling), generator)
        drafter.observe(length - 1, keep=[0, *(1 + i for i in path)])
        keep_path(t_cache, length, [length + i for i in path])
        appended = batch.append(torch.tensor([[*(tree.tokens[i] for i in path), token]], device=device))
        clock.mark(appended)
        rollback(t_cache, batch.length - 1)  # a cut at max_new_tokens may have appended less than the path
        drafter.tree_rollback()
        _count_round(stats, [len(path)], depth, nodes=len(tree))
        if trace:
            rounds.append(TreeTrace(tree, path, token, appended))

    stats.emitted = int(batch.live_appended - first_tokens)
    return GenerateOutput(batch.sequences(), stats, batch.prompt_length, rounds, clock.marks)


def _count_round(stats: DecodeStats, n_active: list[int], k: int, nodes: int | None = None) -> None:
    """A round's counts; a tree round counts its depth as k (acceptance = accepted / depth) and its `nodes`."""
    stats.rounds += 1
    stats.row_rounds += len(n_active)
    stats.proposed += k * len(n_active)
    stats.tree_nodes += k * len(n_active) if nodes is None else nodes
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
    rollback(t_cache, batch.length - 1)
    batch.seq[:, batch.length :] = batch.pad_token_id  # clear any proposals written past the end
    _target_steps(target, t_cache, batch, sampling, generator, stats, clock, kwarg)
    return GenerateOutput(batch.sequences(), stats, batch.prompt_length, rounds, clock.marks)


def _target_only_after(err, target, batch, sampling, generator, stats, clock) -> GenerateOutput:
    """The draft could not even be set up: the whole request target-only (rule 7)."""
    kwarg = cache_kwarg(target)
    t_cache, logits = prefill(target, batch, kwarg)
    stats.target_forwards += 1
    clock.mark(batch.append(next_token(logits, sampling, generator)[:, None]))
    return _fall_back(err, target, t_cache, batch, sampling, generator, stats, clock, kwarg, [])
