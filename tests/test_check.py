"""multihead.check: a zoo of learner's modules with one bug each, diagnosed by name; correct
implementations pass; bad input handled."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import multihead
from multihead.check import ADVICE


class Learner(nn.Module):
    """Multi-head attention as a learner writes it, with an optional bug. forward(q, k, v, mask)
    with the Keras tutorial's mask convention (1 = blocked)."""

    def __init__(self, d_model=32, num_heads=4, bug=None, causal=False):
        super().__init__()
        self.num_heads, self.d_k, self.bug, self.causal = num_heads, d_model // num_heads, bug, causal
        self.W_q, self.W_k = nn.Linear(d_model, d_model), nn.Linear(d_model, d_model)
        self.W_v, self.W_o = nn.Linear(d_model, d_model), nn.Linear(d_model, d_model)

    def split(self, x):
        Bx, L, _ = x.shape
        if self.bug == "heads split without the transpose":
            return x.reshape(Bx, self.num_heads, L, self.d_k)
        return x.view(Bx, L, self.num_heads, self.d_k).transpose(1, 2)

    def forward(self, q, k, v, mask=None):
        Q, K = self.split(self.W_q(q)), self.split(self.W_k(k))
        V = K if self.bug == "keys used as values" else self.split(self.W_v(v))
        s = Q @ K.transpose(-2, -1)
        if self.bug == "scores divided by d_k" or self.bug == "vit":
            s = s / self.d_k
        elif self.bug != "scores not scaled":
            s = s / math.sqrt(self.d_k)
        blocked = None
        if mask is not None:
            blocked = mask.bool()
        if self.causal:
            L = s.shape[-1]
            fut = torch.ones(L, L).triu(0 if self.bug == "causal mask off by one" else 1).bool()
            blocked = fut if blocked is None else blocked | fut
        if blocked is not None and self.bug == "mask polarity inverted":
            blocked = ~blocked
        if self.bug in ("softmax skipped (values times raw scores)", "vit"):
            w = s.masked_fill(blocked, 0.0) if blocked is not None else s
        elif self.bug == "mask applied after the softmax":
            w = torch.softmax(s, -1).masked_fill(blocked, 0.0)
        else:
            if blocked is not None:
                s = s.masked_fill(blocked, float("-inf"))
            w = torch.softmax(s, -2 if self.bug == "softmax over the wrong axis" else -1).nan_to_num()
        if self.bug == "dropout active in eval":
            w = F.dropout(w, 0.2, training=True)
        o = w @ V
        Bx, H, L, D = o.shape
        o = o.reshape(Bx, L, H * D) if self.bug == "heads merged in the wrong order" else \
            o.transpose(1, 2).reshape(Bx, L, H * D)
        return o if self.bug == "output projection missing" else self.W_o(o)


ZOO = [n for n in ADVICE if n != "causal mask off by one"]


@pytest.mark.parametrize("bug", ZOO)
def test_each_bug_is_named(bug):
    torch.manual_seed(0)
    rep = multihead.check(Learner(bug=bug), call="qkv_mask", mask="block")
    assert not rep.ok
    assert [f.name for f in rep.diagnosis] == [bug], str(rep)


def test_causal_off_by_one_is_named():
    torch.manual_seed(0)
    rep = multihead.check(Learner(bug="causal mask off by one", causal=True), call="qkv", causal=True)
    assert [f.name for f in rep.diagnosis] == ["causal mask off by one"], str(rep)
    good = multihead.check(Learner(causal=True), call="qkv", causal=True)
    assert good.ok, str(good)


def test_the_vit_notebooks_module_is_flagged_for_both_bugs():
    torch.manual_seed(0)
    rep = multihead.check(Learner(bug="vit"), call="qkv_mask", mask="block")
    assert {f.name for f in rep.diagnosis} == {"scores divided by d_k", "softmax skipped (values times raw scores)"}
    assert "NOT OK" in str(rep)


@pytest.mark.parametrize("call, mask", [("qkv_mask", "block"), ("qkv", None), ("x", None)])
def test_a_correct_module_passes(call, mask):
    torch.manual_seed(0)
    m = Learner()
    if call == "x":
        m.forward = lambda x, _f=m.forward: _f(x, x, x)
    rep = multihead.check(m, call=call, mask=mask)
    assert rep.ok, str(rep)
    assert any(c.name == "matches the float64 reference" and c.passed for c in rep.checks)


def test_the_course_modules_and_torch_nn_pass():
    from multihead.compat import D2LMultiHeadAttention, KerasTutorialMultiHeadAttention

    torch.manual_seed(0)
    d2l = D2LMultiHeadAttention(key_size=32, query_size=32, value_size=32, num_hiddens=32, num_heads=4, dropout=0.1)
    rep = multihead.check(d2l, call="qkv_mask", mask="valid_lens")
    assert rep.ok, str(rep)
    keras_tut = KerasTutorialMultiHeadAttention(h=4, d_k=32, d_v=32, d_model=32)
    keras_tut(torch.zeros(1, 2, 32), torch.zeros(1, 2, 32), torch.zeros(1, 2, 32))  # infer the input sizes
    rep = multihead.check(keras_tut, call="qkv_mask", mask="block",
                          mapping={"q": "W_q", "k": "W_k", "v": "W_v", "o": "W_o", "heads": 4})
    assert rep.ok, str(rep)  # its scale (1/sqrt of the total d_k, as the tutorial's code) is read off .scale
    tnn = nn.MultiheadAttention(32, 4, batch_first=True)
    rep = multihead.check(tnn, call=lambda m, q, k, v, mk: m(q, k, v, key_padding_mask=mk[:, 0, 0].bool())[0],
                          mask="block")
    # torch.nn is right everywhere but one place, which the checker reports: a fully masked row gives NaN
    failed = [c.name for c in rep.checks if c.passed is False]
    assert failed == ["fully masked rows finite"] and not rep.diagnosis, str(rep)


def test_transformers_bert_self_attention_passes():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(hidden_size=32, num_attention_heads=4, attn_implementation="eager")
    m = transformers.models.bert.modeling_bert.BertSelfAttention(cfg)

    def call(mod, q, k, v, keep):
        return mod(q, attention_mask=torch.zeros(keep.shape).masked_fill(~keep, -1e9))[0]

    rep = multihead.check(m, call=call, mask="keep", embed_dim=32, self_attention=True,
                          mapping={"q": "query", "k": "key", "v": "value", "heads": 4})
    assert rep.ok, str(rep)


def test_bad_input_is_reported():
    with pytest.raises(ValueError, match="has no parameters"):
        multihead.check(nn.Identity())
    with pytest.raises(ValueError, match=r"mask must be one of"):
        multihead.check(Learner(), mask="ones")
    rep = multihead.check(Learner(d_model=32), call="qkv", embed_dim=16)  # the wrong size: it raises inside
    assert not rep.ok and rep.checks[0].name == "runs on probe inputs" and "RuntimeError" in rep.checks[0].detail


def test_command_line_grades_a_file_with_exit_codes(tmp_path, capsys):
    from pathlib import Path

    from multihead.apps.cli import main

    example = Path(__file__).resolve().parent.parent / "examples" / "vit_notebook_attention.py"
    code = main(["check", f"{example}:NotebookMHSA", "--init", "d_model=32, num_head=4, d_k=8", "--call", "x"])
    out = capsys.readouterr().out
    assert code == 1
    assert "- scores divided by d_k:" in out and "- softmax skipped (values times raw scores):" in out
    fixed = tmp_path / "fixed.py"
    fixed.write_text(example.read_text().replace("/ self.d_k  #", "/ self.d_k**0.5  #").replace(
        "out = scores @ v", "out = weights @ v"))
    assert main(["check", f"{fixed}:NotebookMHSA", "--init", "d_model=32, num_head=4, d_k=8", "--call", "x"]) == 0
    assert "OK: the module computes multi-head attention." in capsys.readouterr().out
    assert main(["check", f"{tmp_path / 'nope.py'}:X"]) == 2
    assert main(["check", f"{example}:Missing"]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and "has no 'Missing'; it defines" in err


def test_keras_multi_head_attention_layer_passes():
    keras = pytest.importorskip("keras")
    if keras.backend.backend() != "torch":
        pytest.skip("Keras runs on another backend here")
    layer = keras.layers.MultiHeadAttention(num_heads=4, key_dim=8)
    x = torch.zeros(1, 2, 32)
    layer(x, x)  # build

    def call(m, q, k, v, keep):
        return m(q, v, key=k, attention_mask=keep[:, 0])

    rep = multihead.check(layer, call=call, mask="keep", embed_dim=32)
    failed = [c.name for c in rep.checks if c.passed is False]
    assert not failed and not rep.diagnosis, str(rep)
