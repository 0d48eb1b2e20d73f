"""The verdict on one module, from calls alone (:class:`~multihead.grader.subject.LocalSubject` or a
sandboxed learner's file): the black-box properties (:mod:`multihead.grader.properties`), then the
module read as projections (:mod:`multihead.grader.parts`) and compared with the float64 reference,
then, when it differs, the stage where it departs (:mod:`multihead.grader.stages`).

The rules, so that correct code is never failed:

- every comparison -- two calls, a call and the reference -- passes within the rounding of the probes' dtype
  (:attr:`~multihead.grader.session.Session.tol`): no correct module fails on float rounding;
- a property that fails is a failure (the module is not multi-head attention, whatever its parts);
- the output equal to the reference under some reading of the parts is a pass; equal to it with the softmax in
  float16 or bfloat16, a failure named as precision;
- otherwise a mistake the localisation *names* (a hypothesis that reproduces what the module
  computed) is a failure, and so is any difference when every part was observed at work (each
  projection a layer seen called on its input, the output the output projection's);
- a difference that is neither -- the parts could not be read with certainty -- is a warning that
  says what could not be verified; the black-box checks stand as the verdict;
- "output projection missing" where the reading found no W_o counts only when the module holds no
  weights the reading left unread, or another stage reproduced the output as the merged heads (a W_o
  held where no reading looks is not a missing one);
- the probes give queries, keys and values the input sizes of their own projections where those differ
  (the course's query_size, key_size, value_size);
- every failing check is in the diagnosis with its fix (:func:`_every_failure_explained`); a module that runs as
  attention should only with its mask in another convention is told which, and how to declare it.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass

import torch

from multihead.grader import parts as parts_mod
from multihead.grader import properties as props
from multihead.grader import stages
from multihead.grader.report import Check, Finding, Report, assignment
from multihead.grader.session import CONVENTIONS, LK, LQ, MASK_SHAPES, B, Session, mask_form, mask_value
from multihead.grader.subject import RETURNED, Description, Probe

__all__ = ["GradingOptions", "grade_subject"]


@dataclass(frozen=True)
class GradingOptions:
    """How a module is graded: ``conv`` its mask convention (None: no mask), ``causal``, ``self_attn``,
    ``embed_dim`` (its input size, when nothing tells it), ``mapping`` (the names of its q/k/v/o or qkv,
    ``heads``, ``scale``), ``seed`` of the probes, ``strict`` (warnings fail), ``how`` (the call, for messages), ``call`` its name
    (:data:`~multihead.grader.subject.CALLS`; None for a function)."""

    conv: str | None = None
    causal: bool = False
    self_attn: bool = False
    embed_dim: int | None = None
    mapping: dict | None = None
    seed: int = 0
    strict: bool = False
    how: str = "m(q, k, v)"
    call: str | None = "qkv"
    #: the call never reads its values argument: keys and values are probed as one tensor (``m(q, context=k)``)
    kv_same: bool = False
    #: torch functions and modules the course forbids (:func:`~multihead.grader.subject.forbidden`)
    forbid: tuple = ()

    @property
    def checks(self) -> tuple[str, ...]:
        """The checks this assignment makes of every module (:func:`~multihead.grader.report.assignment`)."""
        return assignment(masked=self.conv is not None, causal=self.causal, self_attn=self.self_attn,
                          forbid=bool(self.forbid))


def _size_from(desc: Description, mapping: dict | None) -> int | None:
    """The input size a Linear-like layer states (the first one; or the mapped q/qkv layer's)."""
    for r in ("q", "qkv"):
        if mapping and mapping.get(r) in desc.linear:
            return int(desc.linear[mapping[r]][0].shape[1])
    for name, (w, _) in desc.linear.items():
        if name:
            return int(w.shape[1])
    return next((int(w.shape[1]) for w, _ in desc.linear.values()), None)


def _role_sizes(desc: Description, mapping: dict | None) -> tuple[int, int, int] | None:
    """(Eq, Ek, Ev): the input sizes of the query, key and value projections, where each role is held by
    Linear-like layers of one input size (found by role name, or the mapping's) and the three are not all
    one size (the course's query_size, key_size and value_size); else None."""
    sizes: dict[str, set[int]] = {"q": set(), "k": set(), "v": set()}
    for name, (w, _) in desc.linear.items():
        r = parts_mod.layer_role(name)
        if mapping and any(mapping.get(m) == name for m in ("q", "k", "v")):
            r = next(m for m in ("q", "k", "v") if mapping.get(m) == name)
        if r in sizes:
            sizes[r].add(int(w.shape[1]))
    for name, kind in desc.modules.items():  # torch.nn.MultiheadAttention(embed_dim, kdim=, vdim=) inside
        ints = desc.ints.get(name, {})
        if kind == "MultiheadAttention" and all(a in ints for a in ("embed_dim", "kdim", "vdim")):
            got = (ints["embed_dim"], ints["kdim"], ints["vdim"])
            if len(set(got)) > 1 and not any(sizes.values()):
                return got
    if any(len(v) != 1 for v in sizes.values()):
        return None
    got = tuple(next(iter(sizes[r])) for r in ("q", "k", "v"))
    return None if len(set(got)) == 1 else got


def _call_at(subject, E: int, self_attn: bool, conv: str | None):
    """A first call at input size ``E`` on zeros (1, 2, E): with every key kept in the module's mask convention (a
    module that reads its mask unconditionally raises on None), then, where that raises, without a mask."""
    x = torch.zeros(1, 2, E)
    mask = mask_value(conv, torch.ones(1, 1, 2, 2, dtype=torch.bool), torch.tensor([2]))
    r = subject.call(Probe(x, x, x, mask, self_attn))
    if mask is not None and (r.error is not None or r.out is None):
        r = subject.call(Probe(x, x, x, None, self_attn))
    return r


def _size_search(subject, desc: Description, self_attn: bool, conv: str | None = None) -> int | None:
    """The input size found by calling: the parameters' sizes (commonest first), a lazy layer's output
    size, then common model sizes; the first that gives a (1, 2, ·) output. A lazy module is built by it."""
    sizes = Counter(d for p in desc.params.values() if p.dim() >= 2 for d in p.shape)
    cands = [E for E, _ in sizes.most_common()]
    cands += [v for ints in desc.ints.values() for a, v in ints.items() if a in ("out_features", "d_model")]
    cands += [32, 64, 16, 24, 100, 128, 8, 256, 512]
    for E in dict.fromkeys(c for c in cands if c > 0):
        r = _call_at(subject, E, self_attn, conv)
        if r.error is None and r.out is not None and r.out.dim() == 3 and tuple(r.out.shape[:2]) == (1, 2):
            return E
    return None


def _runs_at(subject, desc: Description, self_attn: bool, E: int, conv: str | None = None) -> int:
    """``E``, the size the first Linear-like layer takes, when the module runs at it; else the size a search by
    calling finds (a layer shared by the heads takes one head's slice, d_model // H: Persson's per-head
    Linear(head_dim, head_dim)), or ``E`` when none runs (the first graded call then says why)."""
    r = _call_at(subject, E, self_attn, conv)
    if r.error is None and r.out is not None:
        return E
    return _size_search(subject, desc, self_attn, conv) or E


def _call_hint(forward: tuple, call: str | None) -> str:
    """' (its forward(x) fits call='x')' when the module's forward signature fits another call."""
    if call is None or not forward:
        return ""
    required = [n for n, req in forward if req]
    fits = [c for c, n in (("x", 1), ("x_mask", 2), ("qkv", 3), ("qkv_mask", 4)) if len(required) <= n <= len(forward)]
    if not fits or call in fits:
        return ""
    names = ", ".join(n for n, _ in forward)
    return f" (its forward({names}) fits call={fits[0]!r}{' with a mask=' if fits[0].endswith('_mask') else ''})"


def _gave(s: Session, x, r, leaks: bool = True) -> str:
    """What a call under the session's current mask form gave, in words: '' where it behaves as a masked call
    should (runs, output (B, Lq, ·), finite where the reference is, and with ``leaks`` masked keys without
    influence)."""
    if r.error is not None or r.out is None:
        return f"raised {(r.error or 'no tensor returned').splitlines()[0][:160]}" if r.error else "returned no tensor"
    if tuple(r.out.shape[:2]) != tuple(x.q.shape[:2]) or r.out.dim() != 3:
        return f"gave an output of shape {tuple(r.out.shape)} (the mask broadcast against the scores)"
    if not bool(torch.isfinite(r.out).all()):
        return "gave NaN or inf where the reference is finite"
    if leaks and x.lens is not None:
        try:
            leak = props.masked_keys(s, props.Base(x, r.out.double(), r.weights))
        except RuntimeError as e:
            return f"raised {str(e).splitlines()[0][:160]} on other keys"
        if not leak.passed:
            return f"let masked keys change the output ({leak.figure})"
    return ""


def _behaves(s: Session, x, r) -> str:
    """What a call under the session's current form gave, in words: '' where it behaves as attention should -- as
    :func:`_gave` with masked keys without influence, an additive mask whose output does not change when one constant
    is added to the whole mask (softmax does not see it; a mask read as a boolean does), and the second sequence run
    alone giving its row of the batch's output (a layout read the wrong way round ties the rows together)."""
    what = _gave(s, x, r)
    if what:
        return what
    if s.given == "additive":
        s.shift = 0.5
        try:
            r2 = s.call(x.q, x.k, x.v, x.keep, x.lens)
        finally:
            s.shift = 0.0
        if r2.error is not None or r2.out is None or r2.out.shape != r.out.shape or props.rel(r2.out, r.out) > s.tol:
            return "changed its output when one constant was added to the whole mask (it does not add it to the scores)"
    one = props._rows(x, [1])
    r1 = s.call(one.q, one.k, one.v, one.keep, one.lens)
    if r1.error is not None or r1.out is None:
        return f"raised {(r1.error or 'no tensor returned')[:160]} on one sequence alone"
    if r1.out.shape[1:] != r.out.shape[1:] or props.rel(r1.out[0], r.out[1]) > s.tol:
        return "gave a sequence an output that depends on the other sequences of the batch"
    return ""


def _forms(s: Session) -> list[tuple]:
    """Every way the module could be called, (sequence-first, given, other dtype, mask shape), the grader's own
    first: batch-first then sequence-first inputs; the mask in the convention's two dtypes, then as an additive mask
    (0 kept, -inf blocked: the same mask), in each shape of :data:`MASK_SHAPES`, then as each sequence's length (where
    no mask hides the future). The polarity of a boolean mask is the course's (a module that reads it the other way
    round is wrong, not another convention)."""
    shapes = [sh for sh in MASK_SHAPES if not (s.causal and sh == MASK_SHAPES[2])]
    if s.conv in ("keep", "block"):
        kinds = [(g, o, sh) for sh in shapes for g, o in ((None, False), (None, True), ("additive", False))]
    elif s.conv == "additive":
        kinds = [(None, False, sh) for sh in shapes]
    else:
        kinds = [(None, False, MASK_SHAPES[0])]
    if s.conv in ("keep", "block", "additive") and not s.causal:
        kinds.append(("valid_lens", False, MASK_SHAPES[0]))
    return [(sf, *k) for sf in (False, True) for k in kinds]


def _set_form(s: Session, form: tuple) -> None:
    s.seq_first, s.given, s.other_mask, s.mask_shape = form


def _form_words(s: Session) -> str:
    return mask_form(s.conv, s.other_mask, s.mask_shape, s.given, s.seq_first)


def _mask_as_taken(s: Session, x, first):
    """The form of the call under which the module behaves as attention should (:func:`_behaves`), among the forms
    correct code uses (:func:`_forms`): tried in order when the grader's own form does not behave -- it raised, gave
    an output of another shape (a broadcast), NaN or inf where the reference is finite, let masked keys change the
    output, or tied the batch's sequences together. The first form that behaves is kept for every call after;
    failing that, the grader's own form where it ran right-shaped and finite (the module is graded on it, its
    mistakes included), else the first form that runs right-shaped and finite (the checks then say what is wrong),
    else the grader's own form and ``first``. ``s.mask_tried``: each form tried before the one kept, with what it
    gave."""
    what = _behaves(s, x, first)
    if not what:
        return first
    ran = not _gave(s, x, first, leaks=False)
    tried, fallback = [(_form_words(s), what)], None
    for form in _forms(s)[1:]:
        _set_form(s, form)
        try:
            r = s.call(x.q, x.k, x.v, x.keep, x.lens, order=True)
        except ValueError:  # a mask this form cannot hold (lengths of a mask whose rows are not prefixes)
            continue
        gave = _behaves(s, x, r)
        if not gave:
            s.mask_tried = tuple(tried)
            return r
        if fallback is None and not ran and (gave.startswith("let masked keys") or gave.endswith("on other keys")
                                             or gave.startswith("gave a sequence")):
            fallback = (form, r, tuple(tried))
        tried.append((_form_words(s), gave))
    if fallback is not None:
        form, r, s.mask_tried = fallback
        _set_form(s, form)
        return r
    _set_form(s, (False, None, False, MASK_SHAPES[0]))
    s.mask_tried = ()
    return first


#: each mask convention in words, as --mask names it
IN_WORDS = {"keep": "True = may attend", "block": "True or 1 = masked, as torch.nn's key_padding_mask and the Keras "
            "tutorial's mask", "additive": "floats added to the scores, -inf masked", "valid_lens": "each sequence's "
            "length, the course's valid_lens"}


def _convention_that_fits(s: Session, x) -> tuple[str, str] | None:
    """Where no form of the declared convention behaves (:func:`_mask_as_taken`), the first other convention of
    :data:`~multihead.grader.session.CONVENTIONS` under one of whose forms the module behaves as attention should:
    (the convention, the form in words); None where none does."""
    for conv in (c for c in CONVENTIONS if c != s.conv and not (s.causal and c == "valid_lens")):
        t = dataclasses.replace(s, conv=conv, seq_first=False, given=None, other_mask=False,
                                mask_shape=MASK_SHAPES[0], mask_tried=(), shift=0.0)
        r = _mask_as_taken(t, x, t.call(x.q, x.k, x.v, x.keep, x.lens))
        if r.error is None and r.out is not None and not _behaves(t, x, r):
            return conv, _form_words(t)
    return None


def _convention_finding(declared: str, conv: str, form: str) -> Finding:
    """The finding of a module that runs as attention should only with its mask in ``conv``, not the ``declared``
    convention: which one fits, and how to declare it."""
    return Finding(f"its mask is in the {conv} convention, not {declared}", f"declare the convention the module "
                   f"reads: --mask {conv} on the command line (mask={conv!r} in multihead.check), or make it read the "
                   f"course's {declared} mask ({IN_WORDS[declared]}).", "inputs",
                   f"a mask in the {declared} convention ({IN_WORDS[declared]})", f"a module that runs as attention "
                   f"should with its mask in the {conv} convention ({IN_WORDS[conv]}), given as {form}",
                   "runs on probe inputs")


def _causal_lengths(s: Session, x, first):
    """A causal module graded with valid_lens: the lengths as (B,), its own triangle masking the future, or, when
    that is not causal, per query row (B, Lq) as the course's decoder masks its future (valid_lens 1, 2, ..., Lq, and
    the padding's): the first form under which the module is causal is kept; ``first`` (the reply) where neither."""
    def causal(r) -> bool:
        try:
            return all(c.passed for c in props.causality(s, props.Base(x, r.out.double(), r.weights)))
        except RuntimeError:  # the module raised on the changed inputs: the causality checks say so later
            return False

    if causal(first):
        return first
    s.lens_2d = True
    r = s.call(x.q, x.k, x.v, x.keep, x.lens, order=True)
    if r.error is None and r.out is not None and tuple(r.out.shape[:2]) == tuple(x.q.shape[:2]) and causal(r):
        return r
    s.lens_2d = False
    return first


def _raised(s: Session, rep: Report, x, r, hint: str, named: list) -> None:
    """The failing "runs on probe inputs" of a first call that raised (or returned no tensor): the shapes given, what
    was tried, and -- where the module runs as attention should with its mask in another convention -- which one and
    how to declare it (its finding appended to ``named``)."""
    hint = hint if (r.error or "").startswith("TypeError") else ""
    mask = ""
    if s.conv is not None:  # the mask's shape, and how a module that reads another one is called
        shape = (B,) if s.conv == "valid_lens" else (B, 1, x.q.shape[1], x.k.shape[1])
        mask = f", mask ({s.conv}) {shape}"
        if r.error is not None and s.conv != "valid_lens" and not hint and not r.error.startswith(RETURNED):
            also = ", ".join(MASK_SHAPES[1:] if not s.causal else MASK_SHAPES[1:2])
            kinds = ", as bool and as 1/0 floats" if s.conv in ("keep", "block") else ""
            hint = (f" (it raised on the mask given as {also} too{kinds}; a module that reads masks another way "
                    "is graded through a function that gives its mask, e.g. call=lambda m, q, k, v, mask: "
                    "m(q, k, v, mask[:, 0, 0, :, None]) for (B, Lk, 1))")
    fits = _convention_that_fits(s, x) if s.conv is not None and not hint.startswith(" (its forward") else None
    if fits is not None:  # correct code in another convention: which, and how to declare it
        hint = f" (with its mask in the {fits[0]} convention, given as {fits[1]}, it runs as attention should: " \
               f"declare --mask {fits[0]})"
        named.append(_convention_finding(s.conv, *fits))
    rep.checks.append(Check("runs on probe inputs", False, "", f"{s.how} with q {tuple(x.q.shape)}, k "
                            f"{tuple(x.k.shape)}{mask}: {r.error or 'no tensor returned'}{hint}"))


def _base(s: Session, rep: Report, hint: str = "", named: list | None = None) -> props.Base | None:
    """The first call (and the failure it is when it raises): cross-attention that raises with Lq != Lk but
    runs with equal lengths is graded on equal lengths, with a finding."""
    x = s.inputs()
    r = _mask_as_taken(s, x, s.call(x.q, x.k, x.v, x.keep, x.lens, order=True))
    if r.error is not None and not s.self_attn and not s.causal:
        x2 = s.inputs(LQ, LQ)
        r2 = s.call(x2.q, x2.k, x2.v, x2.keep, x2.lens, order=True)
        if r2.error is None and r2.out is not None:
            named.append(Finding(
                "runs only when the query and key lengths are equal", "keys and values come from the key and value "
                "inputs (length Lk), queries from the query input (length Lq); the weights are (B, H, Lq, Lk): check "
                "which input each projection and product takes.", "projections", f"any Lq, Lk (cross-attention: "
                f"Lq={LQ}, Lk={LK})", f"{r.error}"))
            s.square = True
            x, r = x2, r2
    if r.error is not None or r.out is None:
        _raised(s, rep, x, r, hint, named)
        return None
    adapted = s.other_mask or s.mask_shape != MASK_SHAPES[0] or s.given is not None or s.seq_first
    given = _form_words(s)
    others = "; ".join(f"under {form} it {gave}" for form, gave in s.mask_tried[:3]) + (
        f"; {len(s.mask_tried) - 3} other forms did not behave either" if len(s.mask_tried) > 3 else "")
    how = (f"the mask given as {given}" if s.conv is not None else f"the inputs given {given}") + f": {others}"
    read = f"the output read from {r.picked}" if r.picked else ""
    rep.checks.append(Check("runs on probe inputs", True, "", "; ".join(t for t in (how if adapted else "", read)
                                                                        if t)))
    out = r.out
    ok = out.dim() == 3 and tuple(out.shape[:2]) == (B, x.q.shape[1]) and out.dtype == x.q.dtype
    rep.checks.append(Check("output shape and dtype", ok, str(tuple(out.shape)), f"expected ({B}, {x.q.shape[1]}, ·) "
                                                                                 f"{x.q.dtype}"))
    if not ok:
        return None
    if s.causal and s.conv == "valid_lens":
        r = _causal_lengths(s, x, r)
        if s.lens_2d:
            rep.check("runs on probe inputs").detail = ("valid_lens given per query row (B, Lq), as the course's "
                                                        "decoder masks its future: with (B,) lengths it was not causal")
    s.order = r.order
    return props.Base(x, r.out.double(), r.weights)


def _across_calls(s: Session, b: props.Base, desc: Description, rep: Report,
                  forbid: tuple = ()) -> tuple[bool, bool, list[Finding]]:
    """The properties a call shows only beside another (:mod:`multihead.grader.properties`): the same input twice,
    the caller's tensors after a call, a call after others against a fresh module's, the heads' own weights.
    (each call a function of its inputs alone -- deterministic, no state kept --, no weights shared, the findings
    these properties name)."""
    named: list[Finding] = []
    r = props.again(s, b, forbid)
    c, f = props.determinism(s, b, r)
    det = bool(c.passed)
    rep.checks.append(c)
    ci, fi = props.inputs_unchanged(s, b, r)
    rep.checks.append(ci)
    state = None
    if det or f is None:  # a random draw explains two calls that differ: a fresh module's would differ too
        cs, state = props.no_state(s, b)
        rep.checks.append(cs)
    if f is None and state is None and not det:
        f = Finding("the output changes from call to call", "make forward a function of its inputs and parameters: "
                    "no dropout in eval, no random numbers (torch, random, numpy) drawn in forward.", "normalisation",
                    "the same output for the same input in eval mode", "outputs that change")
    co, fo = props.own_weights(desc)
    rep.checks.append(co)
    fb = None
    if forbid:
        cb, fb = props.no_forbidden(r, forbid)
        rep.checks.append(cb)
    for name, x in (("no forbidden calls", fb), ("eval mode deterministic", f), ("no state between calls", state),
                    ("heads have their own weights", fo), ("inputs unchanged by a call", fi)):
        if x is not None:
            x.check = x.check or name
            named.append(x)
    return det and state is None, fo is None and fb is None, named


def _properties(s: Session, b: props.Base, desc: Description, rep: Report,
                forbid: tuple = ()) -> tuple[bool, list[Finding]]:
    """Every black-box check; (whether the module can be read on: deterministic, no state kept, no weights shared,
    no forbidden call; the findings the properties themselves name)."""
    det, own, named = _across_calls(s, b, desc, rep, forbid)
    c, f = props.batch_independence(s, b, det)
    rep.checks.append(c)
    named += [_for(f, c)] if f is not None else []
    det = det and own
    if s.conv is not None:
        rep.checks += [props.masked_keys(s, b), props.fully_masked(s, b)]
    if s.causal:
        rep.checks += props.causality(s, b)
    rep.checks += props.weights_seen(s, b)
    rep.checks.append(props.gradients(s, b, desc.trainable))  # its finding: where nothing else explains it
    if det:
        if s.self_attn and not s.causal:
            c, f = props.permutation(s, b)
            rep.checks.append(c)
            named += [_for(f, c)] if f is not None else []
        if not s.self_attn and not s.causal:
            for check in (props.key_order, props.weights_sum_to_one):
                c, f = check(s, b)
                rep.checks.append(c)
                named += [_for(f, c)] if f is not None else []
    return det, named


def _for(f: Finding, c: Check) -> Finding:
    """``f`` marked as the finding of check ``c`` (where it names no check yet)."""
    f.check = f.check or c.name
    return f


#: checks whose failure only their own finding explains (a mistake in the output does not make them fail)
OWN_ONLY = ("runs on probe inputs", "output shape and dtype", "eval mode deterministic", "inputs unchanged by a call",
            "no state between calls", "heads have their own weights", "no forbidden calls")
#: explained by its own finding or by a mistake located in the output (keys used as values leave W_v unused)
GRADIENTS = "gradients reach every parameter"


#: checks whose finding says the output changes from call to call: no comparison of two calls says more then
UNSTABLE = ("eval mode deterministic", "no state between calls")


def _explained(c: Check, diagnosis: list[Finding]) -> bool:
    """Whether ``diagnosis`` explains the failing check ``c``: its own finding; for a check a wrong output breaks, a
    finding about the output (located by the reference, or another such check's) or one that the output changes
    from call to call (a comparison of two calls then fails whatever else is right); for the gradients, one located
    or one of a changing output (a layer built in forward leaves the module's own unused)."""
    if any(f.check == c.name for f in diagnosis) or c.name in OWN_ONLY:
        return any(f.check == c.name for f in diagnosis)
    if any(f.check in UNSTABLE for f in diagnosis):
        return True
    if c.name == GRADIENTS:
        return any(not f.check for f in diagnosis)
    return any(f.check not in (*OWN_ONLY, GRADIENTS) for f in diagnosis)


def _every_failure_explained(rep: Report) -> None:
    """Each failing check explained in the diagnosis with its fix (:func:`_explained`); else its own finding
    (:func:`~multihead.grader.properties.own_finding`) is added. (A failing check was shown with an empty diagnosis:
    a module whose gradients never reached W_q was NOT OK without a word of why.)"""
    for c in rep.failures:
        if not _explained(c, rep.diagnosis):
            rep.diagnosis.append(props.own_finding(c))


def _fit(s: Session, b: props.Base, readings: list) -> tuple:
    """(the reading and head count that reproduce the output, relative error of the best, the best's H)."""
    best = (None, float("inf"))
    for parts in readings:
        counts = parts_mod.head_counts(parts)
        others = [h for h in parts_mod.head_counts(parts.with_heads(None)) if h not in counts]
        for H in counts + others:
            p = parts.with_heads(H)
            try:
                ref = parts_mod.reference(p, b.x.q, b.x.k, b.x.v, b.x.keep)
            except (RuntimeError, ValueError):
                continue
            e = props.rel(b.out, ref) if ref.shape == b.out.shape else float("inf")
            if e < best[1]:
                best = (p, e)
            if e <= s.tol:
                return p, e, H in counts
    return None, best[1], True


def _rounded(s: Session, b: props.Base, readings: list):
    """The dtype of :data:`~multihead.grader.properties.LOW` (narrower than the probes') in which a softmax gives the
    module's output to the probes' rounding, under one of the two likeliest readings; None where none does."""
    for parts in readings[:2]:
        for H in parts_mod.head_counts(parts):
            p = parts.with_heads(H)
            for dtype in (d for d in props.LOW if torch.finfo(d).eps > torch.finfo(s.dtype).eps):
                try:
                    low = parts_mod.rounded_softmax(p, b.x.q, b.x.k, b.x.v, b.x.keep, dtype)
                except (RuntimeError, ValueError):
                    break
                if low.shape == b.out.shape and props.rel(b.out, low) <= s.tol:
                    return dtype
    return None


def _observed(parts: parts_mod.Parts, s: Session) -> bool:
    """Every part of the reading is a layer seen at work (its inputs and outputs observable), none of them a guess."""
    if parts.guessed_o:
        return False
    roles = [parts.qkv, parts.o] if parts.qkv is not None else [parts.q, parts.k, parts.v, parts.o]
    return all(p is not None and p.hookable and p.modules[0] in s.order for p in roles)


def _localise(s: Session, readings: list) -> tuple[list[Finding], parts_mod.Parts | None]:
    """The likeliest readings localised on probes small enough for the weights to be recovered; the
    candidate with the fewest generic findings wins."""
    candidates = []
    for parts in readings[:2]:
        for H in parts_mod.head_counts(parts):
            p = parts.with_heads(H)
            D = p.width // H
            hookable = (p.qkv or p.v) is not None and (p.qkv or p.v).hookable
            L = LQ if not s.self_attn or hookable or D > LQ else max(2, D - 1)
            x = s.inputs(L, L if s.square else LK)
            try:
                found = stages.localise(s, p, x)
            except (RuntimeError, ValueError):
                continue
            generic = sum(f.name.startswith(stages.GENERIC) for f in found)
            candidates.append(((not found, generic, len(found)), found, p))
    if not candidates:
        return [], None
    candidates.sort(key=lambda c: c[0])
    return candidates[0][1], candidates[0][2]


def _unread_weights(desc: Description, parts: parts_mod.Parts) -> list[str]:
    """The module's parameters of two or more dimensions that no projection of the reading holds: where an
    output projection the reading did not find could be."""
    held = [p for p in (parts.q, parts.k, parts.v, parts.o, parts.qkv) if p is not None]
    layers = tuple(f"{m}." for p in held for m in p.modules)
    raw = {p.name for p in held}
    return [n for n, t in desc.params.items() if t.dim() >= 2 and n not in raw and not n.startswith(layers)]


def _unestablished_missing_projection(found: list[Finding], parts: parts_mod.Parts | None,
                                      desc: Description) -> list[Finding]:
    """``found`` without "output projection missing" where that was not established: the reading has no
    output projection, yet the module holds weights it did not read (a W_o held in a way no reading knows)
    and no other stage reproduced the output as the merged heads themselves."""
    if parts is None or parts.o is not None or not _unread_weights(desc, parts):
        return found
    missing = [f for f in found if f.name == "output projection missing"]
    others = [f for f in found if f not in missing and not f.name.startswith(stages.GENERIC)]
    return found if others else [f for f in found if f not in missing]


def _white_box(s: Session, b: props.Base, desc: Description, opts: GradingOptions, rep: Report, named: list) -> None:
    readings = parts_mod.find_parts(desc, opts.mapping, s.E, s.order, s.kv_sizes)
    fitted, err, own_count = _fit(s, b, readings) if readings else (None, float("inf"), True)
    ref_fn = None if fitted is None else (lambda q, k, v, keep: parts_mod.reference(fitted, q, k, v, keep))
    terms = None if fitted is None else (lambda q, k, v: parts_mod.score_terms(fitted, q, k, v))
    c, f = props.stability(s, b, ref_fn, terms)
    rep.checks.append(c)
    f = None if f is None else _for(f, c)
    if fitted is not None:
        detail = f"{fitted.H} heads" + ("" if fitted.qkv is None else f", fused qkv ({fitted.layout})")
        if fitted.tied:  # attention, with projections narrower than the course's: a warning
            D = s.E // fitted.tied
            detail += (f", with q, k and v each one ({D}, {D}) layer shared by the heads and applied to each head's "
                       f"{D} features of the input: every head of the course projects the whole input "
                       f"(Linear({s.E}, {s.E}), split into heads after)")
        rep.checks.append(Check("matches the float64 reference", not fitted.tied, f"rel. error {err:.2e}", detail,
                                severity="warning" if fitted.tied else "failure"))
        if not own_count:
            named.append(Finding(f"{fitted.H} heads, not the {readings[0].H} it was built with", "split into "
                                 "num_heads heads of d_model // num_heads features each.", "heads split",
                                 f"{readings[0].H} heads", f"multi-head attention with {fitted.H} heads"))
        rep.diagnosis += named + ([f] if f is not None else [])
        return
    low = _rounded(s, b, readings)
    if low is not None:  # the spec with its softmax in float16 or bfloat16: precision, not a mistake of the formula
        rep.checks.append(Check("matches the float64 reference", False, f"rel. error {err:.2e}"))
        rep.diagnosis += [props.precision(low, err, s.dtype)] + [x for x in named if x.check in OWN_ONLY]
        return
    found, parts = _localise(s, readings) if readings else ([], None)
    found = _unestablished_missing_projection(found, parts, desc)
    specific = [x for x in found if not x.name.startswith(stages.GENERIC)]
    figure = "" if err == float("inf") else f"rel. error {err:.2e}"
    extra = [f] if f is not None else []
    if specific:  # the localisation named it: the properties' own findings are its consequences
        rep.checks.append(Check("matches the float64 reference", False, figure))
        rep.diagnosis += specific + [x for x in found if x not in specific]
    elif named or extra:
        rep.checks.append(Check("matches the float64 reference", False, figure))
        rep.diagnosis += named + extra
    elif rep.failures or (parts is not None and (_observed(parts, s) or opts.mapping)):
        rep.checks.append(Check("matches the float64 reference", False, figure))
        rep.diagnosis += (found or [Finding("differs from multi-head attention", "compare each step with "
                                            "multihead.reference_attention (the spec) on the same projected heads.",
                                            "not located", "the output of multi-head attention with the module's "
                                            "own projections", f"a different output ({figure or 'no reading'})")])
    else:
        unread = _unread_weights(desc, readings[0]) if readings and readings[0].o is None else []
        why = ("its projections were not found by name or call order" if not readings else
               f"its output projection was not found (weights no reading holds: {', '.join(unread[:4])})" if unread
               else "no reading of its parameters (orientation, head count, fused layout) reproduces its output, and "
               "its parts could not be observed at work")
        rep.checks.append(Check("matches the float64 reference", False, "not verified", f"{why}; every black-box "
                                "check passed. Pass mapping={'q': ..., 'k': ..., 'v': ..., 'o': ..., 'heads': H} to "
                                "verify it", severity="warning"))


def grade_subject(subject, opts: GradingOptions) -> Report:
    """The :class:`~multihead.grader.report.Report` of the module behind ``subject``."""
    rep = Report(strict=opts.strict, assignment=opts.checks)
    desc = subject.describe()
    sizes = None if opts.self_attn or opts.embed_dim else _role_sizes(desc, opts.mapping)
    E = opts.embed_dim or (sizes[0] if sizes else _size_from(desc, opts.mapping))
    if E is None:  # found by calling (which builds a lazy module)
        E = _size_search(subject, desc, opts.self_attn, opts.conv)
    elif desc.lazy:  # built by a first call at its size
        _call_at(subject, E, opts.self_attn, opts.conv)
    elif not opts.embed_dim and not sizes:
        E = _runs_at(subject, desc, opts.self_attn, E, opts.conv)
    if E is None:
        raise ValueError(f"cannot tell {desc.root}'s input size: no Linear or Dense layer holds it and no size its "
                         "parameters have runs the call; pass embed_dim=.")
    if desc.lazy:
        desc = subject.describe()
    s = Session(subject, opts.conv, opts.causal, opts.self_attn, E, torch.Generator().manual_seed(opts.seed), opts.how,
                kv_sizes=sizes[1:] if sizes else None, kv_same=opts.kv_same,
                dtype=torch.float64 if desc.float64 else torch.float32)
    lengths: list[Finding] = []
    b = _base(s, rep, _call_hint(desc.forward, opts.call), lengths)
    if b is None:
        rep.diagnosis += lengths
    else:
        det, named = _properties(s, b, desc, rep, opts.forbid)
        if not det:
            rep.diagnosis += named + lengths
        else:
            _white_box(s, b, desc, opts, rep, named)
            rep.diagnosis += [f for f in lengths if f not in rep.diagnosis]
    _every_failure_explained(rep)
    return rep
