"""Every PyTorch mode, as a matrix: each subject (the module, the functional API, the course's two
modules, our BERT, a transformers BERT attached to multihead, padded and padding-free) under each
mode (no_grad, inference_mode, autocast bf16, torch.compile, deepcopy, pickle, torch.save, the meta
device) for every mask kind the subject takes. Each result is compared with the same call in plain
eager mode on the real positions (the float64 reference is compared with eager mode in
test_functional / test_modules). Inputs and masks are made inside the mode, as a user would."""

from __future__ import annotations

import contextlib
import copy
import functools
import io
import pickle
import warnings

import pytest
import torch

import multihead
from multihead import MultiHeadAttention, masks
from multihead.compat import D2LMultiHeadAttention, KerasTutorialMultiHeadAttention

B, Lq, Lk, E, H, D = 3, 7, 9, 24, 4, 6
LENS = [9, 4, 0]  # a sequence with no keys at all: its rows give zeros
MODES = ["no_grad", "inference_mode", "autocast_bf16", "compile", "deepcopy", "pickle", "torch.save", "meta"]


def _lens(device):
    return torch.tensor(LENS, device=device)


MASKS = {  # kind -> mask for (B, Lq, Lk) self- or cross-attention, made on `device`
    "none": lambda dev: None,
    "valid_lens": _lens,  # the course's (B,) tensor
    "valid_lens_2d": lambda dev: torch.tensor([[1, 2, 3, 4, 5, 6, 7]] * B, device=dev),  # (B, Lq)
    "ValidLens": lambda dev: masks.ValidLens(_lens(dev)),
    "KeyPadding": lambda dev: masks.KeyPadding(torch.arange(Lk, device=dev) < _lens(dev)[:, None]),
    "Causal": lambda dev: masks.Causal("bottom-right"),
    "SlidingWindow": lambda dev: masks.SlidingWindow(2),
    "Dense": lambda dev: masks.Dense((torch.rand(B, 1, Lq, Lk, generator=torch.Generator().manual_seed(1))
                                      > 0.3).to(dev)),
    "ValidLens & Causal": lambda dev: masks.ValidLens(_lens(dev)) & masks.Causal("bottom-right"),
}


def _data(device="cpu", *shapes):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(*s, generator=g).to(device) for s in shapes]


class Subject:
    """What a mode is applied to: ``build()`` -> a module (or None for the functional API), ``call(model,
    kind, device)`` -> (output, real positions or None: all). ``compile`` wraps the model (or the function)."""

    kinds: list[str]

    def build(self, device="cpu"):
        raise NotImplementedError

    def call(self, model, kind, device="cpu", fn=None):
        raise NotImplementedError


class Module(Subject):
    kinds = list(MASKS)

    def build(self, device="cpu"):
        torch.manual_seed(0)
        return MultiHeadAttention(E, H, bias=True).eval()

    def call(self, model, kind, device="cpu", fn=None):
        x, mem = _data(device, (B, Lq, E), (B, Lk, E))
        mask = MASKS[kind](device)
        f = model if fn is None else fn
        if kind.startswith("valid_lens"):
            return f(x, mem, mem, mask), None
        return f(x, mem, mem, mask=mask), None


class Functional(Subject):
    """``multihead.attention``; its copies are the mask objects' (after a call), its compile the function's."""

    kinds = [k for k in MASKS if not k.startswith("valid_lens")]

    def build(self, device="cpu"):
        return None

    def call(self, model, kind, device="cpu", fn=None):
        q, k, v = _data(device, (B, H, Lq, D), (B, 2, Lk, D), (B, 2, Lk, D + 1))  # GQA, Dv != D
        mask = model if model is not None else MASKS[kind](device)  # a copied mask, when a copy is tested
        return (multihead.attention if fn is None else fn)(q, k, v, mask), None


class D2L(Subject):
    kinds = ["none", "valid_lens", "valid_lens_2d"]

    def build(self, device="cpu"):
        torch.manual_seed(0)
        m = D2LMultiHeadAttention(E, H, 0.1).eval()
        self.call(m, "none", device)  # the course's layers are lazy: materialised by a first call
        return m

    def call(self, model, kind, device="cpu", fn=None):
        x, mem = _data(device, (B, Lq, E), (B, Lk, E))
        return (model if fn is None else fn)(x, mem, mem, MASKS[kind](device)), None


class Keras(Subject):
    """The Keras tutorial's convention: 1 = blocked, a padding mask (B, 1, 1, Lk) or a look-ahead one (L, L)."""

    kinds = ["none", "padding", "look-ahead"]

    def build(self, device="cpu"):
        torch.manual_seed(0)
        m = KerasTutorialMultiHeadAttention(H, 8, 8, E)
        self.call(m, "none", device)
        return m

    def call(self, model, kind, device="cpu", fn=None):
        (x,) = _data(device, (B, Lk, E))
        mask = {"none": None,
                "padding": (torch.arange(Lk, device=device) >= _lens(device)[:, None]).float()[:, None, None, :],
                "look-ahead": torch.triu(torch.ones(Lk, Lk, device=device), diagonal=1)}[kind]
        return (model if fn is None else fn)(x, x, x, mask), None


def _ids_and_mask(kind, device, vocab):
    ids = (torch.arange(B * 11).reshape(B, 11) * 7 % (vocab - 3) + 3).to(device)
    am = torch.ones(B, 11, dtype=torch.long)
    for b, n in enumerate([11, 6, 2]):
        if kind == "right padding":
            am[b, n:] = 0
        elif kind == "left padding":
            am[b, : 11 - n] = 0
    return ids, (None if kind == "none" else am.to(device)), am.bool()


class OurBert(Subject):
    kinds = ["none", "right padding", "left padding"]

    def build(self, device="cpu"):
        from multihead.models.bert import Bert, BertConfig

        torch.manual_seed(0)
        return Bert(BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                               intermediate_size=64, max_position_embeddings=32)).eval()

    def call(self, model, kind, device="cpu", fn=None):
        ids, am, real = _ids_and_mask(kind, device, 50)
        return (model if fn is None else fn)(ids, am), real


class Attached(Subject):
    """A transformers BertModel from a tiny config, attached to multihead (``packed``: padding-free)."""

    kinds = ["none", "right padding", "left padding"]

    def __init__(self, packed):
        self.packed = packed

    def build(self, device="cpu"):
        T = pytest.importorskip("transformers")
        import multihead.hf as mhf

        T.logging.set_verbosity_error()
        torch.manual_seed(0)
        model = T.BertModel(T.BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                         intermediate_size=64)).eval()
        return mhf.attach(model, packed=self.packed)

    def call(self, model, kind, device="cpu", fn=None):
        ids, am, real = _ids_and_mask(kind, device, 50)
        kw = {} if am is None else {"attention_mask": am}
        return (model if fn is None else fn)(input_ids=ids, **kw).last_hidden_state, real


SUBJECTS = {"module": Module(), "functional": Functional(), "d2l": D2L(), "keras tutorial": Keras(),
            "our bert": OurBert(), "transformers attached": Attached(False),
            "transformers attached, padding-free": Attached(True)}
CASES = [(s, k) for s, subj in SUBJECTS.items() for k in subj.kinds]


@functools.cache
def _built(subject):
    return SUBJECTS[subject].build()


def _copy(obj, how):
    if how == "deepcopy":
        return copy.deepcopy(obj)
    if how == "pickle":
        return pickle.loads(pickle.dumps(obj))
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)  # our own object, written just above


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("subject", "kind"), CASES)
def test_every_subject_in_every_mode_equals_eager(subject, kind, mode):
    s, model = SUBJECTS[subject], _built(subject)
    want, real = s.call(model, kind)
    want = want.detach()
    sel = (lambda t: t) if real is None else (lambda t: t[real])  # the real positions
    atol = 1e-5
    if mode in ("no_grad", "inference_mode"):
        with getattr(torch, mode)():
            for _ in range(2):  # twice: anything remembered from the first call must still be right
                got, _ = s.call(model, kind)
                assert not got.requires_grad
                torch.testing.assert_close(sel(got), sel(want), atol=atol, rtol=0)
        return
    if mode == "autocast_bf16":
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
            got, _ = s.call(model, kind)
        assert got.shape == want.shape
        err = (sel(got).float() - sel(want)).abs().max()
        assert err <= 0.05 * sel(want).abs().max() + 1e-2
        return
    if mode == "compile":
        torch._dynamo.reset()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fn = torch.compile(model if model is not None else multihead.attention, backend="aot_eager")
            got, _ = s.call(model, kind, fn=fn)
        torch.testing.assert_close(sel(got), sel(want), atol=atol, rtol=0)
        return
    if mode in ("deepcopy", "pickle", "torch.save"):
        if model is None:  # the functional API: the mask object, after it was used, is what a user copies
            mask = MASKS[kind]("cpu")
            multihead.attention(*_data("cpu", (B, H, Lq, D), (B, 2, Lk, D), (B, 2, Lk, D + 1)), mask)
            back = _copy(mask, mode)
            if mask is not None:
                assert type(back) is type(mask)
            got, _ = s.call(back, kind) if back is not None else s.call(None, kind)
        else:
            s.call(model, kind)  # a call first: nothing it leaves behind may stop a copy
            back = _copy(model, mode)
            assert set(back.__dict__) == set(model.__dict__)
            got, _ = s.call(back, kind)
        torch.testing.assert_close(sel(got), sel(want), atol=1e-6, rtol=0)
        return
    assert mode == "meta"
    _meta(s, model, kind, subject, want)


def _meta(s, model, kind, subject, want):
    """On the meta device shapes flow through without data: value checks and value-driven choices
    (packing by the real lengths) are skipped there, shapes still checked."""
    if isinstance(s, Attached) and kind != "none":
        # transformers' own mask builder reads the attention mask's values (`padding_mask.all()`):
        # there the attached model fails where transformers does, with transformers' error
        plain = copy.deepcopy(model)
        plain.set_attn_implementation("sdpa")
        for m in (plain, copy.deepcopy(model)):
            with pytest.raises(RuntimeError, match="meta"):
                s.call(m.to("meta"), kind, "meta")
        return
    if model is None:
        got, _ = s.call(None, kind, "meta")
    else:
        got, _ = s.call(copy.deepcopy(model).to("meta"), kind, "meta")
    assert got.device.type == "meta" and got.shape == want.shape and got.dtype == want.dtype


@pytest.mark.parametrize("subject", ["module", "d2l", "keras tutorial", "our bert"])
def test_built_on_the_meta_device(subject):
    """Built inside ``torch.device('meta')`` (the course's lazy layers too) and called there."""
    s = SUBJECTS[subject]
    with torch.device("meta"):
        model = s.build("meta")
    got, _ = s.call(model, s.kinds[1], "meta")
    assert got.device.type == "meta"


def test_value_checks_still_run_off_the_meta_device():
    """Skipping value checks on meta must not skip them elsewhere."""
    m = _built("module")
    x = torch.randn(B, Lq, E)
    with pytest.raises(ValueError, match="valid_lens must be <= Lk=7"):
        m(x, x, x, torch.tensor([8, 1, 1]))
    with pytest.raises(ValueError, match="0/1 values"):
        _built("keras tutorial")(x, x, x, torch.full((Lq, Lq), 0.5))


def test_lengths_changed_in_place_inside_inference_mode_are_seen():
    """An inference tensor is never remembered: changing it in place changes the next call."""
    m = _built("module")
    x, mem = _data("cpu", (B, Lq, E), (B, Lk, E))
    with torch.inference_mode():
        lens = torch.tensor([9, 4, 2])
        a = m(x, mem, mem, lens)
        lens[1] = 1
        b = m(x, mem, mem, lens)
        ref = m(x, mem, mem, torch.tensor([9, 1, 2]))
    assert not torch.allclose(a, b) and torch.allclose(b, ref)


def test_the_course_module_keeps_its_weights_in_inference_mode():
    d2l = _built("d2l")
    with torch.inference_mode():
        D2L().call(d2l, "valid_lens")
    assert d2l.attention.attention_weights.shape == (B * H, Lq, Lk)


def test_backward_hooks_on_the_projections_fire_through_the_module():
    """A full backward hook on a projection, or a global one, sees the projections (the fast path
    that skips nn.Module.__call__ is taken only when no hook of any kind could observe them)."""
    torch.manual_seed(0)
    m = multihead.MultiHeadAttention(16, 4)
    x = torch.randn(2, 5, 16, requires_grad=True)
    seen = []
    h = m.projections()[0].register_full_backward_hook(lambda mod, gi, go: seen.append("W_q"))
    m(x, x, x).sum().backward()
    h.remove()
    assert seen == ["W_q"]
    seen.clear()
    g = torch.nn.modules.module.register_module_full_backward_hook(lambda mod, gi, go: seen.append(type(mod).__name__))
    with contextlib.ExitStack() as stack:
        stack.callback(g.remove)
        m(x, x, x).sum().backward()
    assert seen.count("Linear") == 4 and "MultiHeadAttention" in seen
