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
packed path cannot give (hidden states or attentions of every layer, a cache, ``capture``),
or that has no real token to pack, runs padded, unchanged.

The hooks are module-level classes holding no tensors between calls: a packed model pickles,
deep-copies and ``state_dict``s as before. They run when the model is called as a module; code that calls
``model.forward(...)`` itself (sentence-transformers 6 does) skips module hooks, so there the model runs
padded (exact; :func:`multihead.hf.serve` gives a padding-free encoder that needs no hooks).
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch import Tensor, nn

from multihead.core.padding import Unpadding
from multihead.hf import probe

__all__ = ["PackedModel", "disable", "enable", "is_packed"]

KEY = "multihead_packing"


def _per_token(u: Unpadding, t) -> bool:
    """Whether ``t`` is (B or 1, L, ...): a per-position tensor of the padded call ``u`` describes."""
    return isinstance(t, Tensor) and t.dim() >= 2 and t.shape[0] in (1, u.B) and t.shape[1] == u.L


class PackedModel:
    """The packing state of one model: where its stack is, and (during a call only) the call's plan."""

    def __init__(self, stack: str):
        self.stack = stack  # the layer stack's qualified name
        self.enabled = True
        self.causal = False  # any causal attention module (then a call that makes a cache runs padded)
        self.call: Unpadding | None = None  # the real tokens of the call running
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

    def __init__(self, packing: PackedModel):
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
        if int(keep.sum()) in (0, keep.numel()):  # one reduction a call
            return None  # no padding to drop, or no real token to pack (run padded: the model's own answer)
        cfg = getattr(module, "config", None)
        asks = [bound.get(k, getattr(cfg, k, False)) for k in ("output_hidden_states", "output_attentions")]
        # a decoder's cache is laid out per batch row: pack only a call that makes none
        cache = bound.get("past_key_values") is not None or p.causal and bound.get(
            "use_cache", getattr(cfg, "use_cache", False)) is not False
        observed = any(m.attention_hooks.observers or m.attention_hooks.inputs for m in p.attention)
        if any(asks) or cache or observed:
            return None  # these need every padded position (or a cache laid out per batch row): run padded
        p.call = Unpadding.of(keep)
        return None


class _End:
    """Forward hook on the base model: the call's plan is dropped."""

    def __init__(self, packing: PackedModel):
        self.packing = packing

    def __call__(self, module, args, output):
        self.packing.call = None


class _LayerHook:
    """Forward pre-hook on every layer of the stack: the first packs the hidden states; each gets
    no padding mask (the sequences are apart), its per-position tensors packed, and the
    packed-sequence arguments."""

    def __init__(self, packing: PackedModel, first: bool, params: list[str]):
        self.packing, self.first, self.params = packing, first, params

    def __call__(self, module, args, kwargs):
        c = self.packing.call
        if c is None:
            return None
        bound = dict(zip(self.params, args, strict=False)) | kwargs
        new = {}
        for name, val in bound.items():
            if name == self.params[0]:
                new[name] = c.pack(val)[None] if self.first else val  # (B, L, E) -> (1, N, E)
            elif "mask" in name and (val is None or isinstance(val, Tensor)):
                new[name] = None  # the padding lives in cu_seq_lens now
            elif _per_token(c, val):
                new[name] = c.pack(val)[None]  # (B or 1, L, ...) -> (1, N, ...)
            elif isinstance(val, tuple) and val and all(_per_token(c, v) for v in val):
                new[name] = tuple(c.pack(v)[None] for v in val)  # (cos, sin) position embeddings
            else:
                new[name] = val
        new.update(cu_seq_lens_q=c.cu_seqlens, cu_seq_lens_k=c.cu_seqlens, max_length_q=c.max_seqlen,
                   max_length_k=c.max_seqlen)
        return (), new


class _Last:
    """Forward hook on the last layer: the hidden states padded back to (B, L, E)."""

    def __init__(self, packing: PackedModel):
        self.packing = packing

    def __call__(self, module, args, output):
        c = self.packing.call
        if c is None:
            return None
        if isinstance(output, Tensor):
            return c.unpack(output[0])  # (1, N, E) -> (B, L, E)
        if isinstance(output, tuple) and output and isinstance(output[0], Tensor):
            return (c.unpack(output[0][0]), *output[1:])  # (1, N, E) -> (B, L, E)
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
    return isinstance(model.__dict__.get(KEY), PackedModel)


def disable(model: nn.Module) -> None:
    """Remove the packing hooks (the model runs padded again)."""
    p = model.__dict__.pop(KEY, None)
    if p is None:
        return
    for m in model.modules():
        for hooks in (m._forward_pre_hooks, m._forward_hooks):
            for k in [k for k, h in hooks.items() if isinstance(h, _Start | _End | _LayerHook | _Last)]:
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
    p = PackedModel(stack_name)
    p.attention = list(attention.values())
    p.causal = any(getattr(m, "is_causal", False) for m in p.attention)
    handles = [base.register_forward_pre_hook(_Start(p), with_kwargs=True),
               base.register_forward_hook(_End(p), always_call=True)]  # a call that raises leaves no plan behind
    for i, layer in enumerate(stack):
        params = [q.name for q in _kwargs_of(layer.forward).values() if q.kind is not inspect.Parameter.VAR_KEYWORD]
        handles.append(layer.register_forward_pre_hook(_LayerHook(p, i == 0, params), with_kwargs=True))
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


def _verify(model: nn.Module, p: PackedModel, example: dict) -> None:
    """The packed run of a padded probe batch against the padded run, on the real tokens
    (:mod:`multihead.hf.probe`'s tolerance); a difference names the first module whose packed output
    is not its padded output's real tokens."""
    x = probe.padded_example(example)
    keep = x["attention_mask"].bool()  # (B, L)
    was = model.training
    model.eval()
    try:
        p.enabled = False
        padded = probe.run(model, x, p.stack + ".")
        p.enabled = True
        with probe.recording(model, p.stack + ".") as (rec, order):
            try:
                with torch.no_grad():
                    packed = probe.Run(probe.first_output(model(**x)).detach(), rec, order)
            except Exception as e:
                last = f" (the last module to finish: {order[-1]})" if order else ""
                raise ValueError(f"packed=True: {type(model).__name__} cannot run on the real tokens only: the "
                                 f"packed probe call raised {type(e).__name__}: {str(e)[:300]}{last}. This "
                                 "model runs padded: attach it without packed=True.") from e
    finally:
        p.enabled = True
        model.train(was)
    a, b = padded.output, packed.output
    if a.shape == b.shape and not probe.differs(a[keep], b[keep]):
        return
    u = Unpadding.of(keep)

    def real(t: Tensor) -> Tensor | None:  # a padded run's (B or 1, L, ...) -> (N, ...) its real tokens
        return u.pack(t) if _per_token(u, t) else None

    def tokens(t: Tensor) -> Tensor | None:  # a packed run's (1, N, ...) -> (N, ...)
        return t[0] if t.dim() >= 2 and t.shape[:2] == (1, len(u.indices)) else None

    name = probe.first_difference(padded, packed, real, tokens)
    if name is not None:
        raise ValueError(
            f"packed=True: {name} ({type(model.get_submodule(name)).__name__}) gives other outputs on the real tokens "
            "once the padding is removed: its output at a token depends on other positions outside attention (or it "
            "does not pass the packed-sequence arguments cu_seq_lens_q/k on to the attention function). This model "
            "runs padded: attach it without packed=True.")
    gap = f"max difference {float((a[keep] - b[keep]).abs().max()):.2e}" if a.shape == b.shape else \
        f"shape {tuple(b.shape)} != {tuple(a.shape)}"
    raise ValueError(f"packed=True: {type(model).__name__}'s output on the real tokens differs once the padding is "
                     f"removed ({gap}), after the layer stack {p.stack}; this model runs padded: attach it without "
                     "packed=True.")
