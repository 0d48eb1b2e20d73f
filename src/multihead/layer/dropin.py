"""A drop-in for ``torch.nn.MultiheadAttention`` that computes with multihead: the same constructor,
parameters, state_dict, forward signature, return values and input checks (torch.nn's messages), so
``nn.TransformerEncoderLayer``, ``nn.TransformerDecoderLayer`` and ``nn.Transformer`` run on it, and
:func:`multihead.interop.patch` puts it into a model in place.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from multihead import masks
from multihead.core import validation
from multihead.core.functional import weights_of
from multihead.layer.module import AttentionCore

#: torch's own class, bound at import: what ``to_torch`` builds even where ``torch.nn.MultiheadAttention`` has
#: been patched to the drop-in (``tools/torch_tests_on_dropin.py``, or a user's own patch)
TORCH_MHA = nn.MultiheadAttention

__all__ = ["PrunedMultiheadAttention", "TorchMultiheadAttention", "TorchWeights", "heads_like_torch",
           "keep_torch_fast_path_off", "torch_weights"]


def keep_torch_fast_path_off(module, args):
    """A forward pre-hook that does nothing. :class:`TorchMultiheadAttention` carries it so that
    ``nn.TransformerEncoderLayer`` sees a hook on its attention and runs its own modules (this one
    included) instead of torch's fused native layer."""
    return None


class TorchWeights(NamedTuple):
    """The parameters of one torch.nn-style attention call, q/k/v split: ``w_q`` (H*D, E), ``w_k``
    (H*D, kdim), ``w_v`` (H*D, vdim); biases (H*D,) or None; ``bias_k`` / ``bias_v`` (1, 1, H*D) or
    None (add_bias_kv); ``add_zero_attn``. (torch.nn has H*D = E; a pruned module has fewer heads.)"""

    num_heads: int
    w_q: Tensor
    w_k: Tensor
    w_v: Tensor
    b_q: Tensor | None
    b_k: Tensor | None
    b_v: Tensor | None
    bias_k: Tensor | None
    bias_v: Tensor | None
    add_zero_attn: bool


def torch_weights(num_heads: int, w_q: Tensor, w_k: Tensor, w_v: Tensor, in_proj_bias: Tensor | None, *,
                  bias_k: Tensor | None, bias_v: Tensor | None, add_zero_attn: bool) -> TorchWeights:
    """:class:`TorchWeights` from torch.nn's parameters (``in_proj_bias`` (3*H*D,) split in three; a bias of
    another dtype promoted to the weights', as torch.nn's slow path does)."""
    b = in_proj_bias
    if b is not None and b.dtype != w_q.dtype:
        b = b.to(w_q.dtype)
    b_q, b_k, b_v = b.chunk(3) if b is not None else (None, None, None)  # (3 H D,) -> 3 x (H D,)
    return TorchWeights(num_heads, w_q, w_k, w_v, b_q, b_k, b_v, bias_k, bias_v, bool(add_zero_attn))


def heads_like_torch(p: TorchWeights, query: Tensor, key: Tensor, value: Tensor, *, key_padding_mask, attn_mask,
                     is_causal: bool, attend) -> tuple[Tensor, Tensor, Tensor, masks.Mask | None]:
    """torch.nn.MultiheadAttention's computation up to its output projection, the attention itself done
    by ``attend(q (B, Lq, H, D), k (B, Lk', H, D), v (B, Lk', H, D), mask) -> (B, Lq, H, D)``.

    query (B, Lq, E), key (B, Lk, kdim), value (B, Lk, vdim), torch.nn's masks (bool True = blocked, float
    = added; checked by the caller) -> (the heads merged (B, Lq, H*D), q, k, the validated mask), Lk'
    counting the positions ``add_bias_kv`` / ``add_zero_attn`` append (every query may attend to them)."""
    B, Lq, _ = query.shape
    H = p.num_heads
    q = F.linear(query, p.w_q, p.b_q)  # (B, Lq, H*D)
    k = F.linear(key, p.w_k, p.b_k)  # (B, Lk, H*D)
    v = F.linear(value, p.w_v, p.b_v)  # (B, Lk, H*D)
    inner = q.shape[-1]
    D = inner // H if H else 0
    extra = 0
    if p.bias_k is not None:  # one learned key/value position appended to every sequence
        k = torch.cat([k, p.bias_k.expand(B, 1, inner).to(k.dtype)], 1)  # (B, Lk+1, H*D)
        v = torch.cat([v, p.bias_v.expand(B, 1, inner).to(v.dtype)], 1)
        extra += 1
    q = q.view(B, Lq, H, D)  # (B, Lq, H*D) -> (B, Lq, H, D)
    k = k.view(B, k.shape[1], H, D)  # (B, Lk', H*D) -> (B, Lk', H, D)
    v = v.view(B, v.shape[1], H, D)
    if p.add_zero_attn:  # one zero key/value per head appended
        k = torch.cat([k, k.new_zeros(B, 1, H, D)], 1)  # (B, Lk'+1, H, D)
        v = torch.cat([v, v.new_zeros(B, 1, H, D)], 1)
        extra += 1
    Lk = k.shape[1]
    if extra:  # the appended positions may be attended to by every query (as torch.nn pads its masks)
        attn_mask = None if attn_mask is None else F.pad(attn_mask, (0, extra))
        key_padding_mask = None if key_padding_mask is None else F.pad(key_padding_mask, (0, extra))
    if is_causal and not extra:  # the hint: attn_mask is the causal mask
        mask = masks.from_torch(None, key_padding_mask, num_heads=H)
        mask = masks.Causal() if mask is None else masks.Causal() & mask
    else:
        mask = masks.from_torch(attn_mask, key_padding_mask, num_heads=H)
    if mask is not None:
        mask.validate(B, H, Lq, Lk, query.device)
    out = attend(q, k, v, mask) if H else q.new_zeros(B, Lq, 0, D)  # (B, Lq, H, D)
    return out.reshape(B, Lq, inner), q, k, mask  # (B, Lq, H, D) -> (B, Lq, H*D)


def torch_weights_out(q: Tensor, k: Tensor, mask, need_weights: bool, average: bool) -> Tensor | None:
    """The weights torch.nn returns: (B, H, Lq, Lk) softmax weights of q (B, Lq, H, D) and k (B, Lk, H, D),
    averaged over the heads to (B, Lq, Lk) when ``average``; None unless ``need_weights``."""
    if not need_weights:
        return None
    weights = weights_of(q.transpose(1, 2), k.transpose(1, 2), mask, None)  # (B, H, Lq, Lk)
    return weights.mean(1) if average else weights  # (B, Lq, Lk)


def batch_first(query, key, value, key_padding_mask, *, batched: bool, is_batch_first: bool):
    """torch.nn's layouts ((L, B, E), (B, L, E) or unbatched (L, E)) -> (B, L, E), and the
    key_padding_mask to (B, Lk)."""
    if not batched:  # (L, E) -> (1, L, E)
        query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
        if key_padding_mask is not None:
            key_padding_mask = key_padding_mask.unsqueeze(0)  # (Lk,) -> (1, Lk)
    elif not is_batch_first:  # (L, B, E) -> (B, L, E)
        query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
    return query, key, value, key_padding_mask


def layout_back(out: Tensor, weights: Tensor | None, *, batched: bool, is_batch_first: bool):
    """(B, Lq, E) and the weights back to the caller's layout (:func:`batch_first` undone)."""
    if not batched:
        return out.squeeze(0), None if weights is None else weights.squeeze(0)
    return (out if is_batch_first else out.transpose(0, 1)), weights  # (B, Lq, E) -> (Lq, B, E)


class _TorchCall:
    """torch.nn.MultiheadAttention's forward (signature, checks, layouts, masks, return values) on
    multihead's attention call. Needs ``torch_weights()``, ``out_proj``, ``num_heads``, ``embed_dim``,
    ``kdim``, ``vdim``, ``batch_first`` and :class:`AttentionCore`'s ``_attend``."""

    def _forward_nested(self, query, key, value, *, key_padding_mask, attn_mask, is_causal, weights: tuple[bool, bool]):
        """Attention on nested batches: query, key and value each B sequences ((Lq_b, E), (Lk_b, kdim),
        (Lk_b, vdim)), padded to (B, Lq, E) / (B, Lk, .) with the key padding masked, and the output
        nested again in the query's layout. Weights (``weights`` = (need_weights, average)) come back
        as torch.nn's fast path gives them for nested input: padded (B, [H,] Lq, Lk'), zero outside
        each sequence."""
        if query.dim() != 3:
            raise validation.TorchShapeError(f"query should be unbatched 2D or batched 3D tensor but received "
                                             f"{query.dim()}-D query tensor (a nested batch of (L, E) sequences)")
        if not (key.is_nested and value.is_nested) or not self.batch_first or key_padding_mask is not None \
                or attn_mask is not None or is_causal:
            raise validation.TorchShapeError(
                "MultiheadAttention takes NestedTensor input as query, key and value all nested, with "
                "batch_first=True and no attn_mask / key_padding_mask / is_causal (the sequence lengths are the "
                "padding); otherwise pad the batch (torch.nested.to_padded_tensor) and pass a key_padding_mask.")
        q_lens, k_lens = [t.shape[0] for t in query.unbind()], [t.shape[0] for t in key.unbind()]  # L_b each
        v_lens = k_lens if value is key else [t.shape[0] for t in value.unbind()]
        if len(k_lens) != len(q_lens) or v_lens != k_lens:
            raise validation.TorchShapeError(
                f"nested query, key and value must hold the same number of sequences, key and value of the same "
                f"lengths; got query lengths {q_lens}, key lengths {k_lens}, value lengths {v_lens}")
        x = torch.nested.to_padded_tensor(query, 0.0)  # (B, Lq, E)
        k = x if key is query else torch.nested.to_padded_tensor(key, 0.0)  # (B, Lk, kdim)
        v = k if value is key else torch.nested.to_padded_tensor(value, 0.0)  # (B, Lk, vdim)
        pad = torch.arange(k.shape[1], device=k.device) >= torch.tensor(k_lens, device=k.device)[:, None]  # (B, Lk)
        out, w = self.forward(x, k, v, key_padding_mask=pad, need_weights=weights[0],
                              average_attn_weights=weights[1])  # (B, Lq, E)
        if w is not None:  # padded query rows weigh nothing, as torch.nn's fast path gives them
            q_pad = torch.arange(x.shape[1], device=x.device) >= torch.tensor(q_lens, device=x.device)[:, None]
            w = w.masked_fill(q_pad.view(q_pad.shape[0], *[1] * (w.dim() - 3), -1, 1), 0.0)  # (B, [H,] Lq, Lk')
        return torch.nested.as_nested_tensor([o[:n] for o, n in zip(out, q_lens)], layout=query.layout), w

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True, is_causal=False):
        if isinstance(query, Tensor) and query.is_nested:
            return self._forward_nested(query, key, value, key_padding_mask=key_padding_mask, attn_mask=attn_mask,
                                        is_causal=is_causal, weights=(need_weights, average_attn_weights))
        batched = validation.torch_mha_inputs(query, key, value, key_padding_mask, attn_mask, num_heads=self.num_heads,
                                              embed_dim=self.embed_dim, kdim=self.kdim, vdim=self.vdim,
                                              batch_first=self.batch_first, is_causal=is_causal)
        query, key, value, key_padding_mask = batch_first(query, key, value, key_padding_mask, batched=batched,
                                                          is_batch_first=self.batch_first)
        merged, q, k, mask = heads_like_torch(self.torch_weights(), query, key, value, key_padding_mask=key_padding_mask,
                                              attn_mask=attn_mask, is_causal=is_causal, attend=self._attend)  # (B, Lq, H*D)
        out = self.out_proj(merged)  # (B, Lq, E)
        weights = torch_weights_out(q, k, mask, need_weights, average_attn_weights)
        return layout_back(out, weights, batched=batched, is_batch_first=self.batch_first)


class TorchMultiheadAttention(_TorchCall, AttentionCore, nn.MultiheadAttention):
    """A drop-in for ``torch.nn.MultiheadAttention`` that computes with multihead.

    Same constructor (``add_bias_kv`` and ``add_zero_attn`` included), parameters
    (``in_proj_weight`` or ``q/k/v_proj_weight``, ``in_proj_bias``, ``bias_k``/``bias_v``,
    ``out_proj``), state_dict, forward signature, return values ``(attn_output,
    attn_weights or None)`` and input checks (torch.nn's messages; the errors are
    ``ValueError``s that are also the ``AssertionError``/``RuntimeError`` torch.nn
    raises), so ``nn.TransformerEncoderLayer``, ``nn.TransformerDecoderLayer`` and
    ``nn.Transformer`` run on it. Deliberate differences:

    - a query row with nothing to attend to gives zeros, never NaN;
    - the returned weights are the softmax weights before dropout;
    - ``is_causal=True`` is torch.nn's hint (``attn_mask`` must be given, and is taken
      to be the causal mask: the causal kernel runs when nothing is appended);
    - torch's fused encoder fast path (``nn.TransformerEncoderLayer`` computing the whole layer
      in one native call, which would bypass this module) is never taken: the module carries a
      no-op forward pre-hook (:func:`keep_torch_fast_path_off`), so the layer runs its own
      modules and says why (``"forward pre-/hooks are attached to the module"``). Every attribute
      is torch.nn's and truthful (``_qkv_same_embed_dim``, ``in_proj_weight`` / ``q_proj_weight``, ...:
      ``F.multi_head_attention_forward`` with them computes what the module does). Tests that
      check that fast path was entered (by mocking torch's fused kernels) cannot pass;
    - nested-tensor inputs (``nn.TransformerEncoder``'s padding-free path hands them to its
      layers; strided or jagged) are taken with ``batch_first=True`` and no masks, as torch.nn's
      fast path takes them and newer torch takes them outside it: self- or cross-attention
      (query, key and value all nested, ``add_bias_kv`` / ``add_zero_attn`` and gradients
      included), the padding masked, the output nested again in the query's layout, the
      weights padded (B, [H,] Lq, Lk) with zeros outside each sequence as the fast path gives;
    - ``torch.jit.script`` scripts a plain ``torch.nn.MultiheadAttention`` with the same
      weights (TorchScript cannot compile multihead's dispatch); scripting a patched
      model also puts that plain module back into the model (torch does it in place).
    """

    def __init__(self, embed_dim, num_heads, dropout=0.0, bias=True, add_bias_kv=False, add_zero_attn=False,
                 kdim=None, vdim=None, batch_first=False, device=None, dtype=None):
        validation.valid_dropout(dropout)
        super().__init__(embed_dim, num_heads, dropout, bias, add_bias_kv, add_zero_attn, kdim, vdim,
                         batch_first, device=device, dtype=dtype)
        self.register_forward_pre_hook(keep_torch_fast_path_off)
        self.num_kv_heads, self.value_head_dim = self.num_heads, self.head_dim
        self._init_core(dropout=dropout, scale=None, backend="auto")

    @classmethod
    def from_module(cls, module: nn.MultiheadAttention) -> TorchMultiheadAttention:
        """The drop-in with ``module``'s configuration and weights."""
        w = module.out_proj.weight
        new = cls(module.embed_dim, module.num_heads, module.dropout, module.in_proj_bias is not None,
                  module.bias_k is not None, module.add_zero_attn, module.kdim, module.vdim, module.batch_first,
                  device=w.device, dtype=w.dtype)
        new.load_state_dict(module.state_dict())
        new.train(module.training)
        return new

    def to_torch(self) -> nn.MultiheadAttention:
        """A plain ``torch.nn.MultiheadAttention`` with this module's configuration and weights."""
        w = self.out_proj.weight
        plain = TORCH_MHA(self.embed_dim, self.num_heads, self.dropout, self.in_proj_bias is not None,
                                      self.bias_k is not None, self.add_zero_attn, self.kdim, self.vdim,
                                      self.batch_first, device=w.device, dtype=w.dtype)
        plain.load_state_dict(self.state_dict())
        return plain.train(self.training)

    def __prepare_scriptable__(self) -> nn.MultiheadAttention:
        """TorchScript cannot compile multihead's Python dispatch: ``torch.jit.script`` of the
        drop-in (or of a model holding it) scripts ``torch.nn.MultiheadAttention`` with these
        weights instead (same results, except NaN where multihead gives zeros). torch's
        scripting puts the plain module in the model's place, in place."""
        plain = self.to_torch()
        # torch memoizes prepared modules by id(); keeping the original alive keeps its id from being reused
        plain.__dict__["_multihead_source"] = (self,)
        return plain

    def torch_weights(self) -> TorchWeights:
        """The parameters as ``F.multi_head_attention_forward`` takes them (q/k/v split)."""
        if self._qkv_same_embed_dim:
            w_q, w_k, w_v = self.in_proj_weight.chunk(3)  # (3E, E) -> 3 x (E, E)
        else:
            w_q, w_k, w_v = self.q_proj_weight, self.k_proj_weight, self.v_proj_weight
        return torch_weights(self.num_heads, w_q, w_k, w_v, self.in_proj_bias, bias_k=self.bias_k, bias_v=self.bias_v,
                             add_zero_attn=self.add_zero_attn)


class PrunedMultiheadAttention(_TorchCall, AttentionCore, nn.Module):
    """``torch.nn.MultiheadAttention`` with heads cut: what :func:`multihead.heads.prune` puts in the place
    of a torch.nn module (or the drop-in) it prunes, since torch.nn fixes the head count by ``embed_dim``.

    The same call as torch.nn's (signature, layouts, masks, input checks, return values, the drop-in's
    deliberate differences) and the same parameter names (``in_proj_weight`` or ``q/k/v_proj_weight``,
    ``in_proj_bias``, ``bias_k``/``bias_v``, ``out_proj``), with H heads of size D where H*D need not be
    ``embed_dim``: ``in_proj_weight`` (3*H*D, E), ``out_proj`` (E, H*D). A multihead attention module:
    capture, gates, importance and further pruning see it directly. Built empty with the sizes a pruned
    checkpoint records (its ``state_dict`` then loads), or by :meth:`from_torch`.
    """

    def __init__(self, embed_dim: int, num_heads: int, head_dim: int, *, kdim: int | None = None,
                 vdim: int | None = None, bias: bool = True, add_bias_kv: bool = False, add_zero_attn: bool = False,
                 dropout: float = 0.0, batch_first: bool = False, packed: bool = True, device=None, dtype=None):
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.embed_dim, self.num_heads, self.head_dim = embed_dim, num_heads, head_dim
        self.kdim, self.vdim = kdim if kdim is not None else embed_dim, vdim if vdim is not None else embed_dim
        self._qkv_same_embed_dim = packed
        if packed and (self.kdim, self.vdim) != (embed_dim, embed_dim):
            raise ValueError(f"packed=True (one in_proj_weight) needs kdim = vdim = embed_dim={embed_dim}; got "
                             f"kdim={self.kdim}, vdim={self.vdim}. Pass packed=False.")
        inner = num_heads * head_dim
        if packed:
            self.in_proj_weight = nn.Parameter(torch.empty(3 * inner, embed_dim, **kw))  # [Q | K | V] rows
            self.register_parameter("q_proj_weight", None)
            self.register_parameter("k_proj_weight", None)
            self.register_parameter("v_proj_weight", None)
        else:
            self.q_proj_weight = nn.Parameter(torch.empty(inner, embed_dim, **kw))
            self.k_proj_weight = nn.Parameter(torch.empty(inner, self.kdim, **kw))
            self.v_proj_weight = nn.Parameter(torch.empty(inner, self.vdim, **kw))
            self.register_parameter("in_proj_weight", None)
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * inner, **kw)) if bias else None
        self.bias_k = nn.Parameter(torch.zeros(1, 1, inner, **kw)) if add_bias_kv else None
        self.bias_v = nn.Parameter(torch.zeros(1, 1, inner, **kw)) if add_bias_kv else None
        self.add_zero_attn, self.batch_first = add_zero_attn, batch_first
        self.out_proj = nn.Linear(inner, embed_dim, bias=bias, **kw)
        self.register_forward_pre_hook(keep_torch_fast_path_off)
        self.num_kv_heads, self.value_head_dim = num_heads, head_dim
        self._init_core(dropout=dropout, scale=None, backend="auto")

    @classmethod
    def from_torch(cls, module: nn.MultiheadAttention) -> PrunedMultiheadAttention:
        """Every head of ``module`` (torch.nn's, or the drop-in), its weights copied."""
        w = module.out_proj.weight
        new = cls(module.embed_dim, module.num_heads, module.head_dim, kdim=module.kdim, vdim=module.vdim,
                  bias=module.in_proj_bias is not None, add_bias_kv=module.bias_k is not None,
                  add_zero_attn=module.add_zero_attn, dropout=module.dropout, batch_first=module.batch_first,
                  packed=module._qkv_same_embed_dim, device=w.device, dtype=w.dtype)
        new.load_state_dict(module.state_dict())
        return new.train(module.training)

    def __prepare_scriptable__(self):
        raise TypeError(f"torch.jit.script cannot compile {type(self).__name__} (multihead's Python dispatch), and "
                        f"torch.nn.MultiheadAttention cannot hold {self.num_heads} heads of {self.head_dim} with "
                        f"embed_dim={self.embed_dim}; use torch.compile or torch.export instead.")

    def torch_weights(self) -> TorchWeights:
        """The parameters as ``F.multi_head_attention_forward`` would take them (q/k/v split)."""
        if self._qkv_same_embed_dim:
            w_q, w_k, w_v = self.in_proj_weight.chunk(3)  # (3 H D, E) -> 3 x (H D, E)
        else:
            w_q, w_k, w_v = self.q_proj_weight, self.k_proj_weight, self.v_proj_weight
        return torch_weights(self.num_heads, w_q, w_k, w_v, self.in_proj_bias, bias_k=self.bias_k, bias_v=self.bias_v,
                             add_zero_attn=self.add_zero_attn)

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, head_dim={self.head_dim}, "
                f"batch_first={self.batch_first}")
