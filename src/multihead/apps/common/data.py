"""Text that ships with Python itself: English sentences from ``pydoc_data.topics`` (the help text
of the language reference) and from the docstrings of the standard library's modules, classes and
functions (read from the source files, nothing imported). No download, same on every machine with the
same Python."""

from __future__ import annotations

import functools
import re


def sentences(n: int | None = None, *, min_chars: int = 40, max_chars: int = 200) -> list[str]:
    """Up to ``n`` distinct English sentences, in a fixed order (about 970 on Python 3.11)."""
    import pydoc_data.topics as topics

    text = re.sub(r"\s+", " ", " ".join(topics.topics[k] for k in sorted(topics.topics)))
    seen, out = set(), []
    for s in re.split(r"(?<=[.!?])\s+", text):
        if _usable(s, min_chars, max_chars) and s not in seen:
            seen.add(s)
            out.append(s)
    return out if n is None else out[:n]


def _usable(s: str, min_chars: int, max_chars: int) -> bool:
    return (min_chars <= len(s) <= max_chars and s[0].isupper() and not re.search(r"[>{}=\[\]_\\|*]", s))


#: standard-library folders whose docstrings are not the library's prose (tests, demos, tools, the GUI)
_SKIP = ("test", "tests", "idlelib", "tkinter", "turtledemo", "lib2to3", "pydoc_data", "site-packages",
         "ensurepip", "__pycache__", "config-")


def docstring_sentences(n: int | None = None, *, min_chars: int = 40, max_chars: int = 200) -> list[str]:
    """The first ``n`` (default all: about 6,500 on Python 3.11) distinct English sentences from the docstrings
    of the standard library (modules, classes, functions; parsed with ``ast``, nothing imported), in a fixed
    order (files sorted by path), none of them one of :func:`sentences`: wider text to distil on than the
    pruning corpus. Only as many files are read as the ``n`` sentences need (all of them: ~9 s)."""
    return list(_docstring_sentences(n, min_chars, max_chars))


@functools.lru_cache(maxsize=8)
def _docstring_sentences(n: int | None, min_chars: int, max_chars: int) -> tuple[str, ...]:
    import ast
    import sysconfig
    from pathlib import Path

    root = Path(sysconfig.get_paths()["stdlib"])
    known = set(sentences(min_chars=min_chars, max_chars=max_chars))
    seen, out = set(), []
    for f in sorted(root.rglob("*.py")):
        if any(part.startswith(_SKIP) for part in f.relative_to(root).parts):
            continue
        try:
            tree = ast.parse(f.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        nodes = [tree] + [x for x in _defs(tree) if not x.name.startswith("_")]
        text = re.sub(r"\s+", " ", " ".join(ast.get_docstring(x) or "" for x in nodes))
        for s in re.split(r"(?<=[.!?])\s+", text):
            if _usable(s, min_chars, max_chars) and s not in seen and s not in known:
                seen.add(s)
                out.append(s)
                if len(out) == n:
                    return tuple(out)
    return tuple(out)


def _defs(tree):
    """The function and class definitions of a parsed file, in ``ast.walk``'s (breadth-first) order; only
    statements are visited (a definition is a statement), not the expressions ``ast.walk`` also goes through."""
    import ast
    from collections import deque

    todo = deque([tree])
    while todo:
        node = todo.popleft()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node
        todo.extend(c for c in ast.iter_child_nodes(node) if isinstance(c, (ast.stmt, ast.excepthandler, ast.match_case)))


def package_sentences(n: int = 300, *, exclude: frozenset[str] | set[str] = frozenset(), min_chars: int = 40,
                      max_chars: int = 200) -> list[str]:
    """Up to ``n`` English sentences from the long descriptions (READMEs) of the Python distributions installed
    here, by distribution name, code blocks and markup dropped, none in ``exclude``: text of another kind than
    the language reference and the docstrings (what a pruned encoder was never chosen or distilled on)."""
    import importlib.metadata

    seen, out = set(), []
    for dist in sorted(importlib.metadata.distributions(), key=lambda d: (d.metadata["Name"] or "").lower()):
        text = dist.metadata.get_payload() or dist.metadata.get("Description") or ""
        text = re.sub(r"```.*?```", " ", text, flags=re.S)  # code blocks
        text = re.sub(r"\s+", " ", re.sub(r"[#*`]|\[([^\]]*)\]\([^)]*\)", r"\1", text))  # markup; links' text
        for s in re.split(r"(?<=[.!?])\s+", text):
            if _usable(s, min_chars, max_chars) and "<" not in s and "http" not in s and s not in seen \
                    and s not in exclude:
                seen.add(s)
                out.append(s)
                if len(out) == n:
                    return out
    return out



def held_out_batch(b: int, *, max_length: int = 128) -> dict:
    """The first ``b`` of 200 :func:`package_sentences` the pruning never saw (none of :func:`sentences`),
    tokenized with the MiniLM package's tokenizer, padded to the longest: ``{"input_ids": (B, L),
    "attention_mask": (B, L)}``, a BERT-family model's keyword inputs (the benches' batches)."""
    import torch
    from tokenizers import Tokenizer

    from multihead.models import minilm_path

    tok = Tokenizer.from_file(str(minilm_path() / "tokenizer.json"))
    tok.enable_padding()
    tok.enable_truncation(max_length)
    enc = tok.encode_batch(list(_held_out_text()[:b]))
    return {"input_ids": torch.tensor([e.ids for e in enc]),  # (B, L)
            "attention_mask": torch.tensor([e.attention_mask for e in enc])}  # (B, L)


@functools.cache
def _held_out_text() -> tuple[str, ...]:
    return tuple(package_sentences(200, exclude=set(sentences())))
