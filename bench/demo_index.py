"""Every demo run on record, one row each, read from the pages bench/demo.py wrote (docs/results/*demo*.md):

    python bench/demo_index.py     # rewrites docs/results/demos.md

A row quotes its page's summary block and its data and training lines; nothing is measured here. A page that
re-evaluated an earlier run's draft (`--skip-demo`, no data or training minutes) says so.
"""

from __future__ import annotations

import re
from pathlib import Path

from results import RESULTS  # bench/results.py (this script runs with bench/ on its path)

INDEX = RESULTS / "demos.md"
SUMMARY = "=== specdec demo: summary ==="


def _field(text: str, pattern: str) -> str:
    found = re.search(pattern, text, re.M)
    return found.group(1).strip() if found else ""


def row(page: Path) -> dict[str, str] | None:
    """One demo page's figures, or None for a page without a demo summary (scored drafts, benches at its scale)."""
    text = page.read_text()
    if SUMMARY not in text:
        return None
    minutes = dict(re.findall(r"(data|train|eval) ([\d.]+) min", _field(text, r"^time\s+(.*)$")))
    proposal = _field(text, r"^k\s+(\S+)$")
    proposal = f"k = {proposal}" if proposal else "tree " + _field(text, r"^tree\s+(.*)$")
    rerun = minutes.get("data") == "0.0" and minutes.get("train") == "0.0"
    examples, steps = _field(text, r"^- data: (\d+) examples"), _field(text, r"^- training: (\d+) steps")
    return {
        "date": _field(text, r"^- date: (.*)$"),
        "page": page.name,
        "machine": _field(text, r"^- machine: (.*)$").replace(", 2 cores", ""),
        "data": "re-evaluated" if rerun else f"{examples} ({minutes.get('data', '?')} min)",
        "training": "" if rerun else f"{steps} ({minutes.get('train', '?')} min)",
        "proposal": proposal,
        "acceptance": _field(text, r"^acceptance rate\s+([\d.]+)"),
        "speedup": _field(text, r"^speedup\s+([\d.]+x)"),
        "verdict": _field(text, r"^verdict\s+(\S+)"),
    }


def main() -> None:
    rows = [r for r in map(row, RESULTS.glob("*demo*.md")) if r is not None and r["page"] != INDEX.name]
    rows.sort(key=lambda r: (r["date"], r["page"]))
    lines = [
        "# Every demo run on record",
        "",
        "Written by `python bench/demo_index.py` from the pages `bench/demo.py` wrote; each row quotes its page (date,",
        "commit and command are there, and what changed since the run before in its reading). Acceptance is the",
        "greedy acceptance rate of the proposal the demo chose; a tree's counts accepted tokens per tree level and",
        "reads higher than a chain's with the same draft. The verdict needs acceptance >= 0.5, a speedup over the",
        "target alone in the same run >= the demo's threshold, exact output and the memory gate. Some runs tried a",
        "change that was not kept; each page's reading says which.",
        "",
        "| date | page | machine | data: examples (minutes) | training: steps (minutes) | proposal | acceptance | speedup"
        " | verdict |",
        "|---|---|---|---|---|---|---:|---:|---|",
    ]
    for r in rows:
        lines.append(f"| {r['date']} | [{r['page']}]({r['page']}) | {r['machine']} | {r['data']} | {r['training']} | {r['proposal']}"
                     f" | {r['acceptance']} | {r['speedup']} | {r['verdict']} |")
    INDEX.write_text("\n".join(lines) + "\n")
    print(f"{len(rows)} demo runs -> {INDEX}")


if __name__ == "__main__":
    main()
