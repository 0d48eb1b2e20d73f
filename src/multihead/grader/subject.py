"""The module under test, seen only through what the grader asks of it: a :class:`Description`
(its layers, parameters and attributes, as plain tensors and numbers) and :class:`Reply` records
of calls (:class:`Probe`: inputs, a mask in the module's convention, layers to observe or whose
output to replace, a cotangent for gradients).

:func:`describe` and :func:`run` execute in whichever process holds the module: this one for
:func:`multihead.check` on your own module (:class:`LocalSubject`), the submission's own sandbox
for a learner's file (:mod:`multihead.grader.sandbox`). Nothing else of the module reaches the
verdict, which is computed from these records alone.
"""

from __future__ import annotations

import contextlib
import inspect
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["CALLS", "HOW", "SELF_CALLS", "Description", "LocalSubject", "Probe", "Reply", "caller", "describe", "forbidden",
           "run"]

#: the calls a module can be graded through (a sandboxed file is called by name; a function only in-process)
CALLS = ("x", "x_mask", "qkv", "qkv_mask")
#: each call as the learner wrote it (for messages)
HOW = {"x": "m(x)", "x_mask": "m(x, mask)", "qkv": "m(q, k, v)", "qkv_mask": "m(q, k, v, mask)"}
#: the calls of a self-attention module (one input: queries, keys and values are the same tensor)
SELF_CALLS = ("x", "x_mask")
#: attribute names that may hold a head count, read off every submodule
HEAD_ATTRS = ("num_heads", "n_heads", "heads", "h", "num_head", "nhead", "n_head", "num_attention_heads",
              "head_count", "nheads")


class Probe(NamedTuple):
    """One call: q (B, Lq, E), k, v (B, Lk, E), ``mask`` in the module's convention (or None);
    ``same``: self-attention, the module gets q as keys and values (one tensor); ``record``: layers
    whose (input, output) each call returns; ``replace``: layer -> tensor that stands for its output;
    ``cotangent``: backward of (out * cotangent).sum(), gradients of the inputs and parameters;
    ``order``: report the Linear-like layers in the order they ran; ``kept``: report tensor
    attributes whose last two sizes are (Lq, Lk) after the call."""

    q: Tensor
    k: Tensor
    v: Tensor
    mask: Tensor | None = None
    same: bool = False
    record: tuple[str, ...] = ()
    replace: dict | None = None
    cotangent: Tensor | None = None
    order: bool = False
    kept: bool = False
    #: call a fresh copy of the module as it was built (never called), not the module itself
    fresh: bool = False
    #: report the random draws the call made (dropout in training mode, torch.randn, a layer's initialisation)
    watch: bool = False
    #: torch functions and modules the course forbids (:func:`forbidden`): report which the call used
    forbid: tuple = ()


class Reply(NamedTuple):
    """What one call gave: ``out`` (the output, or the first element of a tuple), ``weights`` (a
    tensor second element, if any), ``error`` ("TypeError: ..." when it raised), ``records``
    (layer -> [(input, output), ...] per call of it), ``grads`` ("q", "k", "v", "param.<name>"),
    ``order`` (Linear-like layers in call order), ``kept`` (attribute paths)."""

    out: Tensor | None
    weights: Tensor | None = None
    error: str | None = None
    records: dict = {}
    grads: dict = {}
    order: tuple = ()
    kept: tuple = ()
    #: the inputs the call wrote into ("q", "k", "v", "mask"): their values or shape changed
    changed: tuple = ()
    #: with ``watch``: the random draws the call made ("dropout", "randn", "kaiming_uniform_", ...)
    drawn: tuple = ()
    #: where the output was found when the module returned a mapping or a sequence ("the dict's 'output'"), else ''
    picked: str = ""
    #: of ``probe.forbid``, what the call used (a function called, a module's forward run)
    called: tuple = ()


@dataclass
class Description:
    """A module as data: ``modules`` name -> class name (named_modules; "" is the root);
    ``linear``: Linear-like layers (torch Linear, Keras Dense) -> (weight (out, in), bias) float64;
    ``params``: every parameter by name, float64 (lazy ones absent); ``trainable``: those that
    require grad; ``ints``: module name -> {attribute: int} for head-count-like and size attributes;
    ``scale``: the root's ``scale`` attribute; ``forward``: the forward's positional parameters
    (name, required); ``lazy``: uninitialised parameters remain; ``float64``: every floating parameter is float64
    (a module built with ``.double()``: it is probed in float64)."""

    modules: dict[str, str] = field(default_factory=dict)
    linear: dict[str, tuple] = field(default_factory=dict)
    params: dict[str, Tensor] = field(default_factory=dict)
    trainable: tuple[str, ...] = ()
    ints: dict[str, dict] = field(default_factory=dict)
    scale: float | None = None
    forward: tuple = ()
    lazy: bool = False
    float64: bool = False
    #: groups of names under which one submodule (or Parameter) holding weights sits in one list or dict of the
    #: module (``[Head(...)] * h``): the heads share one set of weights
    shared: tuple = ()

    @property
    def root(self) -> str:
        return self.modules.get("", "module")


def linear_like(m: nn.Module) -> tuple[Tensor, Tensor | None] | None:
    """(weight (out, in), bias) of a torch Linear or a Keras Dense layer, float64; None otherwise (and for
    a lazy layer not yet built)."""
    if isinstance(m, nn.Linear):
        if isinstance(m.weight, nn.parameter.UninitializedParameter):
            return None
        return m.weight.detach().double(), None if m.bias is None else m.bias.detach().double()
    if type(m).__name__ == "Dense" and getattr(m, "kernel", None) is not None:  # Keras 3 on torch: kernel (in, out)
        kern = getattr(m.kernel, "value", m.kernel)
        bias = getattr(m, "bias", None)
        bias = None if bias is None else getattr(bias, "value", bias)
        return kern.detach().double().T, None if bias is None else bias.detach().double()
    return None


def describe(module: nn.Module) -> Description:
    """The module as data (see :class:`Description`)."""
    d = Description()
    for name, m in module.named_modules():
        d.modules[name] = type(m).__name__
        if type(m).__module__.split(".")[0] == "keras" and getattr(m, "built", True) is False:
            d.lazy = True  # a Keras layer not built yet (its weights made by a first call), as a torch Lazy* layer
        wb = linear_like(m)
        if wb is not None:
            d.linear[name] = wb
        ints = {a: getattr(m, a) for a in (*HEAD_ATTRS, "out_features", "in_features", "d_k", "d_model", "head_dim",
                                          "embed_dim", "kdim", "vdim")
                if isinstance(m.__dict__.get(a, getattr(type(m), a, None)), int)
                and not isinstance(getattr(m, a), bool)}
        if ints:
            d.ints[name] = ints
    trainable = []
    for name, p in module.named_parameters():
        if isinstance(p, nn.parameter.UninitializedParameter):
            d.lazy = True
            continue
        d.params[name] = p.detach().double()
        if p.requires_grad:
            trainable.append(name)
    d.trainable = tuple(trainable)
    floats = [p.dtype for p in module.parameters() if p.is_floating_point()
              and not isinstance(p, nn.parameter.UninitializedParameter)]
    d.float64 = bool(floats) and all(t == torch.float64 for t in floats)
    scale = module.__dict__.get("scale")
    d.scale = float(scale) if isinstance(scale, int | float) and not isinstance(scale, bool) else None
    d.shared = _shared(module)
    try:
        params = [p for p in inspect.signature(module.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        d.forward = tuple((p.name, p.default is p.empty) for p in params)
    except (TypeError, ValueError):
        pass
    return d


def _shared(module: nn.Module) -> tuple[tuple[str, ...], ...]:
    """Each submodule holding parameters (or each Parameter) found at two or more places of one container -- a
    ModuleList, Sequential, ModuleDict, ParameterList or ParameterDict (``nn.ModuleList([Head(d)] * h)``) -- as the
    names it sits under there."""
    groups = []
    for name, m in module.named_modules():
        if isinstance(m, nn.ModuleList | nn.Sequential | nn.ModuleDict):
            items = [(k, c) for k, c in m._modules.items() if c is not None and any(True for _ in c.parameters())]
        elif isinstance(m, nn.ParameterList | nn.ParameterDict):
            items = [(k, p) for k, p in m._parameters.items() if p is not None]
        else:
            continue
        seen: dict[int, list[str]] = {}
        for k, c in items:
            seen.setdefault(id(c), []).append(f"{name}.{k}" if name else str(k))
        groups += [tuple(names) for names in seen.values() if len(names) > 1]
    return tuple(groups)


#: the names a forward's keyword-only mask parameter goes by
MASK_NAMES = ("mask", "attn_mask", "attention_mask", "key_padding_mask", "padding_mask", "src_mask", "valid_lens",
              "valid_len")


def mask_keyword(module, n_inputs: int) -> str | None:
    """The keyword the module's forward takes its mask by, where it cannot take it after its ``n_inputs`` tensors
    positionally (``forward(self, x, *, attn_mask=None)``): a keyword-only (or further) parameter named as a mask
    (:data:`MASK_NAMES`); None where the mask goes by position."""
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) > n_inputs or any(p.kind == p.VAR_POSITIONAL for p in params):
        return None
    return next((p.name for p in params if p.kind == p.KEYWORD_ONLY and p.name in MASK_NAMES), None)


def caller(call) -> Callable:
    """``run(module, q, k, v, mask)`` for a call name (:data:`CALLS`) or a function."""
    if callable(call):
        return lambda m, q, k, v, mk: call(m, q, k, v, mk)
    if call == "x":
        return lambda m, q, k, v, mk: m(q)
    if call == "x_mask":
        return lambda m, q, k, v, mk: m(q, **{kw: mk}) if (kw := mask_keyword(m, 1)) else m(q, mk)
    if call == "qkv":
        return lambda m, q, k, v, mk: m(q, k, v)
    if call == "qkv_mask":
        return lambda m, q, k, v, mk: m(q, k, v, **{kw: mk}) if (kw := mask_keyword(m, 3)) else m(q, k, v, mk)
    raise ValueError(f"call must be one of {CALLS} or a function f(module, q, k, v, mask); got {call!r}.")


#: how a reply's error starts when the module returned something the grader does not read as an output
RETURNED = "TypeError: the module returned"
#: how a reply's error starts when a fresh copy of the module could not be called
NO_FRESH = "no fresh copy"


def _output(r, q: Tensor, Lk: int) -> tuple[Tensor | None, Tensor | None, str]:
    """(output, weights or None, where the output was found) from what the module returns: a tensor; a tuple or list
    whose first element is the output (and a tensor second element the weights), or whose one output-shaped tensor
    -- 3-D, its first two sizes the queries' (``q``) -- is; a mapping (a dict, transformers' ModelOutput) whose one
    output-shaped tensor is the output (the one whose last size is the queries' where several are), and a tensor
    whose last two sizes are (Lq, Lk) the weights. A mapping whose output is not one tensor: TypeError naming its
    keys and the call that picks the output."""
    def shaped(t) -> bool:
        return isinstance(t, Tensor) and t.dim() == 3 and tuple(t.shape[:2]) == tuple(q.shape[:2])

    def weights_of(items, out):
        return next((t for _, t in items if isinstance(t, Tensor) and t is not out and t.dim() >= 3
                     and tuple(t.shape[-2:]) == (q.shape[1], Lk)), None)

    if isinstance(r, tuple | list):
        first = r[0] if r else None
        if isinstance(first, Tensor) or not r:
            return first, r[1] if len(r) > 1 and isinstance(r[1], Tensor) else None, ""
        found = [(i, t) for i, t in enumerate(r) if shaped(t)]
        if len(found) == 1:
            return found[0][1], weights_of(list(enumerate(r)), found[0][1]), f"element {found[0][0]} of its " \
                f"{type(r).__name__}"
        return None, None, ""
    if isinstance(r, Mapping):
        keys, said = list(r), RETURNED[len("TypeError: "):]
        if not keys:
            raise TypeError(f"{said} an empty {type(r).__name__}")
        items = list(r.items())
        found = [(k, t) for k, t in items if shaped(t)]
        if len(found) > 1:
            found = [(k, t) for k, t in found if t.shape[-1] == q.shape[-1]]
        if len(found) == 1:
            k, out = found[0]
            return out, weights_of(items, out), f"the {type(r).__name__}'s {k!r}"
        raise TypeError(f"{said} a {type(r).__name__} with keys {keys[:6]}"
                        f"{' and no' if not found else ', more than one'} tensor of the output's shape (B, Lq, ·): "
                        f"grade it through a call that returns the output tensor, e.g. call=lambda m, q, k, v, mask: "
                        f"m(q, k, v)[{keys[0]!r}] (for the command: a class whose forward returns it)")
    return (r if isinstance(r, Tensor) else None), None, ""


def _kept(module: nn.Module, last: tuple[int, int]) -> tuple[str, ...]:
    """Tensor attributes (or properties) of any submodule whose last two sizes are ``last``."""
    found = []
    for mname, m in module.named_modules():
        props = [n for c in type(m).__mro__ for n, a in vars(c).items() if isinstance(a, property)]
        for n in [*vars(m), *props]:
            try:
                t = getattr(m, n)
            except Exception:  # noqa: BLE001 - a property of the learner's module
                continue
            if isinstance(t, Tensor) and t.dim() >= 3 and tuple(t.shape[-2:]) == last:
                found.append(f"{mname}.{n}" if mname else n)
    return tuple(found)


#: the random draws :class:`_Draws` reports (a dropout counts only in training mode; torch.nn.init's functions too)
RANDOM = frozenset({"rand", "randn", "randint", "rand_like", "randn_like", "randint_like", "randperm", "normal",
                    "bernoulli", "multinomial", "poisson", "normal_", "uniform_", "bernoulli_", "random_",
                    "exponential_", "geometric_", "log_normal_", "cauchy_"})
_DROPOUTS = frozenset({"dropout", "alpha_dropout", "feature_alpha_dropout", "dropout1d", "dropout2d", "dropout3d"})


#: how a forbidden name may start, and what it stands for
ALIASES = {"F.": "torch.nn.functional.", "nn.": "torch.nn.", "torch.": "torch."}


def forbidden(names) -> tuple[str, ...]:
    """The names of torch functions or modules a course forbids (``nn.MultiheadAttention``,
    ``F.scaled_dot_product_attention``, ``torch.bmm``), checked: a ValueError naming one torch does not have."""
    out = []
    for name in [n.strip() for n in names if n.strip()]:
        try:
            resolve(name)
        except (AttributeError, ValueError):
            raise ValueError(f"--forbid {name!r}: torch has no such function or module; name them as nn.X, F.X or "
                             "torch.X, e.g. --forbid nn.MultiheadAttention,F.scaled_dot_product_attention") from None
        out.append(name)
    return tuple(out)


def resolve(name: str):
    """The torch object ``name`` stands for (:data:`ALIASES`)."""
    import importlib

    prefix = next((p for p in ALIASES if name.startswith(p)), None)
    if prefix is None:
        raise ValueError(name)
    parts = name[len(prefix):].split(".")
    if not all(p.isidentifier() for p in parts):
        raise ValueError(name)
    space = ALIASES[prefix].rstrip(".")
    obj = _TORCH[space].get(parts[0]) if space in _TORCH else None  # as it was before any submission ran
    if obj is None:
        obj = getattr(importlib.import_module(space), parts[0])
    for part in parts[1:]:
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(name)
    return obj


#: torch's namespaces as this module found them, before any submission is imported (the sandbox imports this module
#: first): a submission that rebinds F.scaled_dot_product_attention to a wrapper of its own still calls this one
_TORCH = {"torch": dict(vars(torch)), "torch.nn": dict(vars(nn)), "torch.nn.functional": dict(vars(F))}


class _Draws(TorchFunctionMode):
    """The random draws made while it is active, by name: torch's random functions, torch.nn.init's (a layer built
    inside forward), and a dropout asked to drop (``training=True``), as "dropout"; and of ``forbid`` (name ->
    function), the functions called."""

    def __init__(self, forbid: dict | None = None):
        super().__init__()
        self.names: list[str] = []
        self.forbid = {id(f): n for n, f in (forbid or {}).items()}
        self.called: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if id(func) in self.forbid:
            self.called.append(self.forbid[id(func)])
        name = getattr(func, "__name__", "")
        if name in _DROPOUTS:
            training = kwargs.get("training", kwargs.get("train", args[2] if len(args) > 2 else True))
            if training:
                self.names.append("dropout")
        elif name in RANDOM or getattr(func, "__module__", "") == "torch.nn.init":
            self.names.append(name)
        return func(*args, **kwargs)


def _changed(given, original) -> bool:
    """Whether the tensor the module was given (a copy of ``original``) no longer equals it (values or shape)."""
    if not isinstance(given, Tensor) or not isinstance(original, Tensor):
        return False
    if given.shape != original.shape or given.dtype != original.dtype:
        return True
    a, b = given.detach(), original.detach()
    if a.is_floating_point():
        return not torch.equal(a.nan_to_num(), b.nan_to_num()) or not torch.equal(a.isnan(), b.isnan())
    return not torch.equal(a, b)


class Pristine:
    """The module as it was built, copied before its first call (a lazy module: before the first call after the one
    that builds it); :meth:`fresh` gives a new copy of it for a call, so that no call reaches it."""

    def __init__(self):
        self._copy, self.why = None, ""

    def note(self, module: nn.Module) -> None:
        """Before each call of ``module``: copy it, the first time it is built."""
        if self._copy is not None or self.why:
            return
        if any(isinstance(p, nn.parameter.UninitializedParameter) for p in module.parameters()) or any(
                type(m).__module__.split(".")[0] == "keras" and getattr(m, "built", True) is False
                for m in module.modules()):
            return
        import copy

        try:
            self._copy = copy.deepcopy(module)
        except Exception as e:  # noqa: BLE001 - the learner's module may hold what cannot be copied
            self.why = f"the module cannot be copied ({type(e).__name__}: {e})"

    def fresh(self) -> nn.Module:
        import copy

        if self._copy is None:
            raise RuntimeError(self.why or "no copy of the module as built")
        return copy.deepcopy(self._copy)


def _hook(module: nn.Module, probe: Probe, records: dict, order: list, handles: list) -> None:
    """Forward hooks on the layers ``probe.record`` names (their (input, output) appended to ``records``) or
    ``probe.replace`` names (their output replaced), and with ``probe.order`` pre-hooks on the Linear-like layers
    (their names appended to ``order`` as they run); each handle appended to ``handles``."""
    replace = dict(probe.replace or {})

    def observe(name):
        def hook(m, args, out):
            if name in records:
                x = args[0] if args and isinstance(args[0], Tensor) else None
                records[name].append((x, out if isinstance(out, Tensor) else None))
            if name in replace and isinstance(out, Tensor):
                return replace[name].to(out.dtype)
            return None
        return hook

    for name in {*records, *replace}:
        handles.append(module.get_submodule(name).register_forward_hook(observe(name)))
    if probe.order:
        for name, m in module.named_modules():
            if linear_like(m) is not None or isinstance(m, nn.Linear):
                handles.append(m.register_forward_pre_hook(lambda m, a, name=name: order.append(name)))


def _copies(probe: Probe, grad: bool) -> tuple:
    """(q, k, v, mask) copied for one call (one tensor staying one): a module that writes into its inputs or its
    mask (mask.unsqueeze_(1), q /= ...) changes no probe; :func:`_changed` tells the call it did."""
    q = probe.q.clone().requires_grad_(grad)
    k = q if probe.same or probe.k is probe.q else probe.k.clone().requires_grad_(grad)
    v = q if probe.same or probe.v is probe.q else k if probe.v is probe.k else probe.v.clone().requires_grad_(grad)
    return q, k, v, probe.mask.clone() if isinstance(probe.mask, Tensor) else probe.mask


def _watcher(probe: Probe, handles: list) -> _Draws | None:
    """What watches a call that asks for it (``probe.watch``, ``probe.forbid``): the function mode, and a global
    forward pre-hook (added to ``handles``) for a forbidden module class; None where nothing is asked."""
    banned = {n: resolve(n) for n in probe.forbid}
    if not (probe.watch or banned):
        return None
    draws = _Draws({n: f for n, f in banned.items() if not isinstance(f, type)})
    classes = [(n, c) for n, c in banned.items() if isinstance(c, type)]
    if classes:  # a forbidden module seen when its forward runs
        handles.append(nn.modules.module.register_module_forward_pre_hook(
            lambda m, a: draws.called.extend(n for n, c in classes if isinstance(m, c))))
    return draws


def run(module: nn.Module, call: Callable, probe: Probe, pristine: Pristine | None = None) -> Reply:
    """Call ``module`` through ``call`` as ``probe`` asks (no grad unless a cotangent is given), with
    forward hooks only on the layers named in ``probe.record`` / ``probe.replace`` (and pre-hooks on the
    Linear-like layers for ``order``); every hook is removed afterwards. ``probe.fresh``: a new copy of the module
    as built (``pristine``) is called instead; ``probe.watch``: the random draws are reported."""
    if pristine is not None:
        pristine.note(module)
    if probe.fresh:
        try:
            module = (pristine or Pristine()).fresh()
        except RuntimeError as e:
            return Reply(None, error=f"{NO_FRESH}: {e}")
    records: dict[str, list] = {n: [] for n in probe.record}
    order: list[str] = []
    handles: list = []
    try:
        _hook(module, probe, records, order, handles)
        grad = probe.cotangent is not None
        q, k, v, mask = _copies(probe, grad)
        if grad:
            for p in module.parameters():
                p.grad = None
        draws = _watcher(probe, handles)
        try:
            with torch.set_grad_enabled(grad):
                with draws if draws is not None else contextlib.nullcontext():
                    got = call(module, q, k, v, mask)
                out, weights, picked = _output(got, q, k.shape[1])
                grads = {}
                if grad and out is not None and out.shape == probe.cotangent.shape:
                    (out * probe.cotangent.to(out.dtype)).sum().backward()
                    grads = {"q": q.grad} if probe.same else {"q": q.grad, "k": k.grad, "v": v.grad}
                    grads |= {f"param.{n}": p.grad for n, p in module.named_parameters(remove_duplicate=False)
                              if p.grad is not None}  # every name of a shared Parameter (Keras lists its weights twice)
        except Exception as e:  # noqa: BLE001 - the learner's module: reported, never raised here
            return Reply(None, error=f"{type(e).__name__}: {e}")
        kept = _kept(module, (q.shape[1], k.shape[1])) if probe.kept else ()
        recs = {n: [(None if x is None else x.detach(), None if y is None else y.detach()) for x, y in lst]
                for n, lst in records.items()}
        changed = tuple(n for n, given, original in (("q", q, probe.q), ("k", k, probe.k), ("v", v, probe.v),
                                                      ("mask", mask, probe.mask))
                        if not (n != "q" and given is q) and _changed(given, original))  # the caller's, in the probe
        return Reply(None if out is None else out.detach(), None if weights is None else weights.detach(), None,
                     recs, {n: g.detach() for n, g in grads.items() if g is not None}, tuple(order), kept, changed,
                     tuple(draws.names) if draws is not None else (), picked,
                     tuple(dict.fromkeys(draws.called)) if draws is not None else ())
    finally:
        for h in handles:
            h.remove()
        if probe.cotangent is not None:
            for p in module.parameters():
                p.grad = None


class _Kept:
    """Everything of the user's a check could change, put back by :meth:`restore`: training flags,
    gradients, parameters and buffers, the random generators."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.training = [(m, m.training) for m in module.modules()]
        self.grads = [(p, p.grad) for p in module.parameters()]
        self.state = {k: t.detach().clone() for k, t in module.state_dict(keep_vars=True).items()
                      if isinstance(t, Tensor) and not isinstance(t, nn.parameter.UninitializedParameter)}
        self.rng = torch.get_rng_state(), random.getstate()
        import numpy as np

        self.np = np.random.get_state()

    def restore(self) -> None:
        for m, t in self.training:
            m.training = t
        for p, gr in self.grads:
            p.grad = gr
        with torch.no_grad():
            for k, t in self.module.state_dict(keep_vars=True).items():
                if k in self.state and isinstance(t, Tensor) and not torch.equal(t, self.state[k]):
                    t.copy_(self.state[k])
        torch.set_rng_state(self.rng[0])
        random.setstate(self.rng[1])
        import numpy as np

        np.random.set_state(self.np)


class LocalSubject:
    """A module in this process (your own, passed to :func:`multihead.check`), in eval mode while it is
    graded; :meth:`close` puts back everything a check could change."""

    def __init__(self, module: nn.Module, call):
        self.module, self._call = module, caller(call)
        self._kept = _Kept(module)
        module.eval()
        self._pristine = Pristine()

    def describe(self) -> Description:
        return describe(self.module)

    def call(self, probe: Probe) -> Reply:
        return run(self.module, self._call, probe, self._pristine)

    def close(self) -> None:
        self._kept.restore()
