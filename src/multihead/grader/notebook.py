"""A learner's notebook (.ipynb) as the definitions a grader imports: its code cells' imports, functions, classes
and plain assignments, run in order in one namespace -- never its training loops, plots or shell lines.

The course is taught in notebooks, and a submission is often the notebook itself. Running it whole would train,
download data and draw before the grader sees the class. What is kept, cell by cell:

- ``import`` / ``from ... import`` statements (a ``try`` holding only imports too);
- ``def``, ``async def`` and ``class`` statements;
- assignments (``d_model = 32``, ``device = torch.device("cpu")``), except those calling a name the notebook
  itself binds (``model = MultiHeadAttention(...)``, ``history = model.fit(...)``): the notebook's own work.

Everything else -- expressions (``train(model)``, ``plt.show()``), loops, ``with`` and ``if`` blocks -- is left out,
and so are IPython's ``%magic`` and ``!shell`` lines (``%%`` cells whole). An assignment that raises is skipped
(the class that needs its name says so when it is built); an import that raises is the submission's error.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

__all__ = ["cells", "run"]


def cells(path: str | Path) -> list[tuple[int, str]]:
    """(cell number, counting every cell from 1 as the notebook shows them; source) of the code cells, IPython's
    magic and shell lines left out (a ``%%`` cell whole). A file that is not a notebook raises ValueError naming
    it."""
    try:
        nb = json.loads(Path(path).read_text(encoding="utf-8"))
        raw = [(i, c) for i, c in enumerate(nb["cells"], 1) if c.get("cell_type") == "code"]
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as e:
        raise ValueError(f"{Path(path).name} is not a Jupyter notebook (nbformat 4 JSON with cells): {e}") from None
    out = []
    for i, c in raw:
        src = c.get("source", "")
        src = "".join(src) if isinstance(src, list) else str(src)
        if src.lstrip().startswith("%%"):
            continue
        out.append((i, "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in src.split("\n"))))
    return out


def _binds(tree: ast.Module) -> set[str]:
    """Names the notebook binds by its own definitions and assignments (not by imports)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return names


def _root(func: ast.expr) -> str | None:
    while isinstance(func, ast.Attribute | ast.Call | ast.Subscript):
        func = func.value if not isinstance(func, ast.Call) else func.func
    return func.id if isinstance(func, ast.Name) else None


def _kept(node: ast.stmt, own: set[str]) -> bool:
    if isinstance(node, ast.Import | ast.ImportFrom | ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return True
    if isinstance(node, ast.Try):
        return all(isinstance(n, ast.Import | ast.ImportFrom) for n in node.body)
    if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
        return not any(isinstance(n, ast.Call) and _root(n.func) in own for n in ast.walk(node.value))
    return False


def run(path: str | Path, namespace: dict) -> None:
    """The notebook's definitions (see the module's docstring) executed into ``namespace``, cell by cell; a cell
    that does not parse raises its SyntaxError, an import its error, with ``<file> cell N`` as the file name."""
    trees = [(i, ast.parse(src, filename=f"{Path(path).name} cell {i}")) for i, src in cells(path)]
    own = set().union(*(_binds(t) for _, t in trees)) if trees else set()
    for i, tree in trees:
        for node in tree.body:
            if not _kept(node, own):
                continue
            code = compile(ast.Module(body=[node], type_ignores=[]), f"{Path(path).name} cell {i}", "exec")
            if isinstance(node, ast.Assign | ast.AnnAssign):
                try:
                    exec(code, namespace)  # noqa: S102 - the learner's notebook, inside the sandbox
                except Exception:  # noqa: BLE001 - a value the class may not need (a dataset, a file)
                    continue
            else:
                exec(code, namespace)  # noqa: S102
