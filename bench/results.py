"""Where bench/ scripts write what they measured: docs/results/<date>-<name>.md, with the provenance a figure
needs to be checked (date, git commit, CPU model, torch, the exact command)."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"


def cpu_model() -> str:
    """The CPU's model name (lscpu's, else the platform's), its family and model numbers (a virtual machine often
    names every EPYC generation "AMD EPYC"; the numbers tell them apart) and whether it computes bf16 natively."""
    name, numbers = platform.processor() or platform.machine(), ""
    try:
        text = Path("/proc/cpuinfo").read_text()
        first = dict(line.split(":", 1) for line in text.split("\n\n")[0].splitlines() if ":" in line)
        first = {k.strip(): v.strip() for k, v in first.items()}
        name = first.get("model name", name)
        if "cpu family" in first and "model" in first:
            numbers = f"family {first['cpu family']} model {first['model']}, "
        extra = "AVX-512 + bf16" if "avx512_bf16" in text else "AVX-512" if "avx512f" in text else "AVX2" \
            if "avx2" in text else "no AVX2"
    except OSError:
        extra = "flags unknown"
    return f"{name} ({numbers}{extra}, {os.cpu_count()} cores)"


def commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=RESULTS.parents[1], timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=RESULTS.parents[1], timeout=10).stdout.strip()
        return f"{sha}{' (with uncommitted changes)' if dirty else ''}" if sha else "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def commit_of(tree) -> str:
    """The short commit a checkout (e.g. a `git worktree` of an earlier commit) is at."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=tree,
                              timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def header(title: str) -> str:
    """The provenance block every results file starts with."""
    import torch

    # settings that change what runs (SPECDEC_FAST_LINEAR=0, ...) belong to the command
    env = [f"{k}={shlex.quote(v)}" for k, v in sorted(os.environ.items()) if k.startswith("SPECDEC_")]
    command = " ".join([*env, "python", *(shlex.quote(a) for a in sys.argv)])
    return "\n".join([
        f"# {title}", "",
        f"- date: {_dt.datetime.now().strftime('%Y-%m-%d %H:%M')}",
        f"- commit: {commit()}",
        f"- machine: {cpu_model()}",
        f"- torch {torch.__version__}, {torch.get_num_threads()} threads",
        f"- command: `{command}`", "", ""])


def write(name: str, title: str, body: str, provenance: str | None = None) -> Path:
    """docs/results/<date>-<name>.md holding the provenance header (`header(title)` now, or the one a long run
    took when it started, before the tree could change) and `body` (markdown); returns the path."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{_dt.date.today().isoformat()}-{name}.md"
    path.write_text((provenance or header(title)) + body.rstrip() + "\n")
    return path
