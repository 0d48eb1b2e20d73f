"""timm's attention modules in the form :func:`multihead.heads.observe` sees and cuts.

timm's attention classes (``timm.layers.Attention`` of ViT and DeiT, EVA's ``EvaAttention``, Swin's
``WindowAttention``, ...) compute attention one of two ways, chosen per instance by ``fused_attn``: with one
``F.scaled_dot_product_attention`` call, or written out by hand. The first is what multihead observes; Swin's
default is the second (timm marks its fused path experimental), and ``TIMM_FUSED_ATTN=0`` chooses it for every
class. Two forms, registered with :data:`multihead.heads.observe.FORMS` (so nothing here imports timm):

- **the fused path**: a timm module whose ``fused_attn`` is False is switched to True (its own SDPA branch: the
  same projections, scale, bias and masks);
- **EVA** (``EvaAttention``): its forward merges the heads with ``reshape(B, N, C)``, C the model's width, so it
  cannot run with fewer heads; its form is the same forward (fused q/k/v with its separate q/k/v biases or three
  projections, the q/k norms, rotary embedding past the prefix tokens, one SDPA call, the merged-heads norm, the
  output gate and projection) with the heads merged as ``reshape(B, N, H D)``.

:func:`~multihead.heads.observe` gives a form and keeps it only if the model's output on the example is unchanged
(within 1e-4 of its scale), as for any form; a module keeps its form after ``unobserve`` (``heads.prune`` needs it).
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from multihead.heads.observe import FORMS

__all__ = ["eva_attention_forward", "give_timm_form", "take_timm_form"]

_WAS = "multihead_timm_form"  # in the module's __dict__: its fused_attn before the form, and whether forward was set


def _is_timm(module: nn.Module) -> bool:
    return type(module).__module__.startswith("timm.")


def eva_attention_forward(self, x: Tensor, rope: Tensor | None = None, attn_mask: Tensor | None = None,
                          is_causal: bool = False) -> Tensor:
    """``EvaAttention.forward`` (timm 1.0's signature and arithmetic) with the heads merged to their own width:
    x (B, N, C) -> (B, N, C_out). ``rope``: the rotary embedding of the N - num_prefix_tokens patch positions."""
    from timm.layers import apply_rot_embed_cat

    B, N, _ = x.shape
    gate = self.gate(x).sigmoid() if self.gate is not None else None  # (B, N, H D)
    if self.qkv is not None:
        bias = None if self.q_bias is None else torch.cat((self.q_bias, self.k_bias, self.v_bias))  # (3 H D,)
        if bias is not None and self.qkv_bias_separate:
            qkv = self.qkv(x) + bias
        else:
            qkv = F.linear(x, self.qkv.weight, bias)  # (B, N, 3 H D)
        q, k, v = qkv.reshape(B, N, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)  # 3 x (B, H, N, D)
    else:
        q, k, v = (p(x).reshape(B, N, self.num_heads, -1).transpose(1, 2)  # (B, N, H D) -> (B, H, N, D)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
    q, k = self.q_norm(q), self.k_norm(k)
    if rope is not None:  # the prefix tokens ([CLS], registers) keep their vectors
        n, half = self.num_prefix_tokens, getattr(self, "rotate_half", False)
        q = torch.cat([q[:, :, :n], apply_rot_embed_cat(q[:, :, n:], rope, half=half)], dim=2).type_as(v)
        k = torch.cat([k[:, :, :n], apply_rot_embed_cat(k[:, :, n:], rope, half=half)], dim=2).type_as(v)
    p = self.attn_drop.p if self.training else 0.0
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=p, is_causal=is_causal,
                                         scale=self.scale)  # (B, H, N, Dv)
    out = self.norm(out.transpose(1, 2).reshape(B, N, -1))  # (B, H, N, Dv) -> (B, N, H Dv)
    if gate is not None:
        out = out * gate
    return self.proj_drop(self.proj(out))


def give_timm_form(module: nn.Module) -> bool:
    """Give a timm attention module its SDPA form (True): EVA's forward above, or its own fused path where it
    computes by hand; any other module, or one that has its form already, is left as it is (False)."""
    if not _is_timm(module) or _WAS in module.__dict__:
        return False
    eva = type(module).__name__ == "EvaAttention"
    fused = module.__dict__.get("fused_attn")
    if not eva and fused is not False:
        return False
    module.__dict__[_WAS] = (fused, eva)
    if fused is False:
        module.__dict__["fused_attn"] = True
    if eva:
        module.forward = types.MethodType(eva_attention_forward, module)  # an instance attribute: copies keep it
    return True


def take_timm_form(module: nn.Module) -> None:
    """Undo :func:`give_timm_form` (the module's own forward and path again)."""
    fused, eva = module.__dict__.pop(_WAS)
    if fused is not None:
        module.__dict__["fused_attn"] = fused
    if eva:
        module.__dict__.pop("forward", None)


FORMS.append((give_timm_form, take_timm_form))
