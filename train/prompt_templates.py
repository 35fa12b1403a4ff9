"""The embedded prompt set: varied instruction prompts written for this project, rendered from the templates and
topic lists in train/assets/prompt_templates.json.

    python -m specdec.train.prompt_templates          # regenerate train/assets/prompts_{train,heldout}.jsonl
    python -m specdec.train.prompt_templates --check  # exit 1 when the shipped files differ from the render

Sixteen kinds of task: explanation, how-to, coding, math, creative-writing, rewriting, summarisation (short
texts), classification, advice, brainstorming, comparison, practical-writing, follow-up, translation (short passages
between English and French, German, Spanish, Italian or Portuguese, both ways), reading-comprehension (a question on
a given text of 80-200 words) and long-summarisation (documents of 300-600 words, built from paragraph templates over
a scenario's slots). Every kind's topics are split once (seeded) into train topics and held-out topics, so the
held-out prompts are about things the train prompts never mention, not merely rewordings of them. The first
thirteen kinds share one seeded stream; each later kind has its own, so adding a kind changes no other's prompts.
Records: {"prompt_id", "category", "messages": [user turns]}; a `follow-up` record has two user turns (the target
answers the first, then the second after its own answer). All of this text was written for this project: none comes
from MT-Bench or Spec-Bench (tests/test_data.py checks) or any other benchmark's questions. The shipped .jsonl files
are what runs read; this module only makes them.
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
HELDOUT_TOTAL = 183  # an even share per kind, the remainder to the first kinds: 11 each, 12 for the first 7
HELDOUT_TOPIC_FRACTION = 0.12
# These kinds draw from one seeded stream, in this order (the set's first kinds); every later kind draws from its
# own stream, seeded by (seed, kind), so adding a kind leaves every other kind's prompts unchanged.
SHARED_STREAM_KINDS = ("explanation", "how-to", "coding", "math", "creative-writing", "rewriting", "summarisation",
                       "classification", "advice", "brainstorming", "comparison", "practical-writing", "follow-up")

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


def _translation(d: dict, topic: list, rng: random.Random) -> Variants:
    """An English passage into four of the other languages; another language's passage into English (three
    English requests and one written in the passage's own language)."""
    src, text = topic
    if src == "English":
        return [[rng.choice(d["templates"]).format(src=src, dst=dst, t=text)] for dst in rng.sample(d["languages"], 4)]
    asks = [[t.format(src=src, dst="English", t=text)] for t in rng.sample(d["templates"], 3)]
    return asks + [[d["native_templates"][src].format(t=text)]]


def _reading(d: dict, topic: dict, rng: random.Random) -> Variants:
    return [[t.format(p=topic["text"], q=q)] for q in topic["questions"] for t in rng.sample(d["templates"], 2)]


def _long_documents(d: dict, topic: dict, rng: random.Random) -> Variants:
    """One scenario written up as each kind of document (paragraph templates over the scenario's slots; a slot
    capitalised, {Slot}, starts a sentence), each asked for with two summary requests."""
    slots = {**topic, **{k[0].upper() + k[1:]: v[0].upper() + v[1:] for k, v in topic.items()}}
    out = []
    for kind, paragraphs in d["documents"].items():
        doc = "\n\n".join(p.format(**slots) for p in paragraphs)
        out += [[t.format(doc=doc, kind=kind, audience=topic["audience"])] for t in rng.sample(d["templates"], 2)]
    return out


def _topics(kind: str, d: dict) -> list:
    if kind == "coding":
        return [["spec", s] for s in d["specs"]] + [["bug", b] for b in d["bugs"]] + [["sql", q] for q in d["sql"]]
    if kind == "math":
        return d["problems"]
    if kind == "translation":
        return d["passages"]
    if kind == "classification":
        return ([["review", p] for p in d["products"]] + [["headline", h] for h in d["headlines"]]
                + [["message", m] for m in d["messages"]] + [["entities", p] for p in d["places"]]
                + [["items", k] for k in d["item_pools"]])
    return d["topics"]


RENDERERS: dict[str, Callable[[dict, object, random.Random], Variants]] = {
    "explanation": _explanation, "how-to": _each_template, "coding": _coding, "math": _math,
    "creative-writing": _creative, "rewriting": _each_template, "summarisation": _each_template,
    "classification": _classification, "advice": _each_template, "brainstorming": _ideas, "comparison": _compare,
    "practical-writing": _each_template, "follow-up": _followup, "translation": _translation,
    "reading-comprehension": _reading, "long-summarisation": _long_documents,
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
    shared = random.Random(seed)
    share, extra = divmod(HELDOUT_TOTAL, len(kinds))  # an even share of the held-out budget per kind
    train, heldout = [], []
    seen: set[str] = set()
    for k, (kind, data) in enumerate(kinds.items()):
        rng = shared if kind in SHARED_STREAM_KINDS else random.Random(f"{seed}:{kind}")
        topics, render = _topics(kind, data), RENDERERS[kind]
        order = list(range(len(topics)))
        rng.shuffle(order)
        n_held = max(2, round(HELDOUT_TOPIC_FRACTION * len(topics)))

        def groups(idx: list[int], render=render, data=data, topics=topics, rng=rng) -> list[Variants]:
            out = []
            for i in idx:
                variants = render(data, topics[i], rng)
                rng.shuffle(variants)
                out.append(variants)
            return out

        train += _records("", kind, 4, _round_robin(groups(order[n_held:]), TRAIN_PER_KIND, seen))
        heldout += _records("heldout-", kind, 3, _round_robin(groups(order[:n_held]), share + (k < extra), seen))
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
