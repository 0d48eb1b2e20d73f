"""``multihead.check``: grade someone's own multi-head attention module and name its bug.

    report = multihead.check(MyAttention(d_model=32, num_heads=4), call="qkv_mask", mask="block")
    print(report)            # a table of checks; report.ok; report.diagnosis: named findings

The module is called only through ``call`` (how it is called) and the mask convention
``mask`` says how it reads masks:

- call: ``"x"`` self-attention ``m(x)``; ``"qkv"`` ``m(q, k, v)``; ``"qkv_mask"``
  ``m(q, k, v, mask)``; or a function ``f(module, q, k, v, mask) -> output``;
- mask: ``"keep"`` (bool, True = may attend), ``"block"`` (1/True = blocked, the Keras
  tutorial), ``"additive"`` (float added to the scores), ``"valid_lens"`` (the course's
  (B,) lengths), or None (the module takes no mask). Masks are given as (B, 1, Lq, Lk).

Black-box checks need nothing but calls. When the projections can be found (four Linear
layers by name, or a fused qkv Linear, plus a head count attribute), the weights are
copied into multihead's float64 reference and the outputs compared; if they differ,
the known mistakes (and pairs of them) are tried against the module's output and the
one that reproduces it is named, with a line of advice.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["Check", "Finding", "Report", "check"]

B, LQ, LK = 3, 5, 7
CONVENTIONS = ("keep", "block", "additive", "valid_lens")


@dataclass
class Check:
    name: str
    passed: bool | None  # None: not applicable
    figure: str = ""
    detail: str = ""


@dataclass
class Finding:
    name: str
    advice: str


@dataclass
class Report:
    checks: list[Check] = field(default_factory=list)
    diagnosis: list[Finding] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.passed is not False for c in self.checks) and not self.diagnosis

    def __str__(self) -> str:
        w = max(len(c.name) for c in self.checks) if self.checks else 10
        lines = [f"{'check':<{w}}  result  figure", "-" * (w + 30)]
        for c in self.checks:
            mark = {True: "pass", False: "FAIL", None: "n/a"}[c.passed]
            lines.append(f"{c.name:<{w}}  {mark:<6}  {c.figure}" + (f"  ({c.detail})" if c.detail else ""))
        if self.diagnosis:
            lines.append("")
            lines.append("diagnosis:")
            lines += [f"- {f.name}: {f.advice}" for f in self.diagnosis]
        lines.append("")
        lines.append("OK: the module computes multi-head attention." if self.ok else "NOT OK.")
        return "\n".join(lines)


# --- the known mistakes: a variant of the computation each, on projected heads ---

ADVICE = {
    "scores divided by d_k": "scale the scores by 1/sqrt(d_k), not 1/d_k (Vaswani et al.'s scaled dot product).",
    "scores not scaled": "multiply the scores by 1/sqrt(d_k) before the softmax.",
    "softmax over the wrong axis": "take the softmax over the keys (the last axis of the scores, dim=-1).",
    "softmax skipped (values times raw scores)": "apply the softmax to the scores and multiply the values by those "
                                                 "weights, not by the raw scores.",
    "heads split without the transpose": "split the heads with x.view(B, L, H, D).transpose(1, 2): a plain "
                                         "view(B, H, L, D) mixes positions and heads.",
    "heads merged in the wrong order": "merge with out.transpose(1, 2).reshape(B, L, H*D): a plain reshape of "
                                       "(B, H, L, D) mixes heads and positions.",
    "mask polarity inverted": "check the mask convention: here True/1 means the opposite of what the module assumes.",
    "mask applied after the softmax": "mask the scores (-inf where blocked) before the softmax; zeroing weights "
                                      "after it leaves rows that no longer sum to 1.",
    "causal mask off by one": "a position may attend to itself and earlier ones: keep j <= i (torch.tril, diagonal 0).",
    "keys used as values": "multiply the weights by the projected values, not the keys.",
    "dropout active in eval": "apply dropout only in training (nn.Dropout follows module.eval(); F.dropout needs "
                              "training=self.training).",
    "output projection missing": "project the concatenated heads with W_o (a final Linear) before returning.",
}


def _heads(x: Tensor, H: int, split_ok: bool) -> Tensor:
    Bx, L, HD = x.shape
    if split_ok:
        return x.view(Bx, L, H, HD // H).transpose(1, 2)  # (B, L, H*D) -> (B, H, L, D)
    return x.reshape(Bx, H, L, HD // H)  # the mistake: positions and heads mixed


def _compute(q, k, v, keep, H, o_lin, mistakes: frozenset[str], scale_default: float) -> Tensor:
    """The float64 computation with ``mistakes`` applied. q (B, Lq, H*D), k, v (B, Lk, H*D)."""
    qh, kh = _heads(q, H, "heads split without the transpose" not in mistakes), \
        _heads(k, H, "heads split without the transpose" not in mistakes)
    vh = _heads(k if "keys used as values" in mistakes else v, H, "heads split without the transpose" not in mistakes)
    D = qh.shape[-1]
    s = qh @ kh.transpose(-2, -1)  # (B, H, Lq, Lk)
    if "scores divided by d_k" in mistakes:
        s = s / D
    elif "scores not scaled" not in mistakes:
        s = s * scale_default
    if keep is not None:
        kp = ~keep if "mask polarity inverted" in mistakes else keep
        if "causal mask off by one" in mistakes:
            kp = kp & ~torch.eye(kp.shape[-2], kp.shape[-1], dtype=torch.bool)  # the diagonal dropped
    if "softmax skipped (values times raw scores)" in mistakes:
        w = s if keep is None else s.masked_fill(~kp, 0.0)
    elif "softmax over the wrong axis" in mistakes:
        w = torch.softmax(s if keep is None else s.masked_fill(~kp, float("-inf")), -2).nan_to_num()
    elif keep is not None and "mask applied after the softmax" in mistakes:
        w = torch.softmax(s, -1).masked_fill(~kp, 0.0)
    else:
        w = torch.softmax(s if keep is None else s.masked_fill(~kp, float("-inf")), -1).nan_to_num()
    o = w @ vh  # (B, H, Lq, D)
    if "heads merged in the wrong order" in mistakes:
        o = o.reshape(o.shape[0], o.shape[2], -1)
    else:
        o = o.transpose(1, 2).reshape(o.shape[0], o.shape[2], -1)  # (B, H, Lq, D) -> (B, Lq, H*D)
    if "output projection missing" in mistakes or o_lin is None:
        return o
    return F.linear(o, o_lin.weight.double(), None if o_lin.bias is None else o_lin.bias.double())


# --- finding the module's parts ---

_Q = ("q", "query", "w_q", "q_proj", "q_lin", "wq", "to_q")
_K = ("k", "key", "w_k", "k_proj", "k_lin", "wk", "to_k")
_V = ("v", "value", "w_v", "v_proj", "v_lin", "wv", "to_v")
_O = ("o", "out", "w_o", "o_proj", "out_proj", "out_lin", "wo", "to_out", "dense", "output", "proj", "fc_out")
_QKV = ("qkv", "in_proj", "c_attn", "to_qkv", "w_qkv", "qkv_proj")
_HEADS = ("num_heads", "n_heads", "heads", "h", "num_head", "nhead", "n_head", "num_attention_heads", "head_count")


def _find(module: nn.Module, mapping: dict | None):
    """(q, k, v, o Linear or None, fused qkv Linear or None, H) found by name, or None."""
    lin = {n.split(".")[-1].lower(): m for n, m in module.named_modules() if isinstance(m, nn.Linear) and n}
    if mapping:
        parts = {k: module.get_submodule(v) for k, v in mapping.items() if k in ("q", "k", "v", "o", "qkv")}
        H = mapping.get("heads")
    else:
        def pick(names):
            return next((lin[n] for n in names if n in lin), None)

        parts = {"q": pick(_Q), "k": pick(_K), "v": pick(_V), "o": pick(_O), "qkv": pick(_QKV)}
        H = next((getattr(module, a) for a in _HEADS if isinstance(getattr(module, a, None), int)), None)
    if H is None:
        return None
    w = module.__dict__.get("_parameters", {}).get("in_proj_weight")
    if parts.get("qkv") is None and w is not None and w.shape[0] == 3 * w.shape[1]:  # torch.nn's fused parameters
        b = module.__dict__["_parameters"].get("in_proj_bias")
        fused = nn.Linear(w.shape[1], w.shape[0], bias=b is not None)
        with torch.no_grad():
            fused.weight.copy_(w)
            if b is not None:
                fused.bias.copy_(b)
        parts["qkv"] = fused
        parts["o"] = parts.get("o") or module.__dict__["_modules"].get("out_proj")
    if parts.get("qkv") is not None or all(parts.get(x) is not None for x in "qkv"):
        return parts.get("q"), parts.get("k"), parts.get("v"), parts.get("o"), parts.get("qkv"), int(H)
    return None


# --- calling the module ---


def _mask_value(conv: str | None, keep: Tensor | None, lens: Tensor | None):
    """The mask in the module's convention (B, 1, Lq, Lk), or the lengths for valid_lens."""
    if conv is None or (keep is None and lens is None):
        return None
    if conv == "valid_lens":
        return lens
    if conv == "keep":
        return keep
    if conv == "block":
        return (~keep).float()
    if conv == "additive":
        return torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))
    raise ValueError(f"mask must be one of {CONVENTIONS} or None; got {conv!r}.")


def _caller(call):
    if callable(call):
        return lambda m, q, k, v, mk: call(m, q, k, v, mk)
    if call == "x":
        return lambda m, q, k, v, mk: m(q)
    if call == "qkv":
        return lambda m, q, k, v, mk: m(q, k, v)
    if call == "qkv_mask":
        return lambda m, q, k, v, mk: m(q, k, v, mk)
    raise ValueError(f"call must be 'x', 'qkv', 'qkv_mask' or a function f(module, q, k, v, mask); got {call!r}.")


def _output(r):
    """(output, weights or None) from whatever the module returns."""
    if isinstance(r, tuple | list):
        return r[0], (r[1] if len(r) > 1 and isinstance(r[1], Tensor) else None)
    return r, None


def _err(a: Tensor, b: Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / (b.abs().max() + 1e-12))


def check(module: nn.Module, *, call: str | Callable = "qkv", mask: str | None = None, embed_dim: int | None = None,
          causal: bool = False, self_attention: bool | None = None, mapping: dict | None = None,
          seed: int = 0) -> Report:
    """Grade ``module`` (see the module docstring). ``embed_dim``: the input size when it
    cannot be read off the first Linear; ``causal``: the module is meant to be causal
    (future positions must have no influence); ``self_attention``: queries, keys and values
    are the same tensor (default: ``call == "x"``); ``mapping``: names of the q/k/v/o (or
    qkv) submodules, the head count (``heads``) and the score scale (``scale``) when they
    cannot be found by name (a numeric ``scale`` attribute of the module is used too)."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"check takes a torch.nn.Module; got {type(module).__name__}.")
    if mask is not None and mask not in CONVENTIONS:
        raise ValueError(f"mask must be one of {CONVENTIONS} or None; got {mask!r}.")
    params = list(module.parameters())
    if not params:
        raise ValueError(f"{type(module).__name__} has no parameters: a multi-head attention module learns its "
                         "projections (W_q, W_k, W_v, W_o).")
    run = _caller(call)
    E = embed_dim or next((m.in_features for m in module.modules() if isinstance(m, nn.Linear)), None)
    if E is None:
        raise ValueError("cannot tell the module's input size: pass embed_dim=.")
    self_attn = call == "x" if self_attention is None else bool(self_attention)
    g = torch.Generator().manual_seed(seed)
    Lk = LQ if self_attn or causal else LK
    q = torch.randn(B, LQ, E, generator=g)
    k = q if self_attn else torch.randn(B, Lk, E, generator=g)
    v = q if self_attn else torch.randn(B, Lk, E, generator=g)
    lens = torch.tensor([Lk, Lk - 2, 3]) if mask is not None else None
    keep = (torch.arange(Lk) < lens[:, None])[:, None, None, :].expand(B, 1, LQ, Lk) if lens is not None else None
    if causal and keep is not None and mask != "valid_lens":
        keep = keep & torch.ones(LQ, Lk, dtype=torch.bool).tril()
    elif causal and mask is None:
        keep = None
    rep = Report()
    module.eval()

    def call_(q_, k_, v_, keep_=keep, lens_=lens):
        return _output(run(module, q_, k_, v_, _mask_value(mask, keep_, lens_)))

    try:
        with torch.no_grad():
            out, weights = call_(q, k, v)
    except Exception as e:  # noqa: BLE001 - the learner's module: report, do not crash
        how = {"x": "m(x)", "qkv": "m(q, k, v)", "qkv_mask": "m(q, k, v, mask)"}.get(call, "call(module, q, k, v, mask)")
        rep.checks.append(Check("runs on probe inputs", False, "", f"{how} with q {tuple(q.shape)}, k "
                                f"{tuple(k.shape)}: {type(e).__name__}: {e}"))
        return rep
    rep.checks.append(Check("runs on probe inputs", True))
    ok_shape = isinstance(out, Tensor) and out.shape[:2] == (B, LQ) and out.dtype == q.dtype
    rep.checks.append(Check("output shape and dtype", ok_shape, str(tuple(out.shape)) if isinstance(out, Tensor) else
                            type(out).__name__, f"expected ({B}, {LQ}, ·) {q.dtype}"))
    if not ok_shape:
        return rep
    with torch.no_grad():
        again, _ = call_(q, k, v)
    det = torch.equal(out, again)
    rep.checks.append(Check("eval mode deterministic", det, "" if det else f"max diff {float((out - again).abs().max()):.3g}"))
    if not det:
        rep.diagnosis.append(Finding("dropout active in eval", ADVICE["dropout active in eval"]))
    with torch.no_grad():  # batch independence: sequence 1 alone
        k1 = None if keep is None else keep[1:2]
        l1 = None if lens is None else lens[1:2]
        one, _ = call_(q[1:2], k[1:2], v[1:2], k1, l1)
    e = _err(one[0], out[1])
    rep.checks.append(Check("batch independence", e < 1e-4 or not det, f"rel. diff {e:.2e}"))
    if mask is not None:  # masked keys and values have no influence
        k2, v2 = k.clone(), v.clone()
        blocked = ~(torch.arange(Lk) < lens[:, None])  # (B, Lk)
        k2[blocked] += 3.0
        v2[blocked] -= 3.0
        with torch.no_grad():
            pert, _ = call_(q if not self_attn else k2, k2, v2)
        live = lens > 0
        e = _err(pert[live], out[live]) if not self_attn else _err(pert[~blocked], out[~blocked])
        rep.checks.append(Check("masked keys have no influence", e < 1e-4, f"rel. change {e:.2e}"))
        full = keep.clone() if keep is not None else None
        if full is not None:
            full[0] = False
        lens0 = lens.clone()
        lens0[0] = 0
        with torch.no_grad():
            o0, _ = call_(q, k, v, full, lens0)
        rep.checks.append(Check("fully masked rows finite", bool(torch.isfinite(o0).all())))
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
    if weights is not None:
        s = weights.sum(-1)
        ok = bool(((s - 1).abs() < 1e-4).all() | (s.abs() < 1e-6).all())
        rep.checks.append(Check("returned weights rows sum to 1", ok, f"row sums {float(s.min()):.4f}-{float(s.max()):.4f}"))
    # gradients reach every parameter
    module.zero_grad(set_to_none=True)
    module.train(False)
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
        _white_box(module, rep, q, k, v, keep, out, mapping, causal and keep is None)
    return rep


def _white_box(module, rep: Report, q, k, v, keep, out, mapping, causal_only: bool) -> None:
    found = _find(module, mapping)
    if found is None:
        rep.checks.append(Check("matches the float64 reference", None, "", "projections or the head count not found "
                                "by name: pass mapping={'q': ..., 'k': ..., 'v': ..., 'o': ..., 'heads': H}"))
        return
    ql, kl, vl, ol, qkv, H = found

    def lin(m, x):
        return F.linear(x.double(), m.weight.double(), None if m.bias is None else m.bias.double())

    if qkv is not None:
        Q, K, V = lin(qkv, q).chunk(3, -1)  # (B, L, 3*H*D) -> 3 x (B, L, H*D)
        if k is not q:
            _, K, _ = lin(qkv, k).chunk(3, -1)
            _, _, V = lin(qkv, v).chunk(3, -1)
    else:
        Q, K, V = lin(ql, q), lin(kl, k), lin(vl, v)
    if Q.shape[-1] % H:
        rep.checks.append(Check("matches the float64 reference", None, "", f"the projection width {Q.shape[-1]} is not "
                                f"divisible by {H} heads"))
        return
    D = Q.shape[-1] // H
    scale = (mapping or {}).get("scale", module.__dict__.get("scale"))
    scale = float(scale) if isinstance(scale, int | float) and not isinstance(scale, bool) else 1 / math.sqrt(D)
    kp = keep
    if causal_only:
        kp = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool).tril()[None, None]
    ref = _compute(Q, K, V, kp, H, ol, frozenset(), scale)
    e = _err(out, ref)
    rep.checks.append(Check("matches the float64 reference", e < 1e-4, f"rel. error {e:.2e}"))
    if e < 1e-4:
        return
    names = [n for n in ADVICE if n != "dropout active in eval"]
    if kp is None:
        names = [n for n in names if n not in ("mask polarity inverted", "mask applied after the softmax",
                                               "causal mask off by one")]
    best = None
    for r in (1, 2):
        for combo in itertools.combinations(names, r):
            try:
                alt = _compute(Q, K, V, kp, H, ol, frozenset(combo), scale)
            except RuntimeError:
                continue
            ea = _err(out, alt)
            if ea < 1e-4 and (best is None or ea < best[0]):
                best = (ea, combo)
        if best is not None:
            break
    if best is None:
        rep.diagnosis.append(Finding("differs from multi-head attention", "none of the known mistakes reproduces the "
                                     "output: compare your computation with multihead.reference_attention step by step."))
        return
    for name in best[1]:
        rep.diagnosis.append(Finding(name, ADVICE[name]))
