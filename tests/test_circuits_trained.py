"""Circuits (heads.circuits) on models trained in the tests whose circuit is small by construction (issue 66, point
4b; the models, their tasks and their training: :mod:`multihead.models.sparse_circuits`): the known edges rank on top,
and the circuit of 5% of the edges carries the behaviour (faithfulness f >= 0.8). Known edges -- induction:
embed -> head 0's value, head 0 -> the induction head's key, embed -> the induction head's value, the induction head
-> logits; look-back: embed -> head 0's value, head 0 -> the retrieving head's value, embed -> the retrieving head's
key, the retrieving head -> logits.

Corrupted runs: the first half other distinct tokens (the second half kept). Metric: minus the second half's loss.
Training: 400 Adam steps (seed 1; seed 0's look-back stalls on a plateau at loss 2.1, which the training's own check
refuses). Measured with this file's code over seeds 0-5 (11 models: the look-back's seed 0 left out): EAP-IG's circuit
of 5% of the edges (13 of 257) had f 0.83 - 1.0 in both directions, the four known edges all in it (8th at worst);
EAP (first order) ranks the task head's output edge within its top 3, but its 5% circuit ranged f 0.15 - 1.0
(denoising) and -0.10 - 1.0 (noising). The cause (measured on seed 1,
test_eap_noising_is_blind_to_the_task_heads_key_and_the_constructions_are_not_the_cause): the task head attends to
one key with weight > 0.999 in the clean run, noising's base, where the norm of the metric's gradient at that head's
key is 3e-5 (induction) and 4e-9 (look-back), against 0.27 and 0.20 in the corrupted run, denoising's base; every
edge into that key scores below 1e-3 of EAP's largest when noising. A 5% circuit with f >= 0.8 exists (EAP-IG's; the
best found by removing edges one at a time on exact patching: f 0.98 and 0.995 at 12 edges), and the same
constructions fed exact single-edge effects instead of EAP's scores give f 0.97 and 0.78: the scores fail, not the
constructions. So EAP-IG is held to f >= 0.8, and EAP to what it holds on every seed."""

from __future__ import annotations

import functools

import pytest
import torch

import multihead
from multihead import heads
from multihead.models.sparse_circuits import H, N, V, case
from test_circuits import _dangling


@pytest.fixture(scope="module", params=["induction", "look-back"])
def trained(request):
    """The trained model, a clean batch and its corruption, the metric, the layer-1 head doing the task (the one
    attending where the task says, weighted by its output's norm), its weight there, and the circuit's known edges."""
    task = request.param
    model, clean, corrupted, metric = case(task)
    with torch.no_grad(), multihead.capture(model) as cap:
        model(clean)
    if task == "induction":
        q = torch.arange(N, 2 * N - 1)
        looked = cap["layers.1"][:, :, q, q - N + 1].mean((0, 2))  # (H,): on the token after the first occurrence
    else:
        first = (clean[:, N:, None] - V == clean[:, None, :N]).float().argmax(-1)  # (B, N): where each query's token was
        w = cap["layers.1"][:, :, N:, :N]  # (B, H, N, N): the second half's weights on the first half
        looked = w.gather(3, first[:, None, :, None].expand(-1, H, -1, 1))[..., 0].mean((0, 2))  # (H,)
    writes = model.layers[1].o_proj.weight.detach().view(32, H, 8).norm(dim=(0, 2))  # (H,): each head's (E, D) norm
    r = int((looked * writes).argmax())
    via, token = ("k", "v") if task == "induction" else ("v", "k")
    known = [("embed", "layers.0.v0"), ("layers.0.h0", f"layers.1.{via}{r}"), ("embed", f"layers.1.{token}{r}"),
             (f"layers.1.h{r}", "logits")]
    return model, clean, corrupted, metric, known, float(looked[r])


def test_the_known_edges_rank_on_top_and_five_percent_of_the_edges_carry_the_task(trained):
    """The task's layer-1 head attends where the task says (weight > 0.9). EAP-IG (5 steps), denoising and noising:
    the four known edges are in its circuit of 5% of the edges (its top 13 of 257), and that circuit has f >= 0.8, the same f
    as the faithfulness curve's at 5%. EAP (denoising and noising) ranks the task head's output edge within its top 3 and
    its value or key edge within the top 6; its 5% circuit's f is computed the same way but not held to 0.8 (see the
    module's docstring: it is not on every seed). The circuits that hold together (MIB's pruned top 12, EAP-IG's greedy
    circuit of 12, each less its dangling edges): every edge on a path from the input to the logits, f the curve's;
    EAP-IG's keep the four known edges and have f >= 0.8."""
    model, clean, corrupted, metric, known, looked = trained
    assert looked > 0.9, looked
    for method in ("eap-ig", "eap"):
        for direction in ("denoise", "noise"):
            s = heads.edge_attribution(model, clean, corrupted, metric, method=method, direction=direction, steps=5)
            assert len(s.edges) == 257 and all(e in s.edges for e in known)
            order = [e[:2] for e in s.top(len(s.edges))]
            rank = [order.index(e) for e in known]
            f = heads.faithfulness(model, clean, corrupted, metric, s.circuit(0.05, how="top"))
            curve = heads.faithfulness_curve(model, clean, corrupted, metric, s, how=("top", "pruned", "greedy"))
            at = curve.budgets.index(0.05)
            assert f.kept == 13 and f.f == pytest.approx(curve.f[at], abs=1e-6)
            if method == "eap-ig":
                assert max(rank) < 13 and f.f >= 0.8, (direction, known, rank, f, order[:13])
            else:
                assert rank[3] < 3 and min(rank[1:3]) < 6, (direction, known, rank, order[:13])
            for how in ("pruned", "greedy"):  # the circuits that hold together: on paths, the same f as the curve's
                c = s.circuit(0.05, how=how)
                fc = heads.faithfulness(model, clean, corrupted, metric, c)
                assert not _dangling(s.graph, c) and 0 < fc.kept == curve[how].kept[at] <= 12
                assert fc.f == pytest.approx(curve[how].f[at], abs=1e-6)
                if method == "eap-ig":
                    assert fc.f >= 0.8 and all(e in c for e in known), (how, direction, fc, c)


@pytest.mark.parametrize("direction", ["denoise", "noise"])
def test_eap_circuits_of_five_percent_that_hold_together(trained, direction, request):
    """The issue's goal for EAP (first order) on these models: its pruned and greedy circuits of 5% of the edges have
    f >= 0.8, denoising and noising. Met on the induction task denoising (f 0.94 both); measured otherwise with this
    file's models (seed 1) -- induction noising: pruned 0.23, greedy 0.21; look-back denoising 0.74, noising 0.11
    (both) -- and kept as expected failures (strict: a change that meets the goal turns them into failures to update),
    not lowered. Look-back denoising is at the edge: the models trained on an AMD EPYC (Zen 4, avx512_bf16 besides)
    gave 0.93 there (induction denoising 0.90; noising 0.25 induction, 0.23 look-back), so that one expected failure
    is not strict. Not the constructions but EAP's scores (measured in the next test): the task head's saturated
    attention leaves the edges into its key no first-order score when noising, and when denoising on the look-back
    gets their signs wrong (layer-0 heads 2-4 into the key and the embedding into their values: EAP -0.14 to -0.25,
    exact patching +0.40 to +0.85), so the 12-edge budget misses a path (the raw top 13, one edge more, gives 0.95)."""
    model, clean, corrupted, metric, known, _ = trained
    task = request.node.callspec.params["trained"]
    if (task, direction) == ("look-back", "denoise"):  # at the edge: the trained model differs by CPU
        request.applymarker(pytest.mark.xfail(strict=False, raises=AssertionError,
                                              reason="EAP's 5% circuit on look-back, denoise: f 0.74 on one Xeon "
                                                     "(avx512f, avx512_vnni), 0.93 on an AMD EPYC (Zen 4)"))
    elif (task, direction) != ("induction", "denoise"):
        request.applymarker(pytest.mark.xfail(strict=True, raises=AssertionError,
                                              reason=f"EAP's 5% circuit on {task}, {direction}: f < 0.8 (measured; "
                                                     "see the docstring)"))
    s = heads.edge_attribution(model, clean, corrupted, metric, direction=direction)
    curve = heads.faithfulness_curve(model, clean, corrupted, metric, s, budgets=[0.05])
    for how in ("pruned", "greedy"):
        assert not _dangling(s.graph, s.circuit(0.05, how=how))
    assert min(curve["pruned"].f[0], curve["greedy"].f[0]) >= 0.8, (curve.to_markdown(), s.top(13))


def test_eap_noising_is_blind_to_the_task_heads_key_and_the_constructions_are_not_the_cause(trained):
    """Why EAP noising's 5% circuits fail above, measured. Noising takes the metric's gradient at the clean run, where
    the task head gives one key all its weight (> 0.999), so the gradient through that head's key vanishes: every edge
    into that key scores below 1e-3 of EAP's largest |score| (measured 3e-4 induction, 3e-7 look-back), while exact
    edge patching puts one of those edges among the 4 largest effects of the 257 (2nd, 3rd). Denoising's base, the
    corrupted run, is not saturated there: an edge into the key scores above 1% of its largest (12%, 2%). The
    constructions are not what fails: fed the exact single-edge effects instead, the same pruned and greedy
    constructions at 5% give f >= 0.75 (0.97 induction; 0.78 look-back, whose key reads its token through several
    layer-0 heads, redundant paths no single edge's effect ranks), where EAP's scores gave 0.23 and 0.11. A 5% circuit
    with f >= 0.8 exists on both (EAP-IG's, in the test above)."""
    model, clean, corrupted, metric, known, looked = trained
    assert looked > 0.999, looked
    key = f"layers.1.k{known[-1][0].rpartition('.h')[2]}"  # the task head's key reader
    eap = heads.edge_attribution(model, clean, corrupted, metric, direction="noise")
    into = torch.tensor([r == key for _, r in eap.edges])  # (257,): the edges into that key
    assert eap.scores[into].abs().max() < 1e-3 * eap.scores.abs().max(), eap.scores[into]
    exact = heads.patch_edges(model, clean, corrupted, metric, eap.edges, direction="noise", chunk=64)
    assert bool(into[exact.scores.abs().argsort(descending=True)[:4]].any()), exact.top(4)
    denoising = heads.edge_attribution(model, clean, corrupted, metric, direction="denoise")
    assert denoising.scores[into].abs().max() > 0.01 * denoising.scores.abs().max(), denoising.scores[into]
    for how in ("pruned", "greedy"):
        by_eap = heads.faithfulness(model, clean, corrupted, metric, eap.circuit(0.05, how=how))
        by_exact = heads.faithfulness(model, clean, corrupted, metric, exact.circuit(0.05, how=how))
        assert by_exact.kept <= 12 and by_exact.f >= 0.75 and by_eap.f < 0.5, (how, by_exact, by_eap)


def test_atp_star_corrects_the_saturated_key_but_not_the_edges_behind_it(trained):
    """AtP* (point 4) does not rescue EAP noising here, measured: its query/key correction recomputes the softmax for
    an edge *into* a query or key, so the edge into the task head's key ranks within its top 3 (second, measured);
    but an edge whose effect reaches the logits *through* that saturated key keeps EAP's vanishing gradient. On the
    induction task that is exact patching's largest effect, embed -> head 0's value (-6.30; AtP* ranks it 25th,
    outside the 12-edge budget). With GradDrop (the default) its 5% circuits' f stays below 0.8 (measured 0.33
    induction, 0.67 look-back, both constructions); signed, without GradDrop, 0.25 induction and 0.87 look-back
    (bench/results/circuit_curves.md). In a 2-layer model GradDrop scores an edge into layer 0 with layer 1's
    gradient dropped, so only the edge's direct path to the logits counts."""
    model, clean, corrupted, metric, known, _ = trained
    atp = heads.edge_attribution(model, clean, corrupted, metric, method="atp*", direction="noise")
    order = [e[:2] for e in atp.top(len(atp.edges))]
    key = [e for e in known if ".k" in e[1]][0]
    assert order.index(key) < 3, (key, atp.top(6))
    exact = heads.patch_edges(model, clean, corrupted, metric, atp.edges, direction="noise", chunk=64)
    if key[0] == "layers.0.h0":  # induction: the previous-token head's value feeds the saturated key
        assert exact.top(1)[0][:2] == ("embed", "layers.0.v0") and order.index(("embed", "layers.0.v0")) >= 12
    curve = heads.faithfulness_curve(model, clean, corrupted, metric, atp, budgets=[0.05])
    assert max(curve["pruned"].f[0], curve["greedy"].f[0]) < 0.8, curve.to_markdown()


# --------------------------------------------------- a circuit through the MLPs: GPT-2 trained to copy two back


@functools.lru_cache(maxsize=1)
def _copy():
    """The copy-two-back GPT-2 attached (once per process), its clean and corrupted batches and metric."""
    pytest.importorskip("transformers")
    import multihead.hf as mhf

    model, clean, corrupted, metric = case("copy-two-back")
    return mhf.attach(model), clean, corrupted, metric


@pytest.mark.parametrize("method,direction", [
    ("eap-ig", "denoise"), ("eap-ig", "noise"), ("eap", "denoise"),
    pytest.param("eap", "noise", marks=pytest.mark.xfail(
        strict=True, raises=AssertionError, reason="EAP noising's 10% circuits leave the MLP out: f 0.34 (pruned, 5 "
                                                   "edges of 11 kept), 0.56 (greedy), measured; the clean run is "
                                                   "sure of every answer, its gradient near zero (next test)")),
])
def test_a_circuit_through_the_mlps_holds_together_at_ten_percent(method, direction):
    """GPT-2 trained here to copy the token two back (the issue's setting, 110 edges): the pruned and greedy circuits
    of 10% of the edges (11 before pruning) lie on input-to-logits paths, run through layer 0's MLP (an edge into its
    input and its edge into the logits both kept) and have f >= 0.8 -- each equal to faithfulness of that circuit
    computed on its own. EAP noising misses it (measured: 0.34 and 0.56; its pruned circuit keeps 5 edges, none of
    the MLP's), kept as a strict expected failure: its scores are gradients at a run that is sure of every answer
    (test_eap_noising_on_the_copy_is_a_first_order_at_a_sure_run_not_a_construction)."""
    model, clean, corrupted, metric = _copy()

    s = heads.edge_attribution(model, clean, corrupted, metric, method=method, direction=direction, steps=5)
    assert len(s.edges) == 110
    curve = heads.faithfulness_curve(model, clean, corrupted, metric, s, budgets=[0.1])
    mlp = "transformer.h.0.mlp"
    for how in ("pruned", "greedy"):
        c = s.circuit(0.1, how=how)
        assert not _dangling(s.graph, c) and len(c) == curve[how].kept[0] <= 11, (how, c)
        assert (mlp, "logits") in c and any(r == f"{mlp}.in" for _, r in c), (how, c)
        f = heads.faithfulness(model, clean, corrupted, metric, c)
        assert f.f == pytest.approx(curve[how].f[0], abs=1e-6)
        assert f.f >= 0.8, (how, f, c)


def test_eap_noising_on_the_copy_is_a_first_order_at_a_sure_run_not_a_construction():
    """Why EAP noising misses the MLP circuit (the expected failure above), measured: the clean run, noising's base,
    is sure of every answer (p > 0.99), so the metric's gradient there is near zero and every EAP noising score is
    below 1e-3 of the largest exact single-edge effect (measured: 3.2e-4 against 2.18), its ranking set by what is
    left of it. Fed those exact effects instead, the same pruned and greedy constructions at 10% run through the MLP
    and have f >= 0.8 (0.996 and 0.999)."""
    model, clean, corrupted, metric = _copy()

    with torch.no_grad():
        sure = model(clean).logits[:, 2:].softmax(-1).gather(-1, clean[:, :-2, None])  # (B, L - 2, 1): p(answer)
    assert sure.min() > 0.99, sure.min()
    eap = heads.edge_attribution(model, clean, corrupted, metric, direction="noise")
    exact = heads.patch_edges(model, clean, corrupted, metric, eap.edges, direction="noise", chunk=64)
    assert eap.scores.abs().max() < 1e-3 * exact.scores.abs().max(), (eap.top(3), exact.top(3))
    mlp = "transformer.h.0.mlp"
    for how in ("pruned", "greedy"):
        c = exact.circuit(0.1, how=how)
        f = heads.faithfulness(model, clean, corrupted, metric, c)
        assert (mlp, "logits") in c and any(r == f"{mlp}.in" for _, r in c), (how, c)
        assert f.kept <= 11 and f.f >= 0.8, (how, f, c)
