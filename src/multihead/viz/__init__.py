"""See the heads: heatmaps (matplotlib), attention rollout, and a self-contained
HTML explorer; the pruning curve."""

from multihead.viz.curves import curve_figure, plot_curve
from multihead.viz.explorer import explorer
from multihead.viz.heatmaps import heatmaps
from multihead.viz.rollout import ROLLOUT_AXES, rollout, stacks_of

__all__ = ["ROLLOUT_AXES", "curve_figure", "explorer", "heatmaps", "plot_curve", "rollout", "stacks_of"]
