"""The served encoder: ``multihead.hf.serve(model)``, a BERT-family encoder rebuilt lean for prediction.

Tiny configs built here (no hub): BERT (float, pruned per layer, int8, every head of a layer pruned, a
classifier around the encoder), RoBERTa (its own position convention: the model's embeddings module is
kept), ELECTRA (its embeddings are smaller than its layers). Compared with the transformers model on
batches with and without padding, token types included; what it cannot compute is refused by name."""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
import multihead.hf as mhf  # noqa: E402
from multihead import heads  # noqa: E402
from multihead.hf import encoder as hf_serve  # noqa: E402
from multihead.hf import probe  # noqa: E402
from multihead.quantize import fused, kernel_kind, linear, quantize  # noqa: E402

warnings.filterwarnings("ignore", message=".*token_id.*")
transformers.logging.set_verbosity_error()
T = transformers
V = 100
SMALL = dict(vocab_size=V, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=64)


def _batch(B=4, L=11, seed=0, pad=True, types=False):
    g = torch.Generator().manual_seed(seed)
    x = {"input_ids": torch.randint(3, V, (B, L), generator=g), "attention_mask": torch.ones(B, L, dtype=torch.long)}
    if pad:
        for b, n in enumerate([L, 7, 1, 9][:B]):
            x["attention_mask"][b, n:] = 0
    if types:
        x["token_type_ids"] = (torch.arange(L) >= L // 2).long().expand(B, L).clone()
    return x


def _close(model, enc, x):
    keep = x["attention_mask"].bool()
    with torch.no_grad():
        ref = model(**x).last_hidden_state
        got = enc(**x).last_hidden_state
    assert got.shape == ref.shape
    assert not probe.differs(ref[keep], got[keep]), float((ref[keep] - got[keep]).abs().max())
    assert bool((got[~keep] == 0).all())  # padded positions: zeros
    return ref, got


def _bert(seed=0, **over):
    torch.manual_seed(seed)
    return T.BertModel(T.BertConfig(**{**SMALL, **over})).eval()


@pytest.mark.parametrize("pad", [True, False])
@pytest.mark.parametrize("types", [False, True])
def test_served_bert_gives_the_models_hidden_states(pad, types):
    model = _bert()
    enc = mhf.serve(model)
    assert isinstance(enc.embeddings, hf_serve.ServedBertEmbeddings)  # BERT's own convention, verified
    for seed in range(3):
        _close(model, enc, _batch(seed=seed, pad=pad, types=types))
    out = enc(**_batch())
    assert out[0] is out.last_hidden_state  # what transformers' outputs allow
    (alone,) = enc(**_batch(), return_dict=False)
    assert torch.equal(alone, out.last_hidden_state)
    assert enc.config.hidden_size == 32 and enc.config is not model.config


def test_served_bert_runs_padding_free_and_without_padding_dense(monkeypatch):
    """A padded batch: every layer on the N real tokens (attention per sequence); a batch without
    padding: dense attention, no unpadding."""
    enc = mhf.serve(_bert())
    seen = []
    real = hf_serve.attention_varlen
    monkeypatch.setattr(hf_serve, "attention_varlen", lambda q, *a, **k: seen.append(q.shape[0]) or real(q, *a, **k))
    x = _batch()
    enc(**x)
    assert seen == [int(x["attention_mask"].sum())] * 3  # (N, H, D) in each of the 3 layers
    seen.clear()
    enc(**_batch(pad=False))
    enc(input_ids=_batch()["input_ids"])  # no mask at all
    assert seen == []


def test_served_pruned_and_int8_bert_is_the_quantized_models_function():
    """Each layer keeps its own head count (one layer with every head pruned); int8: the fused q/k/v
    layer holds the model's own int8 rows and scales, so the served int8 encoder equals the int8 model
    (padding-free, as the served one runs: int8 activations are rounded over the tokens a call holds)."""
    model = mhf.attach(_bert(seed=1), packed=True)
    heads.prune(model, {"encoder.layer.0.attention.self": [1], "encoder.layer.1.attention.self": [0, 1, 2, 3],
                        "encoder.layer.2.attention.self": [0, 2, 3]})  # the heads removed
    enc = mhf.serve(model)
    assert [layer.num_heads for layer in enc.layers] == [3, 0, 1]
    assert enc.layers[1].qkv is None  # no heads: the output projection gives its bias
    _close(model, enc, _batch())
    q = quantize(model)
    qenc = mhf.serve(q)
    for x in (_batch(seed=2), _batch(seed=3, pad=False)):
        with torch.no_grad():
            a, b = q(**x).last_hidden_state, qenc(**x).last_hidden_state
        keep = x["attention_mask"].bool()
        # the same numbers: int8 activations are rounded over what a call holds, so one ulp anywhere upstream
        # (the embeddings summed in another order did that) moves every rounding of the call after it
        assert torch.equal(a[keep], b[keep])
    with torch.no_grad():
        float_gap = (_close(model, enc, _batch(seed=2))[0] - qenc(**_batch(seed=2)).last_hidden_state).abs().max()
    assert float(float_gap) > 1e-4  # the int8 encoder is really int8


def test_bert_embeddings_are_the_models_own_numbers():
    """BERT's embeddings computed from its weights are the module's numbers bit for bit (summed in its order,
    (word + token type) + position): an int8 model's first products round them per call, and on all-MiniLM-L6-v2
    int8 a last-bit difference there moved 256-token outputs by 0.23 (relative) from the model's."""
    model = _bert(seed=5)
    ours = hf_serve.ServedBertEmbeddings.of(model.embeddings)
    for seed in range(3):
        for types in (False, True):
            x = _batch(seed=seed, types=types)
            with torch.no_grad():
                want = model.embeddings(input_ids=x["input_ids"], token_type_ids=x.get("token_type_ids"))
                assert torch.equal(ours(x["input_ids"], x.get("token_type_ids")), want)


def test_roberta_keeps_its_own_embeddings_and_electra_with_a_projection_is_refused():
    torch.manual_seed(0)
    rob = T.RobertaModel(T.RobertaConfig(**SMALL, pad_token_id=1)).eval()
    enc = mhf.serve(rob)
    assert isinstance(enc.embeddings, hf_serve.ModelEmbeddings)  # positions start after padding_idx: not BERT's
    _close(rob, enc, _batch())
    ele = T.ElectraModel(T.ElectraConfig(**SMALL, embedding_size=32)).eval()
    _close(ele, mhf.serve(ele), _batch(seed=1))
    projected = T.ElectraModel(T.ElectraConfig(**SMALL, embedding_size=16)).eval()  # embeddings_project in between
    with pytest.raises(ValueError, match=r"first layer encoder\.layer\.0 does not receive the embeddings' output"):
        mhf.serve(projected)


def test_a_classifier_is_served_as_its_encoder():
    torch.manual_seed(0)
    clf = T.BertForSequenceClassification(T.BertConfig(**SMALL)).eval()
    enc = mhf.serve(clf)
    x = _batch()
    keep = x["attention_mask"].bool()
    with torch.no_grad():
        ref = clf.bert(**x).last_hidden_state
        assert not probe.differs(ref[keep], enc(**x).last_hidden_state[keep])


@pytest.mark.filterwarnings("ignore:TypedStorage is deprecated")  # torch's own pickling of int8 weights
def test_the_served_encoder_is_a_copy_and_survives_every_mode():
    model = _bert()
    enc = mhf.serve(model)
    x = _batch()
    with torch.no_grad():
        before = enc(**x).last_hidden_state
        model.encoder.layer[0].output.dense.weight.mul_(2)  # the model changes after serving
        assert torch.equal(enc(**x).last_hidden_state, before)
        for other in (copy.deepcopy(enc), pickle.loads(pickle.dumps(enc))):
            assert torch.equal(other(**x).last_hidden_state, before)
    with torch.inference_mode():
        assert torch.equal(enc(**x).last_hidden_state, before)
    q = mhf.serve(quantize(_bert()))
    with torch.no_grad():
        y = q(**x).last_hidden_state
        assert torch.equal(pickle.loads(pickle.dumps(q))(**x).last_hidden_state, y)


def test_a_kept_attention_backend_follows_the_registry(monkeypatch):
    """The first layer's attention chooses through multihead.attention; the next layers run that choice
    again, and a change of the registry (backends.use) reaches them within the same call."""
    from multihead import backends

    enc = mhf.serve(_bert())
    x = _batch(pad=False)
    with torch.no_grad():
        ref = enc(**x).last_hidden_state
        with backends.use("math"):
            calls = []
            real = backends.registry.run_kept
            monkeypatch.setattr(backends.registry, "run_kept", lambda *a: calls.append(a[0].backend.name) or real(*a))
            got = enc(**x).last_hidden_state
    assert calls == [] or set(calls) == {"math"}
    assert torch.allclose(ref, got, atol=1e-5)


def test_what_serve_cannot_compute_is_refused_by_name():
    with pytest.raises(TypeError, match="transformers PreTrainedModel"):
        mhf.serve(nn.Linear(2, 2))
    torch.manual_seed(0)
    distil = T.DistilBertModel(T.DistilBertConfig(vocab_size=V, dim=32, n_layers=2, n_heads=4, hidden_dim=64))
    with pytest.raises(ValueError, match="no BERT attention modules"):
        mhf.serve(distil)
    dec = T.BertModel(T.BertConfig(**SMALL, is_decoder=True))
    with pytest.raises(ValueError, match="decoder"):
        mhf.serve(dec)
    model = _bert()
    model.encoder.layer[1].output.LayerNorm = nn.Identity()
    with pytest.raises(ValueError, match=r"encoder\.layer\.1\.output\.LayerNorm is Identity"):
        mhf.serve(model)
    model = _bert()
    model.encoder.layer[2].intermediate.dense = nn.Sequential(nn.Linear(32, 64))
    with pytest.raises(ValueError, match=r"encoder\.layer\.2\.intermediate\.dense is Sequential"):
        mhf.serve(model)


@pytest.mark.parametrize("int8", [False, True])
def test_a_layer_that_computes_otherwise_is_found_by_the_probe(int8):
    """A layer whose forward is not BERT's (here: its feed-forward's residual dropped) has every part,
    so only the comparison can tell; it names the layer (int8 too: the batch without padding is compared
    on the int8 model itself)."""
    model = _bert()
    if int8:
        model = quantize(model)
    out = model.encoder.layer[1].output
    out.forward = lambda h, x: out.LayerNorm(out.dense(h))  # no residual
    with pytest.raises(ValueError, match=r"first layer that differs is encoder\.layer\.1"):
        mhf.serve(model)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("act", ["gelu", "gelu_new", "gelu_python", "relu"])
def test_each_layers_kernels_and_activation_are_resolved_once_and_compute_the_model(act):
    """The served layer resolves its four products' kernels and whether its activation is exactly F.gelu when
    it is built, not per call; an activation that is not (tanh GELU, the python erf form, ReLU) still runs as
    the model's own module, and every one gives the model's hidden states."""
    model = _bert(hidden_act=act)
    for m, kinds in ((model, ("float",) * 4), (quantize(model), None)):
        enc = mhf.serve(m)
        for layer in enc.layers:
            if kinds is not None:
                assert layer.kinds == kinds
            else:
                assert all(isinstance(k, bool) for k in layer.kinds)  # int8: the kernel's reduce_range
            assert layer.exact_gelu == (act == "gelu")
        if m is model:
            for seed in range(2):
                _close(model, enc, _batch(seed=seed))


def test_exact_gelu_is_recognised_only_as_the_erf_form():
    import torch.nn.functional as F
    from transformers.activations import ACT2FN

    assert hf_serve.exact_gelu(nn.GELU()) and hf_serve.exact_gelu(ACT2FN["gelu"])
    assert not hf_serve.exact_gelu(nn.GELU(approximate="tanh"))
    assert not hf_serve.exact_gelu(ACT2FN["gelu_python"]) and not hf_serve.exact_gelu(ACT2FN["gelu_new"])
    assert not hf_serve.exact_gelu(F.gelu)  # a function, not a module: called as it is
    hooked = nn.GELU()
    hooked.register_forward_hook(lambda m, a, out: out * 2)
    assert not hf_serve.exact_gelu(hooked)


def test_bad_inputs_get_one_clear_line():
    enc = mhf.serve(_bert())
    x = _batch()
    with pytest.raises(ValueError, match=r"input_ids must be \(B, L\)"):
        enc(x["input_ids"][0])
    with pytest.raises(ValueError, match=r"attention_mask must be \(B, L\) like input_ids \(4, 11\); got \(4, 10\)"):
        enc(x["input_ids"], x["attention_mask"][:, :10])
    with pytest.raises(ValueError, match="attention_mask must hold 0"):
        enc(x["input_ids"], x["attention_mask"] * 2)
    with pytest.raises(ValueError, match=r"is for prediction: it has no dropout to train with. Call \.eval\(\)"):
        enc.train()(**x)
    enc.eval()
    n = _bert().config.max_position_embeddings  # where transformers' own error is a broadcast's
    with pytest.raises(ValueError, match=rf"input_ids \(B, L\) = \(1, {n + 1}\): the model takes at most {n} tokens"):
        enc(torch.ones(1, n + 1, dtype=torch.long))
    with pytest.raises(ValueError, match=rf"token ids 3\.\.{V}; the model's vocabulary has {V} \(ids 0\.\.{V - 1}\)"):
        enc(torch.tensor([[3, V]]))
    with pytest.raises(ValueError, match=r"token ids -1\.\.5"):
        enc(torch.tensor([[-1, 5]]))
    with pytest.raises(TypeError, match=r"input_ids must be integer ids \(torch.long\); got torch.float32"):
        enc(torch.tensor([[1.0, 5.0]]))  # an IndexError from indexing before
    with pytest.raises(ValueError, match=r"token_type_ids hold ids 0\.\.2; the model has 2 token types \(ids 0\.\.1\)"):
        enc(torch.tensor([[1, 5]]), token_type_ids=torch.tensor([[0, 2]]))  # an IndexError before


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_fused_layers_are_the_separate_layers_side_by_side():
    torch.manual_seed(0)
    parts = nn.ModuleList([nn.Linear(24, 8), nn.Linear(24, 16), nn.Linear(24, 4)])
    x = torch.randn(2, 5, 24)
    terms = torch.cat([x.abs() @ m.weight.abs().T + m.bias.abs() for m in parts], -1)  # (2, 5, 28) |x| |W|
    for layers in (parts, quantize(parts)):
        f = fused(*layers)
        want = torch.cat([m(x) for m in layers], -1)
        if layers is parts:  # float: the same products, summed in the GEMM's own blocking order
            assert bool(((f(x) - want).abs() <= 24 * torch.finfo(x.dtype).eps * terms).all())
        else:  # int8: the same rows, scales and activation rounding, integer sums: bit for bit
            assert torch.equal(f(x), want)
        assert torch.equal(linear(f, x), f(x))
        for m in layers:
            assert torch.equal(linear(m, x), m(x))
    with pytest.raises(TypeError, match="of one kind"):
        fused(parts[0], quantize(parts)[1])
    with pytest.raises(ValueError, match=r"in_features \[24, 12\]"):
        fused(parts[0], nn.Linear(12, 3))
    with pytest.raises(ValueError, match="every layer has a bias or none"):
        fused(parts[0], nn.Linear(24, 3, bias=False))
    with pytest.raises(TypeError, match="neither nn.Linear"):
        linear(nn.Conv1d(2, 2, 1), x)
    with pytest.raises(TypeError, match="neither nn.Linear"):
        kernel_kind(nn.Conv1d(2, 2, 1))
    for m in (*parts, *quantize(parts)):  # the kind resolved once gives the same product
        assert torch.equal(linear(m, x, kind=kernel_kind(m)), m(x))
    from torch.ao.quantization import float16_dynamic_qconfig, quantize_dynamic

    half = quantize_dynamic(nn.Sequential(nn.Linear(24, 8)), {nn.Linear: float16_dynamic_qconfig})[0]  # not int8
    with pytest.raises(TypeError, match="neither nn.Linear"):
        linear(half, x)  # after int8 layers of the same class went through


FAMILIES = {  # tiny configs of families serve was not written against: served, or refused in one line naming why
    "xlm-roberta": (lambda: T.XLMRobertaModel(T.XLMRobertaConfig(**SMALL, pad_token_id=1)), None),
    "ernie": (lambda: T.ErnieModel(T.ErnieConfig(**SMALL)), None),
    "data2vec-text": (lambda: T.Data2VecTextModel(T.Data2VecTextConfig(**SMALL, pad_token_id=1)), None),
    "bert-masked-lm": (lambda: T.BertForMaskedLM(T.BertConfig(**SMALL)), None),
    "albert": (lambda: T.AlbertModel(T.AlbertConfig(**SMALL, embedding_size=16)), "no BERT attention modules"),
    "xlm-roberta-xl": (lambda: T.XLMRobertaXLModel(T.XLMRobertaXLConfig(**SMALL, pad_token_id=1)),
                       r"encoder\.layer\.0 \(XLMRobertaXLLayer\) has no attention\.output\.LayerNorm"),
    "rembert": (lambda: T.RemBertModel(T.RemBertConfig(**SMALL, input_embedding_size=16, output_embedding_size=32)),
                "does not receive the embeddings' output"),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_other_families_are_served_exactly_or_refused_by_name(family):
    make, refusal = FAMILIES[family]
    torch.manual_seed(0)
    model = make().eval()
    if refusal is not None:
        with pytest.raises(ValueError, match=refusal):
            mhf.serve(model)
        return
    enc = mhf.serve(model)
    base = model.base_model
    for x in (_batch(), _batch(seed=1, pad=False)):
        _close(base, enc, x)
