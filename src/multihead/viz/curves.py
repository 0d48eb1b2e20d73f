"""The pruning curve as a picture: the metric and the speed-up against the share of heads pruned
(the rows :func:`multihead.heads.pruning_curve` returns); an activation-patching grid (module x head, or each
module's heads x positions) of :func:`multihead.heads.patch`."""

from __future__ import annotations

from pathlib import Path

__all__ = ["curve_figure", "patching_figure", "plot_curve"]


def plot_curve(rows: list[dict], path: str | Path, *, metric_name: str = "metric", baseline_ms: dict | None = None):
    """The pruning curve (:func:`curve_figure`) saved to ``path``."""
    curve_figure(rows, metric_name=metric_name, baseline_ms=baseline_ms).savefig(path, dpi=110)
    return Path(path)


def curve_figure(rows: list[dict], *, metric_name: str = "metric", baseline_ms: dict | None = None):
    """The pruning curve as a matplotlib Figure: the metric (and, where the rows have ``metric_recovered``, the
    metric after each step's recovery) and (when measured) the speed-up against the unpruned model, all against
    the share of heads pruned (a notebook shows it inline)."""
    from multihead.extras import require

    Figure = require("matplotlib.figure", "plot_curve").Figure  # no pyplot: the caller's backend is left alone

    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    fr = [100 * r["fraction"] for r in rows]
    lines = ax.plot(fr, [r["metric"] for r in rows], "o-", color="C0", label=metric_name +
                    (" (cut, no recovery)" if rows and "metric_recovered" in rows[0] else ""))
    if rows and "metric_recovered" in rows[0]:  # each step recovered too: the exercise's answer with its fix
        steps = max((r.get("recovery") or {}).get("steps", 0) for r in rows)
        lines += ax.plot(fr, [r["metric_recovered"] for r in rows], "o-", color="C5",
                         label=f"{metric_name} after recovery ({steps} steps)")
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


def patching_figure(result, *, metric_name: str = "metric"):
    """An activation-patching result (:class:`multihead.heads.Patching`) as a matplotlib Figure: each patch's effect
    ((value - base) / (source - base), 1 = that head alone moves the metric all the way), modules down and heads
    across; per position, one panel a module (heads down, positions across)."""
    from multihead.extras import require

    Figure = require("matplotlib.figure", "patching_figure").Figure
    span = result.source - result.base
    scale = span if span != 0 else 1.0
    values = {n: ((v - result.base) / scale).float() for n, v in result.values.items()}
    per_position = next(iter(values.values())).dim() == 2
    panels = list(values.items()) if per_position else [("", result.grid().sub(result.base).div(scale).float())]
    fig = Figure(figsize=(7, 1.2 + 0.5 * sum(v.shape[0] for _, v in panels)))
    axes = fig.subplots(len(panels), 1, squeeze=False)[:, 0]
    lim = max(float(v.nan_to_num().abs().max()) for _, v in panels) or 1.0
    for ax, (name, v) in zip(axes, panels, strict=True):
        im = ax.imshow(v.numpy(), cmap="RdBu_r", vmin=-lim, vmax=lim, aspect="auto")
        if per_position:
            ax.set_ylabel(f"{name}\nhead", fontsize=7)
            ax.set_xlabel("query position", fontsize=7)
        else:
            ax.set_yticks(range(len(values)), list(values), fontsize=7)
            ax.set_xticks(range(v.shape[1]))
            ax.set_xlabel("head")
        fig.colorbar(im, ax=ax, fraction=0.03)
    verb = "restores" if result.direction == "denoise" else "removes"
    axes[0].set_title(f"share of {metric_name} each head {verb} ({result.direction}: base {result.base:.3g}, "
                      f"source {result.source:.3g})", fontsize=8)
    fig.tight_layout()
    return fig
