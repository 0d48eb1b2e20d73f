"""The reference backend: :func:`multihead.functional.reference_attention`,
computed in float64. Slow and exact: the oracle every other backend is tested
against. "auto" picks it only when nothing faster can run."""

from __future__ import annotations

import multihead.functional as functional
from multihead.backends.registry import Request, register


def run(query, key, value, mask, *, scale, dropout_p):
    return functional.reference_attention(query, key, value, mask, scale=scale, dropout_p=dropout_p)


def describe(req: Request) -> str:
    return "float64 spec"


register("reference", run, priority=0, doc="the float64 spec", describe=describe)
