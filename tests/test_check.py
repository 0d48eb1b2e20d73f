"""multihead.check: correct modules of every style pass (exit 0); one-bug and two-bug modules are
located and named; the module comes back as it was; contradictory calls and bad input refused."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import multihead

sys.path.insert(0, str(Path(__file__).resolve().parent))
from check_zoo import BUGGY, PAIRS, STYLES, FourLinear  # noqa: E402


def grade(style, bugs=(), **kw):
    make, call, mask, causal = STYLES[style]
    torch.manual_seed(0)
    return multihead.check(make(bug=bugs), call=call, mask=mask, causal=causal, **kw)


@pytest.mark.parametrize("style", list(STYLES))
def test_a_correct_module_of_every_style_passes(style):
    bugs = {"nan_to_num"} if style == "wrapper, causal" else ()
    rep = grade(style, bugs)
    assert rep.ok, str(rep)
    assert any(c.name == "matches the float64 reference" and c.passed for c in rep.checks), str(rep)


@pytest.mark.parametrize("style, bugs, names", BUGGY, ids=[f"{s}: {'+'.join(sorted(b))}" for s, b, _ in BUGGY])
def test_each_bug_is_located_and_named(style, bugs, names):
    rep = grade(style, bugs)
    assert not rep.ok
    assert [f.name for f in rep.diagnosis] == names, str(rep)
    f = rep.diagnosis[0]
    assert f.stage and f.advice and (f.expected or f.name == "dropout active in eval"), str(rep)


@pytest.mark.parametrize("style, bugs, names", PAIRS, ids=[f"{s}: {'+'.join(sorted(b))}" for s, b, _ in PAIRS])
def test_two_bugs_at_once_are_both_named(style, bugs, names):
    rep = grade(style, bugs)
    assert sorted(f.name for f in rep.diagnosis) == sorted(names), str(rep)


@pytest.mark.parametrize("style, form", [
    ("sequence-first, key padding", "the mask given as sequence-first (L, B, E) inputs, (B, Lk) bool: under (B, 1, "
     "Lq, Lk) 1/0 floats it raised"),
    ("dict output", "the output read from the dict's 'output'"),
    ("additive mask given a keep mask", "the mask given as (B, 1, Lq, Lk) additive floats (0 kept, -inf blocked): "
     "under (B, 1, Lq, Lk) bool it let masked keys change the output"),
])
def test_a_convention_correct_code_uses_is_found_and_the_report_says_it(style, form):
    """Issue 65: torch.nn's sequence-first layout with a (B, Lk) key-padding mask ('cannot be graded'), a dict
    returned ({"output", "attention"}: NOT OK) and an additive float mask given the course's boolean one (NOT OK,
    'mask applied wrongly') are found by trying the forms correct code uses and graded OK on theirs, which the report
    says; a module no form explains is graded on the course's form (the bugs in these styles: BUGGY)."""
    rep = grade(style)
    assert rep.ok and rep.check("matches the float64 reference").passed, str(rep)
    assert rep.check("runs on probe inputs").detail.startswith(form), rep.check("runs on probe inputs").detail


def test_a_module_that_ignores_its_mask_is_graded_on_the_courses_form():
    rep = grade("four Linear", {"ignore mask"})
    assert rep.check("masked keys have no influence").passed is False and rep.check("runs on probe inputs").detail \
        == "", str(rep)


def test_the_finding_says_the_stage_what_was_expected_and_found():
    rep = grade("four Linear", {"scale d_model"})
    (f,) = rep.diagnosis
    assert f.stage == "scores" and "1/sqrt(8)" in f.expected and "1/sqrt(d_model)" in f.found, str(f)
    text = str(rep)
    assert "[stage: scores]" in text and "expected:" in text and "found:" in text and "fix:" in text


def test_any_fill_value_for_the_mask_is_correct():
    for fill in (float("-inf"), -1e9, -1e4):
        torch.manual_seed(0)
        rep = multihead.check(FourLinear(fill=fill, bug={"nan_to_num"}), call="qkv_mask", mask="block")
        assert rep.ok, (fill, str(rep))
    torch.manual_seed(0)
    rep = multihead.check(FourLinear(fill=-1e9, bug={"axis queries"}), call="qkv_mask", mask="block")
    assert [f.name for f in rep.diagnosis] == ["softmax over the wrong axis"], str(rep)
    torch.manual_seed(0)
    rep = multihead.check(FourLinear(fill=-1e9, bug={"inverted"}), call="qkv_mask", mask="block")
    assert [f.name for f in rep.diagnosis] == ["mask polarity inverted"], str(rep)


def test_nan_on_fully_masked_rows_is_a_warning_not_a_failure():
    torch.manual_seed(0)
    m = FourLinear()  # masked_fill(-inf) and softmax: a row with every key masked is NaN, as in torch.nn
    rep = multihead.check(m, call="qkv_mask", mask="block")
    assert rep.ok and [c.name for c in rep.warnings] == ["fully masked rows finite", "attention weights can be seen"]
    assert "OK: the module computes multi-head attention. (2 warnings)" in str(rep)
    strict = multihead.check(m, call="qkv_mask", mask="block", strict=True)
    assert not strict.ok and not strict.failures and "fully masked rows finite" in strict.summary()


def test_the_module_comes_back_as_it_was():
    torch.manual_seed(0)
    m = FourLinear(bug={"dropout"})
    m.train()
    m.W_o.eval()  # a mixed state, kept as it is
    x = torch.randn(2, 3, 32)
    m(x, x, x).sum().backward()
    grads = {n: p.grad.clone() for n, p in m.named_parameters()}
    params = {n: p.detach().clone() for n, p in m.named_parameters()}
    torch.manual_seed(123)
    rng = torch.get_rng_state()
    multihead.check(m, call="qkv_mask", mask="block")
    assert m.training and m.W_q.training and not m.W_o.training
    assert all(torch.equal(p.grad, grads[n]) for n, p in m.named_parameters())
    assert all(torch.equal(p, params[n]) for n, p in m.named_parameters())
    assert torch.equal(torch.get_rng_state(), rng)


def test_a_contradictory_call_is_refused_before_any_check():
    m = FourLinear()
    calls = []
    m.register_forward_pre_hook(lambda *a: calls.append(1))
    with pytest.raises(ValueError, match=r"call='x' with mask='keep' cannot be honoured: m\(x\) passes no mask"):
        multihead.check(m, call="x", mask="keep")
    with pytest.raises(ValueError, match=r"call='qkv' with mask='block'.*Use call='qkv_mask'"):
        multihead.check(m, call="qkv", mask="block")
    with pytest.raises(ValueError, match=r"call='x' with mask='keep'.*Use call='x_mask' \(m\(x, mask\)\)"):
        multihead.check(m, call="x", mask="keep")
    with pytest.raises(ValueError, match="never uses its fifth argument"):
        multihead.check(m, call=lambda mod, q, k, v, mk: mod(q, k, v), mask="block")
    with pytest.raises(TypeError, match=r"f\(module, q, k, v, mask\)"):
        multihead.check(m, call=lambda mod, q: mod(q, q, q))
    assert not calls


def test_bad_input_is_reported():
    with pytest.raises(ValueError, match="has no parameters"):
        multihead.check(nn.Identity())
    with pytest.raises(TypeError, match="takes a torch.nn.Module"):
        multihead.check(lambda x: x)
    with pytest.raises(ValueError, match=r"mask must be one of"):
        multihead.check(FourLinear(), call="qkv_mask", mask="ones")
    rep = multihead.check(FourLinear(d_model=32), call="qkv", embed_dim=16)  # the wrong size: it raises inside
    assert not rep.ok and rep.checks[0].name == "runs on probe inputs" and "RuntimeError" in rep.checks[0].detail


def test_the_course_modules_torch_nn_and_a_causal_valid_lens_module_pass():
    from multihead.compat import D2LMultiHeadAttention, KerasTutorialMultiHeadAttention

    torch.manual_seed(0)
    d2l = D2LMultiHeadAttention(key_size=32, query_size=32, value_size=32, num_hiddens=32, num_heads=4, dropout=0.1)
    rep = multihead.check(d2l, call="qkv_mask", mask="valid_lens")
    assert rep.ok and not rep.warnings, str(rep)  # its weights are kept as attention_weights
    keras_tut = KerasTutorialMultiHeadAttention(h=4, d_k=32, d_v=32, d_model=32)
    keras_tut(torch.zeros(1, 2, 32), torch.zeros(1, 2, 32), torch.zeros(1, 2, 32))  # infer the input sizes
    rep = multihead.check(keras_tut, call="qkv_mask", mask="block", mapping={"heads": 4})
    assert rep.ok, str(rep)  # its scale (1/sqrt of the total d_k, as the tutorial's code) is read off .scale
    tnn = nn.MultiheadAttention(32, 4, batch_first=True)
    rep = multihead.check(tnn, call=lambda m, q, k, v, mk: m(q, k, v, key_padding_mask=mk[:, 0, 0].bool())[0],
                          mask="block")
    assert rep.ok and [c.name for c in rep.warnings] == ["fully masked rows finite", "attention weights can be seen"]

    class CausalLens(nn.Module):  # causal inside, and the course's valid_lens on top
        def __init__(self):
            super().__init__()
            self.inner = FourLinear(bug={"nan_to_num"})

        def forward(self, q, k, v, valid_lens):
            L = k.shape[1]
            blocked = (torch.arange(L) >= valid_lens[:, None])[:, None, None, :] | torch.ones(L, L).triu(1).bool()
            return self.inner(q, k, v, blocked.float())

    torch.manual_seed(0)
    rep = multihead.check(CausalLens(), call="qkv_mask", mask="valid_lens", causal=True)
    assert rep.ok, str(rep)


def test_transformers_bert_self_attention_passes():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(hidden_size=32, num_attention_heads=4, attn_implementation="eager")
    m = transformers.models.bert.modeling_bert.BertSelfAttention(cfg)

    def call(mod, q, k, v, keep):
        return mod(q, attention_mask=torch.zeros(keep.shape).masked_fill(~keep, -1e9))[0]

    rep = multihead.check(m, call=call, mask="keep", embed_dim=32, self_attention=True, mapping={"heads": 4})
    assert not rep.failures and not rep.diagnosis, str(rep)
    assert any(c.name == "matches the float64 reference" and c.passed for c in rep.checks), str(rep)


KERAS_FILE = """
import keras
from keras import ops


class KerasMHA(keras.layers.Layer):
    def __init__(self, d_model=32, num_heads=4, scale_by_d_k=False):
        super().__init__()
        self.num_heads, self.d, self.by_dk = num_heads, d_model // num_heads, scale_by_d_k
        self.W_q, self.W_k = keras.layers.Dense(d_model), keras.layers.Dense(d_model)
        self.W_v, self.W_o = keras.layers.Dense(d_model), keras.layers.Dense(d_model)

    def call(self, q, k, v):
        def heads(x):
            return ops.transpose(ops.reshape(x, (x.shape[0], x.shape[1], self.num_heads, self.d)), (0, 2, 1, 3))

        Q, K, V = heads(self.W_q(q)), heads(self.W_k(k)), heads(self.W_v(v))
        s = ops.matmul(Q, ops.transpose(K, (0, 1, 3, 2))) / (self.d if self.by_dk else self.d ** 0.5)
        o = ops.transpose(ops.matmul(ops.softmax(s, -1), V), (0, 2, 1, 3))
        return self.W_o(ops.reshape(o, (o.shape[0], o.shape[1], -1)))
"""


def test_keras_layers():
    keras = pytest.importorskip("keras")
    if keras.backend.backend() != "torch":
        pytest.skip("Keras runs on another backend here")
    layer = keras.layers.MultiHeadAttention(num_heads=4, key_dim=8)
    x = torch.zeros(1, 2, 32)
    layer(x, x)  # build
    rep = multihead.check(layer, call=lambda m, q, k, v, keep: m(q, v, key=k, attention_mask=keep[:, 0]),
                          mask="keep", embed_dim=32)
    assert not rep.failures and not rep.diagnosis, str(rep)

    ns: dict = {}
    exec(KERAS_FILE, ns)  # a learner's Keras 3 layer: Dense projections
    KerasMHA = ns["KerasMHA"]  # noqa: N806

    for by_dk in (False, True):
        m = KerasMHA(32, 4, by_dk)
        m(x, x, x)
        rep = multihead.check(m, call="qkv")
        names = [f.name for f in rep.diagnosis]
        assert names == (["scores divided by d_k"] if by_dk else []), str(rep)
        assert rep.ok != by_dk and not (rep.failures and not by_dk), str(rep)  # 'gradients reach every parameter'
    rep = multihead.check(KerasMHA(32, 4), call="qkv")  # not built: built by a first call ('has no parameters')
    assert rep.ok and rep.check("matches the float64 reference").passed, str(rep)




def test_a_learners_keras_file_is_graded_from_the_command_line(tmp_path, capsys, monkeypatch):
    """A Keras 3 layer in a learner's file: the sandbox runs Keras on torch (it imported TensorFlow, absent:
    exit 2), builds the layer by a first call (its Dense layers were not read: a warning), and every name of its
    weights gets its gradient (Keras lists each twice: 'gradients reach every parameter' failed, NOT OK)."""
    pytest.importorskip("keras")
    from multihead_cli import main

    monkeypatch.delenv("KERAS_BACKEND", raising=False)  # the grader's user need not know about it
    f = tmp_path / "keras_mha.py"
    f.write_text(KERAS_FILE)
    code = main(["check", f"{f}:KerasMHA", "--call", "qkv"])
    out = capsys.readouterr().out
    assert code == 0 and re.search(r"matches the float64 reference\s+pass", out), out
    code = main(["check", f"{f}:KerasMHA", "--init", "scale_by_d_k=True", "--call", "qkv"])
    out = capsys.readouterr().out
    assert code == 1 and "- scores divided by d_k" in out, out


def test_command_line_grades_a_file_with_exit_codes(tmp_path, capsys):
    from multihead_cli import main

    example = Path(__file__).resolve().parent.parent / "examples" / "vit_notebook_attention.py"
    code = main(["check", f"{example}:NotebookMHSA", "--init", "d_model=32, num_head=4, d_k=8", "--call", "x"])
    out = capsys.readouterr().out
    assert code == 1
    assert "- softmax skipped (values times raw scores)" in out and "- scores divided by d_k" in out
    fixed = tmp_path / "fixed.py"
    fixed.write_text(example.read_text().replace("/ self.d_k  #", "/ self.d_k**0.5  #").replace(
        "out = scores @ v", "out = weights @ v"))
    assert main(["check", f"{fixed}:NotebookMHSA", "--init", "d_model=32, num_head=4, d_k=8", "--call", "x"]) == 0
    assert "OK: the module computes multi-head attention." in capsys.readouterr().out
    assert main(["check", f"{tmp_path / 'nope.py'}:X"]) == 2
    assert main(["check", f"{example}:Missing"]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and "has no 'Missing'; it defines" in err
    assert main(["check", f"{example}:NotebookMHSA", "--init", "d_model=32, num_head=4, d_k=8", "--call", "x",
                 "--mask", "keep"]) == 2
    assert "cannot be honoured" in capsys.readouterr().err


def test_grading_a_folder_gives_every_submission_its_line(tmp_path, capsys):
    import csv
    import json

    from multihead_cli import main

    zoo = (Path(__file__).resolve().parent / "check_zoo.py").read_text()
    subs = tmp_path / "class"
    subs.mkdir()

    def submission(name, body):
        (subs / f"{name}.py").write_text(zoo + "\n\n" + body)

    submission("alice", "class MHA(FourLinear):\n    pass\n")
    submission("bob", "class MHA(FourLinear):\n    def __init__(self, **kw):\n        super().__init__(bug={'scale d_k'}, "
                      "**kw)\n")
    submission("carol", "class MHA(FourLinear):\n    def forward(self, q, k, v, mask=None):\n        while True:\n"
                        "            pass\n")
    submission("dave", "class Attention(FourLinear):\n    pass\n")  # no class MHA
    (subs / "erin.py").write_text("import torch\nraise RuntimeError('my notebook cell')\n")
    report = tmp_path / "grades.csv"
    code = main(["check", str(subs), "--name", "MHA", "--init", "d_model=32, num_heads=4", "--call", "qkv_mask",
                 "--mask", "block", "--timeout", "8", "--report", str(report)])
    out = capsys.readouterr().out
    assert code == 1
    rows = {Path(r["file"]).stem: r for r in csv.DictReader(report.open())}
    assert set(rows) == {"alice", "bob", "carol", "dave", "erin"}, out
    assert rows["alice"]["status"] == "ok" and rows["alice"]["ok"] == "True"
    assert rows["bob"]["status"] == "not ok" and rows["bob"]["finding"].startswith("scores divided by d_k [scores]")
    assert rows["carol"]["status"] == "timeout"
    assert rows["dave"]["status"] == "error" and "has no 'MHA'" in rows["dave"]["finding"]
    assert rows["erin"]["status"] == "error" and "RuntimeError: my notebook cell" in rows["erin"]["finding"]
    assert "1 of 5 OK" in out
    as_json = tmp_path / "grades.json"
    assert main(["check", str(subs / "alice.py"), str(subs / "bob.py"), "--name", "MHA", "--call", "qkv_mask",
                 "--mask", "block", "--report", str(as_json)]) == 1
    assert [r["status"] for r in json.loads(as_json.read_text())] == ["ok", "not ok"]
    assert main(["check", str(tmp_path / "nothing-*.py"), "--name", "MHA"]) == 2
    assert main(["check", str(subs / "carol.py:MHA"), "--call", "qkv_mask", "--mask", "block", "--timeout", "3"]) == 2
    assert "no answer within 3 s" in capsys.readouterr().err


def test_a_call_that_does_not_fit_the_forward_suggests_the_one_that_does(capsys):
    from multihead_cli import main

    example = Path(__file__).resolve().parent.parent / "examples" / "vit_notebook_attention.py"
    assert main(["check", f"{example}:NotebookMHSA", "--init", "d_model=32, num_head=4, d_k=8"]) == 2
    err = capsys.readouterr().err
    assert "the call raised: m(q, k, v)" in err and "(its forward(x) fits call='x')" in err


SELF_MASKED = """
import math
import torch
from torch import nn


class SelfMasked(nn.Module):
    \"\"\"Self-attention taking its mask with its input, forward(x, mask): a fused qkv, heads folded into the batch,
    the mask expanded per head; ``ignore`` leaves the mask out (the bug).\"\"\"

    def __init__(self, d_model, num_heads, ignore=False):
        super().__init__()
        self.H, self.D, self.ignore = num_heads, d_model // num_heads, ignore
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x, mask=None):
        B, L, E = x.shape
        q, k, v = (t.reshape(B, L, self.H, self.D).transpose(1, 2).reshape(B * self.H, L, self.D)
                   for t in self.qkv(x).split(E, dim=-1))  # 3 x (B*H, L, D)
        s = q @ k.transpose(1, 2) / math.sqrt(self.D)  # (B*H, L, L)
        if mask is not None and not self.ignore:
            s = s.masked_fill(~mask.expand(B, self.H, L, L).reshape(B * self.H, L, L), float("-inf"))
        o = (s.softmax(-1) @ v).reshape(B, self.H, L, self.D).transpose(1, 2).reshape(B, L, E)  # (B, L, E)
        return self.proj(o)
"""


def test_self_attention_with_a_mask_is_graded_through_x_mask(tmp_path, capsys):
    """``forward(x, mask)``: call='x_mask' (m(x, mask)) grades it as self-attention with its mask, in this
    process and in the sandbox; a module that drops the mask is caught by the masked keys."""
    from multihead_cli import main

    ns: dict = {}
    exec(compile(SELF_MASKED, "self_masked.py", "exec"), ns)
    torch.manual_seed(0)
    rep = multihead.check(ns["SelfMasked"](32, 4), call="x_mask", mask="keep")
    assert rep.ok, str(rep)
    names = [c.name for c in rep.checks]
    assert "masked keys have no influence" in names and "permutation equivariance" in names  # masked, self-attention
    bad = multihead.check(ns["SelfMasked"](32, 4, ignore=True), call="x_mask", mask="keep")
    assert not bad.ok and any(c.name == "masked keys have no influence" and c.passed is False for c in bad.checks)
    path = tmp_path / "self_masked.py"
    path.write_text(SELF_MASKED)
    assert main(["check", f"{path}:SelfMasked", "--init", "d_model=32, num_heads=4", "--call", "x_mask",
                 "--mask", "keep"]) == 0
    assert "OK: the module computes multi-head attention." in capsys.readouterr().out
    assert main(["check", f"{path}:SelfMasked", "--init", "d_model=32, num_heads=4, ignore=True", "--call", "x_mask",
                 "--mask", "keep"]) == 1
    assert main(["check", f"{path}:SelfMasked", "--init", "d_model=32, num_heads=4", "--call", "x",
                 "--mask", "keep"]) == 2
    assert "use --call x_mask, or --mask none" in capsys.readouterr().err


def test_a_module_built_in_float64_is_probed_in_float64(tmp_path, capsys):
    """A module whose parameters are all float64 (built with .double()) raised on the float32 probes ('mat1 and mat2
    must have the same dtype'): it could not be graded. It is probed in its dtype now, and its mistakes still named."""
    from multihead_cli import main

    torch.manual_seed(0)
    rep = multihead.check(FourLinear(d_model=32, num_heads=4).double(), call="qkv_mask", mask="block")
    assert rep.ok and rep.check("matches the float64 reference").passed, str(rep)
    torch.manual_seed(0)
    bad = multihead.check(FourLinear(d_model=32, num_heads=4, bug={"scale d_k"}).double(), call="qkv_mask", mask="block")
    assert not bad.ok and bad.diagnosis[0].name == "scores divided by d_k", str(bad)
    f = tmp_path / "f64.py"
    f.write_text(SELF_MASKED + "\n\nclass Double(SelfMasked):\n    def __init__(self, **kw):\n        super().__init__(**kw)\n"
                 "        self.double()\n")
    assert main(["check", f"{f}:Double", "--init", "d_model=32, num_heads=4", "--call", "x_mask", "--mask", "keep"]) == 0
    assert "OK: the module computes multi-head attention." in capsys.readouterr().out


def test_a_nondeterministic_module_is_not_blamed_for_batch_dependence():
    """Dropout left on in eval changes every call: batch independence cannot be measured then, and
    the report says so instead of 'depends on the other sequences' (a finding it could not make)."""
    rep = grade("four Linear", {"dropout"})
    (c,) = [c for c in rep.checks if c.name == "batch independence"]
    assert c.passed is None and c.figure == "not measured", str(rep)
    assert "depends on the other sequences" not in str(rep) and not rep.ok, str(rep)
