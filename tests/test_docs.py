"""The documentation site, built as `make docs` builds it (strict: a broken link or a missing name fails), with the
quick pictures (an untrained model, small settings), then opened in Debian's Chromium from a local server with no
other host reachable: every page loads without a console error or a request leaving the machine, every internal link
resolves (the file, and the anchor on it), the search finds `capture` and `check`, and each API reference page holds
every public name of its module. The code blocks of the pages run in tests/test_readme.py."""

from __future__ import annotations

import functools
import http.server
import importlib
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from urllib.parse import urldefrag, urljoin, urlparse

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytest.importorskip("mkdocs")
pytest.importorskip("mkdocstrings")


def _build(config: Path, out: Path) -> tuple[int, list[str], str]:
    """`mkdocs build --strict` as `make docs` runs it: (exit code, the warnings it printed, the log's tail). No -q:
    it lowers mkdocs' log level below WARNING, and --strict then has no warning to count."""
    env = {**os.environ, "MULTIHEAD_DOCS_QUICK": "1", "NO_MKDOCS_2_WARNING": "1"}
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(out)],
                         cwd=config.parent, env=env, capture_output=True, text=True, timeout=300)
    log = run.stdout + run.stderr
    return run.returncode, _warnings(log), log[-3000:]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    code, warned, tail = _build(ROOT / "mkdocs.yml", out)
    assert code == 0 and not warned, "\n".join(warned) or tail
    return out


def _warnings(log: str) -> list[str]:
    """mkdocs' WARNING/ERROR records with their continuation lines (indented), as `make docs` prints them."""
    lines, keep = [], False
    for line in log.splitlines():
        if re.match(r"(WARNING|ERROR)\s*-", line):
            lines.append(line)
            keep = True
        elif keep and line.startswith((" ", "\t")):
            lines.append(line)
        else:
            keep = False
    return lines


def test_a_docstring_that_breaks_a_reference_fails_the_build(tmp_path):
    """The project's mkdocstrings settings on a one-page site whose module's docstring reads ``[x][, "y"]`` as a
    Markdown reference (issue 77's break): the strict build fails and the warning is among those `_build` returns."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "broken.py").write_text(
        'def export():\n    """Returns {"onnx", "onnx_int8"[, "onnx_optimized"][, "openvino", "openvino_int8"]: path}."""\n')
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "index.md").write_text("# Broken\n\n::: broken\n")
    ours = (ROOT / "mkdocs.yml").read_text()
    plugins = ours[ours.index("plugins:"):ours.index("markdown_extensions:")].replace("paths: [src]", "paths: [pkg]")
    (tmp_path / "mkdocs.yml").write_text(f"site_name: broken\nstrict: true\n{plugins}")
    code, warned, tail = _build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert code != 0, tail
    assert any("Could not find cross-reference target" in w for w in warned), warned or tail


def _ids(html: str) -> set[str]:
    return set(re.findall(r'\bid="([^"]+)"', html))


def test_every_public_name_is_in_its_api_reference_page(site):
    pages = sorted((site / "reference").glob("*.html"))
    assert len(pages) >= 12
    documented = {("multihead" if p.stem == "multihead" else f"multihead.{p.stem}") for p in pages}
    for page in pages:
        name = "multihead" if page.stem == "multihead" else f"multihead.{page.stem}"
        ids = _ids(page.read_text())
        for public in importlib.import_module(name).__all__:
            full = f"{name}.{public}"
            # a function exported under its submodule's name is documented as that (module.function)
            assert full in ids or f"{full}.{public}" in ids or full in documented, f"{page.name} lacks {full}"


def test_the_readme_is_the_home_page_with_its_links_made_relative(site):
    home = (site / "index.html").read_text()
    assert "For practitioners" in home and 'href="tutorials/learner.html"' in home and 'href="docs/' not in home


def test_the_pictures_are_drawn_into_the_site(site):
    shot = shutil.which("chromium") or shutil.which("chromium-browser")  # the explorer's screenshot needs it
    for name in ("transformer_cross_attention.png", "curve.png", "class_summary.png", "patching.png",
                 "transformer_decoder_explorer.html") + (("explorer.png",) if shot else ()):
        assert (site / "pictures" / name).stat().st_size > 1000, name
    gallery = (site / "pictures.html").read_text()
    assert gallery.count("<img") >= (6 if shot else 5) and "multihead check submissions/" in gallery


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture
def served(site):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(site)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def _chromium():
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.skip("Debian's chromium is not installed")
    return exe, pytest.importorskip("playwright.sync_api")


def test_every_page_loads_offline_links_resolve_and_search_finds(site, served):
    exe, sync_api = _chromium()
    pages = sorted(p.relative_to(site).as_posix() for p in site.rglob("*.html") if p.name != "404.html"
                   and p.parent.name != "pictures")
    ids = {p: _ids((site / p).read_text()) for p in pages}
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=exe, args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})  # the search box in the header
            errors, outside = [], []
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))

            def only_here(route):  # offline: nothing but the local server answers
                if route.request.url.startswith(served):
                    route.continue_()
                else:
                    outside.append(route.request.url)
                    route.abort()
            page.route("**/*", only_here)
            for rel in pages:
                page.goto(served + rel)
                links = page.eval_on_selector_all("a[href]", "els => els.map(e => e.getAttribute('href'))")
                for href in links:
                    target = urljoin(served + rel, href)
                    if not target.startswith(served):
                        continue
                    path, anchor = urldefrag(target)
                    file = urlparse(path).path.lstrip("/") or "index.html"
                    if file.endswith("/"):
                        file += "index.html"
                    assert (site / file).exists(), f"{rel}: the link {href!r} leads to a missing {file}"
                    if anchor and file in ids:
                        assert anchor in ids[file], f"{rel}: the link {href!r}: no #{anchor} on {file}"
            assert errors == [], errors
            assert outside == [], outside
            for word in ("capture", "check"):
                found = _search(page, served, word)
                assert word in found.lower(), found[:500]
        finally:
            browser.close()


def _search(page, served: str, word: str) -> str:
    """The search's results for ``word``, typed as a reader types it; typed again while the search's worker is still
    building its index on a busy machine (the box answers only once it is ready), for up to two minutes. The worker
    answers each keystroke in turn, so the list first shown may be a shorter prefix's ("c", "ca", ...): the list is
    read until it holds the whole word's results (up to 20 s), else returned as it is, for the caller to fail on."""
    page.goto(served + "index.html")
    page.click("input.md-search__input")
    for _ in range(40):
        page.fill("input.md-search__input", "")
        page.type("input.md-search__input", word)
        try:
            page.wait_for_selector(".md-search-result__item", timeout=3000)
        except Exception:  # noqa: BLE001 - playwright's TimeoutError: not ready yet
            continue
        found = page.inner_text(".md-search-result__list")
        for _ in range(40):
            if word in found.lower():
                break
            page.wait_for_timeout(500)
            found = page.inner_text(".md-search-result__list")
        return found
    raise AssertionError(f"the search found nothing for {word!r} in two minutes")


# --- pages people read: short paragraphs (issue 67) ------------------------------------------------------------------

#: the most lines a paragraph (or a list item) of the README or a page of docs/ (tutorials, how-to, explanation,
#: performance, reference) may have, outside code blocks and tables: longer prose becomes a table, one row a case or a
#: measurement, or a list
PROSE_LINES = 8
READ_PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
_LIST_ITEM = re.compile(r"\s*([-*+]|\d+\.) ")


def prose_blocks(text: str) -> list[tuple[int, list[str]]]:
    """(first line's number, lines) of every paragraph and list item of a markdown page: what fenced code, table rows,
    headings and blank lines leave."""
    blocks: list[tuple[int, list[str]]] = []
    fenced = is_open = False
    for number, line in enumerate(text.splitlines(), 1):
        s = line.strip()
        if s.startswith(("```", "~~~")):
            fenced, is_open = not fenced, False
            continue
        if fenced or not s or s.startswith(("|", "#")):
            is_open = False
            continue
        if not is_open or _LIST_ITEM.match(line):
            blocks.append((number, []))
            is_open = True
        blocks[-1][1].append(s)
    return blocks


def test_prose_blocks_are_paragraphs_and_list_items_outside_code_and_tables():
    text = "# T\n\none\ntwo\n\n```python\nx = 1\n\ny = 2\n```\n| a | b |\n|---|---|\n- item\n  more\n- next\n1. step\nthree"
    assert prose_blocks(text) == [(3, ["one", "two"]), (13, ["- item", "more"]), (15, ["- next"]),
                                  (16, ["1. step", "three"])]


def test_no_paragraph_of_a_page_people_read_is_longer_than_the_limit():
    assert {p.parent.name for p in READ_PAGES} >= {"tutorials", "how-to", "explanation", "reference"}, READ_PAGES
    long = [f"{page.relative_to(ROOT)}:{start}: {len(lines)} lines" for page in READ_PAGES
            for start, lines in prose_blocks(page.read_text()) if len(lines) > PROSE_LINES]
    assert not long, f"paragraphs over {PROSE_LINES} lines (make them a table, one row a case, or a list): {long}"


def test_a_how_to_page_has_at_most_one_paragraph_of_caveats():
    """A how-to page is one task: its code, the expected output, and one paragraph of caveats at most."""
    pages = [p for p in READ_PAGES if p.parent.name == "how-to"]
    assert pages
    for page in pages:
        caveats = [start for start, lines in prose_blocks(page.read_text()) if lines[0].startswith("Caveats")]
        assert len(caveats) <= 1, f"{page.relative_to(ROOT)} has paragraphs of caveats at lines {caveats}: a how-to " \
                                  "page is one task (a second task gets a page of its own)"
