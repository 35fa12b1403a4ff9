"""What `pip install specdec` puts into site-packages: one top-level package, `specdec`, with the train/, eval/ and
recipes/ folders inside it as `specdec.train`, `specdec.eval` and `specdec.recipes` (pyproject.toml's package-dir),
never top-level `train` or `eval` packages that would collide with users' own modules (`eval` would also shadow the
builtin); and that the installed command runs from another folder, finding its recipe and prompt sets in the
install (`specdec demo --quick --plan`; CI runs the whole quick demo the same way: `make wheel-demo`).

scripts/wheel_venv.py builds the wheel from a copy of the sources (no build/ left in the checkout) and installs it
with --no-deps into a fresh venv: one that sees nothing of this one (files only, no torch there), and one whose
dependencies come from this venv's site-packages through plain path lines (its editable install stays inactive)."""

from __future__ import annotations

import importlib.util
import os
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# source folder -> in the wheel
FOLDERS = {"specdec": "specdec", "train": "specdec/train", "eval": "specdec/eval", "recipes": "specdec/recipes"}
_spec = importlib.util.spec_from_file_location("wheel_venv", ROOT / "scripts" / "wheel_venv.py")
wheel_venv = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(wheel_venv)
_run = wheel_venv.run


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    pytest.importorskip("setuptools")  # --no-build-isolation builds with this venv's setuptools (no index needed)
    return wheel_venv.build_wheel(tmp_path_factory.mktemp("wheel"))


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
                 "specdec/train/assets/prompts_train.jsonl", "specdec/train/assets/prompts_heldout.jsonl",
                 "specdec/recipes/smollm2-135m-quick.yaml", "specdec/recipes/accelerate/cpu.yaml"):
        assert need in names


def test_installed_wheel_adds_one_top_level_name(wheel, tmp_path):
    venv = tmp_path / "venv"
    purelib = wheel_venv.install(wheel, venv, dependencies=False)  # plain: no system site-packages, no dev install
    python = venv / "bin" / "python"
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


def test_installed_wheel_runs_the_demo_from_another_folder(wheel, tmp_path):
    """The installed `specdec` command, run where there is no checkout, imports the wheel's specdec and finds the
    quick demo's recipe and prompt sets inside the install: `demo --plan` loads every stage's config and reads
    the prompt sets each stage would (the whole demo is CI's `make wheel-demo`, minutes on 2 cores)."""
    venv, elsewhere = tmp_path / "venv", tmp_path / "elsewhere"
    purelib = wheel_venv.install(wheel, venv)
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    python = venv / "bin" / "python"
    found = _run(python, "-c", "import specdec, torch; print(specdec.__file__)", cwd=elsewhere,
                 env=env).stdout.strip()
    assert found == str(purelib / "specdec" / "__init__.py")
    shown = _run(venv / "bin" / "specdec", "demo", "--quick", "--plan", cwd=elsewhere, env=env).stdout
    lines = {line.split()[0]: line for line in shown.splitlines() if line.strip()}
    assert lines["recipe"].split()[-1] == str(purelib / "specdec" / "recipes" / "smollm2-135m-quick.yaml")
    assert f"8 prompts from {purelib / 'specdec' / 'train' / 'assets' / 'prompts_heldout.jsonl'}" in shown
    assert "48 prompts from embedded:train" in shown
    assert not (elsewhere / "outputs").exists()  # a plan writes nothing
    usage = _run(venv / "bin" / "specdec", "--help", cwd=elsewhere, env=env).stdout
    assert str(purelib / "specdec" / "recipes") in usage and "smollm2-135m-quick" in usage
