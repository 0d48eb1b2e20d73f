"""The graph every encoder room traces: the transformers model called as ``(input_ids, attention_mask[,
token_type_ids])`` (B, L) -> its first output (:class:`_TokensToHidden`; the peers' standard files trace the unpruned
model's last hidden state, as users wrap it: :class:`_Hidden`), the inputs it takes (:func:`input_names`), an
example of them checked (:func:`_export_example`), the attention it is traced with (:func:`standard_attention`:
transformers' SDPA where its class has it) and the mode it is traced in (:func:`_padded_eval`: eval, padded)."""

from __future__ import annotations

import contextlib
import inspect

import torch
from torch import Tensor, nn


class _TokensToHidden(nn.Module):
    """(input_ids (B, L), attention_mask (B, L)[, token_type_ids (B, L)]) -> the model's first output (last hidden
    state or logits)."""

    def __init__(self, model: nn.Module, token_types: bool):
        super().__init__()
        self.model, self.token_types = model, token_types

    def forward(self, input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor | None = None) -> Tensor:
        kw = {"token_type_ids": token_type_ids} if self.token_types else {}
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, **kw)
        return out[0]  # (B, L, E) or (B, L, vocab)


class _Hidden(torch.nn.Module):
    """A transformers encoder called with its token tensors, giving its last hidden state: what a user wraps to export
    the model for sentence embeddings (the pooler left out, as sentence-transformers and fastembed read it)."""

    def __init__(self, model, names: list[str]):
        super().__init__()
        self.model, self.names = model, names

    def forward(self, input_ids, attention_mask, token_type_ids=None):
        types = {"token_type_ids": token_type_ids} if "token_type_ids" in self.names else {}
        return self.model(input_ids=input_ids, attention_mask=attention_mask, **types).last_hidden_state  # (B, L, E)


def input_names(model: nn.Module) -> list[str]:
    """The exported graph's inputs: ``input_ids`` and ``attention_mask``, and ``token_type_ids`` where the model
    has more than one token type (BERT's tokenizer gives them; RoBERTa's, with one type, does not)."""
    names = ["input_ids", "attention_mask"]
    if ("token_type_ids" in inspect.signature(model.forward).parameters
            and (getattr(model.config, "type_vocab_size", 0) or 0) > 1):
        names.append("token_type_ids")
    return names


def _export_example(x: dict, names: list[str]) -> tuple[Tensor, ...]:
    """The graph's inputs (each (B, L), B, L >= 2: a size of 1 would be specialised as a constant) from an
    example's inputs, checked."""
    ids = x.get("input_ids")
    if not isinstance(ids, Tensor) or ids.dim() != 2:
        raise ValueError("export_onnx: example must hold input_ids (B, L).")
    am = x.get("attention_mask", torch.ones_like(ids))
    if not isinstance(am, Tensor) or am.shape != ids.shape or not bool(((am == 0) | (am == 1)).all()):
        got = tuple(am.shape) if isinstance(am, Tensor) else type(am).__name__
        raise ValueError(f"export_onnx: attention_mask must be a (B, L) padding mask of 0 and 1 like input_ids "
                         f"{tuple(ids.shape)}; got {got}. Other mask forms (4-D, float biases) are not exported.")
    xs = [ids, am] + ([x.get("token_type_ids", torch.zeros_like(ids))] if "token_type_ids" in names else [])
    if ids.shape[1] < 2:
        xs = [t.repeat(1, 2) for t in xs]  # (B, 1) -> (B, 2)
    if ids.shape[0] < 2:
        xs = [t.repeat(2, 1) for t in xs]  # (1, L) -> (2, L)
    return tuple(xs)


@contextlib.contextmanager
def standard_attention(model: nn.Module):
    """Inside: ``model`` computes attention with transformers' own SDPA function (the graph users export, at whatever
    size each module now has: transformers' modules reshape with -1 heads) where its class supports SDPA; multihead's
    function otherwise. Yields the implementation used; the model's own is restored after."""
    with _attention(model, "sdpa" if getattr(model, "_supports_sdpa", False) else None) as used:
        yield used


@contextlib.contextmanager
def _attention(model: nn.Module, use: str | None):
    """Inside: ``model`` computes attention with transformers' implementation ``use`` (None: its own); yields the one in
    effect (transformers may decline and keep the old one); the model's own is restored after."""
    previous = model.config._attn_implementation
    if use is None or use == previous:
        yield previous
        return
    try:
        model.set_attn_implementation(use)
        yield model.config._attn_implementation
    finally:
        model.set_attn_implementation(previous)


@contextlib.contextmanager
def _padded_eval(model: nn.Module):
    """Inside: ``model`` in eval mode and padded (a padding-free model's packing off: ONNX gets the padded graph, no
    data-dependent shapes); both restored after."""
    from multihead.hf import packed as hf_packed

    packing = model.__dict__.get(hf_packed.KEY)
    was, model_training = (packing.enabled if packing is not None else None), model.training
    if packing is not None:
        packing.enabled = False
    model.eval()
    try:
        yield model
    finally:
        if packing is not None:
            packing.enabled = was
        model.train(model_training)
