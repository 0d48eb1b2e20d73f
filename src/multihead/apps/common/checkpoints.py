"""Where the course's two models are kept: what ``demo`` trains, ``viz`` and ``prune`` read."""

from __future__ import annotations

from pathlib import Path

DEMO_CHECKPOINTS = Path("out") / "checkpoints"  # where `make demo` (multihead demo --out out) keeps them


def checkpoints(given: str | None, out: Path) -> Path:
    """The checkpoint folder: --checkpoints, else OUT/checkpoints or the demo's out/checkpoints,
    whichever holds a trained model; else the demo's (trained there, found by the next command)."""
    if given:
        return Path(given)
    for c in (out / "checkpoints", DEMO_CHECKPOINTS):
        if any((c / m / "model.safetensors").exists() for m in ("transformer", "vit")):
            return c
    return DEMO_CHECKPOINTS

