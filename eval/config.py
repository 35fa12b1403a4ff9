"""`specdec eval`'s settings (recipe section `eval:`), checked when built: the fixed workload, the sweep of
proposals and batch sizes, the decision's thresholds, and the serving engine's settings."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from specdec.decode import max_draft_depth
from specdec.eval import decision as decision_mod
from specdec.eval import engine as engines
from specdec.eval import proposals
from specdec.proposal import Proposal
from specdec.sampling import SamplingConfig

RECOMMEND_BY = ("speedup", "tokens_per_s", "latency_p50", "latency_p95")
PLOT_FORMATS = ("png", "svg", "pdf")


@dataclass
class EvalConfig(*engines.option_classes()):
    """`specdec eval` settings (recipe section `eval:`). Lists sweep: one row per (k or tree, batch size)."""

    target: str = "embedded:smollm2-135m-instruct"  # the target: Hub id, local checkpoint folder or the embedded one
    # The draft: a `specdec train` checkpoint folder (output_dir/final or best) or a Hub id; needed by specdec's
    # decoder, not by engine=vllm with vllm_method=ngram alone.
    draft: str | None = None
    prompts: str = "embedded:heldout"  # .jsonl/.json prompt file; default: the shipped held-out prompt set
    num_prompts: int | None = None  # the first N prompts (None: all)
    use_chat_template: bool = True  # wrap prompts in the target's chat template; false = the raw text
    chat_template_kwargs: dict | None = None  # more chat-template arguments, e.g. {enable_thinking: false} (Qwen3)
    num_draft_tokens: list[int] = field(default_factory=lambda: [4])  # k, draft tokens per round; a list sweeps
    # Draft trees swept beside the chains, at batch size 1 (specdec/tree.py): e.g. 3x1x1 (top 3, then top 1),
    # dyn8 (EAGLE-2's dynamic tree of 8 nodes). [] = chains only.
    tree: list[str] = field(default_factory=list)
    batch_size: list[int] = field(default_factory=lambda: [1])  # prompts decoded together; a list sweeps
    max_new_tokens: int = 64  # tokens generated per prompt, in both modes
    # 0 = greedy: the speculative output must equal the target's token for token; > 0 samples, and the
    # distribution check (equivalence_samples) runs instead.
    temperature: float = 0.0
    top_k: int = 0  # sampling: the k most likely tokens only (0 = no limit), for target and draft alike
    top_p: float = 1.0  # sampling: the smallest set of tokens holding this probability (1 = no limit)
    # > 0: after the timed runs, one untimed speculative pass at this temperature (alone: no top-k / top-p) over the
    # same prompts, seeded, with the recommended proposal measures acceptance where sampled traffic is served
    # (report.json's `sampled`; no speed gate reads it). 0 = off.
    sampled_acceptance_temperature: float = 0.0
    seed: int = 0  # seeds the sampling (each batch's generator) and the equivalence check
    warmup: int = 1  # untimed passes over the first batch, per batch size
    out: str | None = None  # the report's folder (report.json, report.md, plots, samples.jsonl)
    output_dir: str | None = None  # recipe-wide; the report goes to output_dir/eval when `out` is not set
    device: str = "auto"  # auto (CUDA when present, else the CPU), cpu, cuda or cuda:N
    # Both models' dtype: auto (bfloat16 on CUDA, float32 on a CPU, where exactness needs it), float32, bfloat16
    # or float16.
    dtype: str = "auto"
    threads: int | None = None  # torch CPU threads (None: torch's default)
    report_to: str = "none"  # none | wandb (the report's figures go to the wandb project `specdec`)
    run_name: str | None = None  # the wandb run's name (report_to=wandb); None = wandb's own
    # --- decision thresholds, fixed before the run; all must hold for `enable`
    min_acceptance_rate: float = 0.5  # the least acceptance rate (accepted / proposed draft tokens), 0..1
    min_speedup: float = 1.1  # the least speedup (target-only wall time / speculative wall time)
    # The accounted memory the draft may add, as a fraction of target-only's (its weights and KV cache;
    # eval/memory.py).
    max_memory_overhead: float = 0.2
    # The figure that picks the recommended row of the sweep (among those that pass): speedup, tokens_per_s,
    # latency_p50 or latency_p95.
    recommend_by: str = "speedup"
    plot_format: str = "png"  # png | svg | pdf: the plots' file format
    cost_repeats: int = 10  # interleaved passes timing one cached forward of each kind, for c and v
    equivalence_samples: int = 256  # sampling only: draws for the short distribution check (0: skip)
    # Candidate k values: before the timed runs, pick the one with the best predicted speedup (a teacher-forced
    # replay on the first choose_k_prompts prompts, plus timed costs) and measure only it; replaces
    # num_draft_tokens. [] = off.
    choose_k: list[int] = field(default_factory=list)
    choose_tree: list[str] = field(default_factory=list)  # static tree shapes choose_k weighs beside its chains
    choose_k_prompts: int = 4  # calibration prompts (the first ones, which also serve as warm-up)
    # --- the serving engine (eval/engine/; each engine's own keys, vllm_method etc., come from its options class): where the draft is measured; specdec = this decoder
    engine: list[str] = field(default_factory=lambda: ["specdec"])  # specdec | vllm | specdec,vllm (side by side)
    concurrency: list[int] = field(default_factory=lambda: [1, 4, 16])  # serving engine: closed-loop clients per level

    def __post_init__(self) -> None:
        settings = engines.check_settings(self)
        self.engine, self.concurrency = settings.engine, settings.concurrency
        if not self.draft and engines.needs_draft(self):
            raise ValueError("eval needs a draft: pass --draft PATH_OR_HUB_ID (a checkpoint from `specdec train`)")
        if not self.prompts:
            raise ValueError("eval needs prompts: pass --prompts FILE.jsonl (default: embedded:heldout)")
        self._check_proposals()
        self._check_counts()
        self._check_reach()
        self.sampling()  # temperature / top_k / top_p checks with their own messages
        self.thresholds()
        if self.recommend_by not in RECOMMEND_BY:
            raise ValueError(f"unknown recommend_by metric {self.recommend_by!r}; use one of {', '.join(RECOMMEND_BY)}")
        if self.plot_format not in PLOT_FORMATS:
            raise ValueError(f"unknown plot_format {self.plot_format!r}; use one of {', '.join(PLOT_FORMATS)}")
        if self.report_to not in ("none", "wandb"):
            raise ValueError(f"unknown report_to {self.report_to!r}; use none or wandb")

    def _check_proposals(self) -> None:
        """The sweep's and choose_k's proposals, parsed once from the text (kept canonical in the fields)."""
        self._trees = proposals.normalise_trees(self.tree)
        self._choose_trees = proposals.normalise_trees(self.choose_tree, "choose_tree")
        self.tree, self.choose_tree = [p.value for p in self._trees], [p.value for p in self._choose_trees]
        if self.choose_tree and not self.choose_k:
            raise ValueError("choose_tree weighs trees beside chains: give choose_k too (e.g. choose_k=1,2,3)")
        for p in self._choose_trees:
            if p.tree.dynamic:
                raise ValueError(f"choose_tree={p.value}: a dynamic tree cannot be predicted from the replay; list "
                                 f"static shapes (e.g. 3x1x1) to choose among, and measure dynamic ones with tree=")
        if (not self.num_draft_tokens and not self.tree) or min(self.num_draft_tokens, default=1) < 1:
            raise ValueError(f"num_draft_tokens must be integers >= 1 (e.g. --num-draft-tokens 1,2,4), got {self.num_draft_tokens}")
        self.num_draft_tokens = sorted(set(self.num_draft_tokens))
        if self.choose_k and min(self.choose_k) < 1:
            raise ValueError(f"choose_k must list integers >= 1 (e.g. choose_k=1,2,3,4), got {self.choose_k}")
        self.choose_k = sorted(set(self.choose_k))

    def _check_counts(self) -> None:
        if not self.batch_size or min(self.batch_size) < 1:
            raise ValueError(f"batch_size must be integers >= 1 (e.g. --batch-size 1,4), got {self.batch_size}")
        if self.choose_k_prompts < 1:
            raise ValueError(f"choose_k_prompts must be >= 1, got {self.choose_k_prompts}")
        self.batch_size = sorted(set(self.batch_size))
        if self.tree and 1 not in self.batch_size:
            raise ValueError(f"trees decode one prompt at a time: add batch size 1 to measure tree={self.tree}")
        for name in ("max_new_tokens", "cost_repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.sampled_acceptance_temperature < 0:
            raise ValueError(f"sampled_acceptance_temperature must be > 0 (the temperature to measure acceptance at) "
                             f"or 0 (off), got {self.sampled_acceptance_temperature}")
        for name in ("warmup", "equivalence_samples"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1 (or unset for all), got {self.num_prompts}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")

    def _check_reach(self) -> None:
        """No proposal deeper than a round can propose within max_new_tokens. Refused rather than capped: a capped
        k=1000 would be reported as k=1000 while measuring a shorter chain (and sweep rows would merge), with
        positions no round reached; nothing is loaded yet, so the refusal costs nothing."""
        reach = max_draft_depth(self.max_new_tokens)
        listed = [("num_draft_tokens", p) for p in map(Proposal.chain, self.num_draft_tokens)]
        listed += [("tree", p) for p in self._trees] + [("choose_tree", p) for p in self._choose_trees]
        listed += [("choose_k", p) for p in map(Proposal.chain, self.choose_k)]
        for key, p in listed:
            if p.depth > reach:
                what = f"{key}={p.value} is {p.depth} deep" if p.is_tree else f"{key} lists {p.k}"
                raise ValueError(
                    f"{what}, but with max_new_tokens={self.max_new_tokens} a round can propose at most {reach} draft "
                    f"token(s) (the prefill gives the first new token, and each round's last is the target's own); "
                    f"lower it to at most {reach}, or raise max_new_tokens to at least {p.depth + 2}")

    def sampling(self) -> SamplingConfig:
        return SamplingConfig(self.temperature, self.top_k, self.top_p)

    def proposals(self, batch_size: int) -> list[Proposal]:
        """The configurations measured at this batch size: every k, and the trees at batch size 1."""
        return [*map(Proposal.chain, self.num_draft_tokens), *(self._trees if batch_size == 1 else [])]

    def choose_candidates(self) -> list[Proposal]:
        """What choose_k weighs: its chains, then choose_tree's static trees."""
        return [*map(Proposal.chain, self.choose_k), *self._choose_trees]

    def measuring(self, proposal: Proposal) -> EvalConfig:
        """This config measuring `proposal` alone (choose_k's pick)."""
        return dataclasses.replace(self, num_draft_tokens=[] if proposal.is_tree else [proposal.k],
                                   tree=[proposal.value] if proposal.is_tree else [])

    def thresholds(self) -> decision_mod.Thresholds:
        return decision_mod.Thresholds(self.min_acceptance_rate, self.min_speedup, self.max_memory_overhead)

    def out_dir(self) -> Path:
        if self.out:
            return Path(self.out)
        if self.output_dir:
            return Path(self.output_dir) / "eval"
        raise ValueError("where should the report go? pass --out DIR")
