"""The layout's import rules (docs/design.md), read from the source: `specdec` imports neither `train` nor
`eval`, `eval` does not import `train`, module-level imports form no cycle, and project modules are imported
at the top of a module (not inside functions, where a cycle would hide)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("specdec", "train", "eval")
# Where a project import inside a function is the design, with the reason.
LAZY_ALLOWED = {
    # The demo runs every stage, as the `specdec` command does: it is the one module above train and eval.
    "specdec.demo": "runs data, train, eval and publish in one process",
}


def _project_imports():
    """(module, imported module, inside a function?) for every import of a project module."""
    for path in sorted(ROOT.glob("*/*.py")):
        if path.parts[-2] not in PACKAGES:
            continue
        module = f"{path.parts[-2]}.{path.stem}"
        tree = ast.parse(path.read_text())
        nested = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                  for n in ast.walk(f)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names
                                         if (ROOT / node.module.replace(".", "/") / f"{a.name}.py").is_file()]
            else:
                continue
            for name in names:
                if name.split(".")[0] in PACKAGES:
                    yield module, name, id(node) in nested


def test_imports_go_one_way():
    wrong = [(m, n) for m, n, _ in _project_imports()
             if m not in LAZY_ALLOWED and ((m.startswith("specdec.") and not n.startswith("specdec"))
                                            or (m.startswith("eval.") and n.startswith("train")))]
    assert not wrong, f"imports against the layout (specdec <- train, specdec <- eval): {wrong}"


def test_project_imports_sit_at_the_top_of_modules():
    inside = sorted({(m, n) for m, n, nested in _project_imports() if nested and m not in LAZY_ALLOWED})
    assert not inside, f"project imports inside functions (move them to the top; a cycle needs a new module): {inside}"


def test_module_level_imports_have_no_cycle():
    graph: dict[str, set[str]] = {}
    for m, n, nested in _project_imports():
        if not nested and n != m and (ROOT / (n.replace(".", "/") + ".py")).is_file():
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
    """The walker sees an import inside a function and a cycle (so a passing run means something)."""
    pkg = tmp_path / "specdec"
    pkg.mkdir()
    (pkg / "a.py").write_text("from specdec import b\n")
    (pkg / "b.py").write_text("def f():\n    from train import c\nfrom specdec import a\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    found = set(_project_imports())
    assert ("specdec.b", "train", True) in found and ("specdec.a", "specdec.b", False) in found
    try:
        test_module_level_imports_have_no_cycle()
    except AssertionError as err:
        assert "specdec.a -> specdec.b -> specdec.a" in str(err)
    else:
        raise AssertionError("the cycle was not found")
