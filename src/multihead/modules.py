"""MultiHeadAttention: project, split the heads, attend, merge the heads, project.

Inputs are (B, L, E); inside, tensors are (B, H, L, D) and the functional core
(:func:`multihead.functional.attention`) does the attending.
"""

from __future__ import annotations

import numbers

import torch
from torch import Tensor, nn

from multihead import backends, masks, varlen
from multihead.capture import ACTIVE as _CAPTURING
from multihead.functional import dispatch

__all__ = ["AttentionCore", "MultiHeadAttention", "transpose_qkv", "transpose_output"]


def transpose_qkv(X: Tensor, num_heads: int) -> Tensor:
    """Split the heads and fold them into the batch, as the course does:
    (B, L, H*D) -> (B*H, L, D), sequence b's head h at index b*H + h."""
    X = X.reshape(X.shape[0], X.shape[1], num_heads, -1)  # (B, L, H*D) -> (B, L, H, D)
    X = X.permute(0, 2, 1, 3)  # (B, L, H, D) -> (B, H, L, D)
    return X.reshape(-1, X.shape[2], X.shape[3])  # (B, H, L, D) -> (B*H, L, D)


def transpose_output(X: Tensor, num_heads: int) -> Tensor:
    """Undo :func:`transpose_qkv`: (B*H, L, D) -> (B, L, H*D)."""
    X = X.reshape(-1, num_heads, X.shape[1], X.shape[2])  # (B*H, L, D) -> (B, H, L, D)
    X = X.permute(0, 2, 1, 3)  # (B, H, L, D) -> (B, L, H, D)
    return X.reshape(X.shape[0], X.shape[1], -1)  # (B, L, H, D) -> (B, L, H*D)


def _positive_int(name: str, v, optional: bool = False):
    if v is None and optional:
        return None
    if not isinstance(v, numbers.Integral) or isinstance(v, bool) or v <= 0:
        raise ValueError(f"{name} must be a positive integer{' or None' if optional else ''}; got {v!r}.")
    return int(v)


def _linear(in_features: int | None, out_features: int, bias: bool) -> nn.Module:
    """nn.Linear, or nn.LazyLinear (becomes nn.Linear on the first call) when the input size is not given."""
    if in_features is None:
        return nn.LazyLinear(out_features, bias=bias)
    return nn.Linear(in_features, out_features, bias=bias)


def _in_features(lin: nn.Module) -> int | None:
    return None if isinstance(lin, nn.modules.lazy.LazyModuleMixin) and lin.has_uninitialized_params() else lin.in_features


class AttentionCore:
    """The one place every multihead module attends: :class:`MultiHeadAttention`,
    the course's compat modules and the torch.nn drop-in all call :meth:`_attend`
    with (B, H, L, D) tensors made by their own projections and a mask they have
    validated. Needs the attributes ``dropout`` (float), ``scale`` (float or
    None), ``backend`` and ``training``."""

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, mask) -> Tensor:
        """q (B, H, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv) -> (B, H, Lq, Dv)."""
        if _CAPTURING:  # empty unless inside multihead.capture()
            for rec in _CAPTURING:
                rec.record(self, q, k, mask)
        p = self.dropout if self.training else 0.0
        out = dispatch(q, k, v, mask, scale=self.scale, dropout_p=p, backend=self.backend)  # (B, H, Lq, Dv)
        stats = getattr(self, "head_stats", None)  # None unless multihead.heads.mean_head_outputs runs
        if stats is not None:
            s = out.detach().sum((0, 2))  # (H, Dv): summed over the batch and the query rows
            stats["sum"] = s if stats["sum"] is None else stats["sum"] + s
            live = out.shape[0] * out.shape[2]  # rows computed; padded query rows (zeros) do not count
            for part in mask.parts() if mask is not None else ():
                if isinstance(part, masks.Padding):
                    live = int(part.lens.clamp_max(out.shape[2]).sum())
            stats["count"] += live
        gates = getattr(self, "head_gates", None)  # None unless multihead.heads sets them
        if gates is not None:
            g = gates.view(1, -1, 1, 1)  # (H,) -> (1, H, 1, 1)
            out = out * g  # head h's output scaled by gates[h]
            fill = getattr(self, "head_fill", None)  # (H, Dv): what a gated-off head is replaced by
            if fill is not None:
                fill = fill.view(1, fill.shape[0], 1, fill.shape[1]).to(out.dtype)  # (H, Dv) -> (1, H, 1, Dv)
                out = out + (1 - g) * fill
        return out


class MultiHeadAttention(AttentionCore, nn.Module):
    """Multi-head attention (Vaswani et al. 2017), as the course builds it.

    ``h`` learned projections of queries, keys and values, scaled dot-product
    attention for every head in parallel, the heads concatenated and projected:

        q_proj: query_size -> H*D     k_proj: key_size -> Hkv*D
        v_proj: value_size -> Hkv*Dv  o_proj: H*Dv -> out_features

    Args:
        num_hiddens: the model size E; the output size unless ``out_features`` is
            given, and H*D unless ``head_dim`` is given.
        num_heads: H, the number of query heads.
        dropout: dropout rate on the attention weights, applied only in training.
        bias: whether the four projections have biases.
        query_size, key_size, value_size: input sizes; None = inferred on the
            first call (as the course's MXNet/DJL versions and Keras do).
        num_kv_heads: Hkv (grouped-query attention; 1 = multi-query); default H.
        head_dim: D, the query/key size of a head; default num_hiddens // num_heads.
        value_head_dim: Dv, the value size of a head; default D.
        out_features: size of the output; default num_hiddens.
        scale: multiplies the scores; default 1/sqrt(D).
        backend: "auto" or a registered backend name (see :func:`multihead.explain`).

    The ViT notebook's ``MultiHeadAttention(d_model, num_head, d_k)`` (with bias)
    is ``MultiHeadAttention(num_hiddens=d_model, num_heads=num_head, head_dim=d_k,
    bias=True, out_features=d_model)``.
    """

    #: attribute names of the q, k, v and output projections (compat classes rename them)
    _proj_names = ("q_proj", "k_proj", "v_proj", "o_proj")

    def __init__(
        self,
        num_hiddens: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = False,
        *,
        query_size: int | None = None,
        key_size: int | None = None,
        value_size: int | None = None,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        value_head_dim: int | None = None,
        out_features: int | None = None,
        scale: float | None = None,
        backend: str = "auto",
    ):
        super().__init__()
        num_hiddens = _positive_int("num_hiddens", num_hiddens)
        H = _positive_int("num_heads", num_heads)
        for name, v in (("query_size", query_size), ("key_size", key_size), ("value_size", value_size),
                        ("head_dim", head_dim), ("value_head_dim", value_head_dim), ("out_features", out_features),
                        ("num_kv_heads", num_kv_heads)):
            _positive_int(name, v, optional=True)
        if head_dim is None and num_hiddens % H:
            raise ValueError(
                f"num_hiddens={num_hiddens} is not divisible by num_heads={H}; choose num_heads that divides "
                "num_hiddens, or give head_dim."
            )
        Hkv = H if num_kv_heads is None else int(num_kv_heads)
        if H % Hkv:
            raise ValueError(f"num_heads={H} must be a multiple of num_kv_heads={Hkv} (grouped-query attention).")
        if not isinstance(dropout, numbers.Real) or isinstance(dropout, bool) or not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be a number in [0, 1); got {dropout!r}.")
        if scale is not None and (not isinstance(scale, numbers.Real) or scale <= 0):
            raise ValueError(f"scale must be a positive number or None (= 1/sqrt(head_dim)); got {scale!r}.")
        if backend != "auto":
            backends.get(backend)
        D = int(head_dim) if head_dim is not None else num_hiddens // H
        Dv = int(value_head_dim) if value_head_dim is not None else D
        self.num_hiddens = num_hiddens
        self.num_heads, self.num_kv_heads, self.head_dim, self.value_head_dim = H, Hkv, D, Dv
        self.out_features = int(out_features) if out_features is not None else num_hiddens
        self.dropout = float(dropout)
        self.scale = None if scale is None else float(scale)
        self.backend = backend
        q, k, v, o = self._proj_names
        setattr(self, q, _linear(query_size, H * D, bias))
        setattr(self, k, _linear(key_size, Hkv * D, bias))
        setattr(self, v, _linear(value_size, Hkv * Dv, bias))
        setattr(self, o, nn.Linear(H * Dv, self.out_features, bias=bias))

    def projections(self) -> tuple[nn.Module, nn.Module, nn.Module, nn.Module]:
        """The (q, k, v, o) projections, whatever they are named (cached; replacing
        one, as pruning does, clears the cache)."""
        cached = self.__dict__.get("_proj_cache")
        if cached is None:
            cached = tuple(getattr(self, n) for n in self._proj_names)
            self.__dict__["_proj_cache"] = cached
        return cached

    def __setattr__(self, name, value):
        if name in type(self)._proj_names:
            self.__dict__.pop("_proj_cache", None)
        super().__setattr__(name, value)

    def extra_repr(self) -> str:
        s = f"num_heads={self.num_heads}, head_dim={self.head_dim}"
        if self.num_kv_heads != self.num_heads:
            s += f", num_kv_heads={self.num_kv_heads}"
        if self.value_head_dim != self.head_dim:
            s += f", value_head_dim={self.value_head_dim}"
        return s + f", dropout={self.dropout}, backend={self.backend!r}"

    def _check(self, queries, keys, values) -> None:
        named = (("queries", queries), ("keys", keys), ("values", values))
        for (name, t), lin, size in zip(named, self.projections(), ("query_size", "key_size", "value_size")):
            if not isinstance(t, Tensor):
                raise TypeError(f"{name} must be a torch.Tensor of shape (B, L, {size}); got {type(t).__name__}.")
            if not t.dtype.is_floating_point:
                raise TypeError(f"{name} must be floating point; got dtype {t.dtype}. Convert with {name}.float().")
            if t.dim() != 3:
                raise ValueError(f"{name} must be 3-D (B, L, {size}); got shape {tuple(t.shape)}.")
            want = _in_features(lin)
            if want is not None and t.shape[-1] != want:
                raise ValueError(
                    f"{name} must be (B, L, {size}={want}); got shape {tuple(t.shape)}. Give inputs of that size, "
                    f"or build the module with {size}={t.shape[-1]}."
                )
        if not queries.shape[0] == keys.shape[0] == values.shape[0]:
            raise ValueError(
                f"queries, keys and values must have the same batch size B; got shapes {tuple(queries.shape)}, "
                f"{tuple(keys.shape)}, {tuple(values.shape)}."
            )
        if keys.shape[1] != values.shape[1]:
            raise ValueError(
                f"keys and values must have the same length Lk; got keys {tuple(keys.shape)} and values "
                f"{tuple(values.shape)}."
            )

    def _inputs(self, queries, keys, values, valid_lens, mask):
        """Defaults (keys = queries, values = keys), checks, and one mask from valid_lens & mask."""
        keys = queries if keys is None else keys
        values = keys if values is None else values
        self._check(queries, keys, values)
        m = masks.as_mask(mask)
        if valid_lens is not None:
            vl = valid_lens if isinstance(valid_lens, masks.Mask) else masks.ValidLens(valid_lens)
            m = vl if m is None else vl & m
        return queries, keys, values, m

    def forward(
        self,
        queries: Tensor,
        keys: Tensor | None = None,
        values: Tensor | None = None,
        valid_lens: Tensor | None = None,
        *,
        mask=None,
    ) -> Tensor:
        """queries (B, Lq, query_size), keys (B, Lk, key_size) (default: queries),
        values (B, Lk, value_size) (default: keys) -> (B, Lq, out_features).

        valid_lens: (B,) or (B, Lq) integers, the course's masking: keys at
        positions >= the length are ignored. mask: any :mod:`multihead.masks`
        value (or a bool keep / float bias tensor broadcastable to (B, H, Lq, Lk)),
        combined with valid_lens.
        """
        queries, keys, values, m = self._inputs(queries, keys, values, valid_lens, mask)
        B, Lq, Lk = queries.shape[0], queries.shape[1], keys.shape[1]
        H, Hkv, D, Dv = self.num_heads, self.num_kv_heads, self.head_dim, self.value_head_dim
        if H == 0:  # every head pruned (multihead.heads.prune): the output is o_proj's bias, or zeros
            return self.projections()[3](queries.new_zeros(B, Lq, 0))
        if m is not None:
            m.validate(B, H, Lq, Lk, queries.device)  # before the projections run
            if not _CAPTURING:  # capture records whole-batch weights: the dense path
                p = varlen.plan(m, B, Lq, Lk, queries.device, flop_per_token=self._flop_per_token())
                if isinstance(p, varlen.Plan):
                    return varlen.run(self, queries, keys, values, p)
        q_proj, k_proj, v_proj, o_proj = self.projections()
        q = q_proj(queries).view(B, Lq, H, D).transpose(1, 2)  # (B, Lq, H*D) -> (B, H, Lq, D)
        k = k_proj(keys).view(B, Lk, Hkv, D).transpose(1, 2)  # (B, Lk, Hkv*D) -> (B, Hkv, Lk, D)
        v = v_proj(values).view(B, Lk, Hkv, Dv).transpose(1, 2)  # (B, Lk, Hkv*Dv) -> (B, Hkv, Lk, Dv)
        out = self._attend(q, k, v, m)  # (B, H, Lq, Dv)
        out = out.transpose(1, 2).reshape(B, Lq, H * Dv)  # (B, H, Lq, Dv) -> (B, Lq, H*Dv)
        out = o_proj(out)  # (B, Lq, out_features)
        if m is not None:
            for part in m.parts():
                if isinstance(part, masks.Padding):  # padded query rows come out as zeros, as on the varlen path
                    real = torch.arange(Lq, device=out.device) < part.lens.to(out.device)[:, None]  # (B, Lq)
                    out = out.masked_fill(~real[..., None], 0.0)
        return out

    def _flop_per_token(self) -> float:
        """Projection work per token (multiply-adds x 2), what packing saves on each padded token."""
        return 2.0 * sum(p.weight.numel() for p in self.projections() if not isinstance(p, nn.LazyLinear))

    def explain(self, queries: Tensor, keys: Tensor | None = None, values: Tensor | None = None,
                valid_lens: Tensor | None = None, *, mask=None) -> str:
        """Which path a forward with these inputs takes (packed varlen or dense) and
        which attention backend runs, and why."""
        queries, keys, values, m = self._inputs(queries, keys, values, valid_lens, mask)
        B, Lq, Lk = queries.shape[0], queries.shape[1], keys.shape[1]
        p = varlen.plan(m, B, Lq, Lk, queries.device, flop_per_token=self._flop_per_token())
        H, Hkv, D, Dv = self.num_heads, self.num_kv_heads, self.head_dim, self.value_head_dim
        if isinstance(p, varlen.Plan):
            n = int(p.key_keep.sum(-1).max())
            rows = Lq if p.query_keep is None else int(p.query_keep.sum(-1).max())
            head = f"path: varlen ({p.reason}); attention runs per sequence, e.g. the longest:"
            mask_in, shape = p.rest, (1, rows, n)
        else:
            head = f"path: dense ({p})"
            mask_in, shape = m, (B, Lq, Lk)
        q = queries.new_empty(shape[0], H, shape[1], D)  # (B, H, Lq, D), only shapes matter
        k = queries.new_empty(shape[0], Hkv, shape[2], D)
        v = queries.new_empty(shape[0], Hkv, shape[2], Dv)
        from multihead.functional import explain as f_explain

        req = f_explain(q, k, v, mask_in, dropout_p=self.dropout if self.training else 0.0,
                        training=self.training, backend=self.backend)
        return head + "\n" + str(req)
