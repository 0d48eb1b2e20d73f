"""The real vision packages (the `vision` extra: timm, torchvision, open_clip at the lock), tiny configs with random
weights: every head seen as the package's own slow path weighs it, cut (pruned = gated on inputs the probe never
saw), the module's own attributes kept true, the pruned state dict loaded into a fresh model observed and cut the
same way; seeing on the user's own call (no probe); refusals that name the module and why."""

from __future__ import annotations

import copy
import io
import json

import pytest
import torch
from torch import nn

import multihead
from multihead import heads

timm = pytest.importorskip("timm")
torchvision = pytest.importorskip("torchvision")
open_clip = pytest.importorskip("open_clip")

#: timm models at tiny sizes: (name, create_model kwargs, image side)
TIMM = {
    "vit": ("vit_small_patch16_224", dict(img_size=32, patch_size=8, embed_dim=48, depth=2, num_heads=4), 32),
    "deit-distilled": ("deit_tiny_distilled_patch16_224", dict(img_size=32, patch_size=8, embed_dim=36, depth=2,
                                                              num_heads=3), 32),
    "eva02": ("eva02_tiny_patch14_224", dict(img_size=28, patch_size=14, embed_dim=48, depth=2, num_heads=4), 28),
    "swin": ("swin_tiny_patch4_window7_224", dict(img_size=56, patch_size=4, window_size=7, embed_dim=24,
                                                  depths=(2, 2), num_heads=(2, 4)), 56),
}


def _timm(kind: str, seed: int = 0) -> tuple[nn.Module, int]:
    name, kw, side = TIMM[kind]
    torch.manual_seed(seed)
    model = timm.create_model(name, pretrained=False, num_classes=5, **kw).eval()
    with torch.no_grad():  # random weights of a trained model's scale: every head's cut shows in the output
        for n, p in model.named_parameters():
            if n.endswith(("q_bias", "v_bias", "relative_position_bias_table")):
                p.normal_(0, 0.5)
            elif p.dim() >= 2:
                p.normal_(0, 2.0 / p.shape[-1] ** 0.5)
    return model, side


def _slow_weights(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """The weights timm's own slow path computes: every attention module with ``fused_attn`` off, its softmax
    weights read where they enter ``attn_drop`` (B, H, N, N)."""
    from multihead.heads.timm_forms import take_timm_form

    slow, got = copy.deepcopy(model), {}
    for name, m in slow.named_modules():
        if "multihead_timm_form" in m.__dict__:  # the class's own forward (EVA's form computes with SDPA)
            take_timm_form(m)
        if "fused_attn" in m.__dict__:
            m.__dict__["fused_attn"] = False
            m.attn_drop.register_forward_hook(lambda mod, a, out, name=name: got.__setitem__(name, a[0].detach()))
    heads.unobserve(slow)
    with torch.no_grad():
        slow(x)
    return got


@pytest.mark.parametrize("kind", list(TIMM))
def test_timm_attention_seen_as_its_slow_path_weighs_and_cut_as_gated(kind, tmp_path):
    model, side = _timm(kind)
    x, fresh = torch.randn(2, 3, side, side), torch.randn(3, 3, side, side)
    found = heads.observe(model, x)
    assert found and all(m.attention_hooks.layout is not None for m in found.values()), \
        {n: m.attention_hooks.layout_reason for n, m in found.items()}
    want = _slow_weights(model, x)
    with torch.no_grad(), multihead.capture(model) as cap:
        model(x)
    assert set(cap) == set(want) == set(found)
    for name in want:
        assert (cap[name] - want[name]).abs().max() < 1e-5, name
    cut = {n: list(range(0, m.num_heads, 2)) for n, m in found.items()}  # half the heads (one of two)
    gates = {n: torch.tensor([0.0 if h in cut[n] else 1.0 for h in range(m.num_heads)]) for n, m in found.items()}
    with torch.no_grad():
        full = model(fresh)
        with heads.gated(model, gates):
            gated = model(fresh)
    before = {n: m.num_heads for n, m in found.items()}
    heads.prune(model, cut)
    with torch.no_grad():
        pruned = model(fresh)
    assert (gated - full).abs().max() > 1e-3  # the cut heads mattered
    assert (pruned - gated).abs().max() < 1e-5
    for n, m in found.items():  # the module's own attributes say what it holds
        H, D = before[n] - len(cut[n]), m.attention_hooks.seen.D
        assert m.num_heads == H and m.qkv.out_features == 3 * H * D and m.proj.in_features == H * D
        if "attn_dim" in m.__dict__:
            assert m.attn_dim == H * D
        if getattr(m, "q_bias", None) is not None:
            assert m.q_bias.shape == m.k_bias.shape == m.v_bias.shape == (H * D,)
        if hasattr(m, "relative_position_bias_table"):
            assert m.relative_position_bias_table.shape[-1] == H
    path = tmp_path / "pruned.pt"
    torch.save(model.state_dict(), path)
    again, _ = _timm(kind, seed=7)  # other weights: everything comes from the file
    heads.observe(again, x)
    heads.prune(again, cut)
    again.load_state_dict(torch.load(path, weights_only=True))
    with torch.no_grad():
        assert torch.equal(again(fresh), pruned)


class _Block(nn.Module):
    def __init__(self, attn: nn.Module):
        super().__init__()
        self.attn = attn

    def forward(self, x):
        return x + self.attn(x)


def test_timm_attention_output_gate_cut_with_its_heads_and_a_norm_over_heads_refused():
    from timm.layers import Attention

    torch.manual_seed(0)
    x, fresh = torch.randn(2, 5, 32), torch.randn(3, 7, 32)
    gated = nn.Sequential(_Block(Attention(32, num_heads=4, qkv_bias=True, gated=True)),
                          _Block(Attention(32, num_heads=4, qkv_bias=True, gated=True))).eval()
    heads.observe(gated, x)
    with torch.no_grad(), heads.gated(gated, {"0.attn": [1.0, 0.0, 0.0, 1.0]}):
        want = gated(fresh)
    heads.prune(gated, {"0.attn": [1, 2]})
    attn = gated[0].attn
    assert (attn.num_heads, attn.attn_dim, attn.gate.out_features, attn.proj.in_features) == (2, 16, 16, 16)
    with torch.no_grad():
        assert (gated(fresh) - want).abs().max() < 1e-5
    normed = nn.Sequential(_Block(Attention(32, num_heads=4, scale_norm=True, norm_layer=nn.LayerNorm))).eval()
    heads.observe(normed, x)
    with torch.no_grad(), multihead.capture(normed) as cap:  # seen and gated all the same
        normed(x)
    assert cap["0.attn"].shape == (2, 4, 5, 5)
    with pytest.raises(ValueError, match=r"0.attn \(Attention\) .* its norm \(LayerNorm\) normalises all 4 heads' 32 "
                                         r"output features together"):
        heads.prune(normed, {"0.attn": [0]})


def test_eva_attention_with_three_projections_and_a_gate_cut_through_its_form():
    from timm.models.eva import EvaAttention

    torch.manual_seed(0)
    x, fresh = torch.randn(2, 6, 24), torch.randn(1, 9, 24)
    model = nn.Sequential(_Block(EvaAttention(24, num_heads=4, qkv_fused=False, gated=True, qk_norm=True,
                                              norm_layer=nn.LayerNorm, scale_norm=False))).eval()
    with torch.no_grad():
        ref = model(fresh)
    heads.observe(model, x)
    with torch.no_grad():
        assert (model(fresh) - ref).abs().max() < 1e-6  # the form computes what the class computes
        with heads.gated(model, {"0.attn": [0.0, 1.0, 1.0, 0.0]}):
            want = model(fresh)
    heads.prune(model, {"0.attn": [0, 3]})
    with torch.no_grad():
        assert (model(fresh) - want).abs().max() < 1e-5
    assert model[0].attn.q_proj.out_features == 12 and model[0].attn.num_heads == 2


def test_timm_seen_on_the_users_own_call_without_a_probe():
    model, side = _timm("vit")
    x = torch.randn(2, 3, side, side)
    with torch.no_grad():
        ref = model(x)
    want = _slow_weights(model, x)
    with torch.no_grad(), multihead.capture(model) as cap:  # no heads.observe: the first call is observed
        assert torch.equal(model(x), ref)
        model(x)
    assert list(cap) == ["blocks.0.attn", "blocks.1.attn"] and len(cap.calls("blocks.0.attn")) == 2
    for name in want:
        assert (cap[name] - want[name]).abs().max() < 1e-5
    fresh, _ = _timm("vit")
    with torch.no_grad(), heads.gated(fresh, {"blocks.1.attn": [1.0, 0.0, 1.0, 1.0]}) as g:
        out = fresh(x)
    assert list(g) == ["blocks.0.attn", "blocks.1.attn"] and (out - ref).abs().max() > 1e-3
    imp = heads.importance(_timm("vit")[0], [x], lambda m, b: m(b).logsumexp(-1).mean(), method="ablation",
                           progress=False)
    assert imp.names == ["blocks.0.attn", "blocks.1.attn"] and all(s.shape == (4,) for s in imp.scores)
    other = _timm("vit")[0]
    with pytest.raises(ValueError, match=r"no attention module named \['blocks.9.attn'\] was called in the block; "
                                         r"modules: \['blocks.0.attn', 'blocks.1.attn'\]"):
        with torch.no_grad(), heads.gated(other, {"blocks.9.attn": [0.0, 1.0, 1.0, 1.0]}):
            other(x)
    with pytest.raises(ValueError, match=r"VisionTransformer: no module called torch.nn.functional.scaled_dot_product_"
                                         r"attention inside the block.*cannot record its heads"):
        with multihead.capture(_timm("vit")[0]):
            model(x)  # another model: nothing of the captured one runs
    seen_only = _timm("vit")[0]
    with torch.no_grad(), multihead.capture(seen_only):
        seen_only(x)
    with pytest.raises(ValueError, match=r"seen on a call, without a probe: heads.observe\(model, example\)"):
        heads.prune(seen_only, {"blocks.0.attn": [0]})
    heads.observe(seen_only, x)  # the probe derives the layout of modules seen on a call
    heads.prune(seen_only, {"blocks.0.attn": [0]})
    assert seen_only.blocks[0].attn.num_heads == 3


def test_what_runs_outside_python_is_refused_naming_the_module():
    scripted = torch.jit.script(nn.TransformerEncoderLayer(8, 2, 16, batch_first=True).eval())
    model = nn.Sequential(nn.Linear(8, 8), scripted).eval()
    with pytest.raises(ValueError, match=r"1 \(TransformerEncoderLayer, TorchScript\).*attention computed in "
                                         r"TorchScript"):
        heads.observe(model, torch.randn(1, 3, 8))
    with pytest.raises(ValueError, match=r"attention computed in TorchScript.* cannot see its heads"):
        with multihead.capture(model):
            pass

    class Fused(nn.Module):  # the whole attention in one C++ kernel, called from Python
        def __init__(self):
            super().__init__()
            self.mha = nn.MultiheadAttention(8, 2, batch_first=True)

        def forward(self, x):
            m = self.mha
            return torch._native_multi_head_attention(x, x, x, 8, 2, m.in_proj_weight, m.in_proj_bias,
                                                      m.out_proj.weight, m.out_proj.bias, need_weights=False)[0]

    with pytest.raises(ValueError, match=r"0 \(Fused\) calls torch._native_multi_head_attention"):
        heads.observe(nn.Sequential(Fused()).eval(), torch.randn(1, 3, 8))


def _mha_weights(model: nn.Module, x, call) -> dict[str, torch.Tensor]:
    """torch.nn.MultiheadAttention's own weights (need_weights=True, per head) on each module's recorded input."""
    inputs, got = {}, {}
    hs = [m.register_forward_pre_hook(lambda mod, a, kw, n=n: inputs.__setitem__(n, (a, kw)), with_kwargs=True)
          for n, m in model.named_modules() if isinstance(m, nn.MultiheadAttention)]
    with torch.no_grad():
        call(model, x)
    for h in hs:
        h.remove()
    for n, (a, kw) in inputs.items():
        kw = {**kw, "need_weights": True, "average_attn_weights": False}
        with torch.no_grad():
            got[n] = model.get_submodule(n)(*a, **kw)[1]  # (B, H, Lq, Lk)
    return got


def _torchvision_vit(seed: int = 0) -> nn.Module:
    from torchvision.models import VisionTransformer

    torch.manual_seed(seed)
    model = VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=4, hidden_dim=48, mlp_dim=96,
                              num_classes=5).eval()
    nn.init.normal_(model.heads.head.weight)  # torchvision starts its classifier at zero: every output would be 0
    return model


def _clip():
    torch.manual_seed(0)
    return open_clip.model.CLIP(embed_dim=16, vision_cfg=open_clip.model.CLIPVisionCfg(
        layers=2, width=48, head_width=12, image_size=32, patch_size=8), text_cfg=open_clip.model.CLIPTextCfg(
        context_length=8, vocab_size=50, width=32, heads=4, layers=2)).eval()


@pytest.mark.parametrize("kind", ["torchvision-vit", "open_clip"])
def test_torch_nn_attention_of_torchvision_and_open_clip_seen_and_cut(kind):
    if kind == "torchvision-vit":
        model = _torchvision_vit()
        x, fresh = torch.randn(2, 3, 32, 32), torch.randn(3, 3, 32, 32)

        def call(m, inp):
            return m(inp)
    else:
        model = _clip()
        x = (torch.randn(2, 3, 32, 32), torch.randint(1, 50, (2, 8)))
        fresh = (torch.randn(3, 3, 32, 32), torch.randint(1, 50, (3, 8)))

        def call(m, inp):
            return torch.cat([m.encode_image(inp[0]), m.encode_text(inp[1])])
    want = _mha_weights(model, x, call)
    found = heads.observe(model, x)
    assert set(found) == set(want) and all(m.attention_hooks.layout_reason is None for m in found.values())
    with torch.no_grad(), multihead.capture(model) as cap:
        call(model, x)
    for name in want:  # the causal text tower included
        assert (cap[name] - want[name]).abs().max() < 1e-5, name
    if kind == "open_clip":  # seen on the user's own call of one tower, without a probe
        fresh_clip = _clip()
        with torch.no_grad(), multihead.capture(fresh_clip) as tower:
            fresh_clip.encode_image(x[0])
        assert set(tower) == {n for n in want if n.startswith("visual.")} and tower
        for name in tower:
            assert (tower[name] - want[name]).abs().max() < 1e-5, name
    cut = {n: [0, 2] for n in found}
    with torch.no_grad():
        full = call(model, fresh)
        with heads.gated(model, {n: [0.0, 1.0, 0.0] + [1.0] * (m.num_heads - 3) for n, m in found.items()}):
            gated = call(model, fresh)
    heads.prune(model, cut)
    with torch.no_grad():
        pruned = call(model, fresh)
    assert (gated - full).abs().max() > 1e-4 and (pruned - gated).abs().max() < 1e-5
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    again = _torchvision_vit(seed=7) if kind == "torchvision-vit" else _clip()
    heads.observe(again, x)
    heads.prune(again, cut)
    again.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
    with torch.no_grad():
        assert torch.equal(call(again, fresh), pruned)


def test_viz_draws_a_timm_checkpoint_on_a_picture_with_patches_labelled(tmp_path):
    """`multihead viz --timm NAME --checkpoint FILE --image FILE`: the model from a safetensors file, seen on its
    own call; the explorer labels the keys [CLS], [DIST] and (row, col); the rollout is drawn over the picture;
    what the command writes loads back; an image off the patch grid is refused with both sizes."""
    from PIL import Image
    from safetensors.torch import save_file

    from multihead import viz
    from multihead.apps.viz import vision
    from multihead_cli import main

    args = {"img_size": 32, "patch_size": 8, "embed_dim": 36, "depth": 2, "num_heads": 3, "num_classes": 7}
    torch.manual_seed(0)
    model = timm.create_model("deit_tiny_distilled_patch16_224", pretrained=False, **args).eval()
    ckpt = tmp_path / "deit.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(ckpt))
    picture = (torch.rand(32, 32, 3) * 255).to(torch.uint8).numpy()
    Image.fromarray(picture).save(tmp_path / "pic.png")
    out = tmp_path / "viz"
    margs = json.dumps({k: v for k, v in args.items() if k != "num_classes"})  # the classifier's size: from the file
    assert main(["viz", "--timm", "deit_tiny_distilled_patch16_224", "--checkpoint", str(ckpt), "--model-args", margs,
                 "--image", str(tmp_path / "pic.png"), "--out", str(out)]) == 0
    for f in ("heads.png", "cls_attention.png", "rollout.png", "attention.html"):
        assert (out / f).stat().st_size > 1000, f
    meta = json.loads((out / "vision.json").read_text())
    lay = viz.vision_layout(model)
    assert meta["grid"] == [4, 4] and meta["prefix"] == ["[CLS]", "[DIST]"] == list(lay.prefix)
    assert lay.tokens[:4] == ["[CLS]", "[DIST]", "(0, 0)", "(0, 1)"] and lay.tokens[-1] == "(3, 3)"
    x, _ = viz.load_image(tmp_path / "pic.png", model)
    with torch.no_grad():
        assert meta["top_class"] == int(model(x).argmax())  # the checkpoint's model, on the same normalised picture
    page = (out / "attention.html").read_text()
    assert '"(3, 3)"' in page and '"[DIST]"' in page and '"grid":[4,4]' in page and '"prefix":2' in page
    Image.fromarray(picture[:30]).save(tmp_path / "small.png")
    with pytest.raises(ValueError, match=r"small.png is 32x30 pixels; the model takes 32x32 \(4x4 patches of 8x8\)"):
        vision.draw(model, tmp_path / "small.png", out)
    assert main(["viz", "--torchvision", "vit_b_16", "--image", str(tmp_path / "small.png"), "--out", str(out)]) == 2
    with pytest.raises(ValueError, match=r"give a .safetensors file \(multihead never unpickles"):
        vision.load_model("timm", "vit_small_patch16_224", tmp_path / "model.pt")
    swin, side = _timm("swin")  # timm's Swin computes by hand unless its fused path is chosen: a form observe gives
    with pytest.raises(ValueError, match=r"WindowAttention compute attention by hand: heads.observe\(model, example\) "
                                         r"gives them their SDPA form"):
        vision.draw(swin, torch.rand(side, side, 3).numpy(), out)
    heads.observe(swin, torch.randn(1, 3, side, side))
    with pytest.raises(ValueError, match=r"layers.0.blocks.0.attn: its weights have 49 keys; .* 14x14 patches "
                                         r"\(196\): attention over windows \(Swin\)"):
        vision.draw(swin, torch.rand(side, side, 3).numpy(), out)


def test_path_patching_reaches_timm_heads_through_their_sdpa_call():
    """heads.path_patch on a model seen through its SDPA calls (the input transform sets a receiver's q/k/v before
    the observed call): a layer-0 head moves the metric through layer 1's keys; layer 1's own heads, after their
    receivers' inputs are computed, move nothing."""
    model, side = _timm("vit")
    heads.observe(model, torch.randn(1, 3, side, side))
    g = torch.Generator().manual_seed(3)
    clean = torch.randn(2, 3, side, side, generator=g)
    corrupted = clean + 0.5 * torch.randn(2, 3, side, side, generator=g)
    r = heads.path_patch(model, clean, corrupted, lambda out: out[:, 0] - out[:, 1], {"blocks.1.attn": [0, 2]},
                         through="k", chunk=3)
    assert (r.values["blocks.0.attn"] - r.base).abs().max() > 1e-4
    assert torch.allclose(r.values["blocks.1.attn"], torch.full((4,), r.base, dtype=torch.float64), atol=1e-6)


def test_path_patching_through_shared_keys_is_refused():
    """A receiver's key or value in a GQA module is its group's: path patching through them is refused by name."""
    cfg = pytest.importorskip("transformers").LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64,
                                                           num_hidden_layers=2, num_attention_heads=4,
                                                           num_key_value_heads=2)
    import transformers

    import multihead.hf as mhf

    torch.manual_seed(0)
    model = mhf.attach(transformers.LlamaForCausalLM(cfg).eval())
    ids = torch.randint(0, 40, (2, 6))
    other = ids.clone()
    other[:, 1] = (other[:, 1] + 7) % 40
    name = "model.layers.1.self_attn"
    with pytest.raises(ValueError, match=r"model.layers.1.self_attn: its 4 query heads share 2 key/value heads \(GQA\)"):
        heads.path_patch(model, {"input_ids": ids}, {"input_ids": other}, lambda out: out.logits[:, -1, 0],
                         {name: [1]}, through="k")
    r = heads.path_patch(model, {"input_ids": ids}, {"input_ids": other}, lambda out: out.logits[:, -1, 0], {name: [1]},
                         through="q")
    assert (r.values["model.layers.0.self_attn"] - r.base).abs().max() > 0
