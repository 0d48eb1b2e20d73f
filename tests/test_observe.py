"""Attention seen where it is computed (multihead.heads.observe): capture, gates and importance on
modules that call F.scaled_dot_product_attention themselves -- written here in the styles of timm's
Attention (fused qkv, a head size that is not E / H) and of a decoder with GQA -- checked against the float64
reference. timm itself: tests/test_vision_real.py."""

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import multihead
from multihead import heads
from multihead.backends.reference import reference_attention


class FusedQKV(nn.Module):
    """timm's ``Attention`` style: one qkv Linear, (B, N, 3, H, D) -> q, k, v, SDPA, proj."""

    def __init__(self, dim=24, num_heads=3):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x, mask=None):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)  # (B, H, N, D) each
        x = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(x.transpose(1, 2).reshape(B, N, C))


class Block(nn.Module):
    def __init__(self, attn):
        super().__init__()
        self.norm, self.attn = nn.LayerNorm(24), attn

    def forward(self, x, mask=None):
        return x + self.attn(self.norm(x), mask)


class GQADecoder(nn.Module):
    """In Llama's style: separate projections, 4 query heads sharing 2 key/value heads (sizes read
    with -1 from head_dim), a causal call, a scale."""

    def __init__(self, dim=24, H=4, Hkv=2, D=5):
        super().__init__()
        self.head_dim = D
        self.q, self.k, self.v = nn.Linear(dim, H * D), nn.Linear(dim, Hkv * D), nn.Linear(dim, Hkv * D)
        self.o = nn.Linear(H * D, dim)

    def forward(self, x, mask=None):
        B, L, _ = x.shape
        q = self.q(x).view(B, L, -1, self.head_dim).transpose(1, 2)  # (B, H, L, D)
        k = self.k(x).view(B, L, -1, self.head_dim).transpose(1, 2)  # (B, Hkv, L, D)
        v = self.v(x).view(B, L, -1, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=0.3,
                                             enable_gqa=True)  # (B, H, L, D)
        return self.o(out.transpose(1, 2).reshape(B, L, -1))


def _qk(block: Block, x: torch.Tensor, gqa: bool):
    """The per-head query and key a block's attention computes, (B, H, L, D) / (B, Hkv, L, D)."""
    a, h = block.attn, block.norm(x)
    B, L, _ = x.shape
    if gqa:
        return (p(h).view(B, L, -1, a.head_dim).transpose(1, 2) for p in (a.q, a.k, a.v))
    return a.qkv(h).reshape(B, L, 3, a.num_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)


def _roundings(n: int, ref: torch.Tensor) -> float:
    """n float32 roundings of the reference's largest magnitude (at least 1)."""
    return n * torch.finfo(torch.float32).eps * max(1.0, float(ref.abs().max()))


def _reference_weights(q, k, keep, scale):
    """float64 softmax(q k^T * scale) under keep (True = may attend), GQA keys repeated."""
    k = k.double().repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = q.double() @ k.transpose(-1, -2) * scale
    return s.masked_fill(~keep, float("-inf")).softmax(-1).nan_to_num(0.0)


@pytest.mark.parametrize("style", ["fused", "gqa"])
def test_capture_sees_the_weights_sdpa_computed_and_outputs_are_unchanged(style):
    torch.manual_seed(0)
    attn = FusedQKV if style == "fused" else GQADecoder
    model = nn.Sequential(Block(attn()), Block(attn())).eval()
    x = torch.randn(2, 7, 24)
    with torch.no_grad():
        before = model(x)
    found = heads.observe(model, x)
    assert list(found) == ["0.attn", "1.attn"]
    assert heads.observe(model, x) == found  # observing again changes nothing
    with torch.no_grad():
        assert torch.equal(model(x), before)  # nothing registered: the module runs untouched
        with multihead.capture(model) as cap:
            assert torch.equal(model(x), before)  # observed: the SDPA call itself untouched
    with torch.no_grad():
        q, k, _ = _qk(model[0], x, style == "gqa")
    L = x.shape[1]
    keep = torch.ones(L, L, dtype=torch.bool) if style == "fused" else torch.ones(L, L, dtype=torch.bool).tril()
    want = _reference_weights(q, k, keep, q.shape[-1] ** -0.5 if style == "fused" else 0.3)
    got = cap["0.attn"]
    assert got.shape == (2, q.shape[1], L, L)
    scores = q @ k.repeat_interleave(q.shape[1] // k.shape[1], 1).transpose(-1, -2)
    assert (got.double() - want).abs().max() <= _roundings(8, scores)


@pytest.mark.parametrize("mask_kind", ["bool", "float"])
def test_masks_given_to_sdpa_are_the_masks_captured_and_gates_scale_each_head(mask_kind):
    torch.manual_seed(1)
    model = Block(FusedQKV()).eval()
    x = torch.randn(2, 6, 24)
    keep = torch.rand(2, 1, 6, 6) > 0.3
    keep[..., 0] = True
    mask = keep if mask_kind == "bool" else torch.zeros(2, 1, 6, 6).masked_fill(~keep, float("-inf"))
    heads.observe(model, (x, mask))
    with torch.no_grad(), multihead.capture(model) as cap:
        model(x, mask)
        q, k, v = _qk(model, x, False)
    want = _reference_weights(q, k, keep, q.shape[-1] ** -0.5)
    assert (cap["attn"].double() - want).abs().max() <= _roundings(8, q @ k.transpose(-1, -2))
    gates = torch.tensor([1.0, 0.0, 0.5])
    with torch.no_grad(), heads.gated(model, {"attn": gates}):
        got = model(x, mask)
    with torch.no_grad():
        o = reference_attention(q.double(), k.double(), v.double(), keep, scale=q.shape[-1] ** -0.5)  # (B, H, L, D)
        o = (o * gates.double()[:, None, None]).float()
        want = x + model.attn.proj(o.transpose(1, 2).reshape(2, 6, 24))
    assert (got - want).abs().max() <= _roundings(64, want)  # SDPA's float32 sums, then the projection


def test_importance_and_the_mode_left_on_an_exception():
    torch.manual_seed(2)
    model = nn.Sequential(Block(FusedQKV()), Block(GQADecoder())).eval()
    x = torch.randn(3, 5, 24)
    heads.observe(model, x)
    batches = [torch.randn(3, 5, 24) for _ in range(2)]
    imp = heads.importance(model, batches, lambda m, b: m(b).pow(2).mean(), "ablation", progress=False)
    assert [tuple(s.shape) for s in imp.scores] == [(3,), (4,)]
    assert all(bool((s != 0).any()) for s in imp.scores)
    with pytest.raises(RuntimeError), multihead.capture(model):
        model(torch.randn(3, 5, 7))  # a wrong width fails inside the first observed module
    assert torch.overrides._get_current_function_mode_stack() == []  # no mode left behind
    with pytest.raises(ValueError, match=r"0.attn \(FusedQKV\) can be seen and gated, but multihead has no head "
                                         r"layout for it .*gate its heads with heads.gated instead"):
        heads.prune(model, {"0.attn": [0]})
    copy.deepcopy(model)(x)
    pickle.loads(pickle.dumps(model))(x)
    heads.unobserve(model)
    assert heads.attention_modules(model) == {} and heads.observed(model) == {}


def test_what_cannot_be_seen_is_refused():
    class ByHand(nn.Module):  # attention written out: no SDPA call to see
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(8, 24)

        def forward(self, x):
            q, k, v = self.qkv(x).chunk(3, -1)
            return (q @ k.transpose(-1, -2)).softmax(-1) @ v

    with pytest.raises(ValueError, match=r"ByHand: no module called torch.nn.functional.scaled_dot_product_attention"):
        heads.observe(ByHand(), torch.randn(1, 3, 8))
    with pytest.raises(TypeError, match="observe takes an nn.Module; got function"):
        heads.observe(F.relu, torch.randn(2))
    own = nn.Sequential(multihead.MultiHeadAttention(8, 2))  # multihead's own modules are seen already
    assert heads.observe(own, torch.randn(1, 3, 8)) == {}
    assert list(heads.attention_modules(own)) == ["0"]


class TimmStyle(nn.Module):
    """timm's Attention as it reads its sizes from attributes (num_heads, head_dim) and merges the
    heads with reshape(B, N, -1): the shape a cut module can still run."""

    def __init__(self, dim=24, num_heads=4, head_dim=5):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        self.qkv = nn.Linear(dim, 3 * num_heads * head_dim)
        self.proj = nn.Linear(num_heads * head_dim, dim)

    def forward(self, x, mask=None):
        B, N, _ = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)  # (B, H, N, D) each
        x = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, H, N, D)
        return self.proj(x.transpose(1, 2).reshape(B, N, -1))


def test_a_layout_derived_from_the_sdpa_call_cuts_heads_and_the_pruned_model_loads_back(tmp_path):
    """The head layout is proposed from the module's layers and the sizes of its SDPA call, verified
    by cutting a copy (cut = gate on the probe call); heads.prune then cuts, the pruned model equals the
    gated one, and its state dict loads into a fresh model observed and cut the same way."""
    torch.manual_seed(3)

    def make():
        torch.manual_seed(3)
        return nn.Sequential(Block(TimmStyle()), Block(TimmStyle()), Block(GQADecoder())).eval()

    model, x = make(), torch.randn(2, 6, 24)
    heads.observe(model, x)
    layouts = {n: m.attention_hooks.layout for n, m in heads.observed(model).items()}
    assert layouts["0.attn"].family == "fused [Q | K | V]" and layouts["2.attn"].family == "separate q/k/v"
    cut = {"0.attn": [1, 3], "1.attn": [0], "2.attn": [0, 1]}  # 2.attn: one key/value group (GQA)
    gates = {n: torch.ones(m.attention_hooks.num_heads) for n, m in heads.observed(model).items()}
    for n, hs in cut.items():
        gates[n][hs] = 0.0
    with torch.no_grad(), heads.gated(model, gates):
        want = model(x)
    kept = heads.prune(model, cut)
    assert kept == {"0.attn": [0, 2], "1.attn": [1, 2, 3], "2.attn": [2, 3]}
    assert model[0].attn.qkv.weight.shape == (3 * 2 * 5, 24) and model[2].attn.k.weight.shape == (5, 24)
    with torch.no_grad():
        got = model(x)
    assert (got - want).abs().max() <= _roundings(64, want)
    torch.save(model.state_dict(), tmp_path / "pruned.pt")
    fresh = make()
    heads.observe(fresh, x)
    heads.prune(fresh, cut)  # the same cut gives the same shapes; the weights come from the file
    fresh.load_state_dict(torch.load(tmp_path / "pruned.pt", weights_only=True))
    with torch.no_grad():
        assert torch.equal(fresh(x), got)
