"""One self-contained HTML file to explore every head: no CDN, no network; inline
CSS and JS; the weights inside as JSON (each head quantized to 8 bits and, past
``max_cells`` positions, averaged over blocks so that 4096-token inputs stay light).
The page opens on thumbnails (at most 56 x 56 cells a head, each on its own colour
scale); a head's full-resolution map is stored zlib-compressed and inflated by the
browser only when the head is opened, so 144 heads x 512 tokens open at once.

- all layers x heads as thumbnails under their head numbers; click one to enlarge it;
- the enlarged head reads without hovering: query tokens down its side, key tokens
  along its bottom (every n-th token on long inputs, at most 32 per axis) and a
  colour scale from 0 to the head's largest weight;
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
import re
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

#: thumbnails are at most this many cells a side (block means): what the page draws when it opens
THUMB_CELLS = 56


def _cells(w: Tensor, max_cells: int) -> tuple[bytes, float, int, int]:
    """(Lq, Lk) weights -> uint8 bytes (rows x cols, block means past ``max_cells``; 255 = their max),
    the max, rows, cols."""
    Lq, Lk = w.shape
    rows, cols = min(Lq, max_cells), min(Lk, max_cells)
    w = w.float()
    if (rows, cols) != (Lq, Lk):
        w = F.adaptive_avg_pool2d(w[None, None], (rows, cols))[0, 0]  # (Lq, Lk) -> (rows, cols)
    vmax = float(w.max()) if w.numel() else 0.0
    q = (w / vmax * 255).round().clamp(0, 255) if vmax > 0 else torch.zeros_like(w)
    return q.to(torch.uint8).numpy().tobytes(), vmax, rows, cols


def _head(w: Tensor, max_cells: int) -> tuple[dict, int, int]:
    """One head's entry: its thumbnail (``thumb``: at most THUMB_CELLS a side, its own colour scale), and
    its map at full resolution (``data``, up to ``max_cells`` a side) zlib-compressed when that is smaller
    (``z``: the page inflates it with the browser's DecompressionStream only when the head is opened)."""
    data, vmax, rows, cols = _cells(w, max_cells)
    thumb, _, trows, tcols = _cells(w, THUMB_CELLS)
    packed = zlib.compress(data, 1)
    z = len(packed) < len(data)
    entry = {"data": base64.b64encode(packed if z else data).decode("ascii"), "z": int(z), "vmax": vmax,
             "thumb": base64.b64encode(thumb).decode("ascii"), "trows": trows, "tcols": tcols}
    return entry, rows, cols


def _image_data_url(image) -> str:
    from multihead.extras import require

    plt = require("matplotlib.pyplot", "the explorer")  # the backend is the caller's (inline, or Agg headless)

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


def _module_data(name: str, w: Tensor, tokens, key_tokens, batch: int, max_cells: int, *,
                 kv: int | None = None) -> dict:
    """One module's entry of the page: its heads' maps (None for a pruned head), sizes, token labels and ``kv``, its
    key/value heads where they are fewer than its query heads (the page names each head's group), else None."""
    if w.dim() != 4 or not 0 <= batch < w.shape[0]:
        raise ValueError(f"{name}: expected weights (B, H, Lq, Lk) with B > batch={batch}; got {tuple(w.shape)}.")
    w = w[batch].detach().cpu()  # (H, Lq, Lk)
    H, Lq, Lk = w.shape
    kt = key_tokens.get(name) if isinstance(key_tokens, Mapping) else key_tokens
    if kt is None and tokens is not None and len(tokens) == Lk:
        kt = tokens
    heads = [None if bool(w[h].isnan().all()) else _head(w[h], max_cells) for h in range(H)]  # NaN: pruned
    there = [e for e in heads if e is not None]
    rows, cols = (there[0][1], there[0][2]) if there else (min(Lq, max_cells), min(Lk, max_cells))
    return {
        "name": name,
        "kind": "self" if Lq == Lk and (kt is None or kt is tokens) else "cross",
        "lq": Lq, "lk": Lk, "rows": rows, "cols": cols,
        "queries": _labels(tokens, Lq, "q"), "keys": _labels(kt, Lk, "k"),
        "heads": [None if e is None else e[0] for e in heads],
        "kv": kv,
    }


def _patching_data(result, captured: Mapping[str, Tensor]) -> dict:
    """A patching result's effects per module and head, for the page ({"label", "effects": {name: [H]}})."""
    values = getattr(result, "values", None)
    if values is None or not hasattr(result, "effect"):
        raise TypeError(f"patching must be the result of multihead.heads.patch (a Patching); got {type(result).__name__}.")
    if any(v.dim() != 1 for v in values.values()):
        raise ValueError("patching: give the all-position result (heads.patch(..., positions=False)); the explorer "
                         "shows one effect a head.")
    unknown = [n for n in values if n not in captured]
    if unknown:
        raise ValueError(f"patching: modules {unknown} are not in the capture; it holds {list(captured)}.")
    eff = result.effect()
    return {"label": f"{result.direction}, metric {result.base:.4g} -> {result.source:.4g}",
            "effects": {n: [None if not bool(torch.isfinite(x)) else float(x) for x in e] for n, e in eff.items()}}


_NODE = re.compile(r"^(.*)\.([hqkv])(\d+)$")  # a circuit graph's head node: module.h3, .q3, .k1 (a kv group), .v1


def _circuit_data(circuit, captured: Mapping[str, Tensor], kv: Mapping[str, int | None]) -> dict:
    """A circuit's edges for the page ({"edges": [[writer, reader, score or None]], "heads": {module: {h: [edge
    indices]}}}): each head its edges touch, as a writer (``module.h{h}``), through its query (``module.q{h}``) or
    through its key/value group's key or value (``module.k{g}``, ``module.v{g}``: every head of the group)."""
    edges, where = [], {}
    for e in circuit:
        if not isinstance(e, Sequence) or isinstance(e, str) or len(e) not in (2, 3) or \
                not all(isinstance(x, str) for x in e[:2]) or (len(e) == 3 and not isinstance(e[2], int | float)):
            raise TypeError("circuit takes edges (writer, reader) or (writer, reader, score), e.g. "
                            f"EdgeScores.top(20); got {e!r}.")
        i = len(edges)
        edges.append([e[0], e[1], float(e[2]) if len(e) == 3 else None])
        for name in e[:2]:
            m = _NODE.match(name)
            if m is None:
                continue  # the embedding, an MLP, the logits: not a head
            module, kind, n = m.group(1), m.group(2), int(m.group(3))
            if module not in captured:
                raise ValueError(f"circuit: {name} is a head of {module}, which the capture lacks; it holds "
                                 f"{list(captured)}.")
            H = captured[module].shape[1]
            per = H // (kv.get(module) or H) if kind in "kv" else 1
            for h in range(n * per, (n + 1) * per):
                where.setdefault(module, {}).setdefault(h, []).append(i)
    return {"edges": edges, "heads": where}


def _template() -> str:
    from importlib.resources import files

    return files("multihead.viz").joinpath("explorer.html").read_text(encoding="utf-8")


def _labels(given, n: int, prefix: str) -> list[str]:
    if given is not None and len(given) == n:
        return [str(t) for t in given]
    return [f"{prefix}{i}" for i in range(n)]


class Explorer:
    """The explorer page: ``html`` (the self-contained page) and ``path`` (the file written, or
    None). Path-like (``open(explorer)``, ``str(explorer)`` give the file), and in a notebook
    it shows itself inside the output cell: a sandboxed iframe whose ``srcdoc`` is the page
    (scripts run only inside it; the page's CSP allows no request)."""

    def __init__(self, html: str, path: Path | None, title: str):
        self.html, self.path, self.title = html, path, title

    def __fspath__(self) -> str:
        if self.path is None:
            raise TypeError("this explorer was not written to a file (path=None); use .html")
        return str(self.path)

    def __str__(self) -> str:
        return str(self.path) if self.path is not None else f"<explorer: {self.title}>"

    def __repr__(self) -> str:
        return f"Explorer({str(self)!r})"

    def stat(self):
        return Path(self.__fspath__()).stat()

    def read_text(self, encoding: str = "utf-8") -> str:
        return self.html

    def _repr_html_(self) -> str:
        doc = html.escape(self.html, quote=True)
        return (f'<iframe class="multihead-explorer" title="{html.escape(self.title)}" sandbox="allow-scripts" '
                f'style="width:100%;height:900px;border:1px solid #ccc" srcdoc="{doc}"></iframe>')


def explorer(
    captured: Mapping[str, Tensor],
    tokens: Sequence[str] | None = None,
    path: str | Path | None = "attention.html",
    *,
    key_tokens: Sequence[str] | Mapping[str, Sequence[str]] | None = None,
    batch: int = 0,
    image=None,
    patch_grid: tuple[int, int] | None = None,
    prefix_tokens: int = 0,
    title: str = "multihead: attention explorer",
    max_cells: int = 1024,
    patching=None,
    kv_heads: int | Mapping[str, int] | None = None,
    circuit: Sequence[Sequence] | None = None,
) -> Explorer:
    """Write the explorer for ``captured`` (name -> (B, H, Lq, Lk)) to ``path``.

    captured: a head whose weights are all NaN is not there (a pruned head kept in its place, so that the
        others keep their numbers): the page says "pruned" where it would be.
    tokens: the query tokens (and the key tokens of self-attention modules).
    key_tokens: key tokens for cross-attention: one list, or name -> list.
    image, patch_grid, prefix_tokens: for a ViT, the input picture ((h, w),
        (h, w, 3) or (C, h, w)), its patch grid (rows, cols), and how many tokens
        (e.g. a [CLS]) come before the patches.
    patching: an activation-patching result (:func:`multihead.heads.patch`, all positions) shown on the heads:
        each thumbnail's border and the enlarged head's title give its effect (share of the way from the base
        run's metric to the source run's).
    kv_heads: where query heads share key/value heads (grouped-query attention, H > Hkv), the number of key/value
        heads: one for every module or {name: number}; by default the capture's own record (``captured.kv_heads``).
        Each head is then labelled with its group ("kv group g": query head h reads group h // (H // Hkv)).
    circuit: a circuit's edges, (writer, reader) or (writer, reader, score) with the node names of
        :func:`multihead.heads.circuit_graph` (e.g. ``scores.top(20)`` of :func:`multihead.heads.edge_attribution`):
        each head an edge touches (its output, its query, its key/value group's key or value) is outlined in green and
        the enlarged head lists its edges with their scores.
    path: where to write the page; None = no file (the page is in ``.html``).
    Returns an :class:`Explorer` (path-like; shows itself inline in a notebook).
    """
    if not captured:
        raise ValueError("nothing to show: the capture is empty (did the model run inside multihead.capture()?).")
    if image is not None and patch_grid is None:
        raise ValueError("image needs patch_grid=(rows, cols), the patches' layout over the picture.")
    from multihead.viz.heatmaps import _kv_rows

    kv = {n: _kv_rows(captured, kv_heads, [n], w.shape[1])[0] if w.dim() == 4 else None  # (B, H, Lq, Lk)
          for n, w in captured.items()}
    modules = [_module_data(name, w, tokens, key_tokens, batch, max_cells, kv=kv[name]) for name, w in captured.items()]
    data = {"title": title, "modules": modules}
    if image is not None:
        data["image"] = {"src": _image_data_url(image), "grid": list(patch_grid), "prefix": prefix_tokens}
    if patching is not None:
        data["patching"] = _patching_data(patching, captured)
    data.update({} if circuit is None else {"circuit": _circuit_data(circuit, captured, kv)})
    payload = json.dumps(data, separators=(",", ":")).replace("<", "\\u003c").replace(">", "\\u003e")
    page = _template().replace("%TITLE%", html.escape(title)).replace("%DATA%", payload)
    if path is not None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(page, encoding="utf-8")
    return Explorer(page, path, title)
