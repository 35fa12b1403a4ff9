"""Running a bench child process on another checkout's code (a `git worktree` of an earlier commit, say).

The editable install maps `specdec.train` to this checkout whatever PYTHONPATH says, so a child that is to measure
another checkout's trainer starts with `PREAMBLE`: it drops that mapping and loads specdec and train/ from the
checkout it runs in (its working directory).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

PREAMBLE = """
import importlib.util, os, sys
sys.meta_path = [f for f in sys.meta_path if "editable" not in type(f).__name__.lower()]
import specdec
_tree = os.getcwd()
_spec = importlib.util.spec_from_file_location("specdec.train", _tree + "/train/__init__.py",
                                               submodule_search_locations=[_tree + "/train"])
_module = importlib.util.module_from_spec(_spec)
sys.modules["specdec.train"] = _module
_spec.loader.exec_module(_module)
assert specdec.__file__.startswith(_tree) and _module.__file__.startswith(_tree), (specdec.__file__, _tree)
"""


def run_child(tree: Path, source: str, settings: dict, env: dict | None = None, timeout: float = 3600) -> str:
    """Run `PREAMBLE + source` with `tree`'s code, `settings` as JSON in argv[1]; returns its stdout."""
    env = dict(os.environ, **(env or {}), PYTHONPATH=str(tree))
    proc = subprocess.run([sys.executable, "-c", PREAMBLE + source, json.dumps(settings)], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"child in {tree} failed:\n{proc.stderr[-3000:]}")
    return proc.stdout


def last_figure(stdout: str, tag: str) -> float:
    """The number after `tag` on the child's last line that starts with it."""
    return float([line for line in stdout.splitlines() if line.startswith(tag)][-1].split()[1])
