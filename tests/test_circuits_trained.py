"""Circuits (heads.circuits) on two models trained here whose circuit is small by construction (issue 66, point 4b):
the known edges rank on top, and the circuit of 5% of the edges carries the behaviour (faithfulness f >= 0.8).

The model (:class:`Sparse`): tokens -> embedding (no positions) -> 8 heads of size 8 on a 32-wide stream -> 8 causal
heads -> logits, 257 edges. Layer 0's head 0 can attend only to the token before (its mask); layer 0's other heads
only to their own token, so none of them carries anything about another position: the only positional signal is
head 0's. A group-lasso penalty on each head's rows of the output projection (ramped in over the first half of
training) leaves one layer-1 head doing the task. Two tasks, two compositions (Elhage et al. 2021; Olsson et al. 2022):

- induction (K-composition): 8 distinct tokens of 16, then the same again; each repeated token predicts the one after
  its first occurrence. Known edges: embed -> head 0's value, head 0 -> the induction head's key, embed -> the
  induction head's value, the induction head -> logits.
- look-back (V-composition): 8 distinct tokens, then the same tokens in another order in their "query" form
  (token + 16); each query predicts the token *before* its first occurrence. Known edges: embed -> head 0's value,
  head 0 -> the retrieving head's value, embed -> the retrieving head's key, the retrieving head -> logits.

Corrupted runs: the first half other distinct tokens (the second half kept). Metric: minus the second half's loss.
Training: 400 Adam steps (seed 1; seed 0's look-back stalls on a plateau at loss 2.1, which the training's own check
refuses). Measured with this file's code over seeds 0-5 (11 models: the look-back's seed 0 left out): EAP-IG's circuit
of 5% of the edges (13 of 257) had f 0.83 - 1.0 in both directions, the four known edges all in it (8th at worst);
EAP (first order) ranks the task head's output edge within its top 3, but its 5% circuit ranged f 0.15 - 1.0
(denoising) and -0.10 - 1.0 (noising): where the task head's attention is saturated the gradient through the
previous-token head is near zero, so that head's edges fall out of the top 13 (on seed 1, noising: f 0.24 on both
tasks). So EAP-IG is held to f >= 0.8, and EAP to what it holds on every seed."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import multihead
from multihead import MultiHeadAttention, heads, masks

N, V, H = 8, 16, 8  # a half's tokens; content tokens (the look-back's queries are V..2V-1); heads per layer


class Sparse(nn.Module):
    """Tokens -> embedding -> layer 0 (head 0: the token before; heads 1..7: the token itself) -> causal layer 1 ->
    logits; every head writes through its own columns of the output projection."""

    def __init__(self, vocab=2 * V, E=32, D=8):
        super().__init__()
        self.embed = nn.Embedding(vocab, E)
        self.layers = nn.ModuleList(MultiHeadAttention(E, H, bias=True, head_dim=D) for _ in range(2))
        self.out = nn.Linear(E, vocab)

    def forward(self, ids):
        L = ids.shape[1]
        i = torch.arange(L, device=ids.device)
        before = i[None, :] == (i[:, None] - 1).clamp(min=0)  # (Lq, Lk): the token before (position 0: itself)
        itself = i[None, :] == i[:, None]  # (Lq, Lk)
        keep = torch.stack([before] + [itself] * (H - 1))[None]  # (1, H, Lq, Lk)
        x = self.embed(ids)  # (B, L, E)
        x = x + self.layers[0](x, mask=masks.Dense(keep))
        x = x + self.layers[1](x, mask=masks.Causal())
        return self.out(x)  # (B, L, vocab)


def _distinct(g, B):
    return torch.rand(B, V, generator=g).argsort(-1)[:, :N]  # (B, N): N distinct tokens of V


def _batch(task, g, B):
    """(ids (B, 2N), targets (B, N) for the second half's positions; -100: none)."""
    half = _distinct(g, B)
    if task == "induction":
        return torch.cat([half, half], 1), torch.cat([half[:, 1:], torch.full((B, 1), -100)], 1)
    order = torch.rand(B, N, generator=g).argsort(-1)  # (B, N): the order the tokens are asked in
    before = torch.cat([torch.full((B, 1), -100), half[:, :-1]], 1)  # (B, N): the token before each one
    return torch.cat([half, half.gather(1, order) + V], 1), before.gather(1, order)


def _loss(logits, targets):
    """(B,): the second half's mean loss."""
    got = F.cross_entropy(logits[:, N:].transpose(1, 2), targets, ignore_index=-100, reduction="none")  # (B, N)
    return got.sum(-1) / (targets != -100).sum(-1)


def _lasso(model) -> list[torch.Tensor]:
    """Per layer, the sum over heads of the norm of each head's columns of the output projection."""
    return [layer.o_proj.weight.view(32, H, 8).norm(dim=(0, 2)).sum() for layer in model.layers]  # (E, H, D)


@functools.lru_cache(maxsize=2)
def _trained(task: str, steps: int = 400, seed: int = 1) -> Sparse:
    """The model trained on ``task`` once per process (a few seconds on one thread)."""
    torch.manual_seed(seed)
    model = Sparse()
    model(torch.zeros(1, 2 * N, dtype=torch.long))  # builds the lazy layers
    opt = torch.optim.Adam(model.parameters(), 2e-2)
    decay = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1 - k / steps)
    g = torch.Generator().manual_seed(seed)
    for step in range(steps):
        ids, targets = _batch(task, g, 32)
        loss = _loss(model(ids), targets).mean()
        first, second = _lasso(model)
        ramp = min(1.0, 2 * step / steps)
        opt.zero_grad()
        (loss + ramp * (0.06 * first + 0.1 * second)).backward()
        opt.step()
        decay.step()
    assert loss.item() < 0.05, f"the {task} circuit did not form (loss {loss.item():.3f})"
    return model.eval()


@pytest.fixture(scope="module", params=["induction", "look-back"])
def trained(request):
    """The trained model, a clean batch and its corruption, the metric, the layer-1 head doing the task (the one
    attending where the task says, weighted by its output's norm), its weight there, and the circuit's known edges."""
    task = request.param
    model = _trained(task)
    clean, targets = _batch(task, torch.Generator().manual_seed(9), 8)
    corrupted = clean.clone()
    corrupted[:, :N] = _distinct(torch.Generator().manual_seed(5), 8)
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

    def metric(out):
        return -_loss(out, targets)

    return model, clean, corrupted, metric, known, float(looked[r])


def test_the_known_edges_rank_on_top_and_five_percent_of_the_edges_carry_the_task(trained):
    """The task's layer-1 head attends where the task says (weight > 0.9). EAP-IG (5 steps), denoising and noising:
    the four known edges are in its circuit of 5% of the edges (its top 13 of 257), and that circuit has f >= 0.8, the same f
    as the faithfulness curve's at 5%. EAP (denoising and noising) ranks the task head's output edge within its top 3 and
    its value or key edge within the top 6; its 5% circuit's f is computed the same way but not held to 0.8 (see the
    module's docstring: it is not on every seed)."""
    model, clean, corrupted, metric, known, looked = trained
    assert looked > 0.9, looked
    for method in ("eap-ig", "eap"):
        for direction in ("denoise", "noise"):
            s = heads.edge_attribution(model, clean, corrupted, metric, method=method, direction=direction, steps=5)
            assert len(s.edges) == 257 and all(e in s.edges for e in known)
            order = [e[:2] for e in s.top(len(s.edges))]
            rank = [order.index(e) for e in known]
            f = heads.faithfulness(model, clean, corrupted, metric, s.circuit(0.05))
            curve = heads.faithfulness_curve(model, clean, corrupted, metric, s)
            assert f.kept == 13 and f.f == pytest.approx(curve.f[curve.budgets.index(0.05)], abs=1e-6)
            if method == "eap-ig":
                assert max(rank) < 13 and f.f >= 0.8, (direction, known, rank, f, order[:13])
            else:
                assert rank[3] < 3 and min(rank[1:3]) < 6, (direction, known, rank, order[:13])
