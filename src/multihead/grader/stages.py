"""Where a module departs from multi-head attention, stage by stage, last stage first. The course's
computation, with q (B, Lq, E), k and v (B, Lk, E)::

    Q, K, V = q W_qᵀ + b_q, k W_kᵀ + b_k, v W_vᵀ + b_v        # projections   (B, L, H*D)
    Qh, Kh, Vh = split(Q), split(K), split(V)                 # heads split   (B, H, L, D)
    S = Qh Khᵀ · scale, blocked keys -> -inf                   # scores, mask  (B, H, Lq, Lk)
    W = softmax(S, over the keys)                              # normalisation
    Oh = W Vh                                                  # values        (B, H, Lq, D)
    out = merge(Oh) W_oᵀ + b_o                                 # merge, output projection

The module's own intermediates are recovered from the outside, through calls alone:

- :func:`projections`: which input each projection layer was called on (observed);
- :func:`merged_heads`: the output projection's input (observed, or solved for through W_o);
- :func:`combination`: how the heads were combined -- averaged, summed, reordered, one dropped --
  against each head's output as the spec computes it;
- :func:`values`: the weights, solved from the merged heads and several value inputs (W Vh = Oh),
  under hypotheses for the merge, the split and which tensor was weighted (per head too);
- :mod:`multihead.grader.weights`: what normalised the weights, the scale, the mask.

Each stage returns named :class:`~multihead.grader.report.Finding` records only when a hypothesis
reproduces what the module computed; a stage that cannot tell returns a generic one (flagged by
:data:`GENERIC`), which the verdict weighs by how much of the module was observed.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import torch
from torch import Tensor

from multihead.grader import weights as wstage
from multihead.grader.parts import Parts, per_head, split
from multihead.grader.properties import rel
from multihead.grader.report import Finding
from multihead.grader.session import Inputs, Session

__all__ = ["GENERIC", "localise"]

#: findings that say a stage differs without a hypothesis that reproduces it
GENERIC = ("weights are not", "heads' outputs are not", "output changed", "output is not", "mask applied wrongly",
           "differs from multi-head attention")
ROLES = ("q", "k", "v", "o", "qkv")
INPUT = {"q": "query", "k": "key", "v": "value"}


class Observed(NamedTuple):
    """One call with the reading's layers recorded: the output (float64) and role -> [(input, output)]."""

    out: Tensor
    obs: dict


def _layers(parts: Parts) -> dict[str, list[str]]:
    """Layer name -> the roles it plays in this reading (its hookable projections)."""
    names: dict[str, list[str]] = {}
    for role in ROLES:
        p = getattr(parts, role)
        if p is not None and p.hookable:
            names.setdefault(p.modules[0], []).append(role)
    return names


def observe(s: Session, parts: Parts, x: Inputs, v: Tensor | None = None, replace: dict | None = None) -> Observed:
    """The module on x (values ``v`` instead of x.v) with the reading's layers recorded; ``replace``:
    role -> the tensor that stands for that layer's output."""
    layers = _layers(parts)
    rep = {getattr(parts, r).modules[0]: t for r, t in (replace or {}).items()}
    r = s.call(x.q, x.k, x.v if v is None else v, x.keep, x.lens, record=tuple(layers), replace=rep or None)
    if r.error is not None or r.out is None:
        raise RuntimeError(r.error or "no output")
    obs = {role: [] for role in ROLES}
    for name, calls in r.records.items():
        for role in layers.get(name, ()):
            obs[role] = [(x_, None if y is None else y.double()) for x_, y in calls]
    return Observed(r.out.double(), obs)


# --- 1. projections -----------------------------------------------------------------------------


def projections(parts: Parts, obs: dict, x: Inputs, self_attn: bool) -> tuple[list[Finding], dict]:
    """Which input each observed projection was called on, and the Q, K, V the module really used
    (observed where they can be, the spec's otherwise)."""
    Q, K, V = parts.projections(x.q, x.k, x.v)
    used = {"q": Q, "k": K, "v": V}
    findings: list[Finding] = []
    if self_attn or parts.qkv is not None:
        if parts.qkv is not None and obs["qkv"] and self_attn and obs["qkv"][0][1] is not None:
            used["q"], used["k"], used["v"] = parts.fused(obs["qkv"][0][1])
        return findings, used
    given = {"query": x.q, "key": x.k, "value": x.v}

    def which(t):
        return next((n for n, g in given.items() if isinstance(t, Tensor) and t.shape == g.shape and torch.equal(t, g)),
                    None)

    calls = {r: [(which(a), b) for a, b in obs[r]] for r in ("q", "k", "v")}
    context = x.v is x.k  # one tensor for keys and values (the call passes one context): either name is right
    for role in ("q", "k", "v"):
        for got, y in calls[role]:
            if got is None or got == INPUT[role] or y is None or context and {got, INPUT[role]} == {"key", "value"}:
                continue
            other = next(r for r, n in INPUT.items() if n == got)
            if not calls[other] and getattr(parts, other) is not None:  # W_role stands in for W_other
                used[other] = y
                findings.append(Finding(f"{INPUT[role]} projection used for the {got}s", f"project the {got}s with "
                                        f"their own W_{other}: {other.upper()} = W_{other}({got}); W_{other} is never "
                                        "called.", "projections", f"W_{other}({got})", f"W_{role}({got})"))
            elif not any(n == INPUT[role] for n, _ in calls[role]):
                used[role] = y
                findings.append(Finding(f"{INPUT[role]} projection applied to the {got} input", f"apply W_{role} to "
                                        f"the {INPUT[role]} input: {role.upper()} = W_{role}({INPUT[role]}).",
                                        "projections", f"W_{role}({INPUT[role]})", f"W_{role}({got})"))
        own = [y for n, y in calls[role] if n == INPUT[role] and y is not None]
        if own:
            used[role] = own[0]
    return findings, used


# --- 2. output projection ---------------------------------------------------------------------------


def merged_heads(parts: Parts, obs: dict, out: Tensor, q: Tensor) -> tuple[Tensor | None, list[Finding]]:
    """The merged heads (B, Lq, ·) the output projection received, and what is wrong after it. With no W_o in
    the reading, "output projection missing" is a claim about the reading only: the verdict keeps it only
    where the module has no weights left unread (:func:`multihead.grader.verdict` rules)."""
    o = parts.o
    if o is None:
        return out, [Finding("output projection missing", "project the concatenated heads with W_o (a final Linear "
                             "of d_model inputs and outputs) before returning.", "output projection",
                             "W_o(concatenated heads)", "no output projection layer in the module")]
    if o.hookable:
        calls = obs["o"]
        if not calls:
            if out.shape[-1] == o.weight.shape[1]:
                return out, [Finding("output projection missing", f"return {o.name}(concatenated heads): the layer "
                                     "is defined but never called.", "output projection",
                                     f"{o.name}(concatenated heads)", f"{o.name} never called")]
            return None, []
        x, y = calls[-1]
        if x is None or y is None:
            return None, []
        x = x.double()
        if y.shape == out.shape and rel(out, y) > 1e-4:
            d = out - y
            if d.shape == q.shape and rel(d, q.double()) < 1e-4:
                return x, [Finding("residual connection inside attention", "return W_o(concatenated heads); the "
                                   "residual connection (x + attention(x)) belongs to the block around the attention, "
                                   "not inside it.", "output projection", "W_o(heads)", "W_o(heads) + the query input")]
            return x, [Finding("output changed after the output projection", f"return {o.name}(heads) as it is.",
                               "output projection", f"the output of {o.name}",
                               f"something else (rel. difference {rel(out, y):.2e})")]
        return x, []
    if out.shape[-1] != o.weight.shape[0]:  # raw parameters: solve out = M Woᵀ + b for M
        return out, [Finding("output projection missing", "project the concatenated heads with W_o before "
                             "returning.", "output projection", f"output width {o.weight.shape[0]}",
                             f"output width {out.shape[-1]}")]
    M = (out - (o.bias if o.bias is not None else 0)) @ torch.linalg.pinv(o.weight).T  # (B, Lq, E) -> (B, Lq, H*D)
    if rel(o(M), out) > 1e-4:
        return None, [Finding("output is not the output projection's", f"return the concatenated heads times "
                              f"{o.name}.", "output projection", f"an output in the span of {o.name}",
                              "an output no input to W_o gives")]
    return M, []


# --- 3. combination of the heads ------------------------------------------------------------------


def combination(parts: Parts, M: Tensor, used: dict, x: Inputs) -> list[Finding] | None:
    """How the heads' outputs were combined, against each head's output as the spec computes it from the Q,
    K, V the module used: averaged or summed (M is one head wide), or concatenated in another order, with a
    head left out. None when M is the spec's concatenation or no combination of the spec's heads gives it."""
    from multihead.backends.reference import reference_attention

    H, width = parts.H, used["v"].shape[-1]
    D = width // H
    scale = parts.scale if parts.scale is not None else D ** -0.5
    Oh = reference_attention(split(used["q"], H), split(used["k"], H), split(used["v"], H), x.keep, scale=scale)
    if M.shape[-1] == D:  # one head wide: the heads reduced
        for how, red in (("averaged", Oh.mean(1)), ("summed", Oh.sum(1))):
            if rel(M, red) < 1e-4:
                return [Finding(f"heads {how} instead of concatenated", "concatenate the heads' outputs: "
                                "out.transpose(1, 2).reshape(B, Lq, H*D) (H*D features), then project with W_o "
                                "of H*D inputs.", "heads merge", "(B, H, Lq, D) -> (B, Lq, H*D), every head's D "
                                "features side by side", f"the {H} heads {how} into D = {D} features")]
        return None
    if M.shape[-1] != width:
        return None
    blocks = M.reshape(*M.shape[:2], H, D)  # (B, Lq, H*D) -> (B, Lq, H, D)
    source = []
    for j in range(H):
        blk = blocks[:, :, j]
        if float(blk.abs().max()) < 1e-9 * (float(M.abs().max()) + 1e-12):
            source.append(None)
            continue
        g = next((h for h in range(H) if rel(blk, Oh[:, h]) < 1e-4), -1)
        if g < 0:
            return None
        source.append(g)
    if source == list(range(H)):
        return None
    dropped = [j for j, g in enumerate(source) if g is None]
    if dropped:
        return [Finding(f"head{'s' if len(dropped) > 1 else ''} {', '.join(map(str, dropped))} left out of the "
                        "merge", "concatenate every head's output; none may be zeroed or skipped.", "heads merge",
                        f"all {H} heads in the concatenation", f"zeros where head(s) {dropped} belong")]
    return [Finding("heads concatenated in another order", "concatenate the heads in order: head h's D features are "
                    "columns h*D to h*D+D-1 (out.transpose(1, 2).reshape(B, Lq, H*D)).", "heads merge",
                    f"heads in order {list(range(H))}", f"heads in order {source}")]


# --- 4. values and the weights ----------------------------------------------------------------------


def _value_calls(s: Session, parts: Parts, x: Inputs, first: Observed, M: Tensor, used: dict) -> tuple[list, list, list]:
    """Merged heads Ms and values Vs over several calls with other values (so the weights are unique), and
    the value inputs given (cross-attention)."""
    Lk = x.k.shape[1]
    D = used["v"].shape[-1] // parts.H
    Ms, Vs, vins = [M], [used["v"]], [x.v]
    for _ in range(min(8, Lk // D + 1) - 1):
        if not s.self_attn:
            v2 = torch.randn(x.v.shape, generator=s.g, dtype=x.v.dtype)
            ob = observe(s, parts, x, v=v2)
            vcalls = ob.obs["v"]
            V2 = vcalls[0][1] if parts.qkv is None and parts.v is not None and parts.v.hookable and vcalls \
                else parts.projections(x.q, x.k, v2)[2]
            vins.append(v2)
        else:
            V2 = torch.randn(used["v"].shape, generator=s.g, dtype=torch.float64)
            if parts.qkv is not None and first.obs["qkv"]:
                ob = observe(s, parts, x, replace={"qkv": parts.put_v(first.obs["qkv"][0][1], V2)})
            elif parts.qkv is None and parts.v is not None and parts.v.hookable and first.obs["v"]:
                ob = observe(s, parts, x, replace={"v": V2})
            else:
                break
        M2, _ = merged_heads(parts, ob.obs, ob.out, x.q)
        if M2 is None:
            break
        Ms.append(M2)
        Vs.append(V2)
    return Ms, Vs, vins


def _sources(parts: Parts, x: Inputs, used: dict, Vs: list, vins: list, s: Session):
    """(name, value tensors per call) for every tensor a module could have weighted."""
    Lq, Lk = x.q.shape[1], x.k.shape[1]
    v_hooked = parts.qkv is None and parts.v is not None and parts.v.hookable
    yield "values", Vs
    yield "keys", [used["k"]] * len(Vs)
    if Lq == Lk:
        yield "queries", [used["q"]] * len(Vs)
    if not s.self_attn and len(vins) == len(Vs) and x.v.shape[-1] == used["v"].shape[-1]:
        yield "value input", [t.double() for t in vins]
    for src, other in (("W_v(key)", x.k), ("W_v(query)", x.q)):  # an unobserved value projection fed the wrong input
        if not s.self_attn and not v_hooked and parts.v is not None and other.shape[1] == Lk and other is not x.v:
            yield src, [parts.v(other)] * len(Vs)


def values(s: Session, parts: Parts, x: Inputs, first: Observed, M: Tensor, used: dict):
    """The weights the module used (B, H, Lq, Lk) and the findings of the merge/values stages: the merge's
    layout, the split, which tensor was weighted; (None, findings) when nothing reproduces the merged heads."""
    H = parts.H
    Ms, Vs, vins = _value_calls(s, parts, x, first, M, used)
    D = used["v"].shape[-1] // H
    if len(Ms) * D <= x.k.shape[1]:  # the weights are not unique: nothing more can be located from outside
        return None, []
    fin = torch.stack([torch.isfinite(m).flatten(1).all(1) for m in Ms]).all(0)  # (B,): sequences without NaN
    if not bool(fin.any()):
        return None, []
    keep = fin if not bool(fin.all()) else None  # NaN rows (a fully blocked row) say nothing about the rest
    for merge_ok, split_ok in itertools.product((True, False, "interleaved"), (True, False, "interleaved")):
        for src, Vsrc in _sources(parts, x, used, Vs, vins, s):
            Oh = torch.cat([split(m, H, merge_ok) for m in Ms], -1)  # (B, H, Lq, n*D)
            Vh = torch.cat([split(t, H, split_ok) for t in Vsrc], -1)  # (B, H, Lk, n*D)
            if keep is not None:
                Oh, Vh = Oh[keep], Vh[keep]
            W, res = wstage.solve_weights(Oh, Vh)
            if res < 1e-4:
                return (W, keep, split_ok), _merge_findings(merge_ok) + _source_findings(src)
    per = _per_head_values(Ms, Vs, H, keep)
    if per is not None:
        return None, [per]
    return None, [Finding("heads' outputs are not a weighting of the values", "multiply the attention weights "
                          "(B, H, Lq, Lk) by the per-head values V (B, H, Lk, D), then merge the heads with "
                          "out.transpose(1, 2).reshape(B, Lq, H*D).", "values", "each head's output = its weights @ "
                          "its values", "no weighting of the values (or of the keys or queries) gives the merged heads")]


def _per_head_values(Ms: list, Vs: list, H: int, keep) -> Finding | None:
    """Head h weighting another head's values: which head's values reproduce each head's output."""
    Oh = torch.cat([split(m, H) for m in Ms], -1)  # (B, H, Lq, n*D)
    Vh = torch.cat([split(t, H) for t in Vs], -1)  # (B, H, Lk, n*D)
    if keep is not None:
        Oh, Vh = Oh[keep], Vh[keep]
    src = []
    for h in range(H):
        g = next((g for g in range(H) if wstage.solve_weights(Oh[:, h:h + 1], Vh[:, g:g + 1])[1] < 1e-4), None)
        if g is None:
            return None
        src.append(g)
    if src == list(range(H)):
        return None
    wrong = [f"head {h} weighs head {g}'s values" for h, g in enumerate(src) if g != h]
    name = f"every head weighs head {src[0]}'s values" if len(set(src)) == 1 else "heads weigh another head's values"
    return Finding(name, "give each head its own slice of V: head h uses V[:, h] (B, Lk, D), the same h as its "
                   "queries and keys (index the values by the loop's head, not a fixed one).", "values",
                   "head h weighs its own values V_h", "; ".join(wrong))


def _merge_findings(merge_ok) -> list[Finding]:
    if merge_ok == "interleaved":
        return [Finding("heads interleaved when merged", "concatenate the heads: out.transpose(1, 2).reshape(B, Lq, "
                        "H*D) (torch.cat(heads, -1), not torch.stack(heads, -1).flatten(-2)), so head h's D features "
                        "are columns h*D to h*D+D-1.", "heads merge", "(B, H, Lq, D) -> transpose(1, 2) -> (B, Lq, "
                        "H*D), head by head", "(B, H, Lq, D) -> (B, Lq, D, H) -> (B, Lq, D*H): one feature of every "
                        "head, then the next")]
    if not merge_ok:
        return [Finding("heads merged in the wrong order", "merge with out.transpose(1, 2).reshape(B, Lq, H*D): a "
                        "plain reshape of (B, H, Lq, D) mixes heads and positions.", "heads merge",
                        "(B, H, Lq, D) -> transpose(1, 2) -> (B, Lq, H*D)",
                        "(B, H, Lq, D) reshaped to (B, Lq, H*D) without the transpose")]
    return []


def _source_findings(src: str) -> list[Finding]:
    if src == "keys":
        return [Finding("keys used as values", "multiply the weights by the projected values V = W_v(v), not the "
                        "keys.", "values", "weights @ V", "weights @ K")]
    if src == "queries":
        return [Finding("queries used as values", "multiply the weights by the projected values V = W_v(v).",
                        "values", "weights @ V", "weights @ Q")]
    if src in ("W_v(key)", "W_v(query)"):
        got = "key" if src == "W_v(key)" else "query"
        return [Finding(f"value projection applied to the {got} input", "apply W_v to the value input: "
                        "V = W_v(value).", "projections", "W_v(value)", f"W_v({got})")]
    if src == "value input":
        return [Finding("value projection not applied", "project the values with W_v before weighting them.",
                        "values", "weights @ W_v(v)", "weights @ v")]
    return []


def _score_candidates(parts: Parts, x: Inputs, used: dict, split_ok, s: Session) -> list:
    """(split ok, Q, K, findings...) for the scores: the spec's, the split mistake, the wrong tensors."""
    Lq, Lk = x.q.shape[1], x.k.shape[1]
    qk = [(split_ok, used["q"], used["k"])]
    if split_ok:
        qk.append((False, used["q"], used["k"]))
    if Lq == Lk:  # the weights transposed: the keys' scores against the queries
        qk.append((split_ok, used["k"], used["q"], wstage.TRANSPOSED))
    if not s.self_attn:  # the scores of the wrong projected tensors
        qk.append((split_ok, used["q"], used["v"], Finding("values used as keys", "compute the scores from the keys: "
                                                           "Q Kᵀ, with K = W_k(key).", "scores", "Q Kᵀ", "Q Vᵀ")))
    if not s.self_attn and parts.qkv is None:  # unobserved projections fed the wrong input
        for role, nm, t in (("k", "value", x.v), ("k", "query", x.q), ("q", "key", x.k)):
            proj = getattr(parts, role)
            if proj is None or proj.hookable or t.shape[1] != (Lk if role == "k" else Lq):
                continue
            alt = proj(t)
            Qa, Ka = (alt, used["k"]) if role == "q" else (used["q"], alt)
            full = INPUT[role]
            qk.append((split_ok, Qa, Ka, Finding(f"{full} projection applied to the {nm} input", f"apply W_{role} to "
                                                 f"the {full} input.", "projections", f"W_{role}({full})",
                                                 f"W_{role}({nm})")))
    return qk


def localise(s: Session, parts: Parts, x: Inputs) -> list[Finding]:
    """Findings, stage by stage, for the module read as ``parts`` (H set) on inputs ``x``."""
    first = observe(s, parts, x)
    findings, used = projections(parts, first.obs, x, s.self_attn)
    M, after = merged_heads(parts, first.obs, first.out, x.q)
    findings += after
    if M is None:
        return findings
    combined = combination(parts, M, used, x)
    if combined is not None:
        return findings + combined
    solved, found = values(s, parts, x, first, M, used)
    findings += found
    if solved is None:
        return findings
    W, keep, split_ok = solved
    X = torch.zeros(W.shape, dtype=torch.bool) if x.keep is None else ~x.keep.expand(
        x.keep.shape[0], parts.H, *x.keep.shape[2:])
    if keep is not None:
        X = X[keep]
        used = {r: t[keep] for r, t in used.items()}
    qk = _score_candidates(parts, x if keep is None else x._replace(q=x.q[keep], k=x.k[keep], v=x.v[keep]), used,
                           split_ok, s)
    return findings + wstage.weights_findings(W, qk, X, parts, H=parts.H, E=s.E, causal=s.causal)


def spec_heads(parts: Parts, x: Inputs) -> Tensor:
    """Each head's output as the spec computes it (B, H, Lq, D)."""
    return per_head(parts, x.q, x.k, x.v, x.keep)
