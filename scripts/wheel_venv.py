"""specdec as `pip install` gives it to a user: the wheel, built from a copy of the sources (no build/ left in the
checkout), installed with --no-deps into a fresh venv.

    .venv/bin/python scripts/wheel_venv.py DIR    # writes DIR/specdec-*.whl and DIR/venv; prints DIR/venv/bin/specdec

The fresh venv takes its dependencies (torch, transformers, the embedded target's package, ...) from the running
interpreter's site-packages, named one a line in a .pth file: a plain path line adds the folder without running the
.pth files inside it, so the checkout's editable install (a .pth file there) stays inactive and the venv imports
the wheel's specdec. Used by tests/test_wheel.py and by CI (`make wheel-demo`: the quick demo from another folder).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# What the build reads: pyproject.toml's package-dir folders and the readme it names.
SOURCES = ("pyproject.toml", "README.md", "specdec", "train", "eval", "recipes")


def run(*cmd, cwd=None, env=None) -> subprocess.CompletedProcess:
    """Run a command, raising with the end of its output when it fails."""
    done = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode:
        raise RuntimeError(f"{cmd} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done


def build_wheel(out: Path) -> Path:
    """The wheel of the checkout's current sources, in `out`, built with this interpreter's setuptools (no index)."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp)
        for name in SOURCES:
            if (ROOT / name).is_dir():
                shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
            else:
                shutil.copy2(ROOT / name, src / name)
        run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w", out,
            src)
    (wheel,) = Path(out).glob("specdec-*.whl")
    return wheel


def dependency_folders() -> list[str]:
    """The running interpreter's site-packages folders, those its .pth files added included."""
    return [p for p in sys.path if Path(p).name in ("site-packages", "dist-packages") and Path(p).is_dir()]


def install(wheel: Path, venv: Path, dependencies: bool = True) -> Path:
    """A fresh venv at `venv` holding `wheel` (and, with `dependencies`, a path line to each of this
    interpreter's site-packages folders). -> the venv's site-packages folder"""
    run(sys.executable, "-m", "venv", "--without-pip", venv)
    python = venv / "bin" / "python"
    run(sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", "--no-index", wheel)
    purelib = Path(run(python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))").stdout.strip())
    if dependencies:
        (purelib / "specdec_dependencies.pth").write_text("".join(f"{p}\n" for p in dependency_folders()))
    return purelib


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    out = Path(argv[0]).resolve()
    out.mkdir(parents=True, exist_ok=True)
    install(build_wheel(out), out / "venv")
    print(out / "venv" / "bin" / "specdec")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
