"""How far a cut decoder language model is from the unpruned one, on text: the next-token KL divergence to the
unpruned model's distributions and the perplexity of the text, each over every real next token; and recovery by
distillation toward those distributions (:func:`multihead.apps.prune.hf_models.recover`, ``causal=True``).

    batches = text_batches(tokenizer, package_sentences(200))     # text neither the cut nor the recovery saw
    f = fidelity(pruned, unpruned, batches)                        # f.kl, f.perplexity, f.reference_perplexity
    recover(pruned, unpruned, text_batches(tokenizer, sentences()), steps=100)

Launched by ``torchrun`` (``WORLD_SIZE`` > 1: :func:`process_group` joins the group), the recovery is data parallel
on PyTorch's own engine: every rank distils its share of each batch's rows through ``DistributedDataParallel``,
which averages the gradients, so the ranks keep one model, the one a single process makes on the whole batches
(within the rounding of the sum) when every share holds as many real tokens (packed windows do).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["NextTokenFidelity", "fidelity", "process_group", "recover", "text_batches"]


@dataclass(frozen=True)
class NextTokenFidelity:
    """``kl``: the mean over next tokens of KL(unpruned || model) in nats; ``perplexity`` / ``reference_perplexity``:
    exp of the mean negative log-likelihood of the text's next tokens under the model / the unpruned model;
    ``tokens``: how many next tokens were scored."""

    kl: float
    perplexity: float
    reference_perplexity: float
    tokens: int


def text_batches(tokenizer, texts: Sequence[str], *, size: int = 8, max_length: int = 64) -> list[dict]:
    """``texts`` tokenized ``size`` at a time, padded on the right (a causal model's real tokens never see the
    padding after them), truncated to ``max_length`` tokens: ``{"input_ids": (B, L), "attention_mask": (B, L)}``."""
    if isinstance(texts, str) or not texts:
        raise ValueError(f"texts must be a non-empty list of strings; got {texts!r:.80}.")
    if tokenizer.pad_token is None:
        raise ValueError("the tokenizer has no pad token: set tokenizer.pad_token (e.g. to its eos_token) first.")
    tokenizer.padding_side = "right"
    out = []
    for i in range(0, len(texts), size):
        enc = tokenizer(list(texts[i:i + size]), padding=True, truncation=True, max_length=max_length,
                        return_tensors="pt")
        out.append({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})  # (B, L) each
    return out


def _next_logp(model: nn.Module, b: dict) -> Tensor:
    """(B, L-1, V): the log-probabilities the model gives the token after each position but the last."""
    return F.log_softmax(model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits[:, :-1].float(),
                         -1)


def fidelity(model: nn.Module, reference: nn.Module, batches: Sequence[dict]) -> NextTokenFidelity:
    """``model`` (a cut causal LM) against ``reference`` (the unpruned one) on :func:`text_batches`' output, without
    gradients, in eval mode: each position whose next token is real is scored."""
    if not batches:
        raise ValueError("no batches: give text_batches(tokenizer, texts).")
    kl = nll = ref_nll = 0.0
    n = 0
    with torch.no_grad():
        for b in batches:
            am = b["attention_mask"]
            live = (am[:, :-1] * am[:, 1:]).bool()  # (B, L-1): position t and its next token both real
            nxt = b["input_ids"][:, 1:, None]  # (B, L-1, 1)
            lp, ref = _next_logp(model, b), _next_logp(reference, b)  # (B, L-1, V)
            kl += float((ref.exp() * (ref - lp)).sum(-1)[live].sum())
            nll -= float(lp.gather(-1, nxt)[..., 0][live].sum())
            ref_nll -= float(ref.gather(-1, nxt)[..., 0][live].sum())
            n += int(live.sum())
    if n == 0:
        raise ValueError("the batches hold no next token to score: give texts of two tokens or more.")
    return NextTokenFidelity(kl / n, float(torch.tensor(nll / n).exp()), float(torch.tensor(ref_nll / n).exp()), n)


class _Targets(Sequence):
    """The batches paired with the unpruned model's next-token log-probabilities, each computed when its step reads
    it (one (B, L, V) tensor alive at a time: a 49152-word vocabulary takes 200 MB a batch of 8 x 128 tokens, so a
    long run on many batches could not hold them all)."""

    def __init__(self, reference: nn.Module, batches: Sequence[dict]):
        self.reference, self.batches = reference, batches

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i):
        from multihead.apps.prune import hf_models

        b = self.batches[i]
        ids, am = b["input_ids"], b["attention_mask"]
        with torch.no_grad():
            return (ids, am), hf_models._logp(self.reference, ids, am)  # (B, L, V) the unpruned log-probs


def process_group() -> tuple[int, int]:
    """(rank, world size) of this process: under ``torchrun`` (``WORLD_SIZE`` > 1 in the environment) the process
    group is joined here (gloo: the tensors stay on the CPU) unless it already is; (0, 1) for a single process."""
    import os

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return 0, 1
    dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


def _share(batch: dict, rank: int, world: int) -> dict:
    """This rank's rows of ``batch`` (B / world of them, in order); ValueError when B does not split evenly."""
    B = batch["input_ids"].shape[0]
    if B % world:
        raise ValueError(f"a batch of {B} rows does not split over {world} ranks: give a batch of a multiple of "
                         f"{world} windows.")
    n = B // world
    return {k: v[rank * n:(rank + 1) * n] for k, v in batch.items()}  # (B / world, L) each


def recover(model: nn.Module, reference: nn.Module, batches: Sequence[dict], steps: int, *,
            lr: float = 3e-5, observe: Callable[[int], None] | None = None,
            until: float | None = None, shard: bool = False) -> list[float]:
    """Distil a cut causal LM ``model`` toward ``reference`` for ``steps`` steps over ``batches`` (in turn): the loss
    is the KL divergence of next-token distributions over the real tokens (:func:`multihead.apps.prune.hf_models.recover`
    with ``causal=True``, AdamW, the rate decaying along a half cosine). The unpruned model's distributions are
    computed at each step (one batch's in memory), so ``batches`` may be many. ``observe``: called with the number
    of steps done after each step (e.g. to measure :func:`fidelity` every so many steps). ``until``: a
    ``time.monotonic()`` time the run is shortened to end by, from the first steps' cost (the cosine then spans the
    shorter run). In a process group of two ranks or more (:func:`process_group`) each rank distils its share of
    every batch's rows, the gradients averaged by ``DistributedDataParallel`` (``shard``: by FSDP2's ``fully_shard``,
    each rank holding its share of the weights, gradients and AdamW's moments; refused outside a group). Returns the
    losses, one a step (this rank's)."""
    import torch.distributed as dist

    from multihead.apps.prune import hf_models

    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a whole number >= 1; got {steps!r}.")
    if not batches:
        raise ValueError("no batches: give text_batches(tokenizer, texts) (text the fidelity is not measured on).")
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0:
        raise ValueError(f"lr must be a number > 0; got {lr!r}.")
    if observe is not None and not callable(observe):
        raise TypeError(f"observe must be a function of the steps done, or None; got {type(observe).__name__}.")
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        rank, world = dist.get_rank(), dist.get_world_size()
        batches = [_share(b, rank, world) for b in batches]
    return hf_models.recover(model, _Targets(reference, batches), steps, causal=True, lr=lr, observe=observe,
                              until=until, shard=shard)
