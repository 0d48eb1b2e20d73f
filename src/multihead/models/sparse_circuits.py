"""Models whose circuit is small by construction, trained in a few seconds, for the circuit tests and the benchmarks
that read the same circuits (issue 66, point 4b; issue 81).

:class:`Sparse`: tokens -> embedding (no positions) -> 8 heads of size 8 on a 32-wide stream -> 8 causal heads ->
logits, 257 edges. Layer 0's head 0 can attend only to the token before (its mask); layer 0's other heads only to
their own token, so none of them carries anything about another position: the only positional signal is head 0's. A
group-lasso penalty on each head's columns of the output projection (ramped in over the first half of training) leaves
one layer-1 head doing the task. Two tasks, two compositions (Elhage et al. 2021; Olsson et al. 2022):

- ``"induction"`` (K-composition): 8 distinct tokens of 16, then the same again; each repeated token predicts the one
  after its first occurrence.
- ``"look-back"`` (V-composition): 8 distinct tokens, then the same tokens in another order in their "query" form
  (token + 16); each query predicts the token *before* its first occurrence.

:func:`copy_two_back`: a 2-layer GPT-2 (4 heads a layer, E 32, MLPs: 110 edges) trained to copy the token two back,
whose circuit runs through layer 0's MLP (transformers needed; attach it before scoring).

:func:`case` gives each model with the clean and corrupted batches and the metric the tests and benchmarks score it
with (minus the loss)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from multihead import masks
from multihead.layer.module import MultiHeadAttention

N, V, H = 8, 16, 8  # a half's tokens; content tokens (the look-back's queries are V..2V-1); heads per layer
TASKS = ("induction", "look-back")
V2, L2 = 16, 12  # the copy task's vocabulary and length


class Sparse(nn.Module):
    """Tokens -> embedding -> layer 0 (head 0: the token before; heads 1..7: the token itself) -> causal layer 1 ->
    logits; every head writes through its own columns of the output projection."""

    def __init__(self, vocab: int = 2 * V, E: int = 32, D: int = 8):
        super().__init__()
        self.embed = nn.Embedding(vocab, E)
        self.layers = nn.ModuleList(MultiHeadAttention(E, H, bias=True, head_dim=D) for _ in range(2))
        self.out = nn.Linear(E, vocab)

    def forward(self, ids: Tensor) -> Tensor:
        L = ids.shape[1]
        i = torch.arange(L, device=ids.device)
        before = i[None, :] == (i[:, None] - 1).clamp(min=0)  # (Lq, Lk): the token before (position 0: itself)
        itself = i[None, :] == i[:, None]  # (Lq, Lk)
        keep = torch.stack([before] + [itself] * (H - 1))[None]  # (1, H, Lq, Lk)
        x = self.embed(ids)  # (B, L, E)
        x = x + self.layers[0](x, mask=masks.Dense(keep))
        x = x + self.layers[1](x, mask=masks.Causal())
        return self.out(x)  # (B, L, vocab)


def distinct(g: torch.Generator, B: int) -> Tensor:
    """(B, N): N distinct tokens of V per row."""
    return torch.rand(B, V, generator=g).argsort(-1)[:, :N]


def batch(task: str, g: torch.Generator, B: int) -> tuple[Tensor, Tensor]:
    """(ids (B, 2N), targets (B, N) for the second half's positions; -100: none)."""
    if task not in TASKS:
        raise ValueError(f"task must be one of {', '.join(TASKS)}; got {task!r}")
    half = distinct(g, B)
    if task == "induction":
        return torch.cat([half, half], 1), torch.cat([half[:, 1:], torch.full((B, 1), -100)], 1)
    order = torch.rand(B, N, generator=g).argsort(-1)  # (B, N): the order the tokens are asked in
    before = torch.cat([torch.full((B, 1), -100), half[:, :-1]], 1)  # (B, N): the token before each one
    return torch.cat([half, half.gather(1, order) + V], 1), before.gather(1, order)


def loss(logits: Tensor, targets: Tensor) -> Tensor:
    """(B,): the second half's mean loss."""
    got = F.cross_entropy(logits[:, N:].transpose(1, 2), targets, ignore_index=-100, reduction="none")  # (B, N)
    return got.sum(-1) / (targets != -100).sum(-1)


def lasso(model: Sparse) -> list[Tensor]:
    """Per layer, the sum over heads of the norm of each head's columns of the output projection."""
    return [layer.o_proj.weight.view(layer.o_proj.weight.shape[0], H, -1).norm(dim=(0, 2)).sum()  # (E, H, D)
            for layer in model.layers]


@functools.lru_cache(maxsize=2)
def trained(task: str, steps: int = 400, seed: int = 1) -> Sparse:
    """The model trained on ``task`` (one of :data:`TASKS`), once per process (a few seconds on one thread): 400 Adam
    steps (seed 1; seed 0's look-back stalls on a plateau at loss 2.1, which the training's own check refuses)."""
    if task not in TASKS:
        raise ValueError(f"task must be one of {', '.join(TASKS)}; got {task!r}")
    torch.manual_seed(seed)
    model = Sparse()
    model(torch.zeros(1, 2 * N, dtype=torch.long))  # builds the lazy layers
    opt = torch.optim.Adam(model.parameters(), 2e-2)
    decay = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1 - k / steps)
    g = torch.Generator().manual_seed(seed)
    for step in range(steps):
        ids, targets = batch(task, g, 32)
        got = loss(model(ids), targets).mean()
        first, second = lasso(model)
        ramp = min(1.0, 2 * step / steps)
        opt.zero_grad()
        (got + ramp * (0.06 * first + 0.1 * second)).backward()
        opt.step()
        decay.step()
    if not got.item() < 0.05:  # a NaN fails too
        raise RuntimeError(f"the {task} circuit did not form (loss {got.item():.3f})")
    return model.eval()


def two_back(g: torch.Generator, B: int) -> Tensor:
    """(B, L2): random tokens; position t predicts token t - 2."""
    return torch.randint(0, V2, (B, L2), generator=g)


def two_back_loss(logits: Tensor, ids: Tensor) -> Tensor:
    """(B,): the mean loss of predicting each token two back (positions 2..L-1)."""
    return F.cross_entropy(logits[:, 2:].transpose(1, 2), ids[:, :-2], reduction="none").mean(-1)


@functools.lru_cache(maxsize=1)
def copy_two_back() -> nn.Module:
    """A 2-layer GPT-2 (4 heads a layer, E 32, MLPs: 110 edges) trained to copy the token two back, once per process
    (150 Adam steps, ~5 s on one thread), in transformers' own attention: attach it (:func:`multihead.hf.attach`)
    before scoring its circuit. Each call returns the same object, and attaching changes it in place: attach it once.
    The circuit runs embed -> a layer-0 head's value -> the head -> layer 0's MLP -> the logits, beside the heads' own
    edges into the logits."""
    import transformers as T

    torch.manual_seed(0)
    model = T.GPT2LMHeadModel(T.GPT2Config(vocab_size=V2, n_positions=L2, n_embd=32, n_layer=2, n_head=4,
                                           resid_pdrop=0, embd_pdrop=0, attn_pdrop=0))
    opt, g = torch.optim.Adam(model.parameters(), 1e-2), torch.Generator().manual_seed(0)
    for _ in range(150):
        ids = two_back(g, 32)
        got = two_back_loss(model(ids).logits, ids).mean()
        opt.zero_grad()
        got.backward()
        opt.step()
    if not got.item() < 0.05:  # a NaN fails too
        raise RuntimeError(f"the copy did not form (loss {got.item():.3f})")
    return model.eval()


def case(name: str) -> tuple[nn.Module, Tensor, Tensor, Callable]:
    """(model, clean, corrupted, metric) of ``name`` ("induction", "look-back" or "copy-two-back"): 8 clean rows (seed
    9) and their corruption (seed 5: the first half's tokens replaced; for the copy, other random tokens); the metric
    minus the loss of the clean run's answers, (B,). The copy's GPT-2 is :func:`copy_two_back`'s (attach it once)."""
    if name == "copy-two-back":
        model = copy_two_back()
        clean, corrupted = two_back(torch.Generator().manual_seed(9), 8), two_back(torch.Generator().manual_seed(5), 8)

        def copy_metric(out):
            return -two_back_loss(out.logits, clean)

        return model, clean, corrupted, copy_metric
    model = trained(name)
    clean, targets = batch(name, torch.Generator().manual_seed(9), 8)
    corrupted = clean.clone()
    corrupted[:, :N] = distinct(torch.Generator().manual_seed(5), 8)

    def metric(out):
        return -loss(out, targets)

    return model, clean, corrupted, metric
