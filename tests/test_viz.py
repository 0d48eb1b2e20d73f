"""Heatmaps, rollout and the HTML explorer (in a real headless Chromium)."""

from __future__ import annotations

import io
import json
import re
import shutil
from pathlib import Path

import pytest
import torch

import multihead
from multihead import MultiHeadAttention, masks
from multihead.compat import D2LMultiHeadAttention
from multihead.viz import explorer, heatmaps, rollout
from multihead.viz.rollout import stacks_of

pytest.importorskip("matplotlib")


def captured_stack(L=6, layers=2, H=3, B=2):
    torch.manual_seed(0)
    mods = torch.nn.ModuleList([MultiHeadAttention(12, H) for _ in range(layers)])
    x = torch.randn(B, L, 12)
    with multihead.capture(mods) as c:
        for m in mods:
            x = x + m(x, mask=masks.Causal())
    return c


def test_heatmaps_grid_of_layers_by_heads(tmp_path):
    c = captured_stack()
    fig = heatmaps(c, queries=list("abcdef"), keys=list("abcdef"))
    axes = [a for a in fig.axes if a.get_label() != "<colorbar>"]
    assert len(axes) == 2 * 3 and len(fig.axes) == 2 * 3 + 1  # 6 maps + the colour bar
    images = [a.images[0] for a in axes if a.images]
    assert len(images) == 6 and len({im.get_clim() for im in images}) == 1  # one shared colour scale
    assert images[0].get_array().shape == (6, 6)
    assert [t.get_text() for t in axes[0].get_yticklabels()] == list("abcdef")
    for ext in ("png", "svg", "pdf"):
        fig.savefig(tmp_path / f"h.{ext}")
        assert (tmp_path / f"h.{ext}").stat().st_size > 1000
    with pytest.raises(ValueError, match="queries has 2 labels but the weights have 6 queries"):
        heatmaps(c, queries=["a", "b"])


def test_heatmaps_draws_the_course_modules_weights():
    d2l = D2LMultiHeadAttention(100, 100, 100, 100, 5, 0.5).eval()
    X, Y = torch.ones(2, 4, 100), torch.ones(2, 6, 100)
    d2l(X, Y, Y, torch.tensor([3, 2]))
    fig = heatmaps(d2l.attention.attention_weights, num_heads=5)  # (B*H, Lq, Lk) as the course keeps it
    images = [a.images[0] for a in fig.axes if a.images]
    assert len(images) == 2 * 5
    assert (images[5].get_array()[:, 2:] == 0).all()  # sequence 1 (valid length 2), head 0
    with pytest.raises(ValueError, match=r"pass num_heads=H"):
        heatmaps(d2l.attention.attention_weights)


def test_rollout_identity_and_product():
    L = 5
    eye = torch.eye(L).expand(1, 2, L, L)
    r = rollout({"a": eye, "b": eye})
    assert torch.allclose(r[0], torch.eye(L))  # attending only to oneself: rollout is the identity
    c = captured_stack(L=L)
    names = list(c)
    r = rollout(c)
    A = [0.5 * c[n].double().mean(1) + 0.5 * torch.eye(L, dtype=torch.float64) for n in names]
    assert torch.allclose(r.double(), A[1] @ A[0], atol=1e-6)
    assert torch.allclose(r.sum(-1), torch.ones(2, L), atol=1e-5)
    rc = rollout(c, causal=True)
    assert (rc[0].triu(1) == 0).all()
    with pytest.raises(ValueError, match="needs self-attention weights"):
        rollout({"x": torch.rand(1, 2, 3, 4)})


def _with_pruned_heads(c: dict) -> dict:
    """The capture with heads (0, 0) and (1, 2) in place but absent (NaN), as a pruned model's are drawn."""
    first, second = list(c)
    a, b = c[first].clone(), c[second].clone()
    a[:, 0], b[:, 2] = float("nan"), float("nan")
    return {first: a, second: b}


def test_a_pruned_heads_place_says_so_and_every_other_head_keeps_its_number(tmp_path):
    """A head whose weights are NaN is not there (a pruned model's head, kept in its place): the heatmap's panel
    says "pruned" (a pruned MiniLM's heads were drawn as uniform attention, the zero rows its full-size copy holds),
    the explorer leaves its place empty, and rollout, which needs the heads the model computes, refuses it."""
    c = _with_pruned_heads(captured_stack())
    fig = heatmaps(c)
    axes = [a for a in fig.axes if a.get_label() != "<colorbar>"]
    said = [[t.get_text() for t in a.texts] for a in axes]  # (layers x heads) panels, row by row
    assert said == [["pruned"], [], [], [], [], ["pruned"]]
    assert [a.get_title() for a in axes[:3]] == ["head 0", "head 1", "head 2"]
    assert len(fig.axes) == 7  # the colour bar, from the heads that are there
    text = explorer(c, path=tmp_path / "p.html").read_text()
    data = json.loads(re.search(r'<script id="data" type="application/json">(.*?)</script>', text, re.S).group(1))
    assert [[h is None for h in m["heads"]] for m in data["modules"]] == [[True, False, False], [False, False, True]]
    with pytest.raises(ValueError, match="weights hold NaN"):
        rollout(c)
    r = rollout({"a": torch.rand(1, 0, 4, 4)})  # a layer with every head pruned passes its input on
    assert torch.equal(r[0], torch.eye(4))


def test_explorer_is_self_contained_and_escapes_tokens(tmp_path):
    c = captured_stack()
    evil = ["<script>alert(1)</script>", "a&b", '"q"', "</script><b>x", "é", "t"]
    p = explorer(c, tokens=evil, path=tmp_path / "x.html")
    text = p.read_text()
    assert "<script>alert(1)</script>" not in text and "</script><b>" not in text
    assert not re.search(r"(src|href)=\"https?:", text) and "http://" not in text.replace("http-equiv", "")
    payload = re.search(r'<script id="data" type="application/json">(.*?)</script>', text, re.S).group(1)
    data = json.loads(payload)
    assert data["modules"][0]["queries"] == evil
    assert len(data["modules"]) == 2 and len(data["modules"][0]["heads"]) == 3


def _chromium():
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.skip("Debian's chromium is not installed")
    sync_api = pytest.importorskip("playwright.sync_api")
    return exe, sync_api


ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def _open(page_path, exe, sync_api, fn, width=1200, first="0:0"):
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=exe, args=ARGS)
        try:
            page = browser.new_page(viewport={"width": width, "height": 900})
            errors = []
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(Path(page_path).as_uri())
            page.wait_for_selector(f"body[data-shown='{first}']", state="attached")  # the first head, inflated and drawn
            return fn(page), errors
        finally:
            browser.close()


def _show(page, head: int, module: int | None = None) -> None:
    """Click a thumbnail and wait until its head is inflated and drawn."""
    m = "" if module is None else f'[data-module="{module}"]'
    page.click(f'#thumbs canvas{m}[data-head="{head}"]')
    page.wait_for_selector(f"body[data-shown='{0 if module is None else module}:{head}']", state="attached")


def _not_blank(png: bytes) -> bool:
    from PIL import Image

    img = Image.open(io.BytesIO(png)).convert("L")
    lo, hi = img.getextrema()
    return hi - lo > 50 and sum(1 for n in img.histogram() if n) > 10


def test_a_pruned_heads_place_in_chromium(tmp_path):
    exe, sync_api = _chromium()
    p = explorer(_with_pruned_heads(captured_stack()), path=tmp_path / "p.html")

    def act(page):
        return (page.text_content("#enlarged-title"),
                page.eval_on_selector_all("#thumbs .headnum", "els => els.map(e => e.textContent)"),
                page.eval_on_selector_all("#thumbs canvas", "els => els.map(e => e.dataset.module + ':' + e.dataset.head)"))

    (title, headnums, canvases), errors = _open(p, exe, sync_api, act, first="0:1")  # the first head there
    assert errors == []
    assert "— head 1 (" in title
    assert headnums == ["head 0", "head 1", "head 2", "pruned", "pruned"]
    assert canvases == ["0:1", "0:2", "1:0", "1:1"]


def test_explorer_in_chromium(tmp_path):
    exe, sync_api = _chromium()
    c = captured_stack()
    evil = ["<script>alert(1)</script>", "b", "c", "d", "e", "f"]
    p = explorer(c, tokens=evil, path=tmp_path / "e.html")

    def act(page):
        before = page.text_content("#enlarged-title")
        _show(page, 2, module=1)
        after = page.text_content("#enlarged-title")
        page.hover("#tokens span:nth-child(3)")
        shaded = page.eval_on_selector("#keys span:nth-child(1)", "e => e.style.background")
        first_token = page.text_content("#tokens span:nth-child(1)")
        dialogs = []
        page.on("dialog", lambda d: dialogs.append(d))
        labels = {
            "y": page.eval_on_selector_all("#ylabels span", "els => els.map(e => e.textContent)"),
            "x": page.eval_on_selector_all("#xlabels span", "els => els.map(e => e.textContent)"),
            "heads": page.eval_on_selector_all("#thumbs .headnum", "els => els.map(e => e.textContent)"),
            "ticks": page.eval_on_selector_all("#scaleticks span", "els => els.map(e => e.textContent)"),
            "y_visible": page.is_visible("#ylabels span:nth-child(2)"),
        }
        return before, after, shaded, first_token, page.screenshot(), dialogs, labels

    (before, after, shaded, first_token, png, dialogs, labels), errors = _open(p, exe, sync_api, act)
    assert errors == []
    assert before.endswith("— head 0 (6 queries × 6 keys, max weight " + before.split("max weight ")[1])
    assert after.startswith("1 — head 2") and after != before
    assert "rgba(200, 0, 0" in shaded
    assert first_token == "<script>alert(1)</script>" and dialogs == []
    assert _not_blank(png)
    # the enlarged head reads without hovering: token labels on both axes, head numbers, a colour scale
    assert labels["y"] == evil and labels["x"] == evil and labels["y_visible"]
    assert labels["heads"] == [f"head {h}" for h in range(max(w.shape[1] for w in c.values()))]
    vmax = float(after.split("max weight ")[1].rstrip(")"))
    assert [float(t) for t in labels["ticks"]] == pytest.approx([vmax, vmax / 2, 0.0], abs=1e-3)


def test_explorer_long_input_and_image_in_chromium(tmp_path):
    exe, sync_api = _chromium()
    L = 4096
    w = torch.softmax(torch.randn(1, 2, L, L), -1)
    p = explorer({"layer": w}, tokens=[f"t{i}" for i in range(L)], path=tmp_path / "long.html", max_cells=512)
    assert p.stat().st_size < 3_000_000

    def act(page):
        _show(page, 1)
        ys = page.eval_on_selector_all("#ylabels span", "els => els.map(e => e.textContent)")
        return page.text_content("#enlarged-title"), page.screenshot(), ys

    (title, png, ys), errors = _open(p, exe, sync_api, act)
    assert errors == [] and title.startswith("layer — head 1 (4096 queries × 4096 keys") and _not_blank(png)
    assert ys == [f"t{i}" for i in range(0, L, L // 32)]  # every 128th token of 4096
    # a ViT-style capture: [CLS] + 4x4 patches over an 8x8 picture
    img = torch.arange(64.0).reshape(8, 8)
    wv = torch.softmax(torch.randn(1, 2, 17, 17), -1)
    p2 = explorer({"vit.0": wv}, tokens=["[CLS]"] + [f"p{i}" for i in range(16)], path=tmp_path / "vit.html",
                  image=img, patch_grid=(4, 4), prefix_tokens=1)

    def act2(page):
        page.hover("#tokens span:nth-child(6)")
        return page.is_visible("#img"), page.screenshot()

    (visible, png2), errors = _open(p2, exe, sync_api, act2)
    assert errors == [] and visible and _not_blank(png2)


def test_rollout_refuses_to_multiply_across_the_stacks_of_an_encoder_decoder():
    import multihead
    from multihead.models.seq2seq import Seq2SeqConfig, Seq2SeqTransformer

    torch.manual_seed(0)
    model = Seq2SeqTransformer(Seq2SeqConfig(d_model=16, heads=2, ffn=32)).eval()
    src, tgt = torch.randint(3, 13, (1, 5)), torch.randint(3, 13, (1, 5))  # Lq = Lk = 5 everywhere: square cross maps
    with torch.no_grad(), multihead.capture(model) as cap:
        model(src, torch.tensor([5]), tgt)
    with pytest.raises(ValueError, match=r"rollout multiplies self-attention maps of one stack; .*cross"):
        rollout(cap)
    stacks = stacks_of(cap)
    assert len(stacks) == 2  # the encoder's and the decoder's self-attention
    enc = next(iter(stacks.values()))
    with pytest.raises(ValueError, match=r"rollout multiplies the layers of one stack; the capture holds 2"):
        rollout(cap, names=[n for names in stacks.values() for n in names])
    assert rollout(cap, names=enc).shape == (1, 5, 5)


def test_pictures_say_what_their_colours_measure(monkeypatch, tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    from multihead.heads import plot_curve

    c = captured_stack(L=5)
    fig = heatmaps(rollout(c)[:1, None], value_label="rollout: share of the output drawn from each input")
    assert fig.axes[-1].get_ylabel() == "rollout: share of the output drawn from each input"  # the colour bar
    assert fig.axes[0].get_ylabel() == "Queries"  # one row: no "row 0" above the axis name
    assert heatmaps(c).axes[-1].get_ylabel() == "attention weight"
    ticks = heatmaps(c).axes[0].get_xticks()
    assert all(float(t).is_integer() for t in ticks)  # positions, not half-steps
    rows = [{"fraction": 0.0, "metric": 1.0, "speed_ms": {"16": 10.0}},
            {"fraction": 0.25, "metric": 0.9, "speed_ms": {"16": 8.0}}]
    from matplotlib.figure import Figure

    seen = {}
    save = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: (seen.setdefault("fig", self), save(self, *a, **k)))
    plot_curve(rows, tmp_path / "curve.png", metric_name="mean cosine")
    ax = seen["fig"].axes[0]
    assert "pruning curve" in ax.get_title()
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["mean cosine", "speed-up, batch 16"]


def test_a_missing_optional_dependency_names_its_extra(monkeypatch):
    import sys

    from multihead.heads import plot_curve

    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)  # as if matplotlib were not installed
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r"heatmaps needs matplotlib, which is not installed: "
                                          r"pip install 'multihead\[viz\]'"):
        heatmaps(captured_stack())
    with pytest.raises(ImportError, match=r"plot_curve needs matplotlib.*multihead\[viz\]"):
        plot_curve([{"fraction": 0.0, "metric": 1.0}], "unused.png")


def test_the_enlarged_head_and_its_scale_stay_on_screen_at_1024_px(tmp_path):
    """A MiniLM-sized capture (6 layers x 12 heads): the thumbnails wrap below the enlarged head, whose
    labels and colour scale stay inside a 1024 px window (they were pushed past 1500 px)."""
    exe, sync_api = _chromium()
    cap = {f"encoder.layer.{i}.attention.self": torch.softmax(torch.randn(1, 12, 14, 14), -1) for i in range(6)}
    p = explorer(cap, tokens=[f"tok{i}" for i in range(14)], path=tmp_path / "wide.html")

    def act(page):
        _show(page, 11)
        boxes = {sel: page.eval_on_selector(sel, "e => { const r = e.getBoundingClientRect(); return [r.left, r.right]; }")
                 for sel in ("#ylabels", "#big", "#scalewrap", "#thumbs")}
        return boxes, page.evaluate("document.documentElement.scrollWidth"), page.text_content("#enlarged-title")

    (boxes, scroll, title), errors = _open(p, exe, sync_api, act, width=1024)
    assert errors == [] and "head 11" in title
    assert all(0 <= left and right <= 1024 for left, right in boxes.values()), boxes
    assert scroll <= 1024


def test_long_inputs_get_a_colour_scale_per_head():
    """At hundreds of keys a head's weights are ~0.01 each and one shared scale leaves its panel blank:
    past max_labels keys (or with scale="per_head") each panel runs from 0 to its own largest weight,
    written in its title, with no shared colour bar."""
    import matplotlib

    matplotlib.use("Agg")
    c = captured_stack(L=50)
    fig = heatmaps(c, max_labels=40)  # 50 keys: per head
    images = [a.images[0] for a in fig.axes if a.images]
    grid = torch.stack([w[0] for w in c.values()])  # (layers, H, L, L)
    want = [float(grid[r, h].max()) for r in range(grid.shape[0]) for h in range(grid.shape[1])]
    assert [im.get_clim()[1] for im in images] == pytest.approx(want)
    assert len(fig.axes) == len(images)  # no colour bar
    assert fig.axes[0].get_title() == f"head 0 (max {want[0]:.2g})"
    assert len({a.images[0].get_clim() for a in heatmaps(c, scale="shared").axes if a.images}) == 1
    with pytest.raises(ValueError, match="scale must be 'auto', 'shared' or 'per_head'; got 'log'"):
        heatmaps(c, scale="log")


def test_512_tokens_x_144_heads_open_at_once_and_each_head_at_full_resolution(tmp_path):
    """bertviz's users' long inputs: 12 layers x 12 heads x 512 tokens. The page opens on light
    thumbnails; a head's full-resolution map is inflated when it is opened, and a cell read on it is
    that head's weight (8 bits of its own scale)."""
    exe, sync_api = _chromium()
    torch.manual_seed(0)
    L = 512
    cap = {f"encoder.layer.{i}": torch.softmax(torch.randn(1, 12, L, L) * 4, -1) for i in range(12)}  # peaked rows
    p = explorer(cap, tokens=[f"t{i}" for i in range(L)], path=tmp_path / "long.html")
    assert p.stat().st_size < 12_000_000  # 8-bit maps of 144 x 512 x 512 would be 50 MB as base64
    w = cap["encoder.layer.7"][0, 5]
    i = 300
    j = int(w[i].argmax())  # a cell worth reading
    cell = round(float(w[i, j] / w.max()) * 255) / 255 * float(w.max())

    def act(page):
        assert page.eval_on_selector_all("#thumbs canvas", "els => els.length") == 144
        _show(page, 5, module=7)
        cw, ch = page.eval_on_selector("#big", "e => [e.clientWidth, e.clientHeight]")  # inside the border
        page.hover("#big", position={"x": (j + 0.5) / L * cw, "y": (i + 0.5) / L * ch})
        return page.text_content("#enlarged-title"), page.text_content("#info")

    (title, info), errors = _open(p, exe, sync_api, act)
    assert errors == [] and title.startswith("encoder.layer.7 — head 5 (512 queries × 512 keys")
    assert info == f'"t{i}" → "t{j}": {cell:.4f}'


def test_patching_effects_on_the_explorers_heads_in_chromium(tmp_path):
    """explorer(..., patching=heads.patch(...)): every head's thumbnail carries its patching effect (the share of the
    way from base to source, the same numbers as Patching.effect()), the enlarged head's title says it, and the page
    says what the borders mean; a per-position result or a module the capture lacks is refused."""
    exe, sync_api = _chromium()
    from multihead import heads

    torch.manual_seed(0)

    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(MultiHeadAttention(12, 3) for _ in range(2))

        def forward(self, x):
            for m in self.layers:
                x = x + m(x)
            return x

    model = Two().eval()
    clean = torch.randn(2, 6, 12)
    corrupted = clean + torch.randn(2, 6, 12)
    r = heads.patch(model, clean, corrupted, lambda out: out[:, -1, 0])
    with torch.no_grad(), multihead.capture(model) as cap:
        model(clean)
    p = explorer(cap, list("abcdef"), tmp_path / "p.html", patching=r)

    def act(page):
        got = page.eval_on_selector_all("#thumbs canvas", "els => els.map(e => [e.title, e.dataset.effect])")
        _show(page, 1, module=1)
        return got, page.text_content("#enlarged-title"), page.text_content("#patchnote")

    (got, title, note), errors = _open(p, exe, sync_api, act)
    assert errors == []
    want = [(f"{n} head {h}", float(e)) for n, es in r.effect().items() for h, e in enumerate(es)]
    assert [t.split(" — ")[0] for t, _ in got] == [n for n, _ in want]
    assert [float(e) for _, e in got] == pytest.approx([e for _, e in want], abs=1e-4)
    assert title.endswith(f"patching effect {float(r.effect()['layers.1'][1]):.3f}")
    assert note.startswith("Patching (denoise, metric ")
    with pytest.raises(ValueError, match=r"give the all-position result"):
        explorer(cap, None, None, patching=heads.patch(model, clean, corrupted, lambda out: out[:, -1, 0],
                                                       positions=True))
    with pytest.raises(ValueError, match=r"modules \['layers.0'\] are not in the capture"):
        explorer({"layers.1": cap["layers.1"]}, None, None, patching=r)
