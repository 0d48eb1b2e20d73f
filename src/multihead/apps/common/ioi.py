"""Indirect object identification (IOI, Wang et al. 2022), a behaviour of decoder language models, generated here:
templates x names x places x objects, no download.

    "When Mary and John went to the store, John gave a drink to"  ->  " Mary"

The subject (S) is named twice, the indirect object (IO) once; a model that does the task puts the IO's name above
the subject's at the last position. The metric is ``logit(IO) - logit(S)`` there (:func:`logit_diff`); a prompt is
right when it is positive. :func:`score` gives the accuracy and the mean logit difference over a set.

Each prompt comes with its corrupted twin (the same words, the second mention of the subject replaced by the IO's
name, so the answer flips): the clean/corrupted pair activation patching (:func:`multihead.heads.patch`) reads.
Every name, place and object is one token for the tokenizer the set is made for (words that are not are left out),
so the prompts of one template have the same length and batch without padding (:func:`batches`).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

__all__ = ["IOIPrompt", "IOIScore", "TEMPLATES", "batches", "logit_diff", "make", "score"]

#: the prompts' shapes; {A} and {B} are the two names in their first mention, {S} the subject named again
TEMPLATES = (
    "When {A} and {B} went to the {place}, {S} gave a {object} to",
    "After {A} and {B} went to the {place}, {S} gave a {object} to",
    "While {A} and {B} were working at the {place}, {S} gave a {object} to",
    "When {A} and {B} got a {object} at the {place}, {S} decided to give it to",
    "Then, {A} and {B} went to the {place}. {S} gave a {object} to",
    "{A} and {B} had a long day at the {place}. {S} handed a {object} to",
    "The {place} was quiet when {A} and {B} arrived. {S} passed a {object} to",
    "Friends {A} and {B} found a {object} at the {place}. {S} gave the {object} to",
)
NAMES = ("Mary", "John", "Alice", "Bob", "Sarah", "Tom", "James", "Anna", "David", "Emma", "Michael", "Lisa", "Daniel",
         "Laura", "Paul", "Kate", "Mark", "Jessica", "Peter", "Susan", "Robert", "Linda", "Chris", "Amy", "Steven",
         "Rachel", "Kevin", "Emily", "Brian", "Julia", "Jason", "Sophie", "Eric", "Helen", "Adam", "Grace")
PLACES = ("store", "park", "school", "station", "restaurant", "office", "garden", "beach", "library", "hospital",
          "market", "museum", "house", "church", "kitchen", "lake", "farm", "bank")
OBJECTS = ("drink", "book", "ball", "letter", "ring", "gift", "bag", "key", "card", "flower", "hat", "phone", "cake",
           "pen", "shirt", "toy", "apple", "bottle", "basket", "box")


@dataclass(frozen=True)
class IOIPrompt:
    """One prompt: its text, the names of the indirect object (the answer) and of the subject, the template's number,
    and ``corrupted``: the same text with the subject's second mention replaced by the IO's name (answer flipped)."""

    text: str
    io: str
    s: str
    template: int
    corrupted: str


@dataclass(frozen=True)
class IOIScore:
    """A set's result: ``accuracy`` (share of prompts with logit(IO) > logit(S)), ``logit_diff`` (their mean
    difference), ``n`` prompts."""

    accuracy: float
    logit_diff: float
    n: int


def _one_token(tokenizer, words: Sequence[str]) -> list[str]:
    return [w for w in words if len(tokenizer(" " + w, add_special_tokens=False)["input_ids"]) == 1]


def make(n: int, tokenizer, *, seed: int = 0, templates: Sequence[str] = TEMPLATES) -> list[IOIPrompt]:
    """``n`` IOI prompts drawn (``seed``) over ``templates`` in turn, two different names each, the IO named first
    in half of them (ABBA and BABA orders). Only names, places and objects that are one token for ``tokenizer`` (a
    transformers tokenizer, the word after a space) are drawn. Raises ValueError for ``n`` < 1, no template, or
    fewer than two one-token names."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a whole number of prompts >= 1; got {n!r}.")
    if not templates:
        raise ValueError("templates is empty: give at least one, e.g. multihead.apps.common.ioi.TEMPLATES.")
    names, places, objects = (_one_token(tokenizer, w) for w in (NAMES, PLACES, OBJECTS))
    if len(names) < 2 or not places or not objects:
        raise ValueError(f"the tokenizer splits the set's words: one-token names {len(names)} (need 2), places "
                         f"{len(places)}, objects {len(objects)} (need 1 each); this IOI set needs a tokenizer with "
                         "whole-word tokens for common English names.")
    rng = random.Random(seed)
    out = []
    for i in range(n):
        t = i % len(templates)
        io, s = rng.sample(names, 2)
        a, b = (io, s) if i % 2 == 0 else (s, io)
        words = {"A": a, "B": b, "place": rng.choice(places), "object": rng.choice(objects)}
        out.append(IOIPrompt(templates[t].format(S=s, **words), io, s, t, templates[t].format(S=io, **words)))
    return out


def batches(tokenizer, prompts: Iterable[IOIPrompt]) -> list[dict]:
    """The prompts tokenized, grouped by token length (no padding): each batch ``{"input_ids": (B, L),
    "corrupted_ids": (B, L), "io": (B,), "s": (B,)}`` (the names' token ids, the word after a space)."""
    groups: dict[int, list] = {}
    for p in prompts:
        ids = tokenizer(p.text)["input_ids"]
        bad = tokenizer(p.corrupted)["input_ids"]
        io, s = (tokenizer(" " + w, add_special_tokens=False)["input_ids"] for w in (p.io, p.s))
        if len(ids) != len(bad) or len(io) != 1 or len(s) != 1:
            raise ValueError(f"{p.text!r}: a name is not one token for this tokenizer; make the set with it "
                             "(multihead.apps.common.ioi.make(n, tokenizer)).")
        groups.setdefault(len(ids), []).append((ids, bad, io[0], s[0]))
    return [{"input_ids": torch.tensor([r[0] for r in rows]),  # (B, L)
             "corrupted_ids": torch.tensor([r[1] for r in rows]),  # (B, L)
             "io": torch.tensor([r[2] for r in rows]), "s": torch.tensor([r[3] for r in rows])}  # (B,)
            for _, rows in sorted(groups.items())]


def logit_diff(logits: Tensor, batch: dict) -> Tensor:
    """logit(IO) - logit(S) at the last position: (B,), from the model's logits (B, L, V) (or (B, V))."""
    last = logits[:, -1] if logits.dim() == 3 else logits  # (B, V)
    return last.gather(1, batch["io"][:, None])[:, 0] - last.gather(1, batch["s"][:, None])[:, 0]


def _logits(model: nn.Module, ids: Tensor) -> Tensor:
    return model(input_ids=ids, logits_to_keep=1).logits  # (B, 1, V): the last position's only


def score(model: nn.Module, sets: Iterable[dict], *, run: Callable[[nn.Module, Tensor], Tensor] = _logits) -> IOIScore:
    """Accuracy (logit(IO) > logit(S)) and mean logit difference of ``model`` (a causal LM: ``model(input_ids=...,
    logits_to_keep=1).logits``, or ``run(model, ids)`` -> logits) over :func:`batches`' output, without gradients."""
    diffs = []
    with torch.no_grad():
        for b in sets:
            diffs.append(logit_diff(run(model, b["input_ids"]).float(), b))
    if not diffs:
        raise ValueError("no IOI batches: give multihead.apps.common.ioi.batches(tokenizer, make(n, tokenizer)).")
    d = torch.cat(diffs)  # (N,)
    return IOIScore(float((d > 0).float().mean()), float(d.mean()), d.numel())
