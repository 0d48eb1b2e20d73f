"""Attention modules written the ways learners write them, each correct or with one (or two)
bugs, for tests/test_check.py. Styles: four named Linear layers, a fused qkv Linear (two
layouts), raw Parameters with einsum, per-head lists of Linear layers, a wrapper around an
inner module, an additive float mask, unnamed Linear layers in a list (the course's
valid_lens). Bugs are switched on by name: ``bug`` is a set of strings."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def weigh(Q, K, V, blocked, bugs, fill=float("-inf")):
    """Q (B, H, Lq, D), K, V (B, H, Lk, D), blocked (bool, broadcastable, True = may not attend)
    -> (B, H, Lq, D), with ``bugs`` applied where they act on the scores and the weights."""
    d = Q.shape[-1]
    s = torch.einsum("bhqd,bhkd->bhqk", Q, K)
    if "scale d_k" in bugs:
        s = s / d
    elif "scale d_model" in bugs:
        s = s / math.sqrt(d * Q.shape[1])
    elif "times sqrt" in bugs:
        s = s * math.sqrt(d)
    elif "scale twice" in bugs:
        s = s / math.sqrt(d) / math.sqrt(d)
    elif "no scale" not in bugs:
        s = s * d ** -0.5
    if blocked is not None:
        if "inverted" in bugs:
            blocked = ~blocked
        if "first mask" in bugs:
            blocked = blocked[:1].expand(blocked.shape)
        if "after softmax" in bugs:
            w = torch.softmax(s, -1).masked_fill(blocked, 0.0)
            return w @ V
        if "raw" in bugs:
            return s.masked_fill(blocked, 0.0) @ V
        if "ignore mask" not in bugs:
            s = s.masked_fill(blocked, 0.0 if "fill 0" in bugs else 1e9 if "fill +1e9" in bugs else fill)
    if "raw" in bugs:
        return s @ V
    if "sigmoid" in bugs:
        return torch.sigmoid(s) @ V
    if "log_softmax" in bugs:
        return torch.log_softmax(s, -1) @ V
    axis = -2 if "axis queries" in bugs else (1 if "axis heads" in bugs else -1)
    w = torch.softmax(s, axis)
    if "nan_to_num" in bugs:
        w = w.nan_to_num()
    if "dropout" in bugs:
        w = F.dropout(w, 0.3, training=True)
    return w @ (K if "keys as values" in bugs else V)


class FourLinear(nn.Module):
    """Four named Linear layers; forward(q, k, v, mask) with 1 = blocked (the Keras tutorial's way)."""

    def __init__(self, d_model=32, num_heads=4, bug=(), fill=float("-inf")):
        super().__init__()
        self.num_heads, self.d_k, self.bug, self.fill = num_heads, d_model // num_heads, set(bug), fill
        self.W_q, self.W_k = nn.Linear(d_model, d_model), nn.Linear(d_model, d_model)
        self.W_v, self.W_o = nn.Linear(d_model, d_model), nn.Linear(d_model, d_model)

    def heads(self, x):
        b, n, _ = x.shape
        if "split" in self.bug:
            return x.reshape(b, self.num_heads, n, self.d_k)
        return x.reshape(b, n, self.num_heads, self.d_k).permute(0, 2, 1, 3)

    def forward(self, q, k, v, mask=None):
        if mask is not None and "mask in place" in self.bug:  # 1 = blocked made additive in the caller's tensor
            mask *= -1e9
        if mask is not None and "cache mask" in self.bug:  # the first mask of each shape kept for every later call
            if getattr(self, "_mask", None) is None or self._mask.shape != mask.shape:
                self._mask = mask
            mask = self._mask
        Q = self.heads(self.W_q(k if "q from k" in self.bug else q))
        K = self.heads(self.W_k(v if "k from v" in self.bug else k))
        if "v as k" in self.bug:
            K = self.heads(self.W_v(v))
        V = self.heads(self.W_v(k if "v from k" in self.bug else v))
        o = weigh(Q, K, V, None if mask is None else mask.bool(), self.bug, self.fill)
        b, h, n, d = o.shape
        if "merge" in self.bug:
            o = o.reshape(b, n, h * d)
        elif "stack heads" in self.bug:  # the heads stacked on the last axis, then flattened: interleaved
            o = torch.stack(o.unbind(1), -1).flatten(-2)  # (B, H, Lq, D) -> (B, Lq, D, H) -> (B, Lq, D*H)
        else:
            o = o.permute(0, 2, 1, 3).reshape(b, n, h * d)
        if "no out" in self.bug:
            return o
        if "new layer" in self.bug:  # the output projection built in forward: new weights at every call
            return nn.Linear(o.shape[-1], o.shape[-1])(o)
        return self.W_o(o) + (q if "residual" in self.bug else 0)


class Fused(nn.Module):
    """One qkv Linear, self-attention forward(x); ``layout`` "blocks" ([Q | K | V]) or "heads"
    (each head's q, k, v side by side)."""

    def __init__(self, dim=32, heads=4, bug=(), layout="blocks"):
        super().__init__()
        self.heads, self.bug, self.layout = heads, set(bug), layout
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, c = x.shape
        if "batch 3" in self.bug:  # the batch size written in
            b = 3
        if self.layout == "blocks":
            q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        else:
            q, k, v = self.qkv(x).reshape(b, n, self.heads, 3, c // self.heads).permute(3, 0, 2, 1, 4)
        if "split" in self.bug:
            q, k, v = (t.transpose(1, 2).reshape(b, self.heads, n, -1) for t in (q, k, v))
        if "batch keys" in self.bug:  # every sequence's keys and values in one pool: the batch rows tied together
            k, v = (t.transpose(0, 1).reshape(1, self.heads, b * n, -1).expand(b, -1, -1, -1) for t in (k, v))
            # (B, H, L, D) -> (H, B, L, D) -> (1, H, B*L, D) -> (B, H, B*L, D)
        o = weigh(q, k, v, None, self.bug)
        return self.proj(o.transpose(1, 2).reshape(b, n, c))


class Einsum(nn.Module):
    """Raw Parameters (E, E) used as x @ W, einsum for the heads; forward(q, k, v, keep) with
    True = may attend; fills blocked scores with -1e9."""

    def __init__(self, d_model=24, n_heads=3, bug=()):
        super().__init__()
        self.n_heads, self.bug = n_heads, set(bug)
        self.wq, self.wk, self.wv, self.wo = (nn.Parameter(torch.randn(d_model, d_model) / d_model ** 0.5)
                                              for _ in range(4))

    def forward(self, q, k, v, keep=None):
        h = self.n_heads
        Q, K, V = (torch.einsum("ble,ef->blf", x, w).unflatten(-1, (h, -1)).transpose(1, 2)
                   for x, w in ((q, self.wq), (k, self.wk), (k if "v from k" in self.bug else v, self.wv)))
        o = weigh(Q, K, V, None if keep is None else ~keep, self.bug, fill=-1e9)
        o = o.transpose(1, 2).flatten(2)
        return o if "no out" in self.bug else o @ self.wo


class Head(nn.Module):
    def __init__(self, d_model, d_head):
        super().__init__()
        self.query, self.key, self.value = (nn.Linear(d_model, d_head, bias=False) for _ in range(3))


class PerHead(nn.Module):
    """A list of heads, each with its own query/key/value Linear; the heads' outputs are
    concatenated and projected; forward(q, k, v, mask) with 1 = blocked, filled with -1e4."""

    def __init__(self, d_model=32, h=4, bug=()):
        super().__init__()
        self.bug = set(bug)
        self.attn_heads = nn.ModuleList([Head(d_model, d_model // h)] * h if "one head" in self.bug else
                                        [Head(d_model, d_model // h) for _ in range(h)])
        self.out = nn.Linear(d_model, d_model)

    def forward(self, q, k, v, mask=None):
        outs = []
        for hd in self.attn_heads:
            Q, K, V = hd.query(q)[:, None], hd.key(k)[:, None], hd.value(v)[:, None]  # (B, 1, L, D)
            outs.append(weigh(Q, K, V, None if mask is None else mask.bool(), self.bug, fill=-1e4)[:, 0])
        return self.out(torch.cat(outs, -1))


class Inner(nn.Module):
    def __init__(self, d_model, num_heads, bug):
        super().__init__()
        self.num_heads, self.bug = num_heads, bug
        self.wq, self.wk, self.wv = (nn.Linear(d_model, d_model) for _ in range(3))
        self.fc_out = nn.Linear(d_model, d_model)

    def forward(self, q, k, v):
        b, lq, e = q.shape
        Q, K, V = (lin(x).view(b, x.shape[1], self.num_heads, -1).transpose(1, 2)
                   for lin, x in ((self.wq, q), (self.wk, k), (self.wv, v)))
        n = k.shape[1]
        diag = 2 if "causal +1" in self.bug else (0 if "causal diag" in self.bug else 1)
        blocked = torch.ones(lq, n, dtype=torch.bool).triu(diag)
        o = weigh(Q, K, V, blocked, self.bug)
        return self.fc_out(o.transpose(1, 2).reshape(b, lq, e))


class Wrapper(nn.Module):
    """A causal decoder's attention behind a wrapper: the projections live in ``self.inner``."""

    def __init__(self, d_model=32, heads=4, bug=()):
        super().__init__()
        self.inner = Inner(d_model, heads, set(bug))

    def forward(self, q, k, v):
        return self.inner(q, k, v)


class Additive(nn.Module):
    """forward(q, k, v, bias) with a float mask added to the scores (-inf = blocked); Linear layers
    named query/key/value/dense as in BERT."""

    def __init__(self, hidden=32, num_attention_heads=2, bug=()):
        super().__init__()
        self.num_attention_heads, self.bug = num_attention_heads, set(bug)
        self.query, self.key, self.value = (nn.Linear(hidden, hidden) for _ in range(3))
        self.dense = nn.Linear(hidden, hidden)

    def forward(self, q, k, v, bias=None):
        h = self.num_attention_heads
        Q, K, V = (lin(x).unflatten(-1, (h, -1)).transpose(1, 2) for lin, x in ((self.query, q), (self.key, k),
                                                                                (self.value, v)))
        d = Q.shape[-1]
        s = Q @ K.transpose(-1, -2)
        s = s / d if "scale twice" in self.bug else s / math.sqrt(d)
        if bias is not None:
            s = s + bias
        w = torch.softmax(s, -2 if "axis queries" in self.bug else -1)
        return self.dense((w @ V).transpose(1, 2).flatten(2))


class Listed(nn.Module):
    """Four Linear layers in an unnamed list (called in order q, k, v, out); the course's valid_lens
    (B,): keys at positions >= valid_lens[b] are padding."""

    def __init__(self, d=20, h=5, bug=()):
        super().__init__()
        self.h, self.bug = h, set(bug)
        self.linears = nn.ModuleList(nn.Linear(d, d) for _ in range(4))

    def forward(self, q, k, v, valid_lens=None):
        b = q.shape[0]
        Q, K, V = (lin(x).view(b, -1, self.h, x.shape[-1] // self.h).transpose(1, 2)
                   for lin, x in zip(self.linears, (q, k, v), strict=False))
        blocked = None
        if valid_lens is not None:
            lens = valid_lens[:1].expand(b) if "first mask" in self.bug else valid_lens + ("lens+1" in self.bug)
            blocked = (torch.arange(K.shape[2]) >= lens[:, None])[:, None, None, :]  # (B,) -> (B, 1, 1, Lk)
            if "repeat" in self.bug:  # the course's (B*H) layout with lengths cycled through the batch
                per = valid_lens.repeat(self.h)  # (B*H,), should be repeat_interleave
                blocked = (torch.arange(K.shape[2]) >= per[:, None]).view(b, self.h, 1, -1)  # (B*H,) -> (B, H, 1, Lk)
        o = weigh(Q, K, V, blocked, self.bug - {"first mask", "lens+1", "repeat"}, fill=-1e6)
        return self.linears[3](o.transpose(1, 2).reshape(b, -1, self.h * Q.shape[-1]))


class SequenceFirst(nn.Module):
    """torch.nn's default layout: (L, B, E) in and out, a (B, Lk) key-padding mask (True = padding) by keyword."""

    def __init__(self, d_model=32, num_heads=4, bug=()):
        super().__init__()
        self.attn = nn.MultiheadAttention(d_model, num_heads)

    def forward(self, q, k, v, key_padding_mask=None):
        return self.attn(q, k, v, key_padding_mask=key_padding_mask, need_weights=False)[0]


class DictReturn(nn.Module):
    """Returns {"output": (B, Lq, E), "attention": (B, H, Lq, Lk)}; a bool keep mask."""

    def __init__(self, d_model=32, num_heads=4, bug=()):
        super().__init__()
        self.h, self.bug = num_heads, set(bug)
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(d_model, d_model) for _ in range(4))

    def forward(self, q, k, v, mask=None):
        B, Lq, E = q.shape
        Q, K, V = (p(x).view(B, x.shape[1], self.h, -1).transpose(1, 2)  # (B, L, E) -> (B, H, L, D)
                   for p, x in ((self.q_proj, q), (self.k_proj, k), (self.v_proj, v)))
        s = Q @ K.transpose(-1, -2) / (Q.shape[-1] if "scale d_k" in self.bug else math.sqrt(Q.shape[-1]))
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        w = s.softmax(-1)  # (B, H, Lq, Lk)
        return {"output": self.out_proj((w @ V).transpose(1, 2).reshape(B, Lq, E)), "attention": w}


# (style, constructor, call, mask, causal) for each style
STYLES = {
    "four Linear": (FourLinear, "qkv_mask", "block", False),
    "fused": (Fused, "x", None, False),
    "fused, heads layout": (lambda bug=(): Fused(bug=bug, layout="heads"), "x", None, False),
    "einsum Parameters": (Einsum, "qkv_mask", "keep", False),
    "per-head lists": (PerHead, "qkv_mask", "block", False),
    "wrapper, causal": (Wrapper, "qkv", None, True),
    "additive mask": (Additive, "qkv_mask", "additive", False),
    "unnamed list, valid_lens": (Listed, "qkv_mask", "valid_lens", False),
    # conventions found, not listed: each graded on the course's own (B, 1, Lq, Lk) mask
    "sequence-first, key padding": (SequenceFirst, "qkv_mask", "block", False),
    "dict output": (DictReturn, "qkv_mask", "keep", False),
    "additive mask given a keep mask": (Additive, "qkv_mask", "keep", False),
}

# (style, bugs, the finding names expected)
BUGGY = [
    ("four Linear", {"scale d_k"}, ["scores divided by d_k"]),
    ("four Linear", {"no scale"}, ["scores not scaled"]),
    ("four Linear", {"scale d_model"}, ["scores scaled by 1/sqrt(d_model)"]),
    ("four Linear", {"axis queries"}, ["softmax over the wrong axis"]),
    ("four Linear", {"axis heads"}, ["softmax over the wrong axis"]),
    ("four Linear", {"raw"}, ["softmax skipped (values times raw scores)"]),
    ("four Linear", {"split"}, ["heads split without the transpose"]),
    ("four Linear", {"merge"}, ["heads merged in the wrong order"]),
    ("four Linear", {"stack heads"}, ["heads interleaved when merged"]),
    ("four Linear", {"inverted"}, ["mask polarity inverted"]),
    ("four Linear", {"after softmax"}, ["mask applied after the softmax"]),
    ("four Linear", {"keys as values"}, ["keys used as values"]),
    ("four Linear", {"v from k"}, ["value projection applied to the key input"]),
    ("four Linear", {"k from v"}, ["key projection applied to the value input"]),
    ("four Linear", {"dropout"}, ["dropout active in eval"]),
    ("four Linear", {"no out"}, ["output projection missing"]),
    ("four Linear", {"fill 0"}, ["blocked scores filled with 0 instead of -inf"]),
    ("four Linear", {"ignore mask"}, ["mask not applied"]),
    ("four Linear", {"first mask"}, ["the first sequence's mask used for the whole batch"]),
    ("four Linear", {"residual"}, ["residual connection inside attention"]),
    ("four Linear", {"sigmoid"}, ["sigmoid instead of softmax"]),
    ("fused", {"scale d_k"}, ["scores divided by d_k"]),
    ("fused", {"axis queries"}, ["softmax over the wrong axis"]),
    ("fused", {"split"}, ["heads split without the transpose"]),
    ("fused, heads layout", {"scale twice"}, ["scores divided by d_k"]),
    ("einsum Parameters", {"scale d_model"}, ["scores scaled by 1/sqrt(d_model)"]),
    ("einsum Parameters", {"axis queries"}, ["softmax over the wrong axis"]),
    ("einsum Parameters", {"inverted"}, ["mask polarity inverted"]),
    ("einsum Parameters", {"keys as values"}, ["keys used as values"]),
    ("einsum Parameters", {"v from k"}, ["value projection applied to the key input"]),
    ("four Linear", {"v as k"}, ["values used as keys"]),
    ("per-head lists", {"scale d_k"}, ["scores divided by d_k"]),
    ("per-head lists", {"fill 0"}, ["blocked scores filled with 0 instead of -inf"]),
    ("einsum Parameters", {"fill +1e9"}, ["blocked scores filled with a large positive value"]),
    ("wrapper, causal", {"causal +1"}, ["causal mask lets each position see the next one"]),
    ("wrapper, causal", {"causal diag", "nan_to_num"}, ["causal mask off by one"]),
    ("additive mask", {"scale twice"}, ["scores divided by d_k"]),
    ("additive mask", {"axis queries"}, ["softmax over the wrong axis"]),
    ("unnamed list, valid_lens", {"first mask"}, ["the first sequence's mask used for the whole batch"]),
    ("unnamed list, valid_lens", {"no scale"}, ["scores not scaled"]),
    ("unnamed list, valid_lens", {"lens+1"}, ["valid lengths off by one (one key too many)"]),
    ("unnamed list, valid_lens", {"repeat"}, ["lengths repeated with repeat instead of repeat_interleave"]),
    ("wrapper, causal", {"times sqrt", "nan_to_num"}, ["scores scaled by sqrt(d_k)"]),
    ("fused", {"log_softmax"}, ["log_softmax instead of softmax"]),
    # mistakes one call cannot show, each named by its property
    ("four Linear", {"mask in place"}, ["changes its caller's tensors"]),
    ("four Linear", {"cache mask"}, ["keeps state between calls"]),
    ("four Linear", {"new layer"}, ["builds a layer / draws random numbers inside forward"]),
    ("fused", {"batch keys"}, ["batch rows tied together"]),
    ("fused", {"batch 3"}, ["the batch size is hard-coded"]),
    ("per-head lists", {"one head"}, ["the heads share one set of weights"]),
    # a mistake in a module graded on a convention found
    ("dict output", {"scale d_k"}, ["scores divided by d_k"]),
    ("additive mask given a keep mask", {"scale twice"}, ["scores divided by d_k"]),
    ("additive mask given a keep mask", {"axis queries"}, ["softmax over the wrong axis"]),
]

# two bugs at once
PAIRS = [
    ("four Linear", {"scale d_k", "raw"}, ["softmax skipped (values times raw scores)", "scores divided by d_k"]),
    ("four Linear", {"merge", "inverted"}, ["heads merged in the wrong order", "mask polarity inverted"]),
    ("four Linear", {"v from k", "scale d_model"}, ["value projection applied to the key input",
                                                   "scores scaled by 1/sqrt(d_model)"]),
    ("fused", {"split", "no scale"}, ["heads split without the transpose", "scores not scaled"]),
]
