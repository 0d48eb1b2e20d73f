"""Every cut is verified where it is made: heads.prune runs each module's recorded call gated and cut, and refuses
(undoing every module it cut) a cut that does not give the gated outputs. Walked over every transformers family
with a head layout: one head of every key/value group cut (the key/value heads stay, each serving one query head
fewer), and a whole group (one head where every query head has its own key/value head); with random weights in every
per-head norm (StableLM's per-head q/k layer norms were cut to the wrong heads, or not at all: its next call raised)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
import transformers as T  # noqa: E402

import multihead.hf as mhf  # noqa: E402
from multihead import heads  # noqa: E402
from test_hf import FAMILIES as ENCODERS  # noqa: E402
from test_hf_families import FAMILIES as DECODERS  # noqa: E402
from test_hf_families import SMALL, _lm, _out, _real  # noqa: E402

MORE = {
    # per-head layer norms on queries (4) and keys (2): a list of one LayerNorm per head
    "stablelm": (lambda: T.StableLmForCausalLM(T.StableLmConfig(qk_layernorm=True, num_key_value_heads=2, **SMALL)),
                 _lm()),
    "phi": (lambda: T.PhiForCausalLM(T.PhiConfig(qk_layernorm=True, num_key_value_heads=2, **SMALL)), _lm()),
    "llama_gqa": (lambda: T.LlamaForCausalLM(T.LlamaConfig(num_key_value_heads=2, **SMALL)), _lm()),
}
#: families whose cut cannot be exact, refused at prune time with the reason
REFUSED = {"phi3": "its forward fails once heads",  # reads its head counts from the config
           "olmo2": "its forward fails once heads",  # one RMSNorm over every head's queries together
           "cohere": "its forward fails once heads"}
MORE_REFUSED = {
    "olmo2": (lambda: T.Olmo2ForCausalLM(T.Olmo2Config(num_key_value_heads=2, **SMALL)), _lm()),
    "cohere": (lambda: T.CohereForCausalLM(T.CohereConfig(use_qk_norm=True, num_key_value_heads=2, **SMALL)), _lm()),
}
ALL = {**ENCODERS, **DECODERS, **MORE}


def _build(table, family):
    make, inputs = table[family]
    torch.manual_seed(0)
    model = make().eval()
    with torch.no_grad():  # random norms: a norm cut to the wrong head shows (fresh ones are all ones)
        for name, p in model.named_parameters():
            if "norm" in name and p.dim() == 1:
                p.uniform_(0.5, 1.5)
    return model, inputs()


@pytest.mark.parametrize("family", [f for f in ALL if f not in REFUSED])
def test_every_cut_of_every_family_equals_gating(family):
    """One head of every group, a whole group: pruned == gated on real tokens, in each family."""
    model, x = _build(ALL, family)
    mhf.attach(model)
    mods = mhf.attention_modules(model)
    assert all(m.attention_hooks.layout is not None for m in mods.values()), mhf.derive(model)
    real = _real(x)
    names = list(mods)
    last = names[-1]
    H = mods[last].attention_hooks.num_heads
    Hkv = mods[last].attention_hooks.layout.counts(mods[last], mods[last].attention_hooks.parent)[1]
    G = H // Hkv
    cuts = {"one head of every group": list(range(G - 1, H, G)), "a whole group": list(range(G))}
    if G == 1:
        cuts["one head"] = [H - 1]
    for what, remove in cuts.items():
        work, _ = _build(ALL, family)
        mhf.attach(work)
        gates = {last: torch.ones(H).index_fill(0, torch.tensor(remove), 0.0)}
        with heads.gated(work, gates):
            gated = _out(work, x)
        heads.prune(work, {last: remove})
        pruned = _out(work, x)
        err = ((pruned - gated)[real] if real is not None else pruned - gated).abs().max()
        assert err < 1e-4, (family, what, float(err))


@pytest.mark.parametrize("family", list(MORE_REFUSED))
def test_families_whose_cut_cannot_be_exact_are_refused_and_left_unchanged(family):
    model, x = _build(MORE_REFUSED, family)
    mhf.attach(model)
    before = _out(model, x)
    name = next(iter(mhf.attention_modules(model)))
    with pytest.raises(ValueError, match=rf"{name} \(\w+\) can be seen and gated, but multihead has no head layout "
                                         rf"for it .*{REFUSED[family]}"):
        heads.prune(model, {name: [0]})
    assert torch.equal(_out(model, x), before)


def test_a_cut_that_does_not_verify_is_refused_and_every_module_restored():
    """A layout that cuts the wrong heads (the failure verification exists for: shapes right, rows wrong): prune
    refuses naming the module and how far the cut is from the gated module, and the module cut before it in the same
    call is restored as it was."""
    model, x = _build(ENCODERS, "roberta")
    mhf.attach(model)
    mods = mhf.attention_modules(model)
    first, last = list(mods)[0], list(mods)[-1]
    before = _out(model, x)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    lay = mods[last].attention_hooks.layout

    class Shifted(type(lay)):  # keeps the head after each one asked for
        def prune(self, m, keep, kv, mean_out=None, gone=None):
            super().prune(m, [(h + 1) % 4 for h in keep], [(h + 1) % 4 for h in kv], mean_out, gone)

    mods[last].attention_hooks.layout = Shifted(**vars(lay))
    with pytest.raises(ValueError, match=rf"{last} \(RobertaSelfAttention\): cutting heads \[1\] does not give the "
                                         r"gated module's outputs on its recorded call \(max \|cut - gated\| = .*"
                                         r"nothing was cut"):
        heads.prune(model, {first: [0], last: [1]})
    mods[last].attention_hooks.layout = lay
    assert {n: tuple(p.shape) for n, p in model.named_parameters()} == shapes
    assert mods[first].attention_hooks.num_heads == 4 and mods[first].attention_hooks.kept is None
    assert torch.equal(_out(model, x), before)
    heads.prune(model, {first: [0], last: [1]})  # the right layout cuts as before
    assert mods[first].attention_hooks.num_heads == 3
