"""The package's import graph: every file imports only downward (no cycles, counting
imports inside functions too), and the library never imports the applications."""

from __future__ import annotations

import ast
from pathlib import Path

import multihead

ROOT = Path(multihead.__file__).parent


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.split(".")[0] == "multihead"}
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "multihead":
                for a in node.names:  # `from multihead.x import y`: y is a submodule, or a name in x
                    sub = f"{node.module}.{a.name}"
                    deps.add(sub if sub in files else node.module)
        graph[name] = {d for d in deps if d in files and d != name}
    return graph


def test_no_import_runs_back_up():
    graph = _graph()
    state: dict[str, int] = {}

    def visit(n, stack):
        if state.get(n) == 1:
            cycle = stack[stack.index(n):] + [n]
            raise AssertionError("import cycle: " + " -> ".join(cycle))
        if state.get(n) == 2:
            return
        state[n] = 1
        for d in sorted(graph[n]):
            visit(d, stack + [n])
        state[n] = 2

    for n in sorted(graph):
        visit(n, [])


def test_the_library_never_imports_the_applications():
    graph = _graph()
    offenders = {n: sorted(d for d in deps if d.startswith("multihead.apps"))
                 for n, deps in graph.items() if not n.startswith("multihead.apps")}
    assert not {n: d for n, d in offenders.items() if d}


def test_no_sys_path_edits_in_the_package():
    for p in ROOT.rglob("*.py"):
        assert "sys.path" not in p.read_text(), p
