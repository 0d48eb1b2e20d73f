"""One self-contained HTML file to explore every head: no CDN, no network; inline
CSS and JS; the weights inside as JSON (each head quantized to 8 bits and, past
``max_cells`` positions, averaged over blocks so that 4096-token inputs stay light).

- all layers x heads as thumbnails; click one to enlarge it;
- hover a query token to see what it attends to (keys shaded by weight), or a
  cell of the enlarged map to read its weight;
- self- and cross-attention (query and key tokens per module);
- image inputs (a ViT): the picture with its patch grid; hovering a patch shows
  where it looks.

Every token is shown as text (``textContent``), never parsed as HTML.
"""

from __future__ import annotations

import base64
import html
import io
import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor


def _quantize(w: Tensor, max_cells: int) -> tuple[str, float, int, int]:
    """(Lq, Lk) weights -> base64 of uint8 (rows x cols, block means), the max, rows, cols."""
    Lq, Lk = w.shape
    rows, cols = min(Lq, max_cells), min(Lk, max_cells)
    w = w.float()
    if (rows, cols) != (Lq, Lk):
        w = F.adaptive_avg_pool2d(w[None, None], (rows, cols))[0, 0]  # (Lq, Lk) -> (rows, cols)
    vmax = float(w.max()) if w.numel() else 0.0
    q = (w / vmax * 255).round().clamp(0, 255) if vmax > 0 else torch.zeros_like(w)
    data = q.to(torch.uint8).numpy().tobytes()
    return base64.b64encode(data).decode("ascii"), vmax, rows, cols


def _image_data_url(image) -> str:
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    img = image.detach().cpu().numpy() if isinstance(image, Tensor) else np.asarray(image)
    if img.ndim == 3 and img.shape[0] in (1, 3) and img.shape[-1] not in (1, 3):
        img = np.moveaxis(img, 0, -1)  # (C, h, w) -> (h, w, C)
    if img.ndim == 3 and img.shape[-1] == 1:
        img = img[..., 0]
    img = img.astype(np.float64)
    img = (img - img.min()) / (np.ptp(img) or 1.0)
    buf = io.BytesIO()
    plt.imsave(buf, img, cmap="gray" if img.ndim == 2 else None, format="png")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _labels(given, n: int, prefix: str) -> list[str]:
    if given is not None and len(given) == n:
        return [str(t) for t in given]
    return [f"{prefix}{i}" for i in range(n)]


def explorer(
    captured: Mapping[str, Tensor],
    tokens: Sequence[str] | None = None,
    path: str | Path = "attention.html",
    *,
    key_tokens: Sequence[str] | Mapping[str, Sequence[str]] | None = None,
    batch: int = 0,
    image=None,
    patch_grid: tuple[int, int] | None = None,
    prefix_tokens: int = 0,
    title: str = "multihead: attention explorer",
    max_cells: int = 1024,
) -> Path:
    """Write the explorer for ``captured`` (name -> (B, H, Lq, Lk)) to ``path``.

    tokens: the query tokens (and the key tokens of self-attention modules).
    key_tokens: key tokens for cross-attention: one list, or name -> list.
    image, patch_grid, prefix_tokens: for a ViT, the input picture ((h, w),
        (h, w, 3) or (C, h, w)), its patch grid (rows, cols), and how many tokens
        (e.g. a [CLS]) come before the patches.
    Returns the path written.
    """
    if not captured:
        raise ValueError("nothing to show: the capture is empty (did the model run inside multihead.capture()?).")
    if image is not None and patch_grid is None:
        raise ValueError("image needs patch_grid=(rows, cols), the patches' layout over the picture.")
    modules = []
    for name, w in captured.items():
        if w.dim() != 4 or not 0 <= batch < w.shape[0]:
            raise ValueError(f"{name}: expected weights (B, H, Lq, Lk) with B > batch={batch}; got {tuple(w.shape)}.")
        w = w[batch].detach().cpu()  # (H, Lq, Lk)
        H, Lq, Lk = w.shape
        kt = key_tokens.get(name) if isinstance(key_tokens, Mapping) else key_tokens
        if kt is None and tokens is not None and len(tokens) == Lk:
            kt = tokens
        heads = [_quantize(w[h], max_cells) for h in range(H)]
        modules.append({
            "name": name,
            "kind": "self" if Lq == Lk and (kt is None or kt is tokens) else "cross",
            "lq": Lq, "lk": Lk, "rows": heads[0][2], "cols": heads[0][3],
            "queries": _labels(tokens, Lq, "q"), "keys": _labels(kt, Lk, "k"),
            "heads": [{"data": d, "vmax": v} for d, v, _, _ in heads],
        })
    data = {"title": title, "modules": modules}
    if image is not None:
        data["image"] = {"src": _image_data_url(image), "grid": list(patch_grid), "prefix": prefix_tokens}
    payload = json.dumps(data, separators=(",", ":")).replace("<", "\\u003c").replace(">", "\\u003e")
    page = _PAGE.replace("%TITLE%", html.escape(title)).replace("%DATA%", payload)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page, encoding="utf-8")
    return path


_PAGE = r"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; img-src data:; style-src 'unsafe-inline'; script-src 'unsafe-inline'">
<title>%TITLE%</title>
<style>
body{font:13px system-ui,sans-serif;margin:12px;color:#222;background:#fff}
h1{font-size:16px;margin:0 0 8px}
#main{display:flex;gap:16px;align-items:flex-start}
#thumbs{display:grid;gap:3px;align-content:start}
#thumbs .lab{font-size:10px;white-space:nowrap;overflow:hidden;text-overflow:ellipsis;max-width:160px;align-self:center}
#thumbs canvas{width:56px;height:56px;border:2px solid #ddd;cursor:pointer;image-rendering:pixelated}
#thumbs canvas.sel{border-color:#c00}
#big{border:1px solid #999;image-rendering:pixelated;width:512px;height:512px}
#tokens{max-width:520px;line-height:1.9}
#tokens span,#keys span{padding:1px 3px;margin:1px;border-radius:3px;cursor:default;white-space:pre}
#tokens span:hover{outline:1px solid #c00}
#keys{max-width:520px;line-height:1.9}
#info{min-height:1.4em;font-family:monospace}
#imgwrap{position:relative;display:inline-block}
#imgwrap img{width:256px;height:256px;image-rendering:pixelated;display:block}
#overlay{position:absolute;left:0;top:0;width:256px;height:256px}
</style></head><body>
<h1 id="title"></h1>
<div id="main">
 <div id="thumbs"></div>
 <div>
  <div id="enlarged-title"></div>
  <canvas id="big" width="512" height="512"></canvas>
  <div id="info"></div>
  <div><b>queries</b> (hover one): <div id="tokens"></div></div>
  <div><b>keys</b>: <div id="keys"></div></div>
  <div id="imgpanel" hidden><b>image</b> (hover a patch token):<br><div id="imgwrap"><img id="img" alt="input"><canvas id="overlay" width="256" height="256"></canvas></div></div>
 </div>
</div>
<script id="data" type="application/json">%DATA%</script>
<script>
"use strict";
const DATA = JSON.parse(document.getElementById("data").textContent);
document.getElementById("title").textContent = DATA.title;
const cache = new Map();
function head(m, h) {            // uint8 cells (rows x cols) of module m, head h
  const key = m + ":" + h;
  if (!cache.has(key)) {
    const s = atob(DATA.modules[m].heads[h].data), a = new Uint8Array(s.length);
    for (let i = 0; i < s.length; i++) a[i] = s.charCodeAt(i);
    cache.set(key, a);
  }
  return cache.get(key);
}
function color(v) { return [255, Math.round(255 - 0.8 * v), Math.round(255 - 0.9 * v)]; }
function draw(canvas, m, h, size) {   // nearest sampling: any number of cells fits the canvas
  const M = DATA.modules[m], a = head(m, h), ctx = canvas.getContext("2d");
  const W = Math.min(size, Math.max(M.cols, 1)), Hh = Math.min(size, Math.max(M.rows, 1));
  canvas.width = W; canvas.height = Hh;
  const img = ctx.createImageData(W, Hh);
  for (let y = 0; y < Hh; y++) {
    const r = Math.floor(y * M.rows / Hh);
    for (let x = 0; x < W; x++) {
      const c = Math.floor(x * M.cols / W), [R, G, B] = color(a[r * M.cols + c]), o = 4 * (y * W + x);
      img.data[o] = R; img.data[o + 1] = G; img.data[o + 2] = B; img.data[o + 3] = 255;
    }
  }
  ctx.putImageData(img, 0, 0);
}
let sel = [0, 0];
const thumbs = document.getElementById("thumbs");
const maxH = Math.max(...DATA.modules.map(M => M.heads.length));
thumbs.style.gridTemplateColumns = "160px repeat(" + maxH + ", 60px)";
DATA.modules.forEach((M, m) => {
  const lab = document.createElement("div");
  lab.className = "lab"; lab.textContent = M.name + " (" + M.kind + ")"; lab.title = M.name;
  thumbs.appendChild(lab);
  for (let h = 0; h < maxH; h++) {
    if (h >= M.heads.length) { thumbs.appendChild(document.createElement("div")); continue; }
    const c = document.createElement("canvas");
    c.dataset.module = m; c.dataset.head = h; c.title = M.name + " head " + h;
    draw(c, m, h, 56);
    c.addEventListener("click", () => select(m, h));
    thumbs.appendChild(c);
  }
});
function tokenSpans(el, list, max) {
  el.textContent = "";
  const n = Math.min(list.length, max), spans = [];
  for (let i = 0; i < n; i++) { const s = document.createElement("span"); s.textContent = list[i]; s.dataset.i = i; el.appendChild(s); spans.push(s); }
  if (list.length > n) { const s = document.createElement("span"); s.textContent = "… " + (list.length - n) + " more"; el.appendChild(s); }
  return spans;
}
let keySpans = [];
function select(m, h) {
  sel = [m, h];
  document.querySelectorAll("#thumbs canvas").forEach(c => c.classList.toggle("sel", +c.dataset.module === m && +c.dataset.head === h));
  const M = DATA.modules[m];
  document.getElementById("enlarged-title").textContent = M.name + " — head " + h + " (" + M.lq + " queries × " + M.lk + " keys, max weight " + M.heads[h].vmax.toFixed(3) + ")";
  draw(document.getElementById("big"), m, h, 512);
  const qs = tokenSpans(document.getElementById("tokens"), M.queries, 2048);
  keySpans = tokenSpans(document.getElementById("keys"), M.keys, 2048);
  qs.forEach(s => { s.addEventListener("mouseenter", () => showRow(+s.dataset.i)); });
}
function rowOf(i) {              // the stored row of query i (its block when downsampled)
  const [m, h] = sel, M = DATA.modules[m], a = head(m, h), r = Math.floor(i * M.rows / M.lq);
  return j => a[r * M.cols + Math.floor(j * M.cols / M.lk)] / 255 * M.heads[h].vmax;
}
function showRow(i) {
  const [m] = sel, M = DATA.modules[m], w = rowOf(i), vmax = M.heads[sel[1]].vmax || 1;
  keySpans.forEach((s, j) => { const v = w(j) / vmax; s.style.background = "rgba(200,0,0," + v.toFixed(3) + ")"; });
  document.getElementById("info").textContent = "query " + i + " " + JSON.stringify(M.queries[i]);
  if (DATA.image) drawOverlay(i);
}
document.getElementById("big").addEventListener("mousemove", e => {
  const [m, h] = sel, M = DATA.modules[m], r = e.target.getBoundingClientRect();
  const i = Math.min(M.lq - 1, Math.floor((e.clientY - r.top) / r.height * M.lq));
  const j = Math.min(M.lk - 1, Math.floor((e.clientX - r.left) / r.width * M.lk));
  document.getElementById("info").textContent = JSON.stringify(M.queries[i]) + " → " + JSON.stringify(M.keys[j]) + ": " + rowOf(i)(j).toFixed(4);
});
function drawOverlay(i) {
  const I = DATA.image, [m] = sel, M = DATA.modules[m], [gr, gc] = I.grid, w = rowOf(i);
  const c = document.getElementById("overlay"), ctx = c.getContext("2d"), cw = c.width / gc, ch = c.height / gr;
  ctx.clearRect(0, 0, c.width, c.height);
  const vmax = M.heads[sel[1]].vmax || 1;
  for (let p = 0; p < gr * gc && I.prefix + p < M.lk; p++) {
    ctx.fillStyle = "rgba(255,0,0," + (0.8 * w(I.prefix + p) / vmax).toFixed(3) + ")";
    ctx.fillRect((p % gc) * cw, Math.floor(p / gc) * ch, cw, ch);
  }
  ctx.strokeStyle = "rgba(0,0,255,0.4)";
  for (let x = 0; x <= gc; x++) { ctx.beginPath(); ctx.moveTo(x * cw, 0); ctx.lineTo(x * cw, c.height); ctx.stroke(); }
  for (let y = 0; y <= gr; y++) { ctx.beginPath(); ctx.moveTo(0, y * ch); ctx.lineTo(c.width, y * ch); ctx.stroke(); }
  const q = i - I.prefix;
  if (q >= 0 && q < gr * gc) { ctx.strokeStyle = "#00f"; ctx.lineWidth = 2; ctx.strokeRect((q % gc) * cw, Math.floor(q / gc) * ch, cw, ch); ctx.lineWidth = 1; }
}
if (DATA.image) {
  document.getElementById("imgpanel").hidden = false;
  document.getElementById("img").src = DATA.image.src;
}
select(0, 0);
if (DATA.image) drawOverlay(DATA.image.prefix);
</script></body></html>
"""
