"""SDPA forms of transformers families that compute attention by hand, so that
:func:`multihead.heads.observe` sees, gates and cuts their heads like any module that calls
``torch.nn.functional.scaled_dot_product_attention``.

A form is the family's attention forward rewritten with one SDPA call for every head, the same
arithmetic otherwise (the same projections, scale, bias, mask, dropout, cache and return values);
:func:`multihead.heads.observe` installs it on the model's modules of that class and keeps it only
if the model's output on the probe call is unchanged. One family so far:

- **Bloom** (``BloomAttention``): scores = ALiBi bias + (q k^T) / sqrt(D), plus the causal/padding
  float mask, softmax, dropout, @ v, written with ``baddbmm``/``bmm``; its form passes the ALiBi bias
  plus the mask as SDPA's float ``attn_mask``. The ALiBi bias arrives built by the model for all
  ``n_head`` heads; each module keeps a per-head index buffer (``alibi_heads``, not saved in the
  state dict) that ``heads.prune`` cuts with the heads, so a layer keeps its kept heads' slopes.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from multihead.heads.observe import FORMS

__all__ = ["bloom_attention_forward", "give_bloom_form", "take_bloom_form"]


def bloom_attention_forward(self, hidden_states: Tensor, residual: Tensor, alibi: Tensor,
                            attention_mask: Tensor | None, layer_past=None, use_cache: bool = False,
                            output_attentions: bool = False, **kwargs):
    """``BloomAttention.forward`` (transformers' signature, mirrored) with one SDPA call:
    hidden_states (B, Lq, E), alibi (B*n_head, 1, Lk), attention_mask (B, 1, Lq, Lk) float or None
    -> (output (B, Lq, E) with the residual added, weights (B, H, Lq, Lk) if output_attentions else None)."""
    if kwargs:
        raise TypeError(f"BloomAttention's SDPA form computes from hidden_states, residual, alibi, attention_mask, "
                        f"layer_past, use_cache and output_attentions only; got also {sorted(kwargs)} (a transformers "
                        "version whose Bloom passes more: multihead cannot observe it).")
    B, Lq, _ = hidden_states.shape
    q, k, v = self._reshape(self.query_key_value(hidden_states))  # (B, Lq, H*3*D) -> 3 x (B, H, Lq, D)
    if layer_past is not None:
        k, v = layer_past.update(k, v, self.layer_idx)  # (B, H, Lk, D)
    Lk = k.shape[2]
    bias = alibi.view(B, -1, 1, alibi.shape[-1]).index_select(1, self.alibi_heads)  # (B*n_head, 1, Lk) -> (B, H, 1, Lk)
    bias = self.beta * bias
    if attention_mask is not None:
        bias = bias + attention_mask  # (B, 1, Lq, Lk) float: 0 or the dtype's minimum
    bias = bias.to(q.dtype).expand(B, q.shape[1], Lq, Lk)  # (B, H, Lq, Lk)
    weights = None
    if output_attentions:  # as the family returns them: softmax in float32, before dropout
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.inv_norm_factor + bias  # (B, H, Lq, Lk)
        weights = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    p = self.attention_dropout.p if self.training else 0.0
    ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=p, scale=self.inv_norm_factor)
    ctx = ctx.transpose(1, 2).reshape(B, Lq, -1)  # (B, H, Lq, D) -> (B, Lq, H*D)
    out = F.dropout(self.dense(ctx), p=self.hidden_dropout, training=self.training) + residual  # (B, Lq, E)
    return out, weights


def give_bloom_form(module: nn.Module) -> bool:
    """Give a ``BloomAttention`` module its SDPA form (True), or leave any other module, or one that has
    its form already, as it is (False). Refused (ValueError) where the form would compute differently
    (the output projection summed in tensor-parallel slices)."""
    cls = type(module)
    if cls.__name__ != "BloomAttention" or not cls.__module__.startswith("transformers.") or \
            "forward" in module.__dict__:
        return False
    if module.pretraining_tp > 1 and module.slow_but_exact:
        raise ValueError("BloomAttention with pretraining_tp > 1 and slow_but_exact=True sums its output projection "
                         "in slices; multihead's SDPA form does not reproduce that. Set config.slow_but_exact=False.")
    module.register_buffer("alibi_heads", torch.arange(module.num_heads), persistent=False)  # (H,)
    module.forward = types.MethodType(bloom_attention_forward, module)  # an instance attribute: copies keep it
    return True


def take_bloom_form(module: nn.Module) -> None:
    """Undo :func:`give_bloom_form` (the class's forward again)."""
    module.__dict__.pop("forward", None)
    module._buffers.pop("alibi_heads", None)


FORMS.append((give_bloom_form, take_bloom_form))
