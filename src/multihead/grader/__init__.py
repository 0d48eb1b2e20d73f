"""The grader: tell a learner what is wrong with their own multi-head attention, and grade a class.

    report = multihead.check(MyAttention(d_model=32, num_heads=4), call="qkv_mask", mask="block")
    print(report)            # a table of checks; report.ok; report.diagnosis: where it differs, and the fix
    rows = multihead.grade("submissions/", name="MultiHeadAttention", call="qkv_mask", mask="block")

``check`` grades a module of yours in this process; ``grade`` grades learners' files, each in a
sandboxed process of its own that only builds the module and answers calls (the verdict is computed
here). The module is called only through ``call`` -- ``"x"`` ``m(x)``, ``"x_mask"`` ``m(x, mask)`` (self-attention),
``"qkv"`` ``m(q, k, v)``, ``"qkv_mask"`` ``m(q, k, v, mask)``, or (``check`` only) a function
``f(module, q, k, v, mask)`` --
and ``mask`` says how it reads masks: ``"keep"`` (bool, True = may attend), ``"block"`` (1/True =
blocked, the Keras tutorial), ``"additive"`` (added to the scores), ``"valid_lens"`` (the course's
(B,) lengths), or None. Masks are given as (B, 1, Lq, Lk); "keep" as bool and "block" as floats 1/0, each
in the other dtype to a module that raises on the first (``masked_fill(mask, ...)``, ``1 - mask``).

The layers, in the order a verdict flows through them: :mod:`~multihead.grader.subject` (the module
as data and calls), :mod:`~multihead.grader.session` (probes, mask conventions),
:mod:`~multihead.grader.properties` (black-box checks), :mod:`~multihead.grader.parts` (reading the
projections), :mod:`~multihead.grader.stages` and :mod:`~multihead.grader.weights` (localisation),
:mod:`~multihead.grader.verdict` (the rules), :mod:`~multihead.grader.report` (records, points,
feedback); the sandbox: :mod:`~multihead.grader.sandbox`, :mod:`~multihead.grader.warden`,
:mod:`~multihead.grader.runner`, :mod:`~multihead.grader.wire`; a class: :mod:`~multihead.grader.classroom`, and
:mod:`~multihead.grader.similarity` (every pair of its submissions compared as text, the starter code left out).
"""

from __future__ import annotations

import dis
import inspect
import os
from collections.abc import Callable

from torch import nn

from multihead.grader.report import CHECKS, POINTS, Check, Finding, Report
from multihead.grader.session import CONVENTIONS
from multihead.grader.subject import CALLS, HOW, SELF_CALLS, LocalSubject, forbidden
from multihead.grader.verdict import GradingOptions, grade_subject

__all__ = ["CHECKS", "POINTS", "Check", "Finding", "Report", "check", "grade"]


def _reads_argument(fn: Callable, index: int) -> bool | None:
    """Whether Python function ``fn`` ever reads its ``index``-th parameter (None: cannot tell)."""
    code = getattr(fn, "__code__", None)
    if code is None or index >= code.co_argcount:
        return None
    name = code.co_varnames[index]
    return any(i.argval == name for i in dis.get_instructions(code) if i.opname.startswith("LOAD"))


def check_call(call, mask) -> None:
    """Refuse, before any call, a call that cannot take (module, q, k, v, mask) or cannot pass the mask."""
    if mask is not None and mask not in CONVENTIONS:
        raise ValueError(f"mask must be one of {CONVENTIONS} or None; got {mask!r}.")
    if callable(call):
        try:
            inspect.signature(call).bind(None, None, None, None, None)
        except TypeError as e:
            raise TypeError(f"call must be a function f(module, q, k, v, mask) -> output; {call!r} cannot take "
                            f"those five arguments ({e}).") from None
        except ValueError:
            pass
        if mask is not None and _reads_argument(call, 4) is False:
            raise ValueError(f"mask={mask!r} cannot be honoured: the call function never uses its fifth argument "
                             "(the mask), so the module would never receive it. Pass the mask to the module in the "
                             "function, or use mask=None.")
        return
    if call not in CALLS:
        raise ValueError(f"call must be one of {CALLS} or a function f(module, q, k, v, mask); got {call!r}.")
    if call in ("x", "qkv") and mask is not None:
        raise ValueError(f"call={call!r} with mask={mask!r} cannot be honoured: {HOW[call]} passes no mask to the "
                         f"module. Use call={call + '_mask'!r} ({HOW[call + '_mask']}) or a function f(module, q, k, v, "
                         "mask), or mask=None.")


def check(module: nn.Module, *, call: str | Callable = "qkv", mask: str | None = None, embed_dim: int | None = None,
          causal: bool = False, self_attention: bool | None = None, mapping: dict | None = None,
          seed: int = 0, strict: bool = False, forbid: tuple | list = ()) -> Report:
    """Grade ``module`` in this process (see :mod:`multihead.grader`). ``embed_dim``: the input size, when
    no layer tells it; ``causal``: the module is meant to be causal (future positions must have no
    influence), on top of any mask it is given; ``self_attention``: queries, keys and values are the same
    tensor (default: for ``call`` "x" and "x_mask"); ``mapping``: the names of the q/k/v/o (or qkv) submodules or
    Parameters, the head count (``heads``) and the score scale (``scale``) when they cannot be found;
    ``seed``: the probes' random seed; ``strict``: warnings fail too; ``forbid``: torch functions and modules the
    course forbids (``("nn.MultiheadAttention", "F.scaled_dot_product_attention")``), refused when forward uses one
    (observed, whatever the code's text). A lazy module (``nn.LazyLinear``, a
    Keras layer not built yet) is built by a first call. The module comes back as it was: training flags, gradients, parameters
    and buffers, and the random number generators' states.

    Raises before calling the module: TypeError for a module that is not a torch Module or a call that
    cannot take (module, q, k, v, mask); ValueError for a module without parameters, an unknown mask
    convention, a call that cannot pass the mask it is given, or a forbidden name torch does not have."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"check takes a torch.nn.Module; got {type(module).__name__}.")
    check_call(call, mask)
    banned = forbidden([forbid] if isinstance(forbid, str) else forbid)
    unbuilt = any(type(m).__module__.split(".")[0] == "keras" and getattr(m, "built", True) is False
                  for m in module.modules())  # a Keras layer's weights are made by its first call
    if not list(module.parameters()) and not unbuilt:
        raise ValueError(f"{type(module).__name__} has no parameters: a multi-head attention module learns its "
                         "projections (W_q, W_k, W_v, W_o).")
    subject = LocalSubject(module, call)
    try:
        opts = GradingOptions(mask, causal, call in SELF_CALLS if self_attention is None else bool(self_attention), embed_dim,
                       mapping, seed, strict, HOW.get(call, "call(module, q, k, v, mask)") if not callable(call)
                       else "call(module, q, k, v, mask)", call if isinstance(call, str) else None,
                       kv_same=callable(call) and _reads_argument(call, 3) is False, forbid=banned)
        return grade_subject(subject, opts)
    finally:
        subject.close()


def grade(targets, *, name: str | None = None, **options) -> list[dict]:
    """Grade learners' files (a folder, a glob, files, or FILE.py:NAME; notebooks, .ipynb, on their definitions),
    each in its own sandboxed process: the class table as rows (file, ok, status, points, failed checks, finding,
    seconds). The options are :func:`multihead.grader.classroom.grade_many`'s (init, call, mask, causal, embed_dim,
    strict, timeout, memory, points, feedback, jobs, seed)."""
    from multihead.grader import classroom

    items = [targets] if isinstance(targets, str | os.PathLike) else list(targets)
    files = classroom.targets([str(t) for t in items], name)
    if not files:
        raise ValueError(f"nothing matches {' '.join(map(str, items))} (give FILE.py:NAME, a folder holding .py or "
                         ".ipynb files, or a glob of them)")
    return classroom.grade_many(files, **options)
