"""MkDocs hooks of the documentation site (mkdocs.yml): the README as the home page, its links into ``docs/`` made
relative to the site, and the pictures drawn by ``tools/docs_pictures.py`` when the site is built (into a temporary
folder, added to the site as files: never committed, never stale). ``MULTIHEAD_DOCS_QUICK=1``: the quick pictures
(an untrained model, small settings), as the tests build the site."""

from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]
_made: dict = {"folder": None, "captions": {}}


def on_pre_build(config) -> None:
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import docs_pictures
    finally:
        sys.path.remove(str(ROOT / "tools"))
    folder = Path(tempfile.mkdtemp(prefix="multihead-pictures-"))
    quick = os.environ.get("MULTIHEAD_DOCS_QUICK") == "1"
    _made.update(folder=folder, captions=docs_pictures.generate(folder, quick=quick))


def on_files(files, config):
    readme = (ROOT / "README.md").read_text().replace("](docs/", "](")
    files.append(File.generated(config, "index.md", content=readme))
    for name in _made["captions"]:
        files.append(File.generated(config, f"pictures/{name}", abs_src_path=str(_made["folder"] / name)))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    """The pictures page: each picture with its caption (the command that draws it)."""
    if page.file.src_uri != "pictures.md":
        return markdown
    parts = [markdown.rstrip(), ""]
    for name, caption in _made["captions"].items():
        if name.endswith(".html"):
            parts += [f"[{name}](pictures/{name}): {caption}", ""]
        else:
            parts += [f"![{name}](pictures/{name})", "", f"*{caption}*", ""]
    return "\n".join(parts)


#: a Sphinx role the docstrings use (``:func:`~multihead.heads.patch```), as mkdocstrings leaves it in the page
_ROLE = re.compile(r":(?:mod|func|class|meth|attr|data|obj|exc):<code>(~?)([\w.]+)</code>")


def on_page_content(html: str, page, config, files) -> str:
    """The docstrings' Sphinx roles shown as code: ``~a.b.c`` as ``c``, others whole."""
    return _ROLE.sub(lambda m: f"<code>{m.group(2).rsplit('.', 1)[-1] if m.group(1) else m.group(2)}</code>", html)


def on_post_build(config) -> None:
    if _made["folder"] is not None:
        shutil.rmtree(_made["folder"], ignore_errors=True)


def on_build_error(error) -> None:
    on_post_build(None)
