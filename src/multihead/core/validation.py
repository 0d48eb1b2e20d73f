"""Every check of user input, in one place: the functional API, the modules, the
course's compat modules and the torch.nn drop-in all validate through these, before
any computation, and raise ``ValueError``/``TypeError`` naming the argument, what
it got and what would fix it.

Shape letters: B batch, H query heads, Hkv key/value heads, Lq/Lk query/key
lengths, D query/key head size, Dv value head size, E model size.
"""

from __future__ import annotations

import math
import numbers

from torch import Tensor

from multihead.masks import Mask, as_mask

__all__ = ["attention_inputs", "heads", "module_inputs", "positive_int", "valid_dropout", "valid_scale"]


def _shape(t: Tensor) -> str:
    """(3, 5): joined by hand, which torch.compile can trace while building an error message."""
    dims = [str(d) for d in t.shape]
    return "(" + ", ".join(dims) + ("," if len(dims) == 1 else "") + ")"


def positive_int(name: str, v, *, optional: bool = False) -> int | None:
    if v is None and optional:
        return None
    if not isinstance(v, numbers.Integral) or isinstance(v, bool) or v <= 0:
        raise ValueError(f"{name} must be a positive integer{' or None' if optional else ''}; got {v!r}.")
    return int(v)


def valid_scale(v, name: str = "scale") -> float | None:
    """None (= 1/sqrt(D)) or a positive finite number."""
    if v is None:
        return None
    if not isinstance(v, numbers.Real) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
        raise ValueError(f"{name} must be a positive finite number or None (= 1/sqrt(D)); got {v!r}.")
    return float(v)


def valid_dropout(v, name: str = "dropout") -> float:
    """A probability in [0, 1)."""
    if not isinstance(v, numbers.Real) or isinstance(v, bool) or not 0.0 <= float(v) < 1.0:
        raise ValueError(f"{name} must be a number in [0, 1); got {v!r}.")
    return float(v)


def heads(H: int, Hkv: int, *, where: str = "") -> None:
    """H must be a multiple of Hkv (grouped-query attention); no heads at all (H = Hkv = 0) is an empty call."""
    if Hkv == 0 and H == 0:
        return
    if Hkv == 0:
        raise ValueError(f"the key/value have Hkv=0 heads; the query's H={H} heads need at least one key/value head "
                         f"to attend to{where}.")
    if H % Hkv:
        raise ValueError(
            f"the query's heads H={H} must be a multiple of the key/value heads Hkv={Hkv} (grouped-query "
            f"attention: every Hkv head serves H/Hkv query heads){where}."
        )


_LETTERS = {"query": "(B, H, Lq, D)", "key": "(B, Hkv, Lk, D)", "value": "(B, Hkv, Lk, Dv)"}


def attention_inputs(query, key, value=None, mask=None, *, scale=None, dropout_p=0.0, softcap=None,
                     sinks=None) -> Mask | None:
    """Validate a functional attention call: query (B, H, Lq, D), key (B, Hkv, Lk, D),
    value (B, Hkv, Lk, Dv) or None (weights only). Returns the mask as a :class:`Mask`."""
    named = [("query", query), ("key", key)] + ([("value", value)] if value is not None else [])
    for name, t in named:
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor of shape {_LETTERS[name]}; got {type(t).__name__}.")
        if not t.dtype.is_floating_point:
            raise TypeError(f"{name} must be floating point; got dtype {t.dtype}. Convert with {name}.float().")
        if t.dim() != 4:
            raise ValueError(
                f"{name} must be 4-D {_LETTERS[name]}; got shape {_shape(t)}. For (B, L, E) inputs use "
                "MultiHeadAttention, or split the heads: x.view(B, L, H, D).transpose(1, 2)."
            )
    if len({t.dtype for _, t in named}) > 1:
        got = ", ".join(f"{n} {t.dtype}" for n, t in named)
        raise TypeError(f"query, key and value must share one dtype; got {got}. Cast them to one.")
    if len({t.device for _, t in named}) > 1:
        got = ", ".join(f"{n} on {t.device}" for n, t in named)
        raise ValueError(f"query, key and value must be on one device; got {got}.")
    B, H, Lq, D = query.shape
    if any(t.shape[0] != B for _, t in named):  # compared, not hashed: sizes may be symbolic (torch.export)
        got = ", ".join(f"{n} {_shape(t)}" for n, t in named)
        raise ValueError(f"query, key and value must have the same batch size B; got {got}.")
    Hkv, Lk = key.shape[1], key.shape[2]
    if key.shape[-1] != D:
        raise ValueError(
            f"query and key must have the same head size D; got query {_shape(query)} (D={D}) and key "
            f"{_shape(key)} (D={key.shape[-1]})."
        )
    if D == 0:
        raise ValueError(f"query and key have head size D=0 (got query {_shape(query)}): the scores would be empty "
                         "dot products, and the default scale 1/sqrt(D) has no value; give each head at least one "
                         "feature.")
    if value is not None and (value.shape[1] != Hkv or value.shape[2] != Lk):
        raise ValueError(
            f"key (B, Hkv, Lk, D) and value (B, Hkv, Lk, Dv) must agree on Hkv and Lk; got key {_shape(key)} "
            f"and value {_shape(value)}."
        )
    heads(H, Hkv, where=f"; got query {_shape(query)}, key {_shape(key)}")
    valid_scale(scale)
    valid_dropout(dropout_p, "dropout_p")
    score_modifiers(softcap, sinks, H, query)
    mask = as_mask(mask)
    if mask is not None:
        mask.validate(B, H, Lq, Lk, query.device)
    return mask


def score_modifiers(softcap, sinks, H: int, query: Tensor) -> None:
    """softcap: None or a positive finite number; sinks: None or a floating (H,) tensor on the
    query's device."""
    if softcap is not None:
        valid_scale(softcap, "softcap")
    if sinks is None:
        return
    if not isinstance(sinks, Tensor):
        raise TypeError(f"sinks must be a torch.Tensor of shape (H,) = ({H},), one logit per query head; got "
                        f"{type(sinks).__name__}.")
    if not sinks.dtype.is_floating_point or tuple(sinks.shape) != (H,):
        raise ValueError(f"sinks must be a floating tensor of shape (H,) = ({H},), one logit per query head; got "
                         f"shape {_shape(sinks)}, dtype {sinks.dtype}.")
    if sinks.device != query.device:
        raise ValueError(f"sinks is on {sinks.device} but query is on {query.device}; move it with "
                         f"sinks.to({str(query.device)!r}).")


def module_inputs(named: tuple[tuple[str, Tensor], ...], sizes: tuple[tuple[str, int | None], ...]) -> None:
    """Validate a module call's (B, L, size) inputs: ``named`` = (("queries", t), ...),
    ``sizes`` = (("query_size", expected or None when not known yet), ...)."""
    for (name, t), (size, want) in zip(named, sizes):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor of shape (B, L, {size}); got {type(t).__name__}.")
        if not t.dtype.is_floating_point:
            raise TypeError(f"{name} must be floating point; got dtype {t.dtype}. Convert with {name}.float().")
        if t.dim() != 3:
            raise ValueError(f"{name} must be 3-D (B, L, {size}); got shape {_shape(t)}.")
        if want is not None and t.shape[-1] != want:
            raise ValueError(
                f"{name} must be (B, L, {size}={want}); got shape {_shape(t)}. Give inputs of that size, "
                f"or build the module with {size}={t.shape[-1]}."
            )
    (_, q), (_, k), (_, v) = named
    if not q.shape[0] == k.shape[0] == v.shape[0]:
        raise ValueError(
            f"queries, keys and values must have the same batch size B; got shapes {_shape(q)}, {_shape(k)}, "
            f"{_shape(v)}."
        )
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"keys and values must have the same length Lk; got keys {_shape(k)} and values {_shape(v)}.")
    if len({q.device, k.device, v.device}) > 1:
        raise ValueError(f"queries, keys and values must be on one device; got {q.device}, {k.device}, {v.device}.")



# --- torch.nn.MultiheadAttention's contract, for the drop-in ---


class TorchShapeError(ValueError, AssertionError):
    """A shape error of the torch.nn drop-in: a ValueError here, and an AssertionError with
    torch.nn's own words, so code (and tests) written against torch.nn catch it as before."""


class TorchHintError(ValueError, RuntimeError):
    """torch.nn's RuntimeError for ``is_causal=True`` without ``attn_mask``, also a ValueError."""


def _torch_ranks(query, key, value, key_padding_mask, attn_mask, *, batched: bool, layout: str,
                 num_heads: int) -> None:
    """torch.nn's checks of a call's ranks, batched (3-D query) or not (2-D), in torch.nn's words."""
    n, what = (3, "batched (3-D)") if batched else (2, "unbatched (2-D)")
    if key.dim() != n or value.dim() != n:
        raise TorchShapeError(
            f"For {what} `query`, expected `key` and `value` to be {n}-D but found "
            f"{key.dim()}-D and {value.dim()}-D tensors respectively (query {_shape(query)}, key {_shape(key)}, "
            f"value {_shape(value)}); give all three as {layout if batched else '(L, E)'}.")
    if key_padding_mask is not None and key_padding_mask.dim() != n - 1:
        raise TorchShapeError(
            f"For {what} `query`, expected `key_padding_mask` to be `None` or {n - 1}-D but found "
            f"{key_padding_mask.dim()}-D tensor instead; give it as {'(B, Lk)' if batched else '(Lk,)'}, "
            "True = padding.")
    if attn_mask is not None and attn_mask.dim() not in (2, 3):
        raise TorchShapeError(
            f"For {what} `query`, expected `attn_mask` to be `None`, 2-D or 3-D but found "
            f"{attn_mask.dim()}-D tensor instead; give it as (Lq, Lk) or {'(B*H' if batched else '(H'}, Lq, Lk).")
    if not batched and attn_mask is not None and attn_mask.dim() == 3 and \
            tuple(attn_mask.shape) != (num_heads, query.shape[0], key.shape[0]):
        raise TorchShapeError(
            f"Expected `attn_mask` shape to be {(num_heads, query.shape[0], key.shape[0])} but got "
            f"{tuple(attn_mask.shape)}: (H, Lq, Lk) for an unbatched query.")


def torch_mha_inputs(query, key, value, key_padding_mask, attn_mask, *, num_heads: int, embed_dim: int,
                     kdim: int, vdim: int, batch_first: bool, is_causal: bool) -> bool:
    """Check a ``torch.nn.MultiheadAttention`` call as torch.nn does (same messages, plus
    what to do) before any computation. Returns whether the input is batched."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}.")
        if not t.dtype.is_floating_point:
            raise TypeError(f"{name} must be floating point; got dtype {t.dtype}. Convert with {name}.float().")
    layout = "(B, L, E)" if batch_first else "(L, B, E)"
    if query.dim() in (2, 3):
        _torch_ranks(query, key, value, key_padding_mask, attn_mask, batched=query.dim() == 3, layout=layout,
                     num_heads=num_heads)
    else:
        raise TorchShapeError(
            f"query should be unbatched 2D or batched 3D tensor but received {query.dim()}-D query tensor "
            f"(shape {_shape(query)}); give it as {layout} or (L, E).")
    batched = query.dim() == 3
    if query.shape[-1] != embed_dim:
        raise TorchShapeError(f"was expecting embedding dimension of {embed_dim}, but got {query.shape[-1]} "
                              f"(query {_shape(query)}).")
    if key.shape[-1] != kdim or value.shape[-1] != vdim:
        raise TorchShapeError(f"key must have kdim={kdim} and value vdim={vdim} features; got key {_shape(key)} and "
                              f"value {_shape(value)}.")
    if key.shape[:-1] != value.shape[:-1]:
        raise TorchShapeError(f"key's sequence and batch dims {tuple(key.shape[:-1])} do not match value's "
                              f"{tuple(value.shape[:-1])}.")
    if batched:
        bdim = 0 if batch_first else 1
        if query.shape[bdim] != key.shape[bdim]:
            raise TorchShapeError(f"query and key must have the same batch size; got query {_shape(query)} and key "
                                  f"{_shape(key)} ({layout}).")
    if is_causal and attn_mask is None:
        raise TorchHintError(
            "Need attn_mask if specifying the is_causal hint. You may use the Transformer module method "
            "`generate_square_subsequent_mask` to create this mask.")
    return batched
