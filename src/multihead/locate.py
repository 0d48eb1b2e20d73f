"""Where a learner's attention module departs from multi-head attention, stage by stage.

The course's computation, with q (B, Lq, E), k and v (B, Lk, E)::

    Q, K, V = q W_qᵀ + b_q, k W_kᵀ + b_k, v W_vᵀ + b_v        # projections   (B, L, H*D)
    Qh, Kh, Vh = split(Q), split(K), split(V)                 # heads split   (B, H, L, D)
    S = Qh Khᵀ · scale, blocked keys -> -inf                   # scores, mask  (B, H, Lq, Lk)
    W = softmax(S, over the keys)                              # normalisation
    Oh = W Vh                                                  # values        (B, H, Lq, D)
    out = merge(Oh) W_oᵀ + b_o                                 # merge, output projection

:func:`find_parts` reads the projections off the module (Linear or Keras Dense layers at any
depth, per-head lists of them, raw Parameters, a fused qkv projection), by name, by the
order they are called in, or from ``mapping``. :func:`localise` then recovers the module's
own intermediates from the outside, last stage first, and compares each with the spec:

- the projections' inputs and outputs are observed through forward hooks;
- the merged heads are the output projection's input (observed, or solved for through
  W_o, a known linear map);
- the attention weights are solved for from the per-head outputs and the values
  (``Oh = W Vh``: several calls with other values make W unique);
- the weights are then tested: which axis sums to 1, whether log W is a multiple of
  Qh Khᵀ (the fitted multiple is the scale), which entries are zero (the mask).

Each stage is tried as the spec says first, then as the common mistakes do it (heads
split without the transpose, keys used as values, ...); the first stage that differs is
reported with what was expected, what was found and the fix. Mistakes at different stages
are found together; the ones with a known name get that name.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["Finding", "Parts", "Proj", "find_parts", "localise"]


@dataclass
class Finding:
    """A departure from multi-head attention: ``name`` (short), ``advice`` (the fix), and where
    it was located: ``stage``, what the spec ``expected`` and what the module computes (``found``)."""

    name: str
    advice: str
    stage: str = ""
    expected: str = ""
    found: str = ""

    def __str__(self) -> str:
        where = f" [{self.stage}]" if self.stage else ""
        seen = f" expected {self.expected}; found {self.found}." if self.expected or self.found else ""
        return f"{self.name}{where}:{seen} Fix: {self.advice}"


@dataclass
class Proj:
    """A linear projection ``x -> x Wᵀ + b``: weight (out, in) and bias in float64; ``modules``
    are the hookable layers that compute it (several for a per-head list), empty for raw
    Parameters."""

    weight: Tensor
    bias: Tensor | None
    name: str
    modules: list = field(default_factory=list)

    def __call__(self, x: Tensor) -> Tensor:
        return F.linear(x.double(), self.weight, self.bias)


@dataclass
class Parts:
    q: Proj | None = None
    k: Proj | None = None
    v: Proj | None = None
    o: Proj | None = None
    qkv: Proj | None = None  # fused
    H: int | None = None
    scale: float | None = None
    layout: str = "blocks"  # fused qkv: "blocks" [Q | K | V] or "heads" [q_h k_h v_h] per head

    def projections(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(Q, K, V) as the spec computes them, float64 (B, L, H*D)."""
        if self.qkv is not None:
            return (self.fused(self.qkv(q))[0], self.fused(self.qkv(k))[1], self.fused(self.qkv(v))[2])
        return self.q(q), self.k(k), self.v(v)

    def fused(self, y: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Split a fused projection's output (B, L, 3*H*D) into Q, K, V (B, L, H*D) by ``layout``."""
        Bx, L, W3 = y.shape
        if self.layout == "blocks":
            return y.chunk(3, -1)
        y = y.reshape(Bx, L, self.H, 3, W3 // (3 * self.H))  # (B, L, 3*H*D) -> (B, L, H, 3, D)
        return tuple(y[:, :, :, i].reshape(Bx, L, -1) for i in range(3))  # 3 x (B, L, H*D)

    def put_v(self, y: Tensor, V: Tensor) -> Tensor:
        """The fused output y (B, L, 3*H*D) with its V part replaced by V (B, L, H*D)."""
        y = y.clone()
        Bx, L, W3 = y.shape
        if self.layout == "blocks":
            y[..., 2 * W3 // 3:] = V
            return y
        D = W3 // (3 * self.H)
        y.view(Bx, L, self.H, 3, D)[:, :, :, 2] = V.reshape(Bx, L, self.H, D)  # (B, L, H*D) -> (B, L, H, D)
        return y


# --- finding the parts -------------------------------------------------------------------

_FILLER = {"w", "proj", "projection", "lin", "linear", "layer", "dense", "weight", "weights", "to", "fc", "mat",
           "matrix", "head", "heads", "self", "attn", "attention", "list", "param", "params", "kernel", "p", "in",
           "layers", "all"}
_ROLE = {"q": "q", "query": "q", "queries": "q", "k": "k", "key": "k", "keys": "k", "v": "v", "value": "v",
         "values": "v", "o": "o", "out": "o", "output": "o", "combine": "o", "concat": "o", "merge": "o", "c": "o",
         "qkv": "qkv"}
_FUSED = {"inproj", "cattn", "qkv", "inprojweight"}
_HEADS = ("num_heads", "n_heads", "heads", "h", "num_head", "nhead", "n_head", "num_attention_heads", "head_count",
          "n_head", "nheads", "n_heads")


def role_of(name: str) -> str | None:
    """'W_q' -> 'q', 'self.inner.to_out' -> 'o', 'c_attn' -> 'qkv', 'proj' -> 'o?', '0' -> None."""
    last = name.split(".")[-1]
    flat = re.sub(r"[^a-z0-9]", "", last.lower())
    if flat in _FUSED or "qkv" in flat:
        return "qkv"
    tokens = [t for t in re.split(r"[^a-z0-9]+|(?<=[a-z])(?=[A-Z])", last) if t]
    tokens = [t.lower() for t in tokens]
    roles = set()
    for t in tokens:
        if t in _ROLE:
            roles.add(_ROLE[t])
        elif len(t) > 1 and t[0] == "w" and t[1:] in _ROLE:
            roles.add(_ROLE[t[1:]])
        elif t not in _FILLER and not t.isdigit():
            return None
    if len(roles) == 1:
        return roles.pop()
    if roles == {"q", "k", "v"}:  # query_key_value
        return "qkv"
    if not roles and {"proj", "dense", "fc", "linear", "projection"} & set(tokens):
        return "o?"  # an unnamed projection: the output one when q, k and v have names
    return None


def _linear_like(m: nn.Module) -> tuple[Tensor, Tensor | None] | None:
    """(weight (out, in), bias) of a torch Linear or a Keras Dense layer, float64; None otherwise."""
    if isinstance(m, nn.Linear):
        return m.weight.detach().double(), None if m.bias is None else m.bias.detach().double()
    if type(m).__name__ == "Dense" and getattr(m, "kernel", None) is not None:  # Keras 3 on torch: kernel (in, out)
        kern = getattr(m.kernel, "value", m.kernel)
        bias = getattr(m, "bias", None)
        bias = None if bias is None else getattr(bias, "value", bias)
        return kern.detach().double().T, None if bias is None else bias.detach().double()
    return None


def _stack(projs: list[Proj], name: str) -> Proj:
    """Per-head projections (each (D, E)) as one (H*D, E) projection, heads in order."""
    w = torch.cat([p.weight for p in projs])
    b = None if any(p.bias is None for p in projs) else torch.cat([p.bias for p in projs])
    return Proj(w, b, name, [m for p in projs for m in p.modules])


def _param_proj(name: str, p: Tensor, E: int | None) -> list[Proj]:
    """A raw Parameter as a projection: (in, out) for ``x @ W`` or (out, in) for ``F.linear``;
    (H, E, D) or (H, D, E) per head. Every reading the shape allows, likeliest first."""
    w = p.detach().double()
    if w.dim() == 2:
        a, b = w.shape
        if E is not None and a == E and b != E:
            return [Proj(w.T, None, name)]
        if E is not None and b == E and a != E:
            return [Proj(w, None, name)]
        return [Proj(w.T, None, name), Proj(w, None, name)]
    if w.dim() == 3:
        H, a, b = w.shape
        outs = []
        if E is None or a == E:
            outs.append(Proj(w.transpose(1, 2).reshape(H * b, a), None, name))  # (H, E, D) -> (H*D, E)
        if E is None or b == E:
            outs.append(Proj(w.reshape(H * a, b), None, name))  # (H, D, E) -> (H*D, E)
        return outs
    return []


def find_parts(module: nn.Module, mapping: dict | None, E: int, order: list[nn.Module] | None = None) -> list[Parts]:
    """The readings of ``module``'s projections, head count and scale, likeliest first (several
    where a raw square Parameter's orientation or a fused layout cannot be told from names).
    ``order``: the Linear-like layers in the order one call ran them, for modules whose layers
    have no names that say their role (``self.linears[0..3]``)."""
    mapping = dict(mapping or {})
    named: dict[str, list] = {"q": [], "k": [], "v": [], "o": [], "o?": [], "qkv": []}
    lin_of: dict[nn.Module, Proj] = {}
    for name, m in module.named_modules():
        wb = _linear_like(m) if name else None
        if wb is None:
            continue
        pr = Proj(wb[0], wb[1], name, [m])
        lin_of[m] = pr
        r = role_of(name) or (role_of(name.rsplit(".", 1)[0]) if name.split(".")[-1].isdigit() and "." in name
                              else None)
        if r is not None:
            named[r].append(pr)
    for name, p in module.named_parameters():
        owner = module.get_submodule(name.rsplit(".", 1)[0]) if "." in name else module
        if _linear_like(owner) is not None or type(owner).__name__ in ("ParameterDict",):
            continue
        r = role_of(name)
        if r in ("q", "k", "v", "o", "qkv"):
            named[r].append(_param_proj(name, p, E))
    if mapping:
        for r in ("q", "k", "v", "o", "qkv"):
            if r in mapping:
                sub = mapping[r]
                try:
                    m = module.get_submodule(sub)
                    wb = _linear_like(m)
                    if wb is None:
                        raise ValueError(f"mapping[{r!r}] = {sub!r} is a {type(m).__name__}, not a Linear layer.")
                    named[r] = [Proj(wb[0], wb[1], sub, [m])]
                except AttributeError:
                    p = module.get_parameter(sub)
                    named[r] = [_param_proj(sub, p, E)]
    H = mapping.get("heads")
    if H is None:
        for _, m in module.named_modules():
            H = next((getattr(m, a) for a in _HEADS if isinstance(getattr(m, a, None), int)
                      and not isinstance(getattr(m, a), bool) and getattr(m, a) > 0), None)
            if H is not None:
                break
    scale = mapping.get("scale", module.__dict__.get("scale"))
    scale = float(scale) if isinstance(scale, int | float) and not isinstance(scale, bool) else None

    if not named["o"] and named["o?"]:
        named["o"] = named["o?"][-1:]
    if not (named["q"] or named["qkv"]) and order:  # nothing named: the order of the calls
        seq = [lin_of[m] for m in dict.fromkeys(order) if m in lin_of]
        fused = [p for p in seq if p.weight.shape[0] == 3 * p.weight.shape[1]]
        if fused and len(seq) >= 2:
            named["qkv"], named["o"] = [fused[0]], [seq[-1]]
        elif len(seq) >= 4:
            named["q"], named["k"], named["v"], named["o"] = [seq[0]], [seq[1]], [seq[2]], [seq[3]]
    readings = []
    raw = [r for r in ("q", "k", "v", "o", "qkv") if named[r] and isinstance(named[r][0], list)]
    choices = [range(len(named[r][0])) for r in raw]
    import itertools

    combos = list(itertools.product(*choices)) if len(raw) <= 4 else [(i,) * len(raw) for i in range(2)]
    combos.sort(key=lambda c: (len(set(c)) > 1, c))  # every Parameter read the same way first, x @ W first
    for combo in combos:
        pick = dict(zip(raw, combo, strict=True))

        def one(role, pick=pick):
            got = named[role]
            if not got:
                return None
            if isinstance(got[0], list):  # a raw Parameter: its readings
                return got[0][min(pick[role], len(got[0]) - 1)]
            if len(got) > 1:  # a per-head list of layers
                return _stack(got, ".".join(got[0].name.split(".")[:-1]) or role)
            return got[0]

        if named["qkv"] and not named["q"]:
            for layout in ("blocks", "heads"):
                readings.append(Parts(o=one("o"), qkv=one("qkv"), H=H, scale=scale, layout=layout))
        elif named["q"] and named["k"] and named["v"]:
            n_q = len(named["q"]) if isinstance(named["q"][0], Proj) else 1
            readings.append(Parts(q=one("q"), k=one("k"), v=one("v"), o=one("o"),
                                  H=H if H is not None or n_q < 2 else n_q, scale=scale))
    return readings


def head_counts(parts: Parts) -> list[int]:
    """The head counts to try: the module's own attribute, or every divisor of the width."""
    if parts.H is not None:
        return [parts.H]
    width = (parts.qkv.weight.shape[0] // 3) if parts.qkv is not None else parts.q.weight.shape[0]
    return [h for h in range(1, width + 1) if width % h == 0]


# --- the stages ---------------------------------------------------------------------------


def split(x: Tensor, H: int, ok: bool | str = True) -> Tensor:
    """(B, L, H*D) -> (B, H, L, D); ``ok=False``: the mistake, a plain reshape that mixes
    positions and heads; ``ok="interleaved"``: the features taken head-minor (feature d of head h
    at d*H + h, what ``torch.stack(heads, -1).flatten(-2)`` makes)."""
    Bx, L, W = x.shape
    if ok == "interleaved":
        return x.reshape(Bx, L, W // H, H).permute(0, 3, 1, 2)  # (B, L, D*H) -> (B, L, D, H) -> (B, H, L, D)
    if ok:
        return x.reshape(Bx, L, H, W // H).transpose(1, 2)  # (B, L, H*D) -> (B, L, H, D) -> (B, H, L, D)
    return x.reshape(Bx, H, L, W // H)  # (B, L, H*D) -> (B, H, L, D), positions and heads mixed


def merge(o: Tensor, ok: bool = True) -> Tensor:
    """(B, H, Lq, D) -> (B, Lq, H*D); ``ok=False``: a plain reshape (the mistake)."""
    Bx, H, L, D = o.shape
    if ok:
        return o.transpose(1, 2).reshape(Bx, L, H * D)  # (B, H, Lq, D) -> (B, Lq, H, D) -> (B, Lq, H*D)
    return o.reshape(Bx, L, H * D)  # (B, H, Lq, D) -> (B, Lq, H*D), heads and positions mixed


def unmerge(m: Tensor, H: int, ok: bool | str = True) -> Tensor:
    """The inverse of :func:`merge`: (B, Lq, H*D) -> (B, H, Lq, D)."""
    return split(m, H, ok)


def reference(parts: Parts, H: int, q: Tensor, k: Tensor, v: Tensor, keep: Tensor | None) -> Tensor:
    """The spec's output, float64, through :func:`multihead.reference_attention`."""
    from multihead.backends.reference import reference_attention

    Q, K, V = parts.projections(q, k, v)
    D = Q.shape[-1] // H
    scale = parts.scale if parts.scale is not None else 1 / math.sqrt(D)
    o = reference_attention(split(Q, H), split(K, H), split(V, H), keep, scale=scale)  # (B, H, Lq, D)
    m = merge(o)  # (B, H, Lq, D) -> (B, Lq, H*D)
    return m if parts.o is None else parts.o(m)


def rel(a: Tensor, b: Tensor) -> float:
    """max |a - b| / max |b|; NaN in the same places counts as equal, NaN in one only as inf."""
    a, b = a.detach().double(), b.detach().double()
    na, nb = torch.isnan(a), torch.isnan(b)
    if not torch.equal(na, nb):
        return math.inf
    a, b = a.masked_fill(na, 0.0), b.masked_fill(nb, 0.0)
    if not bool(torch.isfinite(a).all()) or not bool(torch.isfinite(b).all()):
        return 0.0 if torch.equal(a, b) else math.inf
    return float((a - b).abs().max() / (b.abs().max() + 1e-12))


_SCALES = (("1/sqrt(d_k)", lambda D, E, H: 1 / math.sqrt(D)), ("1/d_k", lambda D, E, H: 1 / D),
           ("1 (not scaled)", lambda D, E, H: 1.0), ("1/sqrt(d_model)", lambda D, E, H: 1 / math.sqrt(E)),
           ("1/d_model", lambda D, E, H: 1 / E), ("sqrt(d_k)", lambda D, E, H: math.sqrt(D)),
           ("d_k", lambda D, E, H: float(D)), ("1/sqrt(num_heads)", lambda D, E, H: 1 / math.sqrt(H)),
           ("1/num_heads", lambda D, E, H: 1 / H), ("1/(2 sqrt(d_k))", lambda D, E, H: 0.5 / math.sqrt(D)),
           ("2/sqrt(d_k)", lambda D, E, H: 2 / math.sqrt(D)), ("-1/sqrt(d_k)", lambda D, E, H: -1 / math.sqrt(D)))


def name_scale(c: float, D: int, E: int, H: int) -> str:
    """The expression a fitted score multiple ``c`` is: '1/d_k', '1/sqrt(d_model)', ... or its value."""
    for expr, f in _SCALES:
        if D == E and expr in ("1/sqrt(d_model)", "1/d_model"):
            continue
        val = f(D, E, H)
        if abs(c - val) <= 2e-3 * abs(val):
            return expr
    return f"{c:.4g}"


def _scale_finding(c: float, expected: float, D: int, E: int, H: int, given: bool) -> Finding | None:
    if abs(c - expected) <= 2e-3 * abs(expected):
        return None
    expr = name_scale(c, D, E, H)
    want = f"{expected:.4g}" if given else f"1/sqrt(d_k) = 1/sqrt({D}) = {expected:.4g}"
    name = {"1/d_k": "scores divided by d_k", "1 (not scaled)": "scores not scaled"}.get(expr, f"scores scaled by {expr}")
    found = f"{expr} = {c:.4g}" if not expr[0].isdigit() or "/" in expr or "sqrt" in expr else f"{c:.4g}"
    return Finding(name, f"multiply Q Kᵀ by {want} (d_k = d_model / num_heads, the size of one head), once, "
                         "before the mask and the softmax.", "scores", f"Q Kᵀ × {want}", f"Q Kᵀ × {found}")


def _solve_weights(Oh: Tensor, V: Tensor) -> tuple[Tensor, float]:
    """W with Oh = W V per (b, h), least squares: Oh (B, H, Lq, N), V (B, H, Lk, N) ->
    (W (B, H, Lq, Lk), relative residual)."""
    W = Oh @ torch.linalg.pinv(V)  # (B, H, Lq, N) @ (B, H, N, Lk) -> (B, H, Lq, Lk)
    res = float((W @ V - Oh).abs().max() / (Oh.abs().max() + 1e-12))
    return W, res


AXES = {-1: "the keys (dim=-1)", -2: "the queries (dim=-2)", 1: "the heads (dim=1)", 0: "the batch (dim=0)"}


def _normalised_axis(W: Tensor, X: Tensor) -> int | None:
    """The axis over which the weights (B, H, Lq, Lk) sum to 1 (slices that are wholly
    blocked may sum to 0), or None."""
    for ax in (-1, -2, 1, 0):
        if W.shape[ax] < 2:
            continue
        s = W.sum(ax)
        one = (s - 1).abs() < 1e-3
        if bool((one | (s.abs() < 1e-3)).all()) and bool(one.any()):  # a slice of zeros: nothing to attend to
            return ax
    return None


def _fit_logits(W: Tensor, S: Tensor, X: Tensor, ax: int, thr: float = 1e-4):
    """Fit log W = c·S + r along axis ``ax`` (r: one constant per slice), slice by slice, on the
    entries with weight above ``thr`` (first the kept ones only, then all): c is the median of
    the slices' own fits. Returns (c, fraction of slices (of 3 or more entries) that fit c, r per
    slice broadcastable to W) for the better of the two, or None."""
    W, S, X = W.movedim(ax, -1), S.movedim(ax, -1), X.movedim(ax, -1)
    best = None
    for P in ((W > thr) & ~X, W > thr):
        n = P.sum(-1, keepdim=True)
        use = P & (n >= 3)
        logW = torch.where(P, W.clamp_min(1e-300).log(), torch.zeros_like(W))
        Sm = torch.where(P, S, torch.zeros_like(S))
        mu_y, mu_x = logW.sum(-1, keepdim=True) / n.clamp_min(1), Sm.sum(-1, keepdim=True) / n.clamp_min(1)
        xc = torch.where(use, Sm - mu_x, torch.zeros_like(S))
        yc = torch.where(use, logW - mu_y, torch.zeros_like(S))
        sxx, sxy = (xc * xc).sum(-1), (xc * yc).sum(-1)
        valid = sxx > 1e-12
        if not bool(valid.any()):
            continue
        cs = (sxy[valid] / sxx[valid]).unique()
        cs = cs[torch.linspace(0, len(cs) - 1, min(len(cs), 64)).round().long()]
        for c in cs.tolist():  # the slices' own multiples: the one most slices agree with
            res = (yc - c * xc).abs().amax(-1) / (yc.abs().amax(-1) + xc.abs().amax(-1) * abs(c) + 1e-12)
            frac = float((res[valid] < 1e-2).float().mean())
            if best is None or (frac, abs(c)) > (best[1], abs(best[0])):
                best = (c, frac, (mu_y - c * mu_x).movedim(-1, ax))
    return best


def _predicted(S: Tensor, c: float, Xp: Tensor, ax: int, fill: float | None = None) -> tuple[Tensor, Tensor]:
    """softmax along ``ax`` of c·S with the entries ``Xp`` blocked (or set to ``fill``), and the
    slices it says something about (those that keep an entry)."""
    logits = c * S
    logits = logits.masked_fill(Xp, float("-inf")) if fill is None else torch.where(Xp, torch.full_like(S, fill),
                                                                                   logits)
    live = torch.ones_like(Xp) if fill is not None else (~Xp).any(ax, keepdim=True).expand_as(Xp)
    return torch.softmax(logits, ax).nan_to_num(), live


def _fits(W: Tensor, S: Tensor, c: float, Xp: Tensor, ax: int, fill: float | None = None) -> bool:
    Wp, live = _predicted(S, c, Xp, ax, fill)
    return bool(live.any()) and float((W - Wp).abs()[live].max()) < 2e-3


_MASKS = {
    "inverted": Finding("mask polarity inverted", "check the mask convention: the module attends exactly where the "
                        "mask says a key is blocked (True/1 means the opposite of what the module assumes).", "mask",
                        "zero weight on the blocked keys", "zero weight on the kept keys, weight on the blocked ones"),
    "first": Finding("the first sequence's mask used for the whole batch", "index the mask by the batch: mask[b] for "
                     "sequence b (a mask of shape (B, 1, 1, Lk) broadcasts over heads and queries, not over the "
                     "batch).", "mask", "each sequence's own keys blocked", "sequence 0's keys blocked in every "
                     "sequence"),
    "repeat": Finding("lengths repeated with repeat instead of repeat_interleave", "give every head of sequence b "
                      "sequence b's lengths: torch.repeat_interleave(valid_lens, num_heads, dim=0) matches the "
                      "(B*H, ...) order of transpose_qkv; valid_lens.repeat(num_heads) cycles through the batch.",
                      "mask", "head h of sequence b masked by sequence b's length",
                      "head h of sequence b masked by sequence (b*H + h) mod B's length"),
    "diag": Finding("causal mask off by one", "a position may attend to itself and earlier ones: keep j <= i "
                    "(torch.tril(ones(L, L)), diagonal 0; block with triu(..., diagonal=1)).", "mask",
                    "position i attends to keys 0..i", "position i attends to keys 0..i-1 (itself blocked)"),
    "ahead": Finding("causal mask lets each position see the next one", "keep j <= i: torch.tril(ones(L, L)) with "
                     "diagonal=0, not diagonal=1.", "mask", "position i attends to keys 0..i",
                     "position i attends to keys 0..i+1 (one step of the future)"),
    "none": Finding("mask not applied", "set the blocked scores to -inf (masked_fill(~keep, float('-inf')) or add "
                    "the additive mask) before the softmax.", "mask", "zero weight on the blocked keys",
                    "the blocked keys weighted as if unmasked"),
    "longer": Finding("valid lengths off by one (one key too many)", "keep the keys j < valid_len (positions "
                      "0..valid_len-1), not j <= valid_len.", "mask", "keys 0..len-1 of each sequence",
                      "keys 0..len (one padding key attended)"),
    "shorter": Finding("valid lengths off by one (one key too few)", "keep the keys j < valid_len (positions "
                       "0..valid_len-1): the last real key is blocked.", "mask", "keys 0..len-1 of each sequence",
                       "keys 0..len-2 (the last real key blocked)"),
}


def _mask_findings(W: Tensor, S: Tensor, X: Tensor, c: float, ax: int, causal: bool) -> list[Finding]:
    """Which blocking pattern reproduces the weights W (B, H, Lq, Lk) as a softmax along ``ax``
    of c·S: the spec's X (True = blocked), or a named mistake's, or a finite fill value."""
    if _fits(W, S, c, X, ax):
        return []
    Lq, Lk = W.shape[-2:]
    Bx, H = X.shape[:2]
    idx = (torch.arange(Bx)[:, None] * H + torch.arange(H)[None, :]) % Bx  # (B, H): the sequence .repeat(H) gives
    patterns = {"inverted": ~X, "first": X[:1].expand_as(X), "repeat": X[idx, 0]}
    if causal:
        eye = torch.eye(Lq, Lk, dtype=torch.bool)
        sup = torch.ones(Lq, Lk, dtype=torch.bool).triu(1) & ~torch.ones(Lq, Lk, dtype=torch.bool).triu(2)
        patterns.update(diag=X | eye, ahead=X & ~sup)
    prefix = X.any() and bool((X == X[:, :, :1, :].expand_as(X)).all()) and bool((X[..., 1:] >= X[..., :-1]).all())
    if prefix:  # key padding: each sequence keeps a prefix of its keys
        lens = (~X[:, 0, 0]).sum(-1)  # (B,)
        pos = torch.arange(Lk)
        for nm, d in (("longer", 1), ("shorter", -1)):
            patterns[nm] = (pos >= (lens + d).clamp(1, Lk)[:, None])[:, None, None, :].expand_as(X)
    patterns["none"] = torch.zeros_like(X)
    for nm, Xp in patterns.items():
        if not torch.equal(Xp, X) and _fits(W, S, c, Xp, ax):
            return [_MASKS[nm]]
    # a large positive fill (+1e9, or keep and block swapped in masked_fill): the blocked keys share the
    # weight evenly and the kept ones get none
    mixed = (~X).any(ax, keepdim=True) & X.any(ax, keepdim=True)
    nb = X.sum(ax, keepdim=True).clamp_min(1)
    even = torch.where(X, 1.0 / nb, torch.zeros_like(W))
    if bool(mixed.any()) and float((W - even).abs().masked_fill(~mixed.expand_as(W), 0).max()) < 1e-3:
        return [Finding("blocked scores filled with a large positive value", "fill the blocked scores with -inf "
                        "(or -1e9): a large positive fill gives the blocked keys all the weight, shared evenly.",
                        "mask", "blocked scores = -inf (zero weight)",
                        "the blocked keys share all the weight evenly; the kept keys get none")]
    # a finite fill: the blocked entries' logit, relative to a kept entry of the same slice
    Wm, Sm, Xm = W.movedim(ax, -1), S.movedim(ax, -1), X.movedim(ax, -1)
    ref = torch.where(~Xm, Wm, torch.zeros_like(Wm)).argmax(-1, keepdim=True)  # the largest kept entry
    lw_ref, s_ref = Wm.gather(-1, ref).clamp_min(1e-300).log(), Sm.gather(-1, ref)
    leak = Xm & (Wm > 1e-6) & (~Xm).any(-1, keepdim=True)
    if bool(leak.any()):
        f = (Wm.clamp_min(1e-300).log() - lw_ref + c * s_ref)[leak]
        fill = float(f.median())
        if _fits(W, S, c, X, ax, fill):
            shown = 0.0 if abs(fill) < 1e-3 else float(f"{fill:.3g}")
            return [Finding(f"blocked scores filled with {shown:g} instead of -inf", "fill the blocked scores with "
                            "-inf (or a large negative number like -1e9): a finite fill near the scores still gives "
                            "those keys weight.", "mask", "blocked scores = -inf (zero weight)",
                            f"blocked scores = {shown:g} (weight up to {float(W[X].max()):.3g} on blocked keys)")]
    Wp, live = _predicted(S, c, X, ax)
    got_w = int((X & (W > 1e-4) & live).sum())
    lost = int((~X & (W < 1e-6) & (Wp > 1e-3) & live).sum())
    return [Finding("mask applied wrongly", "build the keep mask so that exactly the padded (or future) keys are "
                    "blocked, and apply it to the scores before the softmax.", "mask",
                    f"zero weight on exactly the {int((X & live).sum())} blocked (query, key) pairs",
                    f"{got_w} blocked pairs with weight, {lost} kept pairs with zero weight")]


def localise(parts: Parts, H: int, run: Callable, q: Tensor, k: Tensor, v: Tensor,
             keep: Tensor | None, *, self_attn: bool, causal: bool, E: int, g: torch.Generator) -> list[Finding]:
    """Findings, stage by stage, for the module read as ``parts`` with H heads (its layers observed
    through ``parts``' hookable modules). ``run(q, k, v)`` calls the module (no grad, eval) and returns
    its output; ``keep`` (B, 1, Lq, Lk) is the spec's mask."""
    Bx, Lq, _ = q.shape
    Lk = k.shape[1]
    findings: list[Finding] = []
    roles = {"q": parts.q, "k": parts.k, "v": parts.v, "o": parts.o, "qkv": parts.qkv}
    seen: dict[str, list] = {r: [] for r in roles}
    swap: dict[str, Tensor] = {}

    def hook_for(role):
        def hook(m, args, out):
            seen[role].append((args[0] if args else None, out))
            if role in swap and role in ("v", "qkv"):
                return swap[role] if role == "v" else parts.put_v(out.double(), swap[role]).to(out.dtype)
            return None
        return hook

    handles = []
    for role, p in roles.items():
        if p is not None and len(p.modules) == 1:
            handles.append(p.modules[0].register_forward_hook(hook_for(role)))

    def call(q_, k_, v_):
        for lst in seen.values():
            lst.clear()
        out = run(q_, k_, v_)
        return out.detach().double(), {r: list(lst) for r, lst in seen.items()}

    try:
        out, obs = call(q, k, v)
        # 1. projections: which input reaches which projection (only separable with distinct inputs)
        probes = {"query": q, "key": k, "value": v}
        Qm, Km, Vm = parts.projections(q, k, v)  # the spec's Q, K, V (B, L, H*D)
        used = {"q": Qm, "k": Km, "v": Vm}
        if not self_attn and parts.qkv is None:
            for role, want in (("q", "query"), ("k", "key"), ("v", "value")):
                calls = obs[role]
                if not calls:
                    continue
                x, y = calls[0]
                used[role] = y.detach().double()
                if isinstance(x, Tensor) and not torch.equal(x, probes[want]):
                    got = next((n for n, t in probes.items() if x.shape == t.shape and torch.equal(x, t)), None)
                    if got is not None:
                        nm = {"q": "query", "k": "key", "v": "value"}[role]
                        findings.append(Finding(f"{nm} projection applied to the {got} input",
                                                f"apply W_{role} to the {want} input: {role.upper()} = W_{role}({want}).",
                                                "projections", f"W_{role}({want})", f"W_{role}({got})"))
        elif parts.qkv is not None and obs["qkv"] and self_attn:
            used["q"], used["k"], used["v"] = parts.fused(obs["qkv"][0][1].detach().double())
        # 2. output projection: the merged heads, observed or solved for
        M, o_ok = _merged(parts, obs, out, q, findings)
        if M is None:
            return findings
        # 3. values and merge: several calls with other values make the weights unique
        Ms, Vs = [M], [used["v"]]
        vins = [v] if not self_attn else None
        D = used["v"].shape[-1] // H
        n = min(8, Lk // D + 1)
        can_swap = parts.v is not None and obs["v"] if parts.qkv is None else bool(obs["qkv"])
        for _ in range(n - 1):
            if not self_attn:
                v2 = torch.randn(v.shape, generator=g, dtype=v.dtype)
                vins.append(v2)
                o2, ob2 = call(q, k, v2)
                V2 = ob2["v"][0][1].detach().double() if parts.qkv is None and ob2["v"] and len(parts.v.modules) == 1 \
                    else parts.projections(q, k, v2)[2]
            elif can_swap:
                V2 = torch.randn(used["v"].shape, generator=g, dtype=torch.float64)
                swap["qkv" if parts.qkv is not None else "v"] = V2.to(v.dtype)
                try:
                    o2, ob2 = call(q, k, v)
                finally:
                    swap.clear()
            else:
                break
            M2, _ = _merged(parts, ob2, o2, q, [])
            if M2 is None:
                break
            Ms.append(M2)
            Vs.append(V2)
        if len(Ms) * D <= Lk:  # the weights are not unique: nothing more can be located from outside
            return findings
        fin = torch.stack([torch.isfinite(m_).flatten(1).all(1) for m_ in Ms]).all(0)  # (B,): sequences without NaN
        if not bool(fin.any()):
            return findings
        if not bool(fin.all()):  # NaN rows (a fully blocked row, say) say nothing about the rest: left out
            Ms, Vs = [m_[fin] for m_ in Ms], [x[fin] for x in Vs]
            used = {r: t[fin] for r, t in used.items()}
            vins = None if vins is None else [x[fin] for x in vins]
            keep = None if keep is None else keep[fin]
            v = v[fin]
        hyps = [(m_ok, s_ok, src) for m_ok in (True, False, "interleaved") for s_ok in (True, False)
                for src in ("values", "keys", "queries", "value input", "W_v(key)", "W_v(query)")]
        v_hooked = parts.qkv is None and parts.v is not None and len(parts.v.modules) == 1
        best = None
        for merge_ok, split_ok, src in hyps:
            if src == "values":
                Vsrc = Vs
            elif src == "keys":
                Vsrc = [used["k"]] * len(Ms)
            elif src == "queries":
                if Lq != Lk:
                    continue
                Vsrc = [used["q"]] * len(Ms)
            elif src == "value input":
                if vins is None or len(vins) != len(Ms) or v.shape[-1] != used["v"].shape[-1]:
                    continue
                Vsrc = [x.double() for x in vins]
            else:  # an unobserved value projection fed the wrong input
                other = k if src == "W_v(key)" else q
                if self_attn or v_hooked or parts.v is None or other.shape[1] != Lk:
                    continue
                Vsrc = [parts.v(other)] * len(Ms)
            Oh = torch.cat([unmerge(m_, H, merge_ok) for m_ in Ms], -1)  # (B, H, Lq, n*D)
            Vh = torch.cat([split(x, H, split_ok) for x in Vsrc], -1)  # (B, H, Lk, n*D)
            W, res = _solve_weights(Oh, Vh)
            if res < 1e-4:
                best = (merge_ok, split_ok, src, W)
                break
        if best is None:
            findings.append(Finding("heads' outputs are not a weighting of the values", "multiply the attention "
                                    "weights (B, H, Lq, Lk) by the per-head values V (B, H, Lk, D), then merge the "
                                    "heads with out.transpose(1, 2).reshape(B, Lq, H*D).", "values",
                                    "each head's output = its weights @ its values",
                                    "no weighting of the values (or of the keys or queries) gives the merged heads"))
            return findings
        merge_ok, split_ok, src, W = best
        if merge_ok == "interleaved":
            findings.append(Finding("heads interleaved when merged", "concatenate the heads: out.transpose(1, 2)"
                                    ".reshape(B, Lq, H*D) (torch.cat(heads, -1), not torch.stack(heads, -1)"
                                    ".flatten(-2)), so head h's D features are columns h*D to h*D+D-1.",
                                    "heads merge", "(B, H, Lq, D) -> transpose(1, 2) -> (B, Lq, H*D), head by head",
                                    "(B, H, Lq, D) -> (B, Lq, D, H) -> (B, Lq, D*H): one feature of every head, "
                                    "then the next"))
        elif not merge_ok:
            findings.append(Finding("heads merged in the wrong order", "merge with out.transpose(1, 2).reshape(B, Lq, "
                                    "H*D): a plain reshape of (B, H, Lq, D) mixes heads and positions.", "heads merge",
                                    "(B, H, Lq, D) -> transpose(1, 2) -> (B, Lq, H*D)",
                                    "(B, H, Lq, D) reshaped to (B, Lq, H*D) without the transpose"))
        if src == "keys":
            findings.append(Finding("keys used as values", "multiply the weights by the projected values V = W_v(v), "
                                    "not the keys.", "values", "weights @ V", "weights @ K"))
        elif src == "queries":
            findings.append(Finding("queries used as values", "multiply the weights by the projected values "
                                    "V = W_v(v).", "values", "weights @ V", "weights @ Q"))
        elif src in ("W_v(key)", "W_v(query)"):
            got = "key" if src == "W_v(key)" else "query"
            findings.append(Finding(f"value projection applied to the {got} input", "apply W_v to the value input: "
                                    "V = W_v(value).", "projections", "W_v(value)", f"W_v({got})"))
        elif src == "value input":
            findings.append(Finding("value projection not applied", "project the values with W_v before weighting "
                                    "them.", "values", "weights @ W_v(v)", "weights @ v"))
        # 4. the weights: normalisation axis, scale, mask
        X = torch.zeros(W.shape, dtype=torch.bool) if keep is None else ~keep.expand(W.shape)
        qk = [(split_ok, used["q"], used["k"])]
        if split_ok:
            qk.append((False, used["q"], used["k"]))
        if not self_attn:  # the scores of the wrong projected tensors
            qk.append((split_ok, used["q"], used["v"], Finding("values used as keys", "compute the scores from the "
                                                               "keys: Q Kᵀ, with K = W_k(key).", "scores", "Q Kᵀ",
                                                               "Q Vᵀ")))
        if not self_attn and parts.qkv is None:  # unobserved projections fed the wrong input
            for role, nm, x in (("k", "value", v), ("k", "query", q), ("q", "key", k)):
                proj = getattr(parts, role)
                if proj is None or len(proj.modules) == 1 or x.shape[1] != (Lk if role == "k" else Lq):
                    continue
                alt = proj(x)
                Qa, Ka = (alt, used["k"]) if role == "q" else (used["q"], alt)
                full = {"q": "query", "k": "key"}[role]
                qk.append((split_ok, Qa, Ka, Finding(f"{full} projection applied to the {nm} input",
                                                     f"apply W_{role} to the {full} input.", "projections",
                                                     f"W_{role}({full})", f"W_{role}({nm})")))
        findings += _weights(W, qk, X, H, E, parts, causal)
        return findings
    finally:
        for h in handles:
            h.remove()


def _merged(parts: Parts, obs: dict, out: Tensor, q: Tensor, findings: list[Finding]):
    """The merged heads (B, Lq, H*D) the output projection received, and whether the output is
    that projection's output; appends what it finds wrong."""
    o = parts.o
    if o is None:
        findings.append(Finding("output projection missing", "project the concatenated heads with W_o (a final "
                                "Linear of d_model inputs and outputs) before returning.", "output projection",
                                "W_o(concatenated heads)", "no output projection layer in the module"))
        return out, False
    if o.modules and len(o.modules) == 1:
        calls = obs["o"]
        if not calls:
            if out.shape[-1] == o.weight.shape[1]:
                findings.append(Finding("output projection missing", f"return {o.name}(concatenated heads): the "
                                        "layer is defined but never called.", "output projection",
                                        f"{o.name}(concatenated heads)", f"{o.name} never called"))
                return out, False
            return None, False
        x, y = calls[-1]
        x, y = x.detach().double(), y.detach().double()
        if y.shape == out.shape and rel(out, y) > 1e-4:
            d = out - y
            if d.shape == q.shape and rel(d, q.double()) < 1e-4:
                findings.append(Finding("residual connection inside attention", "return W_o(concatenated heads); the "
                                        "residual connection (x + attention(x)) belongs to the block around the "
                                        "attention, not inside it.", "output projection", "W_o(heads)",
                                        "W_o(heads) + the query input"))
            else:
                findings.append(Finding("output changed after the output projection", f"return {o.name}(heads) as "
                                        "it is.", "output projection", f"the output of {o.name}",
                                        f"something else (rel. difference {rel(out, y):.2e})"))
            return x, False
        return x, True
    # raw parameters: solve out = M Woᵀ + b for M
    if out.shape[-1] != o.weight.shape[0]:
        findings.append(Finding("output projection missing", "project the concatenated heads with W_o before "
                                "returning.", "output projection", f"output width {o.weight.shape[0]}",
                                f"output width {out.shape[-1]}"))
        return out, False
    y = out - (o.bias if o.bias is not None else 0)
    M = y @ torch.linalg.pinv(o.weight).T  # (B, Lq, E) @ (E, H*D) -> (B, Lq, H*D)
    if rel(F.linear(M, o.weight, o.bias), out) > 1e-4:
        findings.append(Finding("output is not the output projection's", f"return the concatenated heads times "
                                f"{o.name}.", "output projection", f"an output in the span of {o.name}",
                                "an output no input to W_o gives"))
        return None, False
    return M, True


def _weights(W: Tensor, qk: list, X: Tensor, H: int, E: int, parts: Parts, causal: bool) -> list[Finding]:
    """What is wrong with the solved weights W (B, H, Lq, Lk) given the scores' candidates."""
    D = qk[0][1].shape[-1] // H
    expected = parts.scale if parts.scale is not None else 1 / math.sqrt(D)
    split_finding = Finding("heads split without the transpose", "split the heads with x.view(B, L, H, D)"
                            ".transpose(1, 2): a plain view(B, H, L, D) mixes positions and heads.", "heads split",
                            "(B, L, H*D) -> view(B, L, H, D) -> transpose(1, 2)",
                            "(B, L, H*D) viewed as (B, H, L, D) directly")
    ax = _normalised_axis(W, X)
    if ax is None:  # log-probabilities: exp(W) normalised
        We = W.clamp(max=50).exp()
        if _normalised_axis(We, X) is not None:
            return [Finding("log_softmax instead of softmax", "weigh the values with softmax(scores, dim=-1) (the "
                            "probabilities), not log_softmax (their logarithms).", "normalisation",
                            "softmax(scores) @ V", "log_softmax(scores) @ V")] + _weights(
                                We, qk, X, H, E, parts, causal)
    for ok, Q, K, *extra in qk:
        S = split(Q, H, ok) @ split(K, H, ok).transpose(-2, -1)  # (B, H, Lq, Lk), unscaled
        pre = ([] if ok else [split_finding]) + list(extra)
        if ax is not None:
            fit = _fit_logits(W, S, X, ax)
            if fit is None or fit[1] < 0.4:
                continue
            c, _, r = fit
            out = list(pre)
            if ax != -1:
                out.append(Finding("softmax over the wrong axis", "take the softmax over the keys: the last axis of "
                                   "the scores (B, H, Lq, Lk), dim=-1.", "normalisation",
                                   "weights summing to 1 over the keys", f"weights summing to 1 over {AXES[ax]}"))
            sf = _scale_finding(c, expected, D, E, H, parts.scale is not None)
            if sf is not None:
                out.append(sf)
            out += _mask_findings(W, S, X, c, ax, causal)
            return out
        # not normalised over any axis: the raw scores, or a softmax before the mask
        live = ~X
        fit = _fit_logits(W, S, X, -1)
        if fit is not None and fit[1] >= 0.4:
            c, _, r = fit
            lse = -torch.logsumexp(c * S, -1, keepdim=True)
            rows = live.any(-1, keepdim=True)
            if float((r - lse)[rows].abs().max()) < 1e-2:
                out = pre + [Finding("mask applied after the softmax", "mask the scores (-inf where blocked) before "
                                     "the softmax; zeroing weights after it leaves rows that no longer sum to 1.",
                                     "normalisation", "softmax over the kept keys (rows sum to 1)",
                                     "softmax over all keys, then the blocked ones zeroed (rows sum to "
                                     f"{float(W.sum(-1).min()):.3f}-{float(W.sum(-1).max()):.3f})")]
                sf = _scale_finding(c, expected, D, E, H, parts.scale is not None)
                return out + ([sf] if sf else [])
        x, y = S[live], W[live]
        c = float((x * y).sum() / (x * x).sum().clamp_min(1e-300))
        if float((y - c * x).abs().max()) < 1e-3 * (float(y.abs().max()) + 1e-12):
            out = pre + [Finding("softmax skipped (values times raw scores)", "apply the softmax to the scaled scores "
                                 "and multiply the values by those weights, not by the raw scores.", "normalisation",
                                 "softmax(scores) @ V", "scores @ V (no softmax)")]
            sf = _scale_finding(c, expected, D, E, H, parts.scale is not None)
            return out + ([sf] if sf else [])
        sig = W[live].clamp(1e-12, 1 - 1e-12)
        lg = (sig / (1 - sig)).log()
        cs = float((x * lg).sum() / (x * x).sum().clamp_min(1e-300))
        if float((lg - cs * x).abs().max()) < 1e-2 * (float(lg.abs().max()) + 1e-12):
            return pre + [Finding("sigmoid instead of softmax", "normalise the scores with softmax over the keys "
                                  "(dim=-1): the weights of a query must sum to 1.", "normalisation",
                                  "softmax(scores, dim=-1)", "sigmoid(scores)")]
    sums = W.sum(-1)
    if ax is not None:
        return [Finding("weights are not a softmax of Q Kᵀ", "the scores are the dot products of each head's "
                        "queries and keys, Q Kᵀ / sqrt(d_k); check which tensors enter the product.", "scores",
                        "log weights = Q Kᵀ × scale + a constant per row",
                        f"weights summing to 1 over {AXES[ax]} that no multiple of Q Kᵀ gives")]
    return [Finding("weights are not normalised", "apply softmax over the keys (dim=-1) to the scaled scores.",
                    "normalisation", "each query's weights summing to 1",
                    f"row sums {float(sums.min()):.3f} to {float(sums.max()):.3f}")]
