"""Parity with the released ``d2l`` package (1.0.3): its ``MultiHeadAttention(num_hiddens,
num_heads, dropout, bias=False)``, taken from the wheel that ``make test`` downloads
(``pip download --no-deps d2l==1.0.3``). The package itself cannot be imported beside
this torch (it pins torchvision, pandas, IPython), so the test reads the three pieces
it needs (``masked_softmax``, ``DotProductAttention``, ``MultiHeadAttention``) out of
the wheel's ``d2l/torch.py`` with ``ast`` and runs them as they are."""

from __future__ import annotations

import ast
import math
import os
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from multihead.compat import D2LMultiHeadAttention

WHEELS = Path(os.environ.get("MULTIHEAD_WHEELS", Path(__file__).resolve().parent.parent / ".venv" / "wheels"))


@pytest.fixture(scope="module")
def d2l():
    wheels = sorted(WHEELS.glob("d2l-1.0.3-*.whl"))
    if not wheels:
        pytest.skip(f"the d2l 1.0.3 wheel is not in {WHEELS} (make test downloads it)")
    with zipfile.ZipFile(wheels[0]) as z:
        source = z.read("d2l/torch.py").decode()
    tree = ast.parse(source)
    wanted = {"masked_softmax", "DotProductAttention", "MultiHeadAttention"}
    nodes = [n for n in tree.body if getattr(n, "name", None) in wanted]
    assert {n.name for n in nodes} == wanted
    ns = SimpleNamespace(Module=nn.Module)
    env = {"torch": torch, "nn": nn, "F": F, "math": math, "d2l": ns}
    for node in nodes:  # in file order: masked_softmax, DotProductAttention, MultiHeadAttention
        exec(compile(ast.Module(body=[node], type_ignores=[]), "d2l/torch.py", "exec"), env)
        setattr(ns, node.name, env[node.name])
    return ns


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("lens_shape", ["(B,)", "(B, Lq)", "none"])
def test_released_d2l_parity_outputs_weights_gradients(d2l, bias, lens_shape):
    torch.manual_seed(0)
    theirs = d2l.MultiHeadAttention(100, 5, 0.5, bias=bias)
    ours = D2LMultiHeadAttention(100, 5, 0.5, bias=bias)  # the released signature
    X, Y = torch.randn(2, 4, 100), torch.randn(2, 6, 100)
    lens = {"(B,)": torch.tensor([3, 2]), "(B, Lq)": torch.tensor([[1, 2, 3, 6], [2, 2, 5, 1]]), "none": None}[lens_shape]
    theirs.eval()(X, Y, Y, lens)  # materialize the lazy layers
    ours.load_state_dict(theirs.state_dict(), strict=True)  # the released state_dict loads as is
    ours.eval()
    X1, Y1 = X.clone().requires_grad_(), Y.clone().requires_grad_()
    X2, Y2 = X.clone().requires_grad_(), Y.clone().requires_grad_()
    a, b = theirs(X1, Y1, Y1, lens), ours(X2, Y2, Y2, lens)
    assert a.shape == b.shape == (2, 4, 100)
    assert torch.allclose(a, b, atol=1e-5)
    assert torch.allclose(theirs.attention.attention_weights, ours.attention.attention_weights, atol=1e-6)
    g = torch.randn(a.shape)
    a.backward(g)
    b.backward(g)
    assert torch.allclose(X1.grad, X2.grad, atol=1e-5) and torch.allclose(Y1.grad, Y2.grad, atol=1e-5)
    for (n, p), (m, q) in zip(theirs.named_parameters(), ours.named_parameters()):
        assert n == m and torch.allclose(p.grad, q.grad, atol=1e-5), n


def test_both_constructor_forms(d2l):
    released = D2LMultiHeadAttention(100, 5, 0.5)
    older = D2LMultiHeadAttention(100, 100, 100, 100, 5, 0.5)
    keywords = D2LMultiHeadAttention(num_hiddens=100, num_heads=5, dropout=0.5, bias=True)
    X = torch.ones(2, 4, 100)
    for m in (released, older, keywords):
        assert m.eval()(X, X, X, torch.tensor([3, 2])).shape == (2, 4, 100)
    assert keywords.W_o.bias is not None and released.W_o.bias is None
    with pytest.raises(TypeError, match=r"missing dropout: use D2LMultiHeadAttention\(num_hiddens, num_heads, dropout"):
        D2LMultiHeadAttention(100, 5)
