"""The families people run today, with no per-family entry in multihead: Qwen3, Gemma 2 (softcap),
Gemma 3 (sliding-window layers, q/k norms), gpt-oss (attention sinks, few experts), GPT-NeoX,
Phi-3, ModernBERT (local/global layers), T5 (relative-position bias), SigLIP and CLIP vision.

Each, built from a tiny config here: outputs = transformers' sdpa (eager where transformers' sdpa
refuses the family) within 1e-5 on real tokens; capture = eager's output_attentions within 1e-5 on
real rows; gates act; bad arguments refused. And a walk over every transformers modeling file:
each keyword a family passes to its attention function is computed, declared harmless, or
refused with a reason."""

from __future__ import annotations

import ast
import contextlib
import copy
import functools
import inspect
import io
import re
import tokenize
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

transformers = pytest.importorskip("transformers")
import multihead  # noqa: E402
import multihead.hf as mhf  # noqa: E402
import multihead.hf.attention as mha  # noqa: E402
from multihead import heads  # noqa: E402

warnings.filterwarnings("ignore", message=".*token_id.*")
transformers.logging.set_verbosity_error()
T = transformers
V = 100
SMALL = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
VISION = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=16,
              patch_size=4)


def _ids(B=3, L=9, left=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (B, L), generator=g)
    am = torch.ones(B, L, dtype=torch.long)
    for b, n in enumerate([L, 6, 2][:B]):
        if left:
            am[b, : L - n] = 0
        else:
            am[b, n:] = 0
    return {"input_ids": ids, "attention_mask": am}


def _seq2seq():
    x = _ids()
    x["decoder_input_ids"] = _ids(L=5, seed=1)["input_ids"]
    return x


def _image():
    return {"pixel_values": torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))}


def _lm(left=True):
    return lambda: _ids(left=left)


FAMILIES = {
    "qwen3": (lambda: T.Qwen3ForCausalLM(T.Qwen3Config(num_key_value_heads=2, head_dim=8, **SMALL)), _lm()),
    "gemma2": (lambda: T.Gemma2ForCausalLM(T.Gemma2Config(num_key_value_heads=2, head_dim=8, sliding_window=4,
                                                          **SMALL)), _lm()),
    "gemma3": (lambda: T.Gemma3ForCausalLM(T.Gemma3TextConfig(num_key_value_heads=2, head_dim=8, sliding_window=4,
                                                              **SMALL)), _lm()),
    "gpt_oss": (lambda: T.GptOssForCausalLM(T.GptOssConfig(num_key_value_heads=2, head_dim=8, sliding_window=4,
                                                           num_local_experts=4, num_experts_per_tok=2, **SMALL)),
                _lm()),
    "gpt_neox": (lambda: T.GPTNeoXForCausalLM(T.GPTNeoXConfig(**SMALL)), _lm()),
    "phi3": (lambda: T.Phi3ForCausalLM(T.Phi3Config(num_key_value_heads=2, pad_token_id=0, **SMALL)), _lm()),
    "modernbert": (lambda: T.ModernBertModel(T.ModernBertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=3,
                                                                num_attention_heads=4, intermediate_size=64,
                                                                local_attention=4, global_attn_every_n_layers=2,
                                                                pad_token_id=0)), _lm(left=False)),
    "t5": (lambda: T.T5Model(T.T5Config(vocab_size=V, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)),
           _seq2seq),
    "siglip": (lambda: T.SiglipVisionModel(T.SiglipVisionConfig(**VISION)), _image),
    "clip": (lambda: T.CLIPVisionModel(T.CLIPVisionConfig(**VISION)), _image),
}
#: the families transformers' own sdpa function refuses (softcap, sinks): compared with eager
EAGER_ONLY = {"gemma2", "gpt_oss"}


def _build(family):
    make, inputs = FAMILIES[family]
    torch.manual_seed(0)
    return make().eval(), inputs()


def _out(model, x):
    with torch.no_grad():
        o = model(**x)
    return o.logits if getattr(o, "logits", None) is not None else o.last_hidden_state


def _real(x):
    """(B, L) True on real tokens of the output (every position for images and seq2seq decoders)."""
    if "attention_mask" in x and "decoder_input_ids" not in x:
        return x["attention_mask"].bool()
    return None


def _on_real(t, real):
    return t if real is None else t[real]


def _eager(model, x):
    model.set_attn_implementation("eager")
    with torch.no_grad():
        o = model(**x, output_attentions=True)
    out = o.logits if getattr(o, "logits", None) is not None else o.last_hidden_state
    if getattr(o, "encoder_attentions", None) is not None:  # per decoder layer: self, then cross
        att = list(o.encoder_attentions) + [t for pair in zip(o.decoder_attentions, o.cross_attentions) for t in pair]
    else:
        att = list(o.attentions)
    return out, att


@pytest.mark.parametrize("family", list(FAMILIES))
def test_outputs_capture_and_gates(family):
    model, x = _build(family)
    real = _real(x)
    eager_out, eager_att = _eager(model, x)
    if family in EAGER_ONLY:
        with pytest.raises(ValueError, match="does not support an attention implementation through"):
            model.set_attn_implementation("sdpa")
        want = eager_out
    else:
        model.set_attn_implementation("sdpa")
        want = _out(model, x)
        assert (_on_real(want - eager_out, real)).abs().max() < 1e-5  # eager and sdpa agree here
    mhf.attach(model)
    got = _out(model, x)
    assert torch.isfinite(got).all()
    assert _on_real(got - want, real).abs().max() < 1e-5
    # see: every module that calls the attention interface, found without a table
    with torch.no_grad(), multihead.capture(model) as cap:
        inside = _out(model, x)
    assert torch.equal(inside, got)
    names = list(mhf.attention_modules(model))
    assert list(cap) == names and len(names) == len(eager_att)
    for (name, w), e in zip(cap.items(), eager_att):
        assert w.shape == e.shape, name
        rows = w.sum(-1) > 0  # rows with something to attend to (eager spreads empty rows uniformly)
        assert (w - e).abs()[rows].max() < 1e-5, name
    # gates: all ones change nothing; one head off changes the output by exactly its contribution
    first = names[0]
    H = mhf.attention_modules(model)[first].attention_hooks.num_heads
    with heads.gated(model) as g:
        assert torch.equal(_out(model, x), got) and g[first].shape == (H,)
    with heads.gated(model, {first: torch.ones(H).index_fill(0, torch.tensor([1]), 0.0)}):
        off = _out(model, x)
    assert (off - got).abs().max() > 1e-4


def test_sinks_and_softcap_reach_the_spec():
    """gpt-oss' sinks and Gemma 2's softcap were dropped in round 2 (outputs off by 3.4 and 1.1):
    the recorded weights now carry them (a row sums to less than 1 with a sink)."""
    model, x = _build("gpt_oss")
    mhf.attach(model)
    with torch.no_grad(), multihead.capture(model) as cap:
        _out(model, x)
    w = cap["model.layers.0.self_attn"]
    live = w.sum(-1) > 0
    assert (w.sum(-1)[live] < 1 - 1e-4).all()


@pytest.mark.parametrize("pruned", [False, True], ids=["unpruned", "pruned"])
@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_generate_gives_sdpas_tokens(family, pruned):
    """Greedy decoding with the model's own cache: the same tokens as transformers' sdpa on the same
    weights (pruned: the cut ones)."""
    model, x = _build(family)
    kw = dict(max_new_tokens=8, do_sample=False, use_cache=True, pad_token_id=0)
    mhf.attach(model)
    if pruned:
        heads.prune(model, {"model.layers.0.self_attn": [0, 1], "model.layers.1.self_attn": [1, 3]})  # even groups
    with torch.no_grad():
        got = model.generate(**x, **kw)
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        ref = model.generate(**x, **kw)
    assert torch.equal(got, ref)


def test_inference_mode_and_pickle_of_an_attached_model():
    import pickle

    model, x = _build("qwen3")
    mhf.attach(model)
    want = _out(model, x)
    with torch.inference_mode():
        got = model(**{k: v.clone() for k, v in x.items()}).logits
    real = _real(x)
    assert (got - want)[real].abs().max() < 1e-6
    back = pickle.loads(pickle.dumps(model))
    assert (_out(back, x) - want)[real].abs().max() < 1e-6


def test_every_argument_is_computed_or_refused():
    model, _ = _build("qwen3")
    mhf.attach(model)
    m = model.model.layers[0].self_attn
    q = torch.randn(1, 4, 5, 8)
    kv = torch.randn(1, 2, 5, 8)
    with pytest.raises(TypeError, match=r"Qwen3Attention passes 'alibi_slopes' to its attention function; multihead "
                                        r"does not compute this argument and will not ignore it"):
        mhf.attention_forward(m, q, kv, kv, None, alibi_slopes=torch.ones(4))
    with pytest.raises(TypeError, match=r"passes 'indices' to its attention function \(indices: sparse top-k"):
        mhf.attention_forward(m, q, kv, kv, None, indices=torch.zeros(3))
    with pytest.raises(ValueError, match=r"passes sliding_window=2 with Lk=5 keys but no attention mask"):
        mhf.attention_forward(m, q, kv, kv, None, sliding_window=2)
    # harmless keywords are accepted; packed rows run varlen, each sequence on its own
    out, _ = mhf.attention_forward(m, q, kv, kv, None, position_ids=torch.arange(5)[None], use_cache=True,
                                   cu_seq_lens_q=torch.tensor([0, 2, 5]), cu_seq_lens_k=torch.tensor([0, 2, 5]),
                                   max_length_q=3, max_length_k=3)
    for a, b in ((0, 2), (2, 5)):
        ref = multihead.reference_attention(q[:, :, a:b], kv[:, :, a:b], kv[:, :, a:b],
                                            multihead.masks.Causal())  # (1, H, L, D)
        assert torch.allclose(out[0, a:b], ref[0].transpose(0, 1), atol=1e-5)
    with pytest.raises(ValueError, match=r"max_length_q=4 but the longest sequence in cu_seq_lens_q has 3 tokens"):
        mhf.attention_forward(m, q, kv, kv, None, cu_seq_lens_q=torch.tensor([0, 2, 5]), max_length_q=4)
    with pytest.raises(ValueError, match=r"cu_seq_lens_q\[-1\] = 4 but the packed row holds 5 tokens"):
        mhf.attention_forward(m, q, kv, kv, None, cu_seq_lens_q=torch.tensor([0, 2, 4]))


_CALL = re.compile(r"(?<![\w.])attention_interface\(")  # a call of the name itself (not x.attention_interface)
_TOP = re.compile(r"^(class|def|async def) (\w+)", re.M)  # the file's top-level definitions


def _attention_calls(path: Path):
    """(class name, keywords passed by name) of every call of ``attention_interface`` in a file. Only the calls are
    parsed (each from its name to its closing bracket, found by Python's tokenizer), not the whole file: parsing
    ~360 modeling files took ~17 s of this test, the calls take ~1.4 s, and on transformers 5.23 both give the same
    500 (class, keywords) pairs."""
    text = path.read_text()
    tops = [(m.start(), m.group(1), m.group(2)) for m in _TOP.finditer(text)]
    for m in _CALL.finditer(text):
        owner = [(kind, name) for start, kind, name in tops if start < m.start()]
        if text[max(0, m.start() - 4):m.start()] == "def " or not owner or owner[-1][0] != "class":
            continue  # its definition, or not inside a class
        tail = text[m.start():]
        depth = 0
        for tok in tokenize.generate_tokens(io.StringIO(tail).readline):
            if tok.type == tokenize.OP and tok.string in "([{":
                depth += 1
            elif tok.type == tokenize.OP and tok.string in ")]}":
                depth -= 1
                if depth == 0:
                    break
        lines = tail.splitlines(keepends=True)
        src = "".join(lines[:tok.end[0] - 1]) + lines[tok.end[0] - 1][:tok.end[1]]
        call = ast.parse(src, mode="eval").body
        yield owner[-1][1], [k.arg for k in call.keywords if k.arg is not None]


@functools.cache
def _walk() -> tuple[dict[str, set[str]], int]:
    """Every keyword a modeling file passes by name to its attention function -> the classes passing it, and the
    number of files that call the interface."""
    root = Path(transformers.__file__).parent / "models"
    seen, files = {}, 0
    for path in sorted(root.glob("*/modeling_*.py")):
        calls = list(_attention_calls(path))
        files += bool(calls)
        for cls, kws in calls:
            for k in kws:
                seen.setdefault(k, set()).add(f"{path.parent.name}.{cls}")
    return seen, files


def _forwarded() -> dict[str, set[str]]:
    """The fields of every typed keyword dictionary a modeling file forwards (``**kwargs: Unpack[X]``): transformers'
    own (multihead's DECLARATIONS) by name, one a file defines itself read from its class body."""
    core = {td.__name__: td.__required_keys__ | td.__optional_keys__ for td in mha.DECLARATIONS}
    found = {}
    for path in sorted((Path(transformers.__file__).parent / "models").glob("*/modeling_*.py")):
        text = path.read_text()
        for name in set(re.findall(r"Unpack\[(\w+)\]", text)) - set(found):
            if name in core:
                found[name] = set(core[name])
                continue
            body = re.search(rf"^class {name}\(.*?(?=^\S)", text, re.M | re.S)
            assert body, f"{path.name} forwards Unpack[{name}], defined neither there nor in multihead's DECLARATIONS"
            cls = ast.parse(body.group(0)).body[0]
            found[name] = {a.target.id for a in cls.body if isinstance(a, ast.AnnAssign)}
    return found


def test_what_passes_through_is_derived_from_transformers_declarations(monkeypatch):
    """Not a list: a keyword passes through when transformers declares it as one its models forward (the typed
    dictionaries, its loss functions' parameters) and none of its own attention functions takes it. The loss
    keywords every causal LM crashed on (shift_labels, ignore_index) and seq_idx (packed-sequence information for
    state-space layers) are among them; an attention argument stays refused."""
    computed = set(inspect.signature(mhf.attention_forward).parameters) - {"module", "kwargs"}
    forwarded = _forwarded()
    assert {"TransformersKwargs", "FlashAttentionKwargs"} <= set(forwarded)  # 5.24: and Granite's own
    unaccounted = {name: sorted(f - computed - set(mhf.NOT_ATTENTION)) for name, f in forwarded.items()
                   if f - computed - set(mhf.NOT_ATTENTION)}
    assert not unaccounted, f"forwarded keywords multihead neither computes nor passes: {unaccounted}"
    # every argument transformers' own attention functions name is computed here (a new one fails here)
    assert {"dropout", "scaling", "is_causal", "softcap", "s_aux", "sliding_window"} <= set(mha.ATTENTION_ARGUMENTS)
    assert set(mha.ATTENTION_ARGUMENTS) <= computed, set(mha.ATTENTION_ARGUMENTS) - computed
    # where each passing keyword is declared, as the reason
    assert "ForCausalLMLoss" in mhf.NOT_ATTENTION["shift_labels"] and "ForCausalLMLoss" in mhf.NOT_ATTENTION[
        "ignore_index"]
    assert mhf.NOT_ATTENTION["seq_idx"].startswith("declared in TransformersKwargs (Sequence index for each token")
    # nothing transformers declares is refused by hand, nothing both passes and is refused
    declared = mha._declared()
    assert not set(mhf.REFUSED) & set(declared) and not set(mhf.REFUSED) & set(mhf.NOT_ATTENTION)
    # the hand-written residue is undeclared, and transformers still passes it
    assert mha.UNDECLARED and not set(mha.UNDECLARED) & set(declared)
    assert "deterministic" in _walk()[0]
    passed = []
    monkeypatch.setattr(mha, "_refuse", lambda module, kwargs: passed.append(set(kwargs)))
    model, x = _build("qwen3")
    mhf.attach(model)
    _out(model, x)
    assert passed and all("use_cache" in p for p in passed)
    # the rule, not a table: once one of transformers' attention functions names a declared keyword, it is refused
    def named(module, query, key, value, attention_mask, seq_idx=None, **kwargs):
        raise AssertionError("never called")

    monkeypatch.setitem(transformers.AttentionInterface._global_mapping, "test-seq-idx", named)
    assert mha._attention_arguments()["seq_idx"].endswith("named")
    assert "seq_idx" not in mha._not_attention() and "shift_labels" in mha._not_attention()


def test_every_keyword_any_family_passes_is_computed_declared_or_refused():
    """The registry walk: every modeling file of transformers whose attention calls the interface.
    A keyword multihead's function takes is computed (its docstring says how); a NOT_ATTENTION one
    does not change attention (derived from transformers' declarations, with where); a REFUSED one raises with its reason. A new
    keyword in a future transformers fails here, not silently in a user's model."""
    computed = set(inspect.signature(mhf.attention_forward).parameters) - {"module", "kwargs"}
    seen, files = _walk()
    assert files > 300  # the walk saw the registry (5.23: ~350 files)
    unaccounted = {k: sorted(v)[:3] for k, v in seen.items()
                   if k not in computed and k not in mhf.NOT_ATTENTION and k not in mhf.REFUSED}
    assert not unaccounted, f"keywords multihead neither computes, declares nor refuses: {unaccounted}"
    assert {"softcap", "s_aux", "position_bias", "sliding_window", "cu_seq_lens_q"} <= set(seen) & computed


REFUSED_LAYOUT = {"phi3": "its forward fails once heads"}  # Phi-3 reads its head counts from the config


@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in REFUSED_LAYOUT])
def test_layouts_are_derived_and_pruned_equals_gated_and_reloads(family, tmp_path):
    """No table: the head layout is derived from the module and verified on a recorded call; cutting
    (every head of the first module, three of the last's) equals gating; save/load rebuilds it."""
    model, x = _build(family)
    mhf.attach(model)
    mods = mhf.attention_modules(model)
    assert all(m.attention_hooks.layout is not None for m in mods.values()), mhf.derive(model)
    names = list(mods)
    first, last = names[0], names[-1]
    H = mods[last].attention_hooks.num_heads
    remove = {first: list(range(H)), last: [0, 1, 3]}  # GQA (Hkv = 2): kv head 0 goes, kv head 1 stays for head 2
    gates = {n: torch.ones(H).index_fill(0, torch.tensor(hs), 0.0) for n, hs in remove.items()}
    real = _real(x)
    with heads.gated(model, gates):
        gated = _out(model, x)
    heads.prune(model, remove)
    pruned = _out(model, x)
    assert (_on_real(pruned, real) - _on_real(gated, real)).abs().max() < 1e-5
    assert mods[last].attention_hooks.kept == [2]
    mhf.save(model, tmp_path / "pruned")
    back = mhf.load(tmp_path / "pruned")
    assert {n: m.attention_hooks.num_heads for n, m in mhf.attention_modules(back).items()} == \
        {n: m.attention_hooks.num_heads for n, m in mods.items()}
    assert (_on_real(_out(back, x), real) - _on_real(pruned, real)).abs().max() < 1e-6


def test_t5_pruned_layers_take_their_rows_of_the_shared_position_bias(tmp_path):
    model, x = _build("t5")
    mhf.attach(model)
    first = "encoder.block.0.layer.0.SelfAttention"  # holds relative_attention_bias (32 buckets, 4 heads)
    later = "encoder.block.1.layer.0.SelfAttention"
    gates = {first: torch.tensor([1.0, 0.0, 1.0, 0.0]), later: torch.tensor([0.0, 1.0, 1.0, 0.0])}
    with heads.gated(model, gates):
        gated = _out(model, x)
    heads.prune(model, {first: [1, 3], later: [0, 3]})
    assert model.encoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight.shape == (32, 4)
    assert (_out(model, x) - gated).abs().max() < 1e-5
    mhf.save(model, tmp_path / "t5")
    back = mhf.load(tmp_path / "t5")
    assert back.encoder.block[1].layer[0].SelfAttention.attention_hooks.kept == [1, 2]
    assert (_out(back, x) - gated).abs().max() < 1e-5


def test_a_layout_that_does_not_verify_is_refused_with_the_reason_before_changing_anything():
    model, x = _build("phi3")
    mhf.attach(model)
    before = _out(model, x)
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn \(Phi3Attention\) can be seen and gated, but "
                                         r"multihead has no head layout for it .*its forward fails once heads"):
        heads.prune(model, {"model.layers.0.self_attn": [0]})
    assert torch.equal(_out(model, x), before)
    with heads.gated(model, {"model.layers.0.self_attn": torch.tensor([1.0, 0.0, 1.0, 1.0])}):
        assert not torch.equal(_out(model, x), before)  # seeing and gating still work


def test_explain_says_per_module_the_layout_or_why_none_and_the_arguments_computed():
    model, x = _build("gpt_oss")
    mhf.attach(model)
    _out(model, x)
    text = mhf.explain(model)
    assert "- model.layers.0.self_attn (GptOssAttention): H=4 Hkv=2 D=8" in text
    assert "layout: separate q/k/v (q=q_proj, k=k_proj, v=v_proj, o=o_proj, per head: sinks)" in text
    assert "sinks (H,)" in text and "sliding_window=4" in text
    phi, _ = _build("phi3")
    mhf.attach(phi)
    assert "no layout (seen and gated, not cut): fused [Q | K | V]: its forward fails once heads" in mhf.explain(phi)


V_SMALL = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64, image_size=16,
               patch_size=4)
EAGER_MASK_FAMILIES = {  # classes that do not support sdpa: their modules were written for eager's masks
    # GIT's text attention computes attention itself and adds the mask to its scores
    "git": (lambda: T.GitModel(T.GitConfig(vision_config=V_SMALL, max_position_embeddings=64, **SMALL)), _ids),
    # NLLB-MoE's decoder self-attention leaves causality to the mask (is_causal is not set)
    "nllb_moe": (lambda: T.NllbMoeModel(T.NllbMoeConfig(
        vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, num_experts=4,
        max_position_embeddings=64)), _seq2seq),
}


@pytest.mark.parametrize("family", list(EAGER_MASK_FAMILIES))
def test_families_without_sdpa_get_the_masks_their_modules_expect(family):
    """sdpa's boolean masks, dropped when there is no padding, changed these families' outputs by
    0.04-0.07 (found by a sweep over transformers' families): a class that does not support sdpa now
    gets eager's float masks, always built, and equals eager attention."""
    make, inputs = EAGER_MASK_FAMILIES[family]
    torch.manual_seed(0)
    model, x = make().eval(), inputs()
    want = _out(model, x)  # eager: these classes support nothing else
    mhf.attach(model)
    assert model.config._attn_implementation == "multihead_eager_masks"
    assert _on_real(_out(model, x) - want, _real(x)).abs().max() < 1e-5
    bert = T.BertModel(T.BertConfig(**SMALL))
    mhf.attach(bert)
    assert bert.config._attn_implementation == "multihead"  # a class that supports sdpa keeps sdpa's masks


def test_attach_refuses_a_model_whose_output_it_would_change_and_names_the_module():
    """The whole model is checked against eager attention on a padded probe call: a module that
    computes attention itself from the mask (here: adds it to its scores, as eager expects, in a
    class that says it supports sdpa) would be silently wrong; attach refuses, names it, and leaves
    the model as it was."""
    torch.manual_seed(0)
    model = T.BertModel(T.BertConfig(**SMALL)).eval()
    model.set_attn_implementation("sdpa")
    own = model.encoder.layer[1].attention.self

    def forward(hidden_states, attention_mask=None, **kwargs):  # attention by hand, the mask added
        B, L, _ = hidden_states.shape
        q, k, v = (p(hidden_states).view(B, L, 4, 8).transpose(1, 2) for p in (own.query, own.key, own.value))
        s = q @ k.transpose(-1, -2) / 8 ** 0.5
        if attention_mask is not None:
            s = s + attention_mask
        return (s.softmax(-1) @ v).transpose(1, 2).reshape(B, L, 32), None

    own.forward = forward
    x = _ids()
    want = _out(model, x)
    with pytest.raises(ValueError, match=r"differs from transformers' eager attention .* first module whose output "
                                         r"differs is encoder\.layer\.1\.attention\.self \(BertSelfAttention\)"):
        mhf.attach(model)
    assert model.config._attn_implementation == "sdpa"
    assert torch.equal(_out(model, x), want)


def test_packed_refuses_at_attach_what_cannot_run_on_the_real_tokens():
    """A family whose attention the packed path does not compute (Gemma 2's softcap) is refused when
    attached, with the reason, not at the user's first call."""
    make, _ = FAMILIES["gemma2"]
    torch.manual_seed(0)
    with pytest.raises(ValueError, match="packed=True: Gemma2ForCausalLM cannot run on the real tokens only.*softcap"):
        mhf.attach(make().eval(), packed=True)


def test_the_name_is_checked_where_transformers_resolves_it_inside_loading_or_not():
    """Built with attn_implementation="multihead" outside ``multihead.hf.loading()``, a class written for eager's
    masks got sdpa's and refused at its first call; now the name is checked where transformers resolves it (for
    the whole process, as the name is registered): the class gets the masks it was written for, everywhere; every
    other implementation's name passes through unchanged. (GIT builds its text attention from a table keyed by
    implementation name, so it is attached, not built.)"""
    make, inputs = EAGER_MASK_FAMILIES["nllb_moe"]
    torch.manual_seed(0)
    model, x = make().eval(), inputs()
    want = _out(model, x)
    mhf.attach(model)
    state = model.state_dict()
    cfg = model.config
    for block in (mhf.loading, contextlib.nullcontext):
        cfg._attn_implementation = "multihead"
        with block():
            built = type(model)(cfg).eval()
        built.load_state_dict(state)
        assert built.config._attn_implementation == "multihead_eager_masks"
        assert _on_real(_out(built, x) - want, _real(x)).abs().max() < 1e-5
    cfg._attn_implementation = "eager"
    assert type(model)(cfg).config._attn_implementation == "eager"  # another name: transformers' own resolution


def test_families_that_compute_attention_themselves_are_seen_through_sdpa_or_refused():
    """Falcon's sdpa branch calls F.scaled_dot_product_attention itself: multihead.heads.observe sees
    it (the outputs unchanged, the captured weights equal eager's output_attentions on the real
    rows, a gated head equals a zeroed one); Bloom (ALiBi, baddbmm) and DeBERTa-v2 (disentangled
    attention) compute by hand and are refused in one line each."""
    torch.manual_seed(0)
    ids, am = _ids()["input_ids"], _ids()["attention_mask"]
    def build(impl):  # Falcon chooses its masks when built: eager's float masks need an eager model
        cfg = T.FalconConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4)
        cfg._attn_implementation = impl
        torch.manual_seed(0)
        return T.FalconModel(cfg).eval()

    falcon, eager_model = build("sdpa"), build("eager")
    with pytest.raises(ValueError, match=r"FalconModel: none of its modules calls .* multihead.heads.observe"):
        mhf.attach(falcon)
    with torch.no_grad():
        eager = eager_model(input_ids=ids, attention_mask=am, output_attentions=True)
    with torch.no_grad():
        ref = falcon(input_ids=ids, attention_mask=am).last_hidden_state
    assert list(heads.observe(falcon, {"input_ids": ids, "attention_mask": am})) == \
        ["h.0.self_attention", "h.1.self_attention"]
    with torch.no_grad(), multihead.capture(falcon) as cap:
        assert torch.equal(falcon(input_ids=ids, attention_mask=am).last_hidden_state, ref)
    real = am.bool()
    for i, name in enumerate(cap):
        got, want = cap[name], eager.attentions[i]  # (B, H, L, L)
        assert (got - want).transpose(1, 2)[real].abs().max() < 1e-5  # the real query rows
    with torch.no_grad(), heads.gated(falcon, {"h.1.self_attention": torch.tensor([1.0, 1.0, 0.0, 1.0])}):
        gated = falcon(input_ids=ids, attention_mask=am).last_hidden_state
    assert (gated - ref)[real].abs().max() > 1e-4  # the head mattered
    heads.unobserve(falcon)
    model = T.DebertaV2Model(T.DebertaV2Config(vocab_size=V, hidden_size=32, num_hidden_layers=1,
                                               num_attention_heads=4, intermediate_size=64)).eval()
    with pytest.raises(ValueError, match=r"DebertaV2Model: no module called torch.nn.functional."
                                         r"scaled_dot_product_attention .* compute attention another way"):
        heads.observe(model, {"input_ids": ids, "attention_mask": am})


@pytest.mark.parametrize("n_head", [4, 6])
def test_bloom_seen_through_its_sdpa_form_and_cut_with_its_alibi_slopes(n_head):
    """Bloom computes attention by hand (ALiBi through baddbmm): observe gives BloomAttention its SDPA
    form (multihead.hf.forms), the outputs and output_attentions unchanged; capture = Bloom's own weights
    on the real rows; cut = gated (each layer keeps its kept heads' ALiBi slopes: 6 heads have the
    non-power-of-two slopes), logits and greedy tokens with the cache; the form survives deepcopy."""
    torch.manual_seed(0)
    model = T.BloomForCausalLM(T.BloomConfig(vocab_size=V, hidden_size=8 * n_head, n_layer=2, n_head=n_head)).eval()
    ids, am = _ids()["input_ids"], _ids()["attention_mask"]
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=am, output_attentions=True)
    assert list(heads.observe(model, {"input_ids": ids, "attention_mask": am})) == \
        ["transformer.h.0.self_attention", "transformer.h.1.self_attention"]
    real = am.bool()
    with torch.no_grad():
        same = model(input_ids=ids, attention_mask=am, output_attentions=True)
        assert (same.logits - ref.logits).abs().max() < 1e-5
        assert all((a - b).abs().max() < 1e-6 for a, b in zip(same.attentions, ref.attentions))
        with multihead.capture(model) as cap:
            model(input_ids=ids, attention_mask=am)
    for i, name in enumerate(cap):
        assert (cap[name] - ref.attentions[i]).transpose(1, 2)[real].abs().max() < 1e-5  # (B, Lq, H, Lk) real rows
    lay = model.transformer.h[0].self_attention.attention_hooks.layout
    assert lay is not None and lay.fused == "interleaved" and lay.per_head == ("alibi_heads",)
    cut = {"transformer.h.0.self_attention": [1], "transformer.h.1.self_attention": [0, 2, n_head - 1]}
    gates = {n: torch.ones(n_head).index_fill(0, torch.tensor(hs), 0.0) for n, hs in cut.items()}
    prompt = ids[:1, :4]
    with torch.no_grad(), heads.gated(model, gates):
        want = model(input_ids=ids, attention_mask=am).logits
        want_tokens = model.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0)
    heads.prune(model, cut)
    for m in (model, copy.deepcopy(model)):
        with torch.no_grad():
            got = m(input_ids=ids, attention_mask=am).logits
            tokens = m.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0)
        assert (got - want)[real].abs().max() < 1e-5 and torch.equal(tokens, want_tokens)
    attn = model.transformer.h[1].self_attention
    assert attn.num_heads == n_head - 3 and attn.alibi_heads.tolist() == [1] + list(range(3, n_head - 1))
    assert not any(k.endswith("alibi_heads") for k in model.state_dict())  # not saved: Bloom's checkpoints stay Bloom's
    h = torch.zeros(1, 2, 8 * n_head)
    with pytest.raises(TypeError, match=r"computes from hidden_states, .* got also \['position_bias'\]"):
        attn(h, h, torch.zeros(n_head, 1, 2), None, position_bias=None)  # an argument the form does not compute


def test_a_form_that_changes_the_output_is_taken_back():
    """A registered SDPA form is kept only if the model's output is unchanged: a wrong one is taken back
    and observe refuses, naming the module class."""
    from multihead.heads.observe import FORMS

    class ByHand(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv, self.o = nn.Linear(8, 24), nn.Linear(8, 8)

        def forward(self, x):  # (B, L, 8), 2 heads of 4, written out by hand
            q, k, v = self.qkv(x).view(*x.shape[:2], 3, 2, 4).permute(2, 0, 3, 1, 4)  # 3 x (B, H, L, D)
            return self.o(((q @ k.transpose(-1, -2)) / 2).softmax(-1).matmul(v).transpose(1, 2).flatten(2))

    def wrong(self, x):  # forgets the scale
        q, k, v = self.qkv(x).view(*x.shape[:2], 3, 2, 4).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, scale=1.0)
        return self.o(out.transpose(1, 2).flatten(2))

    def broken(self, x):
        raise RuntimeError("shape mismatch in the form")

    form = [wrong]

    def give(m):
        if type(m) is ByHand and "forward" not in m.__dict__:
            m.forward = form[0].__get__(m)
            return True
        return False

    def take(m):
        m.__dict__.pop("forward", None)

    model = nn.Sequential(ByHand()).eval()
    x = torch.randn(2, 5, 8)
    before = model(x)
    FORMS.append((give, take))
    try:
        with pytest.raises(ValueError, match=r"Sequential: with ByHand in their SDPA form the model gives another "
                                             r"output \(max .* on the example\); .* cannot see their heads"):
            heads.observe(model, x)
        assert "forward" not in model[0].__dict__ and torch.equal(model(x), before)
        form[0] = broken  # a form that cannot run at all
        with pytest.raises(ValueError, match=r"with ByHand in their SDPA form the model does not run on the example "
                                             r"\(RuntimeError: .*\); multihead leaves them as they are"):
            heads.observe(model, x)
    finally:
        FORMS.remove((give, take))
    assert "forward" not in model[0].__dict__ and torch.equal(model(x), before)


@pytest.mark.parametrize("arch", ["multi-query", "per head [q k v]", "new decoder (grouped)"])
def test_falcon_heads_cut_through_the_sdpa_observation(arch):
    """Falcon's three fused query_key_value layouts (multi-query [Q | k | v]; per head [q k v]; the new
    decoder's per key/value group [q .. q k v], whose keys reach SDPA broadcast to every head): the
    layout is derived and verified on the probe call, the cut model equals the gated one, and greedy
    decoding with its cache gives the gated model's tokens."""
    kw = {"multi-query": {}, "per head [q k v]": {"multi_query": False},
          "new decoder (grouped)": {"new_decoder_architecture": True, "num_kv_heads": 2}}[arch]
    torch.manual_seed(0)
    cfg = T.FalconConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, **kw)
    cfg._attn_implementation = "sdpa"
    model = T.FalconForCausalLM(cfg).eval()
    ids, am = _ids()["input_ids"], _ids()["attention_mask"]
    heads.observe(model, {"input_ids": ids, "attention_mask": am})
    lay = model.transformer.h[0].self_attention.attention_hooks.layout
    assert lay is not None and lay.fused == {"multi-query": "blocks", "per head [q k v]": "interleaved",
                                             "new decoder (grouped)": "grouped"}[arch]
    cut = {"transformer.h.0.self_attention": [1, 3] if arch == "new decoder (grouped)" else [1],  # groups even
           "transformer.h.1.self_attention": [0, 2]}
    gates = {n: torch.ones(4) for n in heads.attention_modules(model)}
    for n, hs in cut.items():
        gates[n][hs] = 0.0
    prompt = ids[:1, :4]
    with torch.no_grad(), heads.gated(model, gates):
        want = model(input_ids=ids, attention_mask=am).logits
        want_tokens = model.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0)
    heads.prune(model, cut)
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=am).logits
        tokens = model.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0)
    real = am.bool()
    assert (got - want)[real].abs().max() < 1e-5
    assert torch.equal(tokens, want_tokens)
    assert model.transformer.h[1].self_attention.num_heads == 2


def test_gptj_heads_cut_through_the_interface():
    """GPT-J (on transformers' attention interface since 5.24; refused by name before): its separate
    projections are derived at attach and cut; the cut model equals the gated one, greedy tokens too."""
    torch.manual_seed(0)
    cfg = T.GPTJConfig(vocab_size=V, n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=32)
    model = T.GPTJForCausalLM(cfg).eval()
    ids, am = _ids()["input_ids"], _ids()["attention_mask"]
    try:
        mhf.attach(model)
    except ValueError as e:  # an older transformers: GPT-J computes attention itself and is refused in one line
        assert "GPTJForCausalLM: none of its modules calls transformers' attention interface" in str(e)
        return
    cut = {"transformer.h.0.attn": [3], "transformer.h.1.attn": [0, 1]}
    gates = {n: torch.ones(4).index_fill(0, torch.tensor(hs), 0.0) for n, hs in cut.items()}
    prompt = ids[:1, :4]
    with torch.no_grad(), heads.gated(model, gates):
        want = model(input_ids=ids, attention_mask=am).logits
        want_tokens = model.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0)
    heads.prune(model, cut)
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=am).logits
        tokens = model.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert (got - want)[am.bool()].abs().max() < 1e-5 and torch.equal(tokens, want_tokens)
    assert model.transformer.h[1].attn.q_proj.weight.shape == (16, 32)
