"""AtP* (Kramár et al. 2024) in heads.circuits: the query/key correction against exact edge patching -- equal to it
where the metric is linear in the heads' outputs (the last layer of the course's attention-only model), and right where
EAP's linear estimate misses a saturated head; node scores against activation patching per head; GradDrop against the
same estimate written out by hand with one layer's gradient cut; bad input refused before any forward."""

from __future__ import annotations

import pytest
import torch

from multihead import heads
from test_circuits import _pair, _two_layers
from test_patching import _by_hand, _logit_diff


def _qk_edges(scores, layer: str) -> list[tuple[str, str]]:
    """The edges into ``layer``'s queries and keys."""
    return [e for e in scores.edges if e[1].startswith(layer + ".") and e[1].rsplit(".", 1)[1][0] in "qk"]


def test_the_query_key_correction_equals_exact_edge_patching_where_it_is_exact_by_construction():
    """TwoLayers (attention only, no norm, a linear readout): after layer 1's heads' outputs the metric is linear, so
    AtP*'s score of every single edge into layer 1's queries and keys equals exact edge patching (to float32's
    rounding); EAP's does not. Every other edge keeps EAP's score exactly. Node scores with method="eap" are
    heads.attribution's per-head estimates."""
    model = _two_layers()
    clean, corrupted = _pair()
    atp = heads.edge_attribution(model, clean, corrupted, _logit_diff, method="atp*", graddrop=False)
    eap = heads.edge_attribution(model, clean, corrupted, _logit_diff)
    assert atp.method == "atp*" and not atp.graddrop and atp.edges == eap.edges
    qk = _qk_edges(atp, "layers.1")
    assert len(qk) == 5 * 8  # 5 writers (the embedding, layer 0's heads) x (4 queries + 4 keys)
    exact = heads.patch_edges(model, clean, corrupted, _logit_diff, qk, chunk=24)
    idx = atp.graph.index(qk)
    span = float(exact.scores.abs().max())
    assert span > 1e-3
    assert float((atp.scores[idx] - exact.scores).abs().max()) < 1e-5 * max(1.0, span)
    assert float((eap.scores[idx] - exact.scores).abs().max()) > 0.1 * span  # the linear estimate is not exact
    rest = torch.ones(len(atp.edges), dtype=torch.bool)
    rest[idx] = False
    rest[atp.graph.index(_qk_edges(atp, "layers.0"))] = False
    assert torch.equal(atp.scores[rest], eap.scores[rest])
    nodes = heads.node_attribution(model, clean, corrupted, _logit_diff, method="eap")
    by_patching = heads.attribution(model, clean, corrupted, _logit_diff)
    for name, v in nodes.heads().items():
        assert torch.allclose(v, by_patching.values[name] - by_patching.base, atol=1e-6), name
    assert nodes.nodes == atp.graph.writers and nodes.base == pytest.approx(eap.base)


def _saturated():
    """TwoLayers with layer 1's queries scaled 100x: its softmax is nearly one-hot at the last position."""
    model = _two_layers()
    with torch.no_grad():
        model.layers[1].q_proj.weight.mul_(100.0)
    return model


def test_atp_star_finds_what_eap_misses_in_a_saturated_head():
    """A saturated head (every head of layer 1 puts > 0.9 of its weight on one key at the last query): patching an
    edge into a key moves which key wins, and EAP's gradient there is near zero. AtP* equals exact edge patching on
    every edge into layer 1's queries and keys (within 1e-5 of the largest effect); EAP's largest miss is most of the
    effect (the largest: EAP -2e-5 where the patch moves the metric by -0.098). Per head (the node's output patched,
    heads.patch), AtP*'s sum over the head's edges is closer to the real patch than attribution patching's (a head
    moving a later head's query and key together is the sum of the two, not their joint effect: approximate)."""
    model = _saturated()
    clean, corrupted = _pair()
    with torch.no_grad():
        _, qkv, _ = _by_hand(model, corrupted)
        q, k, _ = qkv[1]
        w = ((q[:, :, -1:] @ k.transpose(-1, -2)) / 2.0).softmax(-1)  # (B, H, 1, L): scale 1/sqrt(D), D = 4
    assert float(w.amax(-1).min()) > 0.9
    atp = heads.edge_attribution(model, clean, corrupted, _logit_diff, method="atp*", graddrop=False)
    eap = heads.edge_attribution(model, clean, corrupted, _logit_diff)
    qk = _qk_edges(atp, "layers.1")
    exact = heads.patch_edges(model, clean, corrupted, _logit_diff, qk, chunk=24)
    idx = atp.graph.index(qk)
    span = float(exact.scores.abs().max())
    j = int(exact.scores.abs().argmax())
    assert qk[j][1].rsplit(".", 1)[1][0] == "k"  # the largest effect is a key's
    assert float((atp.scores[idx] - exact.scores).abs().max()) < 1e-5 * max(1.0, span)
    assert float((eap.scores[idx] - exact.scores).abs().max()) > 0.5 * span, (eap.scores[idx][j], exact.scores[j])
    patched = heads.patch(model, clean, corrupted, _logit_diff)
    real = patched.values["layers.0"] - patched.base  # (H,): each layer-0 head's output patched
    est = heads.node_attribution(model, clean, corrupted, _logit_diff, graddrop=False).heads()["layers.0"]
    lin = heads.node_attribution(model, clean, corrupted, _logit_diff, method="eap").heads()["layers.0"]
    assert float((lin - real).abs().max()) > 2 * float((est - real).abs().max()), (real, est, lin)
    assert float((est - real).abs().max()) < 0.2 * float(real.abs().max())


def _direct(model, base, source, h: int) -> float:
    """The edge embed -> layer 0's query h patched, with layer 1's output held at the base run's (its gradient
    dropped: what GradDrop's layer-1 term sees), written out without hooks."""
    with torch.no_grad():
        B, L = base.shape
        x0 = model.embed(base) + model.pos[:L]  # (B, L, E)
        change = model.embed(source) - model.embed(base)
        lay = model.layers[0]
        new_q = lay.q_proj(x0 + change).view(B, L, 4, 4).transpose(1, 2)  # (B, H, L, D)

        def put(q, k, v):
            q = q.clone()
            q[:, h] = new_q[:, h]
            return q, k, v

        logits, _, outs = _by_hand(model, base)
        _, _, moved = _by_hand(model, base, inputs={0: put})
        step = lay.o_proj(moved[0].reshape(B, L, 16)) - lay.o_proj(outs[0].reshape(B, L, 16))  # (B, L, E)
        x2 = x0 + lay.o_proj(outs[0].reshape(B, L, 16)) + model.layers[1].o_proj(outs[1].reshape(B, L, 16))
        return float((_logit_diff(model.out(x2 + step)) - _logit_diff(logits)).mean())


def test_graddrop_is_the_mean_of_the_scores_with_each_other_layer_dropped():
    """Two layers: an edge into layer 0 has one other layer, so its GradDrop score is |its AtP* score with layer 1's
    gradient dropped| -- for a query edge, the patch through layer 0's head straight to the logits, written out by
    hand; an edge into layer 1 or the logits is |its signed AtP* score| (dropping layer 0 leaves its gradient). Per
    node, a layer-1 head's is |its signed score|."""
    model = _two_layers()
    clean, corrupted = _pair()
    gd = heads.edge_attribution(model, clean, corrupted, _logit_diff, method="atp*")
    signed = heads.edge_attribution(model, clean, corrupted, _logit_diff, method="atp*", graddrop=False)
    assert gd.graddrop and bool((gd.scores >= 0).all())
    late = torch.tensor([not r.startswith("layers.0.") for _, r in gd.edges])
    assert torch.allclose(gd.scores[late], signed.scores[late].abs(), rtol=1e-9, atol=1e-12)
    for h in range(4):
        got = float(gd.scores[gd.graph.index([("embed", f"layers.0.q{h}")])])
        want = abs(_direct(model, corrupted, clean, h))
        assert got == pytest.approx(want, abs=1e-6 + 1e-4 * want), h
    assert float((gd.scores[~late] - signed.scores[~late].abs()).abs().max()) > 1e-4  # layer 1's path mattered
    nodes = heads.node_attribution(model, clean, corrupted, _logit_diff)
    plain = heads.node_attribution(model, clean, corrupted, _logit_diff, graddrop=False)
    assert torch.allclose(nodes.heads()["layers.1"], plain.heads()["layers.1"].abs(), atol=1e-12)


def test_atp_star_runs_on_grouped_rotary_models_and_bad_input_is_refused():
    """A Llama with grouped key/value heads, its MIB graph too: AtP*'s key scores sum over the query heads of a group
    (ungrouped: one per query head) and agree with exact edge patching on the last layer's queries and keys to first
    order in what follows the heads (an MLP, the final norm). graddrop with another method, a non-bool graddrop and
    graddrop on one layer are refused before any forward."""
    T = pytest.importorskip("transformers")
    import multihead.hf as mhf

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

    for ungroup in (False, True):
        s = heads.edge_attribution(model, clean, corrupted, metric, method="atp*", graddrop=False, ungroup=ungroup)
        qk = _qk_edges(s, "model.layers.1.self_attn")
        assert len(qk) == 6 * (4 + (4 if ungroup else 2))
        exact = heads.patch_edges(model, clean, corrupted, metric, qk, ungroup=ungroup)
        span = float(exact.scores.abs().max())
        assert span > 0 and float((s.scores[s.graph.index(qk)] - exact.scores).abs().max()) < 0.01 * span

    def refused(match, **kw):
        with pytest.raises((ValueError, TypeError), match=match):
            heads.edge_attribution(model, clean, corrupted, metric, **kw)

    refused(r"graddrop is part of AtP\*: pass method='atp\*' \(got method='eap'\)", graddrop=True)
    refused(r"graddrop must be True or False \(AtP\*'s GradDrop\); got 'yes'", method="atp*", graddrop="yes")
    one = _two_layers()
    del one.layers[1]
    with pytest.raises(ValueError, match="the model has one attention layer; pass graddrop=False"):
        heads.node_attribution(one, *_pair(), _logit_diff)
