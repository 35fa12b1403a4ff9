"""The embedded prompt set: varied instruction prompts written for this project, rendered from the templates and
topic lists in train/assets/prompt_templates.json.

    python -m specdec.train.prompt_templates          # regenerate train/assets/prompts_{train,heldout}.jsonl
    python -m specdec.train.prompt_templates --check  # exit 1 when the shipped files differ from the render

Thirteen kinds of task. Every kind's topics are split once (seeded) into train topics and held-out topics, so the
held-out prompts are about things the train prompts never mention, not merely rewordings of them. Records:
{"prompt_id", "category", "messages": [user turns]}; a `follow-up` record has two user turns (the target answers the
first, then the second after its own answer). None of this text comes from MT-Bench or Spec-Bench
(tests/test_data.py checks). The shipped .jsonl files are what runs read; this module only makes them.
"""

from __future__ import annotations

import ast
import json
import operator
import random
import sys
from collections.abc import Callable
from pathlib import Path

ASSETS = Path(__file__).resolve().parent / "assets"
TEMPLATES = ASSETS / "prompt_templates.json"
EMBEDDED_TRAIN_PROMPTS = ASSETS / "prompts_train.jsonl"
EMBEDDED_HELDOUT_PROMPTS = ASSETS / "prompts_heldout.jsonl"
SEED = 20261130
TRAIN_PER_KIND = 130
HELDOUT_TOTAL = 150
HELDOUT_TOPIC_FRACTION = 0.12

Variants = list[list[str]]  # a topic's prompts, each a list of user turns

# --------------------------------------------------------------------------------------------------------
# Maths word problems: each is a text with named numbers, drawn in the listed order (the order is the seeded
# stream: reordering the draws changes every later prompt).

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Gt: operator.gt}


def _value(expr, names: dict):
    """A number, or an arithmetic expression (+, -, *, >) over the names drawn so far."""
    if not isinstance(expr, str):
        return expr

    def ev(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.Name):
            return names[node.id]
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _OPS:
            return _OPS[type(node.ops[0])](ev(node.left), ev(node.comparators[0]))
        raise ValueError(f"prompt templates: unsupported expression {expr!r}")

    return ev(ast.parse(expr, mode="eval").body)


def _draw(spec: dict, names: dict, rng: random.Random):
    if "choice" in spec:
        options = spec["choice"]
        if "except" in spec:
            options = [x for x in options if x != _value(spec["except"], names)]
        return rng.choice(options)
    if "randint" in spec:
        return rng.randint(*(_value(bound, names) for bound in spec["randint"]))
    if "first" in spec:  # the first option for which `where` holds, x standing for it
        return next(x for x in spec["first"] if _value(spec["where"], {**names, "x": x}))
    return _value(spec["is"], names)


def _math_problem(problem: dict, rng: random.Random) -> str:
    names: dict = {}
    for spec in problem["draw"]:
        names[spec["let"]] = _draw(spec, names, rng)
    return problem["text"].format(**names)


# --------------------------------------------------------------------------------------------------------
# Each kind: (its topics, its renderer: (the kind's data, one topic, rng) -> the topic's prompt variants)


def _each_template(d: dict, topic, rng: random.Random) -> Variants:
    return [[t.format(t=topic)] for t in d["templates"]]


def _explanation(d: dict, topic: str, rng: random.Random) -> Variants:
    return [[t.format(t=topic, a=rng.choice(d["audiences"]))] for t in d["templates"]]


def _coding(d: dict, topic: list, rng: random.Random) -> Variants:
    kind, payload = topic
    if kind == "spec":
        langs = rng.sample(sorted(set(d["languages"])), 3) + ["Python"]
        return [[t.format(l=lang, t=payload)] for t in d["templates"] for lang in langs]
    if kind == "bug":
        code, why, bare = payload
        return [[t.format(code=code, why=why, why_bare=bare)] for t in d["bug_templates"]]
    return [[t.format(t=payload)] for t in d["sql_templates"]]


def _math(d: dict, topic: dict, rng: random.Random) -> Variants:
    return [[_math_problem(topic, rng) + rng.choice(d["suffixes"])] for _ in range(d["per_topic"])]


def _creative(d: dict, topic: str, rng: random.Random) -> Variants:
    forms = rng.sample(d["forms"], 6)
    return [[rng.choice(d["templates"]).format(f=f, s=topic, x=rng.choice(d["extras"]))] for f in forms]


def _review(d: dict, product: str, rng: random.Random) -> Variants:
    out = []
    for _ in range(6):
        good, bad = rng.choice(d["praise"]), rng.choice(d["complaints"])
        text = rng.choice(d["review_texts"]).format(p=product, good=good, bad=bad)
        out.append([rng.choice(d["review_templates"]).format(text=text)])
    return out


def _meeting(d: dict, place: str, rng: random.Random) -> Variants:
    out = []
    for _ in range(5):
        a, b = rng.sample(d["people"], 2)
        day, month = rng.randint(1, 28), rng.choice(d["months"])
        sentence = d["meeting"].format(a=a, b=b, place=place, day=day, month=month, event=rng.choice(d["events"]))
        out.append([rng.choice(d["meeting_templates"]).format(s=sentence)])
    return out


def _sorting(d: dict, pool_name: str, rng: random.Random) -> Variants:
    pool = d["item_pools"][pool_name]
    out = []
    for _ in range(5):
        items = ", ".join(rng.sample(pool, rng.randint(5, 7)))
        out.append([rng.choice(d["item_templates"]).format(t=pool_name, items=items)])
    return out


def _classification(d: dict, topic: list, rng: random.Random) -> Variants:
    kind, payload = topic
    if kind == "review":
        return _review(d, payload, rng)
    if kind == "entities":
        return _meeting(d, payload, rng)
    if kind == "items":
        return _sorting(d, payload, rng)
    return [[t.format(t=payload)] for t in d[f"{kind}_templates"]]  # a headline or a customer message


def _ideas(d: dict, topic: str, rng: random.Random) -> Variants:
    return [[t.format(n=n, t=topic)] for t in d["templates"] for n in rng.sample(d["counts"], 2)]


def _compare(d: dict, topic: list, rng: random.Random) -> Variants:
    a, b = topic
    return [[t.format(a=a, b=b)] for t in d["templates"]]


def _followup(d: dict, topic: str, rng: random.Random) -> Variants:
    return [[topic, f] for f in rng.sample(d["follow_ups"], 5)]


def _topics(kind: str, d: dict) -> list:
    if kind == "coding":
        return [["spec", s] for s in d["specs"]] + [["bug", b] for b in d["bugs"]] + [["sql", q] for q in d["sql"]]
    if kind == "math":
        return d["problems"]
    if kind == "classification":
        return ([["review", p] for p in d["products"]] + [["headline", h] for h in d["headlines"]]
                + [["message", m] for m in d["messages"]] + [["entities", p] for p in d["places"]]
                + [["items", k] for k in d["item_pools"]])
    return d["topics"]


RENDERERS: dict[str, Callable[[dict, object, random.Random], Variants]] = {
    "explanation": _explanation, "how-to": _each_template, "coding": _coding, "math": _math,
    "creative-writing": _creative, "rewriting": _each_template, "summarisation": _each_template,
    "classification": _classification, "advice": _each_template, "brainstorming": _ideas, "comparison": _compare,
    "practical-writing": _each_template, "follow-up": _followup,
}

# --------------------------------------------------------------------------------------------------------
# Assembly


def _round_robin(groups: list[Variants], limit: int, seen: set[str]) -> Variants:
    """Take prompts one topic at a time, so every topic is used before any is used twice; skip duplicates."""
    picked: Variants = []
    queues = [list(g) for g in groups]
    while len(picked) < limit and any(queues):
        for q in queues:
            while q:
                turns = q.pop()
                key = "\n\n".join(turns)
                if key not in seen:
                    seen.add(key)
                    picked.append(turns)
                    break
            if len(picked) >= limit:
                break
    return picked


def _records(prefix: str, kind: str, width: int, prompts: Variants) -> list[dict]:
    return [{"prompt_id": f"{prefix}{kind}-{n:0{width}d}", "category": kind,
             "messages": [{"role": "user", "content": t} for t in turns]} for n, turns in enumerate(prompts)]


def build_prompt_sets(seed: int = SEED) -> tuple[list[dict], list[dict]]:
    """(train, heldout) records, deterministic for a seed; held-out topics never appear in train."""
    kinds = json.loads(TEMPLATES.read_text(encoding="utf-8"))["kinds"]
    rng = random.Random(seed)
    train, heldout_pool = [], {}
    seen: set[str] = set()
    for kind, data in kinds.items():
        topics, render = _topics(kind, data), RENDERERS[kind]
        order = list(range(len(topics)))
        rng.shuffle(order)
        n_held = max(2, round(HELDOUT_TOPIC_FRACTION * len(topics)))

        def groups(idx: list[int], render=render, data=data, topics=topics) -> list[Variants]:
            out = []
            for i in idx:
                variants = render(data, topics[i], rng)
                rng.shuffle(variants)
                out.append(variants)
            return out

        train += _records("", kind, 4, _round_robin(groups(order[n_held:]), TRAIN_PER_KIND, seen))
        heldout_pool[kind] = _round_robin(groups(order[:n_held]), HELDOUT_TOTAL, seen)
    # An even share of the held-out budget per kind (the remainder to the first kinds).
    share, extra = divmod(HELDOUT_TOTAL, len(kinds))
    heldout = []
    for k, (kind, pool) in enumerate(heldout_pool.items()):
        heldout += _records("heldout-", kind, 3, pool[: share + (k < extra)])
    return _interleave(train), _interleave(heldout)


def _interleave(records: list[dict]) -> list[dict]:
    """Kinds taken in turn (first of each kind, then second of each, ...), so any prefix (`limit=N`) is varied."""
    kinds = list(dict.fromkeys(r["category"] for r in records))
    rank: dict[str, int] = {}
    keyed = []
    for r in records:
        n = rank[r["category"]] = rank.get(r["category"], -1) + 1
        keyed.append(((n, kinds.index(r["category"])), r))
    return [r for _, r in sorted(keyed, key=lambda kr: kr[0])]


def dump(records: list[dict]) -> str:
    """Records as the shipped JSON lines."""
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)


def main(argv: list[str] | None = None) -> int:
    """Regenerate the shipped prompt files (or, with --check, verify them)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    train, heldout = build_prompt_sets()
    files = {EMBEDDED_TRAIN_PROMPTS: dump(train), EMBEDDED_HELDOUT_PROMPTS: dump(heldout)}
    if "--check" in argv:
        stale = [str(p) for p, text in files.items() if not p.is_file() or p.read_text(encoding="utf-8") != text]
        if stale:
            print(f"out of date: {', '.join(stale)}; run python -m specdec.train.prompt_templates",
                  file=sys.stderr)
            return 1
        print("embedded prompt files are up to date")
        return 0
    for path, text in files.items():
        path.write_text(text, encoding="utf-8")
    print(f"wrote {len(train)} train prompts to {EMBEDDED_TRAIN_PROMPTS} and {len(heldout)} held-out prompts "
          f"to {EMBEDDED_HELDOUT_PROMPTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
