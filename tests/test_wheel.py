"""What `pip install specdec` puts into site-packages: one top-level package, `specdec`, with the train/ and eval/
folders inside it as `specdec.train` and `specdec.eval` (pyproject.toml's package-dir), never top-level `train` or
`eval` packages that would collide with users' own modules (`eval` would also shadow the builtin).

Builds the wheel from a copy of the sources (no build/ left in the checkout), installs it with --no-deps into a
fresh venv that sees nothing of this one, and reads files only (no torch there)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"specdec": "specdec", "train": "specdec/train", "eval": "specdec/eval"}  # source folder -> in the wheel


def _run(*cmd, cwd=None):
    done = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{cmd} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    pytest.importorskip("setuptools")  # --no-build-isolation builds with this venv's setuptools (no index needed)
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for folder in FOLDERS:
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = tmp_path_factory.mktemp("wheel")
    _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w", out,
         src)
    (found,) = out.glob("specdec-*.whl")
    return found


def _sources(folder: str) -> set[str]:
    return {str(p.relative_to(ROOT / folder)) for p in (ROOT / folder).rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"}


def test_wheel_holds_specdec_only_with_train_and_eval_inside(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        (top_level,) = [n for n in names if n.endswith(".dist-info/top_level.txt")]
        assert z.read(top_level).decode().split() == ["specdec"]
    assert {n.split("/")[0] for n in names} == {"specdec", wheel.name.split("-py")[0] + ".dist-info"}
    for folder, inside in FOLDERS.items():
        # every source file ships, the train assets (jsonl) and the vLLM worker script included
        missing = {f for f in _sources(folder) if f"{inside}/{f}" not in names}
        assert not missing, f"{folder}/ files missing from the wheel: {sorted(missing)}"
    for need in ("specdec/train/__init__.py", "specdec/eval/__init__.py", "specdec/train/vllm_worker.py",
                 "specdec/train/assets/prompts_train.jsonl", "specdec/train/assets/prompts_heldout.jsonl"):
        assert need in names


def test_installed_wheel_adds_one_top_level_name(wheel, tmp_path):
    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", "--without-pip", venv)  # plain: no system site-packages, no dev install
    python = venv / "bin" / "python"
    _run(sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", "--no-index", wheel)
    purelib = Path(_run(python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))").stdout.strip())
    assert sorted(p.name for p in purelib.iterdir()) == ["specdec", "specdec-0.1.0.dist-info"]
    assert (venv / "bin" / "specdec").is_file()
    for folder, inside in FOLDERS.items():
        assert _sources(folder) <= {str(p.relative_to(purelib / inside)) for p in (purelib / inside).rglob("*")}
    # Found where the console script will look, with the checkout out of sight (cwd elsewhere); a spec lookup
    # of a submodule would import specdec (and so torch, absent here), hence the path-based finder.
    probe = ("import sys; from importlib.machinery import PathFinder as F\n"
             "sp = F.find_spec('specdec'); loc = sp.submodule_search_locations\n"
             "print(F.find_spec('train') is None, F.find_spec('eval') is None,\n"
             "      F.find_spec('specdec.train', loc).origin, F.find_spec('specdec.eval', loc).origin)")
    found = _run(python, "-I", "-c", probe, cwd=tmp_path).stdout.split()
    assert found[:2] == ["True", "True"]
    assert found[2:] == [str(purelib / "specdec" / "train" / "__init__.py"),
                         str(purelib / "specdec" / "eval" / "__init__.py")]
