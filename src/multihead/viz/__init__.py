"""See the heads: heatmaps (matplotlib), attention rollout, and a self-contained
HTML explorer; the pruning curve; a vision model's patches and tokens (:mod:`~multihead.viz.vision`); a circuit's
edges between heads as a picture and an offline page, and its faithfulness curve (:mod:`~multihead.viz.circuit`)."""

from multihead.viz.circuit import EDGE_COLOURS, circuit_figure, circuit_html, circuit_layout, faithfulness_figure
from multihead.viz.curves import curve_figure, plot_curve
from multihead.viz.explorer import explorer
from multihead.viz.heatmaps import heatmaps
from multihead.viz.rollout import ROLLOUT_AXES, rollout, stacks_of
from multihead.viz.vision import VisionLayout, cls_figure, load_image, overlay_figure, vision_layout

__all__ = ["EDGE_COLOURS", "ROLLOUT_AXES", "VisionLayout", "circuit_figure", "circuit_html", "circuit_layout",
           "cls_figure", "curve_figure", "explorer", "faithfulness_figure", "heatmaps", "load_image", "overlay_figure",
           "plot_curve", "rollout", "stacks_of", "vision_layout"]
