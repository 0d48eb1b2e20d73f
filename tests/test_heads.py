"""Head gates, importance and physical pruning."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from multihead import MultiHeadAttention, heads, masks
from multihead.compat import TorchMultiheadAttention
from multihead.models import checkpoint


class Stack(nn.Module):
    def __init__(self, kv=None):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(
            [MultiHeadAttention(24, 6, bias=True, num_kv_heads=kv, query_size=24, key_size=24, value_size=24)
             for _ in range(2)])

    def forward(self, x, lens=None):
        for m in self.layers:
            x = x + m(x, valid_lens=lens)
        return x


def loss_fn(model, batch):
    x, lens, target = batch
    return ((model(x, lens) - target) ** 2).mean()


def batches(n=3):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 7, 24, generator=g), torch.tensor([7, 5, 3, 1]), torch.randn(4, 7, 24, generator=g))
            for _ in range(n)]


def test_gates_scale_head_outputs_and_leave_no_trace():
    model = Stack().eval()
    x = torch.randn(2, 5, 24)
    base = model(x)
    with heads.gated(model) as g:
        assert set(g) == {"layers.0", "layers.1"} and g["layers.0"].shape == (6,)
        assert torch.allclose(model(x), base, atol=1e-6)
    assert all(not m.attention_hooks for m in model.layers)  # no hook left behind
    # gating a head to 0 equals removing its slice of the output projection by hand
    m = model.layers[0]
    vals = torch.ones(6)
    vals[2] = 0
    with heads.gated(m, {"": vals}):
        gated = m(x)
    w = m.o_proj.weight.detach().clone()
    with torch.no_grad():
        m.o_proj.weight[:, 2 * 4:3 * 4] = 0
    assert torch.allclose(m(x), gated, atol=1e-6)
    with torch.no_grad():
        m.o_proj.weight.copy_(w)
    with pytest.raises(ValueError, match=r"gates for layers.0 must have shape \(6,\)"):
        with heads.gated(model, {"layers.0": torch.ones(3)}):
            pass
    # a bad gate in a later module left the earlier modules' gates on for good: all are checked first now
    with pytest.raises(ValueError, match=r"gates for layers.1 must have shape \(6,\)"):
        with heads.gated(model, {"layers.0": torch.zeros(6), "layers.1": torch.ones(2)}):
            pass
    assert all(not m.attention_hooks for m in model.layers) and torch.equal(model(x), base)
    with pytest.raises(ValueError, match=r"gates for layers.0 must be finite; got \[nan, 1.0"):
        with heads.gated(model, {"layers.0": torch.tensor([float("nan")] + [1.0] * 5)}):
            pass
    with pytest.raises(TypeError, match=r"gates for layers.0 must be a tensor or a list of 6 numbers; got 'off'"):
        with heads.gated(model, {"layers.0": "off"}):
            pass
    with heads.gated(model, {"layers.0": [1, 1, 0, 1, 1, 1]}) as g:  # a list of numbers is a gate tensor
        assert torch.equal(g["layers.0"], vals) and torch.allclose(model.layers[0](x), gated, atol=1e-6)


@pytest.mark.parametrize("method", ["gradient", "ablation", "entropy"])
def test_importance_methods(method):
    model = Stack()
    imp = heads.importance(model, batches(), loss_fn, method, progress=False)
    assert imp.names == ["layers.0", "layers.1"] and imp.table().shape == (2, 6)
    assert torch.isfinite(imp.table()).all()
    assert len(imp.order()) == 12 and "| layers.0 |" in imp.to_markdown()
    if method == "gradient":  # normalized per layer (Michel et al.)
        assert torch.allclose(imp.table().norm(dim=1), torch.ones(2), atol=1e-5)
        # and equal to the mean |dL/dgate| computed by hand
        with heads.gated(model, requires_grad=True) as g:
            acc = torch.zeros(6)
            for b in batches():
                acc += torch.autograd.grad(loss_fn(model, b), g["layers.1"])[0].abs()
        assert torch.allclose(imp.raw[1], acc / 3, atol=1e-6)
    if method == "ablation":  # the loss change when that head alone is off
        vals = torch.ones(6)
        vals[4] = 0
        with torch.no_grad():
            base = sum(float(loss_fn(model, b)) for b in batches()) / 3
            with heads.gated(model, {"layers.0": vals}):
                off = sum(float(loss_fn(model, b)) for b in batches()) / 3
        assert abs(float(imp.scores[0][4]) - (off - base)) < 1e-6
    if method == "entropy":
        assert (imp.table() <= 0).all() and (torch.stack(imp.raw) <= torch.log(torch.tensor(7.0)) + 1e-5).all()


#: an even cut per key/value layout of Stack's 6 query heads: whole groups in layer 0, one head of every group in 1
EVEN = {None: {"layers.0": [0, 1, 2], "layers.1": [5]}, 1: {"layers.0": [0, 1, 2], "layers.1": [5]},
        2: {"layers.0": [0, 1, 2], "layers.1": [2, 5]}, 3: {"layers.0": [0, 1], "layers.1": [1, 3, 5]}}


@pytest.mark.parametrize("kv", [None, 3, 2, 1])
def test_pruned_equals_gated(kv):
    model = Stack(kv).eval()
    x, lens = torch.randn(3, 7, 24), torch.tensor([7, 4, 2])
    remove = EVEN[kv]
    gates = {}
    for n, hs in remove.items():
        g = torch.ones(6)
        g[hs] = 0
        gates[n] = g
    with heads.gated(model, gates):
        expected = model(x, lens)
    kept = heads.prune(model, remove)
    assert kept == {n: [h for h in range(6) if h not in hs] for n, hs in remove.items()}
    H0 = 6 - len(remove["layers.0"])
    assert model.layers[0].num_heads == H0 and model.layers[0].q_proj.out_features == H0 * 4
    assert model.layers[0].o_proj.in_features == H0 * 4
    if kv == 3:  # groups of 2: kv 0's group gone in layer 0; one head of every group in layer 1 keeps all three
        assert (model.layers[0].num_kv_heads, model.layers[1].num_kv_heads) == (2, 3)
        assert model.layers[0].k_proj.out_features == 2 * 4
    if kv == 2:  # groups of 3: heads 0,1,2 are kv head 0's group: it goes
        assert model.layers[0].num_kv_heads == 1 and model.layers[0].k_proj.out_features == 4
        assert model.layers[1].num_kv_heads == 2 and model.layers[1].num_heads == 4
    assert torch.allclose(model(x, lens), expected, atol=1e-5)


@pytest.mark.parametrize("kv, remove", [(3, [0, 1, 2]), (2, [5]), (3, [0])])
def test_a_cut_leaving_key_value_groups_uneven_is_refused_and_nothing_grows(kv, remove):
    """A cut that would leave some key/value heads serving more query heads than others is refused before any
    weight moves (the copies it once made grew the key/value projections and the KV cache), naming the groups and
    an even cut; the model is left as it was, and the even cut the message names is accepted and shrinks k/v."""
    model = Stack(kv).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"leaves the key/value groups uneven .*Cut whole groups") as e:
        heads.prune(model, {"layers.0": remove, "layers.1": [0, 1] if kv == 3 else [0, 1, 2]})
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    even = [int(h) for h in str(e.value).split("e.g. heads ")[1].rstrip(".").strip("[]").split(", ")]
    heads.prune(model, {"layers.0": even})
    assert model.layers[0].num_heads == 6 - len(even)
    assert model.layers[0].k_proj.out_features <= 4 * kv and model.layers[0].num_kv_heads <= kv


def test_prune_every_head_of_a_layer_and_round_trip(tmp_path):
    model = Stack().eval()
    x = torch.randn(2, 5, 24)
    g = torch.zeros(6)
    with heads.gated(model, {"layers.1": g}):
        expected = model(x)
    heads.prune(model, {"layers.1": range(6)})
    assert model.layers[1].num_heads == 0
    assert torch.allclose(model(x), expected, atol=1e-5)
    # a pruned model saves (safetensors) and rebuilds itself from its config
    from dataclasses import dataclass

    @dataclass
    class Cfg:
        kv: int | None = None

    class Saved(Stack):
        def __init__(self, cfg):
            super().__init__(cfg.kv)
            self.config = cfg

    m = Saved(Cfg()).eval()
    heads.prune(m, {"layers.0": [1, 3], "layers.1": range(6)})
    checkpoint.save(m, tmp_path)
    again = checkpoint.load(Saved, Cfg, tmp_path)
    assert again.layers[0].num_heads == 4 and again.layers[1].num_heads == 0
    assert torch.equal(again(x), m(x))


def test_mean_replacement_folds_into_the_bias():
    model = Stack().eval()
    bs = batches()
    means = heads.mean_head_outputs(model, bs, loss_fn)
    assert means["layers.0"].shape == (6, 4)
    m = model.layers[0]
    x = torch.randn(2, 5, 24)
    # expected: head 2's output replaced by its mean = gate it off and add W_o[:, head 2] @ mean to the output
    g = torch.ones(6)
    g[2] = 0
    with heads.gated(m, {"": g}):
        expected = m(x) + m.o_proj.weight[:, 8:12] @ means["layers.0"][2]
    heads.prune(model, {"layers.0": [2]}, mean_outputs=means)
    assert torch.allclose(model.layers[0](x), expected.detach(), atol=1e-5)


def test_prune_errors():
    model = Stack()
    with pytest.raises(ValueError, match=r"no multihead attention module named 'nope'"):
        heads.prune(model, {"nope": [0]})
    with pytest.raises(ValueError, match=r"heads \[9\] do not exist: the module has num_heads=6"):
        heads.prune(model, {"layers.0": [9]})
    # head numbers are whole numbers, never guessed: 1.5 and True were head 1, "12" heads 1 and 2
    for bad, says in ((1.5, r"whole head numbers; got 1.5 \(float\)"), (True, r"got True \(bool\)"),
                      (torch.tensor(True), r"got tensor\(True\)")):
        with pytest.raises(TypeError, match=says):
            heads.prune(model, {"layers.0": [bad]})
    for bad in ("12", 1):
        with pytest.raises(TypeError, match=r"must be a list of head numbers, e.g. \[0, 3\]"):
            heads.prune(model, {"layers.0": bad})
    H = [m.num_heads for m in model.layers]
    with pytest.raises(ValueError, match=r"layers.1: heads \[9\] do not exist"):  # checked before anything is cut
        heads.prune(model, {"layers.0": [0], "layers.1": [9]})
    assert [m.num_heads for m in model.layers] == H
    assert heads.prune(model, {"layers.0": torch.tensor([1, 1, 2])}) == {"layers.0": [0, 3, 4, 5]}  # tensor items
    lazy = nn.ModuleDict({"a": MultiHeadAttention(16, 4)})  # LazyLinear, not called yet
    with pytest.raises(ValueError, match=r"a has parameters not built yet \(nn.LazyLinear\): call the model once"):
        heads.prune(lazy, {"a": [0]})
    wrapper = nn.Sequential(TorchMultiheadAttention(8, 2, batch_first=True).eval())  # the drop-in is cut too
    x = torch.randn(2, 3, 8)
    with torch.no_grad(), heads.gated(wrapper, {"0": torch.tensor([0.0, 1.0])}):
        want = wrapper[0](x, x, x)[0]
    assert heads.prune(wrapper, {"0": [0]}) == {"0": [1]}
    assert type(wrapper[0]).__name__ == "PrunedMultiheadAttention" and wrapper[0].in_proj_weight.shape == (12, 8)
    with torch.no_grad():
        assert torch.allclose(wrapper[0](x, x, x)[0], want, atol=1e-6)
    with pytest.raises(ValueError, match="method must be"):
        heads.importance(model, batches(), loss_fn, "random")


@pytest.mark.parametrize("method", ["gradient", "ablation", "entropy"])
def test_each_importance_method_is_its_own_function_with_one_result_type(method):
    model = Stack()
    via_name = heads.importance(model, batches(), loss_fn, method, progress=False)
    own = heads.METHODS[method](model, batches(), loss_fn, progress=False)
    assert type(own) is heads.Importance and own.method == method and own.names == via_name.names
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(own.scores, via_name.scores))
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(own.raw, via_name.raw))
    others = {"gradient": {"fill": {"layers.0": torch.zeros(6, 4)}}, "ablation": {"normalize": False},
              "entropy": {"normalize": False}}[method]
    (option, value), = others.items()
    with pytest.raises(ValueError, match=rf"{option}= is an option of method='(ablation|gradient)'.*got method='{method}'"):
        heads.importance(model, batches(), loss_fn, method, progress=False, **{option: value})
    with pytest.raises(ValueError, match="importance needs at least one batch"):
        heads.METHODS[method](model, [], loss_fn, progress=False)


def test_varlen_path_is_gated_too():
    mha = MultiHeadAttention(768, 12, query_size=768, key_size=768, value_size=768).eval()
    x = torch.randn(2, 300, 768)
    mask = masks.Padding(torch.tensor([300, 100]))
    assert str(mha.explain(x, mask=mask)).startswith("path: packed")
    g = torch.ones(12)
    g[[0, 5]] = 0
    with torch.no_grad(), heads.gated(mha, {"": g}):
        expected = mha(x, mask=mask)
    heads.prune(mha, {"": [0, 5]})
    with torch.no_grad():
        assert torch.allclose(mha(x, mask=mask), expected, atol=1e-5)


def test_gates_follow_the_output_to_its_device():
    """Gates and fills made on the CPU act on a model elsewhere (here the meta device, standing in
    for CUDA on this machine): they are moved to the output's device, as the README's call needs."""
    m = MultiHeadAttention(16, 4, query_size=16, key_size=16, value_size=16).to("meta")
    x = torch.randn(2, 5, 16, device="meta")
    with heads.gated(m, {"": torch.tensor([1.0, 0.0, 1.0, 0.5])}, fill={"": torch.zeros(4, 4)}):
        out = m(x)
    assert out.device.type == "meta" and out.shape == (2, 5, 16)


@pytest.mark.parametrize("reestimate", [True, False])
def test_the_curve_starts_from_a_known_importance_instead_of_estimating_it_again(reestimate, monkeypatch):
    from multihead.heads import pruning as pr

    def metric(m):
        with torch.no_grad():
            return -float(sum(loss_fn(m, b) for b in batches()))

    def curve(**kw):
        torch.manual_seed(0)
        return heads.pruning_curve(Stack(), batches(), loss_fn, metric, step=0.25, max_fraction=0.5,
                                   reestimate=reestimate, progress=False, **kw)

    calls = []
    real = pr.importance
    monkeypatch.setattr(pr, "importance", lambda *a, **k: calls.append(1) or real(*a, **k))
    plain = curve()
    n_plain = len(calls)
    torch.manual_seed(0)
    known = heads.importance(Stack(), batches(), loss_fn, "ablation", progress=False)
    calls.clear()
    given = curve(initial=known)
    assert [r["removed"] for r in given] == [r["removed"] for r in plain]
    assert [r["metric"] for r in given] == [r["metric"] for r in plain]
    assert len(calls) == n_plain - 1 == (1 if reestimate else 0)
