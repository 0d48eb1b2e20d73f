"""KV-cache decoding: the same numbers as recomputing, GQA-aware buffers, capture over the
cached length, cross-attention memory projected once, clear errors."""

from __future__ import annotations

import contextlib

import pytest
import torch

import multihead
from multihead import KVCache, MultiHeadAttention, masks
from multihead.models import Seq2SeqConfig, Seq2SeqTransformer, reverse_batch


def test_cached_self_attention_equals_the_causal_forward_gqa():
    torch.manual_seed(0)
    m = MultiHeadAttention(24, 6, bias=True, num_kv_heads=2, query_size=24, key_size=24, value_size=24).eval()
    x = torch.randn(3, 9, 24)
    full = m(x, mask=masks.Causal())
    cache = KVCache(m, batch_size=3, max_len=9)
    steps = [m(x[:, :4], cache=cache)] + [m(x[:, t:t + 1], cache=cache) for t in range(4, 9)]  # a prefill, then 1 by 1
    assert torch.allclose(torch.cat(steps, 1), full, atol=1e-5)
    layer = cache.layer(m)
    assert layer.k.shape == (3, 2, 9, 4) and layer.length == 9  # (B, Hkv, Lmax, D): GQA keeps Hkv heads


def test_greedy_decoding_with_the_cache_equals_recomputing():
    torch.manual_seed(0)
    model = Seq2SeqTransformer(Seq2SeqConfig()).eval()
    src, lens, _, _ = reverse_batch(8, generator=torch.Generator().manual_seed(1))
    steps = 11
    fast, slow = model.greedy(src, lens, steps), model.greedy(src, lens, steps, use_cache=False)
    assert torch.equal(fast, slow)
    # and the logits of every step
    memory = model.encode(src, lens)
    ys = torch.cat([torch.ones(8, 1, dtype=torch.long), slow], 1)
    with torch.no_grad():
        full = model.decode(ys, memory, lens)  # (B, T, vocab)
        cache = KVCache(model, 8, steps + 1)
        cached = torch.cat([model.decode(ys[:, t:t + 1], memory, lens, cache, start=t) for t in range(steps + 1)], 1)
    assert (cached - full).abs().max() < 1e-5


def test_capture_during_cached_decoding_sees_the_whole_cache():
    torch.manual_seed(0)
    model = Seq2SeqTransformer(Seq2SeqConfig()).eval()
    src, lens, _, _ = reverse_batch(2, generator=torch.Generator().manual_seed(2))
    with multihead.capture(model, include=["decoder.0.*"]) as cap:
        model.greedy(src, lens, 5)
    self_steps = cap.calls("decoder.0.self_attn")
    assert [tuple(w.shape) for w in self_steps] == [(2, 4, 1, t) for t in range(1, 6)]
    assert all(torch.allclose(w.sum(-1), torch.ones(2, 4, 1)) for w in self_steps)
    cross = cap.calls("decoder.0.cross_attn")
    assert all(w.shape == (2, 4, 1, src.shape[1]) for w in cross)


def test_cross_attention_projects_the_memory_once():
    torch.manual_seed(0)
    m = MultiHeadAttention(16, 4, query_size=16, key_size=12, value_size=12).eval()
    calls = []
    m.k_proj.register_forward_hook(lambda *a: calls.append(1))
    mem, lens = torch.randn(2, 5, 12), torch.tensor([5, 3])
    cache = KVCache(m, 2, 4)
    ys = torch.randn(2, 3, 16)
    outs = [m(ys[:, t:t + 1], mem, mem, lens, cache=cache) for t in range(3)]
    assert len(calls) == 1
    assert torch.allclose(torch.cat(outs, 1), m(ys, mem, mem, lens), atol=1e-6)


def test_cache_errors():
    m = MultiHeadAttention(16, 4, query_size=16, key_size=16, value_size=16)
    other = MultiHeadAttention(16, 4, query_size=16, key_size=16, value_size=16)
    cache = KVCache(m, batch_size=2, max_len=3)
    x = torch.randn(2, 2, 16)
    m(x, cache=cache)
    with pytest.raises(ValueError, match=r"2 cached positions \+ 2 new ones exceed max_len=3"):
        m(x, cache=cache)
    with pytest.raises(ValueError, match=r"the cache holds batches of 2; this step has B=3"):
        KVCache(m, 2, 8) and m(torch.randn(3, 1, 16), cache=KVCache(m, 2, 8))
    with pytest.raises(ValueError, match=r"this KVCache was made for MultiHeadAttention, and this MultiHeadAttention "
                                         r"is not one of its attention modules"):
        other(x, cache=cache)
    with pytest.raises(ValueError, match="max_len must be a positive integer"):
        KVCache(m, 2, 0)
    y = torch.randn(2, 1, 16)
    for keys in (None, y):  # values apart from self-attention's queries would be ignored: refused
        with pytest.raises(ValueError, match=r"a self-attention step \(keys not given, or keys=queries\) projects its "
                                             r"keys and values from the queries, and values were given apart"):
            m(y, keys, torch.randn(2, 1, 16), cache=KVCache(m, 2, 4))


def test_one_token_steps_find_their_backend_without_choosing_again(monkeypatch):
    """A step of one new token has no mask; its key length grows every step, and "auto"'s remembered
    choice (keyed without the lengths when there is no mask) serves every step after the first."""
    from multihead.backends import registry

    torch.manual_seed(0)
    m = MultiHeadAttention(16, 4, bias=True, query_size=16, key_size=16, value_size=16).eval()
    x = torch.randn(2, 12, 16)
    registry.forget()
    chosen = []
    real = registry._auto
    monkeypatch.setattr(registry, "_auto", lambda req, exclude: chosen.append(req.Lk) or real(req, exclude))
    cache = KVCache(m, batch_size=2, max_len=12)
    with torch.no_grad():
        steps = [m(x[:, t:t + 1], cache=cache) for t in range(12)]
    assert chosen == [1], f"auto chose again at key lengths {chosen}"
    assert torch.allclose(torch.cat(steps, 1), m(x, mask=masks.Causal()), atol=1e-5)


def _decode(m, x, cache, *, explicit_keys=False):
    """Feed x (B, T, E) one position at a time; explicit_keys passes keys=queries (the same tensor: self-attention),
    which plans every step."""
    steps = [x[:, t:t + 1] for t in range(x.shape[1])]  # (B, 1, E) each
    return torch.cat([m(h, h, cache=cache) if explicit_keys else m(h, cache=cache) for h in steps], 1)


def test_a_step_planned_like_the_last_runs_that_plan_again_with_the_same_numbers(monkeypatch):
    """Greedy decoding plans a layer's first step; the next steps (same queries' shape, no mask, no grad,
    no hooks) run that plan again, and give exactly what planning every step gives (GQA, batch 3)."""
    from multihead.layer import plan as planning

    torch.manual_seed(0)
    m = MultiHeadAttention(24, 6, bias=True, num_kv_heads=2, query_size=24, key_size=24, value_size=24).eval()
    x = torch.randn(3, 7, 24)
    made = []
    real = planning.make
    monkeypatch.setattr(planning, "make", lambda *a: made.append(1) or real(*a))
    with torch.no_grad():
        again = _decode(m, x, KVCache(m, 3, 7))
        assert len(made) == 1  # the first step only
        every = _decode(m, x, KVCache(m, 3, 7), explicit_keys=True)
        assert len(made) == 1 + 7
        cache = KVCache(m, 3, 7)
        _decode(m, x, cache)
        cache.reset()
        after_reset = _decode(m, x, cache)
    assert torch.equal(again, every) and torch.equal(after_reset, every)
    assert torch.allclose(every, m(x, mask=masks.Causal()), atol=1e-5)
    with pytest.raises(ValueError, match=r"7 cached positions \+ 1 new ones exceed max_len=7"), torch.no_grad():
        m(x[:, :1], cache=cache)  # full: planned in full, and refused


def test_what_could_change_a_step_is_planned_again():
    """Between two steps: a capture, a gate, a replaced projection (checked again), a global hook, gradients,
    training with dropout, backends.use(), queries of another dtype, pruning -- each is seen, as when every
    step is planned."""
    from multihead import backends, heads

    torch.manual_seed(0)

    def fresh():
        m = MultiHeadAttention(16, 4, dropout=0.5, bias=True, query_size=16, key_size=16, value_size=16).eval()
        cache = KVCache(m, 2, 8)
        with torch.no_grad():
            _decode(m, torch.randn(2, 3, 16), cache)  # three steps: the plan is repeated from the second
        return m, cache

    x = torch.randn(2, 1, 16)

    def both(change):
        """The next step after ``change`` (which returns a context, or None), against the same step planned."""
        outs = []
        for explicit in (False, True):
            torch.manual_seed(1)
            m, cache = fresh()
            with contextlib.ExitStack() as stack:
                stack.enter_context(torch.no_grad())  # as decoding runs; a change may enable grad again
                ctx = change(m)
                got = None if ctx is None else stack.enter_context(ctx)
                out = m(x, x, cache=cache) if explicit else m(x, cache=cache)
            outs.append((out, got))
        return outs

    (a, _), (b, _) = both(lambda m: None)
    assert torch.equal(a, b)
    (a, cap), (b, _) = both(lambda m: multihead.capture(m))
    assert cap.calls("MultiHeadAttention")[0].shape == (2, 4, 1, 4)  # the weights of the step over 3 cached + 1
    (a, _), (b, _) = both(lambda m: heads.gated(m, {"": torch.tensor([1.0, 0.0, 1.0, 0.0])}))
    assert torch.equal(a, b)
    (a, _), (b, _) = both(lambda m: setattr(m, "o_proj", torch.nn.Identity()))  # a replaced projection
    assert a.shape == (2, 1, 16) and torch.equal(a, b)
    with pytest.raises(ValueError, match=r"queries must be \(B, L, query_size=8\)"):  # checked, as when planned
        both(lambda m: setattr(m, "q_proj", torch.nn.Linear(8, 16)))
    seen = []

    @contextlib.contextmanager
    def hooked(m):
        handle = torch.nn.modules.module.register_module_forward_hook(lambda mod, i, o: seen.append(type(mod)))
        yield
        handle.remove()

    (a, _), (b, _) = both(hooked)
    assert seen.count(torch.nn.Linear) == 8 and torch.equal(a, b)  # the global hook saw q, k, v, o on both paths
    (a, _), (b, _) = both(lambda m: torch.enable_grad())
    assert a.requires_grad and b.requires_grad and torch.equal(a, b)
    a.sum().backward()  # gradients reach the parameters
    assert a.grad_fn is not None
    (a, _), (b, _) = both(lambda m: m.train() and None)  # training: attention dropout on the weights
    assert torch.equal(a, b)
    ran = []
    sdpa = backends.get("sdpa")
    backends.register("probe", lambda *a, **k: ran.append(1) or sdpa.run(*a, **k), priority=-1)
    try:
        (a, _), (b, _) = both(lambda m: backends.use("probe"))
    finally:
        backends.unregister("probe")
    assert ran == [1, 1] and torch.equal(a, b)  # the backend use() names runs on both paths
    with torch.no_grad():
        m, cache = fresh()
        with pytest.raises(RuntimeError, match="same dtype"):  # float64 queries: planned in full, refused as before
            m.double()(x.double(), cache=cache)
        m, cache = fresh()
        heads.prune(m, {"": [0]})
        with pytest.raises(ValueError, match="the cache holds Hkv=4 heads of D=4; this step has 3 of 4"):
            m(x, cache=cache)


def test_a_kept_backend_that_becomes_unavailable_is_reported_and_the_next_choice_runs():
    """A step run again keeps the registry's choice; when that backend raises Unavailable mid-decoding, the
    registry reports it once and the next choice computes the step, as on a planned call."""
    from multihead import backends
    from multihead.backends import registry

    sdpa = backends.get("sdpa")
    state = {"fail": False, "ran": 0}

    def flaky(q, k, v, mask, *, scale, dropout_p):
        state["ran"] += 1
        if state["fail"]:
            raise registry.Unavailable("its compiler broke")
        return sdpa.run(q, k, v, mask, scale=scale, dropout_p=dropout_p)

    backends.register("flaky", flaky, priority=1000, cacheable=True)
    try:
        torch.manual_seed(0)
        m = MultiHeadAttention(16, 4, bias=True, query_size=16, key_size=16, value_size=16).eval()
        x = torch.randn(2, 5, 16)
        cache = KVCache(m, 2, 5)
        with torch.no_grad():
            first = _decode(m, x[:, :3], cache)
            assert state["ran"] == 3
            state["fail"] = True
            with pytest.warns(RuntimeWarning, match="'flaky' could not run"):
                fourth = m(x[:, 3:4], cache=cache)
            fifth = m(x[:, 4:5], cache=cache)  # no longer chosen: not tried again
            assert state["ran"] == 4
            full = m(x, mask=masks.Causal())
    finally:
        backends.unregister("flaky")
    assert torch.allclose(torch.cat([first, fourth, fifth], 1), full, atol=1e-6)


def test_a_copied_cache_forks_the_decoding_without_copying_the_model():
    """copy.deepcopy(cache) (a beam search's fork) continues as the original does, and carries tensors only:
    what the last step was planned on (which names the projection modules) is not copied."""
    import copy

    torch.manual_seed(0)
    m = MultiHeadAttention(16, 4, bias=True, query_size=16, key_size=16, value_size=16).eval()
    x = torch.randn(2, 6, 16)
    cache = KVCache(m, 2, 6)
    with torch.no_grad():
        _decode(m, x[:, :4], cache)
        fork = copy.deepcopy(cache)
        assert all(isinstance(t, torch.Tensor) or t is None
                   for layer in fork._layers.values() for t in (layer.k, layer.v, layer.step, layer.chosen))
        a, b = _decode(m, x[:, 4:], cache), _decode(m, x[:, 4:], fork)
    assert torch.equal(a, b)
