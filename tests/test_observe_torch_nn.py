"""torch.nn.MultiheadAttention seen where it is computed (multihead.heads.observe through
F.multi_head_attention_forward): the ViT of torchvision and the text tower of open_clip are built
on it. The real packages are tested in tests/test_vision_real.py; the blocks written here in their style
keep the cases those lack: capture against the float64 reference from the same q/k, uneven head counts
(4 and 6 heads in one model), open_clip's older sequence-first layout with a float causal mask and
returned weights, and torch's own nn.TransformerEncoder. Each: outputs unchanged, pruned = gated, the
pruned state dict loads back."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import multihead
from multihead import heads
from multihead.layer.dropin import PrunedMultiheadAttention


class EncoderBlock(nn.Module):
    """torchvision's ViT ``EncoderBlock``: pre-norm, ``nn.MultiheadAttention(batch_first=True)`` called as
    ``self_attention(x, x, x, need_weights=False)``, then an MLP."""

    def __init__(self, num_heads=4, hidden_dim=24, mlp_dim=48):
        super().__init__()
        self.ln_1 = nn.LayerNorm(hidden_dim, eps=1e-6)
        self.self_attention = nn.MultiheadAttention(hidden_dim, num_heads, batch_first=True)
        self.ln_2 = nn.LayerNorm(hidden_dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(hidden_dim, mlp_dim), nn.GELU(), nn.Linear(mlp_dim, hidden_dim))

    def forward(self, x):
        h = self.ln_1(x)
        h, _ = self.self_attention(h, h, h, need_weights=False)
        x = x + h
        return x + self.mlp(self.ln_2(x))


class ResidualAttentionBlock(nn.Module):
    """open_clip's text block in its older layout: (L, B, E) inputs, a float causal ``attn_mask``, and
    torch.nn's default call (need_weights=True: the averaged weights come back and are dropped)."""

    def __init__(self, width=24, heads=3):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x, attn_mask):
        h = self.ln_1(x)
        x = x + self.attn(h, h, h, attn_mask=attn_mask)[0]
        return x + self.mlp(self.ln_2(x))


class TextTower(nn.Module):
    def __init__(self, layers=2):
        super().__init__()
        self.resblocks = nn.ModuleList(ResidualAttentionBlock() for _ in range(layers))

    def forward(self, x):  # x (B, L, E)
        L = x.shape[1]
        mask = torch.full((L, L), float("-inf")).triu(1)  # (L, L) float causal
        x = x.transpose(0, 1)  # (B, L, E) -> (L, B, E)
        for b in self.resblocks:
            x = b(x, mask)
        return x.transpose(0, 1)


def _roundings(n: int, ref: torch.Tensor) -> float:
    return n * torch.finfo(torch.float32).eps * max(1.0, float(ref.detach().abs().max()))


def _reference_weights(mha: nn.MultiheadAttention, h: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """float64 softmax(q k^T / sqrt(D)) of the module's own projections of h (B, L, E), under keep
    (True = may attend): (B, H, L, L)."""
    B, L, E = h.shape
    H = mha.num_heads
    w, b = mha.in_proj_weight.double(), mha.in_proj_bias.double()
    q, k, _ = F.linear(h.double(), w, b).chunk(3, -1)  # (B, L, E) each
    q = q.view(B, L, H, -1).transpose(1, 2)  # (B, L, E) -> (B, H, L, D)
    k = k.view(B, L, H, -1).transpose(1, 2)
    s = q @ k.transpose(-1, -2) / (E // H) ** 0.5
    return s.masked_fill(~keep, float("-inf")).softmax(-1)


def _vit(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(EncoderBlock(), EncoderBlock(num_heads=6)).eval()


def test_torchvision_style_blocks_are_seen_captured_against_the_reference_and_cut(tmp_path):
    model, x = _vit(), torch.randn(2, 7, 24)
    with torch.no_grad():
        before = model(x)
    found = heads.observe(model, x)
    assert list(found) == ["0.self_attention", "1.self_attention"]
    with torch.no_grad():
        assert torch.allclose(model(x), before, atol=_roundings(16, before))  # torch.nn's slow path while observed
        with multihead.capture(model) as cap:
            seen = model(x)
    assert torch.allclose(seen, before, atol=_roundings(16, before))
    with torch.no_grad():
        h = model[0].ln_1(x)
        want = _reference_weights(model[0].self_attention, h, torch.ones(1, 1, 7, 7, dtype=torch.bool))
    got = cap["0.self_attention"]
    assert got.shape == (2, 4, 7, 7) and cap["1.self_attention"].shape == (2, 6, 7, 7)
    assert (got.double() - want).abs().max() <= _roundings(8, want)

    cut = {"0.self_attention": [1, 3], "1.self_attention": [0, 2, 4, 5]}
    gates = {n: torch.ones(m.attention_hooks.num_heads) for n, m in heads.observed(model).items()}
    for n, hs in cut.items():
        gates[n][hs] = 0.0
    with torch.no_grad(), heads.gated(model, gates):
        gated = model(x)
    assert heads.prune(model, cut) == {"0.self_attention": [0, 2], "1.self_attention": [1, 3]}
    attn = model[0].self_attention
    assert isinstance(attn, PrunedMultiheadAttention) and attn.in_proj_weight.shape == (3 * 2 * 6, 24)
    assert attn.out_proj.weight.shape == (24, 12) and heads.observed(model) == {}  # a multihead module now
    with torch.no_grad():
        pruned = model(x)
    assert (pruned - gated).abs().max() <= 1e-5
    assert list(heads.attention_modules(model)) == ["0.self_attention", "1.self_attention"]

    torch.save(model.state_dict(), tmp_path / "pruned.pt")  # loads into a fresh model cut the same way
    fresh = _vit(seed=1)
    heads.observe(fresh, x)
    heads.prune(fresh, cut)
    fresh.load_state_dict(torch.load(tmp_path / "pruned.pt", weights_only=True))
    with torch.no_grad():
        assert torch.equal(fresh(x), pruned)


def test_open_clip_style_sequence_first_float_causal_mask_and_returned_weights():
    torch.manual_seed(0)
    tower, x = TextTower().eval(), torch.randn(2, 6, 24)
    with torch.no_grad():
        before = tower(x)
        attn = tower.resblocks[0].attn
        h = tower.resblocks[0].ln_1(x.transpose(0, 1))  # (L, B, E)
        mask = torch.full((6, 6), float("-inf")).triu(1)
        _, torch_weights = attn(h, h, h, attn_mask=mask)  # (B, L, L), averaged over the heads
    heads.observe(tower, x)
    with torch.no_grad(), multihead.capture(tower) as cap:
        assert torch.allclose(tower(x), before, atol=_roundings(16, before))
        _, our_weights = attn(h, h, h, attn_mask=mask)  # the observed module returns torch.nn's weights
    assert torch.allclose(our_weights, torch_weights, atol=1e-6)
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    want = _reference_weights(attn, h.transpose(0, 1).detach(), causal)
    assert (cap["resblocks.0.attn"][:2].double() - want).abs().max() <= _roundings(8, want)
    with torch.no_grad(), heads.gated(tower, {"resblocks.1.attn": torch.tensor([1.0, 0.0, 1.0])}):
        gated = tower(x)
    heads.prune(tower, {"resblocks.1.attn": [1]})
    with torch.no_grad():
        assert (tower(x) - gated).abs().max() <= 1e-5


def test_transformer_encoder_with_padding_importance_and_every_head_cut():
    """torch's own encoder (its fused fast path off while observed): a key padding mask, head
    importance through the gates, and a layer with every head pruned (its output projection's bias)."""
    torch.manual_seed(0)
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True), 2,
                                enable_nested_tensor=False).eval()
    x = torch.randn(3, 5, 16)
    pad = torch.tensor([[False] * 5, [False, False, False, True, True], [False] * 4 + [True]])  # True = padding
    with torch.no_grad():
        before = enc(x, src_key_padding_mask=pad)
    heads.observe(enc, (x, None, pad))
    with torch.no_grad(), multihead.capture(enc) as cap:
        seen = enc(x, src_key_padding_mask=pad)
    real = ~pad[:, None, :, None]  # rows of real queries: padded ones are torch.nn's own output there
    assert torch.allclose(seen.masked_fill(~real[:, 0], 0), before.masked_fill(~real[:, 0], 0), atol=1e-5)
    w = cap["layers.0.self_attn"]  # (B, H, L, L): no weight on a padded key
    assert w.shape == (3, 4, 5, 5) and float(w[1, :, :, 3:].abs().max()) == 0.0

    def loss(model, batch):  # (post-norm outputs: their mean square would not move)
        return model(batch)[..., :4].mean()

    imp = heads.importance(enc, [x, x + 1], loss, "ablation", progress=False)
    assert imp.names == ["layers.0.self_attn", "layers.1.self_attn"] and float(imp.table().abs().max()) > 1e-3
    gates = {"layers.1.self_attn": torch.zeros(4)}
    with torch.no_grad(), heads.gated(enc, gates):
        gated = enc(x)
    heads.prune(enc, {"layers.1.self_attn": [0, 1, 2, 3]})
    assert enc.layers[1].self_attn.num_heads == 0
    with torch.no_grad():
        assert (enc(x) - gated).abs().max() <= 1e-5


def test_what_is_refused_for_torch_nn_modules():
    class OwnForward(nn.MultiheadAttention):  # a subclass computing something else around torch.nn's call
        def forward(self, query, key, value, **kw):
            out, w = super().forward(query, key, value, **kw)
            return out * 2, w

    model = nn.Sequential(nn.Linear(8, 8), OwnForward(8, 2, batch_first=True))

    class Wrap(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, x):
            return self.inner[1](x, x, x, need_weights=False)[0]

    wrap = Wrap().eval()
    heads.observe(wrap, torch.randn(1, 3, 8))
    with torch.no_grad(), heads.gated(wrap, {"inner.1": torch.tensor([0.0, 1.0])}):
        wrap(torch.randn(1, 3, 8))  # seen and gated
    with pytest.raises(ValueError, match=r"inner.1 \(OwnForward\) can be seen and gated, but not pruned: OwnForward "
                                         r"overrides torch.nn.MultiheadAttention.forward"):
        heads.prune(wrap, {"inner.1": [0]})

    class Static(nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = nn.MultiheadAttention(8, 2)

        def forward(self, x):  # (L, B, E), keys given per head as static_k / static_v
            m = self.mha
            sk = torch.zeros(x.shape[1] * 2, x.shape[0], 4)
            return F.multi_head_attention_forward(x, x, x, 8, 2, m.in_proj_weight, m.in_proj_bias, None, None, False,
                                                  0.0, m.out_proj.weight, m.out_proj.bias, training=False,
                                                  need_weights=False, static_k=sk, static_v=sk)[0]

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = Static()

        def forward(self, x):
            return self.block(x)

    outer = Outer()
    heads.observe(outer, torch.randn(3, 1, 8))
    with pytest.raises(ValueError, match="static_k / static_v; multihead observes calls that project their own"):
        with multihead.capture(outer):
            outer(torch.randn(3, 1, 8))
    with pytest.raises(ValueError, match=r"packed=True \(one in_proj_weight\) needs kdim = vdim = embed_dim=8; got "
                                         r"kdim=4, vdim=8. Pass packed=False."):
        PrunedMultiheadAttention(8, 2, 4, kdim=4)


@pytest.mark.parametrize("kw", [{"kdim": 6, "vdim": 5}, {"add_bias_kv": True, "add_zero_attn": True}, {"bias": False}])
def test_every_torch_nn_variant_cut_equals_gated(kw):
    """Separate q/k/v weights (kdim, vdim), appended key/value positions, no biases: observed outputs
    equal torch.nn's, and a cut head equals its gate."""
    torch.manual_seed(0)

    class Cross(nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = nn.MultiheadAttention(12, 3, batch_first=True, **kw)

        def forward(self, x, k, v):
            pad = torch.tensor([[False] * 4, [False, False, True, True]])  # True = padding
            return self.mha(x, k, v, key_padding_mask=pad)[0]

    model = Cross().eval()
    x, k, v = torch.randn(2, 3, 12), torch.randn(2, 4, kw.get("kdim", 12)), torch.randn(2, 4, kw.get("vdim", 12))
    with torch.no_grad():
        before = model(x, k, v)
    heads.observe(model, (x, k, v))
    with torch.no_grad(), heads.gated(model, {"mha": torch.tensor([1.0, 1.0, 1.0])}) as g:
        assert torch.allclose(model(x, k, v), before, atol=1e-6)  # gates at 1: torch.nn's output
        g["mha"][1] = 0.0
        gated = model(x, k, v)
    assert not torch.allclose(gated, before, atol=1e-3)
    heads.prune(model, {"mha": [1]})
    assert isinstance(model.mha, PrunedMultiheadAttention) and model.mha.num_heads == 2
    with torch.no_grad():
        assert (model(x, k, v) - gated).abs().max() <= 1e-5


def test_the_pruned_module_in_every_mode():
    import copy
    import pickle

    torch.manual_seed(0)
    model, x = _vit(), torch.randn(2, 5, 24)
    heads.observe(model, x)
    heads.prune(model, {"0.self_attention": [0], "1.self_attention": [1, 2]})
    with torch.no_grad():
        ref = model(x)
        assert torch.equal(copy.deepcopy(model)(x), ref) and torch.equal(pickle.loads(pickle.dumps(model))(x), ref)
    with torch.inference_mode():
        assert torch.equal(model(x), ref)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert model[0].self_attention(x, x, x, need_weights=False)[0].dtype == torch.bfloat16
        assert (model(x) - ref).abs().max() < 0.2  # bfloat16's 8 bits
    with torch.device("meta"):
        meta = PrunedMultiheadAttention(24, 3, 6, batch_first=True)
    y = torch.empty(2, 5, 24, device="meta")
    assert meta(y, y, y, need_weights=False)[0].shape == (2, 5, 24)
    with pytest.raises(TypeError, match="torch.jit.script cannot compile PrunedMultiheadAttention .* cannot hold 3 "
                                        "heads of 6 with embed_dim=24; use torch.compile or torch.export instead"):
        torch.jit.script(model)
