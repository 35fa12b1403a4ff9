"""`specdec verify`: is speculative sampling distributed exactly as the target? (docs/design.md rule 2)

Default run: a seeded tiny target/draft pair over a small vocabulary, built in-process. The first m generated
tokens are sampled many times in both modes (speculative and target-only, batched by repeating the prompt, plus
a batch-1 run) and compared with the target's exact distribution over those m tokens, enumerated with the same
warped probabilities the decoder uses (`specdec.sampling.probabilities`). With m = 4 and k = 2 the first round
proposes two tokens, so acceptance at positions 1 and 2, the residual and the bonus token are all exercised.

On a user's pair (`--target T --draft D --prompts FILE`) the joint of the first two tokens is tested: the first
comes from the target's prefill, the second from the first speculative round (k = 1 there, the last position
before max_new_tokens), and its exact law p(t1) p(t2 | t1) is computed for the most likely first tokens.

Each comparison is a chi-square test (cells with expected count < 5 pooled) and a total variation (TV) distance:
a test passes when p >= alpha and TV <= E[TV under the null] bound + sqrt(ln(1/delta) / 2N), both fixed before
sampling: 0.5 * sum sqrt(p (1 - p) / N) bounds the mean TV of an exact sampler, McDiarmid the deviation.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdec.compat import check_compatible
from specdec.decode import speculative_generate, target_generate
from specdec.draft_registry import check_fits
from specdec.models import context_length, load_model, load_tokenizer
from specdec.prompts import check_prompt_lengths, encode_prompt, read_prompts
from specdec.sampling import SamplingConfig, probabilities

log = logging.getLogger(__name__)

MIN_EXPECTED = 5.0
TV_DELTA = 1e-3


# ---------------------------------------------------------------- statistics (pure)


def chi2_sf(statistic: float, dof: int) -> float:
    """Survival function of the chi-square distribution: P(X >= statistic), X ~ chi2(dof)."""
    if dof <= 0:
        return 1.0
    x = torch.tensor(statistic / 2.0, dtype=torch.float64)
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), x))


def pool_cells(expected: torch.Tensor, *observed: torch.Tensor, min_expected: float = MIN_EXPECTED):
    """Merge every cell with expected count < min_expected into one cell (and that one into the smallest kept
    cell if it is still too small).  expected [C], observed [C] each -> same, fewer cells."""
    small = expected < min_expected
    if not bool(small.any()):
        return (expected, *observed)
    keep = ~small
    pooled_e = torch.cat([expected[keep], expected[small].sum()[None]])
    pooled_o = [torch.cat([o[keep], o[small].sum()[None]]) for o in observed]
    if pooled_e[-1] < min_expected and pooled_e.numel() > 1:
        j = int(pooled_e[:-1].argmin())
        pooled_e[j] += pooled_e[-1]
        pooled_e = pooled_e[:-1]
        for i, o in enumerate(pooled_o):
            o[j] += o[-1]
            pooled_o[i] = o[:-1]
    return (pooled_e, *pooled_o)


def tv_tolerance(probs: torch.Tensor, samples: int, delta: float = TV_DELTA) -> float:
    """Bound on the TV distance between an exact sampler's empirical law and the truth, exceeded w.p. <= delta."""
    probs = probs.double()
    mean_bound = 0.5 * float((probs * (1 - probs) / samples).clamp_min(0).sqrt().sum())
    return mean_bound + math.sqrt(math.log(1.0 / delta) / (2.0 * samples))


def goodness_of_fit(counts: torch.Tensor, probs: torch.Tensor) -> dict:
    """Chi-square goodness of fit and TV distance of observed counts [C] against exact probabilities [C]."""
    counts, probs = counts.double(), probs.double().clamp_min(0)
    n = int(counts.sum())
    if n == 0:
        raise ValueError("no samples to test")
    outside = float(counts[probs == 0].sum())  # a sample where the target has no mass is a hard failure
    probs = probs / probs.sum()
    expected, observed, pooled_p = pool_cells(probs * n, counts, probs)
    statistic = float(((observed - expected) ** 2 / expected.clamp_min(1e-300)).sum())
    dof = expected.numel() - 1
    tv = 0.5 * float((observed / n - pooled_p).abs().sum())
    return {
        "samples": n, "cells": int(dof + 1), "chi2": statistic, "dof": dof,
        "p_value": 0.0 if outside else chi2_sf(statistic, dof),
        "tv": tv, "tv_tolerance": tv_tolerance(pooled_p, n), "impossible_samples": int(outside),
    }


def homogeneity(counts_a: torch.Tensor, counts_b: torch.Tensor) -> dict:
    """Two-sample chi-square test that two count vectors [C] come from one distribution, and their TV distance."""
    a, b = counts_a.double(), counts_b.double()
    n_a, n_b = float(a.sum()), float(b.sum())
    if n_a == 0 or n_b == 0:
        raise ValueError("no samples to test")
    pooled = (a + b) / (n_a + n_b)
    e_a, o_a, o_b, p = pool_cells(pooled * min(n_a, n_b), a, b, pooled)
    e_a, e_b = p * n_a, p * n_b
    statistic = float(((o_a - e_a) ** 2 / e_a).sum() + ((o_b - e_b) ** 2 / e_b).sum())
    dof = p.numel() - 1
    tv = 0.5 * float((o_a / n_a - o_b / n_b).abs().sum())
    # Each empirical law deviates from the common one by the one-sample bound; TV between them by their sum.
    tolerance = tv_tolerance(p, int(n_a), TV_DELTA / 2) + tv_tolerance(p, int(n_b), TV_DELTA / 2)
    return {"samples": int(n_a + n_b), "cells": int(dof + 1), "chi2": statistic, "dof": dof,
            "p_value": chi2_sf(statistic, dof), "tv": tv, "tv_tolerance": tolerance, "impossible_samples": 0}


def judge(result: dict, alpha: float) -> dict:
    """Add `passed` (p >= alpha and TV <= tolerance) to a test result."""
    result["passed"] = bool(result["p_value"] >= alpha and result["tv"] <= result["tv_tolerance"])
    return result


# ---------------------------------------------------------------- exact distributions and sampling


def _last_probs(model, input_ids: torch.Tensor, sampling: SamplingConfig, chunk: int = 4096) -> torch.Tensor:
    """Warped next-token probabilities after each row of input_ids (no cache).  [R, L] -> [R, V] float64"""
    out = []
    with torch.inference_mode():
        for i in range(0, input_ids.shape[0], chunk):
            logits = model(input_ids=input_ids[i: i + chunk], logits_to_keep=1).logits[:, -1]
            out.append(probabilities(logits, sampling).double())
    return torch.cat(out)


def exact_joint(target, prompt: torch.Tensor, num_tokens: int, sampling: SamplingConfig) -> torch.Tensor:
    """The target's exact law of its next `num_tokens` tokens, by enumeration.  prompt [L] -> [V ** m]

    Cell index = sum_i t_i * V ** (m - 1 - i) (t_1 most significant).
    """
    vocab = target.get_output_embeddings().out_features
    joint = torch.ones(1, dtype=torch.float64, device=prompt.device)
    prefixes = torch.empty(1, 0, dtype=torch.long, device=prompt.device)
    for _ in range(num_tokens):
        rows = torch.cat([prompt[None].expand(prefixes.shape[0], -1), prefixes], dim=1)
        joint = (joint[:, None] * _last_probs(target, rows, sampling)).reshape(-1)
        ext = torch.arange(vocab, device=prompt.device)
        prefixes = torch.cat([prefixes.repeat_interleave(vocab, 0), ext.repeat(prefixes.shape[0])[:, None]], dim=1)
    return joint


def _encode(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """Rows of m tokens -> cell indices (t_1 most significant).  [N, m] -> [N]"""
    code = torch.zeros(tokens.shape[0], dtype=torch.long, device=tokens.device)
    for i in range(tokens.shape[1]):
        code = code * vocab + tokens[:, i]
    return code


def sample_tokens(
    mode: str, target, draft, prompt: torch.Tensor, num_tokens: int, sampling: SamplingConfig, k: int,
    samples: int, batch_size: int, generator: torch.Generator,
) -> torch.Tensor:
    """`samples` draws of the first `num_tokens` generated tokens, `batch_size` rows per decoder call.  -> [N, m]"""
    out, done = [], 0
    while done < samples:
        rows = min(batch_size, samples - done)
        ids = prompt[None].expand(rows, -1).contiguous()
        if mode == "speculative":
            res = speculative_generate(target, draft, ids, num_draft_tokens=k, sampling=sampling,
                                       max_new_tokens=num_tokens, generator=generator)
        else:
            res = target_generate(target, ids, sampling=sampling, max_new_tokens=num_tokens, generator=generator)
        out.append(res.sequences[:, res.prompt_length:])
        done += rows
    return torch.cat(out)


# ---------------------------------------------------------------- the two checks


def tiny_pair(vocab_size: int = 16, seed: int = 0, head_scale: float = 30.0, draft_noise: float = 0.7):
    """A seeded tiny Llama target and a draft that agrees with it partly (its weights, perturbed)."""

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         bos_token_id=None, eos_token_id=None, pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(seed)
    target = LlamaForCausalLM(config).eval()
    draft = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        draft.load_state_dict(target.state_dict())
        g = torch.Generator().manual_seed(seed + 1)
        # Random init gives near-uniform logits: a larger head makes p peaked, and noise on the draft's head
        # makes q differ from p so that rejections, residual samples and bonus tokens all happen.
        target.lm_head.weight.mul_(head_scale)
        draft.lm_head.weight.mul_(head_scale)
        w = draft.lm_head.weight
        w.add_(draft_noise * w.std() * torch.randn(w.shape, generator=g, dtype=w.dtype))
    return target, draft


def check_tiny(
    settings: list[SamplingConfig], batch_sizes: list[int], samples: int, samples_batch1: int,
    num_tokens: int = 4, k: int = 2, vocab_size: int = 16, alpha: float = 1e-3, seed: int = 0,
) -> dict:
    """The default check: both modes against the exact law of the first `num_tokens` tokens, and each other."""
    target, draft = tiny_pair(vocab_size, seed)
    prompt = torch.randint(1, vocab_size, (5,), generator=torch.Generator().manual_seed(seed))
    tests = []
    for sampling in settings:
        exact = exact_joint(target, prompt, num_tokens, sampling)
        cells = exact.numel()
        for b in batch_sizes:
            n = samples_batch1 if b == 1 else samples
            g = torch.Generator().manual_seed(seed + 7)
            # Batch 1 is slow per sample (one decoder call each): only the speculative side, against the truth.
            modes = ("speculative",) if b == 1 else ("speculative", "target-only")
            counts = {}
            for mode in modes:
                toks = sample_tokens(mode, target, draft, prompt, num_tokens, sampling, k, n, b, g)
                counts[mode] = torch.bincount(_encode(toks, vocab_size), minlength=cells)
            label = _setting_label(sampling)
            results = [("speculative vs exact", goodness_of_fit(counts["speculative"], exact))]
            if "target-only" in counts:
                results += [
                    ("target-only vs exact", goodness_of_fit(counts["target-only"], exact)),
                    ("speculative vs target-only", homogeneity(counts["speculative"], counts["target-only"])),
                ]
            for name, res in results:
                tests.append(judge({"test": name, "sampling": label, "batch_size": b, **res}, alpha))
    return {"pair": f"tiny (vocab {vocab_size}, seed {seed})", "num_tokens": num_tokens, "num_draft_tokens": k,
            "alpha": alpha, "tests": tests, "passed": all(t["passed"] for t in tests)}


def check_pair(
    target, draft, prompts: list[list[int]], sampling: SamplingConfig, samples: int, batch_size: int,
    k: int = 1, alpha: float = 1e-3, seed: int = 0, max_first: int = 16, coverage: float = 0.99,
    label: str = "user pair",
) -> dict:
    """A user's pair: joint law of the first two generated tokens, per prompt, against the exact one."""
    device = next(target.parameters()).device
    vocab = target.get_output_embeddings().out_features
    g = torch.Generator(device=device).manual_seed(seed)
    tests = []
    for i, ids in enumerate(prompts):
        prompt = torch.tensor(ids, dtype=torch.long, device=device)
        p1 = _last_probs(target, prompt[None], sampling)[0]  # [V]
        # The tested first tokens are fixed from the exact law, before sampling: the likeliest up to `coverage`.
        order = p1.argsort(descending=True)
        n_first = int((p1[order].cumsum(0) < coverage).sum()) + 1
        first = order[: min(max_first, n_first)]
        rows = torch.cat([prompt[None].expand(first.numel(), -1), first[:, None]], dim=1)
        p2 = _last_probs(target, rows, sampling)  # [G, V]
        exact = torch.cat([(p1[first, None] * p2).reshape(-1), (1 - p1[first].sum()).clamp_min(0)[None]])
        toks = sample_tokens("speculative", target, draft, prompt, 2, sampling, k, samples, batch_size, g)
        slot = torch.full((vocab,), -1, dtype=torch.long, device=device)
        slot[first] = torch.arange(first.numel(), device=device)
        s = slot[toks[:, 0]]
        cell = torch.where(s >= 0, s * vocab + toks[:, 1], torch.full_like(s, first.numel() * vocab))
        counts = torch.bincount(cell, minlength=exact.numel()).cpu()
        res = goodness_of_fit(counts, exact.cpu())
        tests.append(judge({"test": f"speculative vs exact, prompt {i}", "sampling": _setting_label(sampling),
                            "batch_size": batch_size, **res}, alpha))
    return {"pair": label, "num_tokens": 2, "num_draft_tokens": 1, "alpha": alpha, "tests": tests,
            "passed": all(t["passed"] for t in tests)}


def _setting_label(s: SamplingConfig) -> str:
    return f"T={s.temperature:g} top_k={s.top_k} top_p={s.top_p:g}"


def format_result(result: dict, seconds: float | None = None) -> str:
    """A fixed-width table of the tests and the overall verdict."""
    lines = [f"specdec verify: {result['pair']}, first {result['num_tokens']} generated tokens, "
             f"alpha = {result['alpha']:g}"]
    head = f"{'test':<34} {'sampling':<24} {'batch':>5} {'N':>7} {'cells':>6} {'chi2':>9} {'p':>8} {'TV':>7} {'TV max':>7}  ok"
    lines += [head, "-" * len(head)]
    for t in result["tests"]:
        lines.append(f"{t['test']:<34} {t['sampling']:<24} {t['batch_size']:>5} {t['samples']:>7} {t['cells']:>6} "
                     f"{t['chi2']:>9.1f} {t['p_value']:>8.4f} {t['tv']:>7.4f} {t['tv_tolerance']:>7.4f}  "
                     f"{'PASS' if t['passed'] else 'FAIL'}")
    verdict = "PASS" if result["passed"] else "FAIL"
    took = f" in {seconds:.1f} s" if seconds is not None else ""
    lines.append(f"{verdict}: {sum(t['passed'] for t in result['tests'])}/{len(result['tests'])} tests passed{took}")
    return "\n".join(lines)




# ---------------------------------------------------------------- config and entry point


@dataclass
class VerifyConfig:
    """`specdec verify` settings. Sampling lists are zipped into settings (a one-item list is repeated)."""

    target: str | None = None  # with draft and prompts: check that pair instead of the tiny one
    draft: str | None = None  # the draft checked with target (a checkpoint folder or Hub id); None = the tiny pair
    prompts: str | None = None  # a user's pair: .jsonl/.json prompt file, or embedded:heldout
    num_prompts: int = 2  # a user's pair: the first N prompts, each tested on its own
    use_chat_template: bool = True  # a user's pair: wrap prompts in the target's chat template
    # Sampling temperatures checked (> 0: greedy is `specdec eval`'s token-identity check); zipped with top_k and
    # top_p into settings, a one-item list repeated.
    temperature: list[float] = dataclasses.field(default_factory=lambda: [1.0, 0.8])
    top_k: list[int] = dataclasses.field(default_factory=lambda: [0, 6])  # top-k of each setting (0 = no limit)
    top_p: list[float] = dataclasses.field(default_factory=lambda: [1.0, 0.9])  # top-p of each setting (1 = no limit)
    batch_size: list[int] | None = None  # tiny pair: [2000, 1]; a user's pair: [64]
    samples: int | None = None  # per batched check; tiny pair: 16000; a user's pair: 512 per prompt
    samples_batch1: int = 300  # draws at batch size 1 (one decoder call each, so fewer)
    num_tokens: int = 4  # tiny pair: m tokens tested jointly
    num_draft_tokens: int = 2  # tiny pair: k, draft tokens per round (a user's pair is tested at k = 1)
    vocab_size: int = 16  # tiny pair: its vocabulary (vocab_size ** num_tokens cells, at most 4M)
    alpha: float = 1e-3  # a test fails when its chi-square p-value is below alpha (or TV exceeds its bound)
    seed: int = 0  # seeds the tiny pair's weights and prompt, and the sampling
    device: str = "auto"  # a user's pair: auto (CUDA when present, else the CPU), cpu, cuda or cuda:N
    dtype: str = "auto"  # a user's pair: both models' dtype (auto: bfloat16 on CUDA, float32 on a CPU)
    threads: int | None = None  # torch CPU threads (None: 1 for the tiny pair, torch's default for a user's pair)
    out: str | None = None  # write verify.json here

    def __post_init__(self) -> None:
        lengths = {len(self.temperature), len(self.top_k), len(self.top_p)}
        if not self.temperature or not self.top_k or not self.top_p or len(lengths - {1}) > 1:
            raise ValueError("temperature, top_k and top_p lists must have one length (or length 1, repeated); "
                             "e.g. --temperature 1.0,0.8 --top-k 0,6 --top-p 1.0,0.9")
        if any(t == 0 for t in self.temperature):
            raise ValueError("specdec verify checks sampling; temperature 0 (greedy) is checked by `specdec eval` "
                             "(token identity). Use a temperature > 0")
        if (self.target is None) != (self.draft is None):
            raise ValueError("pass both --target and --draft (and --prompts) to check your own pair, or neither "
                             "for the built-in tiny pair")
        if self.target is not None and not self.prompts:
            raise ValueError("checking your own pair needs --prompts FILE.jsonl (a few prompts are enough)")
        if self.batch_size is not None and (not self.batch_size or min(self.batch_size) < 1):
            raise ValueError(f"batch_size must be a list of integers >= 1, got {self.batch_size}")
        for name in ("samples", "samples_batch1", "num_prompts", "num_tokens", "num_draft_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.vocab_size < 2 or self.vocab_size ** self.num_tokens > 2 ** 22:
            raise ValueError("vocab_size ** num_tokens must stay <= 4M cells for the exact enumeration; "
                             f"got {self.vocab_size} ** {self.num_tokens}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if not 0.0 < self.alpha < 1.0:
            raise ValueError(f"alpha must be within (0, 1), got {self.alpha}")
        self.settings()  # validates each setting

    def settings(self) -> list[SamplingConfig]:
        """The sampling settings to check, zipping the three lists."""
        n = max(len(self.temperature), len(self.top_k), len(self.top_p))

        def pick(xs, i):
            return xs[0] if len(xs) == 1 else xs[i]

        return [SamplingConfig(float(pick(self.temperature, i)), int(pick(self.top_k, i)), float(pick(self.top_p, i)))
                for i in range(n)]


def run_verify(cfg: VerifyConfig) -> dict:
    """Run the configured check; returns the result dict (tests, passed) and writes verify.json when asked."""
    start = time.perf_counter()
    threads = torch.get_num_threads()
    # The tiny pair's forwards are too small to gain from threads, and idle threads spin on a busy CPU.
    torch.set_num_threads(cfg.threads or (1 if cfg.target is None else threads))
    try:
        if cfg.target is None:
            result = check_tiny(cfg.settings(), cfg.batch_size or [2000, 1], cfg.samples or 16000,
                                cfg.samples_batch1, cfg.num_tokens, cfg.num_draft_tokens, cfg.vocab_size, cfg.alpha,
                                cfg.seed)
        else:
            result = _check_user_pair(cfg)
    finally:
        torch.set_num_threads(threads)
    result["seconds"] = time.perf_counter() - start
    if cfg.out:
        out = Path(cfg.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "verify.json").write_text(json.dumps(result, indent=2))
    return result


def _check_user_pair(cfg: VerifyConfig) -> dict:

    path = resolve_prompts_path(cfg.prompts)
    prompts = read_prompts(path, limit=cfg.num_prompts)
    tokenizer = load_tokenizer(cfg.target)
    target = load_model(cfg.target, cfg.dtype, cfg.device)
    draft = load_model(cfg.draft, cfg.dtype, cfg.device)
    check_fits(draft, target, f"the draft {cfg.draft}", f"the target {cfg.target}")
    check_compatible(tokenizer, _draft_tokenizer(cfg.draft, tokenizer), target, draft)
    ids = [encode_prompt(tokenizer, first_turn(p.messages), cfg.use_chat_template) for p in prompts]
    # the check generates two tokens per prompt
    check_prompt_lengths(prompts, ids, 2, {"the target": context_length(target), "the draft": context_length(draft)}, path)
    tests = []
    for sampling in cfg.settings():
        for b in cfg.batch_size or [64]:
            n = cfg.samples_batch1 if b == 1 else cfg.samples or 512
            res = check_pair(target, draft, ids, sampling, n, b, alpha=cfg.alpha, seed=cfg.seed,
                             label=f"{cfg.target} + {cfg.draft}")
            tests += res["tests"]
    return {"pair": f"{cfg.target} + {cfg.draft}", "num_tokens": 2, "num_draft_tokens": 1, "alpha": cfg.alpha,
            "tests": tests, "passed": all(t["passed"] for t in tests)}


def first_turn(messages: list[dict]) -> list[dict]:
    """The messages up to and including the first user message (system prompt kept)."""
    for i, m in enumerate(messages):
        if m["role"] == "user":
            return messages[: i + 1]
    return messages[:1]


def _draft_tokenizer(draft: str, fallback):
    """The draft's own tokenizer when its checkpoint has one, else the target's (a draft saved without one)."""

    try:
        return load_tokenizer(draft)
    except (ValueError, OSError, TypeError) as err:
        log.warning("draft %s has no loadable tokenizer (%s); assuming the target's", draft, err)
        return fallback


EMBEDDED_HELDOUT = "embedded:heldout"


def resolve_prompts_path(name: str) -> Path:
    """A prompt file path; `embedded:heldout` is the held-out set shipped in the installed `specdec.train` package
    (found without importing it: eval does not import train)."""
    if name.strip().lower() == EMBEDDED_HELDOUT:
        spec = importlib.util.find_spec("specdec.train")
        folders = [] if spec is None else list(spec.submodule_search_locations or [])
        if spec is not None and spec.origin:
            folders.insert(0, str(Path(spec.origin).parent))
        # A package installed in editable mode may be a namespace package without an origin: try each folder.
        path = next((p for f in folders if (p := Path(f) / "assets" / "prompts_heldout.jsonl").is_file()), None)
        if path is None:
            raise ValueError(f"{EMBEDDED_HELDOUT} is not available in this install (train/assets/prompts_heldout.jsonl "
                             "is missing); pass --prompts FILE.jsonl")
        return path
    return Path(name)
