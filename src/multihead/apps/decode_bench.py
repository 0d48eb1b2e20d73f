"""W5: greedy decoding with a KV cache (``multihead bench --workloads W5``).

A decoder-only language model of 2 pre-norm layers (512 hiddens, 8 heads, causal
self-attention + a 4x feed-forward) decodes 256 tokens greedily, batch 1 and 16, three
ways on the same weights:

- multihead + KVCache: each step feeds the newest token; keys and values come from the cache;
- recompute: multihead without a cache, the whole prefix through the model every step;
- hand-written: the same projections with ``F.linear``, preallocated key/value buffers and
  ``F.scaled_dot_product_attention`` (the loop a careful user writes by hand).

Reported: total time for the 256 tokens and the latency of the 256th step; runs of the
three are interleaved, medians over rounds with min-max.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from multihead import KVCache, MultiHeadAttention, masks


class Block(nn.Module):
    def __init__(self, E: int, H: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(E), nn.LayerNorm(E)
        self.attn = MultiHeadAttention(E, H, bias=True, query_size=E, key_size=E, value_size=E)
        self.ffn = nn.Sequential(nn.Linear(E, 4 * E), nn.GELU(), nn.Linear(4 * E, E))

    def forward(self, x: Tensor, cache: KVCache | None = None) -> Tensor:
        h = self.norm1(x)
        x = x + (self.attn(h, cache=cache) if cache is not None else self.attn(h, mask=masks.Causal()))
        return x + self.ffn(self.norm2(x))


class TinyLM(nn.Module):
    """Embedding, N blocks, a final norm and the output layer; positions learned."""

    def __init__(self, vocab: int = 1000, E: int = 512, H: int = 8, layers: int = 2, max_len: int = 512):
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab, E), nn.Embedding(max_len, E)
        self.blocks = nn.ModuleList(Block(E, H) for _ in range(layers))
        self.norm, self.out = nn.LayerNorm(E), nn.Linear(E, vocab)

    def forward(self, ids: Tensor, cache: KVCache | None = None, start: int = 0) -> Tensor:
        x = self.embed(ids) + self.pos(torch.arange(start, start + ids.shape[1]))  # (B, T, E)
        for b in self.blocks:
            x = b(x, cache)
        return self.out(self.norm(x))  # (B, T, vocab)


@torch.no_grad()
def decode_cached(model: TinyLM, B: int, steps: int) -> tuple[Tensor, float]:
    cache = KVCache(model, B, steps)
    ys = torch.zeros(B, 1, dtype=torch.long)
    last = 0.0
    for t in range(steps):
        s = time.perf_counter()
        nxt = model(ys[:, -1:], cache, start=t)[:, -1].argmax(-1, keepdim=True)  # (B, 1)
        last = time.perf_counter() - s
        ys = torch.cat([ys, nxt], 1)
    return ys, last


@torch.no_grad()
def decode_recompute(model: TinyLM, B: int, steps: int) -> tuple[Tensor, float]:
    ys = torch.zeros(B, 1, dtype=torch.long)
    last = 0.0
    for _ in range(steps):
        s = time.perf_counter()
        nxt = model(ys)[:, -1].argmax(-1, keepdim=True)  # (B, 1)
        last = time.perf_counter() - s
        ys = torch.cat([ys, nxt], 1)
    return ys, last


@torch.no_grad()
def decode_by_hand(model: TinyLM, B: int, steps: int) -> tuple[Tensor, float]:
    """The same weights, F.linear + preallocated caches + F.scaled_dot_product_attention."""
    E = model.embed.embedding_dim
    H = model.blocks[0].attn.num_heads
    D = E // H
    ks = [torch.zeros(B, H, steps, D) for _ in model.blocks]  # (B, H, Lmax, D) per layer
    vs = [torch.zeros(B, H, steps, D) for _ in model.blocks]
    ys = torch.zeros(B, 1, dtype=torch.long)
    last = 0.0
    for t in range(steps):
        s = time.perf_counter()
        x = model.embed(ys[:, -1:]) + model.pos.weight[t]  # (B, 1, E)
        for i, blk in enumerate(model.blocks):
            a = blk.attn
            h = blk.norm1(x)
            q = F.linear(h, a.q_proj.weight, a.q_proj.bias).view(B, 1, H, D).transpose(1, 2)  # (B, H, 1, D)
            ks[i][:, :, t] = F.linear(h, a.k_proj.weight, a.k_proj.bias).view(B, H, D)
            vs[i][:, :, t] = F.linear(h, a.v_proj.weight, a.v_proj.bias).view(B, H, D)
            o = F.scaled_dot_product_attention(q, ks[i][:, :, : t + 1], vs[i][:, :, : t + 1])  # (B, H, 1, D)
            x = x + F.linear(o.transpose(1, 2).reshape(B, 1, E), a.o_proj.weight, a.o_proj.bias)
            x = x + blk.ffn(blk.norm2(x))
        nxt = model.out(model.norm(x))[:, -1].argmax(-1, keepdim=True)
        last = time.perf_counter() - s
        ys = torch.cat([ys, nxt], 1)
    return ys, last


WAYS = {"multihead + KVCache": decode_cached, "recompute (no cache)": decode_recompute,
        "hand-written SDPA + cache": decode_by_hand}


def run(batches=(1, 16), steps: int = 256, rounds: int = 3, log=print) -> dict:
    torch.manual_seed(0)
    model = TinyLM().eval()
    results = {}
    for B in batches:
        times: dict[str, list[tuple[float, float]]] = {w: [] for w in WAYS}
        outs = {}
        decode_cached(model, B, 8), decode_by_hand(model, B, 8)  # warm-up
        for r in range(rounds):
            order = list(WAYS)[r % 3:] + list(WAYS)[: r % 3]
            for w in order:
                s = time.perf_counter()
                ys, last = WAYS[w](model, B, steps)
                times[w].append((time.perf_counter() - s, last))
                outs[w] = ys
        same = torch.equal(outs["multihead + KVCache"], outs["recompute (no cache)"]) and torch.equal(
            outs["multihead + KVCache"], outs["hand-written SDPA + cache"])
        row = {}
        for w, ts in times.items():
            tot = [t for t, _ in ts]
            lat = [x for _, x in ts]
            row[w] = {"total_s": statistics.median(tot), "total_min_max": [min(tot), max(tot)],
                      "step_ms": 1e3 * statistics.median(lat), "step_min_max_ms": [1e3 * min(lat), 1e3 * max(lat)]}
        ref = row["multihead + KVCache"]
        row["speedup_vs_recompute"] = row["recompute (no cache)"]["total_s"] / ref["total_s"]
        row["ratio_to_hand_written"] = ref["total_s"] / row["hand-written SDPA + cache"]["total_s"]
        row["same_tokens"] = same
        results[str(B)] = row
        log(f"W5 batch {B}: " + "; ".join(f"{w} {row[w]['total_s']:.2f} s (step {steps}: {row[w]['step_ms']:.2f} ms)"
                                         for w in WAYS)
            + f"; cache {row['speedup_vs_recompute']:.1f}x faster than recompute, "
              f"{row['ratio_to_hand_written']:.2f}x the hand-written loop; same tokens: {same}")
    return {"steps": steps, "rounds": rounds, "batches": results}


def markdown(data: dict) -> str:
    lines = [f"W5: greedy decoding of {data['steps']} tokens (2 layers, 512 hiddens, 8 heads), medians of "
             f"{data['rounds']} interleaved rounds, min-max in brackets", "",
             "| batch | way | total (s) | step " + str(data["steps"]) + " (ms) |", "|---:|---|---:|---:|"]
    for B, row in data["batches"].items():
        for w in WAYS:
            r = row[w]
            lines.append(f"| {B} | {w} | {r['total_s']:.2f} ({r['total_min_max'][0]:.2f}-{r['total_min_max'][1]:.2f}) "
                         f"| {r['step_ms']:.2f} ({r['step_min_max_ms'][0]:.2f}-{r['step_min_max_ms'][1]:.2f}) |")
        lines.append(f"| {B} | **cache vs recompute** | **{row['speedup_vs_recompute']:.1f}x faster** | |")
        lines.append(f"| {B} | **cache / hand-written** | **{row['ratio_to_hand_written']:.2f}x** | |")
    return "\n".join(lines) + "\n"
