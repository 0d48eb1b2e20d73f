"""Attention seen where it is computed: the head tools on any model whose attention modules call
``torch.nn.functional.scaled_dot_product_attention`` (timm's ``Attention``, a user's own module,
the sdpa branch of a model that computes attention itself).

    found = multihead.heads.observe(model, example)      # {name: module}, from one probe call
    with multihead.capture(model) as cap:                # (B, H, Lq, Lk) per module, as SDPA weighed
        model(x)
    imp = heads.importance(model, batches, loss_fn)       # gates on each head's SDPA output

:func:`observe` runs the model once on ``example`` and finds the modules whose *own* forward
calls SDPA (the innermost module running at the call). Each gets a hook list
(:class:`multihead.layer.hooks.AttentionHooks`, its head count taken from the call) and a forward
pre-hook/hook pair: while something is registered on that list (``capture``, ``heads.gated``,
``heads.importance``), the module's forward runs inside a ``torch.overrides.TorchFunctionMode``
that hands each SDPA call's query and key to the observers -- the weights SDPA computed
implicitly: the same scale, mask, causal flag and GQA grouping, dropout off -- and passes its
output (B, H, Lq, Dv) through the transforms before the module merges the heads. With nothing
registered the module runs untouched (the pre-hook tests one list). :func:`unobserve` removes it all.

``torch.nn.MultiheadAttention`` (torchvision's ViT, open_clip, ``nn.TransformerEncoderLayer``) is seen
through ``F.multi_head_attention_forward``: while observed it runs torch.nn's slow path (any active
mode turns torch's fused fast path off, as the observation's forward pre-hook turns off
``nn.TransformerEncoderLayer``'s), computed as torch.nn computes it with one SDPA call for the heads.
Differences there: a query row with nothing to attend to gives zeros (torch.nn: NaN), and the weights
returned with ``need_weights=True`` are those before dropout. ``heads.prune`` puts a
:class:`multihead.layer.dropin.PrunedMultiheadAttention` (the same call and parameter names, fewer heads)
in its place.

Modules that compute attention by hand are seen where a *form* is registered for them (``FORMS``:
their forward rewritten with one SDPA call, the same arithmetic otherwise; :mod:`multihead.hf.forms`
registers Bloom's): :func:`observe` gives them their form and keeps it only if the model's output on the
example is unchanged. A module given a form keeps it after :func:`unobserve` (it computes what its class
computes, and a module cut by ``heads.prune`` needs it).

Refused with a clear error: a model none of whose modules calls SDPA in Python during the probe
(a fused kernel called from C++, attention written out by hand), an SDPA call whose query is not
(B, H, Lq, D), a ``multi_head_attention_forward`` call with ``static_k``/``static_v``.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from multihead import masks
from multihead.heads.layouts import candidates, mixing_norm, verify
from multihead.layer.hooks import AttentionHooks, Seen, hooked_modules

__all__ = ["observe", "observed", "on_call", "unobserve"]

SDPA = F.scaled_dot_product_attention
MHA = F.multi_head_attention_forward
_SIGNATURE = inspect.signature(lambda query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                               enable_gqa=False: None)
_MHA_SIGNATURE = inspect.signature(MHA)
_KEY = "multihead_sdpa_observer"  # the module's hook handles, in its __dict__
#: (give, take) pairs: ``give(module) -> bool`` gives a module that computes attention by hand its SDPA
#: form (True when it did), ``take(module)`` undoes it (``multihead.hf.forms`` registers Bloom's)
FORMS: list = []


class _Calls(TorchFunctionMode):
    """During a forward: each SDPA or ``F.multi_head_attention_forward`` call goes to
    ``on_call(module, func, bound arguments)`` with the innermost module on ``stack`` (every argument
    of the latter bound, defaults included); every other function runs as it is."""

    def __init__(self, stack: list, on_call):
        super().__init__()
        self.stack, self.on_call = stack, on_call

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is SDPA and self.stack:
            return self.on_call(self.stack[-1], func, _SIGNATURE.bind(*args, **kwargs).arguments)
        if func is MHA and self.stack:
            bound = _MHA_SIGNATURE.bind(*args, **kwargs)
            bound.apply_defaults()
            return self.on_call(self.stack[-1], func, bound.arguments)
        return func(*args, **kwargs)


def _mask(a: dict, Lq: int, Lk: int) -> masks.Mask | None:
    """SDPA's mask as multihead's: ``attn_mask`` bool (True = may attend) or float (added to the
    scores), broadcastable to (B, H, Lq, Lk); ``is_causal``: top-left causal (SDPA's alignment)."""
    m = masks.from_sdpa(a.get("attn_mask"))
    if a.get("is_causal"):
        m = masks.Causal() if m is None else m & masks.Causal()
    return m


def _live(mask: masks.Mask | None, B: int, H: int, Lq: int, Lk: int, device) -> Tensor | None:
    """(B, Lq) True = a query row with something to attend to; None = every row."""
    if mask is None:
        return None
    keep = mask.keep(B, H, Lq, Lk, device).expand(B, H, Lq, Lk).any(1).any(-1)  # (B, H, Lq, Lk) -> (B, Lq)
    return None if bool(keep.all()) else keep


def _observed_call(module: nn.Module, func, a: dict):
    """One observed call: SDPA's (:func:`_through_hooks`) or torch.nn's (:func:`_mha_through_hooks`)."""
    return _through_hooks(module, a, func) if func is SDPA else _mha_through_hooks(module, a)


def _sdpa_mask(mask: masks.Mask, B: int, H: int, Lq: int, Lk: int, q: Tensor) -> Tensor:
    """A multihead mask as SDPA's ``attn_mask``: bool (True = may attend), or the float bias with -inf
    where nothing may be attended, broadcastable to (B, H, Lq, Lk)."""
    keep = mask.keep(B, H, Lq, Lk, q.device)
    bias = mask.bias(B, H, Lq, Lk, q.device, q.dtype)
    return keep if bias is None else bias.masked_fill(~keep, float("-inf"))


def _mha_through_hooks(module: nn.Module, a: dict):
    """One observed ``F.multi_head_attention_forward`` call (torch.nn.MultiheadAttention's slow path, which
    the observation takes: a mode is active): computed as torch.nn computes it, with SDPA per head
    (:func:`_through_hooks`: observers and transforms) -> (attn_output, weights or None) in torch.nn's
    layout ((Lq, B, E) or unbatched (Lq, E)). The returned weights are the softmax weights before dropout."""
    from multihead.core import validation
    from multihead.layer.dropin import batch_first, heads_like_torch, layout_back, torch_weights, torch_weights_out

    if a["static_k"] is not None or a["static_v"] is not None:
        raise ValueError(f"{type(module).__name__} calls multi_head_attention_forward with static_k / static_v; "
                         "multihead observes calls that project their own keys and values only.")
    H = a["num_heads"]
    if a["use_separate_proj_weight"]:
        w_q, w_k, w_v = a["q_proj_weight"], a["k_proj_weight"], a["v_proj_weight"]
    else:
        w_q, w_k, w_v = a["in_proj_weight"].chunk(3)  # (3 H D, E) -> 3 x (H D, E)
    p = torch_weights(H, w_q, w_k, w_v, a["in_proj_bias"], bias_k=a["bias_k"], bias_v=a["bias_v"],
                      add_zero_attn=a["add_zero_attn"])
    query, key, value, kpm, attn_mask = a["query"], a["key"], a["value"], a["key_padding_mask"], a["attn_mask"]
    batched = validation.torch_mha_inputs(query, key, value, kpm, attn_mask, num_heads=H,
                                          embed_dim=a["embed_dim_to_check"], kdim=w_k.shape[1], vdim=w_v.shape[1],
                                          batch_first=False, is_causal=a["is_causal"])
    query, key, value, kpm = batch_first(query, key, value, kpm, batched=batched, is_batch_first=False)
    dropout = a["dropout_p"] if a["training"] else 0.0

    def attend(q, k, v, mask):  # (B, Lq, H, D), (B, Lk, H, D), (B, Lk, H, D) -> (B, Lq, H, D)
        B, Lq, Lk = q.shape[0], q.shape[1], k.shape[1]
        sdpa = {"query": q.transpose(1, 2), "key": k.transpose(1, 2), "value": v.transpose(1, 2),  # (B, H, L, D)
                "attn_mask": None if mask is None else _sdpa_mask(mask, B, H, Lq, Lk, q), "dropout_p": dropout}
        return _through_hooks(module, sdpa, SDPA).transpose(1, 2)  # (B, H, Lq, D) -> (B, Lq, H, D)

    merged, q, k, mask = heads_like_torch(p, query, key, value, key_padding_mask=kpm, attn_mask=attn_mask,
                                          is_causal=a["is_causal"], attend=attend)
    out = F.linear(merged, a["out_proj_weight"], a["out_proj_bias"])  # (B, Lq, H D) -> (B, Lq, E)
    weights = torch_weights_out(q, k, mask, a["need_weights"], a["average_attn_weights"])
    return layout_back(out, weights, batched=batched, is_batch_first=False)


def _through_hooks(module: nn.Module, a: dict, sdpa) -> Tensor:
    """One observed SDPA call: observers see (q, k, mask, scale), transforms the per-head output."""
    q, k = a["query"], a["key"]
    if q.dim() != 4:
        raise ValueError(f"{type(module).__name__} calls scaled_dot_product_attention with query "
                         f"{tuple(q.shape)}; multihead observes (B, H, Lq, D) calls only.")
    hooks: AttentionHooks = module.__dict__["attention_hooks"]
    B, H, Lq, _ = q.shape
    Lk = k.shape[-2]
    hooks.num_heads = H
    hooks.seen = Seen(H, k.shape[-3], q.shape[-1], a["value"].shape[-1])
    mask = _mask(a, Lq, Lk)
    if hooks.inputs:
        q, k, v = hooks.transform_inputs(module, q, k, a["value"])
        a = {**a, "query": q, "key": k, "value": v}
    if hooks.observers:
        hooks.observe(module, q, k, mask, a.get("scale"))
    out = sdpa(**a)  # (B, H, Lq, Dv), untouched
    if hooks.transforms:
        o = out.transpose(1, 2)  # (B, H, Lq, Dv) -> (B, Lq, H, Dv)
        o = hooks.transform(module, o, _live(mask, B, H, Lq, Lk, q.device))
        out = o.transpose(1, 2)  # (B, Lq, H, Dv) -> (B, H, Lq, Dv)
    return out


class _Enter:
    """Forward pre-hook of an observed module: enter its mode when something is registered."""

    def __init__(self, module: nn.Module):
        self.stack, self.modes = [module], []

    def __call__(self, module, args):
        if module.__dict__["attention_hooks"]:
            mode = _Calls(self.stack, _observed_call)
            mode.__enter__()
            self.modes.append(mode)
        else:
            self.modes.append(None)


class _Exit:
    """Forward hook (always called, also on an exception) leaving the mode :class:`_Enter` entered."""

    def __init__(self, enter: _Enter):
        self.enter = enter

    def __call__(self, module, args, output):
        mode = self.enter.modes.pop() if self.enter.modes else None
        if mode is not None:
            mode.__exit__(None, None, None)


class _Found(NamedTuple):
    """A module whose own forward called SDPA in the probe: its first call's inputs (copied) and
    the call's (H, Hkv, D, Dv)."""

    module: nn.Module
    call: tuple  # (args, kwargs)
    seen: Seen | None  # None: the query was not (B, H, Lq, D)


def _seen(func, a: dict) -> Seen | None:
    """(H, Hkv, D, Dv) of an SDPA call (None: its query is not (B, H, Lq, D)) or of torch.nn's call."""
    if func is MHA:
        H = a["num_heads"]
        w = a["q_proj_weight"] if a["use_separate_proj_weight"] else a["in_proj_weight"]
        D = w.shape[0] // (H if a["use_separate_proj_weight"] else 3 * H)  # (H D, E) or (3 H D, E)
        return Seen(H, H, D, D)
    q, k, v = a["query"], a["key"], a["value"]
    return Seen(q.shape[-3], k.shape[-3], q.shape[-1], v.shape[-1]) if q.dim() == 4 else None


def _call(model: nn.Module, example):
    if isinstance(example, dict):
        return model(**example)
    return model(*example) if isinstance(example, tuple) else model(example)


def _run(model: nn.Module, example) -> None:
    with torch.no_grad():
        _call(model, example)


def _probe(model: nn.Module, example) -> dict[str, _Found]:
    """Run ``model`` on ``example``: which modules' own forward calls SDPA (the innermost module
    running at the call), then, in a second call, their inputs as they arrive."""
    stack, found = [], {}
    names = {id(m): n for n, m in model.named_modules()}

    def record(module, func, a):
        name = names.get(id(module))
        hooks = module.__dict__.get("attention_hooks")  # None, or a module seen on a call (no layout): probed now
        if name is not None and name not in found and (hooks is None or hooks.layout_reason == _ON_CALL):
            found[name] = _Found(module, ((), {}), _seen(func, a))  # multihead's own modules (with hooks): seen
        return func(**a)

    def push(mod, args) -> None:
        stack.append(mod)

    def pop(mod, args, out) -> None:
        stack.pop()

    with _hooked(model, [(m, push, pop) for m in _python_modules(model)]), _Calls(stack, record):
        _run(model, example)
    if found:  # a second call records the found modules' inputs as they arrive (before a cache grows)
        by_id = {id(f.module): n for n, f in found.items()}

        def keep(mod, args, kwargs) -> None:
            n = by_id[id(mod)]
            if found[n].call == ((), {}):
                try:
                    found[n] = found[n]._replace(call=copy.deepcopy((args, kwargs)))
                except Exception:  # noqa: BLE001 - an input that does not copy: used as it is
                    found[n] = found[n]._replace(call=(args, kwargs))

        with _hooked(model, [(f.module, keep, None) for f in found.values()]):
            _run(model, example)
    return found


@contextlib.contextmanager
def _hooked(model: nn.Module, hooks: list):
    """Forward pre-hooks (with kwargs when they take three arguments) and always-called forward
    hooks on the given modules, the model in eval mode, for the block."""
    handles = []
    for m, pre, post in hooks:
        if pre is not None:
            handles.append(m.register_forward_pre_hook(pre, with_kwargs=len(inspect.signature(pre).parameters) == 3))
        if post is not None:
            handles.append(m.register_forward_hook(post, always_call=True))
    was = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was)
        for h in handles:
            h.remove()


def _derive(model: nn.Module, name: str, f: _Found) -> None:
    """The head layout of an observed module, proposed from its layers and verified on its probe
    call (cut = gate); without one it is seen and gated, not cut."""
    m, hooks = f.module, f.module.attention_hooks
    parent_name = name.rsplit(".", 1)[0] if "." in name else ""
    hooks.parent = model.get_submodule(parent_name) if name else None
    if hooks.parent is None:
        hooks.layout_reason = "the model itself calls SDPA (no parent to hold it)"
        return
    hooks.probe = f.call  # heads.prune verifies each cut on it
    if isinstance(m, nn.MultiheadAttention):  # torch.nn's layout is documented: cut by heads.prune's replacement
        if type(m).forward is not nn.MultiheadAttention.forward:
            hooks.layout_reason = (f"{type(m).__name__} overrides torch.nn.MultiheadAttention.forward (the pruned "
                                   "module would compute torch.nn's forward, not its own)")
        return
    lays = candidates(m, name, hooks.parent, parent_name, f.seen)
    reasons = []
    for lay in [] if isinstance(lays, str) else lays:
        try:
            why = verify(lay, m, f.call, f.seen)
        except Exception as e:  # noqa: BLE001 - the module's forward on its recorded inputs: say why
            why = f"its recorded call does not run again ({type(e).__name__}: {str(e)[:120]})"
        if why is None:
            hooks.layout, hooks.layout_reason = lay, None
            return
        reasons.append(f"{lay.family}: {why}")
    mixed = mixing_norm(m, f.seen.H, f.seen.Dv)  # the reason no layout verified, when its norm mixes the heads
    hooks.layout_reason = mixed or (lays if isinstance(lays, str) else "; ".join(reasons))


def _main_output(out) -> Tensor:
    """The first tensor of a model's output (a tensor, a tuple, or a transformers ModelOutput)."""
    while not isinstance(out, Tensor):
        out = out.to_tuple()[0] if hasattr(out, "to_tuple") else out[0]
    return out


def _give_forms(model: nn.Module, example) -> None:
    """Give the modules a registered form rewrites (``FORMS``) their SDPA form, and keep the forms only
    if the model runs on ``example`` with them and gives its own output (else take them back and refuse,
    naming the modules' classes)."""
    given = [(m, give, take) for m in model.modules() for give, take in FORMS if give(m)]
    if not given:
        return
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            try:
                formed, why = _main_output(_call(model, example)), None
            except Exception as e:  # noqa: BLE001 - a form that cannot run: taken back, and said
                formed, why = None, f"does not run on the example ({type(e).__name__}: {str(e)[:120]})"
            for m, _, take in given:
                take(m)
            plain = _main_output(_call(model, example))
    finally:
        model.train(was)
    if formed is not None:
        gap = float((formed.double() - plain.double()).abs().max()) if formed.shape == plain.shape else float("inf")
        if gap <= 1e-4 * (float(plain.abs().max()) + 1e-6):  # the rule layouts.verify cuts by
            for m, give, _ in given:
                give(m)
            return
        why = f"gives another output (max {gap:.3g} on the example)"
    kinds = sorted({type(m).__name__ for m, _, _ in given})
    raise ValueError(f"{type(model).__name__}: with {', '.join(kinds)} in their SDPA form the model {why}; multihead "
                     "leaves them as they are and cannot see their heads.")


def observe(model: nn.Module, example) -> dict[str, nn.Module]:
    """Find the modules of ``model`` that call SDPA (one probe call on ``example``: a tensor, a
    tuple of positional inputs or a dict of keyword inputs) and make their heads visible to
    ``capture``, ``heads.gated``, ``heads.importance`` and the heatmaps. Returns {name: module}.
    Calling it again on an observed model changes nothing."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"observe takes an nn.Module; got {type(model).__name__}.")
    _refuse_scripted(model, "see")
    _give_forms(model, example)
    found = _probe(model, example)
    if not found and hooked_modules(model):  # multihead's own modules (or an attached model): seen already
        return observed(model)
    if not found:
        raise ValueError(nothing_seen(model, "see", "during a forward pass on the example", example))
    for name, f in found.items():
        if f.seen is None:
            raise ValueError(f"{name} ({type(f.module).__name__}) calls scaled_dot_product_attention without a "
                             "(B, H, Lq, D) query; multihead observes per-head calls only.")
    for f in found.values():
        if "attention_hooks" not in f.module.__dict__:
            _install(f.module, f.seen)
    for name, f in found.items():
        _derive(model, name, f)
    return observed(model)


#: fused attention kernels a module may call from Python: the whole attention in C++, the heads out of reach
_FUSED_OPS = ("_native_multi_head_attention", "_transformer_encoder_layer_fwd", "_scaled_dot_product_flash_attention",
              "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
              "_fused_sdp_choice")


def _scripted(model: nn.Module) -> list[str]:
    """Names of TorchScript modules in ``model`` whose code calls SDPA or torch.nn's attention: their calls run in
    TorchScript, where no Python mode sees them."""
    out = []
    for name, m in model.named_modules():
        if isinstance(m, torch.jit.ScriptModule):
            try:
                code = m.code
            except (RuntimeError, AttributeError):  # a module with no forward of its own
                continue
            if any(s in code for s in ("scaled_dot_product_attention", "multi_head_attention_forward", *_FUSED_OPS)):
                out.append(f"{name or type(model).__name__} ({m.original_name}, TorchScript)")
    return out


def _refuse_scripted(model: nn.Module, verb: str) -> None:
    """A ValueError naming the TorchScript modules of ``model`` that compute attention (nothing Python sees)."""
    scripted = _scripted(model)
    if scripted:
        raise ValueError(f"{type(model).__name__}: {', '.join(scripted)}: attention computed in TorchScript, where "
                         f"Python cannot observe it; multihead cannot {verb} its heads (heads are seen on the module's "
                         "Python path: before torch.jit.script).")


def _python_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` that run Python forwards (TorchScript modules take no hooks)."""
    return [m for m in model.modules() if not isinstance(m, torch.jit.ScriptModule)]


def fused_calls(model: nn.Module, example) -> list[str]:
    """Modules of ``model`` that call a fused attention kernel (``torch._native_multi_head_attention`` and the
    like) in a forward on ``example``: "name (Class) calls op", one each."""
    stack, out = [], {}
    names = {id(m): n for n, m in model.named_modules()}

    class Ops(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            op = getattr(func, "__name__", "")
            if op in _FUSED_OPS and stack:
                m = stack[-1]
                out.setdefault(names.get(id(m)) or type(model).__name__, f"{type(m).__name__}) calls torch.{op}")
            return func(*args, **(kwargs or {}))

    def push(mod, args) -> None:
        stack.append(mod)

    def pop(mod, args, out) -> None:  # a forward hook returning something would replace the output
        stack.pop()

    with _hooked(model, [(m, push, pop) for m in _python_modules(model)]), Ops(), torch.no_grad():
        _call(model, example)
    return [f"{n} ({what}" for n, what in out.items()]


def _formable(model: nn.Module) -> set[str]:
    """The classes of ``model``'s modules a registered form would rewrite (each given and taken back at once)."""
    out = set()
    for m in model.modules():
        for give, take in FORMS:
            if give(m):
                take(m)
                out.add(type(m).__name__)
    return out


def nothing_seen(model: nn.Module, verb: str, when: str = "inside the block", example=None) -> str:
    """The refusal when no module of ``model`` could be observed: what computes its attention instead (TorchScript,
    a fused kernel, a class computing by hand) and the way out."""
    where = _scripted(model)
    if example is not None:
        where += fused_calls(model, example)
    attn = sorted({type(m).__name__ for m in model.modules() if "attention" in type(m).__name__.lower()})
    formed = sorted(_formable(model)) if example is None else []  # observe gives forms itself: a lazy one names them
    return (f"{type(model).__name__}: no module called torch.nn.functional.scaled_dot_product_attention {when}"
            + (f"; {', '.join(formed)} compute attention by hand: heads.observe(model, example) gives them their "
               "SDPA form (verified on the example), after which they are seen" if formed else "")
            + (f"; {', '.join(where)}: attention computed where Python cannot observe it (heads are seen on a "
               "module's Python path: before torch.jit.script, without the fused kernel)" if where else "")
            + (f" ({', '.join(attn)} compute attention another way: by hand, or in a fused kernel called from C++)"
               if attn and not where and not formed else "")
            + ("; for a transformers model call multihead.hf.attach(model) first (import multihead.hf: it also knows "
               "the SDPA forms of families that compute attention by hand, Bloom), or load it with "
               "attn_implementation='multihead'" if type(model).__module__.startswith("transformers.") else "")
            + f"; multihead cannot {verb} its heads.")


_ON_CALL = ("seen on a call, without a probe: heads.observe(model, example) derives its head layout (which "
            "weights hold head h), which a cut needs")


def _install(m: nn.Module, seen: Seen) -> None:
    """Give ``m`` (a module whose own forward calls SDPA) its hook list and the hook pair that routes its SDPA
    calls through the list while something is registered on it."""
    hooks = AttentionHooks()
    hooks.num_heads, hooks.seen = seen.H, seen
    m.__dict__["attention_hooks"] = hooks
    enter = _Enter(m)
    m.__dict__[_KEY] = (m.register_forward_pre_hook(enter), m.register_forward_hook(_Exit(enter), always_call=True))
    m.__dict__[_KEY + "_enter"] = enter


@contextlib.contextmanager
def on_call(model: nn.Module, found):
    """Observation on the user's own calls, for the block: each outermost call of ``model`` or any of its modules
    (``model(x)``, ``clip.encode_image(x)``) inside it runs in a mode that sees every SDPA (or
    ``F.multi_head_attention_forward``) call; a module whose own forward makes one and has no hook list yet is
    observed there and then (as :func:`observe` makes it, without a head layout: pruning needs the probe),
    ``found(name, module)`` is called (the caller registers its observers and transforms), and the call goes
    through the module's hooks. Modules seen once keep their hooks: an observed module runs its own."""
    names = {id(m): n for n, m in model.named_modules()}
    stack: list = []
    state = {"mode": None}

    def route(module, func, a):
        enter = module.__dict__.get(_KEY + "_enter")
        if enter is not None and enter.modes and enter.modes[-1] is not None:
            return func(**a)  # the module's own mode (entered at its call) routes it: an inner call, pass it on
        if "attention_hooks" not in module.__dict__:
            seen = _seen(func, a)
            name = names.get(id(module))
            if seen is None or name is None or name == "":
                return func(**a)  # not a per-head call, or the model itself: nothing to observe
            _install(module, seen)
            module.attention_hooks.layout_reason = _ON_CALL
            found(name, module)
        if not module.__dict__["attention_hooks"]:
            return func(**a)
        return _observed_call(module, func, a)

    def push(mod, args) -> None:
        if not stack and state["mode"] is None:  # the outermost call of any of its modules (encode_image too)
            state["mode"] = _Calls(stack, route)
            state["mode"].__enter__()
        stack.append(mod)

    def pop(mod, args, out) -> None:
        if stack:
            stack.pop()
        if not stack:
            leave()

    def leave() -> None:
        if state["mode"] is not None:
            state["mode"].__exit__(None, None, None)
            state["mode"] = None

    _refuse_scripted(model, "see")
    handles = []
    for m in _python_modules(model):
        handles.append(m.register_forward_pre_hook(push))
        handles.append(m.register_forward_hook(pop, always_call=True))
    try:
        yield
    finally:  # an interrupted call (KeyboardInterrupt skips the forward hooks) leaves no mode behind
        for h in handles:
            h.remove()
        stack.clear()
        leave()


def observed(model: nn.Module) -> dict[str, nn.Module]:
    """The modules of ``model`` that :func:`observe` made visible, by name."""
    return {n: m for n, m in model.named_modules() if _KEY in m.__dict__}


def unobserve(model: nn.Module) -> None:
    """Undo :func:`observe`: the hooks and hook lists go; the model is as it was."""
    for m in observed(model).values():
        unobserve_module(m)


def unobserve_module(m: nn.Module) -> None:
    """Undo :func:`observe` on one module (its hooks and hook list go)."""
    for h in m.__dict__.pop(_KEY, ()):
        h.remove()
    m.__dict__.pop(_KEY + "_enter", None)
    m.__dict__.pop("attention_hooks", None)
