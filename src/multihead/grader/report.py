"""The grader's records: a :class:`Check` (one property of the module, pass/fail/n-a, failure or
warning), a :class:`Finding` (a departure from multi-head attention, located at a stage, named
when a hypothesis reproduces it, with the fix), and the :class:`Report` of one module: its verdict,
its points under a scheme, and the feedback a learner reads (nothing of the reference solution).
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["CHECKS", "POINTS", "Check", "Finding", "Report", "assignment", "points_scheme", "possible", "safe"]

#: the most characters of a submission's text (an error, a name) shown in a report, a feedback file or the table
CAP = 2000


def safe(text, limit: int = CAP) -> str:
    """A submission's text made safe to show on the trusted side (the console, a report, feedback, the class table):
    every character that is not printable -- control characters, escape sequences' ESC, newlines, bidirectional
    overrides -- shown escaped as text (``\\x1b``, ``\\n``, ``\\u202e``), and at most ``limit`` characters kept
    (the rest counted). Idempotent: safe text comes back unchanged."""
    s = "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in str(text))
    return s if len(s) <= limit else f"{s[:limit]}... [{len(s) - limit} more characters]"


#: every check the grader can make, in the order it makes them
CHECKS = (
    "runs on probe inputs",
    "output shape and dtype",
    "eval mode deterministic",
    "inputs unchanged by a call",
    "no state between calls",
    "heads have their own weights",
    "no forbidden calls",
    "batch independence",
    "masked keys have no influence",
    "fully masked rows finite",
    "causal: position 0 unchanged when the future changes",
    "causal: no influence from the future",
    "returned weights rows sum to 1",
    "attention weights can be seen",
    "gradients reach every parameter",
    "permutation equivariance",
    "order of the keys does not matter",
    "each query's weights sum to 1",
    "stable on large scores",
    "matches the float64 reference",
)

#: the default points per check (partial credit): the reference comparison is worth most, the
#: properties one each, the robustness warnings nothing; a check that does not apply is left out
POINTS = {name: 1.0 for name in CHECKS} | {
    "matches the float64 reference": 4.0,
    "fully masked rows finite": 0.0,
    "attention weights can be seen": 0.0,
}


def assignment(*, masked: bool, causal: bool, self_attn: bool, forbid: bool) -> tuple[str, ...]:
    """The checks an assignment makes of every submission (in :data:`CHECKS` order), from how it is graded alone --
    a mask, causal, self-attention, forbidden calls -- never from what a submission did: the one set whose points are
    every submission's denominator (:func:`possible`)."""
    skip = set()
    if not masked:
        skip |= {"masked keys have no influence", "fully masked rows finite"}
    if not causal:
        skip |= {"causal: position 0 unchanged when the future changes", "causal: no influence from the future"}
    if not self_attn or causal:
        skip.add("permutation equivariance")
    if self_attn or causal:
        skip |= {"order of the keys does not matter", "each query's weights sum to 1"}
    if not forbid:
        skip.add("no forbidden calls")
    return tuple(c for c in CHECKS if c not in skip)


def possible(scheme: dict[str, float] | None, checks: tuple[str, ...]) -> float:
    """The points an assignment of ``checks`` (:func:`assignment`) is out of under ``scheme`` (default
    :data:`POINTS`): one denominator for every submission, graded, failed early or not graded at all."""
    scheme = POINTS if scheme is None else scheme
    return sum(scheme.get(name, 0.0) for name in checks)


def points_scheme(given: dict | None) -> dict[str, float]:
    """The default :data:`POINTS` updated with ``given`` (check name -> points); a name that is not a
    check, or points that are not a non-negative number, raise a ValueError naming it."""
    scheme = dict(POINTS)
    for name, value in (given or {}).items():
        if name not in POINTS:
            raise ValueError(f"points: {name!r} is not a check; the checks are: {', '.join(CHECKS)}.")
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise ValueError(f"points: {name!r} must be a number >= 0; got {value!r}.")
        scheme[name] = float(value)
    return scheme


@dataclass
class Check:
    """One check: ``passed`` True, False, or None (not applicable); ``severity`` "failure" (the module
    does not compute multi-head attention) or "warning" (a robustness note, or what could not be verified)."""

    name: str
    passed: bool | None
    figure: str = ""
    detail: str = ""
    severity: str = "failure"
    #: not applicable for what the module is (no fresh copy to compare with, too few positions to permute), not for a
    #: failure elsewhere: it earns its points (:meth:`Report.points`)
    waived: bool = False


@dataclass
class Finding:
    """A departure from multi-head attention: ``name`` (short), ``advice`` (the fix), and where it was
    located: ``stage``, what the spec ``expected`` and what the module computes (``found``); ``check``: the check
    whose failure it explains ('' for a mistake located by comparing the output with the reference)."""

    name: str
    advice: str
    stage: str = ""
    expected: str = ""
    found: str = ""
    check: str = ""

    def __str__(self) -> str:
        where = f" [{self.stage}]" if self.stage else ""
        seen = f" expected {self.expected}; found {self.found}." if self.expected or self.found else ""
        return f"{self.name}{where}:{seen} Fix: {self.advice}"


@dataclass
class Report:
    """What the grader established about one module: its checks, the findings that locate what is
    wrong (``diagnosis``), and the verdict :attr:`ok`."""

    checks: list[Check] = field(default_factory=list)
    diagnosis: list[Finding] = field(default_factory=list)
    strict: bool = False
    #: the checks the assignment makes of every submission (:func:`assignment`): the points' denominator
    assignment: tuple[str, ...] = ()

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if c.passed is False and c.severity == "failure"]

    @property
    def warnings(self) -> list[Check]:
        return [c for c in self.checks if c.passed is False and c.severity == "warning"]

    @property
    def ok(self) -> bool:
        """No failure and nothing found wrong (and, with ``strict``, no warning either)."""
        return not self.failures and not self.diagnosis and not (self.strict and self.warnings)

    def check(self, name: str) -> Check | None:
        return next((c for c in self.checks if c.name == name), None)

    def __str__(self) -> str:
        w = max(len(c.name) for c in self.checks) if self.checks else 10
        lines = [f"{'check':<{w}}  result  figure", "-" * (w + 30)]
        for c in self.checks:
            mark = {True: "pass", None: "n/a"}.get(c.passed, "FAIL" if c.severity == "failure" else "warn")
            lines.append(f"{c.name:<{w}}  {mark:<6}  {safe(c.figure)}" + (f"  ({safe(c.detail)})" if c.detail else ""))
        if self.diagnosis:
            lines += ["", "diagnosis:"]
            for f in self.diagnosis:
                lines.append(f"- {safe(f.name)}" + (f" [stage: {safe(f.stage)}]" if f.stage else ""))
                if f.expected or f.found:
                    lines.append(f"    expected: {safe(f.expected)}")
                    lines.append(f"    found:    {safe(f.found)}")
                lines.append(f"    fix:      {safe(f.advice)}")
        lines.append("")
        if self.ok:
            n = len(self.warnings)
            lines.append("OK: the module computes multi-head attention." + (f" ({n} warning{'s' * (n != 1)})" if n else ""))
        else:
            lines.append("NOT OK." + (" (warnings fail with --strict)" if self.strict and self.warnings
                                      and not self.failures and not self.diagnosis else ""))
        return "\n".join(lines)

    def summary(self) -> str:
        """One line: the first finding, or the first failed check."""
        if self.diagnosis:
            f = self.diagnosis[0]
            return safe(f"{f.name}" + (f" [{f.stage}]" if f.stage else "") + (
                f" (+{len(self.diagnosis) - 1} more)" if len(self.diagnosis) > 1 else ""))
        bad = self.failures or (self.warnings if self.strict else [])
        return safe(bad[0].name + (f": {bad[0].detail}" if bad[0].detail else "")) if bad else ""

    def points(self, scheme: dict[str, float] | None = None) -> tuple[float, float]:
        """(earned, possible) under ``scheme`` (default :data:`POINTS`). With an :attr:`assignment` (every report the
        grader makes), possible is the assignment's (:func:`possible`), the same for every submission, and a check
        earns its points when it passes or is waived (not applicable for what the module is; the returned weights'
        sums where it returns none); one never reached (the module failed first) earns nothing. A reference
        comparison that could not be made (the parts unreadable) with nothing found wrong earns its points: the
        black-box checks vouch for it. (Without an assignment: the checks that ran, as before issue 82.)"""
        scheme = POINTS if scheme is None else scheme
        ran = {c.name: c for c in self.checks}
        if self.assignment:
            return sum(scheme.get(n, 0.0) for n in self.assignment if self._earns(n, ran)), \
                possible(scheme, self.assignment)
        earned = possible_ = 0.0
        for name, pts in scheme.items():
            c = ran.get(name)
            if (c is None and name not in _ALWAYS) or (c is not None and c.passed is None):
                continue
            possible_ += pts
            if c is not None and (c.passed or self._vouched(c)):
                earned += pts
        return earned, possible_

    def scored(self, scheme: dict[str, float] | None = None) -> list[tuple[str, float, float, Check | None]]:
        """(check, points earned, points possible, the check as run or None) for each check of the
        :attr:`assignment`, in order: the parts :meth:`points` adds up (a platform's per-check tests)."""
        scheme = POINTS if scheme is None else scheme
        ran = {c.name: c for c in self.checks}
        return [(n, scheme.get(n, 0.0) if self._earns(n, ran) else 0.0, scheme.get(n, 0.0), ran.get(n))
                for n in self.assignment]

    def _earns(self, name: str, ran: dict[str, Check]) -> bool:
        c = ran.get(name)
        if c is None:  # never reached, or the returned weights' sums of a module that returns none (its weights seen)
            return name == "returned weights rows sum to 1" and "attention weights can be seen" in ran
        return bool(c.passed) or (c.passed is None and c.waived) or self._vouched(c)

    def _vouched(self, c: Check) -> bool:
        return c.name == "matches the float64 reference" and c.severity == "warning" and not self.diagnosis

    def feedback(self, title: str = "") -> str:
        """Markdown for the learner: the verdict, each check, and each finding with its stage, what was
        expected, what was found and the fix -- no reference outputs, weights or code."""
        lines = [f"# {_md(title) if title else 'Your multi-head attention'}", ""]
        lines.append("**OK**: it computes multi-head attention." if self.ok else "**Not OK** yet: see below.")
        lines += ["", "| check | result |", "|---|---|"]
        for c in self.checks:
            mark = {True: "pass", None: "n/a"}.get(c.passed, "FAIL" if c.severity == "failure" else "warning")
            note = f" ({c.detail})" if c.detail else ""
            lines.append(f"| {c.name} | {mark}{_md(note)} |")
        if self.diagnosis:
            lines += ["", "## What to fix", ""]
            for f in self.diagnosis:
                lines += [f"### {_md(f.name)}", ""]
                if f.stage:
                    lines.append(f"- **stage**: {_md(f.stage)}")
                if f.expected:
                    lines.append(f"- **expected**: {_md(f.expected)}")
                if f.found:
                    lines.append(f"- **found**: {_md(f.found)}")
                lines += [f"- **fix**: {_md(f.advice)}", ""]
        return "\n".join(lines).rstrip() + "\n"


#: checks every module is given (the others depend on the call, the mask and ``causal``)
_ALWAYS = {"runs on probe inputs", "output shape and dtype", "eval mode deterministic", "inputs unchanged by a call",
           "no state between calls", "heads have their own weights", "batch independence",
           "gradients reach every parameter", "matches the float64 reference"}


def _md(text: str) -> str:
    return safe(text).replace("|", "\\|")
