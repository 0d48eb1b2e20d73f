"""Feed-forward neurons scored and cut like heads (multihead.heads.neurons): blocks found by shape in other
families' layers (BERT's intermediate/output, Llama's gated MLP), every cut verified against the gated model, a
block whose neurons something mixes refused and left whole, and a transformers model cut, saved and loaded back
(by multihead and by transformers itself, its config saying the new width)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from multihead import heads
from multihead.heads import neurons

transformers = pytest.importorskip("transformers")
import multihead.hf as mhf  # noqa: E402

T = transformers


def _batches(vocab: int, n: int = 3):
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        ids = torch.randint(3, vocab, (2, 7 + i), generator=g)  # (B, L)
        am = torch.ones_like(ids)
        am[1, 4:] = 0
        out.append({"input_ids": ids, "attention_mask": am})
    return out


def _run(m, b):
    return m(**b)


def _bert(packed=False):
    torch.manual_seed(0)
    cfg = T.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                       intermediate_size=48)
    return mhf.attach(T.BertModel(cfg).eval(), packed=packed)


def test_blocks_are_found_by_shape_in_other_families():
    assert heads.ffn_blocks(_bert()) == [neurons.FfnBlock(("encoder.layer.0.intermediate.dense",),
                                                          "encoder.layer.0.output.dense", 48),
                                         neurons.FfnBlock(("encoder.layer.1.intermediate.dense",),
                                                          "encoder.layer.1.output.dense", 48)]
    llama = mhf.attach(T.LlamaModel(T.LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=40,
                                                  num_hidden_layers=1, num_attention_heads=4,
                                                  num_key_value_heads=2)).eval())
    (block,) = heads.ffn_blocks(llama)  # the gated MLP: down reads act(gate(x)) * up(x); attention excluded
    assert block.down == "layers.0.mlp.down_proj" and set(block.up) == {"layers.0.mlp.gate_proj",
                                                                          "layers.0.mlp.up_proj"}


def _llama():
    torch.manual_seed(0)
    return mhf.attach(T.LlamaModel(T.LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=40,
                                                 num_hidden_layers=2, num_attention_heads=4,
                                                 num_key_value_heads=2)).eval())


BUILD = {"bert": _bert, "bert-padding-free": lambda: _bert(packed=True), "llama": _llama}


@pytest.mark.parametrize("family", list(BUILD))
@pytest.mark.parametrize("mean_replacement", [True, False])
def test_a_cut_equals_the_gated_model_and_keeps_the_most_important(family, mean_replacement):
    model, fresh = BUILD[family](), BUILD[family]()  # the same seed: the same weights, one kept whole
    batches = _batches(100)
    blocks = heads.ffn_blocks(model)
    stats = neurons.neuron_stats(model, blocks, batches, _run)
    scores = neurons.neuron_scores(model, stats, mean_replacement=mean_replacement)
    kept = heads.prune_neurons(model, 0.25, batches, _run, lambda m: m(**batches[0]),
                               mean_replacement=mean_replacement)
    for b in blocks:
        k = kept[b.down]
        assert len(k) == round(b.width * 0.75) and model.get_submodule(b.down).weight.shape[1] == len(k)
        assert all(model.get_submodule(u).weight.shape[0] == len(k) for u in b.up)
        dropped = sorted(set(range(b.width)) - set(k))
        assert scores[b.down][dropped].max() <= scores[b.down][k].min()  # the least important went
    hooks = [fresh.get_submodule(b.down).register_forward_pre_hook(neurons._gate_hook(
        kept[b.down], b.width, stats[b.down][0].float() if mean_replacement else None)) for b in blocks]
    with torch.no_grad():  # the gated whole model on batches the cut's verification never saw
        for b in batches[1:]:
            real = b["attention_mask"].bool()  # (B, L): padding rows differ between padded and padding-free
            got, gated = model(**b).last_hidden_state[real], fresh(**b).last_hidden_state[real]
            assert (got - gated).abs().max() < 1e-4
            for h in hooks:
                h.remove()
            assert (got - fresh(**b).last_hidden_state[real]).abs().max() > 1e-3  # something was cut
            hooks = [fresh.get_submodule(x.down).register_forward_pre_hook(neurons._gate_hook(
                kept[x.down], x.width, stats[x.down][0].float() if mean_replacement else None)) for x in blocks]


class _Mixed(nn.Module):
    """A block whose neurons a LayerNorm over all of them mixes: cutting is not gating."""

    def __init__(self):
        super().__init__()
        self.up, self.norm, self.down = nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 8)

    def forward(self, x):
        return self.down(torch.relu(self.norm(self.up(x))))


def test_a_block_whose_neurons_are_mixed_is_refused_and_left_whole():
    torch.manual_seed(0)
    m = _Mixed()
    x = torch.randn(4, 8)
    before = m(x).detach()
    (block,) = heads.ffn_blocks(m)
    with pytest.raises(ValueError, match=r"cut_neurons: cutting the neurons of \['down'\] does not equal gating them "
                                         r"\(the cut model fails: RuntimeError: Given normalized_shape=\[16\].*nothing was cut"):
        neurons.cut_neurons(m, {"down": list(range(8))}, lambda mod: mod(x), blocks=[block])
    assert m.up.weight.shape == (16, 8) and torch.equal(m(x), before)
    with pytest.raises(ValueError, match=r"keep\['down'\] must be distinct indices in \[0, 16\) and at least one"):
        neurons.cut_neurons(m, {"down": [3, 3]}, lambda mod: mod(x))
    with pytest.raises(ValueError, match=r"\['nope'\] are not feed-forward blocks of _Mixed"):
        neurons.cut_neurons(m, {"nope": [1]}, lambda mod: mod(x))
    with pytest.raises(ValueError, match=r"fraction must be in \(0, 1\); got 1.5"):
        heads.prune_neurons(m, 1.5, [x], lambda mod, b: mod(b), lambda mod: mod(x))


def test_a_cut_model_saves_and_loads_back_in_multihead_and_transformers(tmp_path):
    """Every block cut alike: config.json says the new intermediate_size, so transformers' own from_pretrained
    reads the folder; multihead.hf.load gives the same model (heads pruned too, stored at full size)."""
    model = _bert()
    batches = _batches(100)
    heads.prune(model, {"encoder.layer.0.attention.self": [1]})
    heads.prune_neurons(model, 0.5, batches, _run, lambda m: m(**batches[0]))
    mhf.save(model, tmp_path / "m")
    b = batches[2]
    with torch.no_grad():
        want = model(**b).last_hidden_state
        for loaded in (mhf.load(tmp_path / "m"), T.BertModel.from_pretrained(tmp_path / "m").eval()):
            assert loaded.encoder.layer[1].intermediate.dense.out_features == 24
            assert (loaded(**b).last_hidden_state - want).abs().max() < 1e-5
    written = mhf.export(model, tmp_path / "m")  # and the runtimes get it at its cut size
    import onnx

    dims = [list(i.dims) for i in onnx.load(str(written["onnx"])).graph.initializer]
    assert [32, 24] in dims and not any(48 in d for d in dims)  # the blocks' weights at 24 neurons, none at 48


def test_uneven_widths_are_recorded_and_rebuilt_by_load(tmp_path):
    model = _bert()
    batches = _batches(100)
    blocks = heads.ffn_blocks(model)
    neurons.cut_neurons(model, {blocks[0].down: list(range(0, 48, 2)), blocks[1].down: list(range(40))},
                        lambda m: m(**batches[0]), blocks=blocks)
    mhf.save(model, tmp_path / "u")
    loaded = mhf.load(tmp_path / "u")
    with torch.no_grad():
        assert (loaded(**batches[1]).last_hidden_state - model(**batches[1]).last_hidden_state).abs().max() < 1e-5
    assert [b.width for b in heads.ffn_blocks(loaded)] == [24, 40]
