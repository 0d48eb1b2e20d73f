"""One-bug attention modules written apart from the grader's localisation (issue 33 point 2): the
mistakes were listed and the modules written before the localisation was changed, in styles the zoo
(tests/check_zoo.py) does not use -- a (B*H, L, D) fold with bmm, a qkv Linear split by view,
einsum with per-head parameters, a per-head Python loop. ``BUGS``: (id, factory, call, mask,
self_attention, a regex the first finding's name should match when the mistake is *named*).
Measured by tests/test_grader_localise.py: each must be NOT OK (caught); the share whose finding
matches is reported (named)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

E, H = 24, 3
D = E // H


class Base(nn.Module):
    """Course-style: (B, L, E) -> heads folded into the batch (B*H, L, D), bmm, merged back."""

    def __init__(self):
        super().__init__()
        self.num_heads = H
        self.query, self.key, self.value, self.out = (nn.Linear(E, E) for _ in range(4))

    def fold(self, x):  # (B, L, H*D) -> (B*H, L, D)
        B, L, _ = x.shape
        return x.view(B, L, H, D).permute(0, 2, 1, 3).reshape(B * H, L, D)

    def unfold(self, x, B):  # (B*H, L, D) -> (B, L, H*D)
        return x.view(B, H, -1, D).permute(0, 2, 1, 3).reshape(B, -1, H * D)

    def scores(self, Q, K):
        return torch.bmm(Q, K.transpose(1, 2)) / math.sqrt(D)

    def normalise(self, s):
        return torch.softmax(s, dim=-1)

    def combine(self, Oh, B):
        return self.out(self.unfold(Oh, B))

    def project(self, q, k, v):
        return self.query(q), self.key(k), self.value(v)

    def forward(self, q, k, v, keep=None):
        B = q.shape[0]
        Qp, Kp, Vp = self.project(q, k, v)
        Q, K, V = self.fold(Qp), self.fold(Kp), self.fold(Vp)
        s = self.scores(Q, K)
        if keep is not None:
            s = s.masked_fill(~keep.repeat_interleave(H, dim=0)[:, 0], -1e9)
        return self.combine(torch.bmm(self.normalise(s), V), B)


class HeadsAveraged(Base):  # heads averaged instead of concatenated (the output projection takes D)
    def __init__(self):
        super().__init__()
        self.out = nn.Linear(D, E)

    def combine(self, Oh, B):
        return self.out(Oh.view(B, H, -1, D).mean(1))


class HeadsSummed(Base):  # heads summed into one D-wide vector
    def __init__(self):
        super().__init__()
        self.out = nn.Linear(D, E)

    def combine(self, Oh, B):
        return self.out(Oh.view(B, H, -1, D).sum(1))


class HeadsReordered(Base):  # heads concatenated in reverse order
    def combine(self, Oh, B):
        o = Oh.view(B, H, -1, D).flip(1)
        return self.out(o.permute(0, 2, 1, 3).reshape(B, -1, H * D))


class HeadDropped(Base):  # the last head left out of the merge (zeros in its place)
    def combine(self, Oh, B):
        o = Oh.view(B, H, -1, D).clone()
        o[:, -1] = 0
        return self.out(o.permute(0, 2, 1, 3).reshape(B, -1, H * D))


class PositionBias(Base):  # an additive term that depends on the key's position
    def scores(self, Q, K):
        Lk = K.shape[1]
        return super().scores(Q, K) + 0.5 * torch.arange(Lk, dtype=Q.dtype)


class RelativeDistance(Base):  # scores minus |i - j|: depends on positions (a learned-bias look-alike)
    def scores(self, Q, K):
        Lq, Lk = Q.shape[1], K.shape[1]
        dist = (torch.arange(Lq)[:, None] - torch.arange(Lk)[None, :]).abs().to(Q.dtype)
        return super().scores(Q, K) - 0.3 * dist


class UnstableSoftmax(Base):  # exp without subtracting the row maximum: inf/NaN once scores pass ~88
    def normalise(self, s):
        e = torch.exp(s)
        return e / e.sum(-1, keepdim=True)


class ValuesFromQueries(Base):  # the value projection applied to the query input
    def project(self, q, k, v):
        return self.query(q), self.key(k), self.value(q)


class QueryWeightsForKeys(Base):  # W_q used for the keys too
    def project(self, q, k, v):
        return self.query(q), self.query(k), self.value(v)


class DropoutInEval(Base):  # F.dropout with training=True always
    def normalise(self, s):
        return F.dropout(torch.softmax(s, -1), 0.2, training=True)


class SoftmaxOverHeads(Base):  # softmax over the heads axis of (B, H, Lq, Lk)
    def normalise(self, s):
        BH, Lq, Lk = s.shape
        return torch.softmax(s.view(-1, H, Lq, Lk), dim=1).view(BH, Lq, Lk)


class ScaleByModel(Base):  # scores divided by sqrt(d_model) instead of sqrt(d_k)
    def scores(self, Q, K):
        return torch.bmm(Q, K.transpose(1, 2)) / math.sqrt(E)


class FusedQKV(nn.Module):
    """A fused qkv Linear split by view into (B, L, 3, H, D), einsum; ``bug`` switches one mistake."""

    def __init__(self, bug=""):
        super().__init__()
        self.n_heads, self.bug = H, bug
        self.qkv, self.proj = nn.Linear(E, 3 * E), nn.Linear(E, E)

    def forward(self, x):
        B, L, _ = x.shape
        q, k, v = self.qkv(x).view(B, L, 3, H, D).unbind(2)  # 3 x (B, L, H, D)
        s = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(D)
        if self.bug == "temperature":  # softmax of the scores times 2
            s = 2 * s
        w = torch.softmax(s, -1)
        if self.bug == "transpose weights":  # weights transposed (keys attend to queries)
            w = w.transpose(-2, -1)
        o = torch.einsum("bhqk,bkhd->bqhd", w, v)
        if self.bug == "no merge transpose":  # (B, H, L, D) layout reshaped as if (B, L, H, D)
            o = torch.einsum("bhqk,bkhd->bhqd", w, v).reshape(B, L, H * D)
            return self.proj(o)
        return self.proj(o.reshape(B, L, H * D))


class LoopHeads(nn.Module):
    """A Python loop over heads with per-head parameters (H, E, D); ``bug``: one mistake."""

    def __init__(self, bug=""):
        super().__init__()
        self.h, self.bug = H, bug
        self.Wq, self.Wk, self.Wv = (nn.Parameter(torch.randn(H, E, D) / math.sqrt(E)) for _ in range(3))
        self.Wo = nn.Parameter(torch.randn(H * D, E) / math.sqrt(E))

    def forward(self, q, k, v):
        outs = []
        for h in range(H):
            Q, K, V = q @ self.Wq[h], k @ self.Wk[h], v @ self.Wv[0 if self.bug == "one head's values" else h]
            w = torch.softmax(Q @ K.transpose(-2, -1) / math.sqrt(D), -1)
            outs.append(w @ V)
        return torch.cat(outs, -1) @ self.Wo


def _keep(B, Lq, Lk):
    return None


BUGS = [
    ("heads averaged", HeadsAveraged, "qkv_mask", "keep", False, r"averag|heads? (merge|combin)"),
    ("heads summed", HeadsSummed, "qkv_mask", "keep", False, r"summ|heads? (merge|combin)"),
    ("heads reordered", HeadsReordered, "qkv_mask", "keep", False, r"order|heads? (merge|combin)"),
    ("a head dropped", HeadDropped, "qkv_mask", "keep", False, r"head.*(dropped|missing|zero|left out)"),
    ("position bias on keys", PositionBias, "qkv_mask", "keep", False, r"order of the keys|position"),
    ("relative distance", RelativeDistance, "qkv_mask", "keep", True, r"order|position"),
    ("unstable softmax", UnstableSoftmax, "qkv_mask", "keep", False, r"overflow|stab|maximum|NaN|inf"),
    ("values from queries", ValuesFromQueries, "qkv_mask", "keep", False, r"value projection applied to the query"),
    ("W_q for keys", QueryWeightsForKeys, "qkv_mask", "keep", False, r"query projection.*key|W_q.*key"),
    ("dropout in eval", DropoutInEval, "qkv_mask", "keep", False, r"dropout"),
    ("softmax over heads", SoftmaxOverHeads, "qkv_mask", "keep", False, r"axis|heads"),
    ("scale sqrt(d_model)", ScaleByModel, "qkv_mask", "keep", False, r"d_model"),
    ("fused: temperature 2", lambda: FusedQKV("temperature"), "x", None, True, r"scal"),
    ("fused: weights transposed", lambda: FusedQKV("transpose weights"), "x", None, True, r"axis|transpos"),
    ("fused: merge without transpose", lambda: FusedQKV("no merge transpose"), "x", None, True, r"merge"),
    ("loop: one head's values", lambda: LoopHeads("one head's values"), "qkv", None, False, r"head 0|one head|same values"),
]
