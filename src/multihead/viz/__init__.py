"""See the heads: heatmaps (matplotlib), attention rollout, and a self-contained
HTML explorer."""

from multihead.viz.explorer import explorer
from multihead.viz.heatmaps import heatmaps
from multihead.viz.rollout import ROLLOUT_AXES, rollout, stacks_of

__all__ = ["ROLLOUT_AXES", "explorer", "heatmaps", "rollout", "stacks_of"]
