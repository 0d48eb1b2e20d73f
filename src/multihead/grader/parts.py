"""Reading a module's projections off its :class:`~multihead.grader.subject.Description`: which
layers or parameters are W_q, W_k, W_v and W_o (or a fused qkv), how raw parameters are oriented,
how many heads there are, and the score scale -- every reading the names and shapes allow,
likeliest first. Nothing here calls the module; :mod:`multihead.grader.verdict` tries the readings.

- Linear or Keras Dense layers at any depth, by role name (``W_q``, ``self.inner.to_out``,
  ``query_key_value``), per-head lists of them (``heads.0.q`` ...), or in call order when nothing
  has a role name (``self.linears[0..3]``);
- raw Parameters used as ``x @ W`` (in, out) or ``F.linear(x, W)`` (out, in) -- both readings when
  square -- or per head (H, E, D) / (H, D, E), each with the bias of its role (``b_q``, ``q_bias``), a
  bare ``weight`` / ``bias`` by its owner's name (a hand-written Linear class, a ParameterDict:
  ``W_o.weight``);
- a fused qkv projection, laid out [Q | K | V] or per head [q k v];
- the head count from an attribute (``num_heads``, ``h``, ``n_head`` ...), else every divisor.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from multihead.grader.subject import HEAD_ATTRS, Description
from multihead.heads.surgery import is_bias, role_of

__all__ = ["Parts", "Proj", "find_parts", "head_counts", "layer_role", "merge", "reference", "split"]


@dataclass
class Proj:
    """A linear projection ``x -> x Wᵀ + b``: weight (out, in) and bias in float64; ``modules``: the
    names of the hookable layers that compute it (several for a per-head list), none for raw Parameters."""

    weight: Tensor
    bias: Tensor | None
    name: str
    modules: list[str] = field(default_factory=list)

    def __call__(self, x: Tensor) -> Tensor:
        return F.linear(x.double(), self.weight, self.bias)

    @property
    def hookable(self) -> bool:
        """One layer computes it: its input and output can be observed (and replaced)."""
        return len(self.modules) == 1


@dataclass
class Parts:
    """One reading of the module: the projections, head count H, score scale, and a fused layout
    ("blocks" [Q | K | V] or "heads" [q_h k_h v_h])."""

    q: Proj | None = None
    k: Proj | None = None
    v: Proj | None = None
    o: Proj | None = None
    qkv: Proj | None = None
    H: int | None = None
    scale: float | None = None
    layout: str = "blocks"
    #: q, k and v each one (D, D) layer shared by the heads, applied to each head's slice of the input (a
    #: block-diagonal projection): the number of slices; 0 for the course's projections of the whole input
    tied: int = 0
    #: the output projection is the last layer called, its name saying no role (``W_0``, ``final_linear``): a
    #: guess that is verified when the output matches, never taken as observed at work
    guessed_o: bool = False

    def with_heads(self, H: int) -> Parts:
        return dataclasses.replace(self, H=H)

    @property
    def width(self) -> int:
        """H*D: the width of the queries' projection."""
        return self.qkv.weight.shape[0] // 3 if self.qkv is not None else self.q.weight.shape[0]

    def projections(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(Q, K, V) as the spec computes them, float64 (B, L, H*D)."""
        if self.qkv is not None:
            return self.fused(self.qkv(q))[0], self.fused(self.qkv(k))[1], self.fused(self.qkv(v))[2]
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


# --- the computation, as the course defines it ----------------------------------------------------


def split(x: Tensor, H: int, ok: bool | str = True) -> Tensor:
    """(B, L, H*D) -> (B, H, L, D); ``ok=False``: the mistake, a plain reshape that mixes positions and
    heads; ``ok="interleaved"``: features taken head-minor (feature d of head h at d*H + h)."""
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


def reference(parts: Parts, q: Tensor, k: Tensor, v: Tensor, keep: Tensor | None) -> Tensor:
    """The spec's output for this reading (H set), float64, through :func:`multihead.reference_attention`."""
    heads = per_head(parts, q, k, v, keep)  # (B, H, Lq, D)
    m = merge(heads)  # (B, H, Lq, D) -> (B, Lq, H*D)
    return m if parts.o is None else parts.o(m)


def _conventional(scale: float | None, E: int, H: int | None) -> float | None:
    """A module's own ``scale`` attribute where it is a convention of the course's texts -- 1/sqrt(d_k) of one head,
    or 1/sqrt of the whole projection's width as the Keras tutorial's code scales -- else None: an attribute is what
    the module computes, not the spec (``self.scale = 1 / d`` must not make its own reference)."""
    if scale is None or not isinstance(scale, int | float) or isinstance(scale, bool):
        return None
    widths = [E] + ([E // H] if H else [])
    return float(scale) if any(math.isclose(scale, w ** -0.5, rel_tol=1e-6) for w in widths) else None


def per_head(parts: Parts, q: Tensor, k: Tensor, v: Tensor, keep: Tensor | None) -> Tensor:
    """Each head's output as the spec computes it (B, H, Lq, D), float64."""
    from multihead.backends.reference import reference_attention

    Q, K, V = parts.projections(q, k, v)
    H = parts.H
    D = Q.shape[-1] // H
    scale = parts.scale if parts.scale is not None else 1 / math.sqrt(D)
    return reference_attention(split(Q, H), split(K, H), split(V, H), keep, scale=scale)


def rounded_softmax(parts: Parts, q: Tensor, k: Tensor, v: Tensor, keep: Tensor | None, dtype: torch.dtype) -> Tensor:
    """The spec's output for this reading with its softmax computed in ``dtype`` (the scores rounded to it, the
    softmax's exps and sums in float32, the weights rounded to it): what a module computes that calls softmax on
    scores cast to float16 or bfloat16; float64 otherwise."""
    Q, K, V = parts.projections(q, k, v)
    H = parts.H
    D = Q.shape[-1] // H
    scale = parts.scale if parts.scale is not None else 1 / math.sqrt(D)
    S = split(Q, H) @ split(K, H).transpose(-1, -2) * scale  # (B, H, Lq, Lk)
    if keep is not None:
        S = S.masked_fill(~keep, float("-inf"))
    W = torch.softmax(S.to(dtype).float(), dim=-1).to(dtype).double()  # (B, H, Lq, Lk), rounded as the module's
    m = merge(W @ split(V, H))  # (B, H, Lq, D) -> (B, Lq, H*D)
    return m if parts.o is None else parts.o(m)


def score_terms(parts: Parts, q: Tensor, k: Tensor, v: Tensor) -> float:
    """What the scores add to the rounding of attention on (q, k, v) under this reading: each score sums D terms, and
    exp turns its error into a relative one times its size, so (D + 1) times the largest |scale * Q_h K_hᵀ|."""
    Q, K, _ = parts.projections(q, k, v)
    H = parts.H
    D = Q.shape[-1] // H
    scale = parts.scale if parts.scale is not None else 1 / math.sqrt(D)
    S = split(Q, H) @ split(K, H).transpose(-1, -2)  # (B, H, Lq, D) @ (B, H, D, Lk) -> (B, H, Lq, Lk)
    return float((D + 1) * (S * scale).abs().max())


# --- finding the parts ---------------------------------------------------------------------------

def _stack(projs: list[Proj], name: str) -> Proj:
    """Per-head projections (each (D, E)) as one (H*D, E) projection, heads in order."""
    w = torch.cat([p.weight for p in projs])
    b = None if any(p.bias is None for p in projs) else torch.cat([p.bias for p in projs])
    return Proj(w, b, name, [m for p in projs for m in p.modules])


def _tiled(proj: Proj, n: int) -> Proj:
    """A (D, D) layer applied to each of the input's n slices of D features, as one (n*D, n*D) projection: a
    block-diagonal weight (not hookable: the layer sees (B, L, n, D), not the whole input)."""
    b = None if proj.bias is None else proj.bias.repeat(n)
    return Proj(torch.block_diag(*[proj.weight] * n), b, f"{proj.name} (shared by {n} slices)")


def _tied(parts: Parts, E: int) -> Parts | None:
    """The reading with q, k and v read as layers shared by the heads (Persson's per-head Linear(head_dim,
    head_dim)): each square, of one size D < E dividing E; else None."""
    if parts.qkv is not None or not all(isinstance(p, Proj) for p in (parts.q, parts.k, parts.v)):
        return None
    shapes = {tuple(p.weight.shape) for p in (parts.q, parts.k, parts.v)}
    if len(shapes) != 1:
        return None
    D, D_in = shapes.pop()
    if D != D_in or D >= E or E % D:
        return None
    n = E // D
    return dataclasses.replace(parts, q=_tiled(parts.q, n), k=_tiled(parts.k, n), v=_tiled(parts.v, n), tied=n)


def _param_readings(name: str, w: Tensor, bias: Tensor | None, E: int | None, role: str | None = None) -> list[Proj]:
    """A raw Parameter as a projection: (in, out) for ``x @ W`` or (out, in) for ``F.linear``; (H, E, D),
    (H, D, E) or (E, H, D) (Keras' ``EinsumDense`` kernel, ``einsum("ble,ehd->blhd", x, W)``) per head -- for
    the output projection (``role`` "o"), each head's D features to E: (H, D, E) as ``Σ_h o_h @ W[h]`` or
    (H, E, D) as ``Σ_h F.linear(o_h, W[h])``. Every reading the shape allows, likeliest first; ``bias`` joins a
    reading whose output size it fits."""
    outs = []
    if w.dim() == 3 and role in ("o", "o?"):
        H, a, b = w.shape
        if E is None or b == E:
            outs.append(w.permute(2, 0, 1).reshape(b, H * a))  # (H, D, E) -> (E, H, D) -> (E, H*D)
        if E is None or a == E:
            outs.append(w.permute(1, 0, 2).reshape(a, H * b))  # (H, E, D) -> (E, H, D) -> (E, H*D)
    if w.dim() == 2:
        a, b = w.shape
        if E is not None and a == E and b != E:
            outs = [w.T]
        elif E is not None and b == E and a != E:
            outs = [w]
        else:
            outs = [w.T, w]
    elif w.dim() == 3 and role not in ("o", "o?"):
        H, a, b = w.shape
        if E is None or a == E:
            outs.append(w.transpose(1, 2).reshape(H * b, a))  # (H, E, D) -> (H, D, E) -> (H*D, E)
        if E is None or b == E:
            outs.append(w.reshape(H * a, b))  # (H, D, E) -> (H*D, E)
        if E is not None and H == E and a != E and b != E:  # Keras' EinsumDense kernel, "ble,ehd->blhd"
            outs.append(w.permute(1, 2, 0).reshape(a * b, H))  # (E, H, D) -> (H, D, E) -> (H*D, E)
    return [Proj(x, bias.reshape(-1) if bias is not None and bias.numel() == x.shape[0] else None, name)
            for x in outs]


#: a parameter's last name that says only "the weight" or "the bias": its owner's name says the role
_BARE = {"weight", "bias", "w", "b", "kernel"}

#: the roles a raw parameter can be read in ("o?": an unnamed projection, the output one when q, k, v have names)
_PARAM_ROLES = ("q", "k", "v", "o", "o?", "qkv")


def _owner_roles(desc: Description, bias: bool) -> dict[str, str]:
    """Parameter name -> role, for parameters named bare (``weight``, ``bias``) whose owner is not a Linear-like
    layer but is named for a role: a hand-written Linear class (``self.W_o = MyLinear(...)``: ``W_o.weight``),
    a ParameterDict (``self.out = nn.ParameterDict({"weight": ...})``). Only a role one such weight (or bias)
    holds: several (a per-head list of them) stay unread rather than half read."""
    found: dict[str, list[str]] = {}
    for name, p in desc.params.items():
        if "." not in name:
            continue
        owner, last = name.rsplit(".", 1)
        if owner in desc.linear or last.lower() not in _BARE or is_bias(name) != bias or p.dim() != (1 if bias else 2):
            continue  # a weight of more dimensions (a convolution's) stays unread
        r = role_of(owner)
        if r in _PARAM_ROLES:
            found.setdefault(r, []).append(name)
    return {names[0]: r for r, names in found.items() if len(names) == 1}


def _biases(desc: Description) -> dict[str, Tensor]:
    """Raw bias parameters by role: 1-D (or (H, D)) parameters whose name (or, named bare, whose owner's
    name) says bias and a role."""
    out = {}
    by_owner = _owner_roles(desc, bias=True)
    for name, p in desc.params.items():
        owner = name.rsplit(".", 1)[0] if "." in name else ""
        if owner in desc.linear or p.dim() not in (1, 2) or not is_bias(name):
            continue
        r = role_of(name) or by_owner.get(name)
        if r in _PARAM_ROLES and (p.dim() == 1 or p.shape[0] < p.shape[1]):
            out[r] = p
    fused = out.get("qkv")
    if fused is not None and fused.dim() == 1 and fused.shape[0] % 3 == 0 and not {"q", "k", "v"} & out.keys():
        # one [b_q | b_k | b_v] for separate weights (torch.nn.MultiheadAttention with kdim / vdim: q_proj_weight,
        # k_proj_weight, v_proj_weight and in_proj_bias)
        out["q"], out["k"], out["v"] = fused.chunk(3)
    return out


def layer_role(name: str) -> str | None:
    """The role a Linear-like layer's name says (``W_q`` -> "q"; an entry of a list, ``to_out.0``, its list's)."""
    return role_of(name) or (role_of(name.rsplit(".", 1)[0]) if name.split(".")[-1].isdigit() and "." in name
                             else None)


def _named(desc: Description, E: int, order: tuple[str, ...], kv_sizes: tuple[int, int] | None = None
           ) -> dict[str, list]:
    """Role -> candidates: Proj (a layer) or list[Proj] (a raw Parameter's readings). ``kv_sizes``: the keys' and
    values' input sizes where they are not E (a raw key weight (H*D, Ek) is read with Ek)."""
    size = {"k": kv_sizes[0], "v": kv_sizes[1]} if kv_sizes else {}
    named: dict[str, list] = {"q": [], "k": [], "v": [], "o": [], "o?": [], "qkv": [], "by order": [],
                              "o by order": []}
    biases = _biases(desc)
    for name, (w, b) in desc.linear.items():
        if not name:
            continue
        r = layer_role(name)
        if r is not None:
            own = biases.get(r)  # a bias-free layer whose bias is a Parameter of its role, added after it (bq)
            if b is None and own is not None and own.dim() == 1 and own.shape[0] == w.shape[0]:
                b = own
            named[r].append(Proj(w, b, name, [name]))
    by_owner = _owner_roles(desc, bias=False)
    for name, p in desc.params.items():
        owner = name.rsplit(".", 1)[0] if "." in name else ""
        if owner in desc.linear or is_bias(name) or p.dim() < 2:
            continue
        r = by_owner.get(name) if name in by_owner else \
            (None if desc.modules.get(owner) == "ParameterDict" else role_of(name))
        if r in _PARAM_ROLES:
            named[r].append(_param_readings(name, p, biases.get(r), size.get(r, E), r))
    if not named["o"] and named["o?"]:
        named["o"] = named["o?"][-1:]
    if not named["o"] and (named["q"] or named["qkv"]) and order:  # W_0, final_linear: the last layer called
        taken = {p.name for r in ("q", "k", "v", "qkv") for p in named[r] if isinstance(p, Proj)}
        rest = [n for n in dict.fromkeys(order) if n in desc.linear and n not in taken]
        if rest:
            named["o"], named["o by order"] = [Proj(*desc.linear[rest[-1]], rest[-1], [rest[-1]])], [True]
    if not (named["q"] or named["qkv"]) and order:  # nothing named: the order of the calls
        seq = [Proj(*desc.linear[n], n, [n]) for n in dict.fromkeys(order) if n in desc.linear]
        fused = [p for p in seq if p.weight.shape[0] == 3 * p.weight.shape[1]]
        if fused and len(seq) >= 2:
            named["qkv"], named["o"] = [fused[0]], [seq[-1]]
        elif len(seq) >= 4:
            named["q"], named["k"], named["v"], named["o"] = [seq[0]], [seq[1]], [seq[2]], [seq[3]]
            named["by order"] = seq[:3]
    return named


def _mapped(desc: Description, mapping: dict, E: int, named: dict) -> None:
    """``mapping``'s roles override what the names say."""
    for r in ("q", "k", "v", "o", "qkv"):
        if r not in mapping:
            continue
        sub = mapping[r]
        if sub in desc.linear:
            named[r] = [Proj(*desc.linear[sub], sub, [sub])]
        elif sub in desc.params:
            named[r] = [_param_readings(sub, desc.params[sub], None, E, r)]
        elif sub in desc.modules:
            raise ValueError(f"mapping[{r!r}] = {sub!r} is a {desc.modules[sub]}, not a Linear layer.")
        else:
            raise ValueError(f"mapping[{r!r}] = {sub!r}: {desc.root} has no such layer or parameter.")


def _heads(desc: Description, mapping: dict) -> int | None:
    H = mapping.get("heads")
    if H is not None:
        return int(H)
    for name in desc.modules:  # the root first, then submodules in order
        for a in HEAD_ATTRS:
            v = desc.ints.get(name, {}).get(a)
            if isinstance(v, int) and v > 0:
                return v
    return None


def find_parts(desc: Description, mapping: dict | None, E: int, order: tuple[str, ...] = (),
               kv_sizes: tuple[int, int] | None = None) -> list[Parts]:
    """The readings of the module's projections, head count and scale, likeliest first (several where a
    raw square Parameter's orientation or a fused layout cannot be told from names). ``order``: the
    Linear-like layers in the order one call ran them; ``kv_sizes``: the keys' and values' input sizes where they
    differ from E."""
    mapping = dict(mapping or {})
    named = _named(desc, E, order, kv_sizes)
    _mapped(desc, mapping, E, named)
    H = _heads(desc, mapping)
    scale = mapping.get("scale", _conventional(desc.scale, E, H))  # the teacher's --scale, else a known convention
    scale = float(scale) if isinstance(scale, int | float) and not isinstance(scale, bool) else None
    raw = [r for r in ("q", "k", "v", "o", "qkv") if named[r] and isinstance(named[r][0], list)]
    choices = [range(len(named[r][0])) for r in raw]
    combos = list(itertools.product(*choices)) if len(raw) <= 4 else [(i,) * len(raw) for i in range(2)]
    combos.sort(key=lambda c: (len(set(c)) > 1, c))  # every Parameter read the same way first, x @ W first
    readings = []
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
    if named["by order"] and not {"q", "k", "v"} & mapping.keys():
        # roles read off the call order alone are a guess (Bloem's tokeys is called before toqueries): the
        # other orders too, the queries' and keys' swap first (the localisation tries the first two readings)
        first, second, third = named["by order"]
        for q, k, v in ((second, first, third), (first, third, second), (second, third, first),
                        (third, first, second), (third, second, first)):
            readings += [dataclasses.replace(r, q=q, k=k, v=v) for r in readings[:1]]
    readings += [t for t in (_tied(r, E) for r in readings) if t is not None]
    return [dataclasses.replace(r, guessed_o=True) for r in readings] if named["o by order"] else readings


def head_counts(parts: Parts) -> list[int]:
    """The head counts to try: the module's own attribute (when it divides the width), else every divisor
    of the width, the likeliest (attribute-free modules rarely use one head) first."""
    width = parts.width
    if parts.H is not None and parts.H > 0 and width % parts.H == 0:
        return [parts.H]
    divisors = [h for h in range(1, width + 1) if width % h == 0]
    return sorted(divisors, key=lambda h: (h == 1, h))
