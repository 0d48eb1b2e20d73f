"""The pruning curve as a picture: the metric and the speed-up against the share of heads pruned
(the rows :func:`multihead.heads.pruning_curve` returns)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["curve_figure", "plot_curve"]


def plot_curve(rows: list[dict], path: str | Path, *, metric_name: str = "metric", baseline_ms: dict | None = None):
    """The pruning curve (:func:`curve_figure`) saved to ``path``."""
    curve_figure(rows, metric_name=metric_name, baseline_ms=baseline_ms).savefig(path, dpi=110)
    return Path(path)


def curve_figure(rows: list[dict], *, metric_name: str = "metric", baseline_ms: dict | None = None):
    """The pruning curve as a matplotlib Figure: the metric and (when measured) the speed-up against
    the unpruned model, both against the share of heads pruned (a notebook shows it inline)."""
    from multihead.extras import require

    Figure = require("matplotlib.figure", "plot_curve").Figure  # no pyplot: the caller's backend is left alone

    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    fr = [100 * r["fraction"] for r in rows]
    lines = ax.plot(fr, [r["metric"] for r in rows], "o-", color="C0", label=metric_name)
    ax.set_xlabel("heads pruned (%)")
    ax.set_ylabel(metric_name, color="C0")
    ax.set_title(f"pruning curve: {metric_name}" + (" and speed-up" if rows and "speed_ms" in rows[0] else "")
                 + " against the share of heads pruned", fontsize=9)
    if rows and "speed_ms" in rows[0]:
        ax2 = ax.twinx()
        base = baseline_ms or rows[0]["speed_ms"]
        for i, b in enumerate(sorted(rows[0]["speed_ms"], key=int)):
            lines += ax2.plot(fr, [base[b] / r["speed_ms"][b] for r in rows], "s--", color=f"C{i + 1}",
                              label=f"speed-up, batch {b}")
        ax2.set_ylabel("speed-up (x the unpruned model)")
    ax.legend(lines, [ln.get_label() for ln in lines], fontsize=8, loc="lower left")  # one legend for both axes
    fig.tight_layout()
    return fig
