"""Circuits: which heads talk to which, through their queries, keys and values -- edge attribution (EAP, EAP-IG),
exact edge patching, and faithfulness by intervention.

**The graph.** Writers: the input embedding (the residual stream where the first layer reads it), each head's output
(where the gates act: each attention module's hook list), each MLP's output. Readers: each head's query input, each
key/value head's key and value inputs (a grouped key/value head is one receiver for its group, never ungrouped
copies), each MLP's input, the logits (the final residual, where the readout reads it). An edge joins a writer to
every later reader: the residual stream carries it there. Where a layer normalises before reading, the edge is
exact -- a reader's input is rebuilt from the writers and its q/k/v recomputed from that (the norm and the
projections run again on the rebuilt input, through the module's own forward), as TransformerLens does.

Models the graph expresses (:data:`BLOCKS`, checked from the module tree before any forward; anything else is refused
by name, :data:`REFUSED` saying why for the post-norm encoders): transformers' GPT-2, Llama, Qwen2, Qwen3 (query/key
norms per head), Mistral and Phi-3 (a fused qkv_proj) decoder layers; GPT-NeoX/Pythia and GPT-J, whose MLP reads the
block's input beside the attention (no edge from a head to its own layer's MLP; GPT-J's MLP input rebuilt through the
attention's own ``ln_1``); Gemma 2, Gemma 3 and OLMo 2, whose blocks normalise the attention's and the MLP's outputs
before the add (an MLP and its norm are one writer; a head's edge is non-linear: each reader's input is rebuilt with
the norm run on its own patched sum of the layer's heads, as EAP-IG's code does for Gemma 2, and EAP takes the
gradient through that norm); multihead's pre-norm ``EncoderBlock``, and multihead attention modules that add straight
onto the residual stream (``x = x + attn(x)``: the course's small models). On the first run it is also checked that
each read point equals the embedding plus the writes before it, and that an attention module's output is the sum of
its heads' writes plus a constant; a model failing either is refused.

**Scores.** :func:`edge_attribution`: ``method="eap"`` scores every edge with one forward of each input and one
backward (Syed et al. 2023): the metric's gradient at the reader's input (in the base run) dotted with the writer's
change (source run - base run), summed over positions, averaged over the batch. ``method="eap-ig"`` (Hanna et al.
2024) averages the gradient over ``steps`` points on the straight line from the base run's embedding to the source
run's (alpha = 0, 1/steps, ..., (steps-1)/steps: ``steps=1`` is EAP). Gradients are kept only where read (the readers'
q/k/v, the MLPs' outputs and the final residual). ``direction="denoise"`` (default, TransformerLens' convention): the
base run is the corrupted input, so a score estimates how much patching that edge from the clean run moves the
metric; ``"noise"``: the clean run is the base (MIB's EAP). A gradient is only as good as the run it is taken at:
where the base run is sure of itself (a head giving one key all its weight, an answer of probability near 1) it
vanishes, and EAP scores the edges behind it (those setting a saturated head's key) near zero whatever patching them
does -- on the models the tests train, noising's 5% circuits keep 11-56% of the metric where circuits of that size
keep 98% or more; EAP-IG's points off the base run and denoising's base see them. :func:`patch_edges` computes a
patch exactly for chosen edges (batched: ``chunk`` edges a forward).
``method="atp*"`` (Kramár et al. 2024's AtP*): the edges into queries and keys scored with the softmax recomputed
exactly (right where a saturated head makes EAP's gradient vanish), and GradDrop against cancelling paths;
:func:`node_attribution` scores the nodes (heads, MLPs, the embedding) as the sums of their edges.

**Circuits at a budget.** A circuit is a set of edges on paths from the input to the logits: an edge whose writer no
kept edge reaches from the embedding, or whose reader feeds a head or MLP that reaches the logits through no kept edge,
joins nothing and does nothing but change what is patched. :meth:`EdgeScores.circuit` builds one three ways
(``how``, :data:`CONSTRUCTIONS`): ``"pruned"`` (the default, MIB's): the top n edges by |score| (n rounded down, as
MIB does), then the dangling ones removed until none is left; ``"greedy"`` (EAP-IG's ``apply_greedy``): grown from
the logits, each step the edge of largest |score| into a reader already in the circuit, then pruned the same way;
``"top"`` (what ``circuit`` returned before): the raw top n, dangling edges and all.

**Faithfulness.** :func:`faithfulness`: the clean run with every edge outside the circuit patched from the corrupted
run, ``f = (m(C) - m(empty)) / (m(N) - m(empty))``; :func:`faithfulness_curve` over MIB's budgets (0.1% ... 100% of
the edges), for the pruned and the greedy circuit, each with CPR (area under f) and CMD (area of |1 - f|), both by
the trapezoid rule over the budgets as fractions of the edges (MIB, Mueller et al. 2025).
"""

from __future__ import annotations

import contextlib
import heapq
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from multihead.heads.gates import attention_modules
from multihead.heads.patching import _call, _per_row, _repeat, _repeat_rows, _rows, _value

__all__ = ["CONSTRUCTIONS", "EDGE_METHODS", "MIB_BUDGETS", "CircuitCurve", "CircuitGraph", "EdgeScores", "Faithfulness",
           "FaithfulnessCurve", "NodeScores", "circuit_graph", "edge_attribution", "faithfulness", "faithfulness_curve",
           "node_attribution", "patch_edges"]

#: MIB's edge budgets, as fractions of the graph's edges (0.1% ... 100%)
MIB_BUDGETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
#: how :meth:`EdgeScores.circuit` builds a circuit from the scores: "pruned" (MIB's: the top n, dangling edges removed),
#: "greedy" (EAP-IG's: grown from the logits, then pruned), "top" (the raw top n)
CONSTRUCTIONS = ("pruned", "greedy", "top")
#: the scoring methods of :func:`edge_attribution` and :func:`node_attribution`
EDGE_METHODS = ("eap", "eap-ig", "atp*")

@dataclass(frozen=True)
class Block:
    """How a block class writes into the residual stream, by its submodules' attribute names: ``attn`` its
    self-attention (reading the block's input, through its own norm, which its forward applies); ``mlp`` its MLP;
    ``mlp_in`` the module whose input is the stream the MLP reads (its norm; the MLP itself where it reads the stream
    unnormalised); ``attn_post``/``mlp_post`` a norm between the attention's/MLP's output and the residual add (Gemma 2
    and 3, OLMo 2: the norm's output is what the block adds); ``parallel`` True, or the name of the block's boolean
    attribute saying so, where the MLP reads the block's input beside the attention (GPT-J, GPT-NeoX): no edge from a
    head to its own layer's MLP; ``mlp_via`` where the MLP reads the output of the attention's own norm (GPT-J's
    ``ln_1``): its input is rebuilt as that norm of the rebuilt stream."""

    attn: str
    mlp: str
    mlp_in: str
    attn_post: str | None = None
    mlp_post: str | None = None
    parallel: bool | str = False
    mlp_via: str | None = None


#: block classes the graph expresses: the block adds its attention's and MLP's outputs (or their post-norms' outputs)
#: to the stream; every reader's input is rebuilt through the block's own forward and norms.
BLOCKS = {
    "GPT2Block": Block("attn", "mlp", "ln_2"),
    "LlamaDecoderLayer": Block("self_attn", "mlp", "post_attention_layernorm"),
    "Qwen2DecoderLayer": Block("self_attn", "mlp", "post_attention_layernorm"),
    "Qwen3DecoderLayer": Block("self_attn", "mlp", "post_attention_layernorm"),
    "MistralDecoderLayer": Block("self_attn", "mlp", "post_attention_layernorm"),
    "Phi3DecoderLayer": Block("self_attn", "mlp", "post_attention_layernorm"),
    "GPTNeoXLayer": Block("attention", "mlp", "post_attention_layernorm", parallel="use_parallel_residual"),
    "GPTJBlock": Block("attn", "mlp", "mlp", parallel=True, mlp_via="ln_1"),
    "Gemma2DecoderLayer": Block("self_attn", "mlp", "pre_feedforward_layernorm", "post_attention_layernorm",
                                "post_feedforward_layernorm"),
    "Gemma3DecoderLayer": Block("self_attn", "mlp", "pre_feedforward_layernorm", "post_attention_layernorm",
                                "post_feedforward_layernorm"),
    "Olmo2DecoderLayer": Block("self_attn", "mlp", "mlp", "post_attention_layernorm", "post_feedforward_layernorm"),
    "EncoderBlock": Block("attn", "ffn", "norm2"),
}
#: blocks refused with the reason: {the class an attention module sits in: why the graph cannot express it}
REFUSED = {
    "BertAttention": "a post-norm encoder: LayerNorm(x + attention(x)) renormalises the whole stream after every add, "
                     "so no reader's input is the embedding plus the writers' writes and an edge has no one place to act",
    "RobertaAttention": "a post-norm encoder, as BERT's: the whole stream renormalised after every add",
}
#: where a transformers model's final norm sits, beside its stack of blocks
_FINAL_NORMS = ("ln_f", "norm", "final_layernorm", "final_layer_norm")


@dataclass(frozen=True)
class _Unit:
    """One attention layer of the stack: its module, the block whose input it reads (None: the module's own input),
    the block's MLP, the module whose input the MLP reads, the module whose output is the MLP's write (the MLP or its
    post-norm), the attention's post-norm (None: the attention's output is its write), whether the MLP reads the
    block's input beside the attention (parallel), and the norm the MLP reads through (GPT-J's shared ``ln_1``)."""

    attn: str
    block: str | None
    mlp: str | None
    mlp_norm: str | None
    mlp_out: str | None = None
    attn_post: str | None = None
    parallel: bool = False
    mlp_via: str | None = None


@dataclass
class CircuitGraph:
    """The edges of a model: ``writers`` and ``readers`` (node names, in the stream's order) and ``edges`` (writer,
    reader) pairs, every writer to every later reader. Names: ``"embed"``; ``"{module}.h{h}"`` a head's output;
    ``"{module}.q{h}"``, ``"{module}.k{g}"``, ``"{module}.v{g}"`` a head's query input and a key/value head's key and
    value inputs (g < Hkv); ``"{mlp}"`` an MLP's output and ``"{mlp}.in"`` its input; ``"logits"``."""

    writers: list[str]
    readers: list[str]
    edges: list[tuple[str, str]]
    units: list[_Unit]
    readout: str
    sizes: dict[str, tuple[int, int]]  # {module: (H, Hkv)}; (H, H) where ungrouped
    ungrouped: bool = False  # one key and one value reader per query head (MIB's graph), not per key/value head
    width: int = 0  # E, the residual stream's width

    def index(self, edges: Sequence[tuple[str, str]]) -> Tensor:
        """The positions of ``edges`` in :attr:`edges` (refused by name when one is not in the graph)."""
        where = self._where()
        out = []
        for e in edges:
            e = (e[0], e[1])
            if e not in where:
                raise ValueError(f"edge {e!r} is not in the graph (a writer to a later reader); e.g. {self.edges[0]!r}.")
            out.append(where[e])
        return torch.tensor(out, dtype=torch.long)

    def _where(self) -> dict[tuple[str, str], int]:
        if getattr(self, "_cache", None) is None:
            self._cache = {e: i for i, e in enumerate(self.edges)}
        return self._cache

    def matrix(self) -> tuple[Tensor, Tensor]:
        """(writer index, reader index) of every edge, (n_edges,) each."""
        w = {n: i for i, n in enumerate(self.writers)}
        r = {n: i for i, n in enumerate(self.readers)}
        return (torch.tensor([w[a] for a, _ in self.edges], dtype=torch.long),
                torch.tensor([r[b] for _, b in self.edges], dtype=torch.long))


@dataclass
class EdgeScores:
    """Scores of a graph's edges: ``scores`` (n_edges,) float64 in :attr:`CircuitGraph.edges` order (for
    :func:`patch_edges`: only ``edges``, the chosen ones); ``base``/``source`` the metric of the base and source runs;
    ``method`` "eap", "eap-ig" or "exact"; ``direction`` as :func:`edge_attribution`."""

    graph: CircuitGraph
    edges: list[tuple[str, str]]
    scores: Tensor
    base: float
    source: float
    method: str
    direction: str
    steps: int = 1
    graddrop: bool = False  # AtP*'s GradDrop: the scores are magnitudes (>= 0), see edge_attribution

    def top(self, n: int = 10) -> list[tuple[str, str, float]]:
        """The ``n`` edges of largest |score|, strongest first: (writer, reader, score)."""
        order = self.scores.abs().argsort(descending=True, stable=True)[:n]
        return [(*self.edges[i], float(self.scores[i])) for i in order.tolist()]

    def circuit(self, budget: float | str | None = None, *, top: int | None = None, threshold: float | None = None,
                how: str = "pruned") -> list[tuple[str, str]]:
        """The circuit kept, (writer, reader) pairs strongest first. One of ``budget`` (a share of the edges scored: a
        fraction in (0, 1] or "5%"), ``top`` (a number of edges, >= 1) or ``threshold`` (a |score|) sets how many;
        ``how`` (:data:`CONSTRUCTIONS`) how they are chosen:

        - ``"pruned"`` (the default: what a user of MIB expects, and what MIB scores): the top n by |score| (n =
          floor(budget x edges), rounded down as MIB does: 0 edges below one; or ``top``; or every edge with |score|
          >= ``threshold``), then every edge not on a path from the input to the logits removed -- a writer that no
          kept edge reaches from the embedding, a reader whose head (any head of a key/value group) or MLP reaches
          the logits through no kept edge -- until none dangles. At most n edges.
        - ``"greedy"`` (EAP-IG's ``apply_greedy``): from the logits, n times the edge of largest |score| among those
          into a reader already in the circuit (the logits; a head's q/k/v or an MLP's input once its output is in),
          then pruned as above (a writer reached from the logits but from no kept path from the input goes). At most
          n edges (floor, as "pruned"), every one connected to the logits. Not with ``threshold``.
        - ``"top"`` (what ``circuit`` returned before the other two): the top ceil(budget x edges) by |score| (at least
          one), the ``top`` n, or every edge over ``threshold``, as they are: edges that join nothing stay.

        Bad input (an unknown ``how``, a budget outside (0, 1], a count below 1) raises ValueError naming the
        argument."""
        how = _how(how)
        given = [x is not None for x in (budget, top, threshold)]
        if sum(given) != 1:
            raise ValueError("circuit takes one of budget= (a fraction of the edges), top= (a number of edges) or "
                             f"threshold= (a |score|); got budget={budget!r}, top={top!r}, threshold={threshold!r}.")
        if top is not None and (isinstance(top, bool) or not isinstance(top, int) or top < 1):
            raise ValueError(f"top must be a whole number of edges >= 1; got {top!r} (for a share of the edges pass "
                             "budget=, e.g. 0.05 or '5%').")
        if threshold is not None and how == "greedy":
            raise ValueError("how='greedy' grows a circuit to a number of edges: pass budget= or top=, not threshold= "
                             "(or how='pruned' for the edges over a threshold).")
        n, mag = len(self.edges), self.scores.abs()
        order = mag.argsort(descending=True, stable=True)  # strongest first; ties: the earlier edge
        if budget is not None:
            frac = _budget(budget, "budget")
            top = _count(frac, n) if how == "top" else int(frac * n)  # MIB's count: int(pct * n_edges)
        pos = self._positions() if how != "top" else None
        if threshold is not None:
            chosen = mag >= threshold
        elif how == "greedy":
            chosen = _greedy(self.graph, pos, mag, top)
        else:
            chosen = torch.zeros(n, dtype=torch.bool)
            chosen[order[:top]] = True
        if how != "top":
            chosen = _on_paths(self.graph, pos, chosen)
        return [self.edges[i] for i in order[chosen[order]].tolist()]

    def _positions(self) -> Tensor:
        """(n,) the scored edges' positions in the graph's edges."""
        if self.edges == self.graph.edges:
            return torch.arange(len(self.edges))
        return self.graph.index(self.edges)

    def to_markdown(self, n: int = 20) -> str:
        """The top ``n`` edges as a table."""
        lines = ["| writer | reader | score |", "|---|---|---:|"]
        lines += [f"| {w} | {r} | {s:.4g} |" for w, r, s in self.top(n)]
        return "\n".join(lines)


@dataclass
class NodeScores:
    """Scores of a graph's nodes, its writers (:func:`node_attribution`): ``nodes`` ("embed", each head's output
    ``"{module}.h{h}"``, each MLP), ``scores`` (n,) float64 in that order: the metric's change estimated for patching
    that node alone from the source run (its output at every position), or with ``graddrop`` its magnitude;
    ``base``/``source``, ``method``, ``direction`` as :class:`EdgeScores`."""

    graph: CircuitGraph
    nodes: list[str]
    scores: Tensor
    base: float
    source: float
    method: str
    direction: str
    graddrop: bool = False

    def top(self, n: int = 10) -> list[tuple[str, float]]:
        """The ``n`` nodes of largest |score|, strongest first: (node, score)."""
        order = self.scores.abs().argsort(descending=True, stable=True)[:n]
        return [(self.nodes[i], float(self.scores[i])) for i in order.tolist()]

    def heads(self) -> dict[str, Tensor]:
        """{attention module: (H,) its heads' scores}, the layout of :class:`~multihead.heads.Patching`'s values."""
        at = {n: i for i, n in enumerate(self.nodes)}
        return {u.attn: self.scores[[at[f"{u.attn}.h{h}"] for h in range(self.graph.sizes[u.attn][0])]]
                for u in self.graph.units}

    def to_markdown(self, n: int = 20) -> str:
        """The top ``n`` nodes as a table."""
        return "\n".join(["| node | score |", "|---|---:|"] + [f"| {w} | {v:.4g} |" for w, v in self.top(n)])


@dataclass
class Faithfulness:
    """f = (m(C) - m(empty)) / (m(N) - m(empty)) of one circuit: ``circuit`` m(C) (the clean run, every other edge
    patched from the corrupted run), ``full`` m(N) (the clean run), ``empty`` m(empty) (the corrupted run: every edge
    patched); ``kept`` edges of ``total``."""

    f: float
    circuit: float
    full: float
    empty: float
    kept: int
    total: int


@dataclass
class CircuitCurve:
    """One construction's faithfulness over the budgets (``how``: see :meth:`EdgeScores.circuit`): ``kept`` edges and
    ``f`` at each budget, CPR = area under f and CMD = area of |1 - f| (trapezoid rule over the budgets as
    fractions)."""

    how: str
    kept: list[int]
    f: list[float]
    cpr: float
    cmd: float


@dataclass
class FaithfulnessCurve:
    """f at each budget (fractions of the edges) for each construction of the circuit asked (``curves``, by name, in
    the order asked: by default MIB's pruned top n, then EAP-IG's greedy circuit), with m(N) ``full`` and m(empty)
    ``empty``. ``kept``, ``f``, ``cpr``, ``cmd`` and ``how`` are the first construction's; ``curve["greedy"]`` is
    another's (:class:`CircuitCurve`)."""

    budgets: list[float]
    full: float
    empty: float
    curves: dict[str, CircuitCurve]

    def __getitem__(self, how: str) -> CircuitCurve:
        if how not in self.curves:
            raise KeyError(f"no {how!r} curve: this one holds {', '.join(self.curves)} (faithfulness_curve's how=).")
        return self.curves[how]

    @property
    def how(self) -> str:
        return next(iter(self.curves))

    @property
    def kept(self) -> list[int]:
        return self.curves[self.how].kept

    @property
    def f(self) -> list[float]:
        return self.curves[self.how].f

    @property
    def cpr(self) -> float:
        return self.curves[self.how].cpr

    @property
    def cmd(self) -> float:
        return self.curves[self.how].cmd

    def to_markdown(self) -> str:
        cs = list(self.curves.values())
        lines = ["| budget | " + " | ".join(f"{c.how} edges | {c.how} f" for c in cs) + " |",
                 "|---:|" + "---:|---:|" * len(cs)]
        for i, b in enumerate(self.budgets):
            lines.append(f"| {b:.1%} | " + " | ".join(f"{c.kept[i]} | {c.f[i]:.4f}" for c in cs) + " |")
        areas = "; ".join(f"{c.how}: CPR {c.cpr:.4f}, CMD {c.cmd:.4f}" for c in cs)
        return "\n".join(lines) + f"\n\n{areas} (CPR higher better, CMD 0 best)"


def _budget(b, name: str = "budgets") -> float:
    """A budget as a fraction in (0, 1]: a number, or a string "5%"; ``name`` the argument it came from."""
    v = b
    if isinstance(b, str):
        try:
            v = float(b.strip().rstrip("%")) / 100 if b.strip().endswith("%") else float(b)
        except ValueError:
            v = None
    if isinstance(v, bool) or not isinstance(v, int | float) or not 0 < v <= 1:
        count = (f"; for {int(v)} edges pass top={int(v)}" if name == "budget" and isinstance(v, int | float) and v > 1
                 and float(v).is_integer() else "")
        raise ValueError(f"{name}: an edge budget must be in (0, 100%] of the edges (a fraction such as 0.05, or '5%'); "
                         f"got {b!r}{count}.")
    return float(v)


def _count(frac: float, n: int) -> int:
    return max(1, min(n, math.ceil(frac * n - 1e-9)))


def _how(how) -> str:
    """A construction's name, checked (:data:`CONSTRUCTIONS`)."""
    if not isinstance(how, str) or how not in CONSTRUCTIONS:
        raise ValueError(f"how must be 'pruned' (MIB's: the top n, edges on no input-to-logits path removed), 'greedy' "
                         f"(EAP-IG's: grown from the logits) or 'top' (the raw top n); got {how!r}.")
    return how


def _node_inputs(graph: CircuitGraph) -> list[list[int]]:
    """Per writer (in :attr:`CircuitGraph.writers` order), the readers that feed it: head h's query and its key/value
    head's key and value (query head h reads key/value head h // (H / Hkv)); an MLP's input; none for the embedding."""
    at = {r: i for i, r in enumerate(graph.readers)}
    feeds: dict[str, list[int]] = {}
    for u in graph.units:
        H, Hkv = graph.sizes[u.attn]
        for h in range(H):
            g = h // (H // Hkv)
            feeds[f"{u.attn}.h{h}"] = [at[f"{u.attn}.q{h}"], at[f"{u.attn}.k{g}"], at[f"{u.attn}.v{g}"]]
        if u.mlp is not None:
            feeds[u.mlp] = [at[f"{u.mlp}.in"]]
    return [feeds.get(w, []) for w in graph.writers]


def _on_paths(graph: CircuitGraph, pos: Tensor, chosen: Tensor) -> Tensor:
    """(n,) bool: the ``chosen`` edges (n,) bool, of the edges at graph positions ``pos`` (n,), that lie on a path from
    the input to the logits through chosen edges (MIB's and EAP-IG's pruning, to the fixed point at once): the writer
    reached from the embedding, the reader's node (its head, a head of its key/value group, its MLP; the logits)
    reaching the logits. Writers come in the stream's order and every edge runs to a later node, so one pass each way
    settles both."""
    w_all, r_all = graph.matrix()
    w, r = w_all[pos[chosen]], r_all[pos[chosen]]
    U, R = len(graph.writers), len(graph.readers)
    adj = torch.zeros(U, R, dtype=torch.bool)  # (U, R): the chosen edges
    adj[w, r] = True
    feeds = _node_inputs(graph)
    reached = torch.zeros(U, dtype=torch.bool)  # (U,): writers a chosen path from the embedding reaches
    reached[0] = True
    for u in range(1, U):
        reached[u] = bool((adj[:, feeds[u]].any(1) & reached).any())
    alive = torch.zeros(R, dtype=torch.bool)  # (R,): readers whose node reaches the logits by chosen edges
    alive[graph.readers.index("logits")] = True
    for u in range(U - 1, -1, -1):
        if bool((adj[u] & alive).any()):
            alive[feeds[u]] = True
    out = chosen.clone()
    out[chosen] = reached[w] & alive[r]
    return out


def _greedy(graph: CircuitGraph, pos: Tensor, mag: Tensor, n: int) -> Tensor:
    """(len(pos),) bool: EAP-IG's greedy circuit of ``n`` edges (before pruning), by |score| ``mag`` (n_edges,): start
    at the logits; each step adds the strongest edge into a reader already in the circuit (ties: the earlier edge),
    and a writer added opens the edges into its own readers."""
    w_all, r_all = graph.matrix()
    w, r = w_all[pos].tolist(), r_all[pos].tolist()
    into: dict[int, list[int]] = {}  # reader -> the edges into it
    for p, reader in enumerate(r):
        into.setdefault(reader, []).append(p)
    feeds, m = _node_inputs(graph), mag.tolist()
    frontier: list[tuple[float, int]] = []  # (-|score|, edge): the edges into the circuit's readers, not yet taken
    opened: set[int] = set()

    def open_readers(readers):
        for reader in readers:
            if reader not in opened:
                opened.add(reader)
                for p in into.get(reader, ()):
                    heapq.heappush(frontier, (-m[p], p))

    open_readers([graph.readers.index("logits")])
    keep = torch.zeros(len(pos), dtype=torch.bool)
    joined: set[int] = set()
    for _ in range(n):
        if not frontier:
            break
        _, p = heapq.heappop(frontier)
        keep[p] = True
        if w[p] not in joined:
            joined.add(w[p])
            open_readers(feeds[w[p]])
    return keep


# ----------------------------------------------------------------------------------------------- the model's layout


def _units(model: nn.Module, readout: str | None) -> tuple[list[_Unit], str, dict[str, nn.Module]]:
    """The stack's attention layers (with their blocks) and the readout, from the module tree: refused by name where
    a module kind is one the graph cannot express. No forward runs."""
    mods = attention_modules(model)
    if not mods:
        raise ValueError("the model has no attention module multihead sees: attach it (multihead.hf.attach) or "
                         "observe it (heads.observe) first.")
    named = dict(model.named_modules())
    units, stacks = [], set()
    for n, m in mods.items():
        parent_name = n.rsplit(".", 1)[0] if "." in n else ""
        parent = named[parent_name]
        kind = type(parent).__name__
        if kind in BLOCKS:
            units.append(_block_unit(n, m, parent_name, parent))
            stacks.add(parent_name.rsplit(".", 1)[0] if "." in parent_name else "")
        elif type(m).__name__ == "MultiHeadAttention" and (isinstance(parent, nn.ModuleList) or parent is model):
            units.append(_Unit(n, None, None, None))
        elif kind in REFUSED:
            raise ValueError(f"{n} sits in a {kind}, {REFUSED[kind]}: the circuit graph cannot express it.")
        else:
            raise ValueError(f"{n} sits in a {kind}, a block the circuit graph cannot express (it expresses "
                             f"{', '.join(sorted(BLOCKS))}, and multihead attention modules adding straight onto the "
                             "residual stream).")
    if readout is None:
        readout = _readout(model, named, units, stacks)
    if readout not in named:
        raise ValueError(f"readout {readout!r} is not a module of the model (the module whose input is the final "
                         "residual stream: the final norm, or the unembedding).")
    return units, readout, mods


def _block_unit(n: str, m: nn.Module, parent_name: str, parent: nn.Module) -> _Unit:
    """The unit of attention module ``n`` in a block of a class :data:`BLOCKS` lists, its submodules checked."""
    kind = type(parent).__name__
    b = BLOCKS[kind]
    if getattr(parent, b.attn, None) is not m:
        raise ValueError(f"{n} is a {type(m).__name__} in a {kind} other than its self-attention (cross-"
                         "attention reads another stream): the circuit graph cannot express it.")
    parallel = b.parallel if isinstance(b.parallel, bool) else getattr(parent, b.parallel, None)
    if not isinstance(parallel, bool):
        raise ValueError(f"{parent_name} is a {kind} without a boolean {b.parallel!r} (whether its MLP reads the "
                         "block's input beside the attention): the circuit graph cannot tell how it reads the stream.")
    for a in (b.mlp, b.mlp_in, b.attn_post, b.mlp_post, b.mlp_via):
        if a is not None and not isinstance(getattr(parent, a, None), nn.Module):
            raise ValueError(f"{parent_name} is a {kind} without its {a!r} module: the circuit graph cannot express "
                             "how it writes into the stream.")
    pre = f"{parent_name}." if parent_name else ""
    return _Unit(n, parent_name, pre + b.mlp, pre + b.mlp_in, pre + (b.mlp_post or b.mlp),
                 pre + b.attn_post if b.attn_post else None, parallel, pre + b.mlp_via if b.mlp_via else None)


def _readout(model, named, units, stacks) -> str:
    for s in stacks:  # a transformers stack: its final norm beside the blocks
        base = s.rsplit(".", 1)[0] if "." in s else ""
        for a in _FINAL_NORMS:
            if isinstance(getattr(named[base], a, None), nn.Module):
                return f"{base}.{a}" if base else a
    # a model of its own: the last child registered after the attention modules' container, not an embedding
    first = units[0].block or units[0].attn
    top = first.split(".")[0]
    children = list(model.named_children())
    after = [c for c, mod in children[[c for c, _ in children].index(top) + 1:] if not isinstance(mod, nn.Embedding)]
    if len(after) != 1:
        raise ValueError("cannot tell which module reads the final residual stream (children after the attention "
                         f"layers: {after}); pass readout='NAME' (the final norm, or the unembedding).")
    return after[0]


# ----------------------------------------------------------------------------------------------------- the runs


class _Stop(Exception):  # noqa: N818 - not an error: ends a nested call once its q, k, v are recorded
    pass


class _Run:
    """One forward with every hook the graph needs: records the read points, the writers' writes (in the residual
    stream: a head's output through its rows of the output projection) and, for a gradient run, the readers' q/k/v;
    with ``patched`` (c, U, R) bool, it rebuilds each reader's input with the marked writers' writes taken from
    ``rep`` (c copies of the base input, batch c B)."""

    def __init__(self, model, units, readout, mods, *, c=1, B=None, patched=None, rep=None, interp=None,
                 grad=False, W=None, ungroup=False, drop=None, atp=None):
        self.model, self.units, self.readout, self.mods, self.grad = model, units, readout, mods, grad
        self.ungroup, self.drop, self.atp = ungroup, drop, atp  # GradDrop's layer; AtP*'s q/k pass (_AtP)
        self.swap: int | None = None  # AtP*: a nested call's writers (rows: q rebuilt n, k rebuilt n, the base run)
        self.named = dict(model.named_modules())
        self.c, self.B, self.patched, self.rep, self.interp = c, B, patched, rep, interp
        self.x: dict = {}  # ("attn", l) / ("mlp", l) / "readout" -> the residual stream read there
        self.writes: list[Tensor] = []  # live writes, (c B, L, E) each, in writer order
        self.deltas: list[Tensor] = []  # live - replacement, (c, B, L, E) each (interventions)
        self.qkv: dict[int, tuple] = {}
        self.out: dict[int, Tensor] = {}  # per-head outputs (c B, L, H, Dv)
        self.y: dict[int, Tensor] = {}  # attention modules' outputs (c B, L, E)
        self.mlp_y: dict[int, Tensor] = {}
        self.order: list[int] = []
        self.sizes: dict[int, tuple[int, int]] = {}
        self.W: dict[int, Tensor] = {} if W is None else W  # (H, Dv, E): head h's rows of the output projection
        self.proj: dict[int, list] = {}  # gradient runs: unit -> [(weight (out, in), input, output)] of q/k/v's layers
        self.nested: int | None = None
        self.emb: dict[str, Tensor] = {}  # token embeddings' outputs (a stream that starts outside any block)
        self.call_args: dict[int, tuple] = {}
        self.r0: dict[int, int] = {}  # unit -> its first reader's index
        self.rmlp: dict[int, int] = {}
        self.hw0: dict[int, int] = {}  # unit -> its first head's writer index
        self.post_in: dict[int, Tensor] = {}  # units with a norm after the attention: its input, (c B, L, E)
        self.post_out: dict[int, Tensor] = {}  # ... and its output, the layer's write into the stream

    # the writers and readers' indices follow the stream's order; sizes come from the call itself
    def _add_writes(self, w: Tensor) -> None:
        for t in w:  # w (n, c B, L, E)
            self.writes.append(t)
            if self.patched is not None:
                u = len(self.writes) - 1
                self.deltas.append((t - self.rep[u].to(t).repeat(self.c, 1, 1)).view(self.c, self.B, *t.shape[1:]))

    def _delta(self, readers: list[int]) -> Tensor | None:
        """(len(readers), c B, L, E): what each reader's input loses (live - replacement of its patched writers), or
        None where no copy patches any of them."""
        if self.patched is None or not self.deltas:
            return None
        U = len(self.deltas)
        mask = self.patched[:, :U][:, :, readers].to(self.deltas[0])  # (c, U, R), on the stream's device
        if not mask.any():
            return None
        D = torch.stack(self.deltas)  # (U, c, B, L, E)
        posts = [(j, self.hw0[j], self.sizes[j][0]) for j in self.post_out]
        linear = mask.clone()
        for _, a, H in posts:  # heads whose sum is normalised before the add: not a sum of their changes
            linear[:, a:a + H] = 0
        d = torch.einsum("pur,upble->rpble", linear, D)  # (R, c, B, L, E)
        for j, a, H in posts:
            d = d + self._through_post(j, mask[:, a:a + H], D[a:a + H])
        return d.reshape(len(readers), self.c * self.B, *d.shape[3:])  # (R, c, B, L, E) -> (R, c B, L, E)

    def _through_post(self, j: int, mask: Tensor, D: Tensor) -> Tensor:
        """(R, c, B, L, E): what each reader's input loses where unit j's patched heads (mask (c, H, R), their changes
        D (H, c, B, L, E)) are replaced before the norm after the attention: the norm's live output less the norm of
        the attention's output with those heads' writes replaced (exact: the norm runs on each reader's own sum)."""
        ds = torch.einsum("phr,hpble->rpble", mask, D)  # (R, c, B, L, E): the patched heads' live - replacement
        out = torch.zeros_like(ds)
        hit = mask.any(0).any(0)  # (R,): readers that patch one of these heads
        if hit.any():
            y = self.post_in[j].view(self.c, self.B, *ds.shape[3:])  # (c B, L, E) -> (c, B, L, E)
            live = self.post_out[j].view(self.c, self.B, *ds.shape[3:])
            norm = self.named[self.units[j].attn_post]
            out[hit] = live - norm.forward(y - ds[hit])  # forward, not __call__: no hook sees this
        return out

    def install(self, stack: contextlib.ExitStack) -> None:
        for i, u in enumerate(self.units):
            mod = self.mods[u.attn]
            unit = self.named[u.block] if u.block is not None else mod
            stack.callback(unit.register_forward_pre_hook(self._pre(i), with_kwargs=True).remove)
            stack.callback(mod.attention_hooks.add_input(self._inputs(i)).remove)
            stack.callback(mod.attention_hooks.add_transform(self._heads(i)).remove)
            stack.callback(mod.register_forward_hook(self._attn_out(i)).remove)
            for p in _qkv_layers(mod) if self.grad else ():
                stack.callback(p.register_forward_hook(self._proj(i, p)).remove)
            if u.attn_post is not None:
                stack.callback(self.named[u.attn_post].register_forward_hook(self._post(i)).remove)
            if u.mlp is not None:
                stack.callback(self.named[u.mlp_norm].register_forward_pre_hook(self._read(("mlp", i))).remove)
                stack.callback(self.named[u.mlp_out].register_forward_hook(self._mlp_out(i)).remove)
            if self.drop == i:  # GradDrop: the layer's writes reach the stream without a gradient back through them
                writes = [u.attn_post or u.attn] + ([u.mlp_out] if u.mlp is not None else [])
                for name in writes:  # registered after the recording hooks: they see the live output
                    stack.callback(self.named[name].register_forward_hook(_detached).remove)
        stack.callback(self.named[self.readout].register_forward_pre_hook(self._read("readout")).remove)
        if self.units[0].block is None:  # the stream starts outside any module: at the token embeddings
            for n, e in self.named.items():
                if isinstance(e, nn.Embedding):
                    stack.callback(e.register_forward_hook(self._embedding(n)).remove)

    def _embedding(self, name):
        def hook(module, args, output):
            if self.nested is not None or self.order:
                return None
            self.emb[name] = output.detach()
            if self.interp is not None:  # EAP-IG: on the line between the base and the source run's embeddings
                e0, e1 = self.interp["emb"][name]
                return (e0 + self.interp["a"] * (e1 - e0)).requires_grad_(True)
            if self.grad:
                return output.detach().requires_grad_(True)
            return None
        return hook

    def _pre(self, i):
        def hook(module, args, kwargs):
            if self.nested is not None:
                return None
            if i in self.order:
                raise ValueError(f"{self.units[i].attn} is called more than once in one forward (a layer shared "
                                 "across the stack, or a loop): the circuit graph takes each layer's one call.")
            self.order.append(i)
            x = args[0] if args else kwargs.get("hidden_states")
            if not isinstance(x, Tensor) or x.dim() != 3:
                raise ValueError(f"{self.units[i].block or self.units[i].attn}: its input is not the residual stream "
                                 f"(B, L, E); got {type(x).__name__}.")
            if self.units[i].block is None:
                rest = list(args[1:3]) + [kwargs.get("keys"), kwargs.get("values")]
                if any(isinstance(r, Tensor) and r is not x for r in rest):
                    raise ValueError(f"{self.units[i].attn} is called with keys or values other than its queries "
                                     "(cross-attention reads another stream): the circuit graph cannot express it.")
            new = None
            if i == 0 and self.units[0].block is not None and self.interp is not None:
                a, (x0, x1) = self.interp["a"], self.interp["x0"]  # EAP-IG: the block's input (its residual with it)
                new = (x0.to(x) + a * (x1.to(x) - x0.to(x))).requires_grad_(True)
            elif i == 0 and self.units[0].block is not None and self.grad:  # the graph starts here
                new = x.detach().requires_grad_(True)
            if new is not None:
                x = new
                args, kwargs = ((x, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": x})
            self.x[("attn", i)] = x
            if i == 0:
                self._add_writes(x.unsqueeze(0))  # the input embedding's write: the stream where it is first read
            self.call_args[i] = (args, kwargs)
            return (args, kwargs) if new is not None else None
        return hook

    def _inputs(self, i):
        def hook(module, q: Tensor, k: Tensor, v: Tensor):
            if self.ungroup and k.shape[1] != q.shape[1]:  # MIB's graph: a key and a value reader per query head
                rep = q.shape[1] // k.shape[1]  # query head h reads key/value head h // rep
                k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)  # (B, Hkv, L, D) -> (B, H, L, D)
            if self.nested is not None:
                if self.nested == i and self.swap is not None:  # AtP*: q alone, then k alone, from the rebuilt rows
                    n, cB = self.swap, q.shape[0] // (2 * self.swap + 1)
                    base = slice(2 * n * cB, None)  # the last cB rows: the base run's stream

                    def rep(t):  # (cB, h, L, D) -> (n cB, h, L, D)
                        return t[base].repeat(n, 1, 1, 1)
                    return (torch.cat([q[:n * cB], rep(q), q[base]]), torch.cat([rep(k), k[n * cB:]]),
                            torch.cat([rep(v), rep(v), v[base]]))
                if self.nested == i:
                    self.got = (q, k, v)
                    raise _Stop
                return q, k, v
            H, Hkv = q.shape[1], k.shape[1]
            self.sizes[i] = (H, Hkv)
            self.r0[i] = sum(s[0] + 2 * s[1] + (self.units[j].mlp is not None) for j, s in self.sizes.items() if j < i)
            readers = list(range(self.r0[i], self.r0[i] + H + 2 * Hkv))
            d = self._delta(readers)
            if d is not None:
                q, k, v = self._rebuilt(i, q, k, v, readers, d)
            self.qkv[i] = (q, k, v)
            if self.atp is not None:
                self.atp.unit(self, i)
            return q, k, v
        return hook

    def _rebuilt(self, i, q, k, v, readers, d):
        """q, k, v with each patched reader's slice recomputed from its rebuilt input (the unit's own forward on the
        stream minus that reader's delta; the nested call ends once q, k, v are known)."""
        H, Hkv = self.sizes[i]
        need = [j for j in range(len(readers)) if d[j].abs().amax() > 0]
        if not need:
            return q, k, v
        x = self.x[("attn", i)]
        cB = x.shape[0]
        qn, kn, vn = self.nested_call(i, torch.cat([x - d[j].to(x) for j in need]))  # (n c B, L, E)
        q, k, v = q.clone(), k.clone(), v.clone()
        for t, j in enumerate(need):
            rows = slice(t * cB, (t + 1) * cB)
            if j < H:
                q[:, j] = qn[rows, j]  # (c B, Lq, D): head j's query
            elif j < H + Hkv:
                k[:, j - H] = kn[rows, j - H]  # (c B, Lk, D): key/value head j - H's key
            else:
                v[:, j - H - Hkv] = vn[rows, j - H - Hkv]
        return q, k, v

    def nested_call(self, i: int, xs: Tensor, swap: int | None = None):
        """Unit i's own forward on the streams ``xs`` ((n c B, L, E): n copies of the call's rows), ended once its
        q, k, v are known (or, with ``swap``, AtP*'s rows: once its heads' outputs are); returns what was caught."""
        x = self.x[("attn", i)]
        n, cB = xs.shape[0] // x.shape[0], x.shape[0]
        args, kwargs = self.call_args[i]
        args, kwargs = _no_cache(_repeat_rows(args[1:], n, cB)), _no_cache(_repeat_rows(kwargs, n, cB))
        u = self.units[i]
        unit = self.named[u.block] if u.block is not None else self.mods[u.attn]
        self.nested, self.swap = i, swap
        try:
            if "hidden_states" in kwargs and not args:
                unit(**{**kwargs, "hidden_states": xs})
            else:
                unit(xs, *args, **{k_: w for k_, w in kwargs.items() if k_ != "hidden_states"})
            raise RuntimeError(f"{u.attn}: its forward did not reach the attention call")
        except _Stop:
            pass
        finally:
            self.nested, self.swap = None, None
        return self.got

    def _heads(self, i):
        def transform(module, out: Tensor, live) -> Tensor:
            if self.nested is not None:
                if self.nested == i and self.swap is not None:
                    self.got = out
                    raise _Stop
                return out
            if out.dim() != 4:
                raise ValueError(f"{self.units[i].attn}: its heads' output is packed ({tuple(out.shape)}, padding-"
                                 "free); the circuit graph takes a padded batch: turn packing off "
                                 "(multihead.hf.attach(..., packed=False)).")
            self.out[i] = out
            return out
        return transform

    def _attn_out(self, i):
        def hook(module, args, output):
            if self.nested is not None:
                return None
            y = output[0] if isinstance(output, tuple | list) else output
            self.y[i] = y
            out = self.out[i]  # (c B, L, H, Dv)
            W = self.W.get(i)
            if W is None:  # checked on the call's first run, then kept in the stream's dtype
                W = self.W[i] = _o_weight(self.units[i].attn, module, out, y).to(y.dtype)
            self.hw0[i] = len(self.writes)
            with torch.no_grad():  # the writes are read, never differentiated
                self._add_writes(torch.einsum("blhd,hde->hble", out.detach().to(W.dtype), W))  # (H, c B, L, E)
            return None
        return hook

    def _post(self, i):
        def hook(module, args, output):
            if self.nested is None:
                if not isinstance(output, Tensor) or args[0] is not self.y[i]:
                    raise ValueError(f"{self.units[i].attn_post} does not take {self.units[i].attn}'s output to a "
                                     "tensor: the circuit graph cannot express the norm after the attention.")
                self.post_in[i], self.post_out[i] = args[0], output
            return None
        return hook

    def _proj(self, i, layer):
        def hook(module, args, output):
            if self.nested is None and isinstance(output, Tensor) and args and isinstance(args[0], Tensor):
                from multihead.heads.surgery import out_in

                self.proj.setdefault(i, []).append((out_in(layer).detach(), args[0], output))
            return None
        return hook

    def _read(self, key):
        def hook(module, args):
            if self.nested is not None:
                return None
            x = args[0]
            if key == "readout":
                readers = [sum(s[0] + 2 * s[1] + (self.units[j].mlp is not None) for j, s in self.sizes.items())]
            else:
                i = key[1]
                self.rmlp[i] = self.r0[i] + sum(self.sizes[i]) + self.sizes[i][1]
                readers = [self.rmlp[i]]
            via = None
            if key != "readout" and self.units[key[1]].mlp_via is not None:  # the MLP reads the attention's norm
                x, via = self.x[("attn", key[1])], self.named[self.units[key[1]].mlp_via]
            self.x[key] = x
            d = self._delta(readers)
            if d is None:
                return None
            x = x - d[0].to(x)  # the rebuilt stream
            return (x if via is None else via.forward(x), *args[1:])
        return hook

    def _mlp_out(self, i):
        def hook(module, args, output):
            if self.nested is not None:
                return None
            if not isinstance(output, Tensor):
                raise ValueError(f"{self.units[i].mlp} returns {type(output).__name__}, not the tensor it writes into "
                                 "the residual stream: the circuit graph cannot express it.")
            self.mlp_y[i] = output
            self._add_writes(output.unsqueeze(0))
            return None
        return hook


def _qkv_layers(mod: nn.Module) -> list[nn.Module]:
    """The attention module's q/k/v projection layers (one fused layer counted once), from its head layout; none
    where it has no layout (the readers' gradients then take the general route)."""
    hooks = mod.__dict__.get("attention_hooks")
    lay = _layout(mod)
    if lay is not None:
        ps = lay.projections(mod, hooks.parent)[:3]
    elif hasattr(mod, "projections"):
        ps = mod.projections()[:3]
    else:
        return []
    out: list[nn.Module] = []
    for p in ps:
        if isinstance(p, nn.Module) and isinstance(getattr(p, "weight", None), Tensor) and p.weight.dim() == 2 \
                and all(p is not q for q in out):
            out.append(p)
    return out


def _layout(mod: nn.Module):
    """The module's head layout: the verified one (attach's: cuts are exact), else the first its projections allow on
    its last call (Phi-3's fused qkv_proj, OLMo 2's: a cut there does not verify, their query/key norms being sized
    for every head, but which rows of the projections hold head h is what the graph needs, and the heads' writes are
    checked on the call: :func:`_o_weight`); None where there is none."""
    from multihead.heads.layouts import candidates

    hooks = mod.__dict__.get("attention_hooks")
    if hooks is None:
        return None
    if hooks.layout is not None or hooks.seen is None or hooks.parent is None:
        return hooks.layout
    lays = candidates(mod, "", hooks.parent, "", hooks.seen)
    return None if isinstance(lays, str) or not lays else lays[0]


def _no_cache(x):
    """``x`` with every transformers ``Cache`` (a key/value cache) replaced by None: a nested call must not touch it."""
    if isinstance(x, tuple | list):
        return type(x)(_no_cache(v) for v in x)
    if isinstance(x, dict):
        return {k: _no_cache(v) for k, v in x.items()}
    return None if any(t.__name__ == "Cache" for t in type(x).__mro__) else x


def _o_weight(name: str, module: nn.Module, out: Tensor, y: Tensor) -> Tensor:
    """(H, Dv, E): head h's rows of the module's output projection (its input features laid out head by head),
    checked on the call: the heads' writes plus a constant (the bias) must give the module's output."""
    from multihead.heads.surgery import out_in

    hooks = module.__dict__["attention_hooks"]
    lay = _layout(module)
    if lay is not None:
        o = lay.projections(module, hooks.parent)[3]
    elif hasattr(module, "projections"):
        o = module.projections()[3]
    else:
        raise ValueError(f"{name}: no head layout (which rows of its output projection hold head h): the circuit "
                         "graph cannot express its heads' writes.")
    H, Dv = out.shape[2], out.shape[3]
    w = out_in(o).detach()  # (E, H Dv)
    if w.shape[1] != H * Dv or y.shape[-1] != w.shape[0]:
        raise ValueError(f"{name}: its output projection takes {w.shape[1]} features, its heads give {H} x {Dv}: the "
                         "circuit graph cannot express its heads' writes.")
    W = w.t().reshape(H, Dv, w.shape[0]).double()  # (H Dv, E) -> (H, Dv, E)
    rest = y.detach().double() - torch.einsum("blhd,hde->ble", out.detach().double(), W)  # (B, L, E): the bias
    off = float((rest - rest[:1, :1]).abs().max())
    if off > 1e-4 * max(1.0, float(y.detach().abs().max())):
        raise ValueError(f"{name}: its output is not the sum of its heads' writes plus a constant (off by {off:.3g}): "
                         "a norm or scale after the heads; the circuit graph cannot express it.")
    return W


def _detached(module, args, output):
    """GradDrop's hook: the module's output unchanged, with no gradient back through the module."""
    if isinstance(output, Tensor):
        return output.detach()
    if isinstance(output, tuple | list) and output and isinstance(output[0], Tensor):
        return type(output)((output[0].detach(), *output[1:]))
    return None


class _AtP:
    """AtP*'s query/key pass, run from each unit's input hook in a forward of the base input (no gradients): for each
    writer u before unit i, the unit's heads' outputs with the queries, then the keys, recomputed from the stream with
    u's write taken from the source run (the unit's own forward: norm, projections, rotary embeddings, the attention
    with its mask, softmax exact), the other two of q, k, v the base run's; each reader's score is the metric's gradient
    at the heads' outputs (``gout``: one dict per gradient run, {unit: (B, L, H, Dv)}) dotted with the outputs' change.
    ``src``: the source run's writes; ``qk``: {unit: (runs, writers, H + Hkv) float64}, its q then k readers."""

    def __init__(self, src: list[Tensor], gout: list[dict], chunk: int):
        self.src, self.gout, self.chunk = src, gout, chunk
        self.qk: dict[int, Tensor] = {}

    def change(self, r: _Run, u: int) -> Tensor:
        """(B, L, E): the stream's change where writer u's write is the source run's (through the norm after the
        attention where a head's layer has one: the norm of the patched sum less the norm's output, exact)."""
        d = self.src[u].to(r.writes[u]) - r.writes[u]
        for j in r.post_out:
            a, H = r.hw0[j], r.sizes[j][0]
            if a <= u < a + H:
                return r.named[r.units[j].attn_post].forward(r.post_in[j] + d) - r.post_out[j]
        return d

    def unit(self, r: _Run, i: int) -> None:
        H, Hkv = r.sizes[i]
        x = r.x[("attn", i)]
        cB, U = x.shape[0], len(r.writes)
        out = torch.zeros(len(self.gout), U, H + Hkv, dtype=torch.float64, device=x.device)
        changes = [self.change(r, u) for u in range(U)]
        todo = [u for u in range(U) if bool(changes[u].abs().amax() > 0)]
        for a in range(0, len(todo), self.chunk):
            part = todo[a:a + self.chunk]
            n = len(part)
            moved = torch.cat([x + changes[u].to(x) for u in part])  # (n B, L, E)
            got = r.nested_call(i, torch.cat([moved, moved, x]), swap=n).double()  # ((2n + 1) B, L, H, Dv)
            o = got[2 * n * cB:]  # (B, L, H, Dv): the base run's outputs, from the same call
            dq = (got[:n * cB] - o.repeat(n, 1, 1, 1)).view(n, cB, *o.shape[1:])  # (n, B, L, H, Dv)
            dk = (got[n * cB:2 * n * cB] - o.repeat(n, 1, 1, 1)).view(n, cB, *o.shape[1:])
            for run, g in enumerate(self.gout):
                gi = g[i].double()  # (B, L, H, Dv)
                out[run, part, :H] = torch.einsum("nblhd,blhd->nh", dq, gi)
                sk = torch.einsum("nblhd,blhd->nh", dk, gi)  # (n, H): query head h reads key head h // (H / Hkv)
                out[run, part, H:] = sk.view(n, Hkv, H // Hkv).sum(-1)  # (n, H) -> (n, Hkv, H / Hkv) -> (n, Hkv)
        self.qk[i] = out


class _Model:
    """The model's layout and how it is called, checked: the units, the readout, the modules, the call."""

    def __init__(self, model, run, readout, ungroup=False):
        if not isinstance(ungroup, bool):
            raise TypeError(f"ungroup must be True (MIB's graph: a key and a value reader per query head) or False (one "
                            f"per key/value head); got {ungroup!r}.")
        self.model, self.ungroup = model, ungroup
        self.units, self.readout, self.mods = _units(model, readout)
        self.call = run or _call
        self.W: dict[int, Tensor] = {}  # each unit's (H, Dv, E) output weights, checked on the call's first run

    def forward(self, inputs, *, grad=False, **kw) -> tuple[object, _Run]:
        r = _Run(self.model, self.units, self.readout, self.mods, grad=grad, W=self.W, ungroup=self.ungroup, **kw)
        with contextlib.ExitStack() as stack, torch.set_grad_enabled(grad):
            r.install(stack)
            output = self.call(self.model, inputs)
        if r.order != list(range(len(self.units))):
            called = [self.units[i].attn for i in r.order]
            raise ValueError(f"the attention layers ran in the order {called}, not the stack's "
                             f"{[u.attn for u in self.units]} (or some did not run): the circuit graph takes each "
                             "layer once, in order.")
        return output, r

    def graph(self, r: _Run) -> CircuitGraph:
        writers, readers, edges = ["embed"], [], []
        sizes = {}
        for i, u in enumerate(self.units):
            H, Hkv = r.sizes[i]
            sizes[u.attn] = (H, Hkv)
            rs = [f"{u.attn}.q{h}" for h in range(H)] + [f"{u.attn}.{x}{g}" for x in "kv" for g in range(Hkv)]
            edges += [(w, q) for q in rs for w in writers]
            readers += rs
            before, writers = writers, writers + [f"{u.attn}.h{h}" for h in range(H)]
            if u.mlp is not None:
                readers.append(f"{u.mlp}.in")
                edges += [(w, f"{u.mlp}.in") for w in (before if u.parallel else writers)]
                writers = writers + [u.mlp]
        readers.append("logits")
        edges += [(w, "logits") for w in writers]
        return CircuitGraph(writers, readers, edges, self.units, self.readout, sizes, self.ungroup,
                            int(r.x[("attn", 0)].shape[-1]))

    def check_stream(self, r: _Run) -> None:
        """Each read point equals the embedding plus every module's output before it (the residual stream is a sum)."""
        x0 = r.x[("attn", 0)].detach().double()
        acc = x0.clone()
        scale = max(1.0, float(x0.abs().max()))

        def same(key, where):
            got = r.x[key].detach().double()
            off = float((got - acc).abs().max())
            if off > 1e-4 * max(scale, float(got.abs().max())):
                raise ValueError(f"the residual stream read at {where} is not the input embedding plus the outputs "
                                 f"written before it (off by {off:.3g}): a module between them the circuit graph "
                                 "cannot express (a norm on the stream, a scaled residual); pass readout= if the "
                                 "final norm or unembedding was misread.")

        for i, u in enumerate(self.units):
            same(("attn", i), u.block or u.attn)
            if u.mlp is not None and u.parallel:
                same(("mlp", i), u.mlp_via or u.mlp_norm)
            acc = acc + (r.post_out[i] if u.attn_post is not None else r.y[i]).detach().double()
            if u.mlp is not None:
                if not u.parallel:
                    same(("mlp", i), u.mlp_norm)
                acc = acc + r.mlp_y[i].detach().double()
        same("readout", self.readout)


def _inputs_checked(clean, corrupted) -> None:
    """Clean and corrupted inputs of the same token counts (before any forward)."""
    def shapes(x):
        if isinstance(x, Tensor):
            return [x.shape]
        if isinstance(x, Mapping):
            return [v.shape for v in x.values() if isinstance(v, Tensor)]
        if isinstance(x, tuple | list):
            return [v.shape for v in x if isinstance(v, Tensor)]
        return []

    a, b = shapes(clean), shapes(corrupted)
    for sa, sb in zip(a, b, strict=False):
        if len(sa) >= 2 and len(sb) >= 2 and sa[1] != sb[1]:
            raise ValueError(f"clean is {sa[1]} tokens and corrupted {sb[1]}: edges are compared position by "
                             "position, so both need the same token count; choose a corrupted input of the same "
                             "length, or pad the shorter one (and mask it).")
        if sa and sb and sa[0] != sb[0]:
            raise ValueError(f"clean has {sa[0]} rows and corrupted {sb[0]}: each clean row is paired with its "
                             "corrupted row; give both the same batch.")


def _direction(direction: str, clean, corrupted):
    if direction not in ("denoise", "noise"):
        raise ValueError(f"direction must be 'denoise' (base = the corrupted run, edges patched from the clean one) "
                         f"or 'noise' (base = the clean run); got {direction!r}.")
    return (corrupted, clean) if direction == "denoise" else (clean, corrupted)


def _batch(r: _Run) -> int:
    return r.x[("attn", 0)].shape[0]


@contextlib.contextmanager
def _eval(model):
    was = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was)


def circuit_graph(model: nn.Module, inputs, *, run: Callable | None = None, readout: str | None = None,
                  ungroup: bool = False) -> CircuitGraph:
    """The model's edge graph (:class:`CircuitGraph`), from one forward of ``inputs`` without gradients (the head
    counts are the call's). ``ungroup``: MIB's graph, a key and a value reader per query head (a grouped key/value
    head's inputs read once per query head of its group, as MIB and TransformerLens' ``ungroup_grouped_query_attention``
    count them), not one per key/value head. A module kind the graph cannot express is refused by name before the
    forward."""
    m = _Model(model, run, readout, ungroup)
    with _eval(model):
        _, r = m.forward(inputs)
    m.check_stream(r)
    return m.graph(r)


def edge_attribution(model: nn.Module, clean, corrupted, metric: Callable, *, method: str = "eap", steps: int = 5,
                     direction: str = "denoise", run: Callable | None = None, readout: str | None = None,
                     ungroup: bool = False, graddrop: bool | None = None) -> EdgeScores:
    """Every edge's attribution score (:class:`EdgeScores`, in :attr:`CircuitGraph.edges` order).

    ``clean``, ``corrupted``: the model's inputs (a dict of keyword arguments, a tuple, or one tensor), batch B, the
    same token count; ``metric(output)`` -> a scalar or a (B,) tensor (averaged), computed from the output so that its
    gradient reaches the readers. ``method``: "eap" (one forward of each input, one backward of the base run),
    "eap-ig" (``steps`` forwards and backwards on the line between the two runs' embeddings) or "atp*" (AtP*, below).
    Score of edge u -> v:
    sum over positions of (u's write in the source run - in the base run) . d metric / d (v's input), where a reader's
    input is its own copy of the residual stream (a head's query, a key/value head's key or value, an MLP's input,
    the final residual). ``readout``: the module whose input is the final residual (found for transformers models
    and the course's; name it otherwise). Gradients reach no parameter's ``.grad``. Memory: one forward's graph (the
    base run's, from the first layer's input on; EAP-IG one step at a time), the writers' changes (writers x B x L x
    E, the model's dtype) and one layer's readers' gradients at a time (its readers x B x L x E); the scores are
    summed in float64. A head's query/key/value reader's gradient is taken back through its own columns of the q/k/v
    projection (where the attention module's head layout names the projections; checked on every layer: the
    readers' gradients add up to the layer's), then through the norm. EAP-IG's points are a left Riemann sum: its
    error falls as 1/steps (the embedding's edges add up to the metric's whole change as steps grow). ``ungroup``: MIB's
    graph (:func:`circuit_graph`).

    **AtP*** (Kramár et al. 2024), ``method="atp*"``: EAP, with two changes.

    - *The query/key correction.* A saturated softmax has a gradient near zero, so EAP's linear estimate of an edge
      into a query or key can miss a patch that changes which key wins. For each edge u -> a head's query (a key/value
      head's key), the unit's own forward recomputes that query (key) from the stream with u's write taken from the
      source run -- the norm, the projection, rotary embeddings -- and the attention with its mask and the softmax
      exactly, the other inputs the base run's; the score is the metric's gradient at the heads' outputs dotted with
      the outputs' change (for a key/value head, summed over the query heads of its group). **Exact**: the new
      query/key, the attention weights and the heads' outputs of the patched run. **Approximate** (first order): only
      what lies after the heads' outputs -- so the score *equals* exact edge patching (:func:`patch_edges`) wherever
      the metric is linear in those outputs (the last layer, no norm or MLP between it and a linear metric), and
      is first order in the rest of the model elsewhere. Edges into values, MLPs and the logits keep EAP's score.
      Cost: one forward of the unit, up to its heads' outputs, per writer before it (8 writers a call).
    - *GradDrop* (``graddrop``, default True with "atp*"): against cancelling paths, the scores are taken again
      with the gradient dropped at each layer l's writes (its heads' outputs and its MLP's: one more forward and
      backward per layer), and an edge's score is the mean over the layers l other than its reader's own of
      |score with l dropped| (the reader's own layer drops its gradient entirely; edges into the logits: the mean over
      every layer, which is |score|): a magnitude, >= 0, for ranking. ``graddrop=False``: the signed QK-corrected
      scores. Needs two or more layers. Refused with the other methods."""
    _method_checked(method, steps, graddrop)
    _inputs_checked(clean, corrupted)
    base_in, src_in = _direction(direction, clean, corrupted)
    m = _Model(model, run, readout, ungroup)
    graddrop = _graddrop_checked(m, method, graddrop)
    with _eval(model):
        graph, full, _, base_v, src_v, _ = _scores(m, base_in, src_in, metric, method=method, steps=steps, graddrop=graddrop)
    w, rr = graph.matrix()
    scores = full[w.to(full.device), rr.to(full.device)].cpu()
    return EdgeScores(graph, list(graph.edges), scores, base_v, src_v, method, direction,
                      steps if method == "eap-ig" else 1, graddrop)


def node_attribution(model: nn.Module, clean, corrupted, metric: Callable, *, method: str = "atp*", steps: int = 5,
                     direction: str = "denoise", run: Callable | None = None, readout: str | None = None,
                     graddrop: bool | None = None) -> NodeScores:
    """Every node's attribution score (:class:`NodeScores`): the embedding, each head's output, each MLP -- the
    estimated change of the metric when that node's output is patched from the source run (at every position), as
    :func:`~multihead.heads.patch` measures it for heads. A node's score is the sum of its edges' scores
    (:func:`edge_attribution`, the same ``method``): with "eap" that is attribution patching of the node's output,
    (its change) . d metric / d (its output), as :func:`~multihead.heads.attribution`; with "atp*" each edge into a
    later head's query or key has the softmax recomputed (exact for that edge alone; a node moving a head's query and
    key together is scored as the sum of the two), and with GradDrop (the default) a node's score is the mean over
    the layers other than its own of |its score with layer l's gradient dropped| (Kramár et al.'s
    1/(L-1) sum over l; the embedding: the mean over all L), a magnitude. Arguments as :func:`edge_attribution`."""
    _method_checked(method, steps, graddrop)
    _inputs_checked(clean, corrupted)
    base_in, src_in = _direction(direction, clean, corrupted)
    m = _Model(model, run, readout, False)
    graddrop = _graddrop_checked(m, method, graddrop)
    with _eval(model):
        graph, _, nodes, base_v, src_v, _ = _scores(m, base_in, src_in, metric, method=method, steps=steps, graddrop=graddrop)
    return NodeScores(graph, list(graph.writers), nodes.cpu(), base_v, src_v, method, direction, graddrop)


def _method_checked(method, steps, graddrop=None) -> None:
    if method not in EDGE_METHODS:
        raise ValueError(f"method must be one of {', '.join(repr(x) for x in EDGE_METHODS)}; got {method!r}.")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a whole number >= 1 (EAP-IG's integration points); got {steps!r}.")
    if graddrop is not None and not isinstance(graddrop, bool):
        raise TypeError(f"graddrop must be True or False (AtP*'s GradDrop); got {graddrop!r}.")
    if graddrop and method != "atp*":
        raise ValueError(f"graddrop is part of AtP*: pass method='atp*' (got method={method!r}).")


def _graddrop_checked(m: _Model, method: str, graddrop: bool | None) -> bool:
    """AtP*'s GradDrop on by default; it averages over the layers other than a reader's own: two or more needed."""
    on = method == "atp*" and graddrop is not False
    if on and len(m.units) < 2:
        raise ValueError("graddrop averages over the layers other than a node's own: the model has one attention "
                         "layer; pass graddrop=False.")
    return on


def _scores(m: _Model, base_in, src_in, metric, *, method: str, steps: int, graddrop: bool):
    """(the graph, (U, R) edge scores, (U,) node scores, the base and source metrics, B) by ``method``."""
    if method == "atp*":
        return _atp(m, base_in, src_in, metric, graddrop)
    graph, full, base_v, src_v, B = _attribute(m, base_in, src_in, metric, steps if method == "eap-ig" else 1)
    return graph, full, full.sum(1), base_v, src_v, B


def _blocks_of(graph: CircuitGraph) -> tuple[Tensor, Tensor]:
    """(R,), (U,): the layer (unit) each reader and each writer belongs to; -1 for the logits and the embedding."""
    rb, wb = [], [-1]
    for i, u in enumerate(graph.units):
        H, Hkv = graph.sizes[u.attn]
        rb += [i] * (H + 2 * Hkv + (u.mlp is not None))
        wb += [i] * (H + (u.mlp is not None))
    return torch.tensor(rb + [-1]), torch.tensor(wb)


def _atp(m: _Model, base_in, src_in, metric, graddrop: bool, chunk: int = 8):
    """AtP*'s scores (:func:`edge_attribution`): EAP's from one gradient run of the base input (and one more per
    layer, that layer's writes detached, with GradDrop), the query/key readers' columns replaced by :class:`_AtP`'s
    pass; the edges' and nodes' GradDrop means."""
    with torch.no_grad():
        src_output, src = m.forward(src_in)
    m.check_stream(src)
    graph = m.graph(src)
    fulls, gouts, deltas, base_v, B = [], [], None, 0.0, 1
    for drop in [None] + (list(range(len(m.units))) if graddrop else []):
        output, r = m.forward(base_in, grad=True, drop=drop)
        if drop is None:
            B = _batch(r)
            _per_row(metric, output, B)
            deltas = torch.stack([a.detach() - b.detach() for a, b in zip(src.writes, r.writes, strict=True)])
            deltas = deltas.flatten(1)  # (U, B, L, E) -> (U, B L E)
        r.writes.clear()
        full = torch.zeros(len(graph.writers), len(graph.readers), dtype=torch.float64, device=deltas.device)
        gout: dict[int, Tensor] = {}
        value = _score(m, r, metric, output, deltas, full, gout=gout)
        base_v = value if drop is None else base_v
        fulls.append(full)
        gouts.append(gout)
        del r, output
    del deltas
    qk = _AtP([w.detach() for w in src.writes], gouts, chunk)
    with torch.no_grad():
        _, fin = m.forward(base_in, atp=qk)
    for i, got in qk.qk.items():  # (runs, writers before unit i, H + Hkv): the q then k readers' columns
        for full, g in zip(fulls, got.to(fulls[0].device), strict=True):
            full[:g.shape[0], fin.r0[i]:fin.r0[i] + g.shape[1]] = g
    src_v = _value(metric, src_output, B)
    if not graddrop:
        return graph, fulls[0], fulls[0].sum(1), base_v, src_v, B
    rb, wb = _blocks_of(graph)
    dropped = torch.stack(fulls[1:])  # (L, U, R): the scores with layer l's gradient dropped
    layers = torch.arange(len(m.units))
    keep_r = (layers[:, None] != rb[None, :]).to(dropped)  # (L, R): every layer but the reader's own
    keep_w = (layers[:, None] != wb[None, :]).to(dropped)  # (L, U)
    edges = (dropped.abs() * keep_r[:, None, :]).sum(0) / keep_r.sum(0)[None, :]  # (U, R)
    nodes = (dropped.sum(2).abs() * keep_w).sum(0) / keep_w.sum(0)  # (U,)
    return graph, edges, nodes, base_v, src_v, B


def _attribute(m: _Model, base_in, src_in, metric, steps: int) -> tuple[CircuitGraph, Tensor, float, float, int]:
    """One batch's scores: (the graph, (U, R) float64 scores averaged over the batch and the steps, the base and
    source runs' metrics, the batch size B)."""
    with torch.no_grad():
        src_output, src = m.forward(src_in)
    m.check_stream(src)
    graph = m.graph(src)
    full = torch.zeros(len(graph.writers), len(graph.readers), dtype=torch.float64)  # (U, R)
    base_v, deltas, base0, base_emb, B = 0.0, None, None, {}, 1
    for s in range(steps):
        interp = None if s == 0 else {"a": s / steps, "x0": (base0, src.x[("attn", 0)].detach()),
                                      "emb": {n: (e, src.emb[n]) for n, e in base_emb.items()}}
        output, r = m.forward(base_in, grad=True, interp=interp)
        if s == 0:
            base0, B, base_emb = r.x[("attn", 0)].detach(), _batch(r), dict(r.emb)
            _per_row(metric, output, B)
            deltas = torch.stack([a.detach() - b.detach() for a, b in zip(src.writes, r.writes, strict=True)])
            deltas = deltas.flatten(1)  # (U, B, L, E) -> (U, B L E)
            full = full.to(deltas.device)
            src.writes.clear()
        else:
            _on_the_line(r, base0, interp)
        r.writes.clear()
        value = _score(m, r, metric, output, deltas, full)
        base_v = value if s == 0 else base_v
        del r, output  # the graph of this step goes
    return graph, full / steps, base_v, _value(metric, src_output, B), B


def _on_the_line(r: _Run, base0: Tensor, interp: dict) -> None:
    """EAP-IG: the stream where the first layer reads it must be the point on the line between the two runs."""
    x0 = base0 + interp["a"] * (interp["x0"][1] - base0)
    off = float((r.x[("attn", 0)].detach() - x0).abs().max())
    if off > 1e-4 * max(1.0, float(base0.abs().max())):
        raise ValueError(f"EAP-IG: the stream where the first layer reads it is not the line between the two runs' "
                         f"embeddings (off by {off:.3g}): the model starts its stream other than by summing token "
                         "embeddings; use method='eap'.")


def _score(m: _Model, r: _Run, metric, output, deltas: Tensor, full: Tensor, *, gout: dict | None = None) -> float:
    """Adds this run's scores into ``full`` (U, R): for each block of readers (a layer's q/k/v, an MLP's input, the
    logits) the writers before it (their changes ``deltas`` (U, B L E)) dotted with the readers' gradients, one
    matrix product a block; returns the metric. ``gout``: filled with the metric's gradient at each unit's heads'
    outputs ((B, L, H, Dv), AtP*'s)."""
    value = metric(output)
    total = value.double().mean() if isinstance(value, Tensor) else None
    if total is None or not total.requires_grad:
        raise ValueError("metric must return a tensor computed from the model's output (a scalar or (B,)), so that "
                         "its gradient reaches the readers.")
    n = len(m.units)
    wrt = [t for i in range(n) for t in r.qkv[i]]
    mlps = [i for i, u in enumerate(m.units) if u.mlp is not None]
    wrt += [r.mlp_y[i] for i in mlps] + [r.x["readout"]]
    k = len(wrt)
    wrt += [r.out[i] for i in range(n)] if gout is not None else []
    g = torch.autograd.grad(total, wrt, retain_graph=True, allow_unused=True)
    g = [torch.zeros_like(t) if gi is None else gi for t, gi in zip(wrt, g, strict=True)]
    if gout is not None:
        gout.update((i, gi.detach()) for i, gi in enumerate(g[k:]))
        g = g[:k]
    if all(not gi.any() for gi in g):
        raise ValueError("metric's gradient is zero at every reader: it does not depend on the model's output through "
                         "the model (a constant, or a value of the inputs); compute it from the logits.")
    gm = dict(zip(mlps, g[3 * n:3 * n + len(mlps)], strict=True))
    u0, r0 = 1, 0  # writers before the block, the block's first reader

    def add(grads: Tensor, writers: int) -> int:  # grads (n_r, B, L, E)
        full[:writers, r0:r0 + grads.shape[0]] += (deltas[:writers] @ grads.flatten(1).to(deltas).t()).double()
        _through_posts(r, deltas, grads, writers, full[:, r0:r0 + grads.shape[0]])
        return r0 + grads.shape[0]

    for i in range(n):
        r0 = add(_attn_grads(r, i, g[3 * i:3 * i + 3]), u0)
        before, u0 = u0, u0 + r.sizes[i][0]
        if i in gm:
            xm = r.x[("mlp", i)]
            (gx,) = torch.autograd.grad(r.mlp_y[i], xm, gm[i], retain_graph=True, allow_unused=True)
            r0 = add((torch.zeros_like(xm) if gx is None else gx).unsqueeze(0), before if m.units[i].parallel else u0)
            u0 += 1
    add(g[-1].unsqueeze(0), u0)
    return float(total.detach())


def _through_posts(r: _Run, deltas: Tensor, grads: Tensor, writers: int, full: Tensor) -> None:
    """For the heads of each layer with a norm after the attention among the first ``writers``: their rows of
    ``full`` (U, n_r) take the readers' gradients ``grads`` (n_r, B, L, E) back through that norm (its Jacobian at the
    run's attention output), not straight (the linear term ``add`` gave them is replaced)."""
    for j in r.post_out:
        a, H = r.hw0[j], r.sizes[j][0]
        if a + H > writers:
            continue
        out, y = r.post_out[j], r.post_in[j]
        try:
            (gj,) = torch.autograd.grad(out, y, grads.to(out), retain_graph=True, is_grads_batched=True)
        except RuntimeError:  # an operation without a batching rule: one backward a reader
            gj = torch.stack([torch.autograd.grad(out, y, gi, retain_graph=True)[0] for gi in grads.to(out)])
        full[a:a + H] += (deltas[a:a + H] @ (gj - grads.to(gj)).flatten(1).to(deltas).t()).double()


def _one_head_each(gt: Tensor) -> Tensor:
    """(n, B, n, L, D) from (B, n, L, D): copy h keeps head h's gradient, zero elsewhere."""
    eye = torch.eye(gt.shape[1], dtype=gt.dtype, device=gt.device)  # (n, n)
    return gt.unsqueeze(0) * eye[:, None, :, None, None]


def _attn_grads(r: _Run, i: int, gq3: list[Tensor]) -> Tensor:
    """(H + 2 Hkv, B, L, E): the metric's gradient at each of unit i's readers' own copy of the stream (q per head,
    then k and v per key/value head), given the gradients at its q, k, v (B, n, L, D) each."""
    x = r.x[("attn", i)]
    fast = _through_projections(r, i, x, gq3)
    if fast is not None:
        return fast
    out: list[Tensor] = []
    for t, gt in zip(r.qkv[i], gq3, strict=True):
        sel = _one_head_each(gt)  # (n_h, B, n_h, L, D)
        try:  # every head's copy of the stream in one vectorised backward through the norm and projections
            (gx,) = torch.autograd.grad(t, x, sel, retain_graph=True, allow_unused=True, is_grads_batched=True)
            gx = torch.zeros(sel.shape[0], *x.shape, dtype=x.dtype, device=x.device) if gx is None else gx
        except RuntimeError:  # an operation without a batching rule: one backward a head
            gx = torch.stack([_or_zeros(torch.autograd.grad(t, x, s, retain_graph=True, allow_unused=True)[0], x)
                              for s in sel])
        out.append(gx)  # (n_h, B, L, E): head h's copy of the stream
    return torch.cat(out)


def _or_zeros(g: Tensor | None, like: Tensor) -> Tensor:
    return torch.zeros_like(like) if g is None else g


def _through_projections(r: _Run, i: int, x: Tensor, gq3: list[Tensor]) -> Tensor | None:
    """The readers' gradients (H + 2 Hkv, B, L, E) taken back through the q/k/v projection layers recorded on the
    run: from q/k/v to each layer's output (through rotary embeddings, head splits: cheap), then through the layer's
    weight on only the columns a reader's gradient is non-zero in (its head's), then through what lies between the
    stream and the layer's input (the norm). None where the layers were not recorded, a layer ran twice, or the
    readers' gradients do not add up to the layer's whole gradient (q/k/v read the stream another way too)."""
    projs = r.proj.get(i)
    if not projs or len({id(w) for w, _, _ in projs}) != len(projs):
        return None
    ins: dict[int, list] = {}  # id(layer input) -> [input, (n_readers, B, L, in) gradient]
    n_r = sum(t.shape[1] for t in r.qkv[i])
    row = 0
    for t, gt in zip(r.qkv[i], gq3, strict=True):
        sel = _one_head_each(gt)
        try:
            gp = torch.autograd.grad(t, [p for _, _, p in projs], sel, retain_graph=True, allow_unused=True,
                                     is_grads_batched=True)  # (n_h, B, L, out) each layer
        except RuntimeError:
            return None
        for (W, n, _), gj in zip(projs, gp, strict=True):
            if gj is not None:
                acc = ins.setdefault(id(n), [n, torch.zeros(n_r, *n.shape, dtype=n.dtype, device=n.device)])
                acc[1][row:row + gt.shape[1]] += _columns_matmul(gj, W.to(gj.dtype))
        row += gt.shape[1]
    gx = torch.zeros(n_r, *x.shape, dtype=x.dtype, device=x.device)
    for n, gn in ins.values():
        if n is x:
            gx += gn
            continue
        try:
            (got,) = torch.autograd.grad(n, x, gn, retain_graph=True, allow_unused=True, is_grads_batched=True)
        except RuntimeError:
            return None
        if got is not None:
            gx += got
    (want,) = torch.autograd.grad(list(r.qkv[i]), x, list(gq3), retain_graph=True, allow_unused=True)
    want = _or_zeros(want, x)
    if float((gx.sum(0) - want).detach().abs().max()) > 1e-4 * max(float(want.detach().abs().max()), 1e-30):
        return None
    return gx


def _columns_matmul(g: Tensor, W: Tensor) -> Tensor:
    """(n, B, L, in) = g (n, B, L, out) @ W (out, in), each row n multiplied over only its non-zero columns (a head's
    gradient at a projection's output is zero outside the head's columns: the product skips only zeros)."""
    n, B, L, out = g.shape
    nz = g.ne(0).flatten(1, 2).any(1)  # (n, out)
    count = nz.sum(1)
    c = int(count[0])
    if c == 0 or c == out or bool((count != c).any()):
        return g @ W  # (n, B, L, out) @ (out, in)
    idx = nz.nonzero()[:, 1].view(n, c)  # (n, c): row n's non-zero columns, ascending
    gs = g.gather(-1, idx[:, None, None, :].expand(n, B, L, c))  # (n, B, L, c)
    return torch.einsum("nblc,nci->nbli", gs, W[idx])  # W[idx] (n, c, in)


def _patched_runs(m: _Model, base_in, rep: _Run, B: int, masks: Tensor, metric, *, chunk: int) -> list[float]:
    """The metric of each copy: the base input with copy p's marked edges (masks (P, U, R) bool) taken from ``rep``."""
    got: list[float] = []
    for i in range(0, masks.shape[0], chunk):
        part = masks[i:i + chunk]
        c = part.shape[0]
        with torch.no_grad():
            output, _ = m.forward(_repeat(base_in, c, B), c=c, B=B, patched=part,
                                  rep=[w.detach() for w in rep.writes])
        got += [_value(metric, _rows(output, p * B, (p + 1) * B, c * B), B) for p in range(c)]
    return got


def _edge_masks(graph: CircuitGraph, sets: list[Tensor]) -> Tensor:
    """(P, U, R) bool: copy p marks the edges at indices ``sets[p]``."""
    w, r = graph.matrix()
    out = torch.zeros(len(sets), len(graph.writers), len(graph.readers), dtype=torch.bool)
    for p, idx in enumerate(sets):
        out[p, w[idx], r[idx]] = True
    return out


def patch_edges(model: nn.Module, clean, corrupted, metric: Callable, edges: Sequence[tuple[str, str]], *,
                direction: str = "denoise", chunk: int = 16, run: Callable | None = None,
                readout: str | None = None, ungroup: bool = False) -> EdgeScores:
    """Exact edge patching (ACDC-style verification of attribution scores): for each edge, the base run with that
    edge's writer taken from the source run at that reader only (the reader's input rebuilt; everything else
    computed as usual). ``scores``: the metric's change from the base run, the quantity :func:`edge_attribution`
    estimates. ``chunk`` edges a forward; ``ungroup``: MIB's graph (:func:`circuit_graph`)."""
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be a whole number >= 1 (edges per forward); got {chunk!r}.")
    _inputs_checked(clean, corrupted)
    base_in, src_in = _direction(direction, clean, corrupted)
    m = _Model(model, run, readout, ungroup)
    with _eval(model), torch.no_grad():
        src_output, src = m.forward(src_in)
        m.check_stream(src)
        graph = m.graph(src)
        idx = graph.index(edges)
        base_output, base = m.forward(base_in)
        B = _batch(base)
        _per_row(metric, base_output, B)
        base_v = _value(metric, base_output, B)
        got = _patched_runs(m, base_in, src, B, _edge_masks(graph, [idx[p:p + 1] for p in range(len(idx))]), metric,
                            chunk=chunk)
    return EdgeScores(graph, [tuple(e) for e in edges], torch.tensor(got, dtype=torch.float64) - base_v, base_v,
                      _value(metric, src_output, B), "exact", direction)


def _faith(m, clean, corrupted, metric, circuits: list[list], chunk) -> tuple[CircuitGraph, list[float], float, float,
                                                                              list[int]]:
    with torch.no_grad():
        corr_output, corr = m.forward(corrupted)
        m.check_stream(corr)
        graph = m.graph(corr)
        clean_output, cl = m.forward(clean)
        B = _batch(cl)
        _per_row(metric, clean_output, B)
        full, empty = _value(metric, clean_output, B), _value(metric, corr_output, B)
        if full == empty:
            raise ValueError("the clean and corrupted runs give the same metric: f = (m(C) - m(empty)) / (m(N) - "
                             "m(empty)) is undefined; choose inputs the metric separates.")
        n = len(graph.edges)
        outside, kept = [], []
        for c in circuits:
            keep = torch.zeros(n, dtype=torch.bool)
            keep[graph.index(c)] = True
            kept.append(int(keep.sum()))
            outside.append((~keep).nonzero().flatten())
        got = _patched_runs(m, clean, corr, B, _edge_masks(graph, outside), metric, chunk=chunk)
    return graph, got, full, empty, kept


def faithfulness(model: nn.Module, clean, corrupted, metric: Callable, circuit: Sequence[tuple[str, str]], *,
                 run: Callable | None = None, readout: str | None = None, ungroup: bool = False) -> Faithfulness:
    """A circuit's faithfulness by intervention: the clean run with every edge outside ``circuit`` (writer, reader
    pairs; a triple's score is ignored) patched from the corrupted run, ``f = (m(C) - m(empty)) / (m(N) -
    m(empty))`` (:class:`Faithfulness`). ``ungroup``: the circuit is on MIB's graph (:func:`circuit_graph`)."""
    _inputs_checked(clean, corrupted)
    m = _Model(model, run, readout, ungroup)
    with _eval(model):
        graph, got, full, empty, kept = _faith(m, clean, corrupted, metric, [[e[:2] for e in circuit]], 1)
    return Faithfulness((got[0] - empty) / (full - empty), got[0], full, empty, kept[0], len(graph.edges))


def faithfulness_curve(model: nn.Module, clean, corrupted, metric: Callable, scores: EdgeScores, *,
                       budgets: Sequence[float | str] = MIB_BUDGETS, how: str | Sequence[str] = ("pruned", "greedy"),
                       chunk: int = 4, run: Callable | None = None, readout: str | None = None) -> FaithfulnessCurve:
    """f at each budget for each construction in ``how`` (``scores.circuit(budget, how=...)``: by default MIB's pruned
    top n and EAP-IG's greedy circuit, see :meth:`EdgeScores.circuit`), with CPR and CMD for each
    (:class:`FaithfulnessCurve`); ``chunk`` circuits a forward. Budgets outside (0, 100%] and unknown constructions are
    refused before any forward."""
    fr = [_budget(b) for b in budgets]
    if not fr:
        raise ValueError("budgets must name at least one edge budget in (0, 100%].")
    hows = [_how(h) for h in ([how] if isinstance(how, str) else how if isinstance(how, list | tuple) else [how])]
    if not hows or len(set(hows)) != len(hows):
        raise ValueError(f"how must name one construction or several, each once (of {', '.join(CONSTRUCTIONS)}); got "
                         f"{how!r}.")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be a whole number >= 1 (circuits per forward); got {chunk!r}.")
    if scores.method == "exact":
        raise ValueError("scores must score every edge of the graph (edge_attribution's), not patch_edges' chosen ones.")
    _inputs_checked(clean, corrupted)
    m = _Model(model, run, readout, scores.graph.ungrouped)
    circuits = [tuple(scores.circuit(b, how=h)) for h in hows for b in fr]
    unique = list(dict.fromkeys(circuits))  # a circuit two constructions share (all edges, none) runs once
    with _eval(model):
        graph, got, full, empty, kept = _faith(m, clean, corrupted, metric, [list(c) for c in unique], chunk)
    if graph.edges != scores.edges:
        raise ValueError("scores were computed on another graph (another model, or other head counts).")
    at = [unique.index(c) for c in circuits]
    f, kept = [(got[i] - empty) / (full - empty) for i in at], [kept[i] for i in at]
    curves = {}
    for i, h in enumerate(hows):
        fh = f[i * len(fr):(i + 1) * len(fr)]
        curves[h] = CircuitCurve(h, kept[i * len(fr):(i + 1) * len(fr)], fh, _trapezoid(fr, fh),
                                 _trapezoid(fr, [abs(1 - x) for x in fh]))
    return FaithfulnessCurve(fr, full, empty, curves)


def _trapezoid(x: list[float], y: list[float]) -> float:
    if len(x) < 2:
        return float("nan")
    order = sorted(range(len(x)), key=lambda i: x[i])
    return sum((x[order[i + 1]] - x[order[i]]) * (y[order[i + 1]] + y[order[i]]) / 2 for i in range(len(x) - 1))
