"""One call plan: what ``explain`` shows is what ``forward`` executes.

A spy wraps every registered backend's ``run`` and records the request each call really makes
(sizes, dtype, mask, dropout, grad need) and which backend ran it; for many random calls on every
layout (dense, packed, cached, sharded over a group of one) the requests and backends
``MultiHeadAttention.explain`` reports must be exactly those."""

from __future__ import annotations

import dataclasses
import pickle
import random

import pytest
import torch
import torch.distributed as dist

from multihead import KVCache, MultiHeadAttention, masks
from multihead import distributed as cp
from multihead.backends import registry
from multihead.compat import D2LMultiHeadAttention, KerasTutorialMultiHeadAttention, TorchMultiheadAttention
from multihead.core import varlen


@pytest.fixture
def spy(monkeypatch):
    """[(backend name, request as the backend received it)] for every backend call."""
    seen: list[tuple[str, tuple]] = []
    registry.forget()  # remembered choices hold the unwrapped backends
    for name, b in list(registry._REGISTRY.items()):
        def run(q, k, v, mask, *, scale, dropout_p, _run=b.run, _name=name, **mods):
            grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
            B, H, Lq, D = q.shape
            seen.append((_name, _key(registry.Request(q.device.type, q.dtype, B, H, k.shape[1], Lq, k.shape[2], D,
                                                      v.shape[-1], mask, float(dropout_p), grad))))
            return _run(q, k, v, mask, scale=scale, dropout_p=dropout_p, **mods)

        monkeypatch.setitem(registry._REGISTRY, name, dataclasses.replace(b, run=run))
    yield seen
    registry.forget()


def _key(req: registry.Request) -> tuple:
    """A request with its mask by repr (masks compare by identity)."""
    return tuple(repr(x) if i == 9 else x for i, x in enumerate(req))


def _explained(ex) -> list[tuple[str, tuple]]:
    """(backend, request) per core call, as explain reports them."""
    runs = [name for n, d in ex.decisions for name in [d.chosen] * n]
    return list(zip(runs, [_key(r) for r in ex.requests]))


def _masks(rng: random.Random, B: int, Lq: int, Lk: int):
    lens = torch.tensor([Lk] + [rng.randint(0, Lk) for _ in range(B - 1)])
    keep = torch.arange(Lk) < lens[:, None]  # (B, Lk)
    kinds = {
        "none": None,
        "valid_lens": masks.ValidLens(lens),
        "per-query lens": masks.ValidLens(torch.randint(0, Lk + 1, (B, Lq))),
        "key padding": masks.KeyPadding(keep),
        "causal": masks.Causal(),
        "causal bottom-right": masks.Causal("bottom-right"),
        "window": masks.SlidingWindow(rng.randint(1, 4)),
        "causal & lens": masks.Causal() & masks.ValidLens(lens),
        "bool tensor": torch.rand(B, 1, Lq, Lk) > 0.3,
        "bias tensor": torch.randn(Lq, Lk),
    }
    if Lq == Lk:
        kinds["padding"] = masks.Padding(lens)
    return kinds


@pytest.mark.parametrize("seed", range(8))
def test_explain_shows_the_requests_the_backends_receive(seed, spy, monkeypatch):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    Hkv = rng.choice([1, 2, 3])
    H = Hkv * rng.choice([1, 2])
    D = rng.choice([3, 8, 16])
    E = H * D
    self_attention = rng.random() < 0.5
    Ek, Ev = (E, E) if self_attention else (E + 3, E + 5)
    m = MultiHeadAttention(E, H, dropout=rng.choice([0.0, 0.2]), bias=rng.random() < 0.5, num_kv_heads=Hkv,
                           query_size=E, key_size=Ek, value_size=Ev)
    m.train(rng.random() < 0.5)
    m.requires_grad_(rng.random() < 0.5)  # a frozen model under grad mode needs no grad, unless its input does
    B = rng.randint(1, 3)
    made = 0
    for call in range(12):
        Lq = rng.randint(1, 9)
        Lk = Lq if self_attention else rng.choice([Lq, rng.randint(0, 9)])
        kinds = _masks(rng, B, Lq, max(Lk, 1)) if Lk else {"none": None}
        kind = rng.choice(sorted(kinds))
        mask = kinds[kind]
        x = torch.randn(B, Lq, E, requires_grad=rng.random() < 0.3)
        kv = () if self_attention else (torch.randn(B, Lk, Ek), torch.randn(B, Lk, Ev))
        monkeypatch.setattr(varlen, "LOOP_COST_FLOP", rng.choice([0.0, varlen.LOOP_COST_FLOP]))  # packed or dense
        grad = rng.random() < 0.5
        with torch.set_grad_enabled(grad):
            what = (seed, call, kind, B, Lq, Lk, grad, m.training)
            try:
                ex = m.explain(x, *kv, mask=mask)
            except ValueError:  # a mask these sizes cannot take (e.g. a window past Lk): forward refuses too
                with pytest.raises(ValueError):
                    m(x, *kv, mask=mask)
                continue
            spy.clear()
            torch.manual_seed(0)
            m(x, *kv, mask=mask)
            assert spy == _explained(ex), (what, str(ex))
            assert str(ex).startswith(f"path: {ex.plan.layout} (")
            made += len(spy)
    assert made >= 6  # the comparison was not of empty lists


def test_the_self_attention_module_plans_every_layout(spy, monkeypatch):
    """Self-attention (keys = queries) under each mask kind, packed and dense, grad on and off."""
    torch.manual_seed(0)
    m = MultiHeadAttention(24, 6, num_kv_heads=2, query_size=24, key_size=24, value_size=24)
    rng = random.Random(1)
    layouts = set()
    for force in (True, False):
        monkeypatch.setattr(varlen, "LOOP_COST_FLOP", 0.0 if force else 1e30)
        for L in (1, 5, 70):  # 70: past the padded varlen call's limit, so packing loops over the sequences
            for kind, mask in _masks(rng, 3, L, L).items():
                for grad in (False, True):
                    x = torch.randn(3, L, 24)
                    with torch.set_grad_enabled(grad):
                        ex = m.explain(x, mask=mask)
                        spy.clear()
                        m(x, mask=mask)
                    assert spy == _explained(ex), (kind, L, force, grad, str(ex))
                    assert spy or kind == "per-query lens"  # (lens of 0 everywhere can leave nothing to call)
                    layouts.add(ex.plan.layout)
    assert layouts == {"dense", "packed"}


def test_cached_steps_are_planned_as_they_run(spy):
    """Decoding with a KVCache: self-attention steps of 1 and of several positions, and
    cross-attention's first (projects the memory) and later steps; with and without grad."""
    torch.manual_seed(0)
    self_attn = MultiHeadAttention(16, 4, num_kv_heads=2, query_size=16, key_size=16, value_size=16)
    cross = MultiHeadAttention(16, 4, query_size=16, key_size=12, value_size=12)
    memory = torch.randn(2, 7, 12)
    for grad in (False, True):
        cache = KVCache(torch.nn.ModuleList([self_attn, cross]), batch_size=2, max_len=16)
        with torch.set_grad_enabled(grad):
            for n, mask in ((3, None), (1, None), (1, masks.ValidLens(torch.tensor([3, 5]))), (2, None)):
                x = torch.randn(2, n, 16)
                ex = self_attn.explain(x, mask=mask, cache=cache)
                assert ex.plan.layout == "cached" and cache.length(self_attn) == ex.requests[0].Lk - n  # nothing cached
                spy.clear()
                self_attn(x, mask=mask, cache=cache)
                assert spy == _explained(ex), (n, mask, str(ex))
                ex = cross.explain(x, memory, memory, cache=cache)
                assert "memory is projected once" in ex.plan.why or "cached memory is reused" in ex.plan.why
                spy.clear()
                cross(x, memory, memory, cache=cache)
                assert spy == _explained(ex), (n, str(ex))


def test_sharded_over_a_group_of_one_runs_and_explains_locally(spy, tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        m = MultiHeadAttention(24, 4, num_kv_heads=2, query_size=24, key_size=24, value_size=24).eval()
        x = torch.randn(2, 8, 24)
        lens = torch.tensor([8, 5])
        for mask in (None, masks.Causal(), masks.ValidLens(lens), masks.Padding(lens), masks.SlidingWindow(3)):
            for grad in (False, True):
                with torch.set_grad_enabled(grad):
                    ex = m.explain(x, mask=mask, sharded=cp.Sharded())
                    spy.clear()
                    out = m(x, mask=mask, sharded=cp.Sharded())
                assert ex.plan.layout == "sharded" and "group of one" in ex.plan.why
                assert spy == _explained(ex), (mask, str(ex))
                assert torch.allclose(out, m.eval()(x, mask=mask), atol=1e-6)  # the same as unsharded
    finally:
        dist.destroy_process_group()


def test_sharded_is_refused_with_a_cache_or_the_wrong_type():
    m = MultiHeadAttention(16, 4, query_size=16, key_size=16, value_size=16)
    x = torch.randn(1, 4, 16)
    with pytest.raises(TypeError, match="sharded must be a multihead.distributed.Sharded.*got str"):
        m(x, sharded="zigzag")
    with pytest.raises(TypeError, match="cache must be a multihead.KVCache.*got dict"):
        m(x, cache={})
    with pytest.raises(TypeError, match=r"KVCache\(model, batch_size, max_len\) takes the model .*got list"):
        KVCache([m], 1, 4)
    named = MultiHeadAttention(16, 4, query_size=16, key_size=16, value_size=16, backend="math")
    with pytest.raises(ValueError, match="backend='math' cannot run on sequence-sharded inputs.*'auto'"):
        named(x, sharded=object.__new__(cp.Sharded))  # refused before the group is consulted
    with pytest.raises(ValueError, match="layout must be"):
        cp.Sharded(layout="spiral")


def test_context_parallel_injects_into_the_models_modules_only(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        inner = MultiHeadAttention(16, 4, query_size=16, key_size=16, value_size=16).eval()
        model = torch.nn.Sequential(torch.nn.Linear(16, 16), inner)
        other = MultiHeadAttention(16, 4, query_size=16, key_size=16, value_size=16).eval()
        got = []
        inner_forward = MultiHeadAttention.forward

        def record(self, *args, sharded=None, **kwargs):
            got.append((self, sharded))
            return inner_forward(self, *args, sharded=sharded, **kwargs)

        x = torch.randn(1, 4, 16)
        MultiHeadAttention.forward = record
        try:
            with cp.context_parallel(model, layout="zigzag") as s:
                model(x)
                other(x)  # another model's module is untouched: nothing is process-wide
        finally:
            MultiHeadAttention.forward = inner_forward
        assert got == [(inner, s), (other, None)] and s.layout == "zigzag" and s.size == 1
        assert not inner._forward_pre_hooks  # removed when the block ends
        for course in (D2LMultiHeadAttention(16, 4, 0.0), KerasTutorialMultiHeadAttention(4, 16, 16, 16)):
            with cp.context_parallel(torch.nn.Sequential(course)):
                pass  # the course's modules take sharded= too
    finally:
        dist.destroy_process_group()


def test_context_parallel_refuses_what_cannot_run_sharded():
    with pytest.raises(TypeError, match=r"context_parallel\(model, .*an nn.Module.*got str"):
        with cp.context_parallel("zigzag"):
            pass
    for attn in (torch.nn.MultiheadAttention(16, 4), TorchMultiheadAttention(16, 4)):
        model = torch.nn.Sequential(torch.nn.Linear(16, 16), attn)
        hooks = dict(attn._forward_pre_hooks)
        with pytest.raises(ValueError, match=rf"cannot run on sequence shards: 1 \({type(attn).__name__}\)"):
            with cp.context_parallel(model):
                pass
        assert dict(attn._forward_pre_hooks) == hooks  # refused before anything was attached
    with pytest.raises(ValueError, match="Linear has no multihead attention module"):
        with cp.context_parallel(torch.nn.Linear(2, 2)):
            pass


def test_the_explanation_renders_one_structure_and_pickles(monkeypatch):
    monkeypatch.setattr(varlen, "LOOP_COST_FLOP", 0.0)
    m = MultiHeadAttention(16, 4, query_size=16, key_size=16, value_size=16)
    x = torch.randn(3, 80, 16)
    ex = m.explain(x, mask=masks.ValidLens(torch.tensor([80, 70, 70])))  # 70 and 70: one section, x2
    title, sections = ex.sections()
    text, md, html = str(ex), ex._repr_markdown_(), ex._repr_html_()
    assert text.splitlines()[0] == title == f"path: packed ({ex.plan.why})"
    assert [s["count"] for s in sections] == [1, 2] and len(ex.requests) == 3
    assert "(x2, one per sequence)" in text and "×2" in md and "&times;2" in html
    for s in sections:
        assert s["call"] in text and f"`{s['call']}`" in md
        for chosen, name, why in s["rows"]:
            assert f"| {'→' if chosen else ''} | {name} | {why} |" in md
            assert f"<td>{name}</td>" in html
    back = pickle.loads(pickle.dumps(ex))
    assert str(back) == text and back._repr_markdown_() == md
    none = MultiHeadAttention(16, 4)
    none.num_heads = 0  # every head pruned: no core call
    assert none.plan(x).calls == () and "no attention call" in str(none.explain(x))
