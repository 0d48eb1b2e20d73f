"""Cut the heads: gates, head importance, physical pruning, the pruning curve.

- :func:`gated` installs a gate ξ_h on every head's output (the module's
  ``head_gates`` buffer is None unless set: no flag threads through any forward);
- :func:`importance` scores every head: ``"gradient"`` (Michel, Levy & Neubig
  2019: E|dL/dξ_h|, normalized per layer), ``"ablation"`` (the loss change when
  the head alone is gated off) or ``"entropy"`` (of its attention weights);
- :func:`prune` removes heads physically: q/k/v/o weights shrink and
  ``num_heads`` changes; the pruned model equals the gated one;
- :func:`pruning_curve` prunes step by step, measuring a metric and the speed.

Pruning every head of a layer is allowed: the module then outputs its output
projection's bias (zeros without bias), exactly what gating all its heads gives.
"""

from __future__ import annotations

import contextlib
import json
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

from multihead.capture import capture
from multihead.compat import TorchMultiheadAttention
from multihead.modules import AttentionCore, MultiHeadAttention

__all__ = ["Importance", "attention_modules", "gated", "importance", "mean_head_outputs", "prune", "pruning_curve",
           "resize"]


def attention_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Every multihead attention module in ``model``, by qualified name, in order."""
    return {n: m for n, m in model.named_modules() if isinstance(m, AttentionCore)}


@contextlib.contextmanager
def gated(model: nn.Module, values: Mapping[str, Tensor] | None = None, *, requires_grad: bool = False,
          fill: Mapping[str, Tensor] | None = None):
    """Inside the block every head's output is scaled by its gate (default 1).
    With ``fill`` ({module: (H, Dv)}), a head's output becomes
    ``gate * output + (1 - gate) * fill``: gated off, it is replaced by ``fill``
    (e.g. its mean output) instead of zeros. Yields {module name: gates (H,)}; the
    gates are removed afterwards."""
    mods = attention_modules(model)
    gates = {}
    for name, m in mods.items():
        H = m.num_heads
        g = values[name].detach().clone() if values is not None and name in values else None
        if g is None:
            w = next(iter(m.parameters()))
            g = torch.ones(H, device=w.device, dtype=w.dtype)
        if g.shape != (H,):
            raise ValueError(f"gates for {name} must have shape ({H},) (its heads); got {tuple(g.shape)}.")
        g.requires_grad_(requires_grad)
        m.head_gates = g
        m.head_fill = None if fill is None else fill.get(name)
        gates[name] = g
    try:
        yield gates
    finally:
        for m in mods.values():
            m.head_gates = None
            m.head_fill = None


@dataclass
class Importance:
    """Head scores: higher = more important. ``names[i]`` has ``scores[i]`` of shape (H_i,)."""

    names: list[str]
    scores: list[Tensor]
    method: str
    raw: list[Tensor] = field(default_factory=list)

    def table(self) -> Tensor:
        """(layers, max heads), NaN where a layer has fewer heads."""
        H = max((len(s) for s in self.scores), default=0)
        t = torch.full((len(self.scores), H), float("nan"))
        for i, s in enumerate(self.scores):
            t[i, : len(s)] = s
        return t

    def order(self) -> list[tuple[str, int]]:
        """Every (module, head), least important first."""
        items = [(float(s[h]), n, h) for n, s in zip(self.names, self.scores) for h in range(len(s))]
        return [(n, h) for _, n, h in sorted(items)]

    def least(self, count: int) -> dict[str, list[int]]:
        """The ``count`` least important heads, as {module: [heads]} for :func:`prune`."""
        out: dict[str, list[int]] = {}
        for n, h in self.order()[:count]:
            out.setdefault(n, []).append(h)
        return out

    def to_markdown(self, digits: int = 3) -> str:
        H = self.table().shape[1]
        lines = [f"| module ({self.method}) | " + " | ".join(f"h{h}" for h in range(H)) + " |",
                 "|---|" + "---:|" * H]
        for n, s in zip(self.names, self.scores):
            cells = [f"{float(x):.{digits}f}" for x in s] + [""] * (H - len(s))
            lines.append(f"| {n} | " + " | ".join(cells) + " |")
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {"method": self.method, "modules": {n: s.tolist() for n, s in zip(self.names, self.scores)}}


def _bar(it, desc: str, progress: bool, total: int | None = None):
    if not progress:
        return it
    from tqdm.auto import tqdm

    return tqdm(it, desc=desc, total=total, mininterval=1.0)


def importance(model: nn.Module, batches: Iterable, loss_fn: Callable[[nn.Module, object], Tensor],
               method: str = "gradient", *, normalize: bool = True, progress: bool = True,
               fill: Mapping[str, Tensor] | None = None) -> Importance:
    """Score every head of ``model`` on ``batches``.

    loss_fn(model, batch) -> a scalar loss. Methods:
      - "gradient": I_h = mean over batches of |dL/dξ_h| at ξ = 1 (Michel et al. 2019),
        divided by the layer's L2 norm when ``normalize``;
      - "ablation": mean loss with head h alone gated off (replaced by ``fill`` when
        given, else zeros), minus the mean loss of the full model (higher = the head
        matters more);
      - "entropy": minus the mean entropy of the head's attention rows (a focused head
        scores higher); ``raw`` keeps the entropies. loss_fn only has to run the model.
    """
    if method not in ("gradient", "ablation", "entropy"):
        raise ValueError(f"method must be 'gradient', 'ablation' or 'entropy'; got {method!r}.")
    mods = attention_modules(model)
    if not mods:
        raise ValueError("the model has no multihead attention modules to score.")
    names = list(mods)
    batches = list(batches)
    if not batches:
        raise ValueError("importance needs at least one batch.")
    was_training = model.training
    model.eval()
    try:
        if method == "gradient":
            total = {n: torch.zeros(mods[n].num_heads) for n in names}
            with gated(model, requires_grad=True) as g:
                for b in _bar(batches, "importance (gradient)", progress):
                    loss = loss_fn(model, b)
                    grads = torch.autograd.grad(loss, [g[n] for n in names], allow_unused=True)
                    for n, gr in zip(names, grads):
                        if gr is not None:
                            total[n] += gr.detach().abs().cpu()
            scores = [total[n] / len(batches) for n in names]
            if normalize:
                scores = [s / s.norm().clamp_min(1e-20) for s in scores]
            return Importance(names, scores, method, [t / len(batches) for t in (total[n] for n in names)])
        if method == "ablation":
            with torch.no_grad():
                base = sum(float(loss_fn(model, b)) for b in batches) / len(batches)
                scores = []
                todo = [(n, h) for n in names for h in range(mods[n].num_heads)]
                results = {}
                for n, h in _bar(todo, "importance (ablation)", progress):
                    vals = torch.ones(mods[n].num_heads)
                    vals[h] = 0.0
                    with gated(model, {n: vals}, fill=fill):
                        results[(n, h)] = sum(float(loss_fn(model, b)) for b in batches) / len(batches) - base
                for n in names:
                    scores.append(torch.tensor([results[(n, h)] for h in range(mods[n].num_heads)]))
            return Importance(names, scores, method, [s.clone() for s in scores])
        # entropy
        sums = {n: torch.zeros(mods[n].num_heads) for n in names}
        counts = dict.fromkeys(names, 0)
        with torch.no_grad():
            for b in _bar(batches, "importance (entropy)", progress):
                with capture(model, to_cpu=True) as cap:
                    loss_fn(model, b)
                for n in names:
                    for w in cap.calls(n) if n in cap else []:
                        w = w.double()  # (B, H, Lq, Lk)
                        ent = -(w * torch.log(w.clamp_min(1e-30))).sum(-1)  # (B, H, Lq)
                        live = (w.sum(-1) > 0.5).double()  # rows with something to attend to
                        sums[n] += (ent * live).sum((0, 2)).float()
                        counts[n] += int(live[:, 0].sum())
        raw = [sums[n] / max(1, counts[n]) for n in names]
        return Importance(names, [-r for r in raw], method, raw)
    finally:
        model.train(was_training)


def _rows(idx: list[int], size: int) -> list[int]:
    return [i * size + d for i in idx for d in range(size)]


def _linear_like(old: nn.Linear, in_features: int, out_features: int) -> nn.Linear:
    return nn.Linear(in_features, out_features, bias=old.bias is not None, device=old.weight.device,
                     dtype=old.weight.dtype)


def _record(model: nn.Module, name: str, m) -> None:
    record = dict(getattr(model, "pruned_heads", {}) or {})
    record[name] = [m.num_heads, m.num_kv_heads]
    model.pruned_heads = record


def _prune_module(m: MultiHeadAttention, remove: set[int], mean_out: Tensor | None) -> None:
    H, Hkv, D, Dv = m.num_heads, m.num_kv_heads, m.head_dim, m.value_head_dim
    bad = [h for h in remove if not 0 <= h < H]
    if bad:
        raise ValueError(f"heads {sorted(bad)} do not exist: the module has num_heads={H}.")
    keep = [h for h in range(H) if h not in remove]
    group = H // Hkv
    per_kv = Counter(h // group for h in keep)
    if len(set(per_kv.values())) <= 1:  # every kept key/value head still serves the same number of heads
        kv = sorted(per_kv)
    else:  # uneven groups: give each kept query head its own copy of its key/value head
        kv = [h // group for h in keep]
    q, k, v, o = m.projections()
    names = m._proj_names
    with torch.no_grad():
        if mean_out is not None and remove:
            gone = sorted(remove)
            const = o.weight[:, _rows(gone, Dv)] @ mean_out[gone].reshape(-1).to(o.weight.dtype)  # (out,)
            if o.bias is None:
                o.bias = nn.Parameter(torch.zeros(o.out_features, device=o.weight.device, dtype=o.weight.dtype))
            o.bias += const
        new = []
        for lin, rows in ((q, _rows(keep, D)), (k, _rows(kv, D)), (v, _rows(kv, Dv))):
            nl = _linear_like(lin, lin.in_features, len(rows))
            nl.weight.copy_(lin.weight[rows])
            if lin.bias is not None:
                nl.bias.copy_(lin.bias[rows])
            new.append(nl)
        cols = _rows(keep, Dv)
        no = _linear_like(o, len(cols), o.out_features)
        if o.bias is not None and no.bias is None:
            no.bias = nn.Parameter(torch.zeros_like(o.bias))
        no.weight.copy_(o.weight[:, cols])
        if o.bias is not None:
            no.bias.copy_(o.bias)
        new.append(no)
    for n, lin in zip(names, new):
        setattr(m, n, lin)
    m.num_heads, m.num_kv_heads = len(keep), len(kv)
    if getattr(m, "head_gates", None) is not None:
        m.head_gates = m.head_gates[keep]


def prune(model: nn.Module, heads: Mapping[str, Iterable[int]], *,
          mean_outputs: Mapping[str, Tensor] | None = None) -> dict[str, list[int]]:
    """Remove heads physically: {module name: [heads to remove]}. q/k/v/o weights
    shrink and ``num_heads`` changes; with GQA a key/value head goes only when all
    of its query heads go (uneven groups are expanded to one key/value head per
    query head). The model's outputs equal the gated model's (gates 0 on the
    removed heads).

    mean_outputs: {module: (H, Dv)} (see :func:`mean_head_outputs`): a removed head
    is replaced by its mean output, folded into the output projection's bias.

    Records the new sizes in ``model.pruned_heads`` ({name: [H, Hkv]}), which
    checkpoints save so that the model rebuilds itself from its config.
    Returns {module: [kept original head indices]}.
    """
    mods = attention_modules(model)
    kept = {}
    for name, remove in heads.items():
        if name not in mods:
            raise ValueError(f"no multihead attention module named {name!r}; modules: {list(mods)}.")
        m = mods[name]
        if isinstance(m, TorchMultiheadAttention) or not isinstance(m, MultiHeadAttention):
            raise TypeError(f"{name} is a {type(m).__name__}: its head count is fixed by embed_dim. Convert it with "
                            "multihead.interop.from_torch first.")
        remove = set(int(h) for h in remove)
        mo = None if mean_outputs is None else mean_outputs.get(name)
        kept[name] = [h for h in range(m.num_heads) if h not in remove]
        _prune_module(m, remove, mo)
        _record(model, name, m)
    return kept


def resize(model: nn.Module, pruned_heads: Mapping[str, list[int]]) -> None:
    """Give modules the head counts a checkpoint recorded ({name: [H, Hkv]}) before
    its weights are loaded (the weights then fill them)."""
    mods = attention_modules(model)
    for name, (H, Hkv) in pruned_heads.items():
        m = mods[name]
        D, Dv = m.head_dim, m.value_head_dim
        q, k, v, o = m.projections()
        new = [_linear_like(q, q.in_features, H * D), _linear_like(k, k.in_features, Hkv * D),
               _linear_like(v, v.in_features, Hkv * Dv), _linear_like(o, H * Dv, o.out_features)]
        if o.bias is None:
            new[3].bias = nn.Parameter(torch.zeros(o.out_features))  # a mean-compensated prune adds one
        for n, lin in zip(m._proj_names, new):
            setattr(m, n, lin)
        m.num_heads, m.num_kv_heads = H, Hkv
    model.pruned_heads = {n: list(v) for n, v in pruned_heads.items()}


def mean_head_outputs(model: nn.Module, batches: Iterable, run_fn: Callable[[nn.Module, object], object]
                      ) -> dict[str, Tensor]:
    """Each head's mean output (H, Dv) over every computed row of ``batches``."""
    mods = attention_modules(model)
    for m in mods.values():
        m.head_stats = {"sum": None, "count": 0}
    try:
        with torch.no_grad():
            for b in batches:
                run_fn(model, b)
        return {n: m.head_stats["sum"] / max(1, m.head_stats["count"]) for n, m in mods.items()
                if m.head_stats["sum"] is not None}
    finally:
        for m in mods.values():
            m.head_stats = None


def pruning_curve(
    model: nn.Module,
    batches: list,
    loss_fn: Callable[[nn.Module, object], Tensor],
    metric_fn: Callable[[nn.Module], float],
    *,
    step: float = 0.1,
    max_fraction: float = 0.5,
    method: str = "ablation",
    reestimate: bool = True,
    speed_fn: Callable[[nn.Module], dict] | None = None,
    mean_replacement: bool = False,
    progress: bool = True,
) -> list[dict]:
    """Prune a copy of ``model`` in steps of ``step`` (a share of all heads) up to
    ``max_fraction``; at each step record the metric, which heads are gone and, with
    ``speed_fn(model) -> {batch: ms}``, the speed. Importance is re-estimated after
    every step when ``reestimate``. Returns one dict per step (fraction 0 first)."""
    import copy

    work = copy.deepcopy(model).eval()
    total = sum(m.num_heads for m in attention_modules(work).values())
    # original head ids per module, to report which heads are gone
    ids = {n: list(range(m.num_heads)) for n, m in attention_modules(work).items()}
    removed: dict[str, list[int]] = {n: [] for n in ids}
    means = mean_head_outputs(work, batches, lambda m, b: loss_fn(m, b)) if mean_replacement else None
    rows = []
    imp = None
    target_steps = int(round(max_fraction / step))
    for s in range(target_steps + 1):
        frac = s * step
        target = int(round(frac * total))
        gone_now = sum(len(v) for v in removed.values())
        if target > gone_now:
            if imp is None or reestimate:
                imp = importance(work, batches, loss_fn, method, progress=progress, fill=means)
            cut = imp.least(target - gone_now)
            cur_means = None if means is None else {n: means[n] for n in cut}  # indexed like the current heads
            for n, hs in cut.items():
                removed[n] += [ids[n][h] for h in hs]
            kept = prune(work, cut, mean_outputs=cur_means)
            for n, k in kept.items():
                ids[n] = [ids[n][h] for h in k]
            if means is not None:
                for n, k in kept.items():
                    means[n] = means[n][k]
            if not reestimate:  # the remaining scores, re-indexed to the pruned modules
                imp = Importance(imp.names, [imp.scores[i][kept[n]] if n in kept else imp.scores[i]
                                             for i, n in enumerate(imp.names)], imp.method)
        n_gone = sum(len(v) for v in removed.values())
        row = {"fraction": n_gone / total, "heads_pruned": n_gone, "metric": float(metric_fn(work)),
               "removed": {n: sorted(v) for n, v in removed.items() if v}}
        if speed_fn is not None:
            row["speed_ms"] = speed_fn(work)
        rows.append(row)
    return rows


def plot_curve(rows: list[dict], path: str | Path, *, metric_name: str = "metric", baseline_ms: dict | None = None):
    """The pruning curve: metric and (when measured) speed-up against the unpruned model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    fr = [100 * r["fraction"] for r in rows]
    ax.plot(fr, [r["metric"] for r in rows], "o-", color="C0")
    ax.set_xlabel("heads pruned (%)")
    ax.set_ylabel(metric_name, color="C0")
    if rows and "speed_ms" in rows[0]:
        ax2 = ax.twinx()
        base = baseline_ms or rows[0]["speed_ms"]
        for i, b in enumerate(sorted(rows[0]["speed_ms"], key=int)):
            ax2.plot(fr, [base[b] / r["speed_ms"][b] for r in rows], "s--", color=f"C{i + 1}",
                     label=f"speed-up, batch {b}")
        ax2.set_ylabel("speed-up")
        ax2.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def save_curve(rows: list[dict], path: str | Path) -> Path:
    Path(path).write_text(json.dumps(rows, indent=2))
    return Path(path)
