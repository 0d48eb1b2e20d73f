"""Activation patching per head: how much of a behaviour one head carries, by a causal experiment.

:func:`patch` runs the model on a *clean* and a *corrupted* input and records every head's output (before the heads
are merged, where the gates act: each module's hook list). Then, for every seen module and head -- over all
positions, or one position at a time -- it runs the *base* input with that one head's output taken from the other
run, and reads the metric: ``direction="denoise"`` (the corrupted run, one head clean: how much of the behaviour
comes back) or ``"noise"`` (the clean run, one head corrupted: how much of it goes). Patches are batched along the
batch dimension, ``chunk`` of them a forward (the base input repeated, each copy with its own head patched), never
one forward per head; memory grows with ``chunk``. Where the attention modules lie in the items of an
``nn.ModuleList`` (the stack's blocks: a transformers model's layers, timm's blocks), the blocks before a chunk's
first patch are not run on the repeated batch (a chunk never spans two blocks): each block's output of the base input
is computed once, at the base batch, and replayed by every later chunk (a block whose forward returns a tensor, and
only while no hook could see inside it: a block with a forward hook of its own or on any of its modules, or with a
global hook, runs at the base batch every time, so every hook runs as in the base run). The repeated rows and the
replay are each checked on the first chunk that uses them (one block type: a stack's blocks share their forward),
its first and last patches against the same run whole (kept only if they agree within 1e-4 of the base-to-source
span; otherwise every chunk runs whole). A metric that reads a value computed over the whole batch (the loss from
``labels=``) is refused before any patched forward. A metric that
reads the last position alone runs faster with ``run=lambda m, x: m(**x, logits_to_keep=1)`` on a transformers causal
language model: its output head then computes one position's logits, not L.

:func:`path_patch` passes a sender head's effect through chosen receiving heads only (their queries, keys or values),
every other head frozen at the base run: the path from one head to another, not its whole effect.

:func:`attribution` estimates every patch at once to first order (attribution patching): one forward and one
backward of the base run, one forward of the other; head h's estimate is the metric's gradient with respect to its
output times the change patching would make, (a_source - a_base) . dmetric/da_base. :meth:`Patching.agreement`
compares it with the real patches.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor, nn

from multihead.heads.gates import attention_modules
from multihead.layer.hooks import num_heads as _num_heads

__all__ = ["Patching", "attribution", "patch", "path_patch"]


@dataclass
class Patching:
    """The result of :func:`patch`: ``values`` {module: (H,) or, per position, (H, L)} the metric with that head
    (at that position) patched; ``base`` the metric of the unpatched base run, ``source`` of the run the patches come
    from; ``direction`` "denoise" (base = corrupted) or "noise" (base = clean)."""

    values: dict[str, Tensor]
    base: float
    source: float
    direction: str

    def effect(self) -> dict[str, Tensor]:
        """Each patch's share of the way from ``base`` to ``source`` ((value - base) / (source - base)): 1 = that head
        alone moves the metric all the way."""
        span = self.source - self.base
        if span == 0:
            raise ValueError("the clean and corrupted runs give the same metric: no effect to share out.")
        return {n: (v - self.base) / span for n, v in self.values.items()}

    def grid(self) -> Tensor:
        """(modules, H) -- per position (modules, H, L) -- in the modules' order; NaN where a module has fewer heads."""
        H = max(v.shape[0] for v in self.values.values())
        rows = [torch.cat([v, v.new_full((H - v.shape[0], *v.shape[1:]), float("nan"))]) for v in self.values.values()]
        return torch.stack(rows)

    def agreement(self, other: Patching) -> dict[str, float]:
        """How well two results of the same experiment agree (attribution against real patching): the Pearson
        correlation of their values over every head (and position), and the largest difference."""
        a = torch.cat([v.flatten() for v in self.values.values()])
        b = torch.cat([other.values[n].flatten() for n in self.values])
        a0, b0 = a - a.mean(), b - b.mean()
        denom = float(a0.norm() * b0.norm())
        return {"pearson": float(a0 @ b0) / denom if denom > 0 else float("nan"),
                "max_abs_diff": float((a - b).abs().max())}

    def figure(self, metric_name: str = "metric"):
        """The effects as a picture (:func:`multihead.viz.curves.patching_figure`)."""
        from multihead.viz.curves import patching_figure

        return patching_figure(self, metric_name=metric_name)

    def to_markdown(self) -> str:
        """The (module x head) table of values (all-position patching)."""
        H = max(v.shape[0] for v in self.values.values())
        lines = ["| module |" + "".join(f" h{h} |" for h in range(H)), "|---|" + "---:|" * H]
        for n, v in self.values.items():
            flat = v if v.dim() == 1 else v.mean(-1)
            lines.append(f"| {n} |" + "".join(f" {float(x):.4f} |" for x in flat) + " |" * (H - len(flat)))
        return "\n".join(lines)


def _call(model: nn.Module, inputs):
    if isinstance(inputs, Mapping):
        return model(**inputs)
    return model(*inputs) if isinstance(inputs, tuple) else model(inputs)


def _repeat(inputs, n: int, B: int):
    """The inputs ``n`` times along the batch dimension (every tensor whose first size is ``B``), block by block."""
    def rep(x):
        return torch.cat([x] * n) if isinstance(x, Tensor) and x.dim() > 0 and x.shape[0] == B else x

    if isinstance(inputs, Mapping):
        return {k: rep(v) for k, v in inputs.items()}
    return tuple(rep(x) for x in inputs) if isinstance(inputs, tuple) else rep(inputs)


def _rows(output, a: int, b: int, B: int):
    """Rows ``a:b`` of every tensor of ``output`` whose first size is the batch ``B`` (a ModelOutput, dict, tuple)."""
    if isinstance(output, Tensor):
        return output[a:b] if output.dim() > 0 and output.shape[0] == B else output
    if isinstance(output, Mapping):
        return type(output)(**{k: _rows(v, a, b, B) for k, v in output.items()})
    if isinstance(output, tuple | list):
        return type(output)(_rows(v, a, b, B) for v in output)
    return output


def _per_row(metric: Callable, output, B: int) -> None:
    """Refuse a metric that reads a value computed over the whole batch (a 0-dim float tensor of the output, such as
    the loss transformers computes from ``labels``): patches batched together would all get their batch's one value.
    Found by reading the metric with those values made NaN, before any patched forward."""
    def poisoned(x):
        if isinstance(x, Tensor):
            return torch.full_like(x, float("nan")) if x.dim() == 0 and x.is_floating_point() else x
        if isinstance(x, Mapping):
            return type(x)(**{k: poisoned(v) for k, v in x.items()})
        if isinstance(x, tuple | list):
            return type(x)(poisoned(v) for v in x)
        return x

    if math.isfinite(_value(metric, output, B)) and not math.isfinite(_value(metric, poisoned(output), B)):
        raise ValueError("metric reads a value of the model's output computed over the whole batch (a 0-dim tensor, "
                         "such as the loss from labels=): patches run batched, so each would get its batch's mixed "
                         "value; compute the metric per row from the logits (a (B,) tensor), e.g. the per-row "
                         "cross-entropy.")


def _value(metric: Callable, output, B: int) -> float:
    """The metric of one block of ``B`` rows: a scalar, or a (B,) tensor averaged; anything else is refused."""
    m = metric(output)
    t = torch.as_tensor(m, dtype=torch.float64) if not isinstance(m, Tensor) else m.detach().double()
    if t.numel() != 1 and tuple(t.shape) != (B,):
        raise ValueError(f"metric must return a scalar or a ({B},) tensor (one value per row of the batch); got "
                         f"{type(m).__name__} of shape {tuple(t.shape)}.")
    return float(t.mean())


@contextlib.contextmanager
def _recording(mods: dict[str, nn.Module], into: dict[str, Tensor]):
    """Every module's per-head output (B, Lq, H, Dv) of the run inside the block, into ``into``."""
    def keep(name):
        def transform(module, out: Tensor, live) -> Tensor:
            if out.dim() != 4:
                raise ValueError(f"{name}: its heads' output is packed ({tuple(out.shape)}, padding-free); patching "
                                 "takes a padded batch: turn packing off (multihead.hf.attach(..., packed=False)).")
            if name in into:
                raise ValueError(f"{name} is called more than once in one forward (a layer shared across the stack, "
                                 "or a loop): a patch takes a module's one call; patch the modules called once "
                                 "(modules=[...]).")
            into[name] = out.detach().clone()
            return out
        return transform

    handles = [m.attention_hooks.add_transform(keep(n)) for n, m in mods.items()]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _both_runs(model: nn.Module, call: Callable, mods: dict[str, nn.Module], base_in, src_in) -> tuple:
    """The base and the source runs with every module's per-head output recorded: (base output, {module: (B, Lq,
    H, Dv)}, source output, {module: (B, Lq, H, Dv)})."""
    base_out, src_out = {}, {}
    with _recording(mods, base_out):
        base_output = call(model, base_in)
    with _recording(mods, src_out):
        src_output = call(model, src_in)
    return base_output, base_out, src_output, src_out


def _patching(name: str, src: Tensor, items: list[tuple[int, int, int | None]], B: int):
    """A transform putting ``src``'s head h (at position ``pos``, or everywhere) into rows of block p."""
    def transform(module, out: Tensor, live) -> Tensor:
        out = out.clone()
        s = src.to(out)
        for p, h, pos in items:
            rows = slice(p * B, (p + 1) * B)
            if pos is None:
                out[rows, :, h] = s[:, :, h]  # (B, Lq, Dv)
            else:
                out[rows, pos, h] = s[:, pos, h]  # (B, Dv)
        return out
    return transform


def patch(model: nn.Module, clean, corrupted, metric: Callable, *, direction: str = "denoise",
          positions: bool = False, modules: list[str] | None = None, chunk: int = 32,
          run: Callable | None = None) -> Patching:
    """Activation patching of every head of every seen attention module (``modules``: some of them).

    ``clean``, ``corrupted``: the model's inputs (a dict of keyword arguments, a tuple, or one tensor), batch B,
    the same length; ``metric(output)`` -> a scalar or a (B,) tensor (averaged over the batch); ``run(model,
    inputs)``: how the model is called (default ``model(**inputs)`` / ``model(*inputs)`` / ``model(inputs)``).
    ``positions``: one patch per (head, query position), values (H, L). ``chunk``: patches per forward. Runs without
    gradients, in eval mode. Refused before any patched forward: an unknown module, ``chunk`` < 1, a metric that
    does not give a scalar or (B,) values, inputs whose runs give heads' outputs of different shapes."""
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be a whole number >= 1 (patches per forward); got {chunk!r}.")
    mods, call, base_in, src_in = _experiment(model, clean, corrupted, direction, modules, run)
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            base_output, base_out, src_output, src_out = _both_runs(model, call, mods, base_in, src_in)
            return _patched(model, mods, (base_in, base_output, base_out), (src_output, src_out), metric, call,
                            positions=positions, chunk=chunk, direction=direction)
    finally:
        model.train(was)


def _patched(model, mods, base, source, metric, call, *, positions: bool, chunk: int, direction: str) -> Patching:
    base_in, base_output, base_out = base
    src_output, src_out = source
    for n in mods:
        if n not in base_out or n not in src_out:
            raise ValueError(f"{n} was not called by the model on these inputs: nothing to patch.")
        if base_out[n].shape != src_out[n].shape:
            raise ValueError(f"{n}: the clean and corrupted runs give its heads' outputs of shapes "
                             f"{tuple(src_out[n].shape)} and {tuple(base_out[n].shape)} (B, Lq, H, Dv): patching "
                             "takes a head's output position by position, so both inputs need the same length; pad "
                             "the shorter one (and mask it) to align their positions.")
    B = next(iter(base_out.values())).shape[0]
    _per_row(metric, base_output, B)
    base_v, src_v = _value(metric, base_output, B), _value(metric, src_output, B)
    todo = [(n, h, pos) for n, m in mods.items() for h in range(_num_heads(m))
            for pos in (range(base_out[n].shape[1]) if positions else [None])]
    called = {n: mods[n] for n in base_out if n in mods}  # in the order the base run called them
    run = _ChunkRun(model, mods, src_out, metric, call, base_in, B, _blocks(model, called),
                    {"checked": set(), "outputs": {}, "span": abs(src_v - base_v)})
    got: list[float] = []
    for group in run.by_block(todo):  # a chunk never spans two blocks: each runs from its own block on
        for i in range(0, len(group), chunk):
            got += run.chunk(group[i:i + chunk])
    values, k = {}, 0
    for n, m in mods.items():
        H, L = _num_heads(m), base_out[n].shape[1]
        size = H * (L if positions else 1)
        v = torch.tensor(got[k:k + size], dtype=torch.float64)
        values[n] = v.view(H, L) if positions else v  # (H,) or (H, L)
        k += size
    return Patching(values, base_v, src_v, direction)


def _blocks(model: nn.Module, mods: dict[str, nn.Module]) -> list[nn.Module]:
    """The stack's blocks (items of the model's outermost ``nn.ModuleList``s holding the attention modules), when
    every attention module lies in one, in the order of the modules the base run called (the recording order): a
    patch in block b leaves everything before b as in the base run."""
    items: list[tuple[str, nn.Module]] = []
    for lname, lst in model.named_modules():
        if isinstance(lst, nn.ModuleList) and lname:
            items += [(f"{lname}.{i}", blk) for i, blk in enumerate(lst)]
    owner = {}
    for n in mods:
        inside = [(p, blk) for p, blk in items if n == p or n.startswith(p + ".")]
        if not inside:
            return []
        owner[n] = min(inside, key=lambda pb: len(pb[0]))[1]  # the outermost: a layer of the stack
    seen: list[nn.Module] = []
    for blk in owner.values():
        if all(blk is not s for s in seen):
            seen.append(blk)
    return seen


def _repeat_rows(x, c: int, B: int):
    """Every tensor in ``x`` (nested tuples, lists, dicts) whose first size is ``B``, ``c`` times along it."""
    if isinstance(x, Tensor):
        return torch.cat([x] * c) if x.dim() > 0 and x.shape[0] == B else x
    if isinstance(x, tuple | list):
        return type(x)(_repeat_rows(v, c, B) for v in x)
    if isinstance(x, dict):
        return {k: _repeat_rows(v, c, B) for k, v in x.items()}
    return x


def _hooked(block: nn.Module) -> bool:
    """Whether a forward hook could see inside ``block`` now: its own or any of its modules' (a user's, or one a
    library installs during the model's forward, as transformers does to collect attentions), or a global one."""
    from multihead.layer.module import _GLOBAL_HOOKS

    return any(_GLOBAL_HOOKS[:3]) or any(m._forward_hooks or m._forward_pre_hooks for m in block.modules())


class _Shared:
    """For one call, a block's ``forward`` wrapped: the first time it runs (no hook seeing inside it), its return is
    recorded; later calls return a copy of that record instead of computing. The real forward runs whenever a hook
    could see inside the block, so every hook runs exactly as in the base run. ``remove()`` puts ``forward`` back
    (an instance attribute set by someone else, as accelerate's, included)."""

    def __init__(self, block: nn.Module, outputs: dict[int, Tensor], i: int):
        self.block, self.had = block, block.__dict__.get("forward")
        real = self.had if self.had is not None else type(block).forward.__get__(block)

        def forward(*args, **kwargs):
            if _hooked(block):
                return real(*args, **kwargs)
            if i in outputs:
                return outputs[i].clone()
            out = real(*args, **kwargs)
            if isinstance(out, Tensor):  # a tensor is replayed; a block returning anything else runs every time
                outputs[i] = out.detach().clone()
            return out

        block.forward = forward

    def remove(self) -> None:
        if self.had is None:
            del self.block.forward
        else:
            self.block.forward = self.had


class _ChunkRun(NamedTuple):
    """One patching experiment's chunks: each chunk's patches run in one forward of the base input."""

    model: nn.Module
    mods: dict
    src_out: dict
    metric: Callable
    call: Callable
    base_in: object
    B: int
    blocks: list
    state: dict  # {"checked": the ways of sharing the prefix checked so far, "outputs": {block: its base output}}

    def chunk(self, part: list) -> list[float]:
        """The chunk's values: with the blocks before its first patch shared with the base run where that was checked
        to agree with the whole forward (the first chunk starting past the first block checks it, the first that
        replays a recorded block's output checks that; any chunk that raises there falls back), else the whole
        forward."""
        start = min(self.block_of(n) for n, _, _ in part) if self.blocks else 0
        if not self.blocks or start == 0:
            return self.values(part)
        way = "replayed" if any(i in self.state["outputs"] for i in range(start)) else "repeated"
        try:
            fast = self.values(part, start)
        except Exception:  # noqa: BLE001 - a model whose blocks take more than per-row inputs: run whole
            self.blocks.clear()
            return self.values(part)
        if way in self.state["checked"]:
            return fast
        ends = [0, len(part) - 1] if len(part) > 1 else [0]  # the first and last copies, whole, in one forward
        whole = self.values([part[i] for i in ends])
        mine = [fast[i] for i in ends]
        scale = max([1e-6] + [abs(v) for v in whole])  # rounding: of the values' size; a wrong share: of the span
        self.state["checked"].add(way)
        if not max(abs(a - b) for a, b in zip(whole, mine)) <= max(1e-4 * self.state["span"], 1e-6 * scale):
            self.blocks.clear()
            return self.values(part)
        return fast

    def values(self, part: list, start: int | None = None) -> list[float]:
        """The metric of each patch in ``part``: the base input repeated ``len(part)`` times (from the start; with
        ``start``, from block ``start`` of the stack on: each block before it gives its output of the base run,
        computed at B rows by the first chunk that needs it and replayed by the later ones), patch p in rows
        p B .. (p + 1) B."""
        B, c = self.B, len(part)
        by_module: dict[str, list] = {}
        for p, (n, h, pos) in enumerate(part):
            by_module.setdefault(n, []).append((p, h, pos))
        with contextlib.ExitStack() as undo:  # every handle undone as soon as it exists, whatever raises
            for n, items in by_module.items():
                undo.callback(self.mods[n].attention_hooks.add_transform(_patching(n, self.src_out[n], items, B)).remove)
            if start is not None:  # blocks from ``start`` on get their per-row inputs repeated (the rest are c B)
                for blk in self.blocks[start:]:
                    undo.callback(blk.register_forward_pre_hook(
                        lambda m, a, kw: (_repeat_rows(a, c, B), _repeat_rows(kw, c, B)), with_kwargs=True).remove)
                for i, blk in enumerate(self.blocks[:start]):
                    undo.callback(_Shared(blk, self.state["outputs"], i).remove)
            output = self.call(self.model, self.base_in if start is not None else _repeat(self.base_in, c, B))
        return [_value(self.metric, _rows(output, p * B, (p + 1) * B, c * B), B) for p in range(c)]

    def by_block(self, todo: list) -> list[list]:
        """``todo`` cut where the block of its patches changes (the whole list where no blocks were found)."""
        if not self.blocks:
            return [todo] if todo else []
        block = {n: self.block_of(n) for n in {item[0] for item in todo}}
        groups: list[list] = []
        for item in todo:
            if groups and block[groups[-1][-1][0]] == block[item[0]]:
                groups[-1].append(item)
            else:
                groups.append([item])
        return groups

    def block_of(self, name: str) -> int:
        return next(i for i, blk in enumerate(self.blocks) if any(m is self.mods[name] for m in blk.modules()))


def attribution(model: nn.Module, clean, corrupted, metric: Callable, *, direction: str = "denoise",
                positions: bool = False, modules: list[str] | None = None, run: Callable | None = None) -> Patching:
    """Attribution patching: every patch of :func:`patch` estimated to first order from one forward and one backward
    of the base run (and one forward of the other), ``base + (a_source - a_base) . dmetric/da_base`` per head (per
    position with ``positions``); the same arguments and record as :func:`patch` (compare them with
    :meth:`Patching.agreement`). Gradients reach no parameter's ``.grad``."""
    mods, call, base_in, src_in = _experiment(model, clean, corrupted, direction, modules, run)
    was = model.training
    model.eval()
    try:
        src_out: dict[str, Tensor] = {}
        with torch.no_grad(), _recording(mods, src_out):
            src_output = call(model, src_in)
        live: dict[str, Tensor] = {}

        def keep(name):
            def transform(module, out: Tensor, _live) -> Tensor:
                live[name] = out  # in the graph: the metric's gradient with respect to it is taken below
                return out
            return transform

        handles = [m.attention_hooks.add_transform(keep(n)) for n, m in mods.items()]
        try:
            with torch.enable_grad():
                base_output = call(model, base_in)
        finally:
            for h in handles:
                h.remove()
        B = next(iter(src_out.values())).shape[0]
        for n in mods:
            if n not in live or live[n].shape != src_out[n].shape:
                raise ValueError(f"{n}: the clean and corrupted runs give its heads' outputs of different shapes (or it "
                                 "was not called): both inputs need the same length.")
        value = metric(base_output)
        total = value.double().mean() if isinstance(value, Tensor) else None
        if total is None or not total.requires_grad:
            raise ValueError("metric must return a tensor computed from the model's output (a scalar or (B,)), so "
                             "that its gradient reaches the heads.")
        base_v = _value(lambda _o: value, base_output, B)
        grads = torch.autograd.grad(total, [live[n] for n in mods], allow_unused=True)
        values = {}
        for (n, a), gr in zip(((n, live[n]) for n in mods), grads, strict=True):
            gr = torch.zeros_like(a) if gr is None else gr
            d = ((src_out[n] - a.detach()) * gr).double()  # (B, Lq, H, Dv): first-order change, summed below
            values[n] = base_v + (d.sum((0, 3)).transpose(0, 1) if positions else d.sum((0, 1, 3)))  # (H, L) or (H,)
        return Patching(values, base_v, _value(metric, src_output, B), direction)
    finally:
        model.train(was)


def path_patch(model: nn.Module, clean, corrupted, metric: Callable, receivers: Mapping[str, list[int]], *,
               through: str | tuple[str, ...] = ("q", "k", "v"), senders: list[str] | None = None,
               direction: str = "denoise", chunk: int = 16, run: Callable | None = None) -> Patching:
    """Path patching: each sender head's effect through the queries, keys or values (``through``) of the receiving
    heads only (``receivers``: {module: [heads]}). For each head of the ``senders`` modules (default every seen
    module), in two runs of the base input (the corrupted one for ``"denoise"``):

    1. the sender head's output taken from the source run, every other head's output frozen at the base run's (the
       layers between recompute the rest: embeddings, feed-forward blocks, norms), and the receivers' per-head
       ``through`` inputs recorded;
    2. the receivers' ``through`` inputs set to those, everything else computed as usual; the metric read.

    So the metric moves only by what the sender writes into the stream and the receivers read through the chosen
    inputs (Wang et al. 2022). ``values[sender module]`` (H,): the metric per sender head; ``base``/``source`` as
    :func:`patch`. Patches batched, ``chunk`` senders a forward (two forwards a chunk). Refused before any patched
    run: unknown modules or heads, ``through`` other than q/k/v; and at the first run: keys or values of a module
    whose heads share them (GQA: a key/value head is its group's, not one head's), a packed call."""
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be a whole number >= 1 (senders per forward); got {chunk!r}.")
    through = (through,) if isinstance(through, str) else tuple(through)
    if not through or any(x not in ("q", "k", "v") for x in through):
        raise ValueError(f"through must name the receivers' inputs among 'q', 'k', 'v'; got {through!r}.")
    every, call, base_in, src_in = _experiment(model, clean, corrupted, direction, None, run)
    send = _modules(model, senders)
    for n in receivers:
        if n not in every:
            raise ValueError(f"receiver {n!r} is not an attention module multihead sees; modules: {list(every)}.")
    recv = {n: sorted(set(_indices_of(n, hs, _num_heads(every[n])))) for n, hs in receivers.items()}
    if not recv:
        raise ValueError("receivers must name at least one module and head: {module: [heads]}.")
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            base_output, base_out, src_output, src_out = _both_runs(model, call, every, base_in, src_in)
            for n in every:
                if n not in base_out or n not in src_out or base_out[n].shape != src_out[n].shape:
                    raise ValueError(f"{n}: not called on both inputs, or its heads' outputs differ in shape "
                                     "(both inputs need the same length).")
            B = next(iter(base_out.values())).shape[0]
            _per_row(metric, base_output, B)
            todo = [(n, h) for n, m in send.items() for h in range(_num_heads(m))]
            exp = _PathRun(model, call, base_in, every, base_out, src_out, recv, through, metric, B)
            got: list[float] = []
            for i in range(0, len(todo), chunk):
                got += _path_chunk(exp, todo[i:i + chunk])
            values, k = {}, 0
            for n, m in send.items():
                values[n] = torch.tensor(got[k:k + _num_heads(m)], dtype=torch.float64)  # (H,)
                k += _num_heads(m)
            return Patching(values, _value(metric, base_output, B), _value(metric, src_output, B), direction)
    finally:
        model.train(was)


def _indices_of(name: str, heads, H: int) -> list[int]:
    try:
        hs = [int(h) for h in heads]
    except (TypeError, ValueError):
        raise TypeError(f"receivers[{name!r}] must be a list of head numbers; got {heads!r}.") from None
    bad = [h for h in hs if not 0 <= h < H]
    if bad or not hs:
        raise ValueError(f"receivers[{name!r}] must name heads in [0, {H - 1}]; got {list(heads)!r}.")
    return hs


class _PathRun(NamedTuple):
    """One path-patching experiment: the model and its call, the base input, the modules with their base and source
    runs' per-head outputs (B, Lq, H, Dv), the receivers {module: heads} and their inputs patched, the metric, B."""

    model: nn.Module
    call: Callable
    base_in: object
    every: dict
    base_out: dict
    src_out: dict
    recv: dict
    through: tuple
    metric: Callable
    B: int


def _path_chunk(exp: _PathRun, part: list[tuple[str, int]]) -> list[float]:
    """The two runs of path patching for ``part`` (senders, one copy of the base input each) -> a metric a sender."""
    model, call, base_in, every, base_out, src_out, recv, through, metric, B = exp
    c = len(part)
    recorded: dict[str, tuple[Tensor, Tensor, Tensor]] = {}

    def frozen(name):  # run 1: every head at its base output, each copy's sender from the source run
        def transform(module, out: Tensor, live) -> Tensor:
            new = base_out[name].to(out).repeat(c, 1, 1, 1)  # (B, Lq, H, Dv) -> (c B, Lq, H, Dv)
            for p, (n, h) in enumerate(part):
                if n == name:
                    new[p * B:(p + 1) * B, :, h] = src_out[name][:, :, h].to(out)
            return new
        return transform

    def record(name):
        def hook(module, q: Tensor, k: Tensor, v: Tensor):
            if ("k" in through or "v" in through) and k.shape[1] != q.shape[1]:
                raise ValueError(f"{name}: its {q.shape[1]} query heads share {k.shape[1]} key/value heads (GQA): a "
                                 "receiver's key or value is its group's, not one head's; path-patch through 'q'.")
            recorded[name] = (q.detach().clone(), k.detach().clone(), v.detach().clone())
            return q, k, v
        return hook

    def setting(name):  # run 2: the receivers' chosen inputs from run 1
        def hook(module, q: Tensor, k: Tensor, v: Tensor):
            rq, rk, rv = recorded[name]
            q, k, v = q.clone(), k.clone(), v.clone()
            for h in recv[name]:
                for x, new, old in (("q", q, rq), ("k", k, rk), ("v", v, rv)):
                    if x in through:
                        new[:, h] = old[:, h].to(new)  # (c B, Lx, d): head h's input
            return q, k, v
        return hook

    handles = [m.attention_hooks.add_transform(frozen(n)) for n, m in every.items()]
    handles += [every[n].attention_hooks.add_input(record(n)) for n in recv]
    try:
        call(model, _repeat(base_in, c, B))
    finally:
        for h in handles:
            h.remove()
    handles = [every[n].attention_hooks.add_input(setting(n)) for n in recv]
    try:
        output = call(model, _repeat(base_in, c, B))
    finally:
        for h in handles:
            h.remove()
    return [_value(metric, _rows(output, p * B, (p + 1) * B, c * B), B) for p in range(c)]


def _experiment(model, clean, corrupted, direction: str, modules, run):
    """(the modules, how the model is called, the base run's inputs, the source run's) of an experiment, checked."""
    if direction not in ("denoise", "noise"):
        raise ValueError(f"direction must be 'denoise' (the corrupted run, one head clean) or 'noise' (the clean run, "
                         f"one head corrupted); got {direction!r}.")
    base_in, src_in = (corrupted, clean) if direction == "denoise" else (clean, corrupted)
    return _modules(model, modules), run or _call, base_in, src_in


def _modules(model: nn.Module, modules: list[str] | None) -> dict[str, nn.Module]:
    mods = attention_modules(model)
    if modules is not None:
        unknown = [n for n in modules if n not in mods]
        if unknown:
            raise ValueError(f"no multihead attention module named {unknown[0]!r}; modules: {list(mods)}.")
        mods = {n: mods[n] for n in modules}
    if not mods:
        raise ValueError("the model has no attention module multihead sees: attach it (multihead.hf.attach) or "
                         "observe it (heads.observe) first.")
    return mods
