"""A drop-in for ``torch.nn.MultiheadAttention`` that computes with multihead: the same constructor,
parameters, state_dict, forward signature, return values and input checks (torch.nn's messages), so
``nn.TransformerEncoderLayer``, ``nn.TransformerDecoderLayer`` and ``nn.Transformer`` run on it, and
:func:`multihead.interop.patch` puts it into a model in place.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from multihead import masks
from multihead.core import validation
from multihead.core.functional import weights_of
from multihead.layer.module import AttentionCore

__all__ = ["TorchMultiheadAttention", "keep_torch_fast_path_off"]


def keep_torch_fast_path_off(module, args):
    """A forward pre-hook that does nothing. :class:`TorchMultiheadAttention` carries it so that
    ``nn.TransformerEncoderLayer`` sees a hook on its attention and runs its own modules (this one
    included) instead of torch's fused native layer."""
    return None


class TorchMultiheadAttention(AttentionCore, nn.MultiheadAttention):
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
      layers) are taken for self-attention with ``batch_first=True`` and no masks, as torch.nn's
      fast path takes them: the padding is masked and the output is nested again
      (``need_weights`` must then be False);
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
        plain = nn.MultiheadAttention(self.embed_dim, self.num_heads, self.dropout, self.in_proj_bias is not None,
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

    def projection_weights(self):
        """(w_q, w_k, w_v, b_q, b_k, b_v): (E, E), (E, kdim), (E, vdim) and (E,) or None."""
        if self._qkv_same_embed_dim:
            w_q, w_k, w_v = self.in_proj_weight.chunk(3)  # (3E, E) -> 3 x (E, E)
        else:
            w_q, w_k, w_v = self.q_proj_weight, self.k_proj_weight, self.v_proj_weight
        b = self.in_proj_bias
        if b is not None and b.dtype != w_q.dtype:  # a bias of another dtype is promoted (as torch.nn's slow path does)
            b = b.to(w_q.dtype)
        b_q, b_k, b_v = b.chunk(3) if b is not None else (None, None, None)  # (3E,) -> 3 x (E,)
        return w_q, w_k, w_v, b_q, b_k, b_v

    def _forward_nested(self, query, key, value, key_padding_mask, need_weights, attn_mask, is_causal):
        """Self-attention on a nested batch (B sequences of (L_b, E)), as torch.nn's fast path takes it:
        padded to (B, L, E) with the padding masked, and nested again."""
        if not (query is key and key is value) or not self.batch_first or key_padding_mask is not None \
                or attn_mask is not None or is_causal or need_weights:
            raise validation.TorchShapeError(
                "MultiheadAttention takes NestedTensor input for self-attention only (query is key is value), with "
                "batch_first=True, no attn_mask / key_padding_mask / is_causal and need_weights=False (as "
                "nn.TransformerEncoder passes it); otherwise pad the batch (torch.nested.to_padded_tensor) and pass "
                "a key_padding_mask.")
        lens = [t.shape[0] for t in query.unbind()]  # L_b of each sequence
        x = torch.nested.to_padded_tensor(query, 0.0)  # (B, L, E)
        pad = torch.arange(x.shape[1], device=x.device) >= torch.tensor(lens, device=x.device)[:, None]  # (B, L)
        out, _ = self.forward(x, x, x, key_padding_mask=pad, need_weights=False)  # (B, L, E)
        return torch.nested.as_nested_tensor([o[:n] for o, n in zip(out, lens)], layout=query.layout), None

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True, is_causal=False):
        if isinstance(query, Tensor) and query.is_nested:
            return self._forward_nested(query, key, value, key_padding_mask, need_weights, attn_mask, is_causal)
        batched = validation.torch_mha_inputs(query, key, value, key_padding_mask, attn_mask, num_heads=self.num_heads,
                                          embed_dim=self.embed_dim, kdim=self.kdim, vdim=self.vdim,
                                          batch_first=self.batch_first, is_causal=is_causal)
        if not batched:  # (L, E) -> (1, L, E)
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)  # (Lk,) -> (1, Lk)
        elif not self.batch_first:  # (L, B, E) -> (B, L, E)
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        B, Lq, E = query.shape
        H, D = self.num_heads, self.head_dim
        w_q, w_k, w_v, b_q, b_k, b_v = self.projection_weights()
        q = F.linear(query, w_q, b_q)  # (B, Lq, E)
        k = F.linear(key, w_k, b_k)  # (B, Lk, E)
        v = F.linear(value, w_v, b_v)  # (B, Lk, E)
        extra = 0
        if self.bias_k is not None:  # one learned key/value position appended to every sequence
            k = torch.cat([k, self.bias_k.expand(B, 1, E).to(k.dtype)], 1)  # (B, Lk+1, E)
            v = torch.cat([v, self.bias_v.expand(B, 1, E).to(v.dtype)], 1)
            extra += 1
        q = q.view(B, Lq, H, D)  # (B, Lq, E) -> (B, Lq, H, D)
        k = k.view(B, k.shape[1], H, D)  # (B, Lk', E) -> (B, Lk', H, D)
        v = v.view(B, v.shape[1], H, D)
        if self.add_zero_attn:  # one zero key/value per head appended
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
        out = self._attend(q, k, v, mask)  # (B, Lq, H, D)
        out = self.out_proj(out.reshape(B, Lq, E))  # (B, Lq, H, D) -> (B, Lq, E)
        weights = None
        if need_weights:
            weights = weights_of(q.transpose(1, 2), k.transpose(1, 2), mask, None)  # (B, H, Lq, Lk)
            if average_attn_weights:
                weights = weights.mean(1)  # (B, Lq, Lk)
        if not batched:
            out = out.squeeze(0)
            weights = weights.squeeze(0) if weights is not None else None
        elif not self.batch_first:
            out = out.transpose(0, 1)  # (B, Lq, E) -> (Lq, B, E)
        return out, weights
