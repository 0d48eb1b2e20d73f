"""Checkpoints: config JSON + safetensors weights in a directory (never pickle)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from torch import nn


def save(model: nn.Module, path: str | Path) -> None:
    """Config JSON + safetensors weights in ``path`` (a directory)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = asdict(model.config)
    if getattr(model, "pruned_heads", None):  # head counts after multihead.heads.prune
        config["pruned_heads"] = model.pruned_heads
    (path / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "model.safetensors"))


def load(cls, cfg_cls, path: str | Path):
    """Rebuild ``cls(cfg_cls(**config.json))``, give pruned modules their recorded head
    counts, and load its weights, in eval mode."""
    from safetensors.torch import load_file

    from multihead.heads import resize

    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    pruned = config.pop("pruned_heads", None)
    model = cls(cfg_cls(**config))
    if pruned:
        resize(model, pruned)
    model.load_state_dict(load_file(str(path / "model.safetensors")))
    return model.eval()
