"""torch.compile: no graph breaks for every mask kind, train and eval, the module, the
functional core and the compat modules; compiled == eager; torch.export; errors kept."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch._dynamo as dynamo

import multihead
from multihead import MultiHeadAttention, masks
from multihead.compat import D2LMultiHeadAttention, KerasTutorialMultiHeadAttention, TorchMultiheadAttention

warnings.filterwarnings("ignore", category=UserWarning)
B, L, E = 2, 7, 16
LENS = torch.tensor([7, 4])
CASES = {
    "none": lambda: {},
    "valid_lens (B,)": lambda: {"valid_lens": LENS},
    "valid_lens (B, Lq)": lambda: {"valid_lens": torch.tensor([[1, 2, 3, 4, 5, 6, 7], [1, 1, 2, 2, 3, 3, 4]])},
    "KeyPadding": lambda: {"mask": masks.KeyPadding(torch.arange(L) < LENS[:, None])},
    "Causal top-left": lambda: {"mask": masks.Causal()},
    "Causal bottom-right": lambda: {"mask": masks.Causal("bottom-right")},
    "SlidingWindow": lambda: {"mask": masks.SlidingWindow(2)},
    "Dense bool": lambda: {"mask": torch.rand(L, L, generator=torch.Generator().manual_seed(0)) > 0.3},
    "Dense float": lambda: {"mask": torch.randn(L, L, generator=torch.Generator().manual_seed(0))},
    "ValidLens & Causal": lambda: {"mask": masks.ValidLens(LENS) & masks.Causal()},
    "Padding & SlidingWindow": lambda: {"mask": masks.Padding(LENS) & masks.SlidingWindow(3)},
}


def _breaks(fn, *args):
    dynamo.reset()
    ex = dynamo.explain(fn)(*args)
    return ex.graph_break_count, [str(r.reason)[:200] for r in ex.break_reasons]


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("case", list(CASES))
def test_module_compiles_without_graph_breaks_and_equals_eager(case, train):
    torch.manual_seed(0)
    m = MultiHeadAttention(E, 4, bias=True, query_size=E, key_size=E, value_size=E).train(train)
    x = torch.randn(B, L, E)
    kw = CASES[case]()
    assert _breaks(lambda t: m(t, **kw), x) == (0, [])
    dynamo.reset()
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    xe, xc = x.clone().requires_grad_(train), x.clone().requires_grad_(train)
    eager, comp = m(xe, **kw), compiled(xc, **kw)
    assert (comp - eager).abs().max() <= 1e-6
    if train:  # gradients through the compiled graph
        eager.sum().backward()
        comp.sum().backward()
        assert (xc.grad - xe.grad).abs().max() <= 1e-6


def test_functional_and_compat_modules_compile_without_graph_breaks():
    q, k, v = torch.randn(2, 6, 5, 8), torch.randn(2, 2, 9, 8), torch.randn(2, 2, 9, 4)
    for mask in (None, masks.Causal("bottom-right"), masks.ValidLens(torch.tensor([9, 3])) & masks.SlidingWindow(2)):
        assert _breaks(lambda a, b, c, m=mask: multihead.attention(a, b, c, m), q, k, v) == (0, [])
    d2l = D2LMultiHeadAttention(E, 4, 0.1).eval()
    x = torch.randn(B, L, E)
    d2l(x, x, x, LENS)  # materialize the lazy layers
    assert _breaks(lambda t: d2l(t, t, t, LENS), x) == (0, [])
    keras = KerasTutorialMultiHeadAttention(h=4, d_k=16, d_v=16, d_model=E).eval()
    keras(x, x, x)
    pad = torch.zeros(B, 1, 1, L)
    pad[1, ..., 4:] = 1
    assert _breaks(lambda t: keras(t, t, t, pad), x) == (0, [])
    tm = TorchMultiheadAttention(E, 4, batch_first=True).eval()
    kpm = ~(torch.arange(L) < LENS[:, None])
    assert _breaks(lambda t: tm(t, t, t, key_padding_mask=kpm, need_weights=False)[0], x) == (0, [])


def test_inductor_fullgraph_equals_eager():
    torch.manual_seed(0)
    m = MultiHeadAttention(E, 4, bias=True, query_size=E, key_size=E, value_size=E).eval()
    x = torch.randn(B, L, E)
    dynamo.reset()
    compiled = torch.compile(m, fullgraph=True, dynamic=False)
    for kw in ({}, {"valid_lens": LENS}, {"mask": masks.Causal()}):
        with torch.no_grad():
            assert (compiled(x, **kw) - m(x, **kw)).abs().max() <= 1e-6


def test_export_with_a_mask():
    torch.manual_seed(0)
    m = MultiHeadAttention(E, 4, bias=True, query_size=E, key_size=E, value_size=E).eval()

    class WithLens(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = m

        def forward(self, x, lens):
            return self.attn(x, valid_lens=lens, mask=masks.Causal())

    x = torch.randn(B, L, E)
    ep = torch.export.export(WithLens(), (x, LENS))
    x2, lens2 = torch.randn(B, L, E), torch.tensor([3, 7])
    assert (ep.module()(x2, lens2) - WithLens()(x2, lens2)).abs().max() <= 1e-6


def test_bad_input_still_raises_in_eager_and_under_compile():
    m = MultiHeadAttention(E, 4, query_size=E, key_size=E, value_size=E).eval()
    x = torch.randn(B, L, E)
    with pytest.raises(ValueError, match=r"valid_lens must be <= Lk=7 \(the number of keys\); got maximum 9"):
        m(x, valid_lens=torch.tensor([9, 2]))
    dynamo.reset()
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    compiled(x, valid_lens=LENS)
    with pytest.raises(RuntimeError, match=r"valid_lens must be <= Lk=7"):  # compiled into the graph as an assertion
        compiled(x, valid_lens=torch.tensor([9, 2]))
    # shapes are checked while tracing: without fullgraph the call falls back to eager and raises our error
    # (with fullgraph=True, torch reports it as the exception its tracer observed)
    dynamo.reset()
    lenient = torch.compile(m, backend="aot_eager")
    lenient(x)
    with pytest.raises(ValueError, match=r"queries must be \(B, L, query_size=16\); got shape \(2, 7, 5\)"):
        lenient(torch.randn(B, L, 5))


def test_patched_transformer_encoder_compiles_fullgraph_with_a_padding_mask():
    """A torch.nn encoder whose attention is the drop-in compiles with fullgraph=True, as
    PyTorch's own test asks of torch.nn's (a key padding mask, eval)."""
    from multihead.interop import patch

    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(d_model=32, nhead=4, batch_first=True, dropout=0.1, dtype=torch.double)
    enc = torch.nn.TransformerEncoder(layer, num_layers=2).eval()
    patch(enc)
    x = torch.randn(1, 9, 32, dtype=torch.double)
    pad = torch.rand(1, 9, generator=torch.Generator().manual_seed(1)) > 0.5
    pad[..., 0] = False  # True = padding (torch.nn); keep one real token
    dynamo.reset()
    compiled = torch.compile(enc, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        assert (compiled(x, mask=None, src_key_padding_mask=pad) - enc(x, src_key_padding_mask=pad)).abs().max() < 1e-10


def _every_kind(B, Lq, Lk):
    lens = torch.tensor([Lk, 1])[:B]
    return [None, masks.ValidLens(lens), masks.ValidLens(torch.ones(B, Lq, dtype=torch.long)), masks.Padding(lens),
            masks.KeyPadding(torch.ones(B, Lk, dtype=torch.bool)), masks.Causal(), masks.Causal("bottom-right"),
            masks.SlidingWindow(64), masks.SlidingWindow(8, 3, "bottom-right"), masks.Dense(torch.ones(Lq, Lk) > 0),
            masks.Dense(torch.zeros(1, 1, Lq, Lk)), masks.ValidLens(lens) & masks.SlidingWindow(32),
            masks.KeyPadding(torch.ones(B, Lk, dtype=torch.bool)) & masks.Causal()]


@pytest.mark.parametrize("shape", [(2, 7, 7), (2, 2048, 2048), (1, 64, 4096)])
@pytest.mark.parametrize("needs_grad", [False, True])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_traced_choice_is_the_eager_choice(shape, needs_grad, device):
    """While tracing, "auto" decides on a stand-in of the mask built from its dispatch key (no values):
    for every mask kind, at sizes and devices where different backends win (sdpa, blocked on CPU, flex
    on CUDA: requests only, nothing runs), it picks what eager selection picks."""
    from multihead.backends import registry

    B, Lq, Lk = shape
    chosen = set()
    for m in _every_kind(B, Lq, Lk):
        head = (device, torch.float32, B, 4, 2, Lq, Lk, 16, 16)
        eager = registry.select("auto", registry.Request(*head, m, 0.0, needs_grad)).name
        key = None if m is None else m.dispatch_key()
        if key is not None:
            assert masks.stand_in(key, B, Lq, Lk).dispatch_key() == key
        assert registry.traced_choice(head, key, 0.0, needs_grad, None) == eager, (m, shape)
        assert registry.traced_choice(head, key, 0.0, needs_grad, "reference") == "reference"
        chosen.add(eager)
    if shape == (2, 2048, 2048) and not needs_grad:
        assert chosen == {"sdpa", "blocked" if device == "cpu" else "flex"}


def test_a_users_own_mask_kind_is_selected_while_tracing():
    """A Mask subclass the stand-ins do not know: no baked choice; selection is traced, with no graph break."""
    from multihead.backends import registry

    class EvenKeys(masks.Mask):
        def keep(self, B, H, Lq, Lk, device=None):
            return (torch.arange(Lk, device=device) % 2 == 0)[None, None, None, :]  # (1, 1, 1, Lk)

    m = EvenKeys()
    assert registry.traced_choice(("cpu", torch.float32, 2, 4, 4, 5, 6, 8, 8), m.dispatch_key(), 0.0, False,
                                  None) is None
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 4, 6, 8), torch.randn(2, 4, 6, 8)
    fn = lambda q, k, v: multihead.attention(q, k, v, m)  # noqa: E731
    assert _breaks(fn, q, k, v)[0] == 0
    dynamo.reset()
    got = torch.compile(fn, backend="aot_eager", fullgraph=True)(q, k, v)
    assert torch.allclose(got, multihead.reference_attention(q, k, v, m), atol=1e-6)


def test_the_traced_choice_is_marked_as_torch_compile_marks_a_constant_result():
    """registry._constant_result stands for torch.compiler.assume_constant_result (which imports torch's compiler,
    1.8 s of every import of multihead): it must set exactly what the public decorator sets."""
    from multihead.backends import registry

    def a():
        return 1

    def b():
        return 1

    marked = torch.compiler.assume_constant_result(a)
    ours = registry._constant_result(b)
    assert {k: v for k, v in vars(marked).items()} == {k: v for k, v in vars(ours).items()} != {}
    assert vars(registry.traced_choice).items() >= vars(ours).items()
