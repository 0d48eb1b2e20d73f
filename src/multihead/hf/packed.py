"""Padding-free transformers models: ``multihead.hf.attach(model, packed=True)``.

A padded batch (B, L) with an ``attention_mask`` runs as transformers runs it up to the first
layer of the model's layer stack (embeddings, position embeddings, masks). There the hidden
states are unpadded once, (B, L, E) -> (1, N, E) with N the real tokens; every layer runs on
the N tokens (attention through :func:`multihead.core.varlen.attention_varlen`, told where each
sequence starts by transformers' own packed-sequence arguments ``cu_seq_lens_q/k`` and
``max_length_q/k``; MLPs and norms on N rows instead of B·L); the last layer's output is
padded back to (B, L, E), zeros at padded positions, and the rest of the model (final norm,
pooler, heads) runs as before. Real tokens get what the padded model gives them (tested
within 1e-5); padded positions hold what the layers after the stack make of zeros.

Nothing here is a guess: the layer stack is the ``nn.ModuleList`` whose children hold every
attention module; its layers must take transformers' keyword arguments (``**kwargs``); and
:func:`enable` runs the model once padded and once packed on a batch with padding and
compares every real token, naming the first module whose output differs (a layer that is not
per-token outside attention) before the model is changed. A call that asks for something the
packed path cannot give (hidden states or attentions of every layer, a cache, ``capture``)
runs padded, unchanged.

The hooks are module-level classes holding no tensors between calls: a packed model pickles,
deep-copies and ``state_dict``s as before.
"""

from __future__ import annotations

import contextlib
import functools
import inspect

import torch
from torch import Tensor, nn

__all__ = ["disable", "enable", "is_packed"]

KEY = "multihead_packing"


class _Call:
    """What one padded call looks like packed: idx (N,) the real tokens' flat positions in B·L,
    cu (B+1,) int32 cumulative lengths, the longest length, B and L."""

    __slots__ = ("B", "L", "cu", "idx", "longest")

    def __init__(self, keep: Tensor):
        self.B, self.L = keep.shape
        lens = keep.sum(1)  # (B,)
        self.idx = keep.reshape(-1).nonzero().squeeze(1)  # (N,)
        self.cu = torch.zeros(self.B + 1, dtype=torch.int32, device=keep.device)
        self.cu[1:] = lens.cumsum(0)
        self.longest = int(lens.max())

    def pack(self, t: Tensor) -> Tensor:
        """(B or 1, L, ...) -> (1, N, ...)."""
        t = t.expand(self.B, *t.shape[1:])  # (1, L, ...) (shared positions) -> (B, L, ...)
        return t.reshape(self.B * self.L, *t.shape[2:])[self.idx][None]  # (B·L, ...) -> (1, N, ...)

    def unpack(self, t: Tensor) -> Tensor:
        """(1, N, ...) -> (B, L, ...), zeros at padded positions."""
        out = t.new_zeros(self.B * self.L, *t.shape[2:])  # (B·L, ...)
        out[self.idx] = t[0]
        return out.view(self.B, self.L, *t.shape[2:])  # (B·L, ...) -> (B, L, ...)

    def packs(self, t) -> bool:
        return isinstance(t, Tensor) and t.dim() >= 2 and t.shape[0] in (1, self.B) and t.shape[1] == self.L


class Packing:
    """The packing state of one model: where its stack is, and (during a call only) the call's plan."""

    def __init__(self, stack: str):
        self.stack = stack  # the layer stack's qualified name
        self.enabled = True
        self.causal = False  # any causal attention module (then a call that makes a cache runs padded)
        self.call: _Call | None = None
        self.attention: list[nn.Module] = []  # set by enable(); not pickled twice (modules are shared)

    def __getstate__(self):
        return {**self.__dict__, "call": None}


def _kwargs_of(fn) -> dict[str, inspect.Parameter]:
    func = getattr(fn, "__func__", None)
    return dict(_parameters(func, bound=True) if func is not None else _parameters(fn, bound=False))


@functools.lru_cache(maxsize=64)
def _parameters(func, *, bound: bool) -> tuple:
    """A function's (name, parameter) pairs, read once per function (the base model's ``forward``
    signature is read on every call); ``bound``: as a bound method's (``self`` taken, as inspect does)."""
    params = tuple(inspect.signature(func).parameters.items())
    if bound and params and params[0][1].kind in (inspect.Parameter.POSITIONAL_ONLY,
                                                  inspect.Parameter.POSITIONAL_OR_KEYWORD):
        params = params[1:]
    return params


class _Start:
    """Forward pre-hook on the base model: decides whether this call runs packed."""

    def __init__(self, packing: Packing):
        self.packing = packing

    def __call__(self, module, args, kwargs):
        p = self.packing
        p.call = None
        if not p.enabled:
            return None
        params = list(_kwargs_of(module.forward))
        bound = dict(zip(params, args, strict=False)) | kwargs
        mask = bound.get("attention_mask")  # (B, L), as the base model receives it
        if not isinstance(mask, Tensor) or mask.dim() != 2 or mask.device.type == "meta":
            return None  # no padding mask, or no values to pack by (the meta device): run padded
        if mask.dtype.is_floating_point and not ((mask == 0) | (mask == 1)).all():
            return None  # not a 0/1 mask: nothing to drop
        keep = mask.bool()
        if bool(keep.all()):
            return None
        cfg = getattr(module, "config", None)
        asks = [bound.get(k, getattr(cfg, k, False)) for k in ("output_hidden_states", "output_attentions")]
        # a decoder's cache is laid out per batch row: pack only a call that makes none
        cache = bound.get("past_key_values") is not None or p.causal and bound.get(
            "use_cache", getattr(cfg, "use_cache", False)) is not False
        observed = any(m.attention_hooks.observers for m in p.attention)
        if any(asks) or cache or observed:
            return None  # these need every padded position (or a cache laid out per batch row): run padded
        p.call = _Call(keep)
        return None


class _End:
    """Forward hook on the base model: the call's plan is dropped."""

    def __init__(self, packing: Packing):
        self.packing = packing

    def __call__(self, module, args, output):
        self.packing.call = None


class _Layer:
    """Forward pre-hook on every layer of the stack: the first packs the hidden states; each gets
    no padding mask (the sequences are apart), its per-position tensors packed, and the
    packed-sequence arguments."""

    def __init__(self, packing: Packing, first: bool, params: list[str]):
        self.packing, self.first, self.params = packing, first, params

    def __call__(self, module, args, kwargs):
        c = self.packing.call
        if c is None:
            return None
        bound = dict(zip(self.params, args, strict=False)) | kwargs
        new = {}
        for name, val in bound.items():
            if name == self.params[0]:
                new[name] = c.pack(val) if self.first else val
            elif "mask" in name and (val is None or isinstance(val, Tensor)):
                new[name] = None  # the padding lives in cu_seq_lens now
            elif c.packs(val):
                new[name] = c.pack(val)
            elif isinstance(val, tuple) and val and all(c.packs(v) for v in val):
                new[name] = tuple(c.pack(v) for v in val)  # (cos, sin) position embeddings
            else:
                new[name] = val
        new.update(cu_seq_lens_q=c.cu, cu_seq_lens_k=c.cu, max_length_q=c.longest, max_length_k=c.longest)
        return (), new


class _Last:
    """Forward hook on the last layer: the hidden states padded back to (B, L, E)."""

    def __init__(self, packing: Packing):
        self.packing = packing

    def __call__(self, module, args, output):
        c = self.packing.call
        if c is None:
            return None
        if isinstance(output, Tensor):
            return c.unpack(output)
        if isinstance(output, tuple) and output and isinstance(output[0], Tensor):
            return (c.unpack(output[0]), *output[1:])
        raise TypeError(f"{type(module).__name__} returned {type(output).__name__}; the packed path pads back a "
                        "tensor or a tuple whose first item is the hidden states.")


def _stack(model: nn.Module, attention: dict[str, nn.Module]) -> tuple[str, nn.ModuleList]:
    """The ModuleList whose children hold every attention module, each child at least one."""
    names = list(attention)
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and len(m) and all(
                any(n.startswith(f"{name}.{i}.") for n in names) for i in range(len(m))) and all(
                any(n.startswith(f"{name}.{i}.") for i in range(len(m))) for n in names):
            return name, m
    raise ValueError(f"packed=True: {type(model).__name__} has no single layer stack (an nn.ModuleList whose "
                     f"layers hold every attention module {names[:4]}...); an encoder-decoder or a model with "
                     "attention outside its layers runs padded (attach without packed=True).")


def _base(model: nn.Module, stack: str) -> nn.Module:
    """The base model (transformers' ``base_model``): it holds the stack and its forward takes the
    (B, L) padding mask, before any 4-D mask is made from it."""
    base = getattr(model, "base_model", model)
    prefix = next((n for n, m in model.named_modules() if m is base), None)
    if prefix is None or not stack.startswith(f"{prefix}." if prefix else "") or "attention_mask" not in _kwargs_of(
            base.forward):
        raise ValueError(f"packed=True: {type(model).__name__}'s base model does not take an attention_mask above "
                         f"{stack}, so the padding cannot be read; this model runs padded.")
    return base


def is_packed(model: nn.Module) -> bool:
    return isinstance(model.__dict__.get(KEY), Packing)


def disable(model: nn.Module) -> None:
    """Remove the packing hooks (the model runs padded again)."""
    p = model.__dict__.pop(KEY, None)
    if p is None:
        return
    for m in model.modules():
        for hooks in (m._forward_pre_hooks, m._forward_hooks):
            for k in [k for k, h in hooks.items() if isinstance(h, _Start | _End | _Layer | _Last)]:
                del hooks[k]
                m._forward_pre_hooks_with_kwargs.pop(k, None)


def enable(model: nn.Module, attention: dict[str, nn.Module], example: dict) -> nn.Module:
    """Make ``model`` run padding-free (see the module's docstring); refuse, naming the module,
    when a packed run of a padded batch does not give the padded run's real tokens. ``example``:
    the model's keyword inputs (token ids; without an ``attention_mask`` a padded batch of three
    is made from their vocabulary)."""
    if is_packed(model):
        return model
    stack_name, stack = _stack(model, attention)
    base = _base(model, stack_name)
    for i, layer in enumerate(stack):
        ps = _kwargs_of(layer.forward)
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in ps.values()):
            raise ValueError(f"packed=True: {stack_name}.{i} ({type(layer).__name__}) takes no **kwargs, so the "
                             "packed-sequence arguments (cu_seq_lens_q/k) cannot reach its attention; this model "
                             "runs padded.")
    p = Packing(stack_name)
    p.attention = list(attention.values())
    p.causal = any(getattr(m, "is_causal", False) for m in p.attention)
    handles = [base.register_forward_pre_hook(_Start(p), with_kwargs=True), base.register_forward_hook(_End(p))]
    for i, layer in enumerate(stack):
        params = [q.name for q in _kwargs_of(layer.forward).values() if q.kind is not inspect.Parameter.VAR_KEYWORD]
        handles.append(layer.register_forward_pre_hook(_Layer(p, i == 0, params), with_kwargs=True))
    handles.append(stack[-1].register_forward_hook(_Last(p)))
    model.__dict__[KEY] = p
    try:
        _verify(model, p, example)
    except Exception:
        for h in handles:
            h.remove()
        del model.__dict__[KEY]
        raise
    return model


def _padded_example(example: dict) -> dict:
    x = dict(example)
    ids = x.get("input_ids")
    if not isinstance(ids, Tensor):
        raise ValueError("packed=True needs token inputs: give attach(..., example={'input_ids': ..., "
                         "'attention_mask': ...}).")
    if "attention_mask" not in x:
        g = torch.Generator().manual_seed(1)
        L = max(int(ids.shape[1]), 6)
        vocab = int(ids.max()) + 1
        ids = torch.randint(1, max(2, vocab), (3, L), generator=g).to(ids.device)
        am = torch.ones(3, L, dtype=torch.long, device=ids.device)
        am[1, L - 2:] = 0  # lengths L, L-2, 1: padding at the end (and a sequence of one token)
        am[2, 1:] = 0
        x["input_ids"], x["attention_mask"] = ids, am
        x = {k: v.expand(3, *v.shape[1:]) if isinstance(v, Tensor) and v.dim() and v.shape[0] == 1 else v
             for k, v in x.items()}  # the other (1, ...) inputs (decoder ids, pixels) -> (3, ...)
    return x


def _first(out):
    if isinstance(out, Tensor):
        return out
    if isinstance(out, tuple | list):
        return out[0]
    return out[0] if hasattr(out, "__getitem__") else out


@contextlib.contextmanager
def recording(model: nn.Module, prefix: str = ""):
    """Within the block, each module's (under ``prefix``) first output tensor is recorded as it
    finishes: yields ({name: tensor}, [names in completion order]); the hooks go at the end."""
    rec, order = {}, []

    def hook(name):
        def f(mod, args, out):
            o = _first(out)
            if isinstance(o, Tensor):
                rec[name] = o.detach()
                order.append(name)
        return f

    hs = [m.register_forward_hook(hook(n)) for n, m in model.named_modules() if n and n.startswith(prefix)]
    try:
        yield rec, order
    finally:
        for h in hs:
            h.remove()


def _verify(model: nn.Module, p: Packing, example: dict) -> None:
    x = _padded_example(example)
    keep = x["attention_mask"].bool()  # (B, L)
    was = model.training
    model.eval()
    try:
        outs, ran = {}, {}
        for packed in (False, True):
            p.enabled = packed
            with recording(model, p.stack + ".") as (rec, order):
                try:
                    with torch.no_grad():
                        outs[packed] = _first(model(**x)).detach()
                except Exception as e:
                    if not packed:
                        raise
                    last = f" (the last module to finish: {order[-1]})" if order else ""
                    raise ValueError(f"packed=True: {type(model).__name__} cannot run on the real tokens only: the "
                                     f"packed probe call raised {type(e).__name__}: {str(e)[:300]}{last}. This "
                                     "model runs padded: attach it without packed=True.") from e
            ran[packed] = (rec, order)
    finally:
        p.enabled = True
        model.train(was)
    a, b = outs[False], outs[True]
    scale = float(a[keep].abs().max()) or 1.0
    if a.shape == b.shape and float((a[keep] - b[keep]).abs().max()) <= 1e-5 * scale:
        return
    call = _Call(keep)
    pad, _ = ran[False]
    pk, order = ran[True]
    for name in order:  # completion order: a module's parts finish before it does
        u, v = pad.get(name), pk[name]
        if u is None or not call.packs(u) or v.shape[:2] != (1, len(call.idx)):
            continue
        ref = call.pack(u)
        if ref.shape == v.shape and float((ref - v).abs().max()) > 1e-5 * (float(ref.abs().max()) or 1.0):
            mod = model.get_submodule(name)
            raise ValueError(
                f"packed=True: {name} ({type(mod).__name__}) gives other outputs on the real tokens once the padding "
                "is removed: its output at a token depends on other positions outside attention (or it does not "
                "pass the packed-sequence arguments cu_seq_lens_q/k on to the attention function). This model runs "
                "padded: attach it without packed=True.")
    raise ValueError(f"packed=True: {type(model).__name__}'s output on the real tokens differs once the padding is "
                     f"removed (max difference {float((a[keep] - b[keep]).abs().max()):.2e}), after the layer stack "
                     f"{p.stack}; this model runs padded: attach it without packed=True.")
