"""The model card (README.md) of a published draft: Hub YAML metadata, provenance, results, usage snippets.

`render_card(info, report)` is a pure function: everything it states comes from `info` (what `publish` knows
about the checkpoint) or from `report` (an `specdec eval` report.json). Without a report the card says
"not measured" and states no figures. When the report has per-category figures, the card's "By task type" table
lists them and names the task types where acceptance is well below the overall rate.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import yaml

from specdec.train import kinds

TAGS = ("speculative-decoding", "draft-model", "assistant-model", "specdec")
DEFAULT_K = 4  # the snippets' k when no report measured one
LEAK_WARNING = 0.01  # an expanded head putting more than this mass on dropped ids gets a note in the card
WEAK_MARGIN = 0.1  # a task type whose acceptance is this far below the overall rate is named as a weak spot
WEAK_MAX = 3  # at most this many weak task types named (the lowest first)


@dataclasses.dataclass
class CardInfo:
    """What the card says about the exported checkpoint (collected by `specdec.train.publish`)."""

    name: str  # title: the Hub repo id, or the output folder's name
    model_ref: str  # how snippets load the draft: Hub repo id or local path
    target: str  # the target as the user named it (Hub id, path or the embedded alias)
    target_ref: str  # how the stock-engine snippets load the target (a Hub id where known)
    base_model: str | None  # Hub id of the target for the metadata; None when the target is not on the Hub
    architecture: str
    num_layers: int
    hidden_size: int
    num_parameters: int
    dtype: str
    vocab_size: int  # the full (target) vocabulary the draft reads
    head: str = "full"  # "full", "reduced" (id map, specdec only) or "expanded" (reduced, re-expanded)
    draft_vocab_size: int | None = None  # kept ids of a reduced/expanded head
    expansion: dict[str, Any] | None = None  # check of an expanded head: positions, agree, max/median mass
    recipe: str | None = None
    data: str | None = None
    # The data section's settings a served target depends on (`traffic_facts`): the temperatures the training
    # answers were sampled at and the chat template's options (e.g. {enable_thinking: false})
    traffic: dict[str, Any] = dataclasses.field(default_factory=dict)
    license: str = "apache-2.0"
    model_on_hub: bool = False  # model_ref is a Hub repo id (the export was pushed)
    # The draft kind's facts (specdec/draft_kind.py: name, vllm_method, sglang_algorithm, maps_vocabulary,
    # card_facts); the kind's training side writes the usage section from them (train/kinds/: card_usage)
    kind: str = "plain"  # the draft kind's registry name
    method: str = "draft_model"  # vLLM's speculative method (the kind's vllm_method)
    sglang_algorithm: str = "STANDALONE"  # SGLang's --speculative-algorithm
    engines_map_vocabulary: bool = False  # the engines read a reduced vocabulary's map themselves (EAGLE-3's d2t)
    kind_facts: dict[str, Any] = dataclasses.field(default_factory=dict)  # the kind's card_facts (its layer ids ...)
    format: str = "engines"  # the kind's layout, one of its `formats` (the first: its default)

    def __post_init__(self) -> None:
        if self.head not in ("full", "reduced", "expanded"):
            raise ValueError(f"head must be full, reduced or expanded, got {self.head!r}")
        if self.head != "full" and not self.draft_vocab_size:
            raise ValueError(f"a {self.head} head needs draft_vocab_size (the number of kept ids)")


def _get(tree: dict | None, dotted: str) -> Any:
    """tree['a']['b'] for 'a.b', or None when any level is missing."""
    node: Any = tree
    for key in dotted.split("."):
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


def _interval_row(report: dict, name: str, key: str, spec: str, suffix: str = "") -> list[tuple[str, str]]:
    """The figure's interval over the evaluation's prompts (specdec.eval.intervals), where the report has one."""
    intervals = _get(report, "intervals")
    if not isinstance(intervals, dict) or not isinstance(intervals.get(key), list):
        return []
    low, high = intervals[key]
    return [(f"{name}, {intervals.get('level', 0.95):.0%} interval over the prompts (bootstrap)",
             f"{_fmt(low, spec, suffix)} - {_fmt(high, spec, suffix)}")]


def _fmt(value: Any, spec: str, suffix: str = "") -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "not reported"
    return f"{value:{spec}}{suffix}"


def traffic_facts(data_section: dict | None) -> dict[str, Any]:
    """From a recipe's `data:` section: the temperatures its answers were sampled at and its chat-template options."""
    section = data_section or {}
    facts: dict[str, Any] = {"temperatures": section.get("temperatures") or [section.get("temperature", 0.0)]}
    if section.get("chat_template_kwargs"):
        facts["chat_template_kwargs"] = section["chat_template_kwargs"]
    return facts


def _traffic_lines(info: CardInfo, report: dict | None) -> list[str]:
    """Which temperatures the draft was trained and measured at, and the chat-template options of its data."""
    trained = info.traffic.get("temperatures")
    trained_text = ", ".join(f"{t:g}" for t in trained) if trained else "not recorded"
    lines = [f"- temperature(s) of the training answers: {trained_text}; "
             f"measured at: {_measured_temperatures(report)}"]
    if info.traffic.get("chat_template_kwargs"):
        options = ", ".join(f"{k}={v}" for k, v in info.traffic["chat_template_kwargs"].items())
        lines.append(f"- chat template options of the training prompts: {options} (serve with the same)")
    return lines


def _measured_temperatures(report: dict | None) -> str:
    """The temperatures the report measured at: its timed run's ("0 (greedy)") and its sampled pass's, if any."""
    if not report:
        return "not measured"
    measured = _get(report, "config.temperature")
    text = "0 (greedy)" if measured == 0 else _fmt(measured, "g")
    sampled = _get(report, "sampled.temperature")
    return text if sampled is None else f"{text} and {_fmt(sampled, 'g')} (acceptance only, untimed)"


def _sampled_rows(report: dict) -> list[tuple[str, str]]:
    """The results table's rows of the report's sampled pass (eval's sampled_acceptance_temperature), if any."""
    sampled = _get(report, "sampled")
    if not isinstance(sampled, dict):
        return []
    t = _fmt(sampled.get("temperature"), "g")
    return [(f"acceptance rate sampled at T={t} (same proposal and prompts, untimed)",
             _fmt(sampled.get("acceptance_rate"), ".3f")),
            (f"mean accepted tokens per round sampled at T={t}", _fmt(sampled.get("mean_accepted_tokens"), ".2f"))]


def metadata(info: CardInfo) -> dict[str, Any]:
    """The Hub's YAML front matter as a dict."""
    meta: dict[str, Any] = {}
    if info.base_model:
        meta["base_model"] = info.base_model
    meta.update(
        library_name="transformers",
        pipeline_tag="text-generation",
        license=info.license,
        tags=list(TAGS),
    )
    return meta


def num_draft_tokens(report: dict | None) -> int:
    """k measured by the report (a tree's depth: the engines run the draft as a chain of it), else the snippets'
    default."""
    k = _get(report, "config.tree_depth") if _get(report, "config.tree") else _get(report, "config.num_draft_tokens")
    return int(k) if isinstance(k, int) and not isinstance(k, bool) and k > 0 else DEFAULT_K


def _results(report: dict | None) -> list[str]:
    if report is None:
        return [
            "## Results",
            "",
            "Not measured: this card was published without an evaluation report. Measure acceptance rate, "
            "mean accepted tokens and speedup on your own machine with `specdec eval` (snippet below), then "
            "re-publish with `--report runs/eval/report.json`.",
            "",
        ]
    env = _get(report, "environment") or {}
    env_text = ", ".join(f"{key} {env[key]}" for key in ("device", "threads", "python", "torch", "transformers")
                         if key in env) or "not reported"
    tree = _get(report, "config.tree")  # a tree's row: its shape and depth where a chain's has k
    rows = [
        (("acceptance rate (accepted tokens per tree level: higher than its chain's with the same draft)"
          if tree else "acceptance rate (accepted / proposed draft tokens)"),
         _fmt(_get(report, "speculative.acceptance_rate"), ".3f")),
        *_interval_row(report, "acceptance rate", "acceptance_rate", ".3f"),
        ("mean accepted tokens per round (incl. correction/bonus)",
         _fmt(_get(report, "speculative.mean_accepted_tokens"), ".2f")),
        *_sampled_rows(report),
        ("speedup (baseline time / speculative time)", _fmt(_get(report, "speedup"), ".2f", "x")),
        *_interval_row(report, "speedup", "speedup", ".2f", "x"),
        *([("draft tree (specdec's decoder; engines run the draft as a chain of its depth)",
            f"{tree} (depth {_fmt(_get(report, 'config.tree_depth'), 'd')})")]
          if tree else
          [("k (draft tokens per round)", _fmt(_get(report, "config.num_draft_tokens"), "d"))]),
        ("target-only tokens/s", _fmt(_get(report, "baseline.tokens_per_s"), ".1f")),
        ("speculative tokens/s", _fmt(_get(report, "speculative.tokens_per_s"), ".1f")),
        ("latency p50 target-only / speculative (s)",
         f"{_fmt(_get(report, 'baseline.latency_s.p50'), '.3f')} / "
         f"{_fmt(_get(report, 'speculative.latency_s.p50'), '.3f')}"),
        ("temperature", _fmt(_get(report, "config.temperature"), "g")),
        ("max new tokens", _fmt(_get(report, "config.max_new_tokens"), "d")),
        ("batch size", _fmt(_get(report, "config.batch_size"), "d")),
        ("prompts", _fmt(_get(report, "config.num_prompts"), "d")),
        ("machine / environment", env_text),
    ]
    equivalence = _get(report, "equivalence")
    if isinstance(equivalence, dict):
        verdict = "passed" if equivalence.get("passed") else "FAILED"
        rows.append(("output equivalence with the target",
                     f"{equivalence.get('mode', '?')}: {verdict} "
                     f"({equivalence.get('mismatches', '?')} mismatches in {equivalence.get('checked', '?')} checked)"))
    decision = _get(report, "decision")
    if isinstance(decision, dict) and decision.get("verdict"):
        rows.append(("decision", str(decision["verdict"])))
    lines = ["## Results", "", f"Measured by `specdec eval` against `{_get(report, 'config.target') or '?'}`.", "",
             "| metric | value |", "|---|---|"]
    lines += [f"| {name} | {value} |" for name, value in rows]
    reasons = _get(report, "decision.reasons")
    if isinstance(reasons, list) and reasons:
        lines += ["", "Decision reasons:", ""] + [f"- {reason}" for reason in reasons]
    lines += ["", "Speedup depends on the machine, batch size and prompts: measure it on yours.", ""]
    return lines + _task_type_lines(report)


def _task_type_lines(report: dict) -> list[str]:
    """Figures per prompt category (report.json's `categories`) and the task types where the draft is weak."""
    cats = _get(report, "categories")
    if not isinstance(cats, dict) or not cats:
        return []
    cats = {str(name): c for name, c in cats.items() if isinstance(c, dict)}
    lines = ["## By task type", "", "The same run's figures per prompt category.", "",
             "| task type | prompts | acceptance | speedup |", "|---|---:|---:|---:|"]
    lines += [f"| {name} | {_fmt(c.get('prompts'), 'd')} | {_fmt(c.get('acceptance_rate'), '.3f')} | "
              f"{_fmt(c.get('speedup'), '.2f', 'x')} |" for name, c in cats.items()]
    overall = _get(report, "speculative.acceptance_rate")
    rates = {name: c.get("acceptance_rate") for name, c in cats.items()}
    rates = {name: r for name, r in rates.items() if isinstance(r, (int, float)) and not isinstance(r, bool)}
    if len(rates) < 2 or isinstance(overall, bool) or not isinstance(overall, (int, float)):
        return lines + [""]
    weak = sorted((r, name) for name, r in rates.items() if r < overall - WEAK_MARGIN)[:WEAK_MAX]
    if not weak:
        return lines + ["", f"No task type's acceptance is more than {WEAK_MARGIN:g} below the overall "
                            f"{overall:.3f}.", ""]
    named = [f"{name} ({r:.3f})" for r, name in weak]
    listed = named[0] if len(named) == 1 else ", ".join(named[:-1]) + " and " + named[-1]
    those = "that type" if len(weak) == 1 else "those types"
    return lines + ["", f"The draft is weak on {listed}: acceptance more than {WEAK_MARGIN:g} below its overall "
                        f"{overall:.3f}, so expect less speedup on prompts of {those}. Training the draft on "
                        f"more prompts of {those} raises its acceptance there.", ""]


def _head_section(info: CardInfo) -> list[str]:
    if info.head == "full":
        return []
    n, v = info.draft_vocab_size, info.vocab_size
    if info.engines_map_vocabulary:
        return ["## Reduced vocabulary", "",
                f"The LM head scores {n:,} of the {v:,} target ids, the most frequent in the training completions. "
                "`d2t` maps them as vLLM and SGLang read it (target id = draft id + d2t[draft id], draft ids in "
                "ascending target-id order; `t2d` marks the kept ids). q = 0 outside them keeps decoding exact.", ""]
    if info.head == "reduced":
        return [
            "## Reduced vocabulary: specdec only",
            "",
            f"> **Warning:** this draft's LM head scores only {n:,} of the {v:,} target ids; "
            "`draft_vocab.safetensors` maps its logits to target ids. Only specdec reads that map. "
            "transformers (`AutoModelForCausalLM.from_pretrained` fails on the smaller `lm_head`), vLLM and "
            "SGLang need the expanded export:",
            "",
            "```bash",
            "specdec publish --draft DRAFT_DIR --out OUT --full-vocab-head",
            "```",
            "",
        ]
    check = info.expansion or {}
    lines = [
        "## Expanded vocabulary head",
        "",
        f"This draft was trained with a reduced head over {n:,} of the {v:,} target ids and exported with the "
        f"head expanded back to {v:,} rows so that stock engines load it unchanged:",
        "",
        "- the kept ids' rows are copied unchanged;",
        "- every other row is one weighted mean of kept rows: mostly the few with the lowest logits on the "
        "draft's own hidden states, plus a little of all of them. Llama heads have no bias, so a -inf logit "
        "is impossible; a weighted mean of kept rows scores below the best kept id at every position (unless "
        "all kept logits are equal), so greedy decoding never proposes a dropped id and proposes exactly what "
        "the reduced draft proposes;",
        "- under sampling the dropped ids share a small probability mass that the reduced draft gives "
        "zero; speculative sampling stays exact for any draft distribution, so only acceptance can move, "
        "and only by that mass;",
        f"- cost: the head is {v:,} rows instead of {n:,}, so each draft step does the full-vocabulary "
        "head matmul again (specdec's reduced export avoids it).",
    ]
    if check:
        leak = check.get("max_dropped_mass", 0.0)
        lines += [
            "",
            f"Checked at export on {check.get('positions', '?')} positions of sample text: greedy proposals "
            f"{'identical to' if check.get('greedy_agreement') else 'DIFFERENT from'} the reduced head; "
            f"smallest gap between the best kept logit and any dropped id's logit {check.get('min_margin', float('nan')):.3g}; "
            f"probability mass on dropped ids max {check.get('max_dropped_mass', float('nan')):.2e}, "
            f"median {check.get('median_dropped_mass', float('nan')):.2e}.",
        ]
        if leak > LEAK_WARNING:
            lines += [
                "",
                "> **Note:** on this draft the dropped ids can take a noticeable share of the probability, so under "
                "sampling the expanded head may be accepted less often than the reduced one (greedy is unaffected).",
            ]
    return lines + [""]


def _specdec_lines(info: CardInfo, k: int, tree: str | None) -> list[str]:
    """specdec's CLI and Python snippets (a local copy first where specdec reads files a Hub load would not)."""
    draft = info.model_ref
    q = json.dumps  # Python string literals in double quotes, like the rest of the snippets
    local = (info.head == "reduced" or info.engines_map_vocabulary) and info.model_on_hub
    cli_draft = f"drafts/{draft.split('/')[-1]}" if local else draft
    py_draft = f"snapshot_download({q(draft)})" if local else q(draft)
    return [
        "### specdec",
        "",
        "```bash",
        *([f"hf download {draft} --local-dir {cli_draft}"] if local else []),
        f"specdec eval --target {info.target} --draft {cli_draft} --prompts prompts.jsonl \\",
        f"    {f'tree={tree}' if tree else f'--num-draft-tokens {k}'} --max-new-tokens 256 --out runs/eval",
        "```",
        "",
        "```python",
        *(["from huggingface_hub import snapshot_download"] if local else []),
        "from specdec import SamplingConfig, speculative_generate",
        "from specdec.models import load_model, load_tokenizer",
        "",
        f"tok = load_tokenizer({q(info.target)})",
        f"target, draft = load_model({q(info.target)}), load_model({py_draft})",
        'ids = tok.apply_chat_template([{"role": "user", "content": "Hello!"}], add_generation_prompt=True,',
        '                              return_tensors="pt", return_dict=True)["input_ids"].to(target.device)',
        f"out = speculative_generate(target, draft, ids, {f'tree={q(tree)}' if tree else f'num_draft_tokens={k}'}, "
        "max_new_tokens=128,",
        "                           sampling=SamplingConfig(temperature=0.0), eos_token_id=tok.eos_token_id)",
        "print(tok.decode(out.sequences[0, out.prompt_length:]), out.stats.as_dict())",
        "```",
        "",
    ]


def _snippets(info: CardInfo, k: int, tree: str | None = None) -> list[str]:
    """Usage snippets: the draft kind's (how the engines run it), then specdec's; `tree`: the draft tree the report
    measured in specdec's decoder (the engines run a chain)."""
    # a kind without a training side (registered in the core only) gets the plain kind's engine snippets
    kind = kinds.get(info.kind) if info.kind in kinds.names() else kinds.PLAIN
    return kind.card_usage(info, k) + _specdec_lines(info, k, tree)


def render_card(info: CardInfo, report: dict | None = None) -> str:
    """The README.md text of a published draft: YAML metadata, provenance, results, caveats and usage."""
    k = num_draft_tokens(report)
    front = yaml.safe_dump(metadata(info), sort_keys=False).strip()
    target_line = f"[`{info.base_model}`](https://huggingface.co/{info.base_model})" if info.base_model \
        else f"`{info.target}`"
    if info.head == "full":
        head_text = f"full vocabulary ({info.vocab_size:,} ids)"
    elif info.head == "reduced":
        head_text = f"reduced head: {info.draft_vocab_size:,} of {info.vocab_size:,} ids, with id map"
    else:
        head_text = f"{info.vocab_size:,} rows, expanded from a reduced head of {info.draft_vocab_size:,} ids"
    lines = [
        "---",
        front,
        "---",
        "",
        f"# {info.name}",
        "",
        f"A draft model for speculative decoding with the target {target_line}, trained with "
        "specdec to agree with that target. It shares the target's tokenizer and is "
        "meant to propose tokens for the target to verify, not to be used on its own.",
        "",
        "## How it was made",
        "",
        f"- target it was aligned to: `{info.target}`",
        f"- recipe: {f'`{info.recipe}`' if info.recipe else 'not recorded'}",
        f"- training data: {info.data if info.data else 'not recorded'}",
        *_traffic_lines(info, report),
        f"- architecture: {info.architecture}; layers: {info.num_layers}; hidden size: {info.hidden_size}; "
        f"parameters: {info.num_parameters:,}; dtype: {info.dtype}",
        f"- LM head: {head_text}",
        f"- serving: vLLM `{info.method}`, SGLang `{info.sglang_algorithm}`",
        "",
    ]
    lines += _results(report)
    lines += _head_section(info)
    tree = _get(report, "config.tree")
    lines += _snippets(info, k, tree if isinstance(tree, str) else None)
    if info.base_model is None:
        lines += ["The target is not a Hub model, so the snippets load it from "
                  f"`{info.target_ref}`: replace that with where your copy of the target lives.", ""]
    return "\n".join(lines).rstrip() + "\n"
