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
    (path / "config.json").write_text(json.dumps(asdict(model.config), indent=2))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "model.safetensors"))


def load(cls, cfg_cls, path: str | Path):
    """Rebuild ``cls(cfg_cls(**config.json))`` and load its weights, in eval mode."""
    from safetensors.torch import load_file

    path = Path(path)
    model = cls(cfg_cls(**json.loads((path / "config.json").read_text())))
    model.load_state_dict(load_file(str(path / "model.safetensors")))
    return model.eval()
