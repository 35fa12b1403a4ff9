"""The report's figures (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import math
from pathlib import Path

from specdec.eval import metrics


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def per_position_acceptance(rows: list[dict], path: Path) -> None:
    """Bars of P(draft token i accepted | tokens < i accepted), one group per k or tree (batch size of the best
    row); a tree's position i is its depth i."""
    acceptance_bars([(r.get("proposal", f"k={r['num_draft_tokens']}"), r["speculative"]["per_position_acceptance"])
                     for r in rows], path)


def acceptance_bars(bars: list[tuple[str, list[float | None]]], path: Path) -> None:
    """Per-position acceptance, one bar of each (label, acceptance per position) at every position; a position no
    round reached (None) gets no bar but a grey x, so that it does not read as a rate of 0."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    width = 0.8 / max(1, len(bars))
    unreached: list[float] = []
    for j, (label, acc) in enumerate(bars):
        xs = [i + 1 + (j - (len(bars) - 1) / 2) * width for i in range(len(acc))]
        ax.bar(xs, [math.nan if a is None else a for a in acc], width=width, label=label)
        unreached += [x for x, a in zip(xs, acc) if a is None]
    if unreached:
        ax.plot(unreached, [0.02] * len(unreached), "x", color="grey", linestyle="none", label="not reached")
    ax.set_xticks(range(1, 1 + max((len(acc) for _, acc in bars), default=0)))
    ax.set_xlabel("draft position i")
    ax.set_ylabel("P(accept i | accepted < i)")
    ax.set_ylim(0, 1)
    ax.set_title("Per-position acceptance")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def latency_cdf(best: dict, path: Path) -> None:
    """Empirical CDFs of request latency, target-only vs speculative."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    proposal = best.get("proposal", f"k={best['num_draft_tokens']}")
    for mode, label in (("baseline", "target-only"), ("speculative", f"speculative ({proposal})")):
        xs, ys = metrics.cdf(best[mode]["latencies"])
        ax.step([xs[0], *xs], [0.0, *ys], where="post", label=label)
    ax.set_xlabel("request latency (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.02)
    ax.set_title(f"Latency CDF (batch size {best['batch_size']})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def speedup_vs_k(rows: list[dict], path: Path) -> None:
    """Measured and analytical speedup against k, one line pair per batch size; trees as single points at their
    depth, labelled."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    trees, rows = [r for r in rows if r.get("tree")], [r for r in rows if not r.get("tree")]
    for r in trees:
        ax.plot([r["tree_depth"]], [r["speedup"]], marker="*", markersize=10, linestyle="none",
                label=f"measured, tree {r['tree']}")
    for b in sorted({r["batch_size"] for r in rows}):
        sel = sorted((r for r in rows if r["batch_size"] == b), key=lambda r: r["num_draft_tokens"])
        ks = [r["num_draft_tokens"] for r in sel]
        line = ax.plot(ks, [r["speedup"] for r in sel], marker="o", label=f"measured, batch {b}")[0]
        ax.plot(ks, [r["analytical_speedup"] for r in sel], marker="x", linestyle="--", color=line.get_color(),
                label=f"analytical, batch {b}")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks(sorted({r["num_draft_tokens"] for r in rows} | {r["tree_depth"] for r in trees}))
    ax.set_xlabel("k (draft tokens per round)")
    ax.set_ylabel("speedup over target-only")
    ax.set_title("Speedup vs k")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def make_all(result: dict, rows: list[dict], best: dict, out_dir: Path, fmt: str = "png") -> dict[str, str]:
    """Write the three figures into out_dir; returns {name: file name}."""
    same_batch = [r for r in rows if r["batch_size"] == best["batch_size"]]
    files = {"per_position_acceptance": f"per_position_acceptance.{fmt}", "latency_cdf": f"latency_cdf.{fmt}",
             "speedup_vs_k": f"speedup_vs_k.{fmt}"}
    per_position_acceptance(same_batch, out_dir / files["per_position_acceptance"])
    latency_cdf(best, out_dir / files["latency_cdf"])
    speedup_vs_k(rows, out_dir / files["speedup_vs_k"])
    return files
