"""The layout's import rules (docs/design.md), read from the source: `specdec` imports neither `specdec.train`
nor `specdec.eval`, `specdec.eval` does not import `specdec.train`, module-level imports form no cycle, project
modules are imported at the top of a module (not inside functions, where a cycle would hide), and nothing uses
the folders' own names (`train`, `eval`): those are importable from the checkout only, never once installed."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# package -> source folder: pyproject.toml's [tool.setuptools.package-dir] (test_folders_match_pyproject checks).
FOLDERS = {"specdec.train": "train", "specdec.eval": "eval", "specdec.recipes": "recipes", "specdec": "specdec"}
CORE, TRAIN, EVAL = "specdec", "specdec.train", "specdec.eval"
OLD_NAMES = ("train", "eval")  # the folder names: not packages of the install
# Folders whose Python files may import the project (all are checked for the old names).
USERS = ("tests", "bench", "scripts")
# Where a project import inside a function is the design, with the reason.
LAZY_ALLOWED = {
    # The demo runs every stage, as the `specdec` command does: it is the one module above train and eval.
    "specdec.demo": "runs data, train and publish, and eval in a process of its own",
}


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _module_name(path: Path) -> str:
    """`train/data.py` -> `specdec.train.data`, `train/plan/memory.py` -> `specdec.train.plan.memory` (an
    `__init__.py` keeps its stem: `specdec.train.__init__`)."""
    folder, *rest = path.relative_to(ROOT).with_suffix("").parts
    package = next(p for p, f in FOLDERS.items() if f == folder)
    return ".".join([package, *rest])


def _python_files(folder: str) -> list[Path]:
    """A source folder's Python files, its subpackages' included."""
    return sorted((ROOT / folder).rglob("*.py"))


def _source(name: str) -> Path | None:
    """The file of a project module or package (`specdec.train.data` -> ROOT/train/data.py), else None."""
    for package, folder in FOLDERS.items():  # the longest package first
        if _within(name, package):
            rest = name[len(package):].lstrip(".").replace(".", "/")
            for path in ([ROOT / folder / f"{rest}.py", ROOT / folder / rest / "__init__.py"] if rest
                         else [ROOT / folder / "__init__.py"]):
                if path.is_file():
                    return path
    return None


def _imports(path: Path):
    """(imported module, inside a function?) for every import of a project module, or of a folder's old name."""
    tree = ast.parse(path.read_text())
    nested = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
              for n in ast.walk(f)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names
                                     if _source(f"{node.module}.{a.name}") is not None]
        else:
            continue
        for name in names:
            if name.split(".")[0] in (CORE, *OLD_NAMES):
                yield name, id(node) in nested


def _project_imports():
    """(module, imported module, inside a function?) for every import in specdec/, train/ and eval/."""
    for folder in FOLDERS.values():
        for path in _python_files(folder):
            module = _module_name(path)
            for name, nested in _imports(path):
                yield module, name, nested


def _wrong_imports() -> list[tuple[str, str]]:
    wrong = []
    for m, n, _ in _project_imports():
        core = _within(m, CORE) and not (_within(m, TRAIN) or _within(m, EVAL))
        if n.split(".")[0] in OLD_NAMES:
            wrong.append((m, n))
        elif m not in LAZY_ALLOWED and ((core and (_within(n, TRAIN) or _within(n, EVAL)))
                                        or (_within(m, EVAL) and _within(n, TRAIN))):
            wrong.append((m, n))
    return wrong


def test_imports_go_one_way():
    wrong = _wrong_imports()
    assert not wrong, f"imports against the layout (specdec <- specdec.train, specdec <- specdec.eval): {wrong}"


def test_nothing_imports_the_folder_names():
    """`from train import x` works from the checkout (its root is on sys.path) and nowhere else."""
    old = [(str(path.relative_to(ROOT)), name) for folder in (*FOLDERS.values(), *USERS)
           for path in _python_files(folder) for name, _ in _imports(path)
           if name.split(".")[0] in OLD_NAMES]
    assert not old, f"import specdec.train / specdec.eval instead: {old}"


def _old_module_runs(path: Path) -> list[str]:
    """`-m train...` / `-m eval...` in the string constants of a file (subprocess argument lists, commands)."""
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.List, ast.Tuple)):
            items = [e.value if isinstance(e, ast.Constant) and isinstance(e.value, str) else None for e in node.elts]
            found += [b for a, b in zip(items, items[1:]) if a == "-m" and b and b.split(".")[0] in OLD_NAMES]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            words = node.value.split()
            found += [b for a, b in zip(words, words[1:]) if a == "-m" and b.split(".")[0] in OLD_NAMES]
    return found


def test_commands_run_the_installed_names():
    runs = {str(p.relative_to(ROOT)): found for folder in (*FOLDERS.values(), *USERS)
            for p in _python_files(folder) if (found := _old_module_runs(p))}
    assert not runs, f"`-m train` / `-m eval` run the checkout's folders only; use -m specdec.train: {runs}"
    from specdec.cli import COMMANDS

    for module, _, _ in COMMANDS.values():
        assert _within(module, CORE) and _source(module) is not None, module


def test_folders_match_pyproject():
    tomllib = pytest.importorskip("tomllib")
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setuptools["package-dir"] == FOLDERS
    for package in setuptools["packages"]:
        assert _source(package) is not None or package == "specdec.train.assets", package


def test_project_imports_sit_at_the_top_of_modules():
    inside = sorted({(m, n) for m, n, nested in _project_imports() if nested and m not in LAZY_ALLOWED})
    assert not inside, f"project imports inside functions (move them to the top; a cycle needs a new module): {inside}"


def test_module_level_imports_have_no_cycle():
    graph: dict[str, set[str]] = {}
    for m, n, nested in _project_imports():
        path = _source(n)
        if not nested and n != m and path is not None and path.name != "__init__.py":
            graph.setdefault(m, set()).add(n)
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])


def test_the_rules_can_fail(tmp_path, monkeypatch):
    """The walker sees each kind of violation (so a passing run means something)."""
    for folder in FOLDERS.values():
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "specdec" / "a.py").write_text("from specdec import b\n")
    (tmp_path / "specdec" / "b.py").write_text("def f():\n    from specdec.train import c\nfrom specdec import a\n")
    (tmp_path / "train" / "c.py").write_text("from specdec import a\n")
    (tmp_path / "eval" / "d.py").write_text("from specdec import train\nfrom eval import e\n")
    (tmp_path / "eval" / "e.py").write_text("import subprocess\nsubprocess.run(['python', '-m', 'train'])\n")
    (tmp_path / "eval" / "sub").mkdir()  # a subpackage's modules are walked too
    (tmp_path / "eval" / "sub" / "f.py").write_text("from specdec.train import c\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    found = set(_project_imports())
    assert ("specdec.b", "specdec.train.c", True) in found and ("specdec.a", "specdec.b", False) in found
    assert ("specdec.train.c", "specdec.a", False) in found
    assert set(_wrong_imports()) == {("specdec.b", "specdec.train"), ("specdec.b", "specdec.train.c"),
                                     ("specdec.eval.d", "specdec.train"), ("specdec.eval.d", "eval"),
                                     ("specdec.eval.sub.f", "specdec.train"), ("specdec.eval.sub.f", "specdec.train.c")}
    assert _old_module_runs(tmp_path / "eval" / "e.py") == ["train"]
    with pytest.raises(AssertionError, match="specdec.a -> specdec.b -> specdec.a"):
        test_module_level_imports_have_no_cycle()
