"""Every head of a vision model on one picture: ``multihead viz --timm NAME --checkpoint FILE --image FILE``
(or ``--torchvision NAME``), and the Python call behind it:

    from multihead.apps.viz import vision
    model = vision.load_model("timm", "vit_small_patch16_224", "vit_s.safetensors")
    vision.draw(model, "cat.png", "out/viz")   # heads.png, cls_attention.png, rollout.png, attention.html

The model is seen on its own call (no probe: :func:`multihead.capture` observes the SDPA or
``nn.MultiheadAttention`` calls as they happen); its keys are labelled as the patches they are ("(row, col)")
and the tokens before them ([CLS], [DIST], registers); the rollout of [CLS] is drawn over the picture.
Checkpoints are read with safetensors (never unpickled).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

__all__ = ["draw", "load_model"]


def load_model(package: str, name: str, checkpoint: str | Path | None = None, model_args: dict | None = None
               ) -> nn.Module:
    """timm's ``create_model(name, **model_args)`` or torchvision's ``models.get_model(name, **model_args)``, random
    weights, then the state dict in ``checkpoint`` (a .safetensors file; its classifier's size read from it), in
    eval mode. ValueError for an unknown package or name, or a checkpoint that does not fit the model."""
    from multihead.extras import require

    args = dict(model_args or {})
    state = None
    if checkpoint is not None:
        from safetensors.torch import load_file

        if not str(checkpoint).endswith(".safetensors"):
            raise ValueError(f"--checkpoint {checkpoint}: give a .safetensors file (multihead never unpickles a "
                             "checkpoint; save one with safetensors.torch.save_file(model.state_dict(), PATH)).")
        state = load_file(str(checkpoint))
        head = next((state[k] for k in ("head.weight", "heads.head.weight", "fc.weight") if k in state), None)
        if head is not None and "num_classes" not in args:
            args["num_classes"] = int(head.shape[0])
    if package == "timm":
        timm = require("timm", "vision")
        if not timm.is_model(name.split(".", 1)[0]):  # "vit_base_patch16_224.augreg_in21k": a name and its tag
            raise ValueError(f"--timm {name!r} is not one of timm's models (timm.list_models() lists them).")
        model = timm.create_model(name, pretrained=False, **args)
    elif package == "torchvision":
        tv = require("torchvision", "vision")
        if name not in tv.models.list_models():
            raise ValueError(f"--torchvision {name!r} is not one of torchvision's models "
                             "(torchvision.models.list_models() lists them).")
        model = tv.models.get_model(name, weights=None, **args)
    else:
        raise ValueError(f"package must be 'timm' or 'torchvision'; got {package!r}.")
    if state is not None:
        try:
            model.load_state_dict(state)
        except RuntimeError as e:
            first = str(e).splitlines()[0]
            raise ValueError(f"--checkpoint {checkpoint} does not fit {package}'s {name} with {args or 'its defaults'} "
                             f"({first}); give the sizes it was trained with in --model-args.") from None
    return model.eval()


def draw(model: nn.Module, image, out: str | Path, *, batch_note: str = "") -> list[Path]:
    """Run ``model`` on ``image`` (a path, a PIL image or an (H, W, 3) array at the model's input size) inside
    :func:`multihead.capture` and write into ``out``: ``heads.png`` (every layer's heads, keys labelled as patches
    where they fit), ``cls_attention.png`` ([CLS]'s attention over the patch grid per head), ``rollout.png`` (the
    rollout of [CLS] drawn over the picture), ``attention.html`` (the explorer, the picture under its patch grid)
    and ``vision.json`` (the layout and the predicted class). Returns the paths."""
    import multihead
    from multihead import viz

    lay = viz.vision_layout(model)
    x, picture = viz.load_image(image, lay)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with torch.no_grad(), multihead.capture(model, to_cpu=True) as cap:
        logits = model(x)
    captured = {n: w for n, w in cap.items() if w.shape[-1] == w.shape[-2]}  # self-attention (an attentional pool
    tokens = lay.tokens                                                      # has learned queries: left out)
    for n, w in captured.items():
        if w.shape[-1] != len(tokens):
            raise ValueError(f"{n}: its weights have {w.shape[-1]} keys; the model's layout has {len(lay.prefix)} "
                             f"tokens before {lay.grid[0]}x{lay.grid[1]} patches ({len(tokens)}): attention over "
                             "windows (Swin) has no one patch grid to draw; draw its heads with multihead.viz.heatmaps.")
    paths = [out / "heads.png", out / "cls_attention.png", out / "rollout.png", out / "attention.html",
             out / "vision.json"]
    fig = viz.heatmaps(captured, queries=tokens, keys=tokens, scale="per_head")
    fig.savefig(paths[0], dpi=80)
    viz.cls_figure(captured, lay).savefig(paths[1], dpi=100)
    roll = viz.rollout(captured)[0, 0]  # (B, L, L) -> [CLS]'s row (L,)
    viz.overlay_figure(picture, roll, lay).savefig(paths[2], dpi=100)
    viz.explorer(captured, tokens, paths[3], image=picture, patch_grid=lay.grid, prefix_tokens=len(lay.prefix),
                 title=f"multihead: {type(model).__name__}{batch_note}")
    top = int(logits.reshape(-1).argmax()) if isinstance(logits, torch.Tensor) else None
    paths[4].write_text(json.dumps({"image": list(lay.image), "patch": list(lay.patch), "grid": list(lay.grid),
                                    "prefix": list(lay.prefix), "modules": list(captured), "top_class": top},
                                   indent=1))
    return paths
