"""Padding is not computed.

When a mask says which keys are padding (``ValidLens`` of shape (B,), a
``KeyPadding``, or ``Padding`` for queries and keys), :class:`MultiHeadAttention`
gathers the real tokens, projects only them, attends sequence by sequence on the
packed tokens, projects back and scatters the rows into place:

    keys (B, Lk, E) --gather--> (Nk, E) --k_proj--> (Nk, Hkv*D)
    per sequence b: q_b (1, H, nq_b, D), k_b (1, Hkv, nk_b, D) -> (1, H, nq_b, Dv)
    (Nq, H*Dv) --o_proj--> (Nq, out) --scatter--> (B, Lq, out)

Queries are packed too under ``Padding`` (padded query rows come out as zeros);
under the course's ``valid_lens`` every query row is computed, exactly as before.
Position-dependent masks (``Causal``, ``SlidingWindow``, top-left aligned) may be
combined when the kept keys are a prefix of each sequence, since packing a
prefix keeps every position. Anything else (dense masks, per-query lengths,
bottom-right alignment) takes the dense path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from multihead import masks

#: what one sequence of the per-sequence loop costs, in floating-point operations
#: it could have done instead (~50 us of Python and kernel launch at ~100 GFLOP/s)
LOOP_COST_FLOP = 5e6


@dataclass
class Plan:
    key_keep: Tensor  # (B, Lk) bool: the keys that are real
    query_keep: Tensor | None  # (B, Lq) bool, or None = every query row is computed
    rest: masks.Mask | None  # what remains to apply inside each sequence (positions preserved)
    reason: str


def _prefix(keep: Tensor) -> bool:
    n = keep.sum(-1, keepdim=True)  # (B, 1)
    return bool((keep == (torch.arange(keep.shape[-1], device=keep.device) < n)).all())


def plan(mask: masks.Mask | None, B: int, Lq: int, Lk: int, device, *, flop_per_token: float = 0.0,
         force: bool = False) -> Plan | str:
    """A packing plan for ``mask``, or the reason the dense path runs instead.

    Packing pays when the work it saves on padded tokens (``flop_per_token`` each,
    the projections) exceeds what the per-sequence loop costs (B x LOOP_COST_FLOP)."""
    if mask is None:
        return "no padding in the mask"
    if not force and Lk * flop_per_token <= LOOP_COST_FLOP:  # even all-padding could not pay for the loop
        return (f"Lk={Lk}: skipping padded keys saves at most ~{Lk * flop_per_token / 1e6:.1f} MFLOP per sequence, "
                f"less than the per-sequence loop costs (~{LOOP_COST_FLOP / 1e6:.0f} MFLOP)")
    key_keep = query_keep = None
    rest = []
    for p in mask.parts():
        if isinstance(p, masks.Padding):  # Lq == Lk: the same real tokens for queries and keys
            k = torch.arange(Lk, device=device) < p.lens.to(device)[:, None]  # (B, Lk)
            key_keep = k if key_keep is None else key_keep & k
            query_keep = k if query_keep is None else query_keep & k
        elif isinstance(p, masks.ValidLens) and p.lens.dim() == 1:
            k = torch.arange(Lk, device=device) < p.lens.to(device)[:, None]  # (B, Lk)
            key_keep = k if key_keep is None else key_keep & k
        elif isinstance(p, masks.KeyPadding):
            k = p.keep_mask.to(device)
            key_keep = k if key_keep is None else key_keep & k
        elif isinstance(p, (masks.Causal, masks.SlidingWindow)) and p.align == "top-left":
            rest.append(p)
        else:
            return f"{p!r} is applied densely"
    if key_keep is None:
        return "no padding in the mask"
    if rest and not _prefix(key_keep):
        return "the real keys are not a prefix of each sequence, and the mask depends on positions"
    if query_keep is not None and rest and not _prefix(query_keep):
        return "the real queries are not a prefix of each sequence, and the mask depends on positions"
    n_padded = key_keep.numel() - int(key_keep.sum())
    padded = n_padded / max(1, key_keep.numel())
    if not force:
        saved, cost = n_padded * flop_per_token, B * LOOP_COST_FLOP
        if saved <= cost:
            return (f"{padded:.0%} of the keys are padding: skipping them saves ~{saved / 1e6:.0f} MFLOP, less than "
                    f"the per-sequence loop costs (~{cost / 1e6:.0f} MFLOP)")
    rest_mask = None
    for r in rest:
        rest_mask = r if rest_mask is None else rest_mask & r
    return Plan(key_keep, query_keep, rest_mask, f"packing: {padded:.0%} of the keys are padding")


#: self-attention over packed sequences no longer than this is padded to the longest
#: for the attention alone (one batched call); longer ones loop over the sequences
PAD_UP_TO = 128


def attend_packed(module, q_in: Tensor, k_in: Tensor, v_in: Tensor, q_lens: list[int], k_lens: list[int],
                  rest: masks.Mask | None) -> Tensor:
    """Project packed tokens, attend sequence by sequence, project back.

    q_in (Nq, query_size), k_in (Nk, key_size), v_in (Nk, value_size); sequence b
    has q_lens[b] query rows and k_lens[b] keys, in order -> (Nq, out_features).
    The projections and the output projection see only the real tokens. Short
    self-attention sequences (all <= PAD_UP_TO, no other mask) attend in one call,
    padded to the longest with a ``Padding`` mask; others loop over the sequences.
    """
    H, Hkv, D, Dv = module.num_heads, module.num_kv_heads, module.head_dim, module.value_head_dim
    q_proj, k_proj, v_proj, o_proj = module.projections()
    if H == 0:  # every head pruned: the output projection's bias
        return o_proj(q_in.new_zeros(q_in.shape[0], 0))
    q = q_proj(q_in)  # (Nq, H*D)
    k = k_proj(k_in)  # (Nk, Hkv*D)
    v = v_proj(v_in)  # (Nk, Hkv*Dv)
    if rest is None and q_lens == k_lens and q_lens and max(q_lens) <= PAD_UP_TO:
        B, Lm = len(q_lens), max(q_lens)
        lens = torch.tensor(q_lens, device=q.device)
        idx = (torch.arange(B, device=q.device)[:, None] * Lm + torch.arange(Lm, device=q.device))[
            torch.arange(Lm, device=q.device) < lens[:, None]]  # (N,): where each packed row sits in (B*Lm)

        def pad(t, heads, size):  # (N, heads*size) -> (B, heads, Lm, size)
            full = t.new_zeros(B * Lm, t.shape[-1]).index_copy(0, idx, t)
            return full.view(B, Lm, heads, size).transpose(1, 2)  # (B*Lm, heads*size) -> (B, heads, Lm, size)

        o = module._attend(pad(q, H, D), pad(k, Hkv, D), pad(v, Hkv, Dv), masks.Padding(lens))  # (B, H, Lm, Dv)
        o = o.transpose(1, 2).reshape(B * Lm, H * Dv).index_select(0, idx)  # -> (N, H*Dv)
        return o_proj(o)
    outs = []
    qo = ko = 0
    for nq, nk in zip(q_lens, k_lens):
        qb = q[qo:qo + nq].view(1, nq, H, D).transpose(1, 2)  # (nq, H*D) -> (1, H, nq, D)
        kb = k[ko:ko + nk].view(1, nk, Hkv, D).transpose(1, 2)  # (nk, Hkv*D) -> (1, Hkv, nk, D)
        vb = v[ko:ko + nk].view(1, nk, Hkv, Dv).transpose(1, 2)  # (nk, Hkv*Dv) -> (1, Hkv, nk, Dv)
        ob = module._attend(qb, kb, vb, rest)  # (1, H, nq, Dv)
        outs.append(ob[0].transpose(0, 1).reshape(nq, H * Dv))  # (1, H, nq, Dv) -> (nq, H*Dv)
        qo, ko = qo + nq, ko + nk
    return o_proj(torch.cat(outs))  # (Nq, out_features)


def run(module, queries: Tensor, keys: Tensor, values: Tensor, p: Plan) -> Tensor:
    """The varlen path of :class:`MultiHeadAttention`: (B, Lq, ·) -> (B, Lq, out_features)."""
    B, Lq = queries.shape[:2]
    k_in = keys[p.key_keep]  # (B, Lk, E) -> (Nk, E)
    v_in = k_in if values is keys else values[p.key_keep]  # (Nk, E)
    k_lens = p.key_keep.sum(-1).tolist()
    if p.query_keep is None:
        q_in = queries.reshape(B * Lq, -1)  # (B, Lq, E) -> (B*Lq, E)
        q_lens = [Lq] * B
    else:
        same = queries is keys and torch.equal(p.query_keep, p.key_keep)
        q_in = k_in if same else queries[p.query_keep]  # (Nq, E)
        q_lens = p.query_keep.sum(-1).tolist()
    out = attend_packed(module, q_in, k_in, v_in, q_lens, k_lens, p.rest)  # (Nq, out)
    if p.query_keep is None:
        return out.view(B, Lq, -1)  # (B*Lq, out) -> (B, Lq, out)
    full = out.new_zeros(B, Lq, out.shape[-1])
    full[p.query_keep] = out  # padded query rows stay zeros
    return full
