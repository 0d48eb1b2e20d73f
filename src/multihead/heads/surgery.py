"""Head surgery, written once: which rows and columns belong to heads, a projection cut to
them, and a removed head's mean output folded into the output projection's bias.

Used by :func:`multihead.heads.prune` (multihead's own modules) and by the transformers head
layouts (:mod:`multihead.hf.layouts`). A projection is ``nn.Linear`` (weight (out, in)) or
transformers' ``Conv1D`` (weight (in, out), y = x W + b).

Dependency order: modules -> surgery -> heads, hf_heads.
"""

from __future__ import annotations

import re
from collections import Counter

import torch
from torch import Tensor, nn

from multihead.layer.module import linear

__all__ = ["fold_into_bias", "head_rows", "is_conv1d", "kept_heads", "out_in", "select"]


def head_rows(heads: list[int], size: int) -> list[int]:
    """The rows (or columns) of heads ``heads`` in a projection laid out head by head, ``size``
    per head: head h owns h*size .. h*size + size - 1."""
    return [h * size + d for h in heads for d in range(size)]


def is_conv1d(p: nn.Module) -> bool:
    """transformers' Conv1D (GPT-2): weight (in, out), y = x W + b."""
    return type(p).__name__ == "Conv1D"


def out_in(p: nn.Module) -> Tensor:
    """The projection's weight as (out, in), whatever its layout (a view, not a copy)."""
    return p.weight.t() if is_conv1d(p) else p.weight


def select(p: nn.Module, out_rows: list[int] | None = None, in_cols: list[int] | None = None) -> nn.Module:
    """A new projection of ``p``'s kind keeping output rows ``out_rows`` and input columns
    ``in_cols`` (None: all) of its weight and bias, on its device and dtype. A Conv1D left without
    input columns becomes an nn.Linear (Conv1D cannot have zero input features)."""
    w = out_in(p).detach()  # (out, in)
    if out_rows is not None:
        w = w[out_rows]
    if in_cols is not None:
        w = w[:, in_cols]
    b = p.bias.detach() if p.bias is not None else None
    if b is not None and out_rows is not None:
        b = b[out_rows]
    conv = is_conv1d(p) and w.shape[1] > 0
    if conv:
        new = type(p)(w.shape[0], w.shape[1])
        new.weight = nn.Parameter(w.t().contiguous())  # (out, in) -> Conv1D's (in, out)
        new.bias = None if b is None else nn.Parameter(b.contiguous())
    else:
        new = linear(w.shape[1], w.shape[0], b is not None, device=w.device, dtype=w.dtype)
        with torch.no_grad():
            new.weight.copy_(w)
            if b is not None:
                new.bias.copy_(b)
    return new.to(device=w.device, dtype=w.dtype)


def fold_into_bias(new_o: nn.Module, old_o: nn.Module, cols: list[int], mean: Tensor) -> None:
    """Fold what removed heads contributed on average into ``new_o``'s bias: ``old_o``'s weight
    columns ``cols`` (the removed heads' inputs) times ``mean`` (their mean outputs, flattened to
    len(cols)) is a constant (out,) added to the bias (made when ``new_o`` has none)."""
    w = out_in(old_o)  # (out, H*Dv)
    const = w[:, cols] @ mean.reshape(-1).to(w.dtype)  # (out,)
    with torch.no_grad():
        if new_o.bias is None:
            new_o.bias = nn.Parameter(torch.zeros_like(const))
        new_o.bias += const


# --- the role a layer's name says it plays (shared by the transformers layouts and the grader) ---

_FILLER = {"w", "proj", "projection", "lin", "linear", "layer", "dense", "weight", "weights", "to", "fc", "mat",
           "matrix", "head", "heads", "self", "attn", "attention", "list", "param", "params", "kernel", "p", "in",
           "layers", "all", "wt"}
_BIAS = {"b", "bias", "biases"}
_ROLE = {"q": "q", "query": "q", "queries": "q", "k": "k", "key": "k", "keys": "k", "v": "v", "value": "v",
         "values": "v", "o": "o", "out": "o", "output": "o", "combine": "o", "concat": "o", "merge": "o", "c": "o",
         "unify": "o", "qkv": "qkv"}
_FUSED = {"inproj", "cattn", "qkv", "inprojweight"}


def _compound(token: str) -> list[str] | None:
    """A name written as one word, split into its filler and role words: 'tokeys' -> ['to', 'keys'],
    'unifyheads' -> ['unify', 'heads'], 'qproj' -> ['q', 'proj']; None when it is not such a word. A role word
    of one letter counts only first and before a filler of three letters or more ('qproj', not 'tok')."""
    words = (_FILLER | _ROLE.keys()) - {"c"}

    def split(rest: str, first: bool) -> list[str] | None:
        if not rest:
            return []
        for n in range(len(rest), 0, -1):
            head = rest[:n]
            if head not in words or (len(head) == 1 and head in _ROLE and not (first and len(rest) >= 4)):
                continue
            tail = split(rest[n:], False)
            if tail is not None:
                return [head, *tail]
        return None

    pieces = split(token, True)
    return pieces if pieces is not None and len(pieces) > 1 else None


def is_bias(name: str) -> bool:
    """'b_q', 'bias', 'self.out.bias' -> True: a parameter named as a bias (of any role)."""
    last = name.split(".")[-1]
    tokens = [t.lower() for t in re.split(r"[^A-Za-z0-9]+|(?<=[a-z])(?=[A-Z])", last) if t]
    return any(t in _BIAS or (len(t) > 1 and t[0] == "b" and t[1:] in _ROLE) for t in tokens)


def role_of(name: str) -> str | None:
    """'W_q' -> 'q', 'self.inner.to_out' -> 'o', 'c_attn' -> 'qkv', 'c_attn_bias' -> 'qkv', 'b_q' -> 'q',
    'tokeys' -> 'k', 'unifyheads' -> 'o', 'proj' -> 'o?', '0' -> None."""
    last = name.split(".")[-1]
    tokens = [t.lower() for t in re.split(r"[^A-Za-z0-9]+|(?<=[a-z])(?=[A-Z])", last) if t]
    flat = "".join(t for t in tokens if t not in _BIAS and t not in ("weight", "weights"))
    if flat in _FUSED or "qkv" in flat:
        return "qkv"
    tokens = [w for t in tokens for w in (([t] if t in _ROLE or t in _FILLER else _compound(t)) or [t])]
    roles = set()
    for t in tokens:
        if t in _ROLE:
            roles.add(_ROLE[t])
        elif len(t) > 1 and t[0] in "wb" and t[1:] in _ROLE:
            roles.add(_ROLE[t[1:]])
        elif t not in _FILLER and t not in _BIAS and not t.isdigit():
            return None
    if len(roles) == 1:
        return roles.pop()
    if roles == {"q", "k", "v"}:  # query_key_value
        return "qkv"
    if not roles and {"proj", "dense", "fc", "linear", "projection"} & set(tokens):
        return "o?"  # an unnamed projection: the output one when q, k and v have names
    return None


def kept_heads(H: int, Hkv: int, remove: set[int]) -> tuple[list[int], list[int]]:
    """The query heads kept and the key/value heads they read: a key/value head goes only when all its query heads
    go. With grouped key/value heads (GQA, H = G * Hkv) every kept key/value head must keep the same number of query
    heads, so the kept groups still share their key/value heads evenly: a cut that leaves groups uneven is refused
    (ValueError naming the groups and an even cut beside it) -- giving each kept query head its own copy of its
    key/value head would grow the KV cache and the key/value projections it was meant to shrink."""
    bad = [h for h in remove if not 0 <= h < H]
    if bad:
        raise ValueError(f"heads {sorted(bad)} do not exist: the module has num_heads={H}.")
    keep = [h for h in range(H) if h not in remove]
    group = H // Hkv
    per_kv = Counter(h // group for h in keep)
    if len(set(per_kv.values())) <= 1:  # every kept key/value head still serves the same number of heads
        return keep, sorted(per_kv)
    n = min(per_kv.values())  # >= 1: only groups that keep a head are counted
    # an even cut beside it: the groups the user emptied stay empty, every other keeps its first n of those kept
    even = sorted(set(range(H)) - {h for g in per_kv for h in [x for x in keep if x // group == g][:n]})
    raise ValueError(
        f"removing heads {sorted(remove)} leaves the key/value groups uneven (kept query heads per key/value head: "
        f"{dict(sorted(per_kv.items()))}; {H} query heads share {Hkv} key/value heads, {group} each): they would "
        f"need {len(keep)} key/value heads where the module has {Hkv}. Cut whole groups (all {group} query heads of "
        f"a key/value head) or the same number of query heads in every group, e.g. heads {even}.")
