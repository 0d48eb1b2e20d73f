"""KV-cache decoding: the same numbers as recomputing, GQA-aware buffers, capture over the
cached length, cross-attention memory projected once, clear errors."""

from __future__ import annotations

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
