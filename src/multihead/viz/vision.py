"""A vision model's tokens as what they are: patches at (row, column) of the picture and the tokens before them
([CLS], a distillation token, registers), for the heatmaps, the explorer and the pictures drawn over the image.

    lay = vision_layout(model)                 # timm's and torchvision's ViTs, open_clip's image tower
    x, picture = load_image("cat.png", model)  # (1, 3, H, W) normalised, and the picture itself
    lay.tokens                                 # ["[CLS]", "(0, 0)", "(0, 1)", ...]
    cls_figure(captured, lay)                  # each head's [CLS] attention over the patch grid
    overlay_figure(picture, rollout_row, lay)  # a map over the patches drawn on the picture

An image that does not fit the model's patch grid is refused with both sizes (resize or crop it first); a model
whose patches and tokens multihead cannot tell is refused naming its class.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

__all__ = ["VisionLayout", "cls_figure", "load_image", "overlay_figure", "vision_layout"]

#: ImageNet's mean and standard deviation per channel (torchvision's and timm's default normalisation)
IMAGENET = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))


@dataclass(frozen=True)
class VisionLayout:
    """The token layout of a ViT: its input size (H, W) in pixels, its patch size (ph, pw), the patch grid
    (rows, cols) and the labels of the tokens before the patches."""

    image: tuple[int, int]
    patch: tuple[int, int]
    grid: tuple[int, int]
    prefix: tuple[str, ...]
    mean: tuple[float, ...] = IMAGENET[0]
    std: tuple[float, ...] = IMAGENET[1]

    @property
    def tokens(self) -> list[str]:
        """Every token's label, in the model's order: the prefix, then the patches row by row as "(r, c)"."""
        return [*self.prefix, *(f"({r}, {c})" for r in range(self.grid[0]) for c in range(self.grid[1]))]


def _pair(v) -> tuple[int, int]:
    return (int(v), int(v)) if isinstance(v, int) else (int(v[0]), int(v[1]))


def vision_layout(model: nn.Module) -> VisionLayout:
    """The token layout of timm's ``VisionTransformer`` (ViT, DeiT, EVA: ``patch_embed``, ``cls_token``,
    ``dist_token``, ``reg_token``), torchvision's ``VisionTransformer`` or open_clip's image tower (``CLIP.visual``,
    or a CLIP model itself). ValueError naming the class for any other model."""
    visual = getattr(model, "visual", None)
    if isinstance(visual, nn.Module) and hasattr(visual, "grid_size"):  # open_clip's CLIP: its image tower
        model = visual
    pe = getattr(model, "patch_embed", None)
    if pe is not None and hasattr(pe, "grid_size") and hasattr(pe, "patch_size") and getattr(pe, "img_size", None):
        prefix = (["[CLS]"] if getattr(model, "cls_token", None) is not None else []) + \
                 (["[DIST]"] if getattr(model, "dist_token", None) is not None else [])
        reg = getattr(model, "reg_token", None)
        prefix += [f"[REG{i}]" for i in range(reg.shape[1])] if reg is not None else []
        cfg = getattr(model, "pretrained_cfg", None) or {}
        return VisionLayout(_pair(pe.img_size), _pair(pe.patch_size), _pair(pe.grid_size), tuple(prefix),
                            tuple(cfg.get("mean", IMAGENET[0])), tuple(cfg.get("std", IMAGENET[1])))
    if hasattr(model, "class_token") and hasattr(model, "conv_proj") and isinstance(getattr(model, "image_size", None),
                                                                                    int):  # torchvision
        side, p = model.image_size, model.patch_size
        return VisionLayout((side, side), (p, p), (side // p, side // p), ("[CLS]",))
    if hasattr(model, "grid_size") and hasattr(model, "class_embedding") and hasattr(model, "conv1"):  # open_clip
        image, patch = _pair(model.image_size), _pair(model.patch_size)
        cfg = getattr(model, "preprocess_cfg", None) or {}
        return VisionLayout(image, patch, _pair(model.grid_size), ("[CLS]",),
                            tuple(cfg.get("mean", IMAGENET[0])), tuple(cfg.get("std", IMAGENET[1])))
    raise ValueError(f"{type(model).__name__}: multihead tells the patches and tokens of timm's and torchvision's "
                     "VisionTransformer (ViT, DeiT, EVA) and of open_clip's image tower; this model is none of them "
                     "(draw its heads with multihead.viz.heatmaps and your own token labels).")


def load_image(image, model_or_layout) -> tuple[Tensor, np.ndarray]:
    """``image`` (a file path, a PIL image or an (H, W, 3) array in [0, 1] or 0-255) as the model's input
    (1, 3, H, W), normalised by the layout's mean and std, and the picture itself (H, W, 3) in [0, 1]. ValueError
    with both sizes when the image is not the model's input size."""
    lay = model_or_layout if isinstance(model_or_layout, VisionLayout) else vision_layout(model_or_layout)
    name = "image"
    if isinstance(image, str | Path):
        from multihead.extras import require

        Image = require("PIL.Image", "load_image")
        name = f"image {image}"
        with Image.open(image) as im:
            image = np.asarray(im.convert("RGB"))
    elif type(image).__module__.startswith("PIL."):
        image = np.asarray(image.convert("RGB"))
    raw = np.asarray(image)
    pic = raw.astype(np.float64)
    if pic.ndim != 3 or pic.shape[-1] != 3:
        raise ValueError(f"{name}: expected an RGB picture (H, W, 3); got an array of shape {pic.shape}.")
    if raw.dtype == np.uint8 or pic.max() > 1.0:  # 0-255 (a file, a PIL image, uint8 pixels), even a dark one
        pic = pic / 255.0
    H, W = lay.image
    if pic.shape[:2] != (H, W):
        raise ValueError(f"{name} is {pic.shape[1]}x{pic.shape[0]} pixels; the model takes {W}x{H} "
                         f"({lay.grid[1]}x{lay.grid[0]} patches of {lay.patch[1]}x{lay.patch[0]}): resize or crop it "
                         f"to {W}x{H} first (PIL: image.resize(({W}, {H}))).")
    x = torch.tensor(pic, dtype=torch.float32).permute(2, 0, 1)  # (H, W, 3) -> (3, H, W)
    x = (x - torch.tensor(lay.mean)[:, None, None]) / torch.tensor(lay.std)[:, None, None]
    return x[None], pic


def _patch_map(row: Tensor, lay: VisionLayout) -> np.ndarray:
    """A query's weights over all keys (prefix + patches) as the (rows, cols) map over the patches."""
    n = len(lay.prefix)
    rows, cols = lay.grid
    if row.shape[-1] != n + rows * cols:
        raise ValueError(f"the weights have {row.shape[-1]} keys; the model's layout has {n} tokens before "
                         f"{rows}x{cols} patches ({n + rows * cols}): attention over windows (Swin) or another input "
                         "size has no one patch grid to draw.")
    return row[n:].reshape(rows, cols).detach().double().cpu().numpy()  # (rows * cols,) -> (rows, cols)


def cls_figure(captured, lay: VisionLayout, *, query: int = 0, batch: int = 0):
    """A matplotlib Figure: for every layer (row) and head (column), query token ``query``'s ([CLS]'s) attention
    over the patch grid, each on its own colour scale from 0 to its largest weight."""
    from multihead.extras import require

    Figure = require("matplotlib.figure", "cls_figure").Figure
    names = list(captured)
    H = max(w.shape[1] for w in captured.values())
    fig = Figure(figsize=(1.3 * H + 0.6, 1.3 * len(names) + 0.6), layout="constrained")
    axes = np.atleast_2d(fig.subplots(len(names), H, squeeze=False))
    for r, name in enumerate(names):
        w = captured[name][batch]  # (H, Lq, Lk)
        for h in range(H):
            ax = axes[r, h]
            ax.set_xticks([])
            ax.set_yticks([])
            if h >= w.shape[0] or bool(w[h].isnan().all()):
                ax.set_title("pruned" if h < w.shape[0] else "", fontsize=7)
                continue
            m = _patch_map(w[h, query], lay)
            ax.imshow(m, cmap="magma", vmin=0.0, vmax=float(m.max()) or 1.0)
            ax.set_title(f"h{h} max {m.max():.2f}", fontsize=7)
        axes[r, 0].set_ylabel(name, fontsize=7)
    label = lay.tokens[query] if query < len(lay.tokens) else f"token {query}"
    fig.suptitle(f"attention of {label} over the {lay.grid[0]}x{lay.grid[1]} patches, by layer and head", fontsize=9)
    return fig


def overlay_figure(picture: np.ndarray, row: Tensor, lay: VisionLayout, *, title: str = "rollout of [CLS]"):
    """A matplotlib Figure: the picture, and the map ``row`` (weights over all keys, e.g. a rollout's [CLS] row)
    over its patches drawn on it (each patch's square coloured by its share)."""
    from multihead.extras import require

    Figure = require("matplotlib.figure", "overlay_figure").Figure
    m = _patch_map(row, lay)
    big = np.kron(m / (m.max() or 1.0), np.ones(lay.patch))  # (rows, cols) -> (H, W): each patch its square
    fig = Figure(figsize=(6.4, 3.4), layout="constrained")
    a, b = fig.subplots(1, 2)
    for ax in (a, b):
        ax.imshow(picture)
        ax.set_xticks([])
        ax.set_yticks([])
    im = b.imshow(big, cmap="inferno", alpha=0.6, vmin=0.0, vmax=1.0)
    a.set_title("input", fontsize=9)
    b.set_title(f"{title} (share of its largest patch)", fontsize=9)
    fig.colorbar(im, ax=b, shrink=0.8)
    return fig
