"""Which pruned model ``multihead prune`` keeps, and what it is worth.

A step of the pruning curve is *finished* (:func:`finish`): copied, recovered by distillation when asked,
quantized when asked, and its fidelity measured on the held-out text as a mean with a 95% interval
(:class:`Fidelity`; with several kinds of text -- sentences of the held-out split, of other sources, passages of
them joined to long inputs -- the worst kind's). Without a target the last step is finished; with a target
(:class:`Goal`: ``--target-cosine``, ``--target-kl``, ``--target-accuracy``) :func:`choose` keeps the furthest step
tried that meets it -- the unpruned model first, the curve's guess next, then bisection (fidelity falls as heads
go) -- within the command's time (:class:`Budget`).

Everything ``--target-*`` asks is here, below :mod:`multihead.apps.prune.pruning`, which calls it and is never called
back: a target a model cannot be judged by refused in one line (:func:`wrong_target`, :func:`target_refused`), the
search told in one line (:func:`search_line`) and the line a missed target ends the command with (:func:`not_met`).
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["Budget", "Fidelity", "Finished", "Goal", "choose", "fidelity", "finish", "no_cosine", "not_met",
           "search_length", "search_line", "seconds_text", "target_refused", "wrong_target"]

#: seconds kept back from the deadline for what follows the speed table (the curve's plot, the report)
RESERVE_S = 5.0
#: the speed table's share of a :class:`Budget` whose phases after the search were not measured (``after_s`` not
#: given); ``prune`` measures them (:mod:`multihead.apps.prune.runtimes`)
TABLE_MIN_S = 30.0
#: the normal quantile of a two-sided 95% interval
Z95 = 1.959964


@dataclass(frozen=True)
class Fidelity:
    """A model's fidelity to the unpruned one on the held-out items: the mean, and with per-item scores
    (mean cosines) the 95% interval of that mean (normal approximation: mean ± 1.96 sd / sqrt(n), the items
    independent) over ``n`` items; ``lo`` and ``hi`` are None for a metric without per-item scores."""

    mean: float
    lo: float | None = None
    hi: float | None = None
    n: int = 0
    kind: str | None = None  # the kind of held-out text it was measured on (None: one kind)
    others: tuple[Fidelity, ...] = ()  # the other kinds' figures, when this is the worst of several
    unit: str = "sentences"  # what the n items are ("passages" for sentences joined to long inputs)

    @classmethod
    def worst(cls, scores: torch.Tensor, kinds: tuple[tuple, ...]) -> Fidelity:
        """From per-item scores (n,) made of consecutive kinds of text ``(name, count)`` or ``(name, count,
        unit)``: the kind whose interval starts lowest, the others kept beside it -- a target is met only where
        every kind meets it."""
        parts, start = [], 0
        for name, count, *unit in kinds:
            f = cls.of(scores[start:start + count])
            parts.append(cls(f.mean, f.lo, f.hi, f.n, name, unit=unit[0] if unit else "sentences"))
            start += count
        if start != scores.numel():
            raise ValueError(f"the held-out kinds {kinds} count {start} items; the scores have {scores.numel()}.")
        low = min(parts, key=lambda f: f.lo)
        return cls(low.mean, low.lo, low.hi, low.n, low.kind, tuple(f for f in parts if f is not low), low.unit)

    @classmethod
    def of(cls, scores: torch.Tensor) -> Fidelity:
        """From per-item scores (n,)."""
        x = scores.double()
        n = x.numel()
        mean = float(x.mean())
        half = Z95 * float(x.std()) / math.sqrt(n) if n > 1 else float("inf")
        return cls(mean, mean - half, mean + half, n)

    def to_json(self) -> dict:
        out = {"mean": self.mean, "ci95": None if self.lo is None else [self.lo, self.hi], "n": self.n}
        if self.kind is not None:
            out["kind"] = self.kind
        if self.others:
            out["others"] = [f.to_json() for f in self.others]
        if self.unit != "sentences":
            out["unit"] = self.unit
        return out

    def __str__(self) -> str:
        if self.lo is None:
            return f"{self.mean:.4f}"
        on = f" of {self.kind}" if self.kind else ""
        rest = "".join(f"; {f}" for f in self.others)
        return f"{self.mean:.4f} (95% interval {self.lo:.4f}-{self.hi:.4f}, {self.n} {self.unit}{on}){rest}"


def fidelity(setup, model: nn.Module) -> Fidelity:
    """``model``'s fidelity on the setup's held-out items (with an interval when the setup has per-item scores)."""
    if setup.scores_fn is not None:
        with torch.no_grad():
            scores = setup.scores_fn(model)  # (n,)
        kinds = getattr(setup, "held_out_kinds", None)  # a Setup, or a stand-in without kinds
        return Fidelity.worst(scores, kinds) if kinds else Fidelity.of(scores)
    return Fidelity(float(setup.metric_fn(model)))


class Budget:
    """The command's time: a ``time.monotonic()`` deadline (None: no limit), the seconds the phases after the search
    need (``after_s``: measured before it, :mod:`multihead.apps.prune.runtimes`; by default :data:`TABLE_MIN_S` and
    :data:`RESERVE_S`), and what one fidelity evaluation costs (``eval_s``, measured as the curve runs), so that the
    steps before the phases after the search leave them their time and the evaluations that follow the steps."""

    def __init__(self, deadline: float | None, after_s: float = TABLE_MIN_S + RESERVE_S):
        self.deadline = deadline
        self.after_s = after_s
        self.eval_s = 0.0

    def left(self) -> float:
        return math.inf if self.deadline is None else self.deadline - time.monotonic()

    def timed(self, metric_fn):
        """``metric_fn`` that records how long it takes (the largest seen is ``eval_s``)."""
        def timed_metric(m):
            t = time.monotonic()
            out = metric_fn(m)
            self.eval_s = max(self.eval_s, time.monotonic() - t)
            return out
        return timed_metric

    def until(self, evals_after: int) -> float | None:
        """The time a step must end by to leave the phases after the search ``after_s`` and ``evals_after``
        fidelity evaluations (None without a deadline)."""
        if self.deadline is None:
            return None
        return self.deadline - self.after_s - evals_after * self.eval_s

    def spare(self, later_s: float) -> float:
        """Seconds left beyond ``later_s`` (what must still follow; inf without a deadline, never below 0)."""
        return max(0.0, self.left() - later_s)


@dataclass
class Finished:
    """Step ``index`` of the curve finished: the float ``model`` (recovered when asked), the ``quantized`` copy
    or None, the recovery record or None, the fidelity of what is kept, and the seconds it took."""

    index: int
    model: nn.Module
    quantized: nn.Module | None
    recovery: dict | None
    fidelity: Fidelity
    seconds: float = 0.0

    @property
    def kept(self) -> nn.Module:
        """What the command saves and times: the quantized model when asked, else the float one."""
        return self.quantized if self.quantized is not None else self.model


def finish(setup, snapshot: nn.Module, index: int, *, recover: int, quantize: str | None,
           budget: Budget, ffn: float = 0.0) -> Finished:
    """Step ``index`` (its model ``snapshot``) with ``ffn`` of every feed-forward block's neurons cut (a copy;
    ``setup.ffn_fn``), recovered for ``recover`` steps (fewer when the budget ends first: the record says how
    many ran), quantized to ``quantize``, its fidelity measured."""
    started = time.monotonic()
    model, recovery = snapshot, None
    if ffn:
        model = copy.deepcopy(snapshot)
        setup.ffn_fn(model, ffn)
    if recover > 0:
        if setup.recover_fn is None:
            raise ValueError(f"--recover is not available for {setup.name}.")
        model = copy.deepcopy(model) if not ffn else model
        before = fidelity(setup, model)
        losses = setup.recover_fn(model, recover, quantize=quantize, until=budget.until(2 + (quantize is not None)))
        after = fidelity(setup, model)
        recovery = {"steps": len(losses), "steps_asked": recover, "metric_before": before.mean,
                    "metric_after": after.mean, "fidelity_before": before.to_json(), "fidelity_after": after.to_json(),
                    "loss_first": losses[0], "loss_last": losses[-1]}
    quantized = None
    if quantize is not None:
        quantized = setup.quantize_fn(model, quantize)
        fq = fidelity(setup, quantized)
        recovery = {**(recovery or {}), "quantize": quantize, "metric_quantized": fq.mean,
                    "fidelity_quantized": fq.to_json()}
    kept = quantized if quantized is not None else model
    fid = (fidelity(setup, kept) if recovery is None else
           Fidelity(**_from_json(recovery["fidelity_quantized" if quantize else "fidelity_after"])))
    return Finished(index, model, quantized, recovery, fid, time.monotonic() - started)


def _from_json(j: dict) -> dict:
    lo, hi = j["ci95"] if j["ci95"] is not None else (None, None)
    return {"mean": j["mean"], "lo": lo, "hi": hi, "n": j["n"], "kind": j.get("kind"),
            "others": tuple(Fidelity(**_from_json(o)) for o in j.get("others", ())),
            "unit": j.get("unit", "sentences")}


@dataclass(frozen=True)
class Goal:
    """What ``--target-*`` asks of the kept model: its fidelity's ``kind`` ("cosine": mean cosine to the unpruned
    model, higher is better; "kl": mean next-token KL to it, lower is better; "accuracy": the task's accuracy, higher
    is better) at ``value`` or better -- where the fidelity has a 95% interval, its conservative end (the lower end
    of a cosine or an accuracy, the upper end of a KL)."""

    kind: str
    value: float

    #: each kind's direction (True: higher is better) and how the command names it
    KINDS = {"cosine": (True, "--target-cosine"), "kl": (False, "--target-kl"), "accuracy": (True, "--target-accuracy")}

    def __post_init__(self):
        if self.kind not in self.KINDS:
            raise ValueError(f"Goal: kind must be one of {sorted(self.KINDS)}; got {self.kind!r}.")

    @property
    def higher(self) -> bool:
        return self.KINDS[self.kind][0]

    @property
    def option(self) -> str:
        return self.KINDS[self.kind][1]

    def end(self, f: Fidelity) -> float:
        """The end of ``f`` the goal is judged on: the interval's end towards worse, else the mean."""
        end = f.lo if self.higher else f.hi
        return f.mean if end is None else end

    def meets(self, f: Fidelity) -> bool:
        return self.end(f) >= self.value if self.higher else self.end(f) <= self.value

    def margin(self, f: Fidelity) -> float:
        """How far ``f`` is past the goal (negative: short of it); the closest model has the largest margin."""
        return self.end(f) - self.value if self.higher else self.value - self.end(f)

    def curve_meets(self, metric: float) -> bool:
        """Whether a step's zero-shot metric on the curve (a mean, before recovery) already meets the goal."""
        return metric >= self.value if self.higher else metric <= self.value

    def __str__(self) -> str:
        return f"target {self.kind} {self.value:g}"


def no_cosine(name: str, metric_name: str) -> str:
    """Why ``--target-cosine`` is refused for a model measured by ``metric_name``."""
    return f"--target-cosine needs a cosine fidelity; {name} is measured by {metric_name}: prune a fixed --fraction instead."


def wrong_target(setup, g: Goal) -> str | None:
    """Why ``g`` cannot be asked of ``setup`` (its fidelity is another kind), or None."""
    if g.kind == setup.metric_kind and (g.kind != "cosine" or setup.scores_fn is not None):
        return None
    return target_refused(setup.name, setup.metric_kind, setup.metric_name, g)


def target_refused(name: str, kind: str, metric_name: str, g: Goal) -> str:
    """The one line refusing ``g`` for a model ``name`` whose fidelity is of ``kind``, measured by ``metric_name``."""
    if g.kind == "cosine":
        return no_cosine(name, metric_name)
    article = "an" if g.kind[0] in "aeiou" else "a"
    return (f"{g.option} needs {article} {g.kind} fidelity; {name} is measured by {metric_name}: use "
            f"{Goal(kind, 1.0).option} instead, or prune a fixed --fraction.")


def search_length(n_steps: int) -> int:
    """The candidates a full search over the curve's ``n_steps`` pruned steps evaluates at most: the unpruned model,
    the curve's guess, and a bisection of the rest."""
    return 2 + math.ceil(math.log2(n_steps + 1)) if n_steps > 0 else 1


def choose(setup, rows: list[dict], snapshots: list[nn.Module], *, target: Goal | float | None, recover: int,
           quantize: str | None, budget: Budget, ffn: float = 0.0, candidate_s: float = 0.0
           ) -> tuple[Finished, dict | None]:
    """The step to keep, finished, and the target search's record (None without ``target``).

    Without a target: the last step. With one, the invariant: **the kept model is the furthest step tried that meets
    the target** (fidelity judged by :class:`Goal`; a float is a cosine). The unpruned model (step 0; recovered
    only when ``ffn`` cut its neurons: distilling a model towards itself changes nothing) is tried first, so a model
    that meets the target is known before any cut is tried; then the furthest step whose zero-shot fidelity on the
    curve already meets the target (recovery only raises it), then bisection between the furthest step that met it
    and the nearest that did not (fidelity falls as heads go), while the budget leaves time for one more candidate
    (``candidate_s``: the plan's estimate of one, until one has been timed). When no model tried meets the target
    (quantization alone can break it), the closest is returned and the record says ``met`` is False: the command
    then exits non-zero."""
    def run(i: int) -> Finished:
        steps = recover if (i > 0 or ffn) else 0
        return finish(setup, snapshots[i], i, recover=steps, quantize=quantize, budget=budget, ffn=ffn)

    last = len(rows) - 1
    if target is None:
        return run(last), None
    goal = target if isinstance(target, Goal) else Goal("cosine", float(target))
    tried: dict[int, Finished] = {}
    started = time.monotonic()

    def passes(i: int) -> bool:
        tried[i] = run(i)
        return goal.meets(tried[i].fidelity)

    def cost() -> float:
        pruned = [f.seconds for i, f in tried.items() if i > 0]
        return max(pruned) if pruned else candidate_s

    def affordable() -> bool:
        return budget.left() - cost() > budget.after_s

    lo, hi = 0, last  # the furthest passing step is in [lo, hi] (lo: the furthest known to pass, or 0)
    passes(0)  # a miss here (quantization, a task accuracy above the model's) does not end the search: a recovered
    # cut can still meet it, and the record keeps the closest
    guess = max((i for i in range(1, last + 1) if "metric" in rows[i] and goal.curve_meets(rows[i]["metric"])),
                default=None)
    while lo < hi and affordable():
        mid = guess if guess is not None and lo < guess <= hi else (lo + hi + 1) // 2
        guess = None
        if passes(mid):
            lo = mid
        else:
            hi = mid - 1
    passed = [i for i, f in tried.items() if goal.meets(f.fidelity)]
    chosen = tried[max(passed)] if passed else max(tried.values(), key=lambda f: goal.margin(f.fidelity))
    left = math.ceil(math.log2(hi - lo + 1)) if lo < hi else 0  # candidates the bisection still needed
    record = _record(goal, rows, tried, chosen, left=left, more_s=left * cost(), took=time.monotonic() - started)
    return chosen, record | {"quantize": quantize}


def _record(goal: Goal, rows: list[dict], tried: dict[int, Finished], chosen: Finished, *, left: int, more_s: float,
            took: float) -> dict:
    """The target search's record (report.json's ``target``): the goal, whether a model tried met it, the one
    kept, whether the budget ended the search (``left`` candidates, about ``more_s`` seconds short) and every
    model tried."""
    return {"target": goal.value, "kind": goal.kind, "higher_is_better": goal.higher,
            "met": any(goal.meets(f.fidelity) for f in tried.values()), "stopped_by_time_budget": left > 0,
            "chosen_fraction": rows[chosen.index]["fraction"], "candidates_left": left,
            "seconds_more_needed": round(more_s, 0), "search_seconds": round(took, 1),
            "tried": [{"fraction": rows[i]["fraction"], "heads_pruned": rows[i]["heads_pruned"],
                       "fidelity": f.fidelity.to_json(), "passed": goal.meets(f.fidelity),
                       "recovery_steps": (f.recovery or {}).get("steps"), "seconds": round(f.seconds, 1)}
                      for i, f in sorted(tried.items())]}


def seconds_text(seconds: float) -> str:
    """Seconds as 4m30s or 45s."""
    m, s = divmod(int(math.ceil(seconds)), 60)
    return f"{m}m{s:02d}s" if m else f"{s}s"


def _end(x: dict, higher: bool) -> float:
    """The conservative end of a tried model's fidelity (its interval's end towards worse, else its mean)."""
    ci = x["fidelity"].get("ci95")
    return x["fidelity"]["mean"] if ci is None else ci[0] if higher else ci[1]


def search_line(t: dict) -> str:
    """The target search in one line: met where, or not; each model tried with the end of its interval judged."""
    higher = t.get("higher_is_better", True)
    kind = t.get("kind", "cosine")
    end = "lower" if higher else "upper"
    tried = "; ".join(f"{x['fraction']:.0%}: {x['fidelity']['mean']:.4f}, {end} end {_end(x, higher):.4f} "
                      f"({'meets' if x['passed'] else 'short'})" for x in t["tried"])
    verdict = (f"met at {t['chosen_fraction']:.0%} of heads pruned" if t["met"] else
               f"NOT met by any model tried (the closest: {t['chosen_fraction']:.0%} pruned)")
    stopped = ""
    if t["stopped_by_time_budget"]:
        stopped = (f"; the time budget ended the search with {t.get('candidates_left', '?')} candidate(s) left "
                   f"(about {seconds_text(t.get('seconds_more_needed', 0))} more would settle it)")
    return f"target {kind} {t['target']}: {verdict} ({tried}){stopped}"


def not_met(t: dict) -> str:
    """The one line ``multihead prune`` ends with (exit 1) when no model tried met the target."""
    higher = t.get("higher_is_better", True)
    closest = next(x for x in t["tried"] if x["fraction"] == t["chosen_fraction"])
    more = (f"; the search needed about {seconds_text(t['seconds_more_needed'])} more (a longer --time-budget)"
            if t["stopped_by_time_budget"] else "")
    why = ""
    if t["tried"][0]["fraction"] == 0 and not t["tried"][0]["passed"]:
        why = (" -- even the unpruned model misses it" + (" (int8 alone costs that much: leave out --quantize or lower "
               "the target)" if t.get("quantize") else " (lower the target)"))
    return (f"target {t.get('kind', 'cosine')} {t['target']} not met by any model tried{why}; the closest: "
            f"{closest['fraction']:.0%} of heads pruned at {_end(closest, higher):.4f} "
            f"({'lower' if higher else 'upper'} end of its interval){more}. Its report and model are in --out.")
