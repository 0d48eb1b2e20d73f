"""The weights stage of the localisation: given the attention weights a module really used (solved
from its per-head outputs and values, :mod:`multihead.grader.stages`), what normalises them, what
scale and what mask reproduce them. Each named mistake is a hypothesis that must reproduce the
weights exactly: the softmax's axis, the scale (fitted: log W = c Q Kᵀ + a constant per row), the
blocking pattern (inverted, the first sequence's, repeat for repeat_interleave, causal off by one,
lengths off by one, a finite or positive fill), log_softmax, sigmoid, the mask after the softmax, no
softmax, and the weights transposed (keys attending to queries).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from multihead.grader.parts import Parts, split
from multihead.grader.report import Finding

__all__ = ["AXES", "name_scale", "solve_weights", "weights_findings"]


#: the score scale the Keras tutorial's code uses: 1/sqrt of its d_k, the whole projection's width (h heads)
TOTAL = "1/sqrt(h·d_k)"

_SCALES = (("1/sqrt(d_k)", lambda D, E, H: 1 / math.sqrt(D)), ("1/d_k", lambda D, E, H: 1 / D),
           ("1 (not scaled)", lambda D, E, H: 1.0), ("1/sqrt(d_model)", lambda D, E, H: 1 / math.sqrt(E)),
           ("1/d_model", lambda D, E, H: 1 / E), (TOTAL, lambda D, E, H: 1 / math.sqrt(H * D)),
           ("sqrt(d_k)", lambda D, E, H: math.sqrt(D)),
           ("d_k", lambda D, E, H: float(D)), ("1/sqrt(num_heads)", lambda D, E, H: 1 / math.sqrt(H)),
           ("1/num_heads", lambda D, E, H: 1 / H), ("1/(2 sqrt(d_k))", lambda D, E, H: 0.5 / math.sqrt(D)),
           ("2/sqrt(d_k)", lambda D, E, H: 2 / math.sqrt(D)), ("-1/sqrt(d_k)", lambda D, E, H: -1 / math.sqrt(D)))


def name_scale(c: float, D: int, E: int, H: int) -> str:
    """The expression a fitted score multiple ``c`` is: '1/d_k', '1/sqrt(d_model)', ... or its value."""
    for expr, f in _SCALES:
        if D == E and expr in ("1/sqrt(d_model)", "1/d_model"):
            continue
        if expr == TOTAL and (H == 1 or H * D == E):  # then it is 1/sqrt(d_k) or 1/sqrt(d_model), named as such
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
    advice = f"multiply Q Kᵀ by {want} (d_k = d_model / num_heads, the size of one head), once, before the mask " \
             "and the softmax."
    if expr == TOTAL:  # what the Keras tutorial's code does: a course that follows it says so
        name = "scores scaled by 1/sqrt(h·d_k), the whole projection's width"
        advice += (f" (The Keras tutorial's code divides by the square root of its total d_k, h·d_k here; a course "
                   f"that follows it grades with --scale {c:.6g}, or check(..., mapping={{'scale': {c:.6g}}}).)")
    return Finding(name, advice, "scores", f"Q Kᵀ × {want}", f"Q Kᵀ × {found}")


def solve_weights(Oh: Tensor, V: Tensor) -> tuple[Tensor, float]:
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



_SPLIT = Finding("heads split without the transpose", "split the heads with x.view(B, L, H, D).transpose(1, 2): a "
                 "plain view(B, H, L, D) mixes positions and heads.", "heads split",
                 "(B, L, H*D) -> view(B, L, H, D) -> transpose(1, 2)", "(B, L, H*D) viewed as (B, H, L, D) directly")
_SPLIT_INTERLEAVED = Finding(
    "heads split interleaved", "split the heads as the course's transpose_qkv does, x.view(B, L, H, D).transpose(1, "
    "2), so head h takes features h*D to h*D+D-1 (with view(B, L, D, H) head h takes every H-th feature: the same "
    "attention with its projections' rows permuted, not the course's module for the same weights).", "heads split",
    "(B, L, H*D) -> view(B, L, H, D) -> transpose(1, 2)", "(B, L, D*H) -> view(B, L, D, H) -> (B, H, L, D): feature d "
    "of head h at d*H + h")
TRANSPOSED = Finding("attention weights transposed", "weigh the values with softmax(Q Kᵀ) as it is (B, H, Lq, Lk): "
                     "transposing it makes each key attend to the queries.", "normalisation",
                     "weights (B, H, Lq, Lk), each query's row summing to 1", "the weights' transpose: keys' rows")


def weights_findings(W: Tensor, qk: list, X: Tensor, parts: Parts, *, H: int, E: int, causal: bool) -> list[Finding]:
    """What is wrong with the solved weights W (B, H, Lq, Lk), given candidates for the scores ``qk``:
    (split ok, Q, K, findings that candidate stands for...). The first candidate whose scores reproduce
    W names the mistakes; none: a generic finding."""
    D = qk[0][1].shape[-1] // H
    scale = _Scale(parts.scale if parts.scale is not None else 1 / math.sqrt(D), D, E, H, parts.scale is not None)
    ax = _normalised_axis(W, X)
    if ax is None:  # log-probabilities: exp(W) normalised
        We = W.clamp(max=50).exp()
        if _normalised_axis(We, X) is not None:
            return [Finding("log_softmax instead of softmax", "weigh the values with softmax(scores, dim=-1) (the "
                            "probabilities), not log_softmax (their logarithms).", "normalisation",
                            "softmax(scores) @ V", "log_softmax(scores) @ V")] + weights_findings(
                                We, qk, X, parts, H=H, E=E, causal=causal)
    for ok, Q, K, *extra in qk:
        S = split(Q, H, ok) @ split(K, H, ok).transpose(-2, -1)  # (B, H, Lq, Lk), unscaled
        pre = ([] if ok is True else [_SPLIT_INTERLEAVED] if ok == "interleaved" else [_SPLIT]) + list(extra)
        found = _normalised(W, S, X, ax, scale, causal) if ax is not None else _unnormalised(W, S, X, scale)
        if found is None:
            continue
        if TRANSPOSED in pre and found and found[0].name == "softmax over the wrong axis":
            found = found[1:]  # the transpose is the wrong axis
        return pre + found
    if ax is not None:
        return [Finding("weights are not a softmax of Q Kᵀ", "the scores are the dot products of each head's "
                        "queries and keys, Q Kᵀ / sqrt(d_k); check which tensors enter the product.", "scores",
                        "log weights = Q Kᵀ × scale + a constant per row",
                        f"weights summing to 1 over {AXES[ax]} that no multiple of Q Kᵀ gives")]
    sums = W.sum(-1)
    return [Finding("weights are not normalised", "apply softmax over the keys (dim=-1) to the scaled scores.",
                    "normalisation", "each query's weights summing to 1",
                    f"row sums {float(sums.min()):.3f} to {float(sums.max()):.3f}")]


class _Scale:
    """The expected score scale and what naming a fitted one needs (D, E, H; whether the module gave it)."""

    def __init__(self, expected: float, D: int, E: int, H: int, given: bool):
        self.expected, self.D, self.E, self.H, self.given = expected, D, E, H, given

    def finding(self, c: float) -> list[Finding]:
        f = _scale_finding(c, self.expected, self.D, self.E, self.H, self.given)
        return [] if f is None else [f]


def _normalised(W: Tensor, S: Tensor, X: Tensor, ax: int, scale: _Scale, causal: bool) -> list[Finding] | None:
    """Weights that sum to 1 over axis ``ax``: a softmax of c·S over it? Then the axis, the scale c and the
    mask that reproduce W; None when no multiple of S fits."""
    fit = _fit_logits(W, S, X, ax)
    if fit is None or fit[1] < 0.4:
        return None
    c = fit[0]
    out = []
    if ax != -1:
        out.append(Finding("softmax over the wrong axis", "take the softmax over the keys: the last axis of the "
                           "scores (B, H, Lq, Lk), dim=-1.", "normalisation", "weights summing to 1 over the keys",
                           f"weights summing to 1 over {AXES[ax]}"))
    return out + scale.finding(c) + _mask_findings(W, S, X, c, ax, causal)


def _unnormalised(W: Tensor, S: Tensor, X: Tensor, scale: _Scale) -> list[Finding] | None:
    """Weights normalised over no axis: a softmax before the mask, the raw scores, or a sigmoid; None when
    none of them reproduces W from S."""
    live = ~X
    fit = _fit_logits(W, S, X, -1)
    if fit is not None and fit[1] >= 0.4:
        c, _, r = fit
        lse = -torch.logsumexp(c * S, -1, keepdim=True)
        rows = live.any(-1, keepdim=True)
        if float((r - lse)[rows].abs().max()) < 1e-2:
            return [Finding("mask applied after the softmax", "mask the scores (-inf where blocked) before the "
                            "softmax; zeroing weights after it leaves rows that no longer sum to 1.", "normalisation",
                            "softmax over the kept keys (rows sum to 1)", "softmax over all keys, then the blocked "
                            f"ones zeroed (rows sum to {float(W.sum(-1).min()):.3f}-{float(W.sum(-1).max()):.3f})")
                    ] + scale.finding(c)
    x, y = S[live], W[live]
    c = float((x * y).sum() / (x * x).sum().clamp_min(1e-300))
    if float((y - c * x).abs().max()) < 1e-3 * (float(y.abs().max()) + 1e-12):
        return [Finding("softmax skipped (values times raw scores)", "apply the softmax to the scaled scores and "
                        "multiply the values by those weights, not by the raw scores.", "normalisation",
                        "softmax(scores) @ V", "scores @ V (no softmax)")] + scale.finding(c)
    sig = W[live].clamp(1e-12, 1 - 1e-12)
    lg = (sig / (1 - sig)).log()
    cs = float((x * lg).sum() / (x * x).sum().clamp_min(1e-300))
    if float((lg - cs * x).abs().max()) < 1e-2 * (float(lg.abs().max()) + 1e-12):
        return [Finding("sigmoid instead of softmax", "normalise the scores with softmax over the keys (dim=-1): "
                        "the weights of a query must sum to 1.", "normalisation", "softmax(scores, dim=-1)",
                        "sigmoid(scores)")]
    return None
