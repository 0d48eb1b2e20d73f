"""``multihead.check``: grade someone's own multi-head attention module and locate its bug.

    report = multihead.check(MyAttention(d_model=32, num_heads=4), call="qkv_mask", mask="block")
    print(report)            # a table of checks; report.ok; report.diagnosis: where it differs, and the fix

The module is called only through ``call`` (how it is called), and ``mask`` says how it reads masks:

- call: ``"x"`` self-attention ``m(x)``; ``"qkv"`` ``m(q, k, v)``; ``"qkv_mask"``
  ``m(q, k, v, mask)``; or a function ``f(module, q, k, v, mask) -> output``;
- mask: ``"keep"`` (bool, True = may attend), ``"block"`` (1/True = blocked, the Keras
  tutorial), ``"additive"`` (float added to the scores), ``"valid_lens"`` (the course's
  (B,) lengths), or None (the module takes no mask). Masks are given as (B, 1, Lq, Lk).

Each check has a severity. A *failure* means the module does not compute multi-head
attention as the course defines it; a *warning* is a robustness note (a fully masked row
gives NaN, the weights cannot be seen) that leaves ``report.ok`` alone unless ``strict``.

When the projections can be read off the module (:func:`multihead.locate.find_parts`: Linear
or Keras Dense layers at any depth, per-head lists, raw Parameters, a fused qkv; by name, by
call order, or ``mapping``), the output is compared with :func:`multihead.reference_attention`
in float64; if it differs, :func:`multihead.locate.localise` finds the first stage that
differs (projections, heads split, scores and their scale, mask, normalisation, values,
merge, output projection) and says what was expected, what was found, and the fix.

The module comes back as it was: training flags, gradients, parameters and buffers, and
the random number generators' states are restored, even when a check raises.
"""

from __future__ import annotations

import dis
import inspect
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from multihead import locate
from multihead.locate import Finding

__all__ = ["Check", "Finding", "Report", "check"]

B, LQ, LK = 3, 5, 7
CONVENTIONS = ("keep", "block", "additive", "valid_lens")
CALLS = ("x", "qkv", "qkv_mask")


@dataclass
class Check:
    """One check: ``passed`` True, False, or None (not applicable); ``severity`` "failure" (the module
    does not compute multi-head attention) or "warning" (a robustness note)."""

    name: str
    passed: bool | None
    figure: str = ""
    detail: str = ""
    severity: str = "failure"


@dataclass
class Report:
    checks: list[Check] = field(default_factory=list)
    diagnosis: list[Finding] = field(default_factory=list)
    strict: bool = False

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if c.passed is False and c.severity == "failure"]

    @property
    def warnings(self) -> list[Check]:
        return [c for c in self.checks if c.passed is False and c.severity == "warning"]

    @property
    def ok(self) -> bool:
        """No failure and nothing found wrong (and, with ``strict``, no warning either)."""
        return not self.failures and not self.diagnosis and not (self.strict and self.warnings)

    def __str__(self) -> str:
        w = max(len(c.name) for c in self.checks) if self.checks else 10
        lines = [f"{'check':<{w}}  result  figure", "-" * (w + 30)]
        for c in self.checks:
            mark = {True: "pass", None: "n/a"}.get(c.passed, "FAIL" if c.severity == "failure" else "warn")
            lines.append(f"{c.name:<{w}}  {mark:<6}  {c.figure}" + (f"  ({c.detail})" if c.detail else ""))
        if self.diagnosis:
            lines += ["", "diagnosis:"]
            for f in self.diagnosis:
                lines.append(f"- {f.name}" + (f" [stage: {f.stage}]" if f.stage else ""))
                if f.expected or f.found:
                    lines.append(f"    expected: {f.expected}")
                    lines.append(f"    found:    {f.found}")
                lines.append(f"    fix:      {f.advice}")
        lines.append("")
        if self.ok:
            lines.append("OK: the module computes multi-head attention." + (
                f" ({len(self.warnings)} warning{'s' * (len(self.warnings) != 1)})" if self.warnings else ""))
        else:
            lines.append("NOT OK." + (" (warnings fail with --strict)" if self.strict and self.warnings
                                      and not self.failures and not self.diagnosis else ""))
        return "\n".join(lines)

    def summary(self) -> str:
        """One line: the first finding, or the first failed check."""
        if self.diagnosis:
            f = self.diagnosis[0]
            return f"{f.name}" + (f" [{f.stage}]" if f.stage else "") + (
                f" (+{len(self.diagnosis) - 1} more)" if len(self.diagnosis) > 1 else "")
        bad = self.failures or (self.warnings if self.strict else [])
        return bad[0].name + (f": {bad[0].detail}" if bad[0].detail else "") if bad else ""


# --- the call and its mask ----------------------------------------------------------------


def _reads_argument(fn: Callable, index: int) -> bool | None:
    """Whether Python function ``fn`` ever reads its ``index``-th parameter (None: cannot tell)."""
    code = getattr(fn, "__code__", None)
    if code is None or index >= code.co_argcount:
        return None
    name = code.co_varnames[index]
    return any(i.argval == name for i in dis.get_instructions(code) if i.opname.startswith("LOAD"))


def _caller(call, mask):
    """``run(module, q, k, v, mask_value)``, refused before any call when the call cannot pass the mask."""
    if callable(call):
        try:
            sig = inspect.signature(call)
            sig.bind(None, None, None, None, None)
        except TypeError as e:
            raise TypeError(f"call must be a function f(module, q, k, v, mask) -> output; {call!r} cannot take "
                            f"those five arguments ({e}).") from None
        except ValueError:
            pass
        if mask is not None and _reads_argument(call, 4) is False:
            raise ValueError(f"mask={mask!r} cannot be honoured: the call function never uses its fifth argument "
                             "(the mask), so the module would never receive it. Pass the mask to the module in the "
                             "function, or use mask=None.")
        return lambda m, q, k, v, mk: call(m, q, k, v, mk)
    if call not in CALLS:
        raise ValueError(f"call must be 'x', 'qkv', 'qkv_mask' or a function f(module, q, k, v, mask); got {call!r}.")
    if call in ("x", "qkv") and mask is not None:
        how = "m(x)" if call == "x" else "m(q, k, v)"
        raise ValueError(f"call={call!r} with mask={mask!r} cannot be honoured: {how} passes no mask to the module. "
                         "Use call='qkv_mask' (m(q, k, v, mask)) or a function f(module, q, k, v, mask), or "
                         "mask=None.")
    if call == "x":
        return lambda m, q, k, v, mk: m(q)
    if call == "qkv":
        return lambda m, q, k, v, mk: m(q, k, v)
    return lambda m, q, k, v, mk: m(q, k, v, mk)


def _call_hint(module: nn.Module, call) -> str:
    """'; its forward(x) takes one input: try call='x'' when the module's forward signature fits
    another call than ``call``."""
    try:
        params = [p for p in inspect.signature(module.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        return ""
    required = [p for p in params if p.default is p.empty]
    fits = [c for c, n in (("x", 1), ("qkv", 3), ("qkv_mask", 4)) if len(required) <= n <= len(params)]
    if not fits or call in fits:
        return ""
    names = ", ".join(p.name for p in params)
    return f" (its forward({names}) fits call={fits[0]!r}{'' if fits[0] != 'qkv_mask' else ' with a mask='})"


def _mask_value(conv: str | None, keep: Tensor | None, lens: Tensor | None):
    """The mask in the module's convention (B, 1, Lq, Lk), or the lengths for valid_lens."""
    if conv is None:
        return None
    if conv == "valid_lens":
        return lens
    if conv == "keep":
        return keep
    if conv == "block":
        return (~keep).float()
    return torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))  # additive


def _output(r):
    """(output, weights or None) from whatever the module returns."""
    if isinstance(r, tuple | list):
        return r[0], (r[1] if len(r) > 1 and isinstance(r[1], Tensor) else None)
    return r, None


def _err(a: Tensor, b: Tensor) -> float:
    return locate.rel(a, b)


# --- the module's state -----------------------------------------------------------------


class _Kept:
    """Everything of the user's a check could change, put back by :meth:`restore`."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.training = [(m, m.training) for m in module.modules()]
        self.grads = [(p, p.grad) for p in module.parameters()]
        self.state = {k: t.detach().clone() for k, t in module.state_dict(keep_vars=True).items()
                      if isinstance(t, Tensor)}
        self.rng = torch.get_rng_state(), random.getstate()
        try:
            import numpy as np

            self.np = np.random.get_state()
        except ImportError:  # pragma: no cover - numpy comes with torch
            self.np = None

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
        if self.np is not None:
            import numpy as np

            np.random.set_state(self.np)


def _weights_kept(module: nn.Module, last: tuple[int, int]) -> bool:
    """Whether some submodule keeps a (..., Lq, Lk) tensor as an attribute or property after a call."""
    for m in module.modules():
        props = [n for c in type(m).__mro__ for n, a in vars(c).items() if isinstance(a, property)]
        for n in [*vars(m), *props]:
            try:
                t = getattr(m, n)
            except Exception:  # noqa: BLE001 - a property of the learner's module
                continue
            if isinstance(t, Tensor) and t.dim() >= 3 and tuple(t.shape[-2:]) == last:
                return True
    return False


def _embed_dim(module: nn.Module, mapping: dict | None) -> int | None:
    for m in module.modules():
        wb = locate._linear_like(m)
        if wb is not None:
            return int(wb[0].shape[1])
    if mapping:
        for r in ("q", "qkv"):
            if r in mapping:
                try:
                    return int(locate._linear_like(module.get_submodule(mapping[r]))[0].shape[1])
                except (AttributeError, TypeError):
                    pass
    return None


def _probes(E: int, Lq: int, Lk: int, self_attn: bool, mask: str | None, causal: bool, g: torch.Generator):
    """q (B, Lq, E), k, v (B, Lk, E); lens (B,) and the spec's keep mask (B, 1, Lq, Lk) or None."""
    q = torch.randn(B, Lq, E, generator=g)
    k = q if self_attn else torch.randn(B, Lk, E, generator=g)
    v = q if self_attn else torch.randn(B, Lk, E, generator=g)
    lens = torch.tensor([max(1, Lk - 1), min(Lk, 3), Lk]) if mask is not None else None
    keep = None
    if lens is not None:
        keep = (torch.arange(Lk) < lens[:, None])[:, None, None, :].expand(B, 1, Lq, Lk)  # (B,) -> (B, 1, Lq, Lk)
    if causal:
        tri = torch.ones(Lq, Lk, dtype=torch.bool).tril()
        keep = tri[None, None].expand(B, 1, Lq, Lk) if keep is None else keep & tri
    return q, k, v, lens, keep


def check(module: nn.Module, *, call: str | Callable = "qkv", mask: str | None = None, embed_dim: int | None = None,
          causal: bool = False, self_attention: bool | None = None, mapping: dict | None = None,
          seed: int = 0, strict: bool = False) -> Report:
    """Grade ``module`` (see the module docstring). ``embed_dim``: the input size, when no layer
    tells it; ``causal``: the module is meant to be causal (future positions must have no
    influence), on top of any mask it is given; ``self_attention``: queries, keys and values are
    the same tensor (default: ``call == "x"``); ``mapping``: the names of the q/k/v/o (or qkv)
    submodules or Parameters, the head count (``heads``) and the score scale (``scale``) when they
    cannot be found; ``strict``: warnings fail too.

    Raises before calling the module: TypeError for a module that is not a torch Module or a call
    that cannot take (module, q, k, v, mask); ValueError for a module without parameters, an
    unknown mask convention, or a call that cannot pass the mask it is given."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"check takes a torch.nn.Module; got {type(module).__name__}.")
    if mask is not None and mask not in CONVENTIONS:
        raise ValueError(f"mask must be one of {CONVENTIONS} or None; got {mask!r}.")
    run = _caller(call, mask)
    if not list(module.parameters()):
        raise ValueError(f"{type(module).__name__} has no parameters: a multi-head attention module learns its "
                         "projections (W_q, W_k, W_v, W_o).")
    kept = _Kept(module)
    try:
        E = embed_dim or _embed_dim(module, mapping) or _first_call_size(module, run, call == "x")
        if E is None:
            raise ValueError(f"cannot tell {type(module).__name__}'s input size: no Linear or Dense layer holds it "
                             "and no size its parameters have runs the call; pass embed_dim=.")
        return _check(module, run, call, mask, E, causal, call == "x" if self_attention is None else
                      bool(self_attention), mapping, seed, strict)
    finally:
        kept.restore()


def _first_call_size(module: nn.Module, run, self_attn: bool) -> int | None:
    """The input size: the first size among the parameters' dimensions (commonest first) that
    the module runs on."""
    from collections import Counter

    sizes = Counter(d for p in module.parameters() if p.dim() >= 2 for d in p.shape)
    module.eval()
    for E, _ in sizes.most_common():
        x = torch.zeros(1, 2, E)
        try:
            with torch.no_grad():
                out, _ = _output(run(module, x, x, x, None))
        except Exception:  # noqa: BLE001 - the learner's module, on a size it may not take
            continue
        if isinstance(out, Tensor) and out.dim() == 3 and out.shape[:2] == (1, 2):
            return E
    return None


def _check(module, run, call, mask, E, causal, self_attn, mapping, seed, strict) -> Report:
    g = torch.Generator().manual_seed(seed)
    Lk = LQ if self_attn or causal else LK
    q, k, v, lens, keep = _probes(E, LQ, Lk, self_attn, mask, causal, g)
    rep = Report(strict=strict)
    module.eval()

    def call_(q_, k_, v_, keep_=keep, lens_=lens):
        return _output(run(module, q_, k_, v_, _mask_value(mask, keep_, lens_)))

    order: list[nn.Module] = []
    spies = [m.register_forward_pre_hook(lambda m, a: order.append(m)) for m in module.modules()
             if locate._linear_like(m) is not None]
    try:
        with torch.no_grad():
            out, weights = call_(q, k, v)
    except Exception as e:  # noqa: BLE001 - the learner's module: report, do not crash
        how = {"x": "m(x)", "qkv": "m(q, k, v)", "qkv_mask": "m(q, k, v, mask)"}.get(call, "call(module, q, k, v, mask)")
        hint = _call_hint(module, call) if isinstance(e, TypeError) else ""
        rep.checks.append(Check("runs on probe inputs", False, "", f"{how} with q {tuple(q.shape)}, k "
                                f"{tuple(k.shape)}: {type(e).__name__}: {e}{hint}"))
        return rep
    finally:
        for s in spies:
            s.remove()
    rep.checks.append(Check("runs on probe inputs", True))
    ok_shape = isinstance(out, Tensor) and out.dim() == 3 and out.shape[:2] == (B, LQ) and out.dtype == q.dtype
    rep.checks.append(Check("output shape and dtype", ok_shape, str(tuple(out.shape)) if isinstance(out, Tensor) else
                            type(out).__name__, f"expected ({B}, {LQ}, ·) {q.dtype}"))
    if not ok_shape:
        return rep
    with torch.no_grad():
        again, _ = call_(q, k, v)
    det = out.shape == again.shape and torch.allclose(out, again, rtol=0, atol=0, equal_nan=True)
    rep.checks.append(Check("eval mode deterministic", det, "" if det else f"max diff {float((out - again).abs().max()):.3g}"))
    if not det:
        rep.diagnosis.append(Finding("dropout active in eval", "apply dropout only in training (nn.Dropout follows "
                                     "module.eval(); F.dropout needs training=self.training).", "normalisation",
                                     "the same output for the same input in eval mode", "outputs that change"))
    with torch.no_grad():  # batch independence: sequence 1 alone
        one, _ = call_(q[1:2], k[1:2], v[1:2], None if keep is None else keep[1:2], None if lens is None else lens[1:2])
    e = _err(one[0], out[1])
    if det:
        rep.checks.append(Check("batch independence", e < 1e-4, f"rel. diff {e:.2e}",
                                "" if e < 1e-4 else "a sequence's output depends on the other sequences of the batch"))
    else:  # two calls already differ: a difference here says nothing about the other sequences
        rep.checks.append(Check("batch independence", None, "not measured",
                                "the output changes from call to call in eval mode (see above)"))
    if mask is not None:  # masked keys and values have no influence
        k2, v2 = k.clone(), v.clone()
        blocked = ~(torch.arange(Lk) < lens[:, None])  # (B, Lk)
        k2[blocked] += 3.0
        v2[blocked] -= 3.0
        with torch.no_grad():
            pert, _ = call_(q if not self_attn else k2, k2, v2)
        e = _err(pert, out) if not self_attn else _err(pert[~blocked], out[~blocked])
        rep.checks.append(Check("masked keys have no influence", e < 1e-4, f"rel. change {e:.2e}"))
        full = keep.clone()
        full[0] = False
        lens0 = lens.clone()
        lens0[0] = 0
        try:
            with torch.no_grad():
                o0, _ = call_(q, k, v, full, lens0)
            fin = bool(torch.isfinite(o0).all())
            rep.checks.append(Check("fully masked rows finite", fin, "" if fin else "NaN or inf", "" if fin else
                                    "a query with every key masked gives NaN (torch.nn does too; the course never "
                                    "asks for it)", severity="warning"))
        except Exception as ex:  # noqa: BLE001
            rep.checks.append(Check("fully masked rows finite", False, "raises", f"{type(ex).__name__}: {ex}",
                                    severity="warning"))
    if causal:  # future positions: no influence (perturbation and gradients)
        xf = q.clone()
        xf[:, 1:] += 2.0  # every position after the first changed
        with torch.no_grad():
            of, _ = call_(xf, xf, xf) if self_attn else call_(xf, k, v)
        e = _err(of[:, 0], out[:, 0])
        rep.checks.append(Check("causal: position 0 unchanged when the future changes", e < 1e-4, f"rel. change {e:.2e}"))
        x = q.clone().requires_grad_(True)
        o, _ = call_(x, x, x) if self_attn else call_(x, k, v)
        gx = torch.autograd.grad(o[:, 0].sum(), x)[0]  # position 0 depends on nothing after it
        leak = float(gx[:, 1:].abs().max())
        rep.checks.append(Check("causal: no influence from the future", leak < 1e-6, f"max |d out_0 / d x_j>0| "
                                                                                      f"{leak:.2e}"))
    shown = weights is not None and weights.shape[-2:] == (LQ, Lk)
    if shown:
        s = weights.sum(-1)
        ok = bool(((s - 1).abs() < 1e-4).all() | (s.abs() < 1e-6).all())
        rep.checks.append(Check("returned weights rows sum to 1", ok, f"row sums {float(s.min()):.4f}-{float(s.max()):.4f}"))
    else:
        shown = _weights_kept(module, (LQ, Lk))
    rep.checks.append(Check("attention weights can be seen", shown, "", "" if shown else "neither returned nor kept "
                            "as an attribute: return them (or keep them, as the course's attention_weights) to show "
                            "every head's weights", severity="warning"))
    # gradients reach every parameter
    for p in module.parameters():
        p.grad = None
    qg = q.clone().requires_grad_(True)
    o, _ = call_(qg, qg if self_attn else k, qg if self_attn else v)
    (o * torch.randn(o.shape, generator=g)).sum().backward()
    dead = [n for n, p in module.named_parameters() if p.requires_grad and (p.grad is None or not p.grad.abs().sum())]
    rep.checks.append(Check("gradients reach every parameter", not dead, f"{len(dead)} without" if dead else "",
                            ", ".join(dead[:4])))
    if self_attn and mask is None and not causal:  # permutation equivariance over positions
        perm = torch.tensor([4, 2, 0, 3, 1])
        with torch.no_grad():
            op, _ = call_(q[:, perm], q[:, perm], q[:, perm])
        e = _err(op, out[:, perm])
        rep.checks.append(Check("permutation equivariance", e < 1e-4, f"rel. diff {e:.2e}"))
    if det:  # a module that is not deterministic in eval cannot be compared output for output
        _white_box(module, rep, run, mask, E, causal, self_attn, mapping, order, g, out, q, k, v, keep)
    return rep


def _white_box(module, rep, run, mask, E, causal, self_attn, mapping, order, g, out, q, k, v, keep) -> None:
    readings = locate.find_parts(module, mapping, E, order)
    if not readings:
        rep.checks.append(Check("matches the float64 reference", None, "", "projections not found by name or call "
                                "order: pass mapping={'q': ..., 'k': ..., 'v': ..., 'o': ..., 'heads': H}"))
        return
    best = None
    for parts in readings:
        for H in locate.head_counts(parts):
            try:
                ref = locate.reference(parts, H, q, k, v, keep)
            except (RuntimeError, ValueError):
                continue
            e = _err(out, ref) if ref.shape == out.shape else math.inf
            if best is None or e < best[0]:
                best = (e, parts, H)
            if e < 1e-4:
                rep.checks.append(Check("matches the float64 reference", True, f"rel. error {e:.2e}",
                                        f"{H} heads" + ("" if parts.qkv is None else f", fused qkv ({parts.layout})")))
                return
    rep.checks.append(Check("matches the float64 reference", False, "" if best is None or best[0] == math.inf else
                            f"rel. error {best[0]:.2e}"))
    # locate: on probes small enough that the weights can be recovered from the outside
    candidates = []
    for parts in readings[:2]:  # the likeliest readings (raw Parameters: all x @ W, then all F.linear)
        for H in locate.head_counts(parts):
            width = parts.qkv.weight.shape[0] // 3 if parts.qkv is not None else parts.v.weight.shape[0]
            D = width // H
            hookable = (parts.qkv or parts.v).modules and len((parts.qkv or parts.v).modules) == 1
            L = LQ if not self_attn or hookable or D > LQ else max(2, D - 1)
            Lk = L if self_attn or causal else LK
            g2 = torch.Generator().manual_seed(int(torch.randint(1 << 30, (1,), generator=g)))
            q2, k2, v2, lens2, keep2 = _probes(E, L, Lk, self_attn, mask, causal, g2)

            def run2(a, b_, c, lens2=lens2, keep2=keep2):
                with torch.no_grad():
                    return _output(run(module, a, b_, c, _mask_value(mask, keep2, lens2)))[0]

            try:
                found = locate.localise(parts, H, run2, q2, k2, v2, keep2, self_attn=self_attn,
                                        causal=causal, E=E, g=g2)
            except (RuntimeError, ValueError):
                continue
            generic = sum(f.name.startswith(("weights are not", "heads' outputs", "output changed")) for f in found)
            candidates.append((not found, generic, len(found), found))
    candidates.sort(key=lambda c: c[:3])
    found = candidates[0][3] if candidates else []
    if not found:
        found = [Finding("differs from multi-head attention", "compare each step with multihead.reference_attention "
                         "(the spec) on the same projected heads.", "not located",
                         "the output of multi-head attention with the module's own projections",
                         "a different output" + ("" if best is None or best[0] == math.inf else
                                                 f" (rel. error {best[0]:.2e})"))]
    rep.diagnosis += found
