"""Issue 82, point 5: the reasons learners read. A correct module is never failed on float rounding (every
comparison within the rounding its dtype and its sums allow); one denominator per assignment; every failing check in
the diagnosis with its fix; a low-precision softmax named as precision; cross-attention probed at Lq == Lk; a module
in another mask convention told which one fits and how to declare it."""

from __future__ import annotations

import csv
import math
import re
from pathlib import Path

import pytest
import torch
from torch import nn

import multihead
from multihead.grader.session import tolerance


class TorchWrapped(nn.Module):
    """torch.nn.MultiheadAttention itself, self-attention, need_weights=False: torch takes its fast path on a plain
    call (batch-first, eval, no grad) and not on a watched one, so two calls differ by float rounding."""

    def __init__(self, d_model=32, num_heads=4, batch_first=True):
        super().__init__()
        self.mha = nn.MultiheadAttention(d_model, num_heads, batch_first=batch_first)

    def forward(self, x):
        return self.mha(x, x, x, need_weights=False)[0]


class FourLinear(nn.Module):
    """The course's module, written out; each hook below is one place a learner's mistake goes."""

    def __init__(self, d_model=32, num_heads=4):
        super().__init__()
        self.h, self.d = num_heads, d_model // num_heads
        self.W_q, self.W_k = nn.Linear(d_model, d_model), nn.Linear(d_model, d_model)
        self.W_v, self.W_o = nn.Linear(d_model, d_model), nn.Linear(d_model, d_model)

    def split(self, x):
        B, L, _ = x.shape
        return x.view(B, L, self.h, self.d).transpose(1, 2)  # (B, L, E) -> (B, H, L, D)

    def queries(self, q):
        return self.W_q(q)

    def weights(self, scores):
        return torch.softmax(scores, dim=-1)

    def masked(self, scores, mask):
        return scores if mask is None else scores.masked_fill(~mask, float("-inf"))

    def forward(self, q, k, v, mask=None):
        B, Lq, _ = q.shape
        Q, K, V = self.split(self.queries(q)), self.split(self.W_k(k)), self.split(self.W_v(v))
        s = self.masked(Q @ K.transpose(-1, -2) / math.sqrt(self.d), mask)  # (B, H, Lq, Lk)
        return self.W_o((self.weights(s) @ V).transpose(1, 2).reshape(B, Lq, -1))


class NoisyInEval(FourLinear):
    """Random numbers in forward, in eval mode too."""

    def forward(self, q, k, v, mask=None):
        return super().forward(q, k, v, mask) + 1e-3 * torch.randn(q.shape[0], q.shape[1], 32)


# --- 1. no correct module fails on float rounding ------------------------------------------------------------------


@pytest.mark.parametrize("batch_first", [True, False], ids=["batch-first", "sequence-first"])
def test_torch_multihead_attention_wrapped_is_not_failed_on_float_rounding(batch_first):
    """Issue 82.5.1: torch's fast path in one call and not the other made two calls differ by ~1e-7 and the module
    NOT OK ("the output changes from call to call"); the calls now agree within the rounding of float32 sums."""
    for seed in (0, 1):
        torch.manual_seed(seed)
        rep = multihead.check(TorchWrapped(batch_first=batch_first), call="x", seed=seed)
        assert rep.ok and rep.check("eval mode deterministic").passed, str(rep)
        assert rep.check("matches the float64 reference").passed, str(rep)


def test_a_module_that_draws_random_numbers_in_eval_still_fails_determinism():
    torch.manual_seed(0)
    rep = multihead.check(NoisyInEval(), call="qkv")
    c = rep.check("eval mode deterministic")
    assert not rep.ok and c.passed is False and float(c.figure.split()[-1]) > tolerance(torch.float32, 1000), str(rep)
    assert rep.diagnosis[0].name == "builds a layer / draws random numbers inside forward", str(rep)


def test_the_tolerance_is_the_rounding_of_the_dtype_and_its_sums():
    """eps x terms: float32 and float64 scale with their machine epsilon; a bad argument is named with its fix."""
    assert tolerance(torch.float32, 100) == pytest.approx(100 * torch.finfo(torch.float32).eps)
    assert tolerance(torch.float64, 100) == pytest.approx(100 * 2.0 ** -52)
    with pytest.raises(ValueError, match="dtype must be a floating torch dtype"):
        tolerance(torch.int64, 10)
    with pytest.raises(ValueError, match="terms must be the number of terms summed"):
        tolerance(torch.float32, 0)


# --- 3. every failing check in the diagnosis, with its fix ---------------------------------------------------------


class DetachedQueries(FourLinear):
    """The projected queries detached: the output is right, W_q never learns."""

    def queries(self, q):
        return self.W_q(q).detach()


def test_a_parameter_the_gradient_never_reaches_is_named_with_its_fix():
    """Issue 82.5.3: "gradients reach every parameter" FAIL with an empty diagnosis; now the finding names W_q's
    parameters and how to keep them on the graph."""
    torch.manual_seed(0)
    rep = multihead.check(DetachedQueries(), call="qkv")
    assert not rep.ok and rep.check("gradients reach every parameter").passed is False, str(rep)
    assert rep.check("matches the float64 reference").passed, str(rep)  # the output is right
    (f,) = rep.diagnosis
    assert "W_q.weight" in f.name and "W_q.bias" in f.name and ".detach()" in f.advice, str(rep)
    assert f.check == "gradients reach every parameter" and "fix:" in str(rep) and "W_q.weight" in rep.summary()


@pytest.mark.parametrize("make, call, mask", [
    (lambda: DetachedQueries(), "qkv", None), (lambda: NoisyInEval(), "qkv", None),
    (lambda: HalfSoftmax(), "qkv", None), (lambda: TransposedWhereItFits(), "qkv_mask", "keep")],
    ids=["detached", "noisy", "float16", "transposed mask"])
def test_every_failing_check_has_a_finding(make, call, mask):
    """Each failing check of a module is in the diagnosis: a finding of its own, or -- for a check a wrong output
    breaks -- one about the output (its own check's, or located by the reference: check '')."""
    from multihead.grader.verdict import OWN_ONLY

    torch.manual_seed(0)
    rep = multihead.check(make(), call=call, mask=mask)
    assert rep.failures and rep.diagnosis, str(rep)
    about_output = [f for f in rep.diagnosis if f.check not in OWN_ONLY]
    for c in rep.failures:
        own = [f for f in rep.diagnosis if f.check == c.name]
        assert own or (c.name not in OWN_ONLY and about_output), (c.name, str(rep))
        assert all(f.advice for f in own), str(rep)


# --- 4. a low-precision softmax named as precision ------------------------------------------------------------------


class HalfSoftmax(FourLinear):
    """The softmax computed on float16 (or bfloat16) scores: right to that dtype's rounding, not to float32's."""

    def __init__(self, dtype=torch.float16, self_attention=False):
        super().__init__()
        self.low, self.self_attention = dtype, self_attention

    def weights(self, scores):
        return torch.softmax(scores.to(self.low), dim=-1).float()

    def forward(self, q, k=None, v=None, mask=None):
        return super().forward(q, q, q, mask) if self.self_attention else super().forward(q, k, v, mask)


@pytest.mark.parametrize("dtype, self_attention", [(torch.float16, False), (torch.float16, True),
                                                   (torch.bfloat16, False)])
def test_a_low_precision_softmax_is_named_as_precision_with_its_fix(dtype, self_attention):
    """Issue 82.5.4: a float16 softmax was "weights do not sum to 1" with the fix "use softmax over the keys", which it
    does; the spec with its softmax in float16 reproduces the module (to float32's rounding): precision, named."""
    torch.manual_seed(0)
    rep = multihead.check(HalfSoftmax(dtype, self_attention), call="x" if self_attention else "qkv")
    name = str(dtype).removeprefix("torch.")
    assert not rep.ok and rep.check("matches the float64 reference").passed is False, str(rep)
    assert [f.name for f in rep.diagnosis] == [f"softmax computed in {name} (low precision)"], str(rep)
    assert "torch.softmax(scores.float(), dim=-1)" in rep.diagnosis[0].advice, str(rep)
    assert not any("sum to 1 over the keys" in f.name for f in rep.diagnosis), str(rep)


# --- 2. one denominator per assignment ------------------------------------------------------------------------------

SOURCE = '''
import math, torch
from torch import nn


class MHA(nn.Module):
    def __init__(self, d_model=32, num_heads=4):
        super().__init__()
        self.h, self.d = num_heads, d_model // num_heads
        self.W_q, self.W_k = nn.Linear(d_model, d_model), nn.Linear(d_model, d_model)
        self.W_v, self.W_o = nn.Linear(d_model, d_model), nn.Linear(d_model, d_model)

    def forward(self, q, k, v):
        B, Lq, _ = q.shape
        Q, K, V = [x.view(B, -1, self.h, self.d).transpose(1, 2) for x in (self.W_q(q), self.W_k(k), self.W_v(v))]
        w = torch.softmax(Q @ K.transpose(-1, -2) / math.sqrt(self.d), dim=-1)
        return self.W_o((w @ V).transpose(1, 2).reshape(B, Lq, -1)){tail}
'''
CLASS = {"alice": "", "bob": " + 1e-2 * torch.randn(B, Lq, 32)", "carol": "[:, :, :-1].reshape(3)"}


def test_every_grade_of_an_assignment_is_out_of_one_total(tmp_path):
    """Issue 82.5.2: the console showed 8/13 for a submission whose Canvas row read 8 of the assignment's 15 -- each
    row's denominator was the checks its own run reached. Now every row, the table, the gradebook's Points Possible,
    the feedback and the summary are out of the assignment's total (the checks its options make)."""
    from multihead.grader import classroom
    from multihead.grader.report import POINTS, Report, assignment, possible

    files = []
    for learner, tail in CLASS.items():
        (tmp_path / learner).mkdir()
        (tmp_path / learner / "mha.py").write_text(SOURCE.replace("{tail}", tail))
        files.append((tmp_path / learner / "mha.py", "MHA"))
    got = [classroom.grade_file(f, n, call="qkv", seed=2) for f, n in files]
    rows = {Path(r["file"]).parent.name: r for r, _ in got}
    total = possible(POINTS, assignment(masked=False, causal=False, self_attn=False, forbid=False))
    assert {r["possible"] for r in rows.values()} == {total}, rows
    assert [r["status"] for r in rows.values()] == ["ok", "not ok", "error"], rows
    assert rows["alice"]["points"] == total and rows["carol"]["points"] < rows["bob"]["points"] < total, rows
    bob = got[1][1]
    assert Report(bob.checks, bob.diagnosis).points()[1] < total  # the old denominator: the checks bob's run reached
    rows = list(rows.values())
    shown = classroom.table(rows).splitlines()
    assert all(re.search(rf" [\d.]+/{total:g} ", line) for line in shown[2:5]), shown
    assert shown[-1].endswith(f"points out of {total:g}"), shown
    roster = {f"{n}/mha.py": {"Student": n, "ID": str(i)} for i, n in enumerate(CLASS)}
    classroom.write_report(rows, tmp_path / "grades.canvas.csv", roster)
    canvas = list(csv.reader((tmp_path / "grades.canvas.csv").open()))
    assert canvas[1][0] == "Points Possible" and float(canvas[1][-1]) == total, canvas
    md, _ = classroom.write_summary(rows, tmp_path / "summary")
    assert f"of {total:g} on average" in md.read_text()
    fb = classroom.write_feedback(rows[1], bob, tmp_path / "fb")
    assert f"of {total:g} points" in fb.read_text()
    with pytest.raises(ValueError, match="out of different totals"):
        classroom.out_of([rows[0], {**rows[1], "possible": total - 1}])


# --- 5. cross-attention probed at Lq == Lk --------------------------------------------------------------------------


class TransposedWhereItFits(FourLinear):
    """Reads its mask as (B, 1, Lk, Lq) and transposes it where the shapes allow: right at Lq != Lk (the shapes keep
    it as given), the mask applied along the query axis at Lq == Lk."""

    def masked(self, scores, mask):
        m = mask.transpose(-1, -2) if mask.shape[-1] == scores.shape[-2] else mask
        return scores.masked_fill(~m, float("-inf"))


def test_a_mask_applied_along_the_query_axis_is_caught_at_equal_lengths():
    """Issue 82.5.5: the probes never made a cross-attention call with Lq == Lk, distinct inputs and a mask: this
    module was graded OK. The masked-keys check now makes one, in the mask's form, and fails it, saying so."""
    torch.manual_seed(0)
    rep = multihead.check(TransposedWhereItFits(), call="qkv_mask", mask="keep")
    c = rep.check("masked keys have no influence")
    assert not rep.ok and c.passed is False and "only at Lq == Lk" in c.detail, str(rep)
    assert any(f.check == c.name and "masked_fill" in f.advice for f in rep.diagnosis), str(rep)
    torch.manual_seed(0)
    right = multihead.check(FourLinear(), call="qkv_mask", mask="keep")
    assert right.ok and right.check("masked keys have no influence").passed, str(right)


# --- 6. another mask convention: which fits, and how to declare it ---------------------------------------------------

TORCH_STYLE = '''
import math, torch
from torch import nn


class TorchStyle(nn.Module):
    """torch.nn's conventions, by hand: sequence-first, key_padding_mask True = padding, (output, None) returned."""

    def __init__(self, d_model=32, num_heads=4):
        super().__init__()
        self.h, self.d = num_heads, d_model // num_heads
        self.q_proj, self.k_proj = nn.Linear(d_model, d_model), nn.Linear(d_model, d_model)
        self.v_proj, self.out_proj = nn.Linear(d_model, d_model), nn.Linear(d_model, d_model)

    def forward(self, query, key, value, key_padding_mask=None):
        (Lq, B, E), Lk = query.shape, key.shape[0]
        Q, K, V = [p(x).reshape(L, B * self.h, self.d).transpose(0, 1) for p, x, L in
                   ((self.q_proj, query, Lq), (self.k_proj, key, Lk), (self.v_proj, value, Lk))]
        s = (Q @ K.transpose(1, 2) / math.sqrt(self.d)).view(B, self.h, Lq, Lk)
        if key_padding_mask is not None:
            s = s.masked_fill(key_padding_mask[:, None, None, :], float("-inf"))
        o = (torch.softmax(s, -1).view(B * self.h, Lq, Lk) @ V).transpose(0, 1).reshape(Lq, B, E)
        return self.out_proj(o), None
'''


def test_a_module_in_another_mask_convention_is_told_which_fits_and_how_to_declare_it(tmp_path, capsys):
    """Issue 82.5.6: torch.nn's conventions under a declared --mask keep reported "runs on probe inputs FAIL" with a
    reshape error; the report now says the block convention fits (sequence-first, (B, Lk) bool) and --mask block, under
    which the same file is graded OK."""
    from multihead_cli import main

    path = tmp_path / "torch_style.py"
    path.write_text(TORCH_STYLE)
    args = ["check", f"{path}:TorchStyle", "--call", "qkv_mask", "--seed", "3"]
    assert main([*args, "--mask", "keep"]) == 2
    got = capsys.readouterr()
    assert "declare --mask block" in got.err and "sequence-first (L, B, E) inputs, (B, Lk) bool" in got.err, got.err
    assert "- its mask is in the block convention, not keep [stage: inputs]" in got.out, got.out
    assert "--mask block on the command line (mask='block' in multihead.check)" in got.out, got.out
    assert main([*args, "--mask", "block"]) == 0
    assert "OK: the module computes multi-head attention." in capsys.readouterr().out
