"""Heatmaps of attention weights: a grid of layers x heads, one colour scale."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch
from torch import Tensor


def as_grid(weights, *, batch: int = 0, num_heads: int | None = None) -> tuple[Tensor, list[str]]:
    """Weights in any of the accepted forms -> (rows, cols, Lq, Lk) on the CPU and row labels.

    - a mapping name -> (B, H, Lq, Lk) (what :func:`multihead.capture` gives):
      rows are the modules (layers), sequence ``batch`` of each;
    - a 4-D tensor (rows, cols, Lq, Lk), drawn as it is (the course's ``show_heatmaps``);
    - a 3-D tensor (B*H, Lq, Lk), the course module's ``attention.attention_weights``,
      with ``num_heads`` given: rows are the sequences, columns the heads;
    - a 2-D tensor (Lq, Lk): one map.
    """
    if isinstance(weights, Mapping):
        if not weights:
            raise ValueError("no weights to draw: the capture is empty (did the model run inside capture()?).")
        names = list(weights)
        mats = [weights[n] for n in names]
        shapes = {tuple(m.shape[1:]) for m in mats}
        if len(shapes) > 1:
            raise ValueError(f"modules have different (H, Lq, Lk) shapes {sorted(shapes)}; draw them one at a time "
                             "with heatmaps({name: captured[name]}).")
        for n, m in zip(names, mats):
            if m.dim() != 4 or not 0 <= batch < m.shape[0]:
                raise ValueError(f"{n}: expected (B, H, Lq, Lk) with B > batch={batch}; got {tuple(m.shape)}.")
        return torch.stack([m[batch].detach().float().cpu() for m in mats]), names  # (layers, H, Lq, Lk)
    if not isinstance(weights, Tensor):
        raise TypeError(f"weights must be a tensor or a mapping of tensors; got {type(weights).__name__}.")
    w = weights.detach().float().cpu()
    if w.dim() == 2:
        return w[None, None], [""]
    if w.dim() == 3:
        if num_heads is None:
            raise ValueError(f"weights of shape {tuple(w.shape)} are (B*H, Lq, Lk): pass num_heads=H.")
        if w.shape[0] % num_heads:
            raise ValueError(f"weights' first dim {w.shape[0]} is not a multiple of num_heads={num_heads}.")
        w = w.reshape(-1, num_heads, w.shape[1], w.shape[2])  # (B*H, Lq, Lk) -> (B, H, Lq, Lk)
        return w, [f"sequence {i}" for i in range(w.shape[0])]
    if w.dim() == 4:  # one row needs no name (a rollout (B=1, 1, L, L)); several are numbered
        return w, [f"row {i}" for i in range(w.shape[0])] if w.shape[0] > 1 else [""]
    raise ValueError(f"weights must be 2-D, 3-D (with num_heads), 4-D or a mapping; got shape {tuple(w.shape)}.")


class _Style(NamedTuple):
    """How every panel of :func:`heatmaps` is labelled: token labels, axis names, titles, colours, the
    label limit, whether each head has its own scale, the grid's R x C, and the rows' names."""

    queries: Sequence[str] | None
    keys: Sequence[str] | None
    xlabel: str
    ylabel: str
    titles: Sequence[str] | None
    cmap: str
    max_labels: int
    per_head: bool
    R: int
    C: int
    row_names: list
    kv: list  # each row's key/value heads where fewer than its query heads (grouped), else None


def _title(r: int, c: int, st: _Style) -> str | None:
    """Panel (r, c)'s title: the caller's (one a column, or one a panel), else the head's number (and its key/value
    group, where the heads are grouped) on the first row, or on every row where the rows' groups differ."""
    titles = st.titles
    if titles is not None:
        return titles[c] if len(titles) == st.C else titles[r * st.C + c]
    if not (r == 0 or st.per_head or len(set(st.kv)) > 1):
        return None
    return f"head {c}" if st.kv[r] is None else f"head {c}\nkv group {c // (st.C // st.kv[r])}"


def _kv_rows(weights, kv_heads, row_names: list, H: int) -> list:
    """Each row's number of key/value heads where it is grouped (fewer than the H query heads), else None: from
    ``kv_heads`` (one number, or {row name: number}), else from a capture's own record (``Captured.kv_heads``)."""
    given = kv_heads if kv_heads is not None else getattr(weights, "kv_heads", None)
    if given is None:
        return [None] * len(row_names)
    if isinstance(given, Mapping):
        per = [given.get(n) for n in row_names]
    elif isinstance(given, int) and not isinstance(given, bool):
        per = [given] * len(row_names)
    else:
        raise TypeError(f"kv_heads must be a number of key/value heads or {{row name: number}}; got {given!r}.")
    for n, k in zip(row_names, per):
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1 or H % k):
            raise ValueError(f"kv_heads: {n or 'the weights'} has {H} query heads, which {k!r} key/value heads do "
                             f"not divide into groups; give a divisor of {H} (the module's num_key_value_heads).")
    return [None if k is None or k == H else k for k in per]


def _panel(ax, img, r: int, c: int, st: _Style, vmax: float):
    """Draw panel (r, c): the weights ``img`` (Lq, Lk), its title, labels and ticks; returns the image (None for a
    head that is not there: all NaN, a pruned head, drawn as an empty box saying so)."""
    from matplotlib.ticker import MaxNLocator

    Lq, Lk = img.shape
    absent = img.numel() > 0 and bool(img.isnan().all())
    top = 1.0 if absent else (float(img.max()) if img.numel() else 0.0) if st.per_head else vmax
    im = ax.imshow(img.numpy(), cmap=st.cmap, vmin=0.0, vmax=top or 1.0, aspect="auto", interpolation="nearest")
    title = _title(r, c, st)
    if absent:
        ax.text(0.5, 0.5, "pruned", ha="center", va="center", transform=ax.transAxes, fontsize=8, color="0.45")
    elif st.per_head:
        title = f"{title or ''} (max {top:.2g})".strip()
    if title is not None:
        ax.set_title(title, fontsize=8 if not st.per_head else 6)
    if c == 0:
        ax.set_ylabel(f"{st.row_names[r]}\n{st.ylabel}" if st.row_names[r] else st.ylabel, fontsize=7)
    if r == st.R - 1:
        ax.set_xlabel(st.xlabel, fontsize=7)
    if st.keys is not None and Lk <= st.max_labels:
        ax.set_xticks(range(Lk), labels=list(st.keys), rotation=90, fontsize=6)
    if st.queries is not None and Lq <= st.max_labels:
        ax.set_yticks(range(Lq), labels=list(st.queries), fontsize=6)
    ax.tick_params(length=0, labelsize=6)
    if st.keys is None or Lk > st.max_labels:  # positions: whole numbers only
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if st.queries is None or Lq > st.max_labels:
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    return None if absent else im


def heatmaps(
    weights,
    *,
    queries: Sequence[str] | None = None,
    keys: Sequence[str] | None = None,
    batch: int = 0,
    num_heads: int | None = None,
    xlabel: str = "Keys",
    ylabel: str = "Queries",
    titles: Sequence[str] | None = None,
    cmap: str = "Reds",
    cell: float = 2.2,
    max_labels: int = 40,
    value_label: str = "attention weight",
    scale: str = "auto",
    kv_heads: int | Mapping[str, int] | None = None,
):
    """A matplotlib Figure: one heatmap per (row, head), rows = layers (or what the
    first dim of a 4-D tensor is).

    ``scale``: ``"shared"`` -- one colour scale for every panel, with a colour bar;
    ``"per_head"`` -- each panel from 0 to its own largest value (written in its title), so a
    head whose weights are spread over hundreds of keys (~0.01 each) still shows its pattern;
    ``"auto"`` (default) -- per head when there are more than ``max_labels`` keys, else shared.

    ``queries``/``keys``: token labels for the axes (shown when at most
    ``max_labels``; otherwise positions, on integer ticks). ``value_label``: what the colour
    bar measures (rollout values are not attention weights). Save with
    ``fig.savefig("heads.png")`` (or .svg, .pdf). A head whose weights are all NaN is not there (a pruned head,
    kept in its place so the others keep their numbers): its panel says "pruned".

    ``kv_heads``: where the query heads share key/value heads (grouped-query attention, H > Hkv), each head's
    title names its group under its number ("head 4", "kv group 1": query head h reads group h // (H // Hkv)).
    One number for every row, or {row name: number}; by default a capture's own record
    (:class:`multihead.heads.capture.Captured`'s ``kv_heads``), so a capture of a grouped model is labelled as it is.
    """
    from multihead.extras import require

    plt = require("matplotlib.pyplot", "heatmaps")  # the backend is the caller's: inline in a notebook, Agg headless

    if scale not in ("auto", "shared", "per_head"):
        raise ValueError(f"scale must be 'auto', 'shared' or 'per_head'; got {scale!r}.")
    grid, row_names = as_grid(weights, batch=batch, num_heads=num_heads)  # (rows, cols, Lq, Lk)
    R, C, Lq, Lk = grid.shape
    per_head = scale == "per_head" or scale == "auto" and Lk > max_labels
    for name, labels, n in (("queries", queries, Lq), ("keys", keys, Lk)):
        if labels is not None and len(labels) != n:
            raise ValueError(f"{name} has {len(labels)} labels but the weights have {n} {name}.")
    fig, axes = plt.subplots(R, C, figsize=(cell * C + 1.2, cell * R + 0.4), squeeze=False, sharex=True, sharey=True)
    kv = _kv_rows(weights, kv_heads, row_names, C)
    style = _Style(queries, keys, xlabel, ylabel, titles, cmap, max_labels, per_head, R, C, row_names, kv)
    vmax = float(grid.nan_to_num(0.0).max()) if grid.numel() else 1.0
    im = None
    for r in range(R):
        for c in range(C):
            im = _panel(axes[r, c], grid[r, c], r, c, style, vmax) or im
    if not per_head and im is not None:  # one scale: one colour bar (per head, each title gives its panel's top)
        fig.colorbar(im, ax=axes, shrink=0.6, label=value_label)
    return fig
