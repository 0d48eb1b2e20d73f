"""The package's import graph: every file imports only downward -- no cycles (counting imports inside
functions too), and no import that runs up the layers: each concern imports only the ones below it;
the library never imports the applications; the documented doors (``multihead.compat``,
``multihead.distributed``) are for users, not used inside; every documented import path works."""

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


def test_no_import_cycle():
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


#: the concerns, bottom up: a module may import its own concern and those below (see ARCHITECTURE.md)
LAYERS = [
    ("multihead.masks", "multihead.extras", "multihead.core.validation", "multihead.timing"),  # vocabulary, optional
    # deps, input checks, timings that hold still
    ("multihead.backends",),  # ways of computing attention
    ("multihead.core",),  # functional attention, padding, varlen, ring attention
    ("multihead.layer",),  # the module, its plan, hooks, cache, the course's modules, the drop-in
    ("multihead.viz", "multihead.quantize"),  # pictures and int8 layers: no model knowledge
    ("multihead.heads",),  # capture, gates, importance, surgery, pruning
    ("multihead.interop", "multihead.models"),  # other implementations' weights; small models built from ours
    ("multihead.hf",),  # transformers
    ("multihead.deploy",),  # where prediction happens: one room per runtime, the checks, the peers, the table
    ("multihead.grader",),  # the grader
    ("multihead.apps", "multihead.examples"),  # the applications
]
DOORS = {"multihead", "multihead.compat", "multihead.distributed"}
#: names the documentation imports from a floor below the one that holds them ({door: the modules it re-exports}):
#: imported inside the door's module ``__getattr__`` only (or for type checkers), so the lower floor never loads
#: the upper one when it is imported (tests below)
REEXPORTS = {"multihead.hf": {"multihead.deploy.fastembed", "multihead.deploy.folder", "multihead.deploy.onnx"}}


def _layer(name: str) -> int:
    best = None
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if name == p or name.startswith(p + "."):
                if best is None or len(p) > best[1]:
                    best = (i, len(p))
    assert best is not None, f"{name} belongs to no layer: add it to LAYERS (and ARCHITECTURE.md)"
    return best[0]


def test_no_import_runs_up_the_layers():
    graph = _graph()
    up = {n: sorted(d for d in deps if d not in DOORS and _layer(d) > _layer(n) and d not in REEXPORTS.get(n, ()))
          for n, deps in graph.items() if n not in DOORS}
    assert not {n: d for n, d in up.items() if d}, "imports that run up the layers"


def test_reexports_are_imported_only_when_asked_for():
    """A door's re-export of an upper floor's names (:data:`REEXPORTS`) sits in its module ``__getattr__`` or under
    ``if TYPE_CHECKING``, nowhere else: importing the lower floor never imports the upper one."""
    for door, upper in REEXPORTS.items():
        tree = ast.parse((ROOT.parent / (door.replace(".", "/") + "/__init__.py")).read_text())
        lazy = set()
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name == "__getattr__" or \
                    isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
                lazy |= {id(n) for n in ast.walk(node)}
        floors = {u.rsplit(".", 1)[0] for u in upper}  # multihead.deploy.onnx -> multihead.deploy
        eager = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module and id(n) not in lazy
                 and any(n.module == f or n.module.startswith(f + ".") for f in floors)]
        assert not eager, f"{door} imports {sorted(upper)} at import time (lines {eager})"


def test_the_doors_are_not_used_inside_the_package():
    graph = _graph()
    inside = {n: sorted(d for d in deps if d in DOORS - {"multihead"}) for n, deps in graph.items() if n not in DOORS}
    assert not {n: d for n, d in inside.items() if d}


def test_every_documented_import_path_works():
    """Each import path the README, the documentation's pages and the notebook use (the doors included) imports,
    and the names they import from it exist."""
    import importlib
    import json
    import re

    root = ROOT.parent.parent
    texts = [(root / "README.md").read_text()] + [p.read_text() for p in sorted((root / "docs").rglob("*.md"))]
    nb = json.loads((root / "examples" / "course.ipynb").read_text())
    texts += ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]
    seen = set()
    for text in texts:
        for mod, names in re.findall(r"from (multihead[\w.]*) import ([\w, ]+)", text):
            for nm in [n.strip().split(" as ")[0] for n in names.split(",") if n.strip()]:
                seen.add((mod, nm))
        for mod in re.findall(r"import (multihead[\w.]*)", text):
            seen.add((mod, None))
    assert len(seen) > 20
    for mod, nm in sorted(seen, key=str):
        m = importlib.import_module(mod)
        if nm is not None:
            assert hasattr(m, nm) or importlib.util.find_spec(f"{mod}.{nm}") is not None, f"from {mod} import {nm}"


#: the floors of ``multihead.apps``, bottom up: a command's folder imports its own room, the shared room and the
#: floors below; rooms on one floor never import each other (see ARCHITECTURE.md)
APPS = [
    ("multihead.apps.common",),  # what two commands share: the text they run on, the course's checkpoints
    ("multihead.apps.prune",),  # prune; its transformers set-up (hf_models: load, tokenizer, pooling) serves those above
    ("multihead.apps.bench", "multihead.apps.patch", "multihead.apps.check", "multihead.apps.viz"),  # the commands
    ("multihead.apps.demo",),  # the course's two models trained (viz draws them), drawn and pruned (prune's methods)
    ("multihead.apps.cli", "multihead.apps"),  # the dispatch (the parsed arguments to the command's folder)
]


def _room(name: str) -> tuple[int, str]:
    """(floor, room) of a module of ``multihead.apps``: the longest prefix of :data:`APPS` it falls under."""
    best = None
    for i, prefixes in enumerate(APPS):
        for p in prefixes:
            if (name == p or name.startswith(p + ".")) and (best is None or len(p) > len(best[1])):
                best = (i, p)
    assert best is not None, f"{name} belongs to no room of multihead.apps: add it to APPS (and ARCHITECTURE.md)"
    return best


def test_each_command_imports_only_its_room_and_the_floors_below():
    graph = _graph()
    wrong = {}
    for n, deps in graph.items():
        if not n.startswith("multihead.apps"):
            continue
        floor, room = _room(n)
        bad = sorted(d for d in deps if d.startswith("multihead.apps") and (
            _room(d)[0] > floor or _room(d)[0] == floor and _room(d)[1] != room and floor < len(APPS) - 1))
        if bad:
            wrong[n] = bad
    assert not wrong, f"imports that run up or across the commands' floors: {wrong}"


def test_prune_calls_its_target_search_and_is_never_called_back():
    """``apps/prune/target.py`` (what ``--target-*`` asks: the search, its refusals, its lines) sits below
    ``pruning.py``: it imports no other module of the applications, so following prune's options runs one way."""
    graph = _graph()
    assert not {d for d in graph["multihead.apps.prune.target"] if d.startswith("multihead.apps")}
    assert "multihead.apps.prune.target" in graph["multihead.apps.prune.pruning"]


def test_each_runtime_room_holds_its_peers_below_their_index():
    """Each runtime's room makes its own peers' standard files; ``deploy/peers.py`` lists them (``standard_files``)
    and only the runtime table (``deploy/compare.py``) stands on it inside ``multihead.deploy``."""
    graph = _graph()
    rooms = {"onnx", "openvino"}  # the encoder rooms whose standard files the index lists
    assert {f"multihead.deploy.{r}" for r in rooms} <= graph["multihead.deploy.peers"]
    above = sorted(n for n, deps in graph.items() if "multihead.deploy.peers" in deps and n.startswith("multihead.deploy"))
    assert above == ["multihead.deploy.compare"], above


BENCH = ROOT.parent.parent / "bench"


def _private(tree, modules: set[str]) -> list[int]:
    """The lines of ``tree`` that read a private attribute (``_x``, not ``__x__``) through a name in ``modules``."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            attrs, base = [node.attr], node.value
            while isinstance(base, ast.Attribute):
                attrs.append(base.attr)
                base = base.value
            if isinstance(base, ast.Name) and base.id in modules and \
                    any(a.startswith("_") and not a.startswith("__") for a in attrs):
                lines.append(node.lineno)
    return lines


def test_bench_scripts_call_the_library_by_its_public_names_and_write_their_tables():
    """``bench/`` is for measurements (ARCHITECTURE.md): each script is named for its table (no helper modules),
    writes it under ``bench/results/``, takes nothing from ``tests/`` but its corpora (constants in capitals: the
    grader's hostile submissions a platform bench grades; never a test's helper or fixture) and reaches no private
    name of multihead (``from multihead.x import _y``, or ``m._y`` through a name bound by an import of multihead)."""
    for path in sorted(BENCH.glob("*.py")):
        text = path.read_text()
        tree = ast.parse(text)
        assert not path.name.startswith("_"), f"bench/{path.name}: a helper, not a table (its code goes into src/)"
        assert "results" in text, f"bench/{path.name} writes nothing into bench/results/"
        bound = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [(a.name, a.asname or a.name.split(".")[0]) for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [(f"{node.module}.{a.name}", a.asname or a.name) for a in node.names]
            else:
                continue
            for full, local in names:
                corpus = isinstance(node, ast.ImportFrom) and local.isupper()  # a test file's data, by name
                assert corpus or not full.split(".")[0].startswith(("test_", "tests")), \
                    f"bench/{path.name}:{node.lineno} imports {full}"
                if full.split(".")[0] == "multihead":
                    assert not full.split(".")[-1].startswith("_"), f"bench/{path.name}:{node.lineno} imports {full}"
                    bound.add(local)
        assert not _private(tree, bound), f"bench/{path.name} reads private names at lines {_private(tree, bound)}"


def _imports(tree) -> list[tuple[str, int, bool]]:
    """Every import of ``tree`` as (name, line, at import time: outside any function); ``from m import x`` is
    ``m.x``."""
    inside = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
              for n in ast.walk(f)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno, id(node) not in inside) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            found += [(f"{node.module}.{a.name}", node.lineno, id(node) not in inside) for a in node.names]
    return found


def test_the_parser_is_the_top_floor():
    """``multihead_cli`` (the command's arguments, parsed without torch) imports nothing of ``multihead`` when it is
    imported, and after parsing only the dispatch (``multihead.apps.cli``); nothing in ``multihead`` imports the
    parser: the two make no circle."""
    parser = ROOT.parent / "multihead_cli"
    for path in sorted(parser.rglob("*.py")):
        for mod, line, eager in _imports(ast.parse(path.read_text())):
            if mod.split(".")[0] == "multihead":
                assert not eager, f"{path.name}:{line} imports {mod} when the parser is imported (it must stay torch-free)"
                assert mod.startswith("multihead.apps.cli"), \
                    f"{path.name}:{line} imports {mod}: the parser reaches the package through multihead.apps.cli.run only"
    users = sorted(f"{p.relative_to(ROOT.parent)}:{line}" for p in ROOT.rglob("*.py")
                   for mod, line, _ in _imports(ast.parse(p.read_text())) if mod.split(".")[0] == "multihead_cli")
    assert not users, f"the package imports the parser (a circle with multihead_cli): {users}"


def test_the_library_never_imports_the_applications():
    graph = _graph()
    offenders = {n: sorted(d for d in deps if d.startswith("multihead.apps"))
                 for n, deps in graph.items() if not n.startswith("multihead.apps")}
    assert not {n: d for n, d in offenders.items() if d}


def _sys_path(node) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name) and \
        node.value.id == "sys"


def test_no_sys_path_edits_in_the_package():
    """Nothing assigns to sys.path, its items, or calls a method on it (insert, append, ...); reading it is fine
    (the grader's sandbox allows reads of the import path's folders)."""
    for p in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
                if isinstance(node, ast.AugAssign | ast.AnnAssign) else []
            edited = any(_sys_path(t) or isinstance(t, ast.Subscript) and _sys_path(t.value) for t in targets)
            edited |= isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and _sys_path(node.func.value)
            assert not edited, f"{p}:{node.lineno} edits sys.path"


#: the signatures that mirror another library's contract, positional arguments and all: transformers'
#: attention-function interface and torch.nn.MultiheadAttention / TransformerEncoderLayer's
MIRRORS = {("multihead.hf.attention", "attention_forward"), ("multihead.layer.dropin", "forward"),
           ("multihead.layer.dropin", "__init__"), ("multihead.hf.forms", "bloom_attention_forward"),
           ("multihead.deploy.compare", "_math_sdpa"),  # F.scaled_dot_product_attention's signature, written out
           ("multihead.apps.bench.course", "__init__")}  # the course's MultiHeadAttention, as the chapter writes it


def _functions():
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield _module_name(path), node


def test_functions_are_small_and_their_arguments_named():
    """No library function over 60 lines; none taking more than 6 positional arguments (beyond self) except
    the mirrors of another library's signature -- more go in a record or are passed by name."""
    long = [f"{mod}.{n.name} ({n.end_lineno - n.lineno + 1} lines)" for mod, n in _functions()
            if n.end_lineno - n.lineno + 1 > 60]
    assert not long, long
    wide = []
    for mod, n in _functions():
        a = n.args
        positional = len(a.posonlyargs) + len(a.args) - (1 if a.args and a.args[0].arg in ("self", "cls") else 0)
        if positional > 6 and (mod, n.name) not in MIRRORS:
            wide.append(f"{mod}.{n.name} ({positional} positional)")
    assert not wide, wide


def test_each_class_name_means_one_thing():
    """No class name is defined in two files of the package (the parser included): a reader who finds ``Options`` or
    ``Plan`` knows which one it is."""
    where: dict[str, set[str]] = {}
    for path in [*ROOT.rglob("*.py"), *(ROOT.parent / "multihead_cli").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                where.setdefault(node.name, set()).add(str(path.relative_to(ROOT.parent)))
    twice = {name: sorted(files) for name, files in where.items() if len(files) > 1}
    assert not twice, f"class names defined in two files: {twice}"
