"""Correct multi-head attention written the ways well-known code writes it (our own code, in their
styles; none of it copied): the Annotated Transformer's four unnamed Linear layers and a free
``attention`` function, a vision transformer's fused ``qkv`` reshaped to (3, B, H, N, D), GPT-2's
``c_attn`` raw weight (E, 3E) used as ``x @ W + b`` with a causal buffer, BERT's
``transpose_for_scores`` with an additive mask, a ``to_q`` / ``to_kv`` pair (keys and values fused),
torch.nn.MultiheadAttention wrapped, the course's chapter as a learner types it (LazyLinear,
``transpose_qkv``, ``masked_softmax`` with -1e6, ``repeat_interleave``), and learners' styles first seen in
round 4: a hand-written Linear class, heads cut with ``torch.chunk`` and the output weights in a
ParameterDict, queries and keys each scaled by d^-1/4, 1x1 convolutions, q/k/v stacked in one (3, E, E)
Parameter with the output projected per head and summed, torch's functional ``multi_head_attention_forward``,
the course's query_size / key_size / value_size; and round 4's last: Keras' EinsumDense kernels (E, H, D)
translated to einsums, a LLaMA-like layer (scale buffer, float32 softmax), a lecture's list of head modules, the
scores computed keys by queries, a fused qkv split per head (H, 3, D); then one-word names (``tokeys``), unnamed
layers called keys first, one Linear(D, D) per role shared by the heads. ``WILD``: (id, factory, call, mask,
self_attention, causal); every one must be graded OK (``UNREAD``: with the reference check a warning).
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch import nn


def attention(query, key, value, mask=None):
    d_k = query.size(-1)
    scores = torch.matmul(query, key.transpose(-2, -1)) / math.sqrt(d_k)
    if mask is not None:
        scores = scores.masked_fill(mask == 0, -1e9)
    p = scores.softmax(dim=-1)
    return torch.matmul(p, value), p


class Annotated(nn.Module):
    def __init__(self, h=4, d_model=32):
        super().__init__()
        self.d_k, self.h = d_model // h, h
        self.linears = nn.ModuleList([copy.deepcopy(nn.Linear(d_model, d_model)) for _ in range(4)])
        self.attn = None

    def forward(self, query, key, value, mask=None):
        if mask is not None:
            mask = mask.unsqueeze(1)  # (B, 1, Lk) -> (B, 1, 1, Lk)
        nb = query.size(0)
        query, key, value = [lin(x).view(nb, -1, self.h, self.d_k).transpose(1, 2)
                             for lin, x in zip(self.linears, (query, key, value))]
        x, self.attn = attention(query, key, value, mask=mask)
        x = x.transpose(1, 2).contiguous().view(nb, -1, self.h * self.d_k)
        return self.linears[-1](x)


class VisionQKV(nn.Module):
    def __init__(self, dim=32, num_heads=4):
        super().__init__()
        self.num_heads = num_heads
        self.scale = (dim // num_heads) ** -0.5
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)  # each (B, H, N, D)
        attn = (q * self.scale) @ k.transpose(-2, -1)
        attn = attn.softmax(dim=-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(B, N, C))


class GPT2Style(nn.Module):
    def __init__(self, n_embd=32, n_head=4, n_ctx=16):
        super().__init__()
        self.n_head = n_head
        self.c_attn_weight = nn.Parameter(torch.randn(n_embd, 3 * n_embd) * 0.1)
        self.c_attn_bias = nn.Parameter(torch.zeros(3 * n_embd))
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.register_buffer("bias", torch.tril(torch.ones(n_ctx, n_ctx)).view(1, 1, n_ctx, n_ctx))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = (x @ self.c_attn_weight + self.c_attn_bias).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class BertStyle(nn.Module):
    def __init__(self, hidden_size=32, num_attention_heads=4):
        super().__init__()
        self.num_attention_heads = num_attention_heads
        self.attention_head_size = hidden_size // num_attention_heads
        self.query, self.key, self.value = (nn.Linear(hidden_size, hidden_size) for _ in range(3))
        self.dense = nn.Linear(hidden_size, hidden_size)

    def transpose_for_scores(self, x):
        return x.view(x.size()[:-1] + (self.num_attention_heads, self.attention_head_size)).permute(0, 2, 1, 3)

    def forward(self, q, k, v, attention_mask=None):
        Q, K, V = self.transpose_for_scores(self.query(q)), self.transpose_for_scores(self.key(k)), \
            self.transpose_for_scores(self.value(v))
        scores = torch.matmul(Q, K.transpose(-1, -2)) / math.sqrt(self.attention_head_size)
        if attention_mask is not None:
            scores = scores + attention_mask
        probs = nn.functional.softmax(scores, dim=-1)
        ctx = torch.matmul(probs, V).permute(0, 2, 1, 3).contiguous()
        return self.dense(ctx.view(ctx.size()[:-2] + (self.num_attention_heads * self.attention_head_size,)))


class QKVPair(nn.Module):
    """Queries from one Linear, keys and values from one fused Linear over the context."""

    def __init__(self, dim=32, heads=4, dim_head=8):
        super().__init__()
        inner = dim_head * heads
        self.heads, self.scale = heads, dim_head ** -0.5
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_kv = nn.Linear(dim, inner * 2, bias=False)
        self.to_out = nn.Sequential(nn.Linear(inner, dim), nn.Dropout(0.1))

    def forward(self, x, context):
        b, n, _ = x.shape
        q = self.to_q(x)
        k, v = self.to_kv(context).chunk(2, dim=-1)
        q, k, v = (t.reshape(b, t.shape[1], self.heads, -1).permute(0, 2, 1, 3) for t in (q, k, v))
        dots = torch.einsum("bhid,bhjd->bhij", q, k) * self.scale
        attn = dots.softmax(dim=-1)
        out = torch.einsum("bhij,bhjd->bhid", attn, v)
        return self.to_out(out.permute(0, 2, 1, 3).reshape(b, n, -1))


class TorchWrapped(nn.Module):
    def __init__(self, d_model=32, nhead=4):
        super().__init__()
        self.mha = nn.MultiheadAttention(d_model, nhead, batch_first=True)

    def forward(self, q, k, v, key_padding_mask=None):
        return self.mha(q, k, v, key_padding_mask=key_padding_mask, need_weights=False)[0]


def masked_softmax(X, valid_lens):
    if valid_lens is None:
        return nn.functional.softmax(X, dim=-1)
    shape = X.shape
    if valid_lens.dim() == 1:
        valid_lens = torch.repeat_interleave(valid_lens, shape[1])
    else:
        valid_lens = valid_lens.reshape(-1)
    X = X.reshape(-1, shape[-1])
    mask = torch.arange(shape[-1], dtype=torch.float32)[None, :] < valid_lens[:, None]
    X[~mask] = -1e6
    return nn.functional.softmax(X.reshape(shape), dim=-1)


class CourseChapter(nn.Module):
    """The chapter as a learner types it: LazyLinear, heads folded into the batch, bmm."""

    def __init__(self, num_hiddens=32, num_heads=4, dropout=0.1, bias=False):
        super().__init__()
        self.num_heads = num_heads
        self.dropout = nn.Dropout(dropout)
        self.W_q, self.W_k = nn.LazyLinear(num_hiddens, bias=bias), nn.LazyLinear(num_hiddens, bias=bias)
        self.W_v, self.W_o = nn.LazyLinear(num_hiddens, bias=bias), nn.LazyLinear(num_hiddens, bias=bias)

    def transpose_qkv(self, X):
        X = X.reshape(X.shape[0], X.shape[1], self.num_heads, -1).permute(0, 2, 1, 3)
        return X.reshape(-1, X.shape[2], X.shape[3])

    def transpose_output(self, X):
        X = X.reshape(-1, self.num_heads, X.shape[1], X.shape[2]).permute(0, 2, 1, 3)
        return X.reshape(X.shape[0], X.shape[1], -1)

    def forward(self, queries, keys, values, valid_lens):
        queries, keys = self.transpose_qkv(self.W_q(queries)), self.transpose_qkv(self.W_k(keys))
        values = self.transpose_qkv(self.W_v(values))
        if valid_lens is not None:
            valid_lens = torch.repeat_interleave(valid_lens, repeats=self.num_heads, dim=0)
        d = queries.shape[-1]
        scores = torch.bmm(queries, keys.transpose(1, 2)) / math.sqrt(d)
        self.attention_weights = masked_softmax(scores, valid_lens)
        output = torch.bmm(self.dropout(self.attention_weights), values)
        return self.W_o(self.transpose_output(output))


class Affine(nn.Module):
    """A learner's own Linear: ``weight`` (in, out) used as ``x @ weight + bias``."""

    def __init__(self, n_in, n_out):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_in, n_out) / math.sqrt(n_in))
        self.bias = nn.Parameter(torch.randn(n_out) / 10)

    def forward(self, x):
        return x @ self.weight + self.bias


class OwnLinearClass(nn.Module):
    """Every projection a hand-written Linear class (``W_q = Affine(...)``), SDPA for the heads."""

    def __init__(self, d_model=24, num_heads=3):
        super().__init__()
        self.h = num_heads
        self.W_q, self.W_k, self.W_v, self.W_o = (Affine(d_model, d_model) for _ in range(4))

    def forward(self, q, k, v):
        B, Lq, E = q.shape

        def heads(t):  # (B, L, E) -> (B, H, L, E/H)
            return t.view(B, t.shape[1], self.h, E // self.h).transpose(1, 2)

        o = F.scaled_dot_product_attention(heads(self.W_q(q)), heads(self.W_k(k)), heads(self.W_v(v)))
        return self.W_o(o.transpose(1, 2).reshape(B, Lq, E))


class ChunkedHeadsDictOut(nn.Module):
    """q/k/v in a ModuleDict, heads cut with torch.chunk and run one by one, the output projection's weight and
    bias in a ParameterDict used through F.linear."""

    def __init__(self, d_model=24, num_heads=3):
        super().__init__()
        self.n_heads = num_heads
        self.proj = nn.ModuleDict({r: nn.Linear(d_model, d_model, bias=False) for r in ("query", "key", "value")})
        self.out = nn.ParameterDict({"weight": nn.Parameter(torch.randn(d_model, d_model) / math.sqrt(d_model)),
                                     "bias": nn.Parameter(torch.randn(d_model) / 10)})

    def forward(self, x):
        per = [torch.chunk(self.proj[r](x), self.n_heads, dim=-1) for r in ("query", "key", "value")]
        outs = [torch.bmm(torch.softmax(torch.bmm(q, k.transpose(1, 2)) * q.shape[-1] ** -0.5, -1), v)
                for q, k, v in zip(*per)]
        return F.linear(torch.cat(outs, dim=-1), self.out["weight"], self.out["bias"])


class QuarterRootScale(nn.Module):
    """Queries and keys each scaled by d ** -0.25 after projection, the scores as a broadcast product summed
    over features, the softmax as exp(s - logsumexp(s))."""

    def __init__(self, d_model=24, num_heads=3):
        super().__init__()
        self.num_heads = num_heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d_model, d_model) for _ in range(4))

    def forward(self, q, k, v):
        B, Lq, E = q.shape
        H, D = self.num_heads, E // self.num_heads
        r = D ** -0.25
        Q = (self.wq(q) * r).view(B, Lq, H, D).transpose(1, 2)  # (B, H, Lq, D)
        K = (self.wk(k) * r).view(B, -1, H, D).transpose(1, 2)  # (B, H, Lk, D)
        V = self.wv(v).view(B, -1, H, D).transpose(1, 2)
        s = (Q.unsqueeze(-2) * K.unsqueeze(-3)).sum(-1)  # (B, H, Lq, Lk)
        w = torch.exp(s - s.logsumexp(-1, keepdim=True))
        return self.wo((w @ V).transpose(1, 2).reshape(B, Lq, E))


class PointwiseConv(nn.Module):
    """Projections as 1x1 convolutions over channels-first (B, E, L) tensors, heads by einsum."""

    def __init__(self, d_model=24, num_heads=3):
        super().__init__()
        self.heads = num_heads
        self.to_q, self.to_k, self.to_v, self.to_out = (nn.Conv1d(d_model, d_model, 1) for _ in range(4))

    def forward(self, x):
        B, L, E = x.shape
        xt = x.transpose(1, 2)  # (B, E, L)
        q, k, v = (f(xt).view(B, self.heads, E // self.heads, L) for f in (self.to_q, self.to_k, self.to_v))
        w = torch.softmax(torch.einsum("bhdi,bhdj->bhij", q, k) / math.sqrt(E // self.heads), dim=-1)
        o = torch.einsum("bhij,bhdj->bhdi", w, v).reshape(B, E, L)
        return self.to_out(o).transpose(1, 2)


class PerHeadOutputSum(nn.Module):
    """q/k/v stacked in one (3, E, E) Parameter used as x @ W[i]; the output projection per head, (H, D, E),
    each head's output projected and the heads summed (the concatenation's product written out)."""

    def __init__(self, d_model=24, num_heads=3):
        super().__init__()
        self.num_heads, d = num_heads, d_model // num_heads
        self.W_qkv = nn.Parameter(torch.randn(3, d_model, d_model) / math.sqrt(d_model))
        self.W_o = nn.Parameter(torch.randn(num_heads, d, d_model) / math.sqrt(d_model))
        self.b_o = nn.Parameter(torch.randn(d_model) / 10)

    def forward(self, q, k, v):
        B, Lq, E = q.shape
        H = self.num_heads

        def heads(t):  # (B, L, E) -> (B, H, L, D)
            return t.view(B, t.shape[1], H, E // H).transpose(1, 2)

        Q, K, V = heads(q @ self.W_qkv[0]), heads(k @ self.W_qkv[1]), heads(v @ self.W_qkv[2])
        o = torch.softmax(Q @ K.transpose(-1, -2) / math.sqrt(E // H), dim=-1) @ V  # (B, H, Lq, D)
        return torch.einsum("bhld,hde->ble", o, self.W_o) + self.b_o


class FunctionalTorch(nn.Module):
    """torch's own functional multi-head attention called with the module's parameters (sequence-first)."""

    def __init__(self, d_model=24, num_heads=3):
        super().__init__()
        self.num_heads, self.d_model = num_heads, d_model
        self.in_proj_weight = nn.Parameter(torch.randn(3 * d_model, d_model) / math.sqrt(d_model))
        self.in_proj_bias = nn.Parameter(torch.randn(3 * d_model) / 10)
        self.out_proj = nn.Linear(d_model, d_model)

    def forward(self, q, k, v):
        o, _ = F.multi_head_attention_forward(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), self.d_model, self.num_heads, self.in_proj_weight,
            self.in_proj_bias, None, None, False, 0.0, self.out_proj.weight, self.out_proj.bias, training=False,
            need_weights=False)
        return o.transpose(0, 1)  # (L, B, E) -> (B, L, E)


class SizedInputs(nn.Module):
    """The course's earlier chapter's signature: queries, keys and values of sizes of their own
    (query_size, key_size, value_size), plain Linear layers, heads folded into the batch, valid lengths."""

    def __init__(self, key_size=28, query_size=20, value_size=36, num_hiddens=24, num_heads=3, scale_by_d=False):
        super().__init__()
        self.num_heads, self.scale_by_d = num_heads, scale_by_d
        self.W_q, self.W_k = nn.Linear(query_size, num_hiddens), nn.Linear(key_size, num_hiddens)
        self.W_v, self.W_o = nn.Linear(value_size, num_hiddens), nn.Linear(num_hiddens, num_hiddens)

    def fold(self, X):  # (B, L, H*D) -> (B*H, L, D)
        X = X.reshape(X.shape[0], X.shape[1], self.num_heads, -1).permute(0, 2, 1, 3)
        return X.reshape(-1, X.shape[2], X.shape[3])

    def forward(self, queries, keys, values, valid_lens):
        q, k, v = self.fold(self.W_q(queries)), self.fold(self.W_k(keys)), self.fold(self.W_v(values))
        d = q.shape[-1]
        scores = torch.bmm(q, k.transpose(1, 2)) / (d if self.scale_by_d else math.sqrt(d))  # (B*H, Lq, Lk)
        if valid_lens is not None:
            lens = torch.repeat_interleave(valid_lens, self.num_heads, dim=0)  # (B,) -> (B*H,)
            scores = scores.masked_fill(torch.arange(scores.shape[-1])[None, None, :] >= lens[:, None, None], -1e6)
        o = torch.bmm(torch.softmax(scores, dim=-1), v)  # (B*H, Lq, D)
        o = o.reshape(-1, self.num_heads, o.shape[1], o.shape[2]).permute(0, 2, 1, 3)  # (B, Lq, H, D)
        return self.W_o(o.reshape(o.shape[0], o.shape[1], -1))  # (B, Lq, H*D)


class EinsumKernels(nn.Module):
    """Keras' EinsumDense layout translated to torch: (E, H, D) kernels for q, k and v, an (H, D, E) output
    kernel, every product an einsum."""

    def __init__(self, E=32, H=4, scale_by_d=False):
        super().__init__()
        D, self.scale_by_d = E // H, scale_by_d
        self.query_kernel, self.key_kernel, self.value_kernel = (
            nn.Parameter(torch.randn(E, H, D) / math.sqrt(E)) for _ in range(3))
        self.query_bias = nn.Parameter(torch.randn(H, D) / 10)
        self.output_kernel = nn.Parameter(torch.randn(H, D, E) / math.sqrt(E))
        self.output_bias = nn.Parameter(torch.zeros(E))

    def forward(self, q, k, v):
        q = torch.einsum("ble,ehd->blhd", q, self.query_kernel) + self.query_bias
        k = torch.einsum("ble,ehd->blhd", k, self.key_kernel)
        v = torch.einsum("ble,ehd->blhd", v, self.value_kernel)
        d = q.shape[-1]
        s = torch.einsum("bqhd,bkhd->bhqk", q, k) / (d if self.scale_by_d else math.sqrt(d))
        o = torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v)
        return torch.einsum("bqhd,hde->bqe", o, self.output_kernel) + self.output_bias


class LlamaLike(nn.Module):
    """No biases, the scale a registered buffer, the softmax in float32 cast back."""

    def __init__(self, E=32, H=4):
        super().__init__()
        self.H, self.D = H, E // H
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(E, E, bias=False) for _ in range(4))
        self.register_buffer("scale", torch.tensor(self.D ** -0.5))

    def forward(self, q, k, v):
        B, Lq, _ = q.shape
        q = self.q_proj(q).view(B, Lq, self.H, self.D).transpose(1, 2)
        k = self.k_proj(k).view(B, k.shape[1], self.H, self.D).transpose(1, 2)
        v = self.v_proj(v).view(B, v.shape[1], self.H, self.D).transpose(1, 2)
        w = F.softmax(torch.matmul(q, k.transpose(2, 3)) * self.scale, dim=-1, dtype=torch.float32).to(q.dtype)
        return self.o_proj(torch.matmul(w, v).transpose(1, 2).reshape(B, Lq, -1))


class OneHead(nn.Module):
    def __init__(self, E, D):
        super().__init__()
        self.key, self.query, self.value = (nn.Linear(E, D, bias=False) for _ in range(3))

    def forward(self, x):
        k, q, v = self.key(x), self.query(x), self.value(x)
        return F.softmax(q @ k.transpose(-2, -1) * k.shape[-1] ** -0.5, dim=-1) @ v


class HeadModules(nn.Module):
    """A lecture's style: a ModuleList of head modules, each with its own key/query/value layers, their
    outputs concatenated and projected."""

    def __init__(self, E=32, H=4):
        super().__init__()
        self.heads = nn.ModuleList([OneHead(E, E // H) for _ in range(H)])
        self.proj = nn.Linear(E, E)

    def forward(self, x):
        return self.proj(torch.cat([h(x) for h in self.heads], dim=-1))


class KeysFirstScores(nn.Module):
    """The scores computed keys by queries (B, H, Lk, Lq), normalised over dim -2."""

    def __init__(self, E=32, H=4):
        super().__init__()
        self.H = H
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(E, E) for _ in range(4))

    def forward(self, q, k, v):
        B, Lq, E = q.shape
        D = E // self.H

        def sp(t):  # (B, L, E) -> (B, H, L, D)
            return t.view(B, -1, self.H, D).transpose(1, 2)

        q, k, v = sp(self.wq(q)), sp(self.wk(k)), sp(self.wv(v))
        w = (torch.einsum("bhkd,bhqd->bhkq", k, q) / math.sqrt(D)).softmax(dim=-2)
        return self.wo(torch.einsum("bhkq,bhkd->bhqd", w, v).transpose(1, 2).reshape(B, Lq, E))


class PerHeadFusedQKV(nn.Module):
    """A fused query_key_value layer split per head as (H, 3, D) (Megatron's and GPT-NeoX's layout), SDPA."""

    def __init__(self, E=32, H=4):
        super().__init__()
        self.H, self.D = H, E // H
        self.query_key_value, self.dense = nn.Linear(E, 3 * E), nn.Linear(E, E)

    def forward(self, x):
        B, L, E = x.shape
        q, k, v = self.query_key_value(x).view(B, L, self.H, 3 * self.D).split(self.D, dim=-1)  # 3 x (B, L, H, D)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.dense(o.transpose(1, 2).reshape(B, L, E))


class BiasesAfter(nn.Module):
    """Bias-free Linear layers, each bias a Parameter of its own added after the product (``self.q(x) + self.bq``),
    SDPA with the bool mask. Graded NOT OK until round 4: the layers were read without their biases."""

    def __init__(self, E=32, H=4):
        super().__init__()
        self.H, self.D = H, E // H
        self.q, self.k, self.v, self.o = (nn.Linear(E, E, bias=False) for _ in range(4))
        self.bq, self.bk, self.bv, self.bo = (nn.Parameter(torch.randn(E) * 0.1) for _ in range(4))

    def forward(self, q, k, v, mask=None):
        B = q.shape[0]
        split = lambda t: t.view(B, -1, self.H, self.D).transpose(1, 2)  # noqa: E731  (B, L, E) -> (B, H, L, D)
        o = F.scaled_dot_product_attention(split(self.q(q) + self.bq), split(self.k(k) + self.bk),
                                           split(self.v(v) + self.bv), attn_mask=mask)  # (B, H, Lq, D)
        return self.o(o.transpose(1, 2).flatten(2)) + self.bo  # (B, H, Lq, D) -> (B, Lq, E)


class ContextAttention(nn.Module):
    """Stable Diffusion's and Perceiver's cross-attention: ``forward(x, context, mask)``, one context for keys and
    values (to_k and to_v both read it), heads folded into the batch as (b h), einsum, the (B, Lk) key mask repeated
    per head, filled with -finfo.max. Graded with ``call=lambda m, q, k, v, mask: m(q, context=k, ...)``: a call
    that never reads v probes keys and values as one tensor (it was NOT OK, 'value projection applied to the key
    input', before round 4)."""

    def __init__(self, query_dim=32, context_dim=24, heads=4, dim_head=8):
        super().__init__()
        inner = dim_head * heads
        self.scale, self.heads = dim_head ** -0.5, heads
        self.to_q = nn.Linear(query_dim, inner, bias=False)
        self.to_k = nn.Linear(context_dim, inner, bias=False)
        self.to_v = nn.Linear(context_dim, inner, bias=False)
        self.to_out = nn.Sequential(nn.Linear(inner, query_dim), nn.Dropout(0.0))

    def forward(self, x, context, mask=None):
        h, B = self.heads, x.shape[0]

        def fold(t):  # (B, L, h*d) -> (B*h, L, d), batch-major
            return t.reshape(B, t.shape[1], h, -1).transpose(1, 2).reshape(B * h, t.shape[1], -1)

        q, k, v = fold(self.to_q(x)), fold(self.to_k(context)), fold(self.to_v(context))
        sim = torch.einsum("b i d, b j d -> b i j", q, k) * self.scale  # (B*h, Lq, Lk)
        if mask is not None:
            sim = sim.masked_fill(~mask.repeat_interleave(h, dim=0)[:, None, :], -torch.finfo(sim.dtype).max)
        out = torch.einsum("b i j, b j d -> b i d", sim.softmax(-1), v)  # (B*h, Lq, d)
        return self.to_out(out.reshape(B, h, out.shape[1], -1).transpose(1, 2).flatten(2))  # (B, Lq, h*d)


class OneWordNames(nn.Module):
    """Peter Bloem's names, each one word (``tokeys``, ``toqueries``, ``tovalues``, ``unifyheads``), the keys'
    layer called first, heads folded into the batch for bmm, queries and keys each divided by D ** (1/4). Graded
    NOT OK until round 4 ('attention weights transposed'): the names were not read and the call order made the
    keys' layer W_q."""

    def __init__(self, E=32, H=4):
        super().__init__()
        self.H = H
        self.tokeys, self.toqueries, self.tovalues = (nn.Linear(E, E, bias=False) for _ in range(3))
        self.unifyheads = nn.Linear(E, E)

    def forward(self, x):
        B, L, E = x.shape
        D = E // self.H

        def fold(t):  # (B, L, E) -> (B, L, H, D) -> (B*H, L, D)
            return t.view(B, L, self.H, D).transpose(1, 2).reshape(B * self.H, L, D)

        keys, queries, values = fold(self.tokeys(x)), fold(self.toqueries(x)), fold(self.tovalues(x))
        w = torch.bmm(queries / D ** 0.25, (keys / D ** 0.25).transpose(1, 2)).softmax(dim=2)  # (B*H, L, L)
        out = torch.bmm(w, values).view(B, self.H, L, D).transpose(1, 2).reshape(B, L, E)  # (B*H, L, D) -> (B, L, E)
        return self.unifyheads(out)


class KeysCalledFirst(nn.Module):
    """Four layers with no role names in a ModuleList, the keys' one (index 0) called before the queries'. Graded
    NOT OK until round 4 ('attention weights transposed'): roles read off the call order alone were taken as
    certain."""

    def __init__(self, E=32, H=4, scale_by_d=False):
        super().__init__()
        self.H, self.scale_by_d = H, scale_by_d
        self.layers = nn.ModuleList(nn.Linear(E, E) for _ in range(4))

    def forward(self, x):
        B, L, E = x.shape
        k, q, v = (self.layers[i](x).view(B, L, self.H, -1).transpose(1, 2) for i in range(3))  # (B, H, L, D)
        D = q.shape[-1]
        w = torch.softmax(q @ k.transpose(-1, -2) / (D if self.scale_by_d else math.sqrt(D)), -1)  # (B, H, L, L)
        return self.layers[3]((w @ v).transpose(1, 2).reshape(B, L, E))


class SharedHeadLayers(nn.Module):
    """A tutorial's first version: ``forward(values, keys, query, mask)``, the inputs cut into heads first and one
    Linear(D, D) per role shared by every head (a block-diagonal projection), einsums, ``fc_out``. It could not be
    run before round 4 (probed at D, the first layer's input size, not E) and was graded NOT OK; it is attention,
    with narrower projections than the course's: OK with the reference check a warning that says so.
    ``scale_by_e``: the tutorial's published mistake, the scores divided by sqrt(E)."""

    def __init__(self, embed_size=32, heads=4, scale_by_e=False):
        super().__init__()
        self.embed_size, self.heads, self.scale_by_e = embed_size, heads, scale_by_e
        self.head_dim = embed_size // heads
        self.values, self.keys, self.queries = (nn.Linear(self.head_dim, self.head_dim, bias=False) for _ in range(3))
        self.fc_out = nn.Linear(embed_size, embed_size)

    def forward(self, values, keys, query, mask):
        N, Lq = query.shape[:2]

        def heads(t, layer):  # (N, L, E) -> (N, L, H, D), then the shared layer
            return layer(t.reshape(N, t.shape[1], self.heads, self.head_dim))

        v, k, q = heads(values, self.values), heads(keys, self.keys), heads(query, self.queries)
        energy = torch.einsum("nqhd,nkhd->nhqk", q, k)  # (N, H, Lq, Lk)
        if mask is not None:
            energy = energy.masked_fill(mask == 0, -1e20)
        w = torch.softmax(energy / (self.embed_size if self.scale_by_e else self.head_dim) ** 0.5, dim=3)
        return self.fc_out(torch.einsum("nhql,nlhd->nqhd", w, v).reshape(N, Lq, self.embed_size))


def _values_first_call(m, q, k, v, mask):
    return m(v, k, q, mask)


def _context_call(m, q, k, v, mask):
    return m(q, context=k, mask=mask[:, 0, 0])  # the key mask (B, Lk), True = keep


def _annotated_call(m, q, k, v, keep):
    return m(q, k, v, keep[:, :, 0])  # the source mask (B, 1, Lk), 1 = keep


def _pair_call(m, q, k, v, mask):
    return m(q, k)  # keys and values from the same context


WILD = [
    ("annotated transformer", Annotated, _annotated_call, "keep", False, False),
    ("vision qkv", VisionQKV, "x", None, True, False),
    ("gpt-2 c_attn raw weight, causal", GPT2Style, "x", None, True, True),
    ("bert transpose_for_scores, additive", BertStyle, "qkv_mask", "additive", False, False),
    ("to_q / to_kv", QKVPair, _pair_call, None, False, False),
    ("torch.nn wrapped", TorchWrapped, lambda m, q, k, v, mk: m(q, k, v, mk[:, 0, 0].bool()), "block", False, False),
    ("the course's chapter", CourseChapter, "qkv_mask", "valid_lens", False, False),
    ("a hand-written Linear class", OwnLinearClass, "qkv", None, False, False),
    ("chunked heads, output weights in a ParameterDict", ChunkedHeadsDictOut, "x", None, True, False),
    ("q and k each scaled by d^-1/4, broadcast product", QuarterRootScale, "qkv", None, False, False),
    ("1x1 convolutions", PointwiseConv, "x", None, True, False),
    ("q/k/v stacked (3, E, E), output per head summed", PerHeadOutputSum, "qkv", None, False, False),
    ("torch's functional multi_head_attention_forward", FunctionalTorch, "qkv", None, False, False),
    ("query, key and value sizes of their own", SizedInputs, "qkv_mask", "valid_lens", False, False),
    ("keras einsum kernels (E, H, D)", EinsumKernels, "qkv", None, False, False),
    ("llama-like: scale buffer, float32 softmax", LlamaLike, "qkv", None, False, False),
    ("a list of head modules", HeadModules, "x", None, True, False),
    ("scores keys by queries, softmax over dim -2", KeysFirstScores, "qkv", None, False, False),
    ("fused qkv split per head (H, 3, D)", PerHeadFusedQKV, "x", None, True, False),
    ("bias-free layers, biases added after (bq)", BiasesAfter, "qkv_mask", "keep", False, False),
    ("one context for keys and values (stable diffusion)", ContextAttention, _context_call, "keep", False, False),
    ("one-word names (tokeys), keys' layer called first", OneWordNames, "x", None, True, False),
    ("unnamed layers, keys' layer called first", KeysCalledFirst, "x", None, True, False),
    ("one layer per role shared by the heads", SharedHeadLayers, _values_first_call, "keep", False, False),
]

#: styles computing attention with narrower projections than the course's: OK, the reference check a warning
TIED = ("one layer per role shared by the heads",)

#: styles whose parts no reading knows: graded OK on the black-box checks, the reference check a warning
UNREAD = ("to_q / to_kv", "1x1 convolutions")
