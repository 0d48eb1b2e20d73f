"""examples/course.ipynb runs in a real Jupyter kernel from a clean start, shows its figures and
the explorer inline, and the explorer works inside the notebook's HTML in Chromium."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).resolve().parent.parent / "examples" / "course.ipynb"


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code")  # committed without outputs
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()  # raises on any error
    return nb


def _outputs(nb, kind):
    return [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if kind in o.get("data", {})]


def test_the_notebook_runs_and_shows_figures_tables_and_the_explorer(executed):
    assert not [o for c in executed.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert len(_outputs(executed, "image/png")) >= 5  # heads, cross-attention, rollout, pruning curve, patching
    roll = next(c for c in executed.cells if c.cell_type == "code" and "rollout(cap" in c.source)
    assert any("image/png" in o.get("data", {}) for o in roll.outputs)
    plot = next(c for c in executed.cells if c.cell_type == "code" and c.source.startswith("curve.plot("))
    assert any("image/png" in o.get("data", {}) for o in plot.outputs)  # the exercise's result as a plot
    assert any(t.startswith("| heads pruned | metric | ms @64 |") for t in
               (o["data"]["text/markdown"] for o in _outputs(executed, "text/markdown")))  # speed at every step
    html = [o["data"]["text/html"] for o in _outputs(executed, "text/html")]
    assert any('class="multihead-explorer"' in h and 'sandbox="allow-scripts"' in h for h in html)
    tables = [o["data"]["text/markdown"] for o in _outputs(executed, "text/markdown")]
    assert any("| backend | decision |" in t for t in tables)  # explain()
    assert any(t.startswith("| module (gradient) |") for t in tables)  # the importance table
    assert any(t.startswith("| heads pruned | metric |") for t in tables)  # the pruning curve
    text = "".join(o.get("text", "") for c in executed.cells if c.cell_type == "code" for o in c.outputs)
    assert "torch.Size([2, 4, 100])" in "".join(o["data"].get("text/plain", "") for o in _outputs(executed,
                                                                                                  "text/plain"))
    assert "the speed of the full model" in text
    # no warning (tqdm's IProgress, torch's zero-element init, ...) lands in a cell
    assert [o.get("text") for c in executed.cells if c.cell_type == "code" for o in c.outputs
            if o.output_type == "stream" and o.get("name") == "stderr"] == []
    import re

    aligned = int(re.search(r"cross-attention on the aligned digit: (\d+)%", text).group(1))
    assert aligned >= 80  # the anti-diagonal the text promises is there
    # the experiment: patching ranks the induction head first, the head with the highest induction score
    found = re.search(r"patching ranks first: layers\.(\d) head (\d); highest induction score: layers\.1 head (\d)",
                      text)
    assert found and found.group(1) == "1" and found.group(2) == found.group(3), text[-400:]
    patch = next(c for c in executed.cells if c.cell_type == "code" and "heads.patch(" in c.source)
    assert any("image/png" in o.get("data", {}) for o in patch.outputs)  # the grid, inline


def test_the_inline_explorer_works_in_the_notebooks_html(executed, tmp_path):
    nbconvert = pytest.importorskip("nbconvert")
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.skip("Debian's chromium is not installed")
    sync_api = pytest.importorskip("playwright.sync_api")
    body, _ = nbconvert.HTMLExporter(template_name="basic").from_notebook_node(executed)
    page_file = tmp_path / "course.html"
    page_file.write_text(f"<!DOCTYPE html><html><head><meta charset='utf-8'></head><body>{body}</body></html>",
                         encoding="utf-8")
    args = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync"]
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=exe, args=args)
        try:
            page = browser.new_page(viewport={"width": 1300, "height": 1000})
            errors, requests = [], []
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("request", lambda r: requests.append(r.url))
            page.goto(page_file.as_uri())
            frame = page.frame_locator("iframe.multihead-explorer")
            thumbs = frame.locator("#thumbs canvas")
            assert thumbs.count() >= 4
            frame.locator("body[data-shown='0:0']").wait_for()  # the first head inflated and drawn
            before = frame.locator("#enlarged-title").text_content()
            third = thumbs.nth(3)
            shown = f"{third.get_attribute('data-module')}:{third.get_attribute('data-head')}"
            third.click()
            frame.locator(f"body[data-shown='{shown}']").wait_for()
            after = frame.locator("#enlarged-title").text_content()
            labels = frame.locator("#xlabels span").all_text_contents()
        finally:
            browser.close()
    assert before != after and "head" in after
    assert labels == ["3", "1", "4", "1", "5", "9", "2", "6"]  # the source digits along the enlarged head
    assert errors == []
    leaving = [u for u in requests if not u.startswith(("file:", "data:", "about:"))]
    assert leaving == []  # no request leaves the page
