"""Your own model: transformers models on multihead, built from tiny configs (no hub).

Every family: outputs equal transformers' sdpa; capture equals the eager attentions;
pruned equals gated (every head of one module included); save/load rebuilds the pruned
model; padded batches (right padding for encoders, left for causal LMs)."""

from __future__ import annotations

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
import multihead  # noqa: E402
import multihead.hf as mhf  # noqa: E402
from multihead import heads  # noqa: E402

warnings.filterwarnings("ignore", message=".*token_id.*")
V = 100


def _ids(B=3, L=9, left=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (B, L), generator=g)
    am = torch.ones(B, L, dtype=torch.long)
    lens = [L, 6, 2][:B]
    for b, n in enumerate(lens):
        if left:
            am[b, : L - n] = 0
        else:
            am[b, n:] = 0
    return ids, am


def _text(left=False):
    ids, am = _ids(left=left)
    return {"input_ids": ids, "attention_mask": am}


def _seq2seq():
    ids, am = _ids()
    dec, _ = _ids(L=5, seed=1)
    return {"input_ids": ids, "attention_mask": am, "decoder_input_ids": dec}


def _image():
    return {"pixel_values": torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))}


def _audio():
    dec, _ = _ids(L=5, seed=1)
    return {"input_features": torch.randn(3, 8, 32, generator=torch.Generator().manual_seed(0)), "decoder_input_ids": dec}


T = transformers

def _modeling_file_calls_interface(cls) -> bool:
    """Whether the installed modeling file of ``cls`` calls transformers' attention interface."""
    import inspect

    return "ALL_ATTENTION_FUNCTIONS" in inspect.getsource(inspect.getmodule(cls))


class _HandWrittenConfig(T.PretrainedConfig):
    model_type = "multihead-test-hand-written"

    def __init__(self, vocab_size=V, hidden_size=32, num_attention_heads=4, **kw):
        super().__init__(**kw)
        self.vocab_size, self.hidden_size, self.num_attention_heads = vocab_size, hidden_size, num_attention_heads


class _HandWrittenAttention(torch.nn.Module):
    """Computes attention itself (never through transformers' interface)."""

    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.qkv = torch.nn.Linear(config.hidden_size, 3 * config.hidden_size)

    def forward(self, x, attention_mask=None):
        B, L, E = x.shape
        q, k, v = self.qkv(x).view(B, L, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)  # 3 x (B, H, L, D)
        keep = None if attention_mask is None else attention_mask.bool()[:, None, None, :]  # (B, 1, 1, L)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep)  # (B, H, L, D)
        return o.transpose(1, 2).reshape(B, L, E)


class _HandWrittenModel(T.PreTrainedModel):
    config_class = _HandWrittenConfig
    _supports_sdpa = True

    def __init__(self, config):
        super().__init__(config)
        self.embed = torch.nn.Embedding(config.vocab_size, config.hidden_size)
        self.attention = _HandWrittenAttention(config)
        self.post_init()

    def forward(self, input_ids, attention_mask=None):
        return T.modeling_outputs.BaseModelOutput(last_hidden_state=self.attention(self.embed(input_ids), attention_mask))


SMALL = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
FAMILIES = {
    "bert": (lambda: T.BertModel(T.BertConfig(max_position_embeddings=64, **SMALL)), _text),
    "roberta": (lambda: T.RobertaModel(T.RobertaConfig(max_position_embeddings=72, pad_token_id=1, **SMALL)), _text),
    "electra": (lambda: T.ElectraModel(T.ElectraConfig(embedding_size=32, max_position_embeddings=64, **SMALL)), _text),
    "distilbert": (lambda: T.DistilBertModel(T.DistilBertConfig(vocab_size=V, dim=32, n_layers=2, n_heads=4,
                                                                hidden_dim=64, max_position_embeddings=64)), _text),
    "vit": (lambda: T.ViTModel(T.ViTConfig(image_size=16, patch_size=4, **{k: v for k, v in SMALL.items()
                                                                          if k != "vocab_size"})), _image),
    "deit": (lambda: T.DeiTModel(T.DeiTConfig(image_size=16, patch_size=4, **{k: v for k, v in SMALL.items()
                                                                             if k != "vocab_size"})), _image),
    "gpt2": (lambda: T.GPT2LMHeadModel(T.GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64)),
             lambda: _text(left=True)),
    "llama": (lambda: T.LlamaForCausalLM(T.LlamaConfig(num_key_value_heads=2, **SMALL)), lambda: _text(left=True)),
    "mistral": (lambda: T.MistralForCausalLM(T.MistralConfig(num_key_value_heads=2, **SMALL)),
                lambda: _text(left=True)),
    "qwen2": (lambda: T.Qwen2ForCausalLM(T.Qwen2Config(num_key_value_heads=2, **SMALL)), lambda: _text(left=True)),
    "bart": (lambda: T.BartModel(T.BartConfig(vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=2,
                                              encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                              decoder_ffn_dim=64, max_position_embeddings=64)), _seq2seq),
    "whisper": (lambda: T.WhisperModel(T.WhisperConfig(vocab_size=V, num_mel_bins=8, d_model=32, encoder_layers=2,
                                                       decoder_layers=2, encoder_attention_heads=4,
                                                       decoder_attention_heads=4, encoder_ffn_dim=64,
                                                       decoder_ffn_dim=64, max_source_positions=16,
                                                       max_target_positions=32, pad_token_id=0, bos_token_id=1,
                                                       eos_token_id=2, decoder_start_token_id=1)), _audio),
}


def _build(family):
    make, inputs = FAMILIES[family]
    torch.manual_seed(0)
    model = make().eval()
    return model, inputs()


def _out(model, x):
    with torch.no_grad():
        o = model(**x)
    return o.logits if hasattr(o, "logits") and o.logits is not None else o.last_hidden_state


def _eager_attentions(model, x) -> list[torch.Tensor]:
    model.set_attn_implementation("eager")
    with torch.no_grad():
        o = model(**x, output_attentions=True)
    mhf.attach(model)
    if hasattr(o, "encoder_attentions") and o.encoder_attentions is not None:  # per decoder layer: self, then cross
        dec = [t for pair in zip(o.decoder_attentions, o.cross_attentions) for t in pair]
        return list(o.encoder_attentions) + dec
    return list(o.attentions)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_parity_capture_prune_save_load(family, tmp_path):
    model, x = _build(family)
    model.set_attn_implementation("sdpa")
    sdpa = _out(model, x)
    mhf.attach(model)
    assert model.config._attn_implementation == "multihead"
    got = _out(model, x)
    assert torch.isfinite(got).all()
    assert (got - sdpa).abs().max() < 1e-5  # outside capture: transformers' sdpa
    # see: capture records every attention module's (B, H, Lq, Lk) = eager's output_attentions
    with torch.no_grad(), multihead.capture(model) as cap:
        inside = _out(model, x)
    assert torch.equal(inside, got)
    names = list(mhf.attention_modules(model))
    assert list(cap) == names
    for (name, w), e in zip(cap.items(), _eager_attentions(model, x)):
        assert w.shape == e.shape, name
        empty = w.sum(-1) == 0  # rows with nothing to attend to (left padding): zeros here, uniform in eager
        assert torch.allclose(w.sum(-1)[~empty], torch.ones(()), atol=1e-5) and empty.sum() < empty.numel()
        assert (w - e)[~empty].abs().max() < 1e-5, name
    # cut: pruned == gated, every head of the first module removed, and heads of the last
    first, last = names[0], names[-1]
    H = mhf.attention_modules(model)[last].attention_hooks.num_heads
    remove = {first: list(range(H)), last: [0, 1, 3]}  # GQA (Hkv = 2): kv head 0 goes, kv head 1 stays for head 2
    gates = {n: torch.ones(H).index_fill(0, torch.tensor(hs), 0.0) for n, hs in remove.items()}
    with heads.gated(model, gates):
        gated = _out(model, x)
    heads.prune(model, remove)
    pruned = _out(model, x)
    assert (pruned - gated).abs().max() < 1e-5
    counts = {n: m.attention_hooks.num_heads for n, m in mhf.attention_modules(model).items()}
    layout = mhf.attention_modules(model)[first].attention_hooks.layout
    assert counts[first] == (0 if layout.zero_heads_ok else 1) and counts[last] == 1
    mhf.save(model, tmp_path / "pruned")
    back = mhf.load(tmp_path / "pruned")
    assert {n: m.attention_hooks.num_heads for n, m in mhf.attention_modules(back).items()} == counts
    assert torch.allclose(_out(back, x), pruned, atol=1e-6)


#: a language-model head of each family, where its keywords reach the loss (and, through the model below it, every
#: attention call); gemma2 against eager: transformers' sdpa refuses its softcap
LM_HEADS = {
    "llama": (lambda: FAMILIES["llama"][0](), "sdpa"),
    "gpt2": (lambda: FAMILIES["gpt2"][0](), "sdpa"),
    "mistral": (lambda: FAMILIES["mistral"][0](), "sdpa"),
    "qwen2": (lambda: FAMILIES["qwen2"][0](), "sdpa"),
    "gemma2": (lambda: T.Gemma2ForCausalLM(T.Gemma2Config(num_key_value_heads=2, head_dim=8, sliding_window=4,
                                                          **SMALL)), "eager"),
    "bert": (lambda: T.BertLMHeadModel(T.BertConfig(is_decoder=True, max_position_embeddings=64, **SMALL)), "sdpa"),
    "bert_mlm": (lambda: T.BertForMaskedLM(T.BertConfig(max_position_embeddings=64, **SMALL)), "sdpa"),
}


@pytest.mark.parametrize("family", list(LM_HEADS))
def test_the_loss_keywords_pass_through_to_the_loss_and_equal_sdpa(family):
    """transformers' test_causal_lm_loss_honors_shift_labels crashed on every causal LM with multihead
    (``TypeError: LlamaAttention passes 'shift_labels'``): the head hands its keywords to the model, whose layers
    forward them to every attention call. Declared by transformers as the loss's (and seq_idx as packed-sequence
    information no attention function reads), they pass through: loss and logits equal the reference's, and the
    loss is the one the keywords ask for."""
    make, ref = LM_HEADS[family]
    torch.manual_seed(0)
    model = make().eval()
    mlm = family == "bert_mlm"
    ids, am = _ids(left=family != "bert" and not mlm)
    labels = ids.masked_fill(am == 0, -1)
    shift = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-1)  # (B, L): token t predicts t + 1
    shift = shift.masked_fill(am == 0, -1)  # from real tokens only (a padded row is zeros here, uniform in eager)
    kw = dict(attention_mask=am, labels=labels.masked_fill(labels == -1, -100) if mlm else labels,
              shift_labels=shift, ignore_index=-1, seq_idx=torch.zeros_like(ids, dtype=torch.int32))
    outs = {}
    for impl in (ref, "multihead"):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            outs[impl] = model(ids, **kw)
    got, want = outs["multihead"], outs[ref]
    real = am.bool()
    assert (got.logits - want.logits)[real].abs().max() < 1e-5
    assert abs(float(got.loss) - float(want.loss)) < 1e-5
    flat = got.logits.reshape(-1, V)  # (B, L, V) -> (B*L, V)
    asked = (torch.nn.functional.cross_entropy(flat, kw["labels"].reshape(-1)) if mlm  # BertForMaskedLM: its own
             else torch.nn.functional.cross_entropy(flat, shift.reshape(-1), ignore_index=-1))
    assert abs(float(got.loss) - float(asked)) < 1e-5


def test_the_mask_function_is_registered_too():
    """The trap: a custom attention implementation without a mask function receives no padding
    mask. multihead registers transformers' sdpa mask function with its attention function."""
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    assert AttentionMaskInterface._global_mapping["multihead"].__wrapped__ is sdpa_mask  # checked first (below)
    model, x = _build("bert")
    model.set_attn_implementation("sdpa")
    sdpa = _out(model, x)
    mhf.attach(model)
    with torch.no_grad(), multihead.capture(model) as cap:
        got = _out(model, x)
    assert (got - sdpa).abs().max() < 1e-5
    am = x["attention_mask"].bool()
    for w in cap.values():  # padded keys get exactly zero weight
        assert (w.transpose(1, 3)[~am] == 0).all()
    registered = AttentionMaskInterface._global_mapping.pop("multihead")
    try:  # without it the padding is silently dropped: the outputs differ
        assert (_out(model, x) - sdpa).abs().max() > 1e-3
    finally:
        AttentionMaskInterface.register("multihead", registered)  # the same function back (it checks the family)


def test_from_pretrained_with_attn_implementation(tmp_path):
    model, x = _build("llama")
    model.save_pretrained(tmp_path / "m")
    loaded = T.AutoModelForCausalLM.from_pretrained(tmp_path / "m", attn_implementation="multihead").eval()
    assert loaded.config._attn_implementation == "multihead"
    assert torch.allclose(_out(loaded, x), _out(model, x), atol=1e-5)
    with torch.no_grad(), multihead.capture(loaded) as cap:  # no attach needed to see the heads
        loaded(**x)
    assert list(cap) == [f"model.layers.{i}.self_attn" for i in range(2)]
    assert cap["model.layers.0.self_attn"].shape == (3, 4, 9, 9)
    model.set_attn_implementation("sdpa")
    with pytest.raises(ValueError, match=r"call multihead.hf.attach\(model\) first .* or load it with "
                                         "attn_implementation='multihead'"):
        with multihead.capture(model):
            pass


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_generate_with_cache_gives_sdpas_tokens_and_capture_sees_the_cache(family):
    model, x = _build(family)
    kw = dict(max_new_tokens=8, do_sample=False, use_cache=True, pad_token_id=0)
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        ref = model.generate(**x, **kw)
    mhf.attach(model)
    with torch.no_grad():
        got = model.generate(**x, **kw)
    assert torch.equal(got, ref)
    name = list(mhf.attention_modules(model))[0]
    with torch.no_grad(), multihead.capture(model, include=[name]) as cap:
        model.generate(**x, **kw)
    calls = cap.calls(name)
    L = x["input_ids"].shape[1]
    assert calls[0].shape[2:] == (L, L)  # the prompt
    assert [c.shape[2:] for c in calls[1:]] == [(1, L + t) for t in range(1, len(calls))]  # each step over the cache
    assert torch.allclose(calls[-1].sum(-1), torch.ones(()), atol=1e-5)


def test_scores_work_on_an_attached_model():
    model, x = _build("bert")
    mhf.attach(model)
    batches = [x]

    def loss_fn(m, b):
        return m(**b).last_hidden_state.pow(2).mean()

    for method in ("gradient", "ablation", "entropy"):
        imp = heads.importance(model, batches, loss_fn, method, progress=False)
        assert imp.names == list(mhf.attention_modules(model)) and all(s.shape == (4,) for s in imp.scores)
    # ablation == the loss change with the head gated off, by hand
    imp = heads.importance(model, batches, loss_fn, "ablation", progress=False)
    with torch.no_grad():
        base = float(loss_fn(model, x))
        with heads.gated(model, {imp.names[1]: torch.tensor([1.0, 1.0, 0.0, 1.0])}):
            off = float(loss_fn(model, x))
    assert abs(imp.scores[1][2] - (off - base)) < 1e-6
    means = heads.mean_head_outputs(model, batches, lambda m, b: m(**b))
    assert set(means) == set(imp.names) and means[imp.names[0]].shape == (4, 8)


def test_bad_input(tmp_path):
    with pytest.raises(TypeError, match="attach takes a transformers PreTrainedModel"):
        mhf.attach(torch.nn.Linear(2, 2))
    model, _ = _build("bert")
    mhf.attach(model)
    (tmp_path / "a_file").write_text("x")  # transformers only logged it, then the weights failed to write obscurely
    with pytest.raises(ValueError, match=r"save writes a directory; .*a_file is a file"):
        mhf.save(model, tmp_path / "a_file")
    with pytest.raises(ValueError, match="no multihead attention module named 'encoder.layer.0'"):
        heads.prune(model, {"encoder.layer.0": [0]})
    with pytest.raises(ValueError, match=r"heads \[7\] do not exist: the module has num_heads=4"):
        heads.prune(model, {"encoder.layer.0.attention.self": [7]})
    with pytest.raises(ValueError, match="config.json does not exist"):
        mhf.load("/nonexistent-dir")
    # which families compute attention themselves depends on the installed transformers (GPT-J moved onto the
    # interface in 5.24): the expectation is read from the installed modeling file, as the library decides
    families = {
        "GPTJModel": (T.GPTJModel, lambda: T.GPTJConfig(vocab_size=V, n_embd=32, n_layer=1, n_head=4, rotary_dim=4,
                                                       n_positions=32)),
        "FalconModel": (T.FalconModel, lambda: T.FalconConfig(vocab_size=V, hidden_size=32, num_hidden_layers=1,
                                                             num_attention_heads=4)),
        "DebertaV2Model": (T.DebertaV2Model, lambda: T.DebertaV2Config(vocab_size=V, hidden_size=32, num_hidden_layers=1,
                                                                      num_attention_heads=4, intermediate_size=64)),
        "HandWrittenModel": (_HandWrittenModel, _HandWrittenConfig),  # pinned here: refused on every version
    }
    for cls, (make, config) in families.items():
        model = make(config()).eval()
        if make is not _HandWrittenModel and _modeling_file_calls_interface(make):
            ids, am = _ids()
            with torch.no_grad():
                ref = model(input_ids=ids, attention_mask=am).last_hidden_state
                got = mhf.attach(model)(input_ids=ids, attention_mask=am).last_hidden_state
            assert (got - ref)[am.bool()].abs().max() < 1e-5, cls
            continue
        with pytest.raises(ValueError, match=rf"{cls}: none of its modules calls transformers' attention interface "
                                             r"\(ALL_ATTENTION_FUNCTIONS\); .*Attention compute attention themselves"):
            mhf.attach(model)
        assert model.config._attn_implementation != "multihead"  # refused before anything changed
        cfg = config()
        cfg._attn_implementation = "multihead"  # built with "multihead": one clear error before the layers, no KeyError
        with pytest.raises(ValueError, match=rf"{cls}: its attention does not go through transformers' attention "
                                             r"interface .*Load it with attn_implementation='sdpa'"), mhf.loading():
            make(cfg)
    t5 = T.T5Model(T.T5Config(vocab_size=V, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4))
    assert len(mhf.attention_modules(mhf.attach(t5))) == 3  # encoder self, decoder self and cross


def test_minilm_through_transformers_and_multihead():
    pytest.importorskip("tokenizers")
    from multihead.apps.common.data import sentences
    from multihead.models import SentenceEncoder, minilm_path

    try:
        path = minilm_path()
    except FileNotFoundError:
        pytest.skip("the pretrained MiniLM package is not installed")
    model = T.BertModel.from_pretrained(str(path), attn_implementation="sdpa").eval()
    ids, am = SentenceEncoder.from_pretrained(path).tokenize(sentences(16))
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=am).last_hidden_state
        mhf.attach(model)
        got = model(input_ids=ids, attention_mask=am).last_hidden_state
    real = am.bool()
    assert (got - ref)[real].abs().max() < 1e-5
    remove = {"encoder.layer.2.attention.self": [0, 4, 7], "encoder.layer.5.attention.self": list(range(12))}
    gates = {n: torch.ones(12).index_fill(0, torch.tensor(hs), 0.0) for n, hs in remove.items()}
    with torch.no_grad(), heads.gated(model, gates):
        gated = model(input_ids=ids, attention_mask=am).last_hidden_state
    heads.prune(model, remove)
    with torch.no_grad():
        pruned = model(input_ids=ids, attention_mask=am).last_hidden_state
    assert (pruned - gated)[real].abs().max() < 1e-5
