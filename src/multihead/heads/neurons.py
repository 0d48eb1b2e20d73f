"""Feed-forward neurons, scored and cut the way heads are: past the heads' share of the work.

In a transformer layer the feed-forward block holds about two thirds of the multiply-adds on short inputs (8E²
of ~12E² per token), so cutting heads alone can remove at most a third of the work. A feed-forward block is
``down(act(up(x)))`` (or ``down(act(gate(x)) * up(x))``): neuron i is channel i of ``down``'s input, made by row
i of each producing Linear. Here:

- :func:`ffn_blocks` finds the blocks of any model by shape (a Linear ``down`` reading F channels, the Linears before it
  in the nearest enclosing module writing them from its E), attention projections excluded;
  nothing is trusted: every cut is verified.
- :func:`neuron_stats` records each neuron's mean and mean square over the tokens of a few batches;
  :func:`neuron_scores` scores neuron i by what removing it changes in the block's output:
  E[(a_i - m_i)²]·‖W_down[:, i]‖² with mean replacement (the cut neuron's mean output is folded into ``down``'s
  bias), E[a_i²]·‖W_down[:, i]‖² without.
- :func:`cut_neurons` cuts them (the producing Linears' rows, ``down``'s columns) and verifies the cut model
  equals the gated one (the same neurons replaced by their means, or zeroed, by a hook on ``down``'s input) on
  an example call, restoring the model and raising ValueError naming the block where it does not.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn

__all__ = ["FfnBlock", "cut_block", "cut_neurons", "ffn_blocks", "neuron_scores", "neuron_stats", "prune_neurons"]


@dataclass(frozen=True)
class FfnBlock:
    """One feed-forward block: the Linears writing its ``width`` neurons (``up``: one, or a gate and an up
    projection) and the Linear reading them (``down``), by their names in the model."""

    up: tuple[str, ...]
    down: str
    width: int


def _attention_projections(model: nn.Module) -> set[int]:
    """ids of the q/k/v/o projections of every attention module with a head layout (never a feed-forward block)."""
    ids = set()
    for m in model.modules():
        hooks = getattr(m, "attention_hooks", None)
        layout = getattr(hooks, "layout", None) if hooks is not None else None
        if layout is not None:
            ids |= {id(p) for p in layout.projections(m, hooks.parent) if p is not None}
    return ids


def ffn_blocks(model: nn.Module) -> list[FfnBlock]:
    """Every feed-forward block of ``model`` found by shape: for each ``nn.Linear`` ``down`` (F inputs, E outputs,
    F != E), the Linears with E inputs and F outputs registered before it (a block's producers come first: BERT's
    intermediate before output, Llama's gate and up before down) in its parent module or else the parent's parent,
    ``down`` and attention projections excluded. Found by shape, not trusted: :func:`cut_neurons` verifies each
    cut. (A block cut to exactly E neurons is no longer told from the stream's other Linears.)"""
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    order = {n: i for i, n in enumerate(linears)}
    skip = _attention_projections(model)
    blocks = []
    for name, down in linears.items():
        F, E = down.in_features, down.out_features
        if F == E or id(down) in skip:
            continue
        parts = name.split(".")
        for depth in range(len(parts) - 1, max(-1, len(parts) - 3), -1):  # its parent, or the parent's parent
            prefix = ".".join(parts[:depth]) + "." if depth else ""
            ups = tuple(n for n, m in linears.items() if n.startswith(prefix) and order[n] < order[name]
                        and id(m) not in skip and m.out_features == F and m.in_features == E)
            if ups:
                blocks.append(FfnBlock(ups, name, F))
                break
    return blocks


def neuron_stats(model: nn.Module, blocks: list[FfnBlock], batches: Iterable, run_fn: Callable) -> dict[str, tuple]:
    """{down: (mean (F,), mean square (F,))} of each block's neurons (``down``'s input) over every token of
    ``model`` run on ``batches`` (``run_fn(model, batch)``), without gradients. A padding-free model sees only real
    tokens; a padded one counts its padding positions too."""
    sums = {b.down: [0.0, 0.0, 0] for b in blocks}
    handles = []
    for b in blocks:
        def hook(_m, args, key=b.down):
            a = args[0].detach().double().reshape(-1, args[0].shape[-1])  # (tokens, F)
            s = sums[key]
            s[0], s[1], s[2] = s[0] + a.sum(0), s[1] + (a * a).sum(0), s[2] + a.shape[0]
        handles.append(model.get_submodule(b.down).register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            for batch in batches:
                run_fn(model, batch)
    finally:
        for h in handles:
            h.remove()
    return {k: (s[0] / max(s[2], 1), s[1] / max(s[2], 1)) for k, s in sums.items()}


def neuron_scores(model: nn.Module, stats: Mapping[str, tuple], *, mean_replacement: bool = True) -> dict[str, Tensor]:
    """{down: (F,)} what removing each neuron changes in its block's output, squared and averaged over tokens:
    E[(a_i - m_i)²]·‖W_down[:, i]‖² when the neuron is replaced by its mean m_i, E[a_i²]·‖W_down[:, i]‖² when zeroed
    (higher: more important)."""
    out = {}
    for down, (mean, mean_sq) in stats.items():
        w = model.get_submodule(down).weight.detach().double()  # (E, F)
        spread = (mean_sq - mean * mean).clamp_min(0) if mean_replacement else mean_sq
        out[down] = (spread * (w * w).sum(0)).float()  # (F,)
    return out


def _gate_hook(keep: list[int], width: int, mean: Tensor | None):
    """A forward pre-hook on ``down`` replacing the neurons not in ``keep`` by ``mean`` (or zero)."""
    mask = torch.zeros(width, dtype=torch.bool)
    mask[keep] = True

    def hook(_m, args):
        a = args[0]
        fill = torch.zeros_like(a) if mean is None else mean.to(a).expand_as(a)
        return (torch.where(mask.to(a.device), a, fill), *args[1:])
    return hook


def cut_block(model: nn.Module, block: FfnBlock, keep: list[int], mean: Tensor | None) -> None:
    """``block`` at its kept neurons: rows ``keep`` of each producer, those columns of ``down``; with ``mean``, the
    removed neurons' mean contribution folded into ``down``'s bias."""
    idx = torch.tensor(keep, dtype=torch.long)
    down = model.get_submodule(block.down)
    with torch.no_grad():
        if mean is not None:
            cut = torch.ones(block.width, dtype=torch.bool)
            cut[idx] = False
            extra = down.weight[:, cut] @ mean[cut].to(down.weight)  # (E,)
            if down.bias is None:
                down.bias = nn.Parameter(extra)
            else:
                down.bias.add_(extra)
        down.weight = nn.Parameter(down.weight[:, idx].clone())  # (E, F')
        down.in_features = len(keep)
        for name in block.up:
            up = model.get_submodule(name)
            up.weight = nn.Parameter(up.weight[idx].clone())  # (F', E)
            if up.bias is not None:
                up.bias = nn.Parameter(up.bias[idx].clone())
            up.out_features = len(keep)


def cut_neurons(model: nn.Module, keep: Mapping[str, list[int]], example: Callable[[nn.Module], object], *,
                blocks: list[FfnBlock] | None = None, means: Mapping[str, Tensor] | None = None) -> None:
    """Cut each block's neurons to ``keep`` ({down: kept neuron indices}) in place, verified: ``example(model)``
    (one call, its first output a tensor) must give what the gated model gave (the removed neurons replaced by
    ``means[down]``, or zero) within the cut's rounding; else the model is restored and ValueError names the block.
    ``blocks``: :func:`ffn_blocks` (found again when None)."""
    from multihead.heads.layouts import differs

    by_down = {b.down: b for b in (blocks if blocks is not None else ffn_blocks(model))}
    unknown = [d for d in keep if d not in by_down]
    if unknown:
        raise ValueError(f"cut_neurons: {unknown[:3]} are not feed-forward blocks of {type(model).__name__}; "
                         f"its blocks end in {list(by_down)[:3]}... (ffn_blocks(model)).")
    for down, kept in keep.items():
        b = by_down[down]
        if not kept or len(set(kept)) != len(kept) or min(kept) < 0 or max(kept) >= b.width:
            raise ValueError(f"cut_neurons: keep[{down!r}] must be distinct indices in [0, {b.width}) and at least "
                             f"one; got {len(kept)} from {min(kept, default=None)} to {max(kept, default=None)}.")
    means = means or {}
    handles = [model.get_submodule(d).register_forward_pre_hook(_gate_hook(list(k), by_down[d].width, means.get(d)))
               for d, k in keep.items()]
    try:
        with torch.no_grad():
            ref = _first(example(model))
    finally:
        for h in handles:
            h.remove()
    saved = {n: copy.deepcopy(model.get_submodule(n)) for d in keep for n in (*by_down[d].up, d)}
    for d, k in keep.items():
        cut_block(model, by_down[d], sorted(k), means.get(d))
    try:
        with torch.no_grad():
            why = differs(_first(example(model)), ref)
    except (RuntimeError, ValueError) as e:  # a layer between sized for every neuron (a norm over them)
        why = f"the cut model fails: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    if why is not None:
        for n, m in saved.items():  # all or nothing
            parent, _, leaf = n.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, leaf, m)
        raise ValueError(f"cut_neurons: cutting the neurons of {list(keep)[:3]} does not equal gating them ({why}): "
                         "their producers are not what ffn_blocks found, or something between them mixes neurons; "
                         "nothing was cut.")


def _first(out) -> Tensor:
    if isinstance(out, Tensor):
        return out
    if isinstance(out, dict) or hasattr(out, "values"):
        return next(v for v in out.values() if isinstance(v, Tensor))
    return next(v for v in out if isinstance(v, Tensor))


def prune_neurons(model: nn.Module, fraction: float, batches: Iterable, run_fn: Callable,
                  example: Callable[[nn.Module], object], *, mean_replacement: bool = True) -> dict[str, list[int]]:
    """Cut ``fraction`` of every feed-forward block's neurons (the same share of each, the least important by
    :func:`neuron_scores` on ``batches``), verified (:func:`cut_neurons`); a block that would keep exactly as many
    neurons as the stream is wide keeps one fewer (:func:`ffn_blocks` tells blocks by F != E). Returns {down: kept
    indices}."""
    if not 0 < fraction < 1:
        raise ValueError(f"prune_neurons: fraction must be in (0, 1); got {fraction}.")
    blocks = ffn_blocks(model)
    if not blocks:
        raise ValueError(f"prune_neurons: {type(model).__name__} has no feed-forward block of nn.Linear layers "
                         "(a Linear reading F channels written by Linears of the same layer) to cut.")
    stats = neuron_stats(model, blocks, batches, run_fn)
    scores = neuron_scores(model, stats, mean_replacement=mean_replacement)
    keep = {}
    for b in blocks:
        n_keep = max(1, round(b.width * (1 - fraction)))
        if n_keep == model.get_submodule(b.down).out_features:  # as wide as the stream: one fewer, so that
            n_keep -= 1                                         # ffn_blocks (and load) still tell the block
        keep[b.down] = sorted(torch.topk(scores[b.down], n_keep).indices.tolist())
    means = {d: stats[d][0].float() for d in keep} if mean_replacement else None
    cut_neurons(model, keep, example, blocks=blocks, means=means)
    return keep
