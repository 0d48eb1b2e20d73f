"""Correct multi-head attention modules from a grammar of styles, for the grader's no-false-failure
property (tests/test_grader_styles.py). Every module computes exactly the course's multi-head
attention; only how it is written changes:

- proj:    how the projections are held -- nn.Linear, nn.LazyLinear, raw Parameters used as ``x @ W``
           (in, out) or ``F.linear(x, W)`` (out, in), a fused qkv Linear ([Q | K | V] or per head
           [q k v]), a per-head list of Linear layers, per-head (H, E, D) Parameters with einsum;
- fold:    how heads run in parallel -- a (B, H, L, D) matmul, folded into the batch (B*H, L, D) with
           bmm as the course's transpose_qkv, einsum, a Python loop over heads, F.scaled_dot_product_attention;
- softmax: torch.softmax, a hand-written stable one (exp(s - max) / sum), the mask multiplied in
           after exp, float64 internals, exp(s - logsumexp);
- fill:    what blocked scores become -- -inf, -1e9, -1e6 (the course's), the dtype's minimum;
- mask:    the convention the module reads -- keep (bool), block (1 = blocked), additive, the course's
           valid_lens (B,);
- scale:   scores divided by sqrt(d), or the queries multiplied by d ** -0.5 first;
- bias, the head-count attribute's name (or none), dtype of the computation.

``make(style)`` returns (module, call, mask convention); ``STYLES`` enumerates the grammar's product
(filtered to combinations that make sense) and ``sample(n, seed)`` draws from it.
"""

from __future__ import annotations

import itertools
import math
import random
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn


class Style(NamedTuple):
    proj: str = "linear"
    fold: str = "4d"
    softmax: str = "torch"
    fill: str = "-inf"
    mask: str | None = "keep"
    scale: str = "divide"
    bias: bool = True
    heads_attr: str | None = "num_heads"
    dtype: str = "float32"
    self_attention: bool = False

    def __str__(self) -> str:
        return "/".join(f"{v}" for v in self)


PROJ = ("linear", "lazy", "x@W", "F.linear", "fused-blocks", "fused-heads", "per-head-list", "per-head-params")
FOLD = ("4d", "batch", "einsum", "loop", "sdpa")
SOFTMAX = ("torch", "stable", "exp-multiply", "float64", "logsumexp")
FILL = ("-inf", "-1e9", "-1e6", "min")
MASK = (None, "keep", "block", "additive", "valid_lens")
SCALE = ("divide", "scale-q")
HEADS_ATTR = ("num_heads", "h", "n_head", None)


def _fill(name: str, dtype: torch.dtype) -> float:
    return {"-inf": float("-inf"), "-1e9": -1e9, "-1e6": -1e6, "min": torch.finfo(dtype).min}[name]


class StyledMHA(nn.Module):
    """One correct multi-head attention written in ``style``; forward(q, k, v[, mask])."""

    def __init__(self, d_model: int = 24, num_heads: int = 3, style: Style | None = None):
        super().__init__()
        style = Style() if style is None else style
        self.style, H, D, E = style, num_heads, d_model // num_heads, d_model
        self._H, self._D = H, D
        if style.heads_attr is not None:
            setattr(self, style.heads_attr, H)
        b = style.bias
        p = style.proj
        if p == "linear":
            self.W_q, self.W_k, self.W_v = nn.Linear(E, E, bias=b), nn.Linear(E, E, bias=b), nn.Linear(E, E, bias=b)
        elif p == "lazy":  # the course's: input sizes inferred on the first call
            self.W_q, self.W_k, self.W_v = (nn.LazyLinear(E, bias=b) for _ in range(3))
        elif p in ("x@W", "F.linear"):
            shape = (E, E)
            self.w_q, self.w_k, self.w_v = (nn.Parameter(torch.randn(*shape) / math.sqrt(E)) for _ in range(3))
            if b:
                self.b_q, self.b_k, self.b_v = (nn.Parameter(0.1 * torch.randn(E)) for _ in range(3))
        elif p in ("fused-blocks", "fused-heads"):
            self.qkv = nn.Linear(E, 3 * E, bias=b)
        elif p == "per-head-list":
            self.q_heads = nn.ModuleList(nn.Linear(E, D, bias=b) for _ in range(H))
            self.k_heads = nn.ModuleList(nn.Linear(E, D, bias=b) for _ in range(H))
            self.v_heads = nn.ModuleList(nn.Linear(E, D, bias=b) for _ in range(H))
        elif p == "per-head-params":
            self.Wq, self.Wk, self.Wv = (nn.Parameter(torch.randn(H, E, D) / math.sqrt(E)) for _ in range(3))
        else:
            raise ValueError(p)
        self.W_o = nn.LazyLinear(E, bias=b) if p == "lazy" else nn.Linear(E, E, bias=b)

    # --- projections to (B, H, L, D) -----------------------------------------------------------
    def _project(self, x, which):
        s, H, D = self.style, self._H, self._D
        B, L, _ = x.shape
        if s.proj in ("linear", "lazy"):
            y = getattr(self, f"W_{which}")(x)
        elif s.proj == "x@W":
            y = x @ getattr(self, f"w_{which}") + (getattr(self, f"b_{which}") if s.bias else 0)
        elif s.proj == "F.linear":
            y = F.linear(x, getattr(self, f"w_{which}"), getattr(self, f"b_{which}") if s.bias else None)
        elif s.proj == "fused-blocks":
            y = self.qkv(x).chunk(3, dim=-1)["qkv".index(which)]
        elif s.proj == "fused-heads":
            y = self.qkv(x).view(B, L, H, 3, D)[:, :, :, "qkv".index(which)].reshape(B, L, H * D)
        elif s.proj == "per-head-list":
            return torch.stack([lin(x) for lin in getattr(self, f"{which}_heads")], dim=1)  # (B, H, L, D)
        else:  # per-head-params: (H, E, D)
            return torch.einsum("ble,hed->bhld", x, getattr(self, f"W{which}"))
        return y.view(B, L, H, D).transpose(1, 2)  # (B, L, H*D) -> (B, H, L, D)

    # --- masks --------------------------------------------------------------------------------
    def _blocked(self, mask, B, Lq, Lk):
        """(B, 1, Lq, Lk) True = blocked, or None; from the module's own convention."""
        conv = self.style.mask
        if mask is None or conv is None:
            return None
        if conv == "valid_lens":
            return (torch.arange(Lk)[None, :] >= mask[:, None])[:, None, None, :].expand(B, 1, Lq, Lk)
        if conv == "keep":
            return ~mask.bool()
        if conv == "block":
            return mask.bool()
        return mask < -1e3  # additive: -inf (or very negative) where blocked

    # --- attention weights ----------------------------------------------------------------------
    def _softmax(self, s, blocked):
        st = self.style
        if st.dtype == "float64":
            s = s.double()
        if blocked is not None and st.softmax != "exp-multiply":
            s = s.masked_fill(blocked, _fill(st.fill, s.dtype))
        if st.softmax == "torch":
            w = torch.softmax(s, dim=-1)
        elif st.softmax == "float64":
            w = F.softmax(s.double(), dim=-1).to(s.dtype)
        elif st.softmax == "stable":
            e = torch.exp(s - s.max(dim=-1, keepdim=True).values)
            w = e / e.sum(dim=-1, keepdim=True)
        elif st.softmax == "logsumexp":
            w = torch.exp(s - torch.logsumexp(s, dim=-1, keepdim=True))
        else:  # exp-multiply: the mask multiplied in after exp
            e = torch.exp(s - s.max(dim=-1, keepdim=True).values)
            if blocked is not None:
                e = e * (~blocked).to(e.dtype)
            w = e / e.sum(dim=-1, keepdim=True).clamp_min(1e-30)
        return w

    def _attend(self, Q, K, V, blocked):
        """(B, H, Lq, D), (B, H, Lk, D), (B, H, Lk, D) -> (B, H, Lq, D)."""
        st, H, D = self.style, self._H, self._D
        B, _, Lq, _ = Q.shape
        Lk = K.shape[2]
        if st.scale == "scale-q":
            Q, div = Q * D ** -0.5, 1.0
        else:
            div = math.sqrt(D)
        if st.fold == "sdpa":
            keep = None if blocked is None else ~blocked
            return F.scaled_dot_product_attention(Q, K, V, attn_mask=keep, scale=1.0 if st.scale == "scale-q" else None)
        if st.fold == "batch":  # heads folded into the batch: (B*H, L, D), sequence b's head h at b*H + h
            q, k, v = (t.reshape(B * H, -1, D) for t in (Q, K, V))
            s = torch.bmm(q, k.transpose(1, 2)) / div  # (B*H, Lq, Lk)
            bl = None if blocked is None else blocked.expand(B, 1, Lq, Lk).repeat_interleave(H, dim=0)[:, 0]
            w = self._softmax(s, bl)
            return torch.bmm(w, v.to(w.dtype)).to(Q.dtype).reshape(B, H, Lq, D)
        if st.fold == "loop":
            outs = []
            for h in range(H):
                s = Q[:, h] @ K[:, h].transpose(-2, -1) / div  # (B, Lq, Lk)
                w = self._softmax(s, None if blocked is None else blocked[:, 0])
                outs.append((w @ V[:, h].to(w.dtype)).to(Q.dtype))
            return torch.stack(outs, dim=1)
        if st.fold == "einsum":
            s = torch.einsum("bhqd,bhkd->bhqk", Q, K) / div
            w = self._softmax(s, blocked)
            return torch.einsum("bhqk,bhkd->bhqd", w, V.to(w.dtype)).to(Q.dtype)
        s = Q @ K.transpose(-2, -1) / div  # 4d
        w = self._softmax(s, blocked)
        return (w @ V.to(w.dtype)).to(Q.dtype)

    def forward(self, q, k, v, mask=None):
        B, Lq, E = q.shape
        Q, K, V = self._project(q, "q"), self._project(k, "k"), self._project(v, "v")
        Oh = self._attend(Q, K, V, self._blocked(mask, B, Lq, k.shape[1]))  # (B, H, Lq, D)
        return self.W_o(Oh.transpose(1, 2).reshape(B, Lq, E))  # (B, Lq, H*D)


def valid(style: Style) -> bool:
    """Combinations that make sense: SDPA takes its own softmax; the mask multiplied after exp has no
    fill; without a mask neither does anything; per-head layouts of the folding follow the projections."""
    if style.fold == "sdpa" and (style.softmax != "torch" or style.fill != "-inf" or style.dtype != "float32"):
        return False
    if style.softmax == "exp-multiply" and style.fill != "-inf":
        return False
    if style.mask is None and (style.fill != "-inf" or style.softmax == "exp-multiply"):
        return False
    if style.proj == "lazy" and not style.bias:
        return False
    return True


def styles() -> list[Style]:
    out = []
    for p, f, s, fi, m, sc, h, dt in itertools.product(PROJ, FOLD, SOFTMAX, FILL, MASK, SCALE, HEADS_ATTR,
                                                       ("float32", "float64")):
        st = Style(p, f, s, fi, m, sc, True, h, dt)
        if valid(st):
            out.append(st)
    return out


def sample(n: int, seed: int) -> list[Style]:
    """``n`` styles drawn from the grammar (with and without biases, cross- and self-attention)."""
    rng = random.Random(seed)
    pool = styles()
    return [rng.choice(pool)._replace(bias=rng.random() < 0.7 or False, self_attention=rng.random() < 0.3)
            for _ in range(n)]


def call_of(style: Style) -> str:
    return "qkv" if style.mask is None else "qkv_mask"


def make(style: Style, d_model: int = 24, num_heads: int = 3, seed: int = 0):
    """(module, call, mask convention) for ``multihead.check``."""
    torch.manual_seed(seed)
    if style.proj == "lazy" and not style.bias:
        style = style._replace(bias=True)
    return StyledMHA(d_model, num_heads, style), call_of(style), style.mask
