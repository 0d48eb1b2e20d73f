"""A second set of one-bug modules, written after the localisation was rebuilt and measured without
changing it (issue 33 point 2's honest measure; tests/test_grader.py asserts every one is caught and
reports how many are named). Styles: the Annotated Transformer's unnamed Linear list, a vision
transformer's fused qkv, BERT's transpose_for_scores, a per-head Python loop with per-head Linear
layers. ``BUGS2``: (id, factory, call, mask, self_attention, causal, regex a naming finding matches)."""

from __future__ import annotations

import math

import torch
from torch import nn

E, H = 32, 4
D = E // H


class Unnamed(nn.Module):
    """Four unnamed Linear layers in a list, a free attention function; ``bug`` switches one mistake."""

    def __init__(self, bug=""):
        super().__init__()
        self.h, self.bug = H, bug
        self.linears = nn.ModuleList(nn.Linear(E, E) for _ in range(4))

    def forward(self, q, k, v, keep=None):
        B = q.shape[0]
        Q, K, V = (lin(x).view(B, -1, H, D).transpose(1, 2) for lin, x in zip(self.linears, (q, k, v)))
        s = Q @ K.transpose(-2, -1) / math.sqrt(D)
        if self.bug == "square scores":  # scores squared (a learner's 'sharpening')
            s = s * s.abs()
        if keep is not None:
            s = s.masked_fill(keep == 0, -1e9)
        if self.bug == "mask on queries":  # the mask transposed: blocks queries, not keys
            s = s.masked_fill(keep.transpose(-2, -1)[..., : s.shape[-2], : s.shape[-1]] == 0, -1e9) \
                if keep is not None else s
        w = s.softmax(-1)
        if self.bug == "renormalised twice":  # weights divided by their max after the softmax
            w = w / w.amax(-1, keepdim=True)
        o = (w @ V).transpose(1, 2).reshape(B, -1, E)
        if self.bug == "tanh output":
            return torch.tanh(self.linears[-1](o))
        return self.linears[-1](o)


class VisionBug(nn.Module):
    """A fused qkv reshaped (B, N, 3, H, D); ``bug``: one mistake."""

    def __init__(self, bug=""):
        super().__init__()
        self.num_heads, self.bug = H, bug
        self.qkv, self.proj = nn.Linear(E, 3 * E), nn.Linear(E, E)

    def forward(self, x):
        B, N, C = x.shape
        if self.bug == "qkv order":  # the chunks taken as (k, q, v)
            k, q, v = self.qkv(x).reshape(B, N, 3, H, D).permute(2, 0, 3, 1, 4).unbind(0)
        else:
            q, k, v = self.qkv(x).reshape(B, N, 3, H, D).permute(2, 0, 3, 1, 4).unbind(0)
        attn = (q @ k.transpose(-2, -1)) * D ** -0.5
        if self.bug == "causal by accident":  # a lower-triangular mask in an encoder
            attn = attn.masked_fill(torch.ones(N, N).triu(1).bool(), float("-inf"))
        attn = attn.softmax(-1)
        out = (attn @ v).transpose(1, 2).reshape(B, N, C)
        if self.bug == "no output projection":
            return out
        return self.proj(out)


class BertBug(nn.Module):
    """BERT's transpose_for_scores with an additive mask; ``bug``: one mistake."""

    def __init__(self, bug=""):
        super().__init__()
        self.num_attention_heads, self.bug = H, bug
        self.query, self.key, self.value, self.dense = (nn.Linear(E, E) for _ in range(4))

    def t(self, x):
        return x.view(*x.shape[:-1], H, D).permute(0, 2, 1, 3)

    def forward(self, q, k, v, attention_mask=None):
        Q, K, V = self.t(self.query(q)), self.t(self.key(k)), self.t(self.value(v))
        s = Q @ K.transpose(-1, -2) / math.sqrt(D)
        if attention_mask is not None:
            s = s - attention_mask if self.bug == "mask subtracted" else s + attention_mask
        p = s.softmax(-1)
        if self.bug == "bias into values":  # the value bias added after the weighting, per head
            return self.dense((p @ (V - self.t(self.value.bias.expand_as(v[..., :E])))).permute(0, 2, 1, 3)
                              .reshape(*q.shape[:2], E))
        return self.dense((p @ V).permute(0, 2, 1, 3).reshape(*q.shape[:2], E))


class HeadLoop(nn.Module):
    """Per-head Linear layers in ModuleLists and a loop; ``bug``: one mistake."""

    def __init__(self, bug=""):
        super().__init__()
        self.n_heads, self.bug = H, bug
        self.q_heads = nn.ModuleList(nn.Linear(E, D) for _ in range(H))
        self.k_heads = nn.ModuleList(nn.Linear(E, D) for _ in range(H))
        self.v_heads = nn.ModuleList(nn.Linear(E, D) for _ in range(H))
        self.out = nn.Linear(E, E)

    def forward(self, q, k, v):
        outs = []
        for h in range(H):
            K = self.k_heads[h](k)
            Q = self.q_heads[0 if self.bug == "one query head" else h](q)
            w = torch.softmax(Q @ K.transpose(-2, -1) / math.sqrt(D), -1)
            outs.append(w @ self.v_heads[h](v))
        if self.bug == "last head only":
            outs = [outs[-1]] * H
        return self.out(torch.cat(outs, -1))


def _annotated(m, q, k, v, keep):
    return m(q, k, v, keep)


BUGS2 = [
    ("unnamed: squared scores", lambda: Unnamed("square scores"), "qkv", None, False, False, r"score|softmax"),
    ("unnamed: weights over max", lambda: Unnamed("renormalised twice"), "qkv", None, False, False,
     r"normalis|sum to 1"),
    ("unnamed: tanh on the output", lambda: Unnamed("tanh output"), "qkv", None, False, False, r"output"),
    ("vision: q and k swapped", lambda: VisionBug("qkv order"), "x", None, True, False, r"transpos|swap|order"),
    ("vision: causal in an encoder", lambda: VisionBug("causal by accident"), "x", None, True, False, r"causal|mask"),
    ("vision: no output projection", lambda: VisionBug("no output projection"), "x", None, True, False,
     r"output projection"),
    ("bert: mask subtracted", lambda: BertBug("mask subtracted"), "qkv_mask", "additive", False, False,
     r"mask|polarity|invert"),
    ("head loop: one query head", lambda: HeadLoop("one query head"), "qkv", None, False, False, r"head 0|quer"),
    ("head loop: last head only", lambda: HeadLoop("last head only"), "qkv", None, False, False,
     r"head|merge|concat"),
]
