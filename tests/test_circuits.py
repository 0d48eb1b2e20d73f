"""Circuits (heads.circuits): the edge graph of GPT-2, Llama (grouped key/value heads: one receiver per group) and the
course's own models; EAP against exact edge patching written out by hand; EAP-IG's completeness; faithfulness exact at
both ends (no edge kept: the corrupted run; every edge: the clean run); the induction circuit's K-composition edge of a
model trained here found by exact edge patching, path patching and EAP alike; TransformerLens 4.3's edge attribution and
faithfulness on the same GPT-2; bad input refused in one line before any forward."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import multihead
from multihead import MultiHeadAttention, heads
from test_patching import TwoLayers, _by_hand, _logit_diff, _repeat_loss, _repeated, trained_induction


def _two_layers():
    torch.manual_seed(0)
    m = TwoLayers().eval()
    m(torch.zeros(1, 6, dtype=torch.long))  # builds the lazy layers
    return m


def _pair():
    g = torch.Generator().manual_seed(1)
    clean = torch.randint(0, 11, (2, 6), generator=g)
    corrupted = clean.clone()
    corrupted[:, 1:3] = (corrupted[:, 1:3] + 4) % 11
    return clean, corrupted


def _edge_by_hand(model, base, source, edge) -> float:
    """TwoLayers' metric with one edge patched, written out without hooks: the reader's input is the base run's
    stream with the writer's write taken from the source run."""
    with torch.no_grad():
        def run(ids):
            x0 = model.embed(ids) + model.pos[: ids.shape[1]]  # (B, L, E)
            _, _, outs = _by_hand(model, ids)
            return x0, outs

        bx0, bo = run(base)
        sx0, so = run(source)
        w, r = edge
        if w == "embed":
            change = sx0 - bx0
        else:
            h = int(w.split(".h")[1])
            lay = model.layers[int(w.split(".")[1])]
            W = lay.o_proj.weight[:, 4 * h:4 * h + 4]  # (E, D): head h's columns of the output projection
            change = (so[0][:, :, h] - bo[0][:, :, h]) @ W.T  # (B, L, E)
        x1 = bx0 + model.layers[0].o_proj(bo[0].reshape(*bo[0].shape[:2], 16))  # (B, L, E): the stream at layer 1
        if r == "logits":
            x2 = x1 + model.layers[1].o_proj(bo[1].reshape(*bo[1].shape[:2], 16))
            return float(_logit_diff(model.out(x2 + change)).mean())
        kind, h, li = r.split(".")[-1][0], int(r.split(".")[-1][1:]), int(r.split(".")[1])
        lay, x = model.layers[li], (bx0, x1)[li]  # the reader's layer and the stream it reads
        B, L, _ = x.shape
        new = dict(zip("qkv", (p(x + change).view(B, L, 4, 4).transpose(1, 2)
                               for p in (lay.q_proj, lay.k_proj, lay.v_proj)), strict=True))  # (B, H, L, D) each

        def put(q, k, v):
            got = {"q": q.clone(), "k": k.clone(), "v": v.clone()}
            got[kind][:, h] = new[kind][:, h]
            return got["q"], got["k"], got["v"]

        logits, _, _ = _by_hand(model, base, inputs={li: put})
        return float(_logit_diff(logits).mean())


def test_eap_exact_edge_patching_and_the_graph_on_a_small_model():
    """The graph: every writer to every later reader (81 edges for 2 layers x 4 heads, no MLP). EAP's estimate per edge
    is the first order of exact edge patching; exact edge patching (batched) equals the same patch written out by
    hand; EAP-IG with one step is EAP, and with many its embedding edges add up to the metric's whole change
    (completeness); faithfulness is exactly the corrupted run with no edge kept and the clean run with all."""
    model = _two_layers()
    clean, corrupted = _pair()
    g = heads.circuit_graph(model, clean)
    assert g.writers == ["embed"] + [f"layers.{i}.h{h}" for i in range(2) for h in range(4)]
    assert len(g.readers) == 25 and len(g.edges) == 12 * 1 + 12 * 5 + 9 and g.sizes["layers.1"] == (4, 4)
    assert ("layers.1.h0", "layers.1.q0") not in g.edges and ("layers.0.h3", "layers.1.k0") in g.edges
    s = heads.edge_attribution(model, clean, corrupted, _logit_diff)
    with torch.no_grad():
        assert s.base == pytest.approx(float(_logit_diff(model(corrupted)).mean()), abs=1e-6)
        assert s.source == pytest.approx(float(_logit_diff(model(clean)).mean()), abs=1e-6)
    chosen = [("layers.0.h1", "layers.1.k2"), ("embed", "layers.1.v0"), ("layers.0.h2", "layers.1.q3"),
              ("layers.0.h0", "logits"), ("embed", "logits")] + [e[:2] for e in s.top(4)]
    exact = heads.patch_edges(model, clean, corrupted, _logit_diff, chosen, chunk=3)
    for e, v in zip(chosen, exact.scores.tolist(), strict=True):
        assert v + exact.base == pytest.approx(_edge_by_hand(model, corrupted, clean, e), abs=1e-5), e
    est = s.scores[g.index(chosen)]
    assert (est - exact.scores).abs().max() < 0.3 * exact.scores.abs().max(), (est, exact.scores)  # first order
    assert exact.scores.abs().max() > 1e-3
    one = heads.edge_attribution(model, clean, corrupted, _logit_diff, method="eap-ig", steps=1)
    assert torch.equal(one.scores, s.scores)
    ig = heads.edge_attribution(model, clean, corrupted, _logit_diff, method="eap-ig", steps=64)
    emb = torch.tensor([w == "embed" for w, _ in ig.edges])
    gap = ig.source - ig.base
    assert abs(float(ig.scores[emb].sum()) - gap) < 0.03 * abs(gap), (float(ig.scores[emb].sum()), gap)
    assert abs(float(s.scores[emb].sum()) - gap) > 0.05 * abs(gap)  # EAP's first order is not yet there
    none = heads.faithfulness(model, clean, corrupted, _logit_diff, [])
    every = heads.faithfulness(model, clean, corrupted, _logit_diff, s.edges)
    assert none.circuit == pytest.approx(s.base, abs=1e-6) and none.f == pytest.approx(0, abs=1e-5)
    assert every.circuit == pytest.approx(s.source, abs=1e-6) and every.f == pytest.approx(1, abs=1e-5)
    assert every.kept == every.total == 81


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_transformers_families_graph_exact_at_both_ends(family):
    """GPT-2 (fused q/k/v, MLPs) and Llama with grouped key/value heads (4 query heads share 2): receivers per
    key/value group (k0, k1, not k0..k3); the rebuilt readers (through each layer's norm and rotary embedding) give
    exactly the corrupted run when every edge is patched and the clean run when none is; exact edge patching agrees
    with EAP to first order on a small change; the raw top circuits of the curve keep ceil(budget x edges) edges, the
    pruned and greedy ones what EdgeScores.circuit returns."""
    T = pytest.importorskip("transformers")
    import multihead.hf as mhf

    torch.manual_seed(0)
    if family == "gpt2":
        model = T.GPT2LMHeadModel(T.GPT2Config(vocab_size=50, n_positions=16, n_embd=32, n_layer=2, n_head=4))
        attn, mlp = "transformer.h.1.attn", "transformer.h.0.mlp"
    else:
        model = T.LlamaForCausalLM(T.LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64,
                                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
        attn, mlp = "model.layers.1.self_attn", "model.layers.0.mlp"
    model = mhf.attach(model.eval())
    g = torch.Generator().manual_seed(2)
    clean = {"input_ids": torch.randint(0, 50, (2, 7), generator=g)}
    corrupted = {"input_ids": clean["input_ids"].clone()}
    corrupted["input_ids"][:, 2] = (corrupted["input_ids"][:, 2] + 7) % 50

    def metric(out):
        return out.logits[:, -1, 3] - out.logits[:, -1, 5]

    s = heads.edge_attribution(model, clean, corrupted, metric)
    Hkv = 4 if family == "gpt2" else 2
    assert s.graph.sizes[attn] == (4, Hkv)
    assert f"{attn}.k{Hkv - 1}" in s.graph.readers and f"{attn}.k{Hkv}" not in s.graph.readers
    a = 4 + 2 * Hkv  # a layer's attention readers: q per head, k and v per key/value head
    # layer 0: its readers from the embedding, its MLP from the embedding and its heads; layer 1: its readers from
    # those 6 writers, its MLP from 10; the logits from all 11
    assert len(s.edges) == a * 1 + 5 + a * 6 + 10 + 11
    assert (mlp, f"{attn}.q0") in s.edges and (f"{mlp}", f"{mlp}.in") not in s.edges
    none = heads.faithfulness(model, clean, corrupted, metric, [])
    every = heads.faithfulness(model, clean, corrupted, metric, s.edges)
    assert abs(none.circuit - none.empty) < 1e-5 and abs(every.circuit - every.full) < 1e-5
    assert abs(none.full - none.empty) > 1e-3  # the runs differ: the two ends are not the same number
    top = [e[:2] for e in s.top(5)]
    exact = heads.patch_edges(model, clean, corrupted, metric, top, chunk=2)
    est = s.scores[s.graph.index(top)]
    assert (est - exact.scores).abs().max() < 0.5 * exact.scores.abs().max(), (est, exact.scores)
    curve = heads.faithfulness_curve(model, clean, corrupted, metric, s, budgets=[0.05, "50%", 1.0],
                                     how=("top", "pruned", "greedy"))
    n = len(s.edges)
    assert curve.kept == [-(-5 * n // 100), -(-n // 2), n] and curve.f[-1] == pytest.approx(1, abs=1e-4)
    for how in ("pruned", "greedy"):  # MIB's count (rounded down), less the dangling edges
        assert curve[how].kept == [len(s.circuit(b, how=how)) for b in (0.05, 0.5, 1.0)] and curve[how].kept[-1] == n
        assert curve[how].f[-1] == pytest.approx(1, abs=1e-4)


@pytest.fixture(scope="module")
def induction():
    """Olsson et al.'s 2-layer attention-only model trained on random tokens repeated once (as in
    test_patching), with a clean batch, its corruption (the first half other tokens) and the heads found by their
    attention: the induction head of layer 1 and the previous-token head of layer 0."""
    model = trained_induction()  # trained once per process, shared with test_patching
    clean = _repeated(torch.Generator().manual_seed(9), 8)
    corrupted = clean.clone()
    corrupted[:, :16] = torch.randint(0, 32, (8, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad(), multihead.capture(model) as cap:
        model(clean)
    t = torch.arange(17, 32)
    ind = int(cap["layers.1"][:, :, t, t - 15].mean((0, 2)).argmax())  # weight on the token after the first one
    prev = int(cap["layers.0"][:, :, torch.arange(1, 32), torch.arange(0, 31)].mean((0, 2)).argmax())  # on t - 1
    return model, clean, corrupted, ind, prev


def test_the_induction_circuit_found_by_edges(induction):
    """On the trained induction model (noising: the clean run, edges patched from the corrupted one): exact edge
    patching of each layer-0 head -> the induction head's key equals path patching that head through those keys
    alone (two independent routes to the same number: in an attention-only model that path is the edge), and ranks
    the previous-token head's edge among the top two; EAP ranks that edge first among the layer-0 heads' edges into
    that key and within the top 5% of all 81 edges. The faithfulness curve ends at the clean run (f = 1 with every
    edge), and EAP-IG's is measured beside EAP's (figures in the report, not asserted: see the issue's note)."""
    model, clean, corrupted, ind, prev = induction

    def metric(out):
        return -_repeat_loss(out, clean)

    into = [(f"layers.0.h{h}", f"layers.1.k{ind}") for h in range(4)]
    exact = heads.patch_edges(model, clean, corrupted, metric, into, direction="noise")
    path = heads.path_patch(model, clean, corrupted, metric, {"layers.1": [ind]}, through="k", senders=["layers.0"],
                            direction="noise")
    assert torch.allclose(exact.scores + exact.base, path.values["layers.0"], atol=1e-5), (exact.scores, path.values)
    assert prev in exact.scores.argsort()[:2].tolist(), (exact.scores, prev)  # the loss rises most without it
    s = heads.edge_attribution(model, clean, corrupted, metric, direction="noise")
    order = [e[:2] for e in s.top(len(s.edges))]
    assert [e for e in order if e in into][0] == into[prev], (s.top(8), prev, ind)
    assert order.index(into[prev]) < -(-5 * len(s.edges) // 100), (order.index(into[prev]), s.top(8))
    curve = heads.faithfulness_curve(model, clean, corrupted, metric, s, how=("top", "pruned", "greedy"))
    assert curve.f[-1] == pytest.approx(1, abs=1e-6) and curve.kept[-1] == 81 and 0 < curve.cmd
    f = heads.faithfulness(model, clean, corrupted, metric, s.circuit(0.05, how="top"))
    assert f.f == pytest.approx(curve.f[curve.budgets.index(0.05)], abs=1e-6) and f.kept == 5


def _refusals():
    """(model, clean, corrupted, its edge scores, refused(match, fn, *a, **kw), calls): ``refused`` checks that ``fn``
    raises a one-line ValueError matching ``match`` before any forward hooked into ``calls`` (the model's)."""
    model = _two_layers()
    calls = []
    model.register_forward_pre_hook(lambda m, a: calls.append(1))
    clean, corrupted = _pair()
    s = heads.edge_attribution(model, clean, corrupted, _logit_diff)
    calls.clear()

    def refused(match, fn, *a, **kw):
        with pytest.raises(ValueError, match=match) as e:
            fn(*a, **kw)
        assert "\n" not in str(e.value) and not calls, (str(e.value), calls)
    return model, clean, corrupted, s, refused, calls


def test_bad_input_is_refused_in_one_line_before_any_forward():
    model, clean, corrupted, s, refused, calls = _refusals()

    refused(r"clean is 6 tokens and corrupted 5: .*same token count; choose a corrupted input of the same length, or "
            r"pad the shorter", heads.edge_attribution, model, clean, corrupted[:, :5], _logit_diff)
    refused(r"clean is 6 tokens and corrupted 4", heads.faithfulness, model, clean, corrupted[:, :4], _logit_diff, [])
    for bad in (0, 1.5, "150%", "0%", -0.1):
        refused(r"an edge budget must be in \(0, 100%\] of the edges", heads.faithfulness_curve, model, clean,
                corrupted, _logit_diff, s, budgets=[0.01, bad])
    with pytest.raises(ValueError, match=r"an edge budget must be in \(0, 100%\]"):
        s.circuit(2.0)

    class Odd(nn.Module):  # attention inside a block whose residual the graph cannot read
        def __init__(self):
            super().__init__()
            self.attn = MultiHeadAttention(16, 4)

        def forward(self, x):
            return torch.tanh(self.attn(x))

    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([Odd()])
            self.out = nn.Linear(16, 3)

        def forward(self, x):
            return self.out(self.blocks[0](x))

    odd = Holder().eval()
    odd.register_forward_pre_hook(lambda m, a: calls.append(1))
    x = torch.randn(1, 5, 16)
    refused(r"blocks.0.attn sits in a Odd, a block the circuit graph cannot express \(it expresses EncoderBlock, "
            r"GPT2Block", heads.edge_attribution, odd, x, x + 1, lambda out: out[:, -1, 0])
    # a metric whose gradient is zero everywhere: refused after the base run, before any score is formed
    with pytest.raises(ValueError, match=r"metric's gradient is zero at every reader: it does not depend on the "
                                         r"model's output"):
        heads.edge_attribution(model, clean, corrupted, lambda out: out[:, -1, 0] * 0)
    with pytest.raises(ValueError, match=r"metric must return a tensor computed from the model's output"):
        heads.edge_attribution(model, clean, corrupted, lambda out: 1.0)
    with pytest.raises(ValueError, match=r"method must be one of 'eap', 'eap-ig', 'atp\*'; got 'acdc'"):
        heads.edge_attribution(model, clean, corrupted, _logit_diff, method="acdc")
    with pytest.raises(ValueError, match=r"edge \('layers.1.h0', 'layers.0.q0'\) is not in the graph"):
        heads.patch_edges(model, clean, corrupted, _logit_diff, [("layers.1.h0", "layers.0.q0")])


def test_eap_and_faithfulness_equal_transformer_lens_on_the_same_gpt2(tmp_path):
    """TransformerLens 4.3 (the `lens` extra): attribution_patch at edge granularity scores each edge per position;
    summed over positions its scores equal edge_attribution's within 1e-4 on the same GPT-2 (their nodes mapped to
    ours), and its faithfulness of the same circuit (kept at every position) equals ours."""
    import copy

    T = pytest.importorskip("transformers")
    pytest.importorskip("transformer_lens")
    from transformer_lens.model_bridge import TransformerBridge
    from transformer_lens.tools.analysis import attribution_patching as ap

    import multihead.hf as mhf

    torch.manual_seed(0)
    model = T.GPT2LMHeadModel(T.GPT2Config(vocab_size=50, n_positions=16, n_embd=32, n_layer=2, n_head=4)).eval()
    model.save_pretrained(tmp_path)
    bridge = TransformerBridge.boot_transformers(str(tmp_path), hf_model=copy.deepcopy(model), device="cpu")
    ours = mhf.attach(copy.deepcopy(model))
    g = torch.Generator().manual_seed(1)
    clean = torch.randint(0, 50, (3, 8), generator=g)
    corrupted = clean.clone()
    corrupted[:, 2:4] = torch.randint(0, 50, (3, 2), generator=g)

    def tl_metric(logits):
        return (logits[:, -1, 3] - logits[:, -1, 5]).mean()

    def metric(out):
        return out.logits[:, -1, 3] - out.logits[:, -1, 5]

    def name(n):  # TransformerLens' node -> ours
        if n.kind in ("embed", "logits"):
            return n.kind
        at = f"transformer.h.{n.layer}"
        if n.kind in ("mlp_out", "mlp_in"):
            return f"{at}.mlp" + (".in" if n.kind == "mlp_in" else "")
        return f"{at}.attn.{'h' if n.kind == 'attn_head_out' else n.kind[0]}{n.head}"

    res = ap.attribution_patch(bridge, clean, corrupted, tl_metric, ap.EdgeAttributionConfig(granularity="edge"))
    summed: dict = {}
    for (w, r), v in res.edge_scores.items():
        summed[(name(w), name(r))] = summed.get((name(w), name(r)), 0.0) + v
    s = heads.edge_attribution(ours, {"input_ids": clean}, {"input_ids": corrupted}, metric)
    assert set(summed) == set(s.edges) and len(s.edges) == 110
    theirs = torch.tensor([summed[e] for e in s.edges], dtype=torch.float64)
    assert (theirs - s.scores).abs().max() < 1e-4 and s.scores.abs().max() > 1e-3

    def node(n, p):  # ours -> TransformerLens' node at position p
        if n in ("embed", "logits"):
            return ap.Node(n, p) if n == "embed" else ap.Node("logits", p, layer=1)
        parts = n.split(".")
        if parts[3] == "mlp":
            return ap.Node("mlp_in" if parts[-1] == "in" else "mlp_out", p, layer=int(parts[2]))
        kind = {"h": "attn_head_out", "q": "q_input", "k": "k_input", "v": "v_input"}[parts[-1][0]]
        return ap.Node(kind, p, layer=int(parts[2]), head=int(parts[-1][1:]))

    one, other = {"input_ids": clean[:1]}, {"input_ids": corrupted[:1]}
    circuit = heads.edge_attribution(ours, one, other, metric).circuit(0.2)
    fr = ap.faithfulness(bridge, clean[:1], corrupted[:1], tl_metric,
                         [(node(w, p), node(r, p)) for w, r in circuit for p in range(8)])
    fo = heads.faithfulness(ours, one, other, metric, circuit)
    assert fo.f == pytest.approx(fr.recovered, abs=1e-4) and 0.05 < fo.f < 0.95  # a circuit between the two ends
    assert fo.full == pytest.approx(fr.full_metric, abs=1e-5) and fo.empty == pytest.approx(fr.corrupt_metric, abs=1e-5)


def test_the_projection_route_equals_the_general_route(monkeypatch):
    """The readers' gradients taken through each head's own projection columns (the route the layouts allow: Llama's
    grouped key/value heads, rotary embeddings, the norm before) equal the general route (every head's copy of the
    stream backpropagated through the whole norm and projections), which stays for modules without a layout."""
    T = pytest.importorskip("transformers")
    import multihead.hf as mhf
    from multihead.heads import circuits

    torch.manual_seed(0)
    model = mhf.attach(T.LlamaForCausalLM(T.LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64,
                                                        num_hidden_layers=2, num_attention_heads=4,
                                                        num_key_value_heads=2)).eval())
    g = torch.Generator().manual_seed(2)
    clean = {"input_ids": torch.randint(0, 50, (2, 7), generator=g)}
    corrupted = {"input_ids": clean["input_ids"].clone()}
    corrupted["input_ids"][:, 2] = (corrupted["input_ids"][:, 2] + 7) % 50

    def metric(out):
        return out.logits[:, -1, 3] - out.logits[:, -1, 5]

    took, route = [], circuits._through_projections

    def spy(*a):
        out = route(*a)
        took.append(out is not None)
        return out

    monkeypatch.setattr(circuits, "_through_projections", spy)
    fast = heads.edge_attribution(model, clean, corrupted, metric)
    assert took == [True, True]  # both layers took the projection route
    monkeypatch.setattr(circuits, "_through_projections", lambda *a: None)
    general = heads.edge_attribution(model, clean, corrupted, metric)
    assert (fast.scores - general.scores).abs().max() < 1e-6 * general.scores.abs().max()
    assert general.scores.abs().max() > 1e-3


# ----------------------------------------------------------------------- circuits that hold together (issue 81, 1)


def _owners(graph, reader: str) -> list[str]:
    """The node a reader feeds, from its name alone: a head's query its head, a key/value head's key or value every
    query head of its group (h // (H / Hkv) == g), an MLP's input the MLP, the logits themselves."""
    if reader == "logits":
        return ["logits"]
    if reader.endswith(".in"):
        return [reader[:-3]]
    attn, kind, i = reader.rpartition(".")[0], reader.rpartition(".")[2][0], int(reader.rpartition(".")[2][1:])
    if kind == "q":
        return [f"{attn}.h{i}"]
    H, Hkv = graph.sizes[attn]
    return [f"{attn}.h{h}" for h in range(H) if h // (H // Hkv) == i]


def _dangling(graph, circuit) -> list[tuple[str, str]]:
    """The edges of ``circuit`` on no path from the embedding to the logits through the circuit's own edges: found by
    a search over nodes (writers and the logits), independent of heads.circuits."""
    out_of: dict[str, set] = {}
    for w, r in circuit:
        out_of.setdefault(w, set()).update(_owners(graph, r))
    seen, todo = {"embed"}, ["embed"]  # forward from the embedding
    while todo:
        for n in out_of.get(todo.pop(), ()):
            if n not in seen:
                seen.add(n)
                todo.append(n)
    into: dict[str, set] = {}
    for w, targets in out_of.items():
        for n in targets:
            into.setdefault(n, set()).add(w)
    back, todo = {"logits"}, ["logits"]  # backward from the logits
    while todo:
        for n in into.get(todo.pop(), ()):
            if n not in back:
                back.add(n)
                todo.append(n)
    return [(w, r) for w, r in circuit if w not in seen or not any(n in back for n in _owners(graph, r))]


def _greedy_by_hand(s, n: int) -> list[tuple[str, str]]:
    """EAP-IG's greedy construction written out: n times, of the edges not yet taken whose reader feeds a node in the
    circuit (the logits at first), the one of largest |score| (the earlier on a tie); its writer joins the circuit."""
    owners = [_owners(s.graph, r) for _, r in s.edges]
    mag = s.scores.abs().tolist()
    nodes, taken = {"logits"}, set()
    for _ in range(n):
        open_ = [i for i in range(len(s.edges)) if i not in taken and any(o in nodes for o in owners[i])]
        if not open_:
            break
        best = max(open_, key=lambda i: (mag[i], -i))
        taken.add(best)
        nodes.add(s.edges[best][0])
    return [s.edges[i] for i in sorted(taken)]


def _models():
    """Three models, each with a clean and a corrupted input and a metric: the course's 2-layer attention-only model
    (81 edges), GPT-2 with MLPs (110) and Llama with MLPs and 4 query heads sharing 2 key/value heads (86)."""
    T = pytest.importorskip("transformers")
    import multihead.hf as mhf

    torch.manual_seed(0)
    gpt2 = mhf.attach(T.GPT2LMHeadModel(T.GPT2Config(vocab_size=50, n_positions=16, n_embd=32, n_layer=2,
                                                     n_head=4)).eval())
    llama = mhf.attach(T.LlamaForCausalLM(T.LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64,
                                                        num_hidden_layers=2, num_attention_heads=4,
                                                        num_key_value_heads=2)).eval())
    ids = torch.randint(0, 50, (2, 6))
    other = {"input_ids": torch.cat([torch.randint(0, 50, (2, 3)), ids[:, 3:]], 1)}  # (B, L): the first half changed

    def logit_diff(out):
        return out.logits[:, -1, 3] - out.logits[:, -1, 5]

    return [(_two_layers(), *_pair(), _logit_diff), (gpt2, {"input_ids": ids}, other, logit_diff),
            (llama, {"input_ids": ids}, other, logit_diff)]


def _graphs():
    """The three models' graphs (:func:`_models`)."""
    return [heads.circuit_graph(model, clean) for model, clean, _, _ in _models()]


def test_every_circuit_holds_together_pruned_and_greedy_as_written_out():
    """On three graphs (no MLP; GPT-2's MLPs; Llama's MLPs and grouped key/value heads), each under 4 draws of scores
    (heavy-tailed, so that the top edges join at random): at every budget, every edge of the pruned and of the greedy
    circuit lies on a path from the embedding to the logits through the circuit (a search written here); the pruned
    circuit is exactly the top floor(budget x edges) by |score| less its dangling edges (MIB's), the greedy one is the
    greedy construction written out, then pruned; "top" is the raw top ceil(budget x edges), and with every edge all
    three are the whole graph."""
    for graph in _graphs():
        n = len(graph.edges)
        for seed in range(4):
            g = torch.Generator().manual_seed(seed)
            scores = torch.randn(n, generator=g, dtype=torch.float64) ** 3
            s = heads.EdgeScores(graph, list(graph.edges), scores, 0.0, 1.0, "eap", "denoise")
            for b in (0.01, 0.05, 0.1, 0.2, 0.5, 1.0):
                k = int(b * n + 1e-9)
                top = [e[:2] for e in s.top(k)]
                pruned, greedy = s.circuit(b), s.circuit(b, how="greedy")
                assert pruned == s.circuit(b, how="pruned") and not _dangling(graph, pruned) and len(pruned) <= k
                gone = set(_dangling(graph, top))
                assert pruned == [e for e in top if e not in gone], (b, seed)
                by_hand = _greedy_by_hand(s, k)
                assert set(greedy) == set(by_hand) - set(_dangling(graph, by_hand)), (b, seed)
                assert not _dangling(graph, greedy) and len(greedy) <= k
                assert s.circuit(b, how="top") == [e[:2] for e in s.top(math.ceil(b * n - 1e-9))]
            assert len(s.circuit(1.0)) == len(s.circuit(1.0, how="greedy")) == len(s.circuit(1.0, how="top")) == n
            assert s.circuit(top=7, how="greedy") == s.circuit(7 / n + 1e-12, how="greedy")
            t = float(scores.abs().median())
            assert s.circuit(threshold=t) == [e for e in s.circuit(threshold=t, how="top") if
                                              e not in _dangling(graph, s.circuit(threshold=t, how="top"))]


def test_a_dangling_edge_changes_nothing_so_a_circuit_and_its_pruned_form_have_the_same_f():
    """Pruning is free: an edge on no input-to-logits path of its circuit changes no reader the logits depend on (a
    writer that no kept edge reaches from the embedding computes what it computes in the corrupted run; a node whose
    output reaches the logits through no kept edge is read corrupted everywhere), so f of a circuit equals f of the
    circuit less its dangling edges, exactly up to rounding. On the three models (no MLP; GPT-2's MLPs; Llama's
    grouped key/value heads), 4 random circuits each of 10% to 40% of the edges, most with dangling edges. It is
    why searching the circuits that hold together searches them all."""
    for model, clean, corrupted, metric in _models():
        graph = heads.circuit_graph(model, clean)
        g, dangled = torch.Generator().manual_seed(0), 0
        for share in (0.1, 0.2, 0.3, 0.4):
            pick = torch.randperm(len(graph.edges), generator=g)[:int(share * len(graph.edges))].tolist()
            circuit = [graph.edges[i] for i in sorted(pick)]
            gone = set(_dangling(graph, circuit))
            dangled += bool(gone)
            whole = heads.faithfulness(model, clean, corrupted, metric, circuit)
            pruned = heads.faithfulness(model, clean, corrupted, metric, [e for e in circuit if e not in gone])
            assert whole.f == pytest.approx(pruned.f, abs=1e-5), (share, whole, pruned, sorted(gone))
        assert dangled >= 3, (type(model).__name__, dangled)


def test_a_bad_budget_or_construction_is_refused_naming_the_argument_before_any_forward():
    """A budget outside (0, 1] (a count passed as a budget: the fix named), a count below 1, an unknown construction,
    greedy with a threshold, an empty or repeated list of constructions: one line each, before any forward."""
    model, clean, corrupted, s, refused, _ = _refusals()

    refused(r"^budget: an edge budget must be in \(0, 100%\] of the edges \(a fraction such as 0.05, or '5%'\); got "
            r"13; for 13 edges pass top=13\.$", s.circuit, 13)
    refused(r"^budget: an edge budget must be in \(0, 100%\] .*; got '0%'\.$", s.circuit, "0%")
    refused(r"^budget: an edge budget must be in \(0, 100%\] .*; got -0.1\.$", s.circuit, -0.1, how="greedy")
    for bad in (0, -3, 2.5, True):
        refused(rf"^top must be a whole number of edges >= 1; got {bad!r} \(for a share of the edges pass budget=",
                s.circuit, top=bad)
    refused(r"^how must be 'pruned' \(MIB's: the top n, edges on no input-to-logits path removed\), 'greedy' "
            r"\(EAP-IG's: grown from the logits\) or 'top' \(the raw top n\); got 'best'\.$", s.circuit, 0.05,
            how="best")
    refused(r"^how='greedy' grows a circuit to a number of edges: pass budget= or top=, not threshold=",
            s.circuit, threshold=0.1, how="greedy")
    refused(r"^how must be 'pruned' .*; got 'MIB'\.$", heads.faithfulness_curve, model, clean, corrupted,
            _logit_diff, s, how=("pruned", "MIB"))
    for bad in ((), ("greedy", "greedy")):
        refused(r"^how must name one construction or several, each once \(of pruned, greedy, top\); got",
                heads.faithfulness_curve, model, clean, corrupted, _logit_diff, s, how=bad)
    refused(r"^budgets: an edge budget must be in \(0, 100%\] .*; got 5\.$", heads.faithfulness_curve, model, clean,
            corrupted, _logit_diff, s, budgets=[0.05, 5])
