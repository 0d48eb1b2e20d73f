"""Cut the heads: physical pruning and the pruning curve (``multihead.heads`` re-exports them with the
gates and head importance, so ``heads.gated`` and ``heads.importance`` are where the course's exercise
finds them).

- :func:`gated` installs a gate ξ_h on every head's output (a transform in the
  module's own hook list, removed on exit: no flag threads through any forward);
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

import json
import operator
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import torch
from torch import Tensor, nn

from multihead.heads.gates import attention_modules
from multihead.heads.importance import (
    Importance,
    importance,
)
from multihead.heads.layouts import differs, run_call
from multihead.heads.surgery import fold_into_bias, head_rows, kept_heads, select
from multihead.layer.dropin import PrunedMultiheadAttention
from multihead.layer.hooks import num_heads as _num_heads
from multihead.layer.module import MultiHeadAttention
from multihead.layer.module import linear as _empty_ok_linear

__all__ = ["Curve", "head_counts", "kept_heads", "mean_head_outputs", "plot_curve", "prune", "pruning_curve", "resize",
           "save_curve"]


class Curve(list):
    """The rows of :func:`pruning_curve` (a list of dicts), shown as a table in a notebook."""

    def to_markdown(self) -> str:
        speeds = sorted({b for r in self for b in r.get("speed_ms", {})}, key=int)
        head = "| heads pruned | metric |" + "".join(f" ms @{b} |" for b in speeds)
        lines = [head, "|---:|---:|" + "---:|" * len(speeds)]
        for r in self:
            lines.append(f"| {r['fraction']:.0%} ({r['heads_pruned']}) | {r['metric']:.4f} |"
                         + "".join(f" {r['speed_ms'][b]:.2f} |" for b in speeds))
        return "\n".join(lines)

    def _repr_markdown_(self) -> str:
        return self.to_markdown()

    def plot(self, metric_name: str = "metric"):
        """The curve as a figure (:func:`multihead.viz.curve_figure`): the metric and the speed-up
        against the share pruned."""
        from multihead.viz.curves import curve_figure

        return curve_figure(self, metric_name=metric_name)


def _rebuild(m: MultiHeadAttention, keep: list[int], kv: list[int], *, o_bias: bool, copy: bool) -> None:
    """The one rebuild of a module's projections for new head sets: query heads ``keep``
    and key/value heads ``kv`` (indices into the current ones). ``copy`` carries their
    weights over (pruning); otherwise the new layers are fresh, to be filled by a
    checkpoint (resizing). The output projection gets a bias iff ``o_bias``."""
    D, Dv = m.head_dim, m.value_head_dim
    q, k, v, o = m.projections()
    dev, dt = o.weight.device, o.weight.dtype

    def linear(old, in_features, rows=None, cols=None, bias=None):
        bias = old.bias is not None if bias is None else bias
        if not copy:  # fresh layers of the new sizes, to be filled by a checkpoint
            out_features = len(rows) if rows is not None else old.out_features
            return _empty_ok_linear(in_features, out_features, bias, device=dev, dtype=dt)
        new = select(old, rows, cols)  # the kept heads' rows / columns
        if bias and new.bias is None:  # a bias to fold removed heads' mean outputs into
            new.bias = nn.Parameter(new.weight.new_zeros(new.out_features))
        return new

    with torch.no_grad():
        new = [linear(q, q.in_features, head_rows(keep, D)), linear(k, k.in_features, head_rows(kv, D)),
               linear(v, v.in_features, head_rows(kv, Dv)), linear(o, len(keep) * Dv, cols=head_rows(keep, Dv), bias=o_bias)]
    for n, lin in zip(m._proj_names, new):
        setattr(m, n, lin)
    m.num_heads, m.num_kv_heads = len(keep), len(kv)


def _prune_module(m: MultiHeadAttention, remove: set[int], mean_out: Tensor | None) -> None:
    keep, kv = kept_heads(m.num_heads, m.num_kv_heads, remove)
    Dv = m.value_head_dim
    o = m.projections()[3]
    compensate = mean_out is not None and bool(remove)
    _rebuild(m, keep, kv, o_bias=o.bias is not None or compensate, copy=True)
    if compensate:  # a removed head's mean output, through o_proj, folded into its bias
        gone = sorted(remove)
        fold_into_bias(m.projections()[3], o, head_rows(gone, Dv), mean_out[gone])


def _param(old: Tensor | None, index: list[int], dim: int) -> nn.Parameter | None:
    """``old`` with only ``index`` along ``dim``, a new parameter (None stays None)."""
    if old is None:
        return None
    return nn.Parameter(old.detach().index_select(dim, torch.tensor(index, dtype=torch.long, device=old.device)),
                        requires_grad=old.requires_grad)


def _prune_torch_style(model: nn.Module, name: str, m: nn.Module, remove: set[int], mean_out: Tensor | None) -> None:
    """Cut a torch.nn.MultiheadAttention (seen by :func:`multihead.heads.observe`), the drop-in or a
    :class:`PrunedMultiheadAttention`: the latter is cut in place, the others are replaced in ``model`` by
    one (torch.nn fixes the head count by embed_dim) with their weights."""
    if not isinstance(m, PrunedMultiheadAttention):
        new = PrunedMultiheadAttention.from_torch(m)
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, new)  # the old module leaves the model
        m = new
    H, D = m.num_heads, m.head_dim
    keep = [h for h in range(H) if h not in remove]
    rows = head_rows(keep, D)  # (H D) -> (H' D) rows of q, k or v
    with torch.no_grad():
        if m._qkv_same_embed_dim:  # [Q | K | V] rows of in_proj_weight (3 H D, E)
            m.in_proj_weight = _param(m.in_proj_weight, [b * H * D + r for b in range(3) for r in rows], 0)
        else:
            for p in ("q_proj_weight", "k_proj_weight", "v_proj_weight"):
                setattr(m, p, _param(getattr(m, p), rows, 0))
        m.in_proj_bias = _param(m.in_proj_bias, [b * H * D + r for b in range(3) for r in rows], 0)
        m.bias_k, m.bias_v = _param(m.bias_k, rows, 2), _param(m.bias_v, rows, 2)  # (1, 1, H D) -> (1, 1, H' D)
        o = m.out_proj
        new_o = select(o, in_cols=rows)
        if mean_out is not None and remove:  # the removed heads' mean output, through out_proj, into its bias
            if new_o.bias is None:
                new_o.bias = nn.Parameter(new_o.weight.new_zeros(new_o.out_features))
            gone = sorted(remove)
            fold_into_bias(new_o, o, head_rows(gone, D), mean_out[gone])
        m.out_proj = new_o
    m.num_heads = m.num_kv_heads = len(keep)


def head_counts(model: nn.Module) -> dict[str, list[int]]:
    """{module name: [H, Hkv]} for every multihead attention module whose head counts
    differ from those it was built with (pruned modules): what a checkpoint records."""
    return {n: [m.num_heads, m.num_kv_heads] for n, m in attention_modules(model).items()
            if isinstance(m, MultiHeadAttention) and (m.num_heads, m.num_kv_heads) != m.built_heads}


def _indices(name: str, heads: Iterable[int]) -> set[int]:
    """The head numbers to remove from module ``name``: whole numbers (int, a NumPy integer, an integer tensor's
    items), never guessed from a bool, a float or the characters of a string (``"12"`` removed heads 1 and 2)."""
    if isinstance(heads, str | bytes) or not isinstance(heads, Iterable):
        raise TypeError(f"heads[{name!r}] must be a list of head numbers, e.g. [0, 3]; got {heads!r}.")
    out = set()
    for h in heads:
        bad = isinstance(h, bool) or isinstance(h, Tensor) and (h.dtype == torch.bool or h.dtype.is_floating_point)
        try:
            i = None if bad else operator.index(h)
        except TypeError:
            i = None
        if i is None:
            raise TypeError(f"heads[{name!r}] must hold whole head numbers; got {h!r} ({type(h).__name__}).")
        out.add(i)
    return out


def prune(model: nn.Module, heads: Mapping[str, Iterable[int]], *,
          mean_outputs: Mapping[str, Tensor] | None = None) -> dict[str, list[int]]:
    """Remove heads physically: {module name: [heads to remove]}. q/k/v/o weights
    shrink and ``num_heads`` changes; with GQA a key/value head goes only when all
    of its query heads go, and every kept key/value head must keep as many query
    heads as the others: a cut leaving a layer's groups uneven is refused (ValueError
    naming an even cut), since it would need copies of key/value heads -- a larger KV
    cache than the model had. The model's outputs equal the gated model's (gates 0 on
    the removed heads).

    mean_outputs: {module: (H, Dv)} (see :func:`mean_head_outputs`): a removed head
    is replaced by its mean output, folded into the output projection's bias.

    Checkpoints record the new head counts (:func:`head_counts`) so that the model
    rebuilds itself from its config. Head numbers are the module's heads as they are when it is called (the original
    numbers on a first prune). Returns {module: [kept head numbers]}, numbered so. Raises ValueError or TypeError,
    before anything changes, for a name that is not an attention module, or heads that are not whole numbers
    (``True``, ``1.5``, ``"12"``) or do not exist.

    Every cut is verified before this returns: each module runs its recorded call (the probe its layout was
    derived on; random inputs for multihead's own modules) gated and then cut, and a cut whose outputs differ (or
    whose forward raises) is refused with a ValueError naming the module and what differed; all or nothing, every
    module cut by this call is then restored as it was.
    """
    mods = attention_modules(model)
    kept = {}
    for name in heads:
        if name not in mods:
            raise ValueError(f"no multihead attention module named {name!r}; modules: {list(mods)}.")
    heads = {name: _indices(name, remove) for name, remove in heads.items()}
    for name, remove in heads.items():
        H = _num_heads(mods[name])
        bad = sorted(h for h in remove if not 0 <= h < H)
        if bad:
            raise ValueError(f"{name}: heads {bad} do not exist: the module has num_heads={H} (heads 0..{H - 1}).")
        if any(isinstance(p, nn.parameter.UninitializedParameter) for p in mods[name].parameters()):
            raise ValueError(f"{name} has parameters not built yet (nn.LazyLinear): call the model once on an input, "
                             "then prune.")
        Hkv = _num_kv_heads(mods[name])
        if Hkv is not None:
            try:  # an uneven cut of grouped key/value heads, refused before anything changes
                kept_heads(H, Hkv, set(remove))
            except ValueError as e:
                raise ValueError(f"{name}: {e}") from None
    undo: list[_Undo] = []
    try:
        for name, remove in heads.items():
            m = mods[name]
            kept[name] = [h for h in range(_num_heads(m)) if h not in remove]
            mo = None if mean_outputs is None else mean_outputs.get(name)
            _cut_verified(model, name, m, remove, mo, undo)
    except BaseException:
        for u in reversed(undo):  # all or nothing: every module cut before the one refused is restored
            u.restore()
        raise
    return kept


def _refuse_grouped(model: nn.Module) -> None:
    """A model whose query heads share key/value heads refused by a curve that ranks heads over the whole model."""
    grouped = [n for n, m in attention_modules(model).items() if (_num_kv_heads(m) or _num_heads(m)) < _num_heads(m)]
    if grouped:
        raise ValueError(f"{grouped[0]} groups its query heads over shared key/value heads: a curve cutting heads by "
                         "a ranking over the whole model would leave its groups uneven (heads.prune refuses that). "
                         "Cut whole key/value groups or the same number of query heads in every group: `multihead "
                         "prune --hf DIR` does for a causal LM (multihead.apps.prune.decoder.plan).")


def _num_kv_heads(m: nn.Module) -> int | None:
    """The module's key/value heads where it groups them (multihead's own, or a derived layout's counts); None
    where every query head has its own (torch.nn's) or no layout is known yet (refused later, by name)."""
    if isinstance(m, MultiHeadAttention):
        return m.num_kv_heads
    hooks = getattr(m, "attention_hooks", None)
    layout = None if hooks is None else hooks.layout
    return None if layout is None else layout.counts(m, hooks.parent)[1]


def _refuse_uncuttable(name: str, m: nn.Module) -> None:
    """A ValueError where ``m`` has no way to be cut (no head layout, or torch.nn's with a forward of its own)."""
    if isinstance(m, MultiHeadAttention):
        return
    why = m.attention_hooks.layout_reason
    if isinstance(m, nn.MultiheadAttention | PrunedMultiheadAttention):
        if why is not None:
            raise ValueError(f"{name} ({type(m).__name__}) can be seen and gated, but not pruned: {why}. Gate "
                             "its heads with heads.gated instead.")
    elif m.attention_hooks.layout is None:
        why = why or "call multihead.hf.attach(model) to derive it"
        raise ValueError(f"{name} ({type(m).__name__}) can be seen and gated, but multihead has no head layout for "
                         f"it (which rows of its projections hold head h): {why}. It cannot be pruned physically; "
                         "gate its heads with heads.gated instead.")


def _cut_one(model: nn.Module, name: str, m: nn.Module, remove: set[int], mo: Tensor | None) -> list[int] | None:
    """One module's cut, by its kind; the query heads kept where its output projection is outside it (BERT's
    ``output.dense``: the module's own output holds only their rows), else None."""
    if isinstance(m, MultiHeadAttention):
        _prune_module(m, remove, mo)
    elif isinstance(m, nn.MultiheadAttention | PrunedMultiheadAttention):
        _prune_torch_style(model, name, m, remove, mo)
    else:
        layout = m.attention_hooks.layout
        keep, kv = kept_heads(_num_heads(m), layout.counts(m, m.attention_hooks.parent)[1], remove)
        layout.prune(m, keep, kv, mo if remove else None, sorted(remove))
        return keep if layout.o_from_parent else None
    return None


def _probe_of(m: nn.Module) -> tuple | None:
    """The call a cut of ``m`` is verified on: the one its layout was derived on (recorded by
    :func:`multihead.hf.attach` / :func:`multihead.heads.observe`), or for multihead's own modules (the drop-in
    included) random queries, keys and values of its input sizes (B=2, L=5)."""
    g = torch.Generator().manual_seed(0)  # its own: the user's random stream is left as it was
    if isinstance(m, MultiHeadAttention):
        q, k, v, _ = m.projections()
        w = q.weight
        x = [torch.randn(2, 5, p.in_features, generator=g).to(w) for p in (q, k, v)]  # (B, L, E)
        return tuple(x), {}
    if m.attention_hooks.probe is None and isinstance(m, nn.MultiheadAttention | PrunedMultiheadAttention):
        w = m.out_proj.weight  # multihead's drop-in (or its pruned form), never observed: torch.nn's call
        x = [torch.randn(*((2, 5, e) if m.batch_first else (5, 2, e)), generator=g).to(w)
             for e in (m.embed_dim, m.kdim, m.vdim)]  # (B, L, E) or (L, B, E)
        return tuple(x), {}
    return m.attention_hooks.probe


def _cut_verified(model: nn.Module, name: str, m: nn.Module, remove: set[int], mo: Tensor | None,
                  undo: list[_Undo]) -> None:
    """Cut ``m`` and check, on its recorded call, that the cut module gives the gated module's outputs (gates 0 on
    ``remove``, or their mean outputs ``mo``); a cut that does not is undone and refused, naming what differed."""
    from multihead.heads.gates import _gate

    _refuse_uncuttable(name, m)
    call = _probe_of(m)
    if call is None:
        raise ValueError(f"{name} ({type(m).__name__}): no recorded call to verify a cut on (its layout was not "
                         "derived on a probe): call multihead.hf.attach(model) or heads.observe(model, example) "
                         "again, then prune.")
    H = _num_heads(m)
    gate = torch.ones(H).index_fill(0, torch.tensor(sorted(remove), dtype=torch.long), 0.0)
    hooks = m.attention_hooks
    parent = hooks.parent
    slot = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
    u = _Undo([*m.modules(), *(parent.modules() if parent is not None else ()), slot])
    with _quiet(m):
        ref = run_call(m, call, _gate(gate, mo))
        ungated = run_call(m, call)
    undo.append(u)
    why = None
    try:
        keep = _cut_one(model, name, m, remove, mo)
        new = model.get_submodule(name) if name else model
        with _quiet(new):
            got = run_call(new, call)
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - the family's forward on its cut module
        why = f"its forward raised {type(e).__name__}: {str(e)[:200]}"
    else:
        if keep is not None:  # the output projection is the parent's: the module's output holds the kept heads' rows
            rows = head_rows(keep, ref.shape[-1] // H)
            ref, ungated = (ref[..., rows], ungated[..., rows]) if keep else (None, None)
        why = None if ref is None else differs(got, ref, ungated)
    if why is not None:
        raise ValueError(f"{name} ({type(m).__name__}): cutting heads {sorted(remove)} does not give the gated "
                         f"module's outputs on its recorded call ({why}); nothing was cut. Gate its heads with "
                         "heads.gated instead.")


class _quiet:
    """For a check's run: the module in eval mode (no dropout), its observers and transforms set aside (a capture
    or gates of the user's see nothing of it); all restored after."""

    def __init__(self, m: nn.Module):
        self.m = m

    def __enter__(self):
        hooks = self.m.attention_hooks
        self.modes = [(mod, mod.training) for mod in self.m.modules()]
        self.lists = (hooks.observers, hooks.transforms)
        hooks.observers, hooks.transforms = [], []
        self.m.eval()

    def __exit__(self, *exc):
        hooks = self.m.attention_hooks
        hooks.observers, hooks.transforms = self.lists
        for mod, mode in self.modes:
            mod.training = mode


class _Undo:
    """What a cut may replace, recorded before it: each module's own dictionaries (children, parameters, buffers)
    and attributes (head counts, sizes), and its hook list's. A cut replaces objects and never changes a tensor in
    place, so putting the records back restores the module exactly."""

    def __init__(self, modules: Iterable[nn.Module]):
        self.saved, seen = [], set()
        for mod in modules:
            if id(mod) in seen:
                continue
            seen.add(id(mod))
            d = {k: dict(v) if k in ("_modules", "_parameters", "_buffers") else v for k, v in mod.__dict__.items()}
            hooks = mod.__dict__.get("attention_hooks")
            self.saved.append((mod, d, hooks, dict(vars(hooks)) if hooks is not None else None))

    def restore(self) -> None:
        for mod, d, hooks, h in reversed(self.saved):
            mod.__dict__.clear()
            mod.__dict__.update(d)
            if hooks is not None:
                vars(hooks).update(h)


def resize(model: nn.Module, counts: Mapping[str, list[int]], *, o_bias: Mapping[str, bool] | None = None) -> None:
    """Give modules the head counts a checkpoint recorded ({name: [H, Hkv]}) before
    its weights are loaded (the weights then fill them). ``o_bias`` says which output
    projections have a bias (default: as now)."""
    mods = attention_modules(model)
    for name, (H, Hkv) in counts.items():
        if name not in mods:
            raise ValueError(f"the checkpoint records head counts for {name!r}, which is not an attention module of "
                             f"this model; modules: {list(mods)}.")
        m = mods[name]
        has_bias = m.projections()[3].bias is not None
        _rebuild(m, list(range(H)), list(range(Hkv)), o_bias=has_bias if o_bias is None else o_bias.get(name, has_bias),
                 copy=False)


def mean_head_outputs(model: nn.Module, batches: Iterable, run_fn: Callable[[nn.Module, object], object]
                      ) -> dict[str, Tensor]:
    """Each head's mean output (H, Dv) over every computed row of ``batches``."""
    mods = attention_modules(model)
    stats = {n: {"sum": None, "count": 0} for n in mods}
    handles = [m.attention_hooks.add_transform(_mean_stats(stats[n])) for n, m in mods.items()]
    try:
        with torch.no_grad():
            for b in batches:
                run_fn(model, b)
        return {n: st["sum"] / max(1, st["count"]) for n, st in stats.items() if st["sum"] is not None}
    finally:
        for h in handles:
            h.remove()


def _mean_stats(st: dict):
    """A transform that leaves the output alone and adds up every computed row's per-head output."""

    def transform(module, out: Tensor, live) -> Tensor:
        o = out.detach()  # (..., H, Dv)
        if live is not None:
            o = o[live]  # (B, Lq, H, Dv) -> (rows, H, Dv): padded query rows do not count
        o = o.reshape(-1, *o.shape[-2:])  # (rows, H, Dv)
        s = o.sum(0)  # (H, Dv)
        st["sum"] = s if st["sum"] is None else st["sum"] + s
        st["count"] += o.shape[0]
        return out

    return transform


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
    on_step: Callable[[dict, nn.Module], None] | None = None,
    initial: Importance | None = None,
) -> list[dict]:
    """Prune a copy of ``model`` in steps of ``step`` (a share of all heads) up to
    ``max_fraction``; at each step record the metric, which heads are gone and, with
    ``speed_fn(model) -> {batch: ms}``, the speed (measured step by step; to compare the
    steps' speeds fairly, keep the models with ``on_step(row, model)`` and time them
    together afterwards, as ``multihead prune`` does). Importance is re-estimated after
    every step when ``reestimate``; ``initial``: the unpruned model's importance when it is known
    already (same batches, loss and method), used for the first step instead of estimating it again.
    Returns one dict per step (fraction 0 first), as a :class:`Curve` (a list that a notebook shows
    as a table).

    Raises ValueError before any work unless 0 < step <= max_fraction <= 1, and for a model with grouped key/value
    heads (a global ranking leaves its groups uneven)."""
    import copy

    _check_steps(step, max_fraction)
    _refuse_grouped(model)
    work = copy.deepcopy(model).eval()
    total = sum(_num_heads(m) for m in attention_modules(work).values())
    # original head ids per module, to report which heads are gone
    ids = {n: list(range(_num_heads(m))) for n, m in attention_modules(work).items()}
    removed: dict[str, list[int]] = {n: [] for n in ids}
    means = mean_head_outputs(work, batches, lambda m, b: loss_fn(m, b)) if mean_replacement else None
    rows = Curve()
    imp, fresh = initial, initial is not None  # fresh: scores of the model as it is now
    target_steps = int(round(max_fraction / step))
    for s in range(target_steps + 1):
        frac = s * step
        target = int(round(frac * total))
        gone_now = sum(len(v) for v in removed.values())
        if target > gone_now:
            if imp is None or reestimate and not fresh:
                imp = importance(work, batches, loss_fn, method, progress=progress, fill=means)
            imp, fresh = _cut(work, imp, target - gone_now, ids, removed, means=means, reestimate=reestimate), False
        n_gone = sum(len(v) for v in removed.values())
        row = {"fraction": n_gone / total, "heads_pruned": n_gone, "metric": float(metric_fn(work)),
               "removed": {n: sorted(v) for n, v in removed.items() if v}}
        if speed_fn is not None:
            row["speed_ms"] = speed_fn(work)
        rows.append(row)
        if on_step is not None:
            on_step(row, work)
    return rows


def _check_steps(step, max_fraction) -> None:
    """0 < step <= max_fraction <= 1, or a ValueError that says which does not hold."""
    import math

    for name, val in (("step", step), ("max_fraction", max_fraction)):
        if not isinstance(val, int | float) or isinstance(val, bool) or math.isnan(val) or not 0 < val <= 1:
            raise ValueError(f"{name} must be a share of the heads in (0, 1]; got {val!r}.")
    if step > max_fraction:
        raise ValueError(f"step ({step}) must not exceed max_fraction ({max_fraction}): no step would be taken.")


def _cut(work: nn.Module, imp: Importance, n: int, ids: dict[str, list[int]], removed: dict[str, list[int]], *,
         means: dict | None, reestimate: bool) -> Importance:
    """One step of the curve: the ``n`` least important heads pruned from ``work`` (with their mean
    outputs when ``means``); ``ids`` (the original ids of the kept heads), ``removed`` and ``means``
    follow. Returns the remaining scores re-indexed to the pruned modules (unless re-estimated)."""
    cut = imp.least(n)
    cur_means = None if means is None else {m: means[m] for m in cut}  # indexed like the current heads
    for m, hs in cut.items():
        removed[m] += [ids[m][h] for h in hs]
    kept = prune(work, cut, mean_outputs=cur_means)
    for m, k in kept.items():
        ids[m] = [ids[m][h] for h in k]
        if means is not None:
            means[m] = means[m][k]
    if reestimate:
        return imp
    return Importance(imp.names, [imp.scores[i][kept[m]] if m in kept else imp.scores[i]
                                  for i, m in enumerate(imp.names)], imp.method)


def plot_curve(rows: list[dict], path: str | Path, *, metric_name: str = "metric", baseline_ms: dict | None = None):
    """The pruning curve (:func:`multihead.viz.curve_figure`) saved to ``path``."""
    from multihead.viz.curves import plot_curve as plot

    return plot(rows, path, metric_name=metric_name, baseline_ms=baseline_ms)


def save_curve(rows: list[dict], path: str | Path) -> Path:
    Path(path).write_text(json.dumps(rows, indent=2))
    return Path(path)
