"""One checkpoint format for every model here: a directory with ``config.json`` and
``model.safetensors`` (never pickle). :func:`save`/:func:`load` serve models with a
dataclass ``config``; :class:`~multihead.models.Bert` writes and reads the same
format through :func:`write`, :func:`read` and :func:`restore`.

Pruned models rebuild themselves: the config records the head counts of every
pruned attention module ({name: [H, Hkv]}, under ``"multihead_head_counts"``),
read back before the weights are loaded.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from torch import Tensor, nn

from multihead.heads import attention_modules, head_counts, resize

__all__ = ["load", "read", "restore", "save", "write"]

HEADS_KEY = "multihead_head_counts"
_LEGACY_HEADS_KEY = "pruned_heads"  # written by multihead 0.1's checkpoints


def write(path: str | Path, config: dict, model: nn.Module) -> Path:
    """``config`` (plus the head counts of pruned modules) as ``config.json`` and the
    model's weights as ``model.safetensors`` in the directory ``path``."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = dict(config)
    counts = head_counts(model)
    if counts:
        config[HEADS_KEY] = counts
    (path / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "model.safetensors"))
    return path


def read(path: str | Path) -> tuple[dict, dict[str, Tensor]]:
    """(config, weights) from a checkpoint directory; a missing, unreadable or corrupt
    file raises ValueError naming it."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    cfg_file, w_file = path / "config.json", path / "model.safetensors"
    for f in (cfg_file, w_file):
        if not f.is_file():
            raise ValueError(f"{f} does not exist: a checkpoint directory holds config.json and model.safetensors "
                             "(written by multihead's save / save_pretrained).")
    try:
        config = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{cfg_file} is not valid JSON: {e}.") from None
    if not isinstance(config, dict):
        raise ValueError(f"{cfg_file} must hold a JSON object; got {type(config).__name__}.")
    try:
        weights = load_file(str(w_file))  # never unpickles
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{w_file} is not a readable safetensors file ({e}); write it again with save / "
                         "save_pretrained.") from None
    return config, weights


def restore(model: nn.Module, config: dict, weights: dict[str, Tensor], path: str | Path, *,
            strict: bool = True, ignore_missing: tuple[str, ...] = ()) -> nn.Module:
    """Resize pruned modules to the counts ``config`` records, check every weight's shape
    against the model (naming the file and the tensor when one does not fit), load them."""
    counts = config.get(HEADS_KEY) or config.get(_LEGACY_HEADS_KEY)
    if counts:
        mods = attention_modules(model)
        o_bias = {n: f"{n}.{m._proj_names[3]}.bias" in weights for n, m in mods.items() if n in counts}
        resize(model, counts, o_bias=o_bias)
    own = model.state_dict()
    w_file = Path(path) / "model.safetensors"
    wrong = [f"{k}: file {tuple(t.shape)}, model {tuple(own[k].shape)}" for k, t in weights.items()
             if k in own and tuple(t.shape) != tuple(own[k].shape)]
    if wrong:
        raise ValueError(f"the weights in {w_file} do not fit the model built from {Path(path) / 'config.json'}: "
                         + "; ".join(wrong[:4]) + ". Check the config's sizes (hidden size, heads, layers).")
    missing, unexpected = model.load_state_dict(weights, strict=False)
    missing = [m for m in missing if not m.startswith(ignore_missing)] if ignore_missing else list(missing)
    if strict and (missing or unexpected):
        raise ValueError(f"the weights in {w_file} do not fit the config: missing {missing[:5]}, "
                         f"unexpected {list(unexpected)[:5]}.")
    return model.eval()


def save(model: nn.Module, path: str | Path) -> Path:
    """Config JSON (the model's dataclass ``config``) + safetensors weights in ``path`` (a directory)."""
    return write(path, asdict(model.config), model)


def load(cls, cfg_cls, path: str | Path):
    """Rebuild ``cls(cfg_cls(**config.json))``, give pruned modules their recorded head
    counts, and load its weights, in eval mode."""
    config, weights = read(path)
    fields = {k: v for k, v in config.items() if k not in (HEADS_KEY, _LEGACY_HEADS_KEY)}
    try:
        cfg = cfg_cls(**fields)
    except TypeError as e:
        raise ValueError(f"{Path(path) / 'config.json'} does not fit {cfg_cls.__name__}: {e}.") from None
    return restore(cls(cfg), config, weights, path)
