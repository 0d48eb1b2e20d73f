"""Head importance: how much each head matters, three ways, one result type (:class:`Importance`).

- :func:`gradient_importance`: Michel, Levy & Neubig 2019, E|dL/dξ_h| at gate ξ = 1, normalized
  per layer;
- :func:`ablation_importance`: the loss change when the head alone is gated off;
- :func:`entropy_importance`: minus the entropy of its attention rows.

:func:`importance` names them (``method=``). Dependency order: gates -> importance -> heads.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from multihead.heads.capture import capture
from multihead.heads.gates import attention_modules, gated
from multihead.layer.hooks import num_heads as _num_heads

__all__ = ["METHODS", "Importance", "ablation_importance", "entropy_importance", "gradient_importance", "importance"]


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

    def _repr_markdown_(self) -> str:  # a table in a notebook
        return self.to_markdown()


def _bar(it, desc: str, progress: bool, total: int | None = None):
    if not progress:
        return it
    from multihead.extras import progress as bar

    return bar(it, desc=desc, total=total)


def _scored(model: nn.Module, batches: Iterable, fn: Callable) -> tuple[dict[str, nn.Module], list]:
    """The attention modules to score and the batches, checked before any work. A model whose modules call SDPA
    and that nothing has observed yet is observed on ``fn(model, batches[0])`` (the user's own call, run once more,
    without gradients)."""
    batches = list(batches)
    if not batches:
        raise ValueError("importance needs at least one batch.")
    mods = attention_modules(model)
    if not mods:
        from multihead.heads.observe import nothing_seen, on_call

        with _evaluating(model), torch.no_grad(), on_call(model, lambda name, m: None):
            fn(model, batches[0])
        mods = attention_modules(model)
        if not mods:
            raise ValueError(nothing_seen(model, "score", "in a call of the loss function on the first batch"))
    return mods, batches


@contextlib.contextmanager
def _evaluating(model: nn.Module):
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def gradient_importance(model: nn.Module, batches: Iterable, loss_fn: Callable[[nn.Module, object], Tensor], *,
                        normalize: bool = True, progress: bool = True) -> Importance:
    """I_h = mean over batches of |dL/dξ_h| at gate ξ = 1 (Michel et al. 2019), divided by the
    layer's L2 norm when ``normalize`` (``raw`` keeps the unnormalized means). loss_fn(model,
    batch) -> a scalar loss."""
    mods, batches = _scored(model, batches, loss_fn)
    names = list(mods)
    with _evaluating(model):
        total = {n: torch.zeros(_num_heads(mods[n])) for n in names}
        with gated(model, requires_grad=True) as g:
            for b in _bar(batches, "importance (gradient)", progress):
                loss = loss_fn(model, b)
                grads = torch.autograd.grad(loss, [g[n] for n in names], allow_unused=True)
                for n, gr in zip(names, grads):
                    if gr is not None:
                        total[n] += gr.detach().abs().cpu()
    raw = [total[n] / len(batches) for n in names]
    scores = [s / s.norm().clamp_min(1e-20) for s in raw] if normalize else [s.clone() for s in raw]
    return Importance(names, scores, "gradient", raw)


def ablation_importance(model: nn.Module, batches: Iterable, loss_fn: Callable[[nn.Module, object], Tensor], *,
                        fill: Mapping[str, Tensor] | None = None, progress: bool = True) -> Importance:
    """Mean loss with head h alone gated off (replaced by ``fill`` when given, else zeros), minus
    the mean loss of the full model: higher = the head matters more. loss_fn(model, batch) -> a
    scalar loss."""
    mods, batches = _scored(model, batches, loss_fn)
    names = list(mods)
    with _evaluating(model), torch.no_grad():
        base = sum(float(loss_fn(model, b)) for b in batches) / len(batches)
        todo = [(n, h) for n in names for h in range(_num_heads(mods[n]))]
        results = {}
        for n, h in _bar(todo, "importance (ablation)", progress):
            vals = torch.ones(_num_heads(mods[n]))
            vals[h] = 0.0
            with gated(model, {n: vals}, fill=fill):
                results[(n, h)] = sum(float(loss_fn(model, b)) for b in batches) / len(batches) - base
    scores = [torch.tensor([results[(n, h)] for h in range(_num_heads(mods[n]))]) for n in names]
    return Importance(names, scores, "ablation", [s.clone() for s in scores])


def entropy_importance(model: nn.Module, batches: Iterable, run_fn: Callable[[nn.Module, object], object], *,
                       progress: bool = True) -> Importance:
    """Minus the mean entropy of each head's attention rows over the real query rows (a focused
    head scores higher); ``raw`` keeps the entropies. run_fn(model, batch) only has to run the model."""
    mods, batches = _scored(model, batches, run_fn)
    names = list(mods)
    sums = {n: torch.zeros(_num_heads(mods[n])) for n in names}
    counts = dict.fromkeys(names, 0)
    with _evaluating(model), torch.no_grad():
        for b in _bar(batches, "importance (entropy)", progress):
            with capture(model, to_cpu=True) as cap:
                run_fn(model, b)
            for n in names:
                for w in cap.calls(n) if n in cap else []:
                    w = w.double()  # (B, H, Lq, Lk)
                    ent = -(w * torch.log(w.clamp_min(1e-30))).sum(-1)  # (B, H, Lq)
                    live = (w.sum(-1) > 0.5).double()  # rows with something to attend to
                    sums[n] += (ent * live).sum((0, 2)).float()
                    counts[n] += int(live[:, 0].sum())
    raw = [sums[n] / max(1, counts[n]) for n in names]
    return Importance(names, [-r for r in raw], "entropy", raw)


#: the importance methods by name (:func:`importance`'s ``method``)
METHODS = {"gradient": gradient_importance, "ablation": ablation_importance, "entropy": entropy_importance}


def importance(model: nn.Module, batches: Iterable, loss_fn: Callable[[nn.Module, object], Tensor],
               method: str = "gradient", *, normalize: bool = True, progress: bool = True,
               fill: Mapping[str, Tensor] | None = None) -> Importance:
    """Score every head of ``model`` on ``batches`` with one of :data:`METHODS` (each also a
    function of its own, with only its own options): "gradient" (:func:`gradient_importance`,
    ``normalize``), "ablation" (:func:`ablation_importance`, ``fill``) or "entropy"
    (:func:`entropy_importance`; loss_fn only has to run the model). An option the method does
    not take is refused rather than ignored."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {sorted(METHODS)}; got {method!r}.")
    if fill is not None and method != "ablation":
        raise ValueError(f"fill= is an option of method='ablation' (gated-off heads replaced by it); got "
                         f"method={method!r}.")
    if normalize is not True and method != "gradient":
        raise ValueError(f"normalize= is an option of method='gradient'; got method={method!r}.")
    if method == "gradient":
        return gradient_importance(model, batches, loss_fn, normalize=normalize, progress=progress)
    if method == "ablation":
        return ablation_importance(model, batches, loss_fn, fill=fill, progress=progress)
    return entropy_importance(model, batches, loss_fn, progress=progress)
