"""torch.nn.MultiheadAttention <-> multihead."""

from __future__ import annotations

import torch
from torch import nn

from multihead.layer.dropin import TORCH_MHA, TorchMultiheadAttention
from multihead.layer.module import MultiHeadAttention
from multihead.layer.plan import in_features


def _refuse_extras(module: nn.MultiheadAttention) -> None:
    if module.bias_k is not None or module.add_zero_attn:
        raise ValueError(
            "cannot convert a torch.nn.MultiheadAttention with add_bias_kv=True or add_zero_attn=True: multihead "
            "has no learned or zero extra key/value positions. Build the module without them."
        )


def from_torch(module: nn.MultiheadAttention) -> MultiHeadAttention:
    """A :class:`MultiHeadAttention` with ``module``'s weights (packed ``in_proj_weight``
    or separate q/k/v weights with kdim/vdim; biases; dropout).

    The result takes batch-first inputs (B, L, E) whatever ``module.batch_first``
    is; masks convert with :func:`multihead.masks.from_torch`.
    """
    if not isinstance(module, nn.MultiheadAttention):
        raise TypeError(f"from_torch takes a torch.nn.MultiheadAttention; got {type(module).__name__}.")
    _refuse_extras(module)
    E, H = module.embed_dim, module.num_heads
    w = module.out_proj.weight
    bias = module.in_proj_bias is not None
    new = MultiHeadAttention(E, H, module.dropout, bias, query_size=E, key_size=module.kdim, value_size=module.vdim)
    new.to(device=w.device, dtype=w.dtype)
    with torch.no_grad():
        if module._qkv_same_embed_dim:
            ws = module.in_proj_weight.chunk(3)  # (3E, E) -> 3 x (E, E)
        else:
            ws = (module.q_proj_weight, module.k_proj_weight, module.v_proj_weight)
        bs = module.in_proj_bias.chunk(3) if bias else (None, None, None)  # (3E,) -> 3 x (E,)
        for lin, wt, b in zip(new.projections()[:3], ws, bs):
            lin.weight.copy_(wt)
            if b is not None:
                lin.bias.copy_(b)
        new.o_proj.weight.copy_(module.out_proj.weight)
        if bias:
            new.o_proj.bias.copy_(module.out_proj.bias)
    return new.train(module.training)


def to_torch(module: MultiHeadAttention, *, batch_first: bool = True) -> nn.MultiheadAttention:
    """A ``torch.nn.MultiheadAttention`` with ``module``'s weights. torch.nn has
    one head size and no GQA: needs Hkv = H, Dv = D, query_size = H*D = out_features."""
    if not isinstance(module, MultiHeadAttention):
        raise TypeError(f"to_torch takes a multihead.MultiHeadAttention; got {type(module).__name__}.")
    H, D, Dv = module.num_heads, module.head_dim, module.value_head_dim
    q, k, v, o = module.projections()
    sizes = [in_features(p) for p in (q, k, v)]
    if None in sizes:
        raise ValueError("the module's input sizes are not known yet (lazy): call it once, then convert.")
    E = H * D
    problems = []
    if module.num_kv_heads != H:
        problems.append(f"num_kv_heads={module.num_kv_heads} != num_heads={H} (torch.nn has no GQA)")
    if Dv != D:
        problems.append(f"value_head_dim={Dv} != head_dim={D}")
    if sizes[0] != E or module.out_features != E:
        problems.append(f"query_size={sizes[0]} and out_features={module.out_features} must both equal H*D={E}")
    if module.scale is not None:
        problems.append(f"scale={module.scale} (torch.nn always scales by 1/sqrt(D))")
    if problems:
        raise ValueError("torch.nn.MultiheadAttention cannot hold this module: " + "; ".join(problems) + ".")
    bias = q.bias is not None
    w = q.weight
    new = TORCH_MHA(E, H, dropout=module.dropout, bias=bias, kdim=sizes[1], vdim=sizes[2],
                    batch_first=batch_first, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        if new._qkv_same_embed_dim:
            new.in_proj_weight.copy_(torch.cat([q.weight, k.weight, v.weight]))  # 3 x (E, E) -> (3E, E)
        else:
            new.q_proj_weight.copy_(q.weight)
            new.k_proj_weight.copy_(k.weight)
            new.v_proj_weight.copy_(v.weight)
        if bias:
            new.in_proj_bias.copy_(torch.cat([q.bias, k.bias, v.bias]))  # 3 x (E,) -> (3E,)
            new.out_proj.bias.copy_(o.bias)
        new.out_proj.weight.copy_(o.weight)
    return new.train(module.training)


def patch(model: nn.Module) -> dict[str, nn.MultiheadAttention]:
    """Replace, in place, every ``torch.nn.MultiheadAttention`` inside ``model`` by
    :class:`~multihead.compat.TorchMultiheadAttention` with the same weights.
    Returns {qualified name: the module it replaced}. A model that *is* an
    ``nn.MultiheadAttention`` cannot be replaced in place: use ``from_module``.

    ``nn.TransformerEncoder``'s nested-tensor path (eval, batch_first, a key padding mask) keeps
    working: the drop-in takes the nested tensors it hands to the layers, and the patched model
    gives what torch's gives (zeros at padded positions included)."""
    if type(model) is nn.MultiheadAttention:
        raise TypeError("patch replaces modules inside a model; for a lone module use "
                        "TorchMultiheadAttention.from_module(module).")
    replaced = {}
    for name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            if type(child) is nn.MultiheadAttention:
                setattr(parent, child_name, TorchMultiheadAttention.from_module(child))
                replaced[f"{name}.{child_name}" if name else child_name] = child
    return replaced
