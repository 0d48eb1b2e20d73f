"""W5: greedy decoding with a KV cache (``multihead bench --workloads W5``).

A decoder-only language model of 2 pre-norm layers (512 hiddens, 8 heads, causal
self-attention + a 4x feed-forward) decodes 256 tokens greedily, batch 1 and 16, three
ways on the same weights:

- multihead + KVCache: each step feeds the newest token; keys and values come from the cache;
- recompute: multihead without a cache, the whole prefix through the model every step;
- hand-written: the same projections with ``F.linear``, preallocated key/value buffers and
  ``F.scaled_dot_product_attention`` (the loop a careful user writes by hand).

Reported: total time for the 256 tokens and the latency of the 256th step; runs of the
three are interleaved, medians over rounds with min-max. The cache against the hand-written
loop is also timed step by step (:func:`lockstep`: the two decoders advance one token each in
turn, as many rounds; the ratio of their summed times, with each round's min-max), which a
machine whose speed drifts over a run disturbs less than the ratio of two medians.
``recompute=False`` leaves the recomputing decoder out (at batch 16 it takes 25x the others' time).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from multihead import KVCache, MultiHeadAttention, masks


class DecodeBenchBlock(nn.Module):
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
        self.blocks = nn.ModuleList(DecodeBenchBlock(E, H) for _ in range(layers))
        self.norm, self.out = nn.LayerNorm(E), nn.Linear(E, vocab)

    def forward(self, ids: Tensor, cache: KVCache | None = None, start: int = 0) -> Tensor:
        # positions read as the hand-written loop reads them (a slice of the table, not arange + an Embedding call:
        # ~0.7% of a batch-1 step here), so the two decoders differ only in their attention
        x = self.embed(ids) + self.pos.weight[start: start + ids.shape[1]]  # (B, T, E)
        for b in self.blocks:
            x = b(x, cache)
        return self.out(self.norm(x))  # (B, T, vocab)


# The decoders are generators (one token per next()), under torch.no_grad as a decorator: torch then turns
# gradients off only while the generator runs, never across a yield into its caller.


@torch.no_grad()
def _cached_steps(model: TinyLM, B: int, steps: int):
    """multihead + KVCache, one token per ``next()``: yields each step's seconds, returns the tokens (B, steps+1)."""
    cache = KVCache(model, B, steps)
    ys = torch.zeros(B, 1, dtype=torch.long)
    for t in range(steps):
        s = time.perf_counter()
        nxt = model(ys[:, -1:], cache, start=t)[:, -1].argmax(-1, keepdim=True)  # (B, 1)
        ys = torch.cat([ys, nxt], 1)
        yield time.perf_counter() - s
    return ys


@torch.no_grad()
def _recompute_steps(model: TinyLM, B: int, steps: int):
    """multihead without a cache: the whole prefix through the model every step."""
    ys = torch.zeros(B, 1, dtype=torch.long)
    for _ in range(steps):
        s = time.perf_counter()
        nxt = model(ys)[:, -1].argmax(-1, keepdim=True)  # (B, 1)
        ys = torch.cat([ys, nxt], 1)
        yield time.perf_counter() - s
    return ys


@torch.no_grad()
def _by_hand_steps(model: TinyLM, B: int, steps: int):
    """The same weights, F.linear + preallocated caches + F.scaled_dot_product_attention."""
    E = model.embed.embedding_dim
    H = model.blocks[0].attn.num_heads
    D = E // H
    ks = [torch.zeros(B, H, steps, D) for _ in model.blocks]  # (B, H, Lmax, D) per layer
    vs = [torch.zeros(B, H, steps, D) for _ in model.blocks]
    ys = torch.zeros(B, 1, dtype=torch.long)
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
        ys = torch.cat([ys, nxt], 1)
        yield time.perf_counter() - s
    return ys


def _drain(gen) -> tuple[Tensor, float]:
    """Run a decoder to the end: (its tokens, the last step's seconds)."""
    last = 0.0
    while True:
        try:
            last = next(gen)
        except StopIteration as stop:
            return stop.value, last


def decode_cached(model: TinyLM, B: int, steps: int) -> tuple[Tensor, float]:
    return _drain(_cached_steps(model, B, steps))


def decode_recompute(model: TinyLM, B: int, steps: int) -> tuple[Tensor, float]:
    return _drain(_recompute_steps(model, B, steps))


def decode_by_hand(model: TinyLM, B: int, steps: int) -> tuple[Tensor, float]:
    return _drain(_by_hand_steps(model, B, steps))


WAYS = {"multihead + KVCache": decode_cached, "recompute (no cache)": decode_recompute,
        "hand-written SDPA + cache": decode_by_hand}


def lockstep(model: TinyLM, B: int, steps: int) -> tuple[float, float]:
    """The cached and the hand-written decoders run side by side, one step of each in turn (which goes first
    alternates): (cached seconds, hand-written seconds), summed over the steps. Each pair of steps sees the same
    few milliseconds of the machine, so a machine whose speed drifts disturbs their ratio less than it does two
    whole runs'."""
    gens = [_cached_steps(model, B, steps), _by_hand_steps(model, B, steps)]
    tot = [0.0, 0.0]
    for t in range(steps):
        for i in ((0, 1) if t % 2 else (1, 0)):
            tot[i] += next(gens[i])
    for g in gens:
        g.close()
    return tot[0], tot[1]


CACHED, RECOMPUTE, HAND = WAYS


def run(batches=(1, 16), steps: int = 256, rounds: int = 3, log=print, *, recompute: bool = True) -> dict:
    torch.manual_seed(0)
    model = TinyLM().eval()
    ways = [w for w in WAYS if recompute or w != RECOMPUTE]
    results = {}
    for B in batches:
        times: dict[str, list[tuple[float, float]]] = {w: [] for w in ways}
        outs = {}
        decode_cached(model, B, 8), decode_by_hand(model, B, 8)  # warm-up
        for r in range(rounds):
            order = ways[r % len(ways):] + ways[: r % len(ways)]
            for w in order:
                s = time.perf_counter()
                ys, last = WAYS[w](model, B, steps)
                times[w].append((time.perf_counter() - s, last))
                outs[w] = ys
        same = all(torch.equal(outs[CACHED], outs[w]) for w in ways)
        row = {}
        for w, ts in times.items():
            tot = [t for t, _ in ts]
            lat = [x for _, x in ts]
            row[w] = {"total_s": statistics.median(tot), "total_min_max": [min(tot), max(tot)],
                      "step_ms": 1e3 * statistics.median(lat), "step_min_max_ms": [1e3 * min(lat), 1e3 * max(lat)]}
        ref = row[CACHED]
        if recompute:
            row["speedup_vs_recompute"] = row[RECOMPUTE]["total_s"] / ref["total_s"]
        row["ratio_to_hand_written"] = ref["total_s"] / row[HAND]["total_s"]
        pairs = [lockstep(model, B, steps) for _ in range(rounds)]  # each round: the two decoders step by step
        per_round = [c / h for c, h in pairs]
        row["ratio_lockstep"] = {"ratio": sum(c for c, _ in pairs) / sum(h for _, h in pairs),
                                 "min_max": [min(per_round), max(per_round)]}
        row["same_tokens"] = same
        results[str(B)] = row
        log(f"W5 batch {B}: " + "; ".join(f"{w} {row[w]['total_s']:.2f} s (step {steps}: {row[w]['step_ms']:.2f} ms)"
                                         for w in ways)
            + (f"; cache {row['speedup_vs_recompute']:.1f}x faster than recompute" if recompute else "")
            + f"; {row['ratio_to_hand_written']:.2f}x the hand-written loop (step by step "
              f"{row['ratio_lockstep']['ratio']:.3f}x); same tokens: {same}")
    return {"steps": steps, "rounds": rounds, "batches": results}


def markdown(data: dict) -> str:
    lines = [f"W5: greedy decoding of {data['steps']} tokens (2 layers, 512 hiddens, 8 heads), medians of "
             f"{data['rounds']} interleaved rounds, min-max in brackets", "",
             "| batch | way | total (s) | step " + str(data["steps"]) + " (ms) |", "|---:|---|---:|---:|"]
    for B, row in data["batches"].items():
        for w in WAYS:
            if w not in row:  # recompute left out
                continue
            r = row[w]
            lines.append(f"| {B} | {w} | {r['total_s']:.2f} ({r['total_min_max'][0]:.2f}-{r['total_min_max'][1]:.2f}) "
                         f"| {r['step_ms']:.2f} ({r['step_min_max_ms'][0]:.2f}-{r['step_min_max_ms'][1]:.2f}) |")
        if "speedup_vs_recompute" in row:
            lines.append(f"| {B} | **cache vs recompute** | **{row['speedup_vs_recompute']:.1f}x faster** | |")
        lines.append(f"| {B} | **cache / hand-written** | **{row['ratio_to_hand_written']:.3f}x** | |")
        if "ratio_lockstep" in row:
            pr = row["ratio_lockstep"]
            lines.append(f"| {B} | **cache / hand-written, step by step** | **{pr['ratio']:.3f}x** "
                         f"({pr['min_max'][0]:.2f}-{pr['min_max'][1]:.2f} by round) | |")
    return "\n".join(lines) + "\n"
