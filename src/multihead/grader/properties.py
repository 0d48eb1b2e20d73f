"""What can be established about a module from the outside, without reading its parts: each check
is a small function of the :class:`~multihead.grader.session.Session` and the base call, returning
its :class:`~multihead.grader.report.Check` (and, where the property itself names the mistake, a
:class:`~multihead.grader.report.Finding`).

A correct multi-head attention module, whatever its style, has every one of these properties:
deterministic in eval mode (no dropout, no random draw in forward); the caller's tensors unchanged by a call; no
state kept between calls (a call after others gives what a fresh copy of the module gives); each head its own
weights; each sequence independent of the others, in batches of any size; none of the calls a course forbids;
masked keys without
influence; causal when meant to be; gradients reaching every parameter; positions permuted ->
outputs permuted (self-attention); the keys' order irrelevant and, with every value vector equal,
an output that does not depend on the queries or keys (each query's weights sum to 1: cross-attention);
finite and right when the scores are large (a softmax that subtracts each row's maximum).
"""

from __future__ import annotations

import torch
from torch import Tensor

from multihead.grader.report import Check, Finding
from multihead.grader.session import LK, Inputs, Session, tolerance
from multihead.grader.subject import NO_FRESH, Description, Reply

__all__ = ["Base", "rel", "tolerance"]



def rel(a: Tensor, b: Tensor) -> float:
    """max |a - b| / max |b|; NaN in the same places counts as equal, NaN in one only as inf."""
    a, b = a.detach().double(), b.detach().double()
    na, nb = torch.isnan(a), torch.isnan(b)
    if not torch.equal(na, nb):
        return float("inf")
    a, b = a.masked_fill(na, 0.0), b.masked_fill(nb, 0.0)
    if not bool(torch.isfinite(a).all()) or not bool(torch.isfinite(b).all()):
        return 0.0 if torch.equal(a, b) else float("inf")
    return float((a - b).abs().max() / (b.abs().max() + 1e-12))


class Base:
    """The base call: the probe inputs, the output (B, Lq, ·) float64, the weights it returned (or None)."""

    def __init__(self, x: Inputs, out: Tensor, weights: Tensor | None):
        self.x, self.out, self.weights = x, out, weights


def again(s: Session, b: Base, forbid: tuple = ()) -> Reply:
    """The base call made again, its random draws (and its use of what ``forbid`` names) watched: what
    :func:`determinism`, :func:`inputs_unchanged` and :func:`no_forbidden` read."""
    x = b.x
    return s.call(x.q, x.k, x.v, x.keep, x.lens, watch=True, forbid=tuple(forbid))


def no_forbidden(r: Reply, forbid: tuple) -> tuple[Check, Finding | None]:
    """The call used none of the torch functions and modules the course forbids (``r``: :func:`again`, observed:
    a function called, a module's forward run -- whatever the file's text says)."""
    if not r.called:
        return Check("no forbidden calls", True, "", f"watched: {', '.join(forbid)}"), None
    used = ", ".join(r.called)
    return Check("no forbidden calls", False, f"uses {used}"), Finding(
        f"uses {used}, which the course forbids", f"compute attention yourself, without {used}: the projections, "
        "Q Kᵀ scaled, the mask, the softmax and the weighted values, each written out.", "forbidden calls",
        f"none of {', '.join(forbid)}", f"forward calls {used}")


def determinism(s: Session, b: Base, r: Reply) -> tuple[Check, Finding | None]:
    """The same input twice in eval mode gives the same output (``r``: :func:`again`), to the rounding of the probes'
    dtype (``s.tol``: the second call may take another kernel -- torch.nn.MultiheadAttention's fast path is not taken
    while a call is watched --, a correct module is never failed on float rounding). What changes it is named by
    what the call was seen doing: a dropout that drops in eval, or random numbers drawn in forward (a layer built
    there); neither seen, the finding is left to :func:`no_state`."""
    if r.error is not None or r.out is None:
        return Check("eval mode deterministic", False, "raises", r.error or "no output"), None
    again = r.out.double()
    e = rel(again, b.out) if again.shape == b.out.shape else float("inf")
    det = e <= s.tol
    figure = (f"rel. diff {e:.2e} (rounding: <= {s.tol:.1e})" if e else "") if det else \
        f"rel. diff {e:.3g}" if again.shape == b.out.shape else f"shape {tuple(again.shape)}"
    c = Check("eval mode deterministic", det, figure)
    if det:
        return c, None
    if "dropout" in r.drawn:
        return c, Finding("dropout active in eval", "apply dropout only in training (nn.Dropout follows module.eval(); "
                          "F.dropout needs training=self.training).", "normalisation",
                          "the same output for the same input in eval mode", "outputs that change: a dropout drops "
                          "in eval mode")
    if r.drawn:
        drawn = ", ".join(dict.fromkeys(r.drawn))
        return c, Finding("builds a layer / draws random numbers inside forward", "build every layer and draw every "
                          "weight once, in __init__ (self.W_o = nn.Linear(...)), and call it in forward: a layer built "
                          "(or torch.randn drawn) in forward is new at every call and is never trained.", "projections",
                          "the same output for the same input in eval mode, from the module's own parameters",
                          f"outputs that change: forward draws random numbers ({drawn})")
    return c, None


def inputs_unchanged(s: Session, b: Base, r: Reply) -> tuple[Check, Finding | None]:
    """The caller's tensors are the same after a call (``r``: :func:`again`, whose inputs the subject compared with
    copies): values and shape of q, k, v and the mask. (Every call is given copies, so the other checks stand.)"""
    if r.error is not None:
        return Check("inputs unchanged by a call", None, "n/a", "the call raised"), None
    if not r.changed:
        return Check("inputs unchanged by a call", True), None
    names = ", ".join(r.changed)
    return Check("inputs unchanged by a call", False, f"{names} changed"), Finding(
        "changes its caller's tensors", "compute new tensors instead of writing into the inputs: q = q * s (not q *= s "
        "or q.mul_(s)), m = mask.unsqueeze(1) (not mask.unsqueeze_(1)), ~mask (not mask.logical_not_()): the "
        "caller's tensors are theirs, used again after the call.", "inputs",
        "q, k, v and the mask as they were given, after the call", f"the call wrote into {names}")


def no_state(s: Session, b: Base) -> tuple[Check, Finding | None]:
    """A call with other inputs (and another mask) after every call so far gives what a fresh copy of the module,
    never called, gives: nothing of one call (cached keys or mask, a counter) is kept for the next."""
    x = s.inputs()
    if x.lens is not None:  # another mask too: each sequence's padding moves to another row
        x = x._replace(lens=x.lens.flip(0), keep=x.keep.flip(0))
    live = s.call(x.q, x.k, x.v, x.keep, x.lens)
    fresh = s.call(x.q, x.k, x.v, x.keep, x.lens, fresh=True)
    if fresh.error is not None and fresh.error.startswith(NO_FRESH):
        return Check("no state between calls", None, "n/a", fresh.error, waived=True), None
    if (live.error is None) != (fresh.error is None) or (live.out is None) != (fresh.out is None):
        e = float("inf")
    elif live.out is None:
        return Check("no state between calls", None, "n/a", "the call raised"), None
    else:
        e = rel(live.out, fresh.out) if live.out.shape == fresh.out.shape else float("inf")
    ok = e <= s.tol
    c = Check("no state between calls", ok, f"rel. diff {e:.2e}")
    return c, None if ok else Finding(
        "keeps state between calls", "compute every call from its own inputs: keep nothing of one call for the next "
        "(cached keys, values or mask, a counter, a running statistic); a cache belongs to the caller, passed in and "
        "returned.", "inputs", "a call with other inputs gives what a fresh module gives",
        f"outputs {'that differ by ' + format(e, '.2e') + ' (relative)' if e < float('inf') else 'unlike'} those of "
        "a fresh copy of the module given the same inputs")


def _rows(x: Inputs, idx: list[int]) -> Inputs:
    """The probe's sequences ``idx`` (repeats allowed) as a batch; one tensor stays one (self-attention)."""
    i = torch.tensor(idx)
    q = x.q[i]
    k = q if x.k is x.q else x.k[i]
    v = q if x.v is x.q else k if x.v is x.k else x.v[i]
    return Inputs(q, k, v, None if x.lens is None else x.lens[i], None if x.keep is None else x.keep[i])


#: the batches the batch check runs: each sequence alone, two, and five (the batch size is not hard-coded)
BATCHES = ([0], [1], [2], [0, 1], [0, 1, 2, 0, 1])


def batch_independence(s: Session, b: Base, det: bool) -> tuple[Check, Finding | None]:
    """Each sequence's output is the one it has run alone, and in batches of 1, 2, 3 and 5 (:data:`BATCHES`)."""
    if not det:  # two calls already differ: a difference here says nothing about the other sequences
        return Check("batch independence", None, "not measured", "the output of a call depends on more than its "
                     "inputs: it changes from call to call in eval mode, or with the calls before (see above)"), None
    worst, at = 0.0, 0
    for idx in BATCHES:
        if max(idx) >= b.x.q.shape[0]:
            continue
        x = _rows(b.x, idx)
        r = s.call(x.q, x.k, x.v, x.keep, x.lens)
        if r.error is not None or r.out is None:
            return Check("batch independence", False, f"raises at batch size {len(idx)}", r.error or "no output"), \
                Finding("the batch size is hard-coded", "read the batch size from the input (B = q.shape[0]) and "
                        "reshape with it (or with -1): a module must take any batch.", "heads split",
                        f"any batch size (tried {', '.join(str(len(i)) for i in BATCHES)})",
                        f"raises at batch size {len(idx)}: {(r.error or 'no output')[:200]}")
        out = r.out.double()
        e = rel(out, b.out[torch.tensor(idx)]) if out.shape[1:] == b.out.shape[1:] and len(out) == len(idx) else \
            float("inf")
        if e > worst:
            worst, at = e, len(idx)
    ok = worst <= s.tol
    c = Check("batch independence", ok, f"rel. diff {worst:.2e}", "" if ok else
              f"a sequence's output depends on the other sequences of the batch (batch size {at})")
    return c, None if ok else Finding(
        "batch rows tied together", "keep the batch axis apart: split heads as (B, L, E) -> (B, L, H, D) with B from "
        "the input, and take every product, softmax and sum over one sequence's own keys; never merge the batch "
        "with the positions or the heads.", "heads split", "each sequence's output equal to that sequence run alone",
        f"outputs that differ by {worst:.2e} (relative) from the sequences run alone (batch size {at})")


def own_weights(desc: Description) -> tuple[Check, Finding | None]:
    """Every head its own weights: no submodule with parameters (or Parameter) sits twice in one list or dict."""
    if not desc.shared:
        return Check("heads have their own weights", True), None
    names = "; ".join(" = ".join(g[:4]) + (" = ..." if len(g) > 4 else "") for g in desc.shared[:3])
    return Check("heads have their own weights", False, f"{sum(len(g) for g in desc.shared)} entries, "
                 f"{len(desc.shared)} module{'s' * (len(desc.shared) != 1)}", names), Finding(
        "the heads share one set of weights", "build each head anew: nn.ModuleList(Head(...) for _ in range(h)); "
        "[Head(...)] * h (or a list of one head repeated) puts one head, its weights, h times.", "projections",
        "each head its own W_q, W_k, W_v", f"one module, the same weights, under {names}")


def masked_keys(s: Session, b: Base) -> Check:
    """Keys (and values) past each sequence's length changed: no output changes. Cross-attention is probed at Lq != Lk
    and again at Lq == Lk with queries, keys and values of their own, in the mask's form (a mask applied along the
    query axis shows only there: at Lq != Lk its shapes tell the axes apart)."""
    e = _masked_change(s, b.x, b.out)
    if s.self_attn or s.causal or s.square:
        return Check("masked keys have no influence", e <= s.tol, f"rel. change {e:.2e}")
    x = s.inputs(LK, LK)  # Lq == Lk: distinct queries, keys and values
    try:
        e2 = _masked_change(s, x, s.out(x.q, x.k, x.v, x.keep, x.lens))
    except RuntimeError as err:
        return Check("masked keys have no influence", False, "raises at Lq == Lk", str(err).splitlines()[0][:200])
    ok = max(e, e2) <= s.tol
    only = not ok and e <= s.tol  # right where the lengths differ, wrong where they are equal
    return Check("masked keys have no influence", ok, f"rel. change {max(e, e2):.2e}", "" if not only else
                 f"only at Lq == Lk = {LK} ({e:.2e} at Lq = {b.x.q.shape[1]}, Lk = {b.x.k.shape[1]}): a mistake the "
                 "lengths hide when they differ, such as the mask applied along the query axis")


def _masked_change(s: Session, x: Inputs, out: Tensor) -> float:
    """How much the output ``out`` of the call on ``x`` changes when the keys and values past each sequence's length
    change (relative; self-attention: the outputs of the real positions)."""
    Lk = x.k.shape[1]
    k2, v2 = x.k.clone(), x.v.clone()
    blocked = ~(torch.arange(Lk) < x.lens[:, None])  # (B, Lk)
    k2[blocked] += 3.0
    v2[blocked] -= 3.0
    if s.self_attn:
        pert = s.out(k2, k2, k2, x.keep, x.lens)
        return rel(pert[~blocked], out[~blocked])
    pert = s.out(x.q, k2, v2, x.keep, x.lens)
    return rel(pert, out)


def fully_masked(s: Session, b: Base) -> Check:
    x = b.x
    full, lens0 = x.keep.clone(), x.lens.clone()
    full[0], lens0[0] = False, 0
    r = s.call(x.q, x.k, x.v, full, lens0)
    if r.error is not None or r.out is None:
        return Check("fully masked rows finite", False, "raises", r.error or "no output", severity="warning")
    fin = bool(torch.isfinite(r.out).all())
    return Check("fully masked rows finite", fin, "" if fin else "NaN or inf", "" if fin else
                 "a query with every key masked gives NaN (torch.nn does too; the course never asks for it)",
                 severity="warning")


def causality(s: Session, b: Base) -> list[Check]:
    """Position 0's output unchanged when every later position changes, and no gradient from them: the later
    queries, keys and values all (a causal module called with queries, keys and values of its own, Lq = Lk)."""
    x = b.x

    def later_changed(t):
        t = t.clone()
        t[:, 1:] += 2.0
        return t

    if s.self_attn:
        xf = later_changed(x.q)
        of = s.out(xf, xf, xf, x.keep, x.lens)
    else:
        kf = later_changed(x.k)
        of = s.out(later_changed(x.q), kf, kf if x.v is x.k else later_changed(x.v), x.keep, x.lens)
    e = rel(of[:, 0], b.out[:, 0])
    checks = [Check("causal: position 0 unchanged when the future changes", e <= s.tol, f"rel. change {e:.2e}")]
    cot = torch.zeros(b.out.shape, dtype=b.out.dtype)
    cot[:, 0] = 1.0  # d (sum of position 0's outputs) / d inputs
    r = s.call(x.q, x.k, x.v, x.keep, x.lens, cotangent=cot)
    grads = [g.double() for n, g in r.grads.items() if n in ("q", "k", "v")]
    leak = max(float(g[:, 1:].abs().max()) for g in grads) if "q" in r.grads else float("nan")
    present = max(float(g[:, :1].abs().max()) for g in grads) if grads else 0.0  # d out_0 / d x_0: its size
    checks.append(Check("causal: no influence from the future", "q" in r.grads and leak <= s.tol * present,
                        f"max |d out_0 / d x_j>0| {leak:.2e}"))
    return checks


def weights_seen(s: Session, b: Base) -> list[Check]:
    """Returned weights sum to 1 per row; otherwise whether any attribute keeps them (a warning)."""
    Lq, Lk = b.x.q.shape[1], b.x.k.shape[1]
    w = b.weights
    checks = []
    shown = w is not None and tuple(w.shape[-2:]) == (Lq, Lk)
    if shown:
        sums = w.double().sum(-1)
        tol = tolerance(w.dtype, s.terms) if w.is_floating_point() else s.tol  # rounding in the weights' own dtype
        ok = bool(((sums - 1).abs() <= tol).all() | (sums.abs() <= tol).all())
        checks.append(Check("returned weights rows sum to 1", ok, f"row sums {float(sums.min()):.4f}-"
                                                                 f"{float(sums.max()):.4f}"))
    else:
        shown = bool(s.call(b.x.q, b.x.k, b.x.v, b.x.keep, b.x.lens, kept=True).kept)
    checks.append(Check("attention weights can be seen", shown, "", "" if shown else "neither returned nor kept as "
                        "an attribute: return them (or keep them, as the course's attention_weights) to show every "
                        "head's weights", severity="warning"))
    return checks


def gradients(s: Session, b: Base, trainable: tuple[str, ...]) -> Check:
    """A random cotangent of the output, back: every trainable parameter gets a gradient that is not zero (the
    check's detail names those it never reaches: :func:`own_finding` says how to keep them on the graph)."""
    x = b.x
    cot = torch.randn(b.out.shape, generator=s.g, dtype=torch.float64)
    r = s.call(x.q, x.k, x.v, x.keep, x.lens, cotangent=cot)
    if r.error is not None:
        return Check("gradients reach every parameter", False, "backward raises", r.error)
    dead = [n for n in trainable if (g := r.grads.get(f"param.{n}")) is None or not bool(g.abs().sum())]
    return Check("gradients reach every parameter", not dead, f"{len(dead)} without" if dead else "",
                 ", ".join(dead[:4]) + (f" and {len(dead) - 4} more" if len(dead) > 4 else ""))


def _no_gradient(c: Check) -> Finding:
    """The finding of "gradients reach every parameter": the parameters it never reaches (``c.detail``), and how to
    keep them on the output's graph."""
    if c.figure == "backward raises":
        return Finding("backward raises", "make the output differentiable: no in-place change of a tensor autograd "
                       "saved, no integer or numpy step on the way.", "projections", "a backward pass through the "
                       "output", c.detail, c.name)
    names = c.detail
    return Finding(f"gradients never reach {names}", f"keep {names} on the output's graph: no .detach() or .data on "
                   "what it computes (the projected queries, keys or values), no torch.no_grad() around it, no new "
                   "tensor built from its values (torch.tensor(...), .numpy()); a parameter the gradient never reaches "
                   "is never trained.", "projections", "a gradient for every trainable parameter",
                   f"none (or zero) for {names}", c.name)


#: a failing check's own finding (:func:`own_finding`) where nothing else in the diagnosis explains it: (name, fix,
#: stage)
OWN = {
    "runs on probe inputs": ("raises on the probe inputs", "make forward run on queries (B, Lq, E) and keys and values "
                             "(B, Lk, E) with Lq != Lk, and the mask in the convention the course gives it; the error "
                             "(found) says where it stops.", "inputs"),
    "output shape and dtype": ("an output of the wrong shape or dtype", "return (B, Lq, E) in the queries' dtype: the "
                               "heads merged back ((B, H, Lq, D) -> (B, Lq, H*D)) and projected by W_o.", "output"),
    "eval mode deterministic": ("raises when called again", "make forward a function of its inputs and parameters: a "
                                "second call with the same inputs must run as the first.", "inputs"),
    "masked keys have no influence": ("masked keys change the output", "fill the scores of masked keys with -inf (or a "
                                      "large negative number) before the softmax, along the keys' axis (the last): "
                                      "scores.masked_fill(~mask, float('-inf')).", "scores"),
    "causal: position 0 unchanged when the future changes": (
        "the future changes the present", "mask the scores with the lower triangle (torch.ones(Lq, Lk).tril(), "
        "True = may attend) before the softmax: position i sees keys 0 to i.", "scores"),
    "causal: no influence from the future": (
        "gradients flow from the future", "mask the scores with the lower triangle before the softmax (a fill of "
        "-inf, not a product after it): position i sees keys 0 to i.", "scores"),
    "returned weights rows sum to 1": ("returned weights do not sum to 1 over the keys", "return the softmax's output "
                                       "(over the keys, dim=-1, after masking), not the scores.", "normalisation"),
}


def own_finding(c: Check) -> Finding:
    """The finding of a failing check that nothing else in the diagnosis explains: its name, fix and stage from
    :data:`OWN` (else the check's name and a fix that points at its figure), what it found from its figure."""
    if c.name == "gradients reach every parameter":
        return _no_gradient(c)
    name, advice, stage = OWN.get(c.name, (f"fails: {c.name}", f"make the module hold \"{c.name}\": compare each "
                                           "step with multihead.reference_attention on the same inputs.", ""))
    found = "; ".join(t for t in (c.figure, c.detail) if t) or "the check fails"
    return Finding(name, advice, stage, c.name, found, c.name)


def _real_permutation(s: Session, L: int, lens) -> tuple[int, Tensor | None]:
    """(n, a permutation (L,) that moves every one of the first n positions -- the ones real in every
    sequence under ``lens`` -- among themselves and keeps the rest); None when n < 2."""
    n = L if lens is None else int(lens.min())
    if n < 2:
        return n, None
    return n, torch.cat([torch.randperm(n, generator=s.g).roll(1), torch.arange(n, L)])


def permutation(s: Session, b: Base) -> tuple[Check, Finding | None]:
    """Self-attention: positions permuted (the real ones among themselves, under a padding mask) -> outputs
    permuted the same way; a mistake that ties scores to positions breaks it."""
    x = b.x
    n, perm = _real_permutation(s, x.q.shape[1], x.lens)
    if perm is None:
        return Check("permutation equivariance", None, "", "too few real positions", waived=True), None
    xp = x.q[:, perm]
    e = rel(s.out(xp, xp, xp, x.keep, x.lens)[:, :n], b.out[:, perm][:, :n])
    ok = e <= s.tol
    return Check("permutation equivariance", ok, f"rel. diff {e:.2e}"), None if ok else _positional(e, "positions")


def key_order(s: Session, b: Base) -> tuple[Check, Finding | None]:
    """Cross-attention: keys and values permuted together (the kept ones among themselves) leave every
    output unchanged; a mistake that ties scores to positions does not."""
    x = b.x
    _, perm = _real_permutation(s, x.k.shape[1], x.lens)
    if perm is None:
        return Check("order of the keys does not matter", None, "", "too few kept keys", waived=True), None
    e = rel(s.out(x.q, x.k[:, perm], x.v[:, perm], x.keep, x.lens), b.out)
    ok = e <= s.tol
    return Check("order of the keys does not matter", ok, f"rel. change {e:.2e}"), None if ok else _positional(e, "keys")


def _positional(e: float, what: str) -> Finding:
    expected = ("keys and values permuted together leave every output unchanged" if what == "keys" else
                "positions permuted permute the outputs the same way")
    return Finding("the output depends on the order of the keys", "the scores must be Q Kᵀ (scaled) and nothing "
                   "else: remove any term that depends on a key's position (a bias by index, a distance penalty, a "
                   "position added after the projections); positions belong in the inputs (positional encodings), "
                   "not in attention.", "scores", expected,
                   f"outputs change by {e:.2e} (relative) when the {what} are reordered")


def weights_sum_to_one(s: Session, b: Base) -> tuple[Check, Finding | None]:
    """Cross-attention: every value vector of a sequence the same -> every query's output the same (the
    weights sum to 1 over the keys), whatever the queries and keys."""
    x = b.x
    v1 = x.v[:, :1].expand_as(x.v).clone()  # (B, Lk, E): the first value everywhere
    out = s.out(x.q, x.k, v1, x.keep, x.lens)
    if rel(out, b.out) <= s.tol:  # the output ignores the value input: the values come from elsewhere
        return Check("each query's weights sum to 1", None, "n/a", "the output does not depend on the value "
                     "input"), None
    q2 = torch.randn(x.q.shape, generator=s.g)
    out2 = s.out(q2, x.k, v1, x.keep, x.lens)
    e = max(rel(out, out[:, :1].expand_as(out)), rel(out2, out))
    ok = e <= s.tol
    f = None if ok else Finding(
        "each query's weights do not sum to 1 over the keys", "normalise the scores with softmax over the keys "
        "(dim=-1) after masking: every query's weights must sum to 1.", "normalisation",
        "equal values give the same output for every query", f"outputs differ by {e:.2e} (relative) across queries")
    return Check("each query's weights sum to 1", ok, f"rel. spread {e:.2e}"), f


#: the dtypes narrower than the probes' a softmax may be computed in by mistake (``.half()``, autocast)
LOW = (torch.float16, torch.bfloat16)


def precision(dtype: torch.dtype, e: float, probes: torch.dtype) -> Finding:
    """The finding of a softmax computed in ``dtype`` (the module's output differs from the reference by ``e``, and
    equals the reference with its softmax in ``dtype``): named as precision, with the fix."""
    name, given = str(dtype).removeprefix("torch."), str(probes).removeprefix("torch.")
    return Finding(f"softmax computed in {name} (low precision)", f"compute the softmax in {given} (the inputs' "
                   f"dtype) or wider: torch.softmax(scores.float(), dim=-1).to(v.dtype), never on {name} scores "
                   f"(.half(), autocast): {name} rounds each weight to {torch.finfo(dtype).eps:.1e} of itself, so the "
                   f"weights no longer sum to 1 to {given}'s rounding.", "normalisation",
                   f"the output of the {given} computation (within {given}'s rounding)",
                   f"an output {e:.2e} (relative) away, equal to the spec's with the softmax computed in {name}",
                   "matches the float64 reference")


def stability(s: Session, b: Base, reference=None, scores=None) -> tuple[Check, Finding | None]:
    """Scores made large (queries and keys x sqrt(f), so the scores are ~x f, f = 10 ... 10^4: exp overflows
    float32 past ~88; the queries x f where keys and values are one context): the output stays finite and, when
    the parts are known (``reference(q, k, v, keep)``), equals the spec's at x10 and x100 (a softmax that
    saturates) to the rounding of the probes' dtype on scores that large (``scores(q, k, v)``: the terms the scores
    add, :func:`~multihead.grader.parts.score_terms`). Every key is kept (a causal module: only the last query row,
    which sees every key, is judged), so a softmax written as exp(s - max) times the mask is held to what it computes
    exactly."""
    x = b.x
    lens = None if x.lens is None else torch.full_like(x.lens, x.k.shape[1])
    keep = None if x.keep is None else torch.ones_like(x.keep)
    if s.causal:  # every key kept but the future
        keep = torch.ones_like(x.keep).tril() if keep is not None else torch.ones(
            x.q.shape[0], 1, x.q.shape[1], x.k.shape[1], dtype=torch.bool).tril()
    rows = slice(-1, None) if s.causal else slice(None)
    r = s.call(x.q, x.q, x.q, keep, lens) if s.self_attn else s.call(x.q, x.k, x.v, keep, lens)
    if r.error is not None or r.out is None or not bool(torch.isfinite(r.out[:, rows]).all()):
        return Check("stable on large scores", None, "n/a", "not finite with every key kept, even on small scores"), None
    for factor in (10.0, 100.0, 1e3, 1e4):
        if s.kv_same:  # one context for keys and values: the queries take the whole factor, the context stays
            q, k = x.q * factor, x.k
        else:
            q, k = x.q * factor ** 0.5, x.k * factor ** 0.5
        args = (q, q, q) if s.self_attn else (q, k, k if s.kv_same else x.v)
        r = s.call(*args, keep, lens)
        if r.error is not None or r.out is None:
            return Check("stable on large scores", False, f"raises at x{factor:g}", r.error or ""), _overflow(
                factor, "raises")
        out = r.out[:, rows].double()
        if not bool(torch.isfinite(out).all()):
            return Check("stable on large scores", False, f"NaN/inf at scores x{factor:g}"), _overflow(factor,
                                                                                                    "NaN or inf")
        if reference is not None and factor <= 100:  # beyond, exp's rounding of such scores leaves nothing to judge
            e = rel(out, reference(*args, keep)[:, rows])
            if e > tolerance(s.dtype, s.terms + (0 if scores is None else int(scores(*args)))):
                return Check("stable on large scores", False, f"rel. error {e:.2e} at scores x{factor:g}"), Finding(
                    "wrong when the scores are large (saturation)", "compute the softmax in float32 (or wider) from "
                    "the raw scores, subtracting each row's maximum; do not clamp or round the scores.",
                    "normalisation", f"the spec's output with scores x{factor:g}",
                    f"relative error {e:.2e} there (exact on small scores)")
    return Check("stable on large scores", True, "finite at scores x10 to x10^4"), None


def _overflow(factor: float, what: str) -> Finding:
    return Finding("softmax overflows on large scores", "subtract each row's maximum before exp (exp(s - s.max(-1, "
                   "keepdim=True))), or call torch.softmax, which does: exp of a score above ~88 is inf in float32.",
                   "normalisation", f"finite outputs with scores x{factor:g}",
                   f"{what} with scores x{factor:g} (finite on small scores)")
