"""multihead.hf.export_onnx: a pruned (and padding-free) transformers model written as ONNX; ONNX
Runtime's and OpenVINO's outputs equal the torch model's within 1e-4 on real tokens at batch sizes and lengths
the export never saw. Needs the onnx extra (onnx, onnxscript, onnxruntime) and the openvino extra, which
`make test` installs."""

from __future__ import annotations

import importlib.util
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("onnxscript")
ort = pytest.importorskip("onnxruntime")
import multihead.hf as mhf  # noqa: E402
from multihead import heads  # noqa: E402
from multihead.quantize import quantize  # noqa: E402

warnings.filterwarnings("ignore", message=".*token_id.*")
transformers.logging.set_verbosity_error()
T = transformers


def _bert(packed):
    torch.manual_seed(0)
    cfg = T.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                       intermediate_size=64)
    return mhf.attach(T.BertModel(cfg).eval(), packed=packed)


def _runtime(kind: str, f):
    """(inputs as numpy) -> the first output, from the ONNX file ``f`` in ONNX Runtime or OpenVINO (CPU, fp32,
    one thread)."""
    if kind == "onnxruntime":
        session = ort.InferenceSession(str(f))
        return lambda feed: session.run(None, feed)[0]
    ov = pytest.importorskip("openvino")  # the openvino extra, which `make test` installs
    compiled = ov.Core().compile_model(str(f), "CPU", {"INFERENCE_PRECISION_HINT": "f32", "INFERENCE_NUM_THREADS": 1})
    return lambda feed: compiled(feed)[compiled.output(0)]


@pytest.mark.parametrize("packed", [False, True])
def test_a_pruned_model_exported_to_onnx_gives_the_same_outputs_in_onnx_runtime_and_openvino(tmp_path, packed):
    """One export (the exporter takes seconds even here), read by both runtimes."""
    model = _bert(packed)
    heads.prune(model, {"encoder.layer.0.attention.self": [1, 3], "encoder.layer.1.attention.self": [0]})
    f = mhf.export_onnx(model, tmp_path / "m.onnx")
    for runtime in ("onnxruntime", "openvino"):
        run = _runtime(runtime, f)
        for B, L in ((3, 9), (2, 17), (1, 1)):
            g = torch.Generator().manual_seed(B * 100 + L)
            ids = torch.randint(3, 100, (B, L), generator=g)
            am = torch.ones(B, L, dtype=torch.long)
            am[B - 1, max(1, L // 3):] = 0
            tt = (torch.arange(L) >= L // 2).long().expand(B, L)  # (B, L): two segments, as BERT's tokenizer gives
            got = torch.from_numpy(run({"input_ids": ids.numpy(), "attention_mask": am.numpy(),
                                        "token_type_ids": tt.numpy()}))
            with torch.no_grad():
                want = model(input_ids=ids, attention_mask=am, token_type_ids=tt).last_hidden_state
            keep = am.bool()
            assert got.shape == want.shape, runtime
            assert (got[keep] - want[keep]).abs().max() <= 1e-4, runtime


def test_export_refuses_what_it_cannot_write(tmp_path):
    model = _bert(False)
    with pytest.raises(ValueError, match=r"export_onnx: the model is quantized"):
        mhf.export_onnx(quantize(model), tmp_path / "q.onnx")
    ids = torch.randint(3, 100, (2, 5))
    with pytest.raises(ValueError, match=r"attention_mask must be a \(B, L\) padding mask of 0 and 1 like input_ids "
                                         r"\(2, 5\); got \(2, 1, 5, 5\)"):
        mhf.export_onnx(model, tmp_path / "m.onnx", example={"input_ids": ids,
                                                              "attention_mask": torch.ones(2, 1, 5, 5)})
    lm = mhf.attach(T.LlamaForCausalLM(T.LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64,
                                                     num_hidden_layers=1, num_attention_heads=4,
                                                     num_key_value_heads=2)).eval())
    with pytest.raises(ValueError, match=r"a decoder would make a key/value cache; set model.config.use_cache = False"):
        mhf.export_onnx(lm, tmp_path / "lm.onnx")
    with pytest.raises(TypeError, match=r"export_onnx takes a transformers PreTrainedModel; got Linear"):
        mhf.export_onnx(torch.nn.Linear(2, 2), tmp_path / "x.onnx")


def test_a_model_saved_int8_loads_back_float_for_export_and_other_runtimes_quantize_it(tmp_path):
    """save(quantize="int8") keeps the float weights: load(quantized=False) gives the pruned float model exactly
    (load() the int8 one), and its export quantized by ONNX Runtime (onnx.ort_int8) stays close to it."""
    from multihead.deploy import onnx
    from multihead.quantize import is_quantized

    model = _bert(True)
    heads.prune(model, {"encoder.layer.0.attention.self": [1, 3]})
    mhf.save(model, tmp_path / "m", quantize="int8")
    loaded, as_float = mhf.load(tmp_path / "m"), mhf.load(tmp_path / "m", quantized=False)
    assert is_quantized(loaded) == "int8" and not is_quantized(as_float)
    g = torch.Generator().manual_seed(5)
    ids, am = torch.randint(3, 100, (3, 11), generator=g), torch.ones(3, 11, dtype=torch.long)
    am[2, 4:] = 0
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=am).last_hidden_state
        assert torch.equal(as_float(input_ids=ids, attention_mask=am).last_hidden_state, want)
    served = onnx.ort_int8(onnx.export(as_float, {"input_ids": ids, "attention_mask": am}))
    got = served(input_ids=ids, attention_mask=am).last_hidden_state
    keep = am.bool()
    cos = torch.nn.functional.cosine_similarity(got[keep], want[keep], dim=-1)
    assert cos.min() > 0.99  # int8 rounding, not another model


def test_the_same_model_is_exported_once_per_process_and_a_changed_one_again():
    """onnx.export caches by content (class, config, every tensor): the same checkpoint gives the same file,
    a pruned or gated one its own export."""
    from multihead.deploy import onnx

    model = _bert(False)
    ex = {"input_ids": torch.randint(3, 100, (2, 7)), "attention_mask": torch.ones(2, 7, dtype=torch.long)}
    first = onnx.export(model, ex)
    assert onnx.export(_bert(False), ex) == first  # built again from the same seed: the same weights
    assert onnx.export(_bert(True), ex) == first  # padding-free: exported padded, the same graph
    pruned = _bert(False)
    heads.prune(pruned, {"encoder.layer.0.attention.self": [1]})
    assert onnx._fingerprint(pruned) != onnx._fingerprint(model)
    with heads.gated(model, {"encoder.layer.0.attention.self": torch.tensor([1.0, 0.0, 1.0, 1.0])}):
        assert onnx._fingerprint(model) is None  # a gate is not in the weights: never cached


def test_the_runtime_files_a_process_makes_are_removed_when_it_ends(tmp_path):
    """session.scratch: each call a new empty folder inside one folder of the process's, under the temporary folder;
    gone when the process ends, normally or by an exception (the standard files are ~0.8 GB of an encoder's run)."""
    import os
    import subprocess
    import sys

    code = ("import sys\nfrom multihead.deploy import session\na, b = session.scratch(), session.scratch()\n"
            "assert a != b and a.parent == b.parent and not any(a.iterdir())\n(a / 'f.onnx').write_bytes(b'x' * 10)\n"
            "print(a)\nif sys.argv[1] == 'raise':\n    raise RuntimeError('ended by an exception')\n")
    for end in ("return", "raise"):
        tmp = tmp_path / end
        tmp.mkdir()
        run = subprocess.run([sys.executable, "-c", code, end], env={**os.environ, "TMPDIR": str(tmp)},
                             capture_output=True, text=True, timeout=120)
        assert (run.returncode != 0) == (end == "raise"), run.stderr
        made = run.stdout.strip().splitlines()[-1]
        assert made.startswith(str(tmp / "multihead-runtimes-")), made  # it was under the temporary folder
        assert list(tmp.iterdir()) == [], (end, list(tmp.iterdir()))


def test_export_refuses_heads_cut_by_gates_or_stored_as_zeros(tmp_path):
    """Never the full-size model with zeros: a model whose heads a gate cuts, or a pruned directory read at full
    size by transformers (its pruned heads zero), is refused naming the module and the way to its pruned size."""
    model = _bert(False)
    with heads.gated(model, {"encoder.layer.1.attention.self": torch.tensor([1.0, 0.0, 1.0, 1.0])}):
        with pytest.raises(ValueError, match=r"export: encoder.layer.\d.attention.self \(BertSelfAttention\) has hooks "
                                             r"that change its heads .* cut the heads with heads.prune"):
            mhf.export_onnx(model, tmp_path / "g.onnx")
    heads.prune(model, {"encoder.layer.0.attention.self": [1, 3]})
    mhf.save(model, tmp_path / "m")  # one key/value head per query head: stored at full size, pruned heads zero
    full = mhf.attach(T.BertModel.from_pretrained(tmp_path / "m").eval())
    with pytest.raises(ValueError, match=r"export: encoder.layer.0.attention.self \(BertSelfAttention\) holds heads "
                                         r"\[1, 3\] of 4 whose output weights are all zero .* multihead.hf.load\(DIR\)"):
        mhf.export(full, tmp_path / "full")
    assert not (tmp_path / "full" / "onnx" / "model.onnx").exists()
    written = mhf.export(mhf.load(tmp_path / "m"), tmp_path / "cut")  # loaded by multihead: at its pruned size
    assert written["onnx"] == tmp_path / "cut" / "onnx" / "model.onnx" and written["onnx_int8"].is_file()


def test_fastembed_loads_the_pruned_folder_as_a_custom_model(tmp_path):
    """fastembed (ONNX Runtime inside) reads a pruned model's folder, onnx/model.onnx beside the tokenizer, as a
    custom model (multihead.hf.fastembed registers it): its embeddings equal the pruned torch model's mean-pooled,
    normalised output; the int8 file's stay within int8 rounding of them."""
    pytest.importorskip("fastembed")  # the fastembed extra, which `make test` installs
    from tokenizers import Tokenizer, models, pre_tokenizers

    from multihead.apps.prune.hf_models import pooled

    model = _bert(False)
    heads.prune(model, {"encoder.layer.0.attention.self": [1, 3], "encoder.layer.1.attention.self": [0, 2]})
    words = [f"w{i}" for i in range(97)]
    tok = Tokenizer(models.WordLevel(vocab={"[PAD]": 0, "[UNK]": 1, **{w: i + 3 for i, w in enumerate(words)}},
                                     unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    d = tmp_path / "pruned"
    mhf.save(model, d)
    T.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]",
                              model_max_length=64).save_pretrained(d)
    mhf.export(model, d)
    texts = ["w1 w5 w9 w33", "w2 w8", "w90 w91 w92 w93 w94 w95 w96"]
    enc = T.AutoTokenizer.from_pretrained(d)(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        want = pooled(model, enc["input_ids"], enc["attention_mask"])  # (3, E)
    for int8, tol in ((False, 1e-4), (True, 0.05)):
        embed = mhf.fastembed(d, int8=int8)
        got = torch.from_numpy(__import__("numpy").stack(list(embed.embed(texts))))  # (3, E)
        assert (got - want).abs().max() < tol, int8
    _served_is_the_fastest(d)
    with pytest.raises(ValueError, match=r"fastembed: .* has no onnx/model.onnx beside a config.json"):
        mhf.fastembed(tmp_path)


def _served_is_the_fastest(d):
    """Each file to serve export wrote (no serve_batch: the best geometric mean over the batch sizes it timed) is the
    same bytes as the form its own timing, in export.json, found fastest; the CPU's flags are recorded."""
    import filecmp
    import json
    import math

    from multihead.timing import cpu_flags

    record = json.loads((d / "onnx" / "export.json").read_text())["serve"]
    assert record["cpu_flags"] == cpu_flags() and record["serve_batch"] is None
    runtimes = {label: r for label, r in record.items() if isinstance(r, dict)}
    assert {"ONNX Runtime fp32", "ONNX Runtime int8"} <= set(runtimes)
    for r in runtimes.values():
        best = min(r["ms"], key=lambda k: sum(math.log(v) for v in r["ms"][k].values()))
        assert r["key"] == best and filecmp.cmp(d / r["file"], d / r["files"][best], shallow=False)
        assert set(r["ms"][best]) == {"1", "16", "64"}


def test_a_missing_extra_is_named(tmp_path, monkeypatch):
    """fastembed or OpenVINO asked for where the package is missing: the ImportError names the extra."""
    import sys

    model = _bert(False)
    monkeypatch.setitem(sys.modules, "fastembed", None)  # import fastembed -> ImportError
    with pytest.raises(ImportError, match=r"multihead.hf.fastembed needs fastembed, which is not installed: pip "
                                          r"install 'multihead\[fastembed\]'"):
        mhf.fastembed(tmp_path)
    monkeypatch.setitem(sys.modules, "openvino", None)
    with pytest.raises(ImportError, match=r"OpenVINO IR export needs openvino, which is not installed: pip install "
                                          r"'multihead\[openvino\]'"):
        mhf.export(model, tmp_path / "m", openvino=True)
    assert set(mhf.export(model, tmp_path / "n")) == {"onnx", "onnx_int8", "onnx_eager", "onnx_eager_int8", "onnx_optimized",
                                                      "onnx_optimized_int8", "onnx_attention", "onnx_attention_int8",
                                                      "serve", "serve_int8"}  # ONNX only


def test_a_layer_with_every_head_cut_is_exported_at_its_size(tmp_path):
    """A layer left with no head (its output is the projection's bias) exports and runs like the torch model in
    ONNX Runtime; OpenVINO's converter refuses zero-size weights, which export says in a warning (no openvino/)."""
    model = _bert(False)
    heads.prune(model, {"encoder.layer.1.attention.self": [0, 1, 2, 3], "encoder.layer.0.attention.self": [2]})
    if importlib.util.find_spec("openvino"):
        with pytest.warns(RuntimeWarning, match=r"export: OpenVINO cannot read .*model.onnx .*no openvino/ folder"):
            written = mhf.export(model, tmp_path / "m")
        assert "openvino" not in written and not (tmp_path / "m" / "openvino").exists()
    else:
        written = mhf.export(model, tmp_path / "m")
    session = ort.InferenceSession(str(written["onnx"]))
    ids, am = torch.randint(3, 100, (2, 9)), torch.ones(2, 9, dtype=torch.long)
    got = session.run(None, {"input_ids": ids.numpy(), "attention_mask": am.numpy(),
                             "token_type_ids": torch.zeros_like(ids).numpy()})[0]
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=am).last_hidden_state
    assert (torch.from_numpy(got) - want).abs().max() < 1e-4
    # transformers' SDPA graph cannot reshape a layer of zero heads (-1 of zero elements): multihead's graph, said so
    import json

    assert json.loads((tmp_path / "m" / "onnx" / "export.json").read_text())["attention"] == "multihead"


def _ops(f) -> list[str]:
    """The graph's operators, sorted (one entry per node), read with onnx."""
    import onnx

    return sorted(n.op_type for n in onnx.load(str(f), load_external_data=False).graph.node)


def test_the_export_is_the_standard_graph_at_the_pruned_size(tmp_path):
    """Round 6 found multihead's export of the unpruned MiniLM 1.28x slower in ONNX Runtime than the standard export
    (its graph was multihead's attention function, not the one ONNX Runtime is tuned for). Now the file is the
    transformers graph users export: unpruned, the same operators as ``torch.onnx.export`` of the sdpa model (the
    peer, peers.standard_files); pruned, the same operators at the pruned size. The optimized file is the eager graph
    ONNX Runtime's optimizer fuses each layer's attention in (the peer's eager candidate's operators), each layer's
    Attention op at its own head count; the attention form is that file with the GELU left unfused. Each file (fp32,
    optimized, int8) equals the torch model within its rounding."""
    import json

    from multihead.deploy import peers
    from multihead.deploy.onnx import EXPORT_JSON, ONNX_DIR

    model = _bert(False)
    torch.manual_seed(0)
    peer = T.BertModel(model.config.__class__(**{**model.config.to_dict(), "_attn_implementation": "sdpa"})).eval()
    peer.load_state_dict(model.state_dict())
    ex = {"input_ids": torch.randint(3, 100, (2, 7)), "attention_mask": torch.ones(2, 7, dtype=torch.long)}
    std = peers.standard_files(peer, ex, openvino=False)
    assert {"onnx", "onnx_int8", "onnx_optimized", "onnx_optimized_int8", "onnx_eager", "onnx_eager_int8",
            "onnx_eager_optimized", "onnx_eager_optimized_int8"} <= set(std)
    ours = mhf.export(model, tmp_path / "u", openvino=False)
    assert _ops(ours["onnx"]) == _ops(std["onnx"])
    assert _ops(ours["onnx_optimized"]) == _ops(std["onnx_eager_optimized"])
    meta = json.loads((tmp_path / "u" / ONNX_DIR / EXPORT_JSON).read_text())
    assert meta["attention"] == "sdpa" and meta["optimizer"]["written"] and meta["optimizer"]["note"] is None
    assert meta["optimizer"]["fused"]["Attention"] == 2 and meta["optimizer"]["fused"]["SkipLayerNormalization"] > 0
    assert meta["optimizer"]["graph"].startswith("eager attention")
    assert model.config._attn_implementation == "multihead"  # restored after the export

    heads.prune(model, {"encoder.layer.0.attention.self": [1, 3], "encoder.layer.1.attention.self": [0]})
    cut = mhf.export(model, tmp_path / "p", openvino=False)
    assert _ops(cut["onnx"]) == _ops(std["onnx"])
    import onnx

    shapes = {tuple(t.dims) for t in onnx.load(str(cut["onnx"])).graph.initializer}
    assert (32, 16) in shapes and (32, 24) in shapes  # layer 0 keeps 2 heads of 8, layer 1 keeps 3
    assert _ops(cut["onnx_optimized"]) == _ops(std["onnx_eager_optimized"])
    # the eager form: the peer's plain export of the eager-attention model at the pruned size, the same products and
    # softmaxes (no fused op; the mask's own nodes may differ)
    def compute(f):
        return [o for o in _ops(f) if o in ("MatMul", "Softmax", "Attention", "MultiHeadAttention")]

    assert compute(cut["onnx_eager"]) == compute(std["onnx_eager"]) and "Softmax" in compute(std["onnx_eager"])
    for key, op in (("onnx_optimized", "Attention"), ("onnx_optimized_int8", "QAttention"),
                    ("onnx_attention", "Attention"), ("onnx_attention_int8", "QAttention")):
        fused = [n for n in onnx.load(str(cut[key])).graph.node if n.op_type == op]
        assert [onnx.helper.get_attribute_value(a) for n in fused for a in n.attribute if a.name == "num_heads"] == [2, 3]
    # the fused-attention form without the GELU fusion: the optimized file's operators, each layer's fused GELU
    # (BiasGelu) back as the exported bias Add and Gelu's Erf arithmetic; nothing else differs
    attention_ops, optimized_ops = _ops(cut["onnx_attention"]), _ops(cut["onnx_optimized"])
    assert "BiasGelu" in optimized_ops and "BiasGelu" not in attention_ops and "Erf" in attention_ops
    assert [o for o in attention_ops if o not in ("Add", "Div", "Erf", "Mul")] == \
        [o for o in optimized_ops if o not in ("Add", "Div", "Erf", "Mul", "BiasGelu")]
    meta = json.loads((tmp_path / "p" / ONNX_DIR / EXPORT_JSON).read_text())
    assert meta["attention_form"]["written"] and meta["attention_form"]["fused"]["Attention"] == 2
    g = torch.Generator().manual_seed(3)
    ids, am = torch.randint(3, 100, (3, 13), generator=g), torch.ones(3, 13, dtype=torch.long)
    am[2, 5:] = 0
    feed = {"input_ids": ids.numpy(), "attention_mask": am.numpy(), "token_type_ids": torch.zeros_like(ids).numpy()}
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=am).last_hidden_state[am.bool()]  # (N, E) the real tokens
    for key in ("onnx", "onnx_optimized", "onnx_eager", "onnx_attention", "onnx_int8", "onnx_optimized_int8",
                "onnx_eager_int8", "onnx_attention_int8"):
        got = torch.from_numpy(ort.InferenceSession(str(cut[key])).run(None, feed)[0])[am.bool()]
        err = float((got - want).abs().max())
        # fp32: float rounding; int8: weights rounded to 1/254 of each channel's range, activations per call
        bound = 1e-4 if "int8" not in key else 0.1 * float(want.abs().max())
        assert err <= bound, (key, err)
        assert torch.nn.functional.cosine_similarity(got, want, dim=-1).min() > (0.999999 if "int8" not in key else 0.99)


def test_the_runtime_table_times_the_pruned_file_against_the_standard_export(tmp_path):
    """The peer of each row is the fastest standard file of the unpruned model; multihead's own export of the unpruned
    model is a column (its ratio to the peer), never the baseline; the speed-up is the peer's time over the pruned
    file's, read round by round (the median of the rounds' ratios, in its 95% interval), beside the bound."""
    from multihead.deploy import compare, peers, session

    model = _bert(False)
    peer = T.BertModel(model.config.__class__(**{**model.config.to_dict(), "_attn_implementation": "sdpa"})).eval()
    peer.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(4)
    batches = [{"input_ids": torch.randint(3, 100, (4, 9), generator=g), "attention_mask": torch.ones(4, 9,
                                                                                                   dtype=torch.long)}]
    std = peers.standard_files(peer, batches[0], openvino=False)
    assert all(f.is_relative_to(session._SCRATCH.name) for f in std.values())  # removed when the process ends
    base = mhf.export(model, tmp_path / "u", openvino=False)
    import copy

    kept = copy.deepcopy(model)
    heads.prune(kept, {"encoder.layer.0.attention.self": [0, 1], "encoder.layer.1.attention.self": [2]})
    files = mhf.export(kept, tmp_path / "p", openvino=False)
    rows = compare.compare(model, kept, std, base, files, {4: batches}, max_seconds=0.5)
    assert [r["runtime"] for r in rows] == ["ONNX Runtime fp32", "ONNX Runtime int8"]
    for r in rows:
        assert r["peer"] in peers.STANDARD.values() and set(r["standard"]) <= set(peers.STANDARD.values())
        assert r["peer_ms"]["median_ms"] == min(t["median_ms"] for t in r["standard"].values())
        for got, other in ((r["speedup"], r["pruned_ms"]), (r["unpruned_vs_peer"], r["unpruned_ms"])):
            # each a median of the rounds' ratios: within what the two sides' extremes allow
            assert r["peer_ms"]["min_ms"] / other["max_ms"] - 1e-3 <= got <= r["peer_ms"]["max_ms"] / other["min_ms"] + 1e-3
        assert r["range"][0] - 1e-3 <= r["speedup"] <= r["range"][1] + 1e-3  # its 95% interval holds it
        keys = next(keys for label, keys, _ in compare.RUNTIMES if label == r["runtime"])
        assert set(r["forms"]) == {k for k in keys if k in files}  # every pruned form timed, the file to serve one
        assert r["bound"] > 1 and r["pruned_file"] in r["forms"] and "onnx_attention" in files
    table = compare.markdown(rows)
    assert "peer: the standard export" in table and "torch.onnx.export" in table
    # every standard file's time, not only the fastest one's: the plain export and the optimized one side by side
    every = table.split("each standard file of the unpruned model")[1]
    for r in rows:
        assert all(f"{k}: {t['median_ms']:.2f}" in every for k, t in r["standard"].items()), r["standard"]


@pytest.mark.parametrize("packed", [False, True])
def test_openvino_files_come_from_the_pytorch_model_as_optimum_intel_converts(tmp_path, packed):
    """export's OpenVINO IR of a pruned model is the model itself through OpenVINO's PyTorch frontend (export.json says
    so; each layer's projections at its kept heads), named like the model's output, and equals the torch model within
    1e-4 on real tokens at sizes the conversion never saw; the standard files hold the unpruned model converted the
    same way (optimum-intel's route) beside the ONNX file's conversion, both equal to that model."""
    import json

    ov = pytest.importorskip("openvino")
    from multihead.deploy import peers
    from multihead.deploy.onnx import EXPORT_JSON, ONNX_DIR

    model = _bert(packed)
    peer = T.BertModel(model.config.__class__(**{**model.config.to_dict(), "_attn_implementation": "sdpa"})).eval()
    peer.load_state_dict(model.state_dict())
    heads.prune(model, {"encoder.layer.0.attention.self": [1, 3], "encoder.layer.1.attention.self": [0]})
    written = mhf.export(model, tmp_path / "p", openvino=True)
    meta = json.loads((tmp_path / "p" / ONNX_DIR / EXPORT_JSON).read_text())
    assert meta["openvino"].startswith("openvino.convert_model of the PyTorch model"), meta
    ir = ov.Core().read_model(str(written["openvino"]))
    assert "last_hidden_state" in ir.outputs[0].get_names()
    widths = {tuple(op.get_output_shape(0)) for op in ir.get_ops() if op.get_type_name() == "Constant"}
    assert (16, 32) in widths and (24, 32) in widths  # q/k/v weights (out, in): 2 heads of 8, then 3
    ex = {"input_ids": torch.randint(3, 100, (2, 7)), "attention_mask": torch.ones(2, 7, dtype=torch.long)}
    std = peers.standard_files(peer, ex, openvino=True)
    assert {"openvino", "openvino_pt"} <= set(std)
    # the attention ops read the padding mask from the input; the standard conversion keeps transformers' mask graph
    assert "mask read from attention_mask" in meta["openvino"], meta
    assert "reshapes to the same shape after attention ops left out" in meta["openvino"], meta
    after = [list(o.output(0).get_target_inputs())[0].get_node().get_type_name() for o in ir.get_ordered_ops()
             if o.get_type_name() == "ScaledDotProductAttention"]
    assert after == ["Transpose", "Transpose"], after  # no reshape between the attention op and its transpose
    assert len(ir.get_ordered_ops()) < len(ov.Core().read_model(str(std["openvino_pt"])).get_ordered_ops())
    for f, want_model in ((written["openvino"], model), (std["openvino_pt"], peer), (std["openvino"], peer)):
        run = _runtime("openvino", f)
        for B, L in ((3, 9), (1, 1)):
            g = torch.Generator().manual_seed(B * 100 + L)
            ids, am = torch.randint(3, 100, (B, L), generator=g), torch.ones(B, L, dtype=torch.long)
            am[B - 1, max(1, L // 3):] = 0
            tt = torch.zeros_like(ids)
            got = torch.from_numpy(run({"input_ids": ids.numpy(), "attention_mask": am.numpy(),
                                        "token_type_ids": tt.numpy()}))
            with torch.no_grad():
                want = want_model(input_ids=ids, attention_mask=am, token_type_ids=tt).last_hidden_state
            assert (got[am.bool()] - want[am.bool()]).abs().max() <= 1e-4, (f, B, L)


class _Masked(torch.nn.Module):
    """Token embeddings and one SDPA layer of 2 heads of 4 whose mask is the key padding mask ("padding"), or one
    that equals it on some inputs only: keys at most 16 or 2 positions away ("band16": equal up to length 16;
    "band2"), the first attention_mask.sum() keys ("lengths": equal where the padding is at the right), the keys
    whose token is not 0 ("tokens": equal where no real token is 0)."""

    def __init__(self, kind: str, longest: int, **config):
        super().__init__()
        import types

        torch.manual_seed(0)
        self.config = types.SimpleNamespace(max_position_embeddings=longest, vocab_size=100, **config)
        self.emb, self.qkv, self.kind = torch.nn.Embedding(100, 8), torch.nn.Linear(8, 24), kind

    def forward(self, input_ids, attention_mask):
        B, L = input_ids.shape
        q, k, v = self.qkv(self.emb(input_ids)).view(B, L, 3, 2, 4).permute(2, 0, 3, 1, 4).unbind(0)  # (B, H, L, D)
        i = torch.arange(L)
        mask = attention_mask.bool()[:, None, None, :]  # (B, 1, 1, Lk)
        if self.kind.startswith("band"):
            mask = mask & ((i[:, None] - i[None, :]).abs() <= int(self.kind[4:]))  # (B, 1, Lq, Lk)
        elif self.kind == "lengths":
            mask = (i[None, :] < attention_mask.sum(-1, keepdim=True))[:, None, None, :]  # (B, 1, 1, Lk)
        elif self.kind == "tokens":
            mask = mask & (input_ids != 0)[:, None, None, :]  # (B, 1, 1, Lk)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, H, L, D)


@pytest.mark.parametrize("kind, longest, config, rewritten", [
    ("padding", 64, {}, True), ("band16", 64, {}, False), ("band2", 64, {}, False), ("lengths", 64, {}, False),
    ("tokens", 64, {}, False), ("padding", 4096, {}, False), ("padding", 64, {"sliding_window": 512}, False)])
def test_openvino_attention_mask_is_read_from_the_input_only_where_the_traced_mask_is_the_padding_mask(
        kind, longest, config, rewritten):
    """padding_mask_only gives each OpenVINO attention op the key padding mask straight from attention_mask where
    the traced mask equals it at a short length and at the longest the model takes, on padding at the right, the
    left and in holes and on tokens 0-2 (outputs unchanged, fewer nodes). Left as converted, node for node: a local
    window (16: equal to the padding mask at length 7, not at 64; 2: at neither), a mask from the row's length (equal
    where the padding is at the right only), one from the tokens (equal where no real token is 0), a model taking
    more than 2048 positions, and one whose config names a window."""
    ov = pytest.importorskip("openvino")
    from multihead.deploy.openvino import padding_mask_only

    toy = _Masked(kind, longest, **config).eval()
    ex = {"input_ids": torch.randint(3, 100, (2, 9)), "attention_mask": torch.ones(2, 9, dtype=torch.long)}
    with torch.no_grad():
        ir = ov.convert_model(toy, example_input=ex)
    before = len(ir.get_ordered_ops())
    got = padding_mask_only(ir, toy)
    assert (got is not None) == rewritten, got
    if not rewritten:
        assert len(ir.get_ordered_ops()) == before
        return
    assert got == (7, longest) and len(ir.get_ordered_ops()) < before
    sdpa = [o for o in ir.get_ordered_ops() if o.get_type_name() == "ScaledDotProductAttention"]
    feeding = sdpa[0].input(3).get_source_output().get_node()  # Unsqueeze(Convert(attention_mask))
    assert feeding.input(0).get_source_output().get_node().input(0).get_source_output().get_node() \
        .get_friendly_name() == "attention_mask"
    run = ov.Core().compile_model(ir, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    for B, L in ((3, 11), (1, 64)):
        ids, am = torch.randint(0, 100, (B, L)), torch.ones(B, L, dtype=torch.long)
        am[B - 1, L // 3:] = 0
        am[0, :2] = 0  # left padding too
        with torch.no_grad():
            want = toy(ids, am)
        out = torch.from_numpy(run({"input_ids": ids.numpy(), "attention_mask": am.numpy()})[0])
        assert (out - want).abs().max() <= 1e-5, (B, L)


def test_a_failed_simplification_keeps_the_verified_openvino_conversion():
    """_simplified returns the verified model itself, saying why, where the rewritten copy fails its check against
    the torch model (or a rewrite raises): a rewrite never costs the export its OpenVINO file."""
    ov = pytest.importorskip("openvino")
    from multihead.deploy.openvino import _simplified

    toy = _Masked("padding", 64).eval()
    ex = {"input_ids": torch.randint(3, 100, (2, 9)), "attention_mask": torch.ones(2, 9, dtype=torch.long)}
    with torch.no_grad():
        ir = ov.convert_model(toy, example_input=ex)
    n = len(ir.get_ordered_ops())

    def refuse(model, what):
        raise RuntimeError(f"{what} differs")

    got, how = _simplified(ir, toy, "converted", refuse)
    assert got is ir and len(got.get_ordered_ops()) == n
    assert how == "converted; left as converted (simplifying it failed: RuntimeError: the PyTorch model's OpenVINO " \
                  "conversion, simplified differs)"
    kept, said = _simplified(ir, toy, "converted", lambda model, what: model)
    assert kept is not ir and len(kept.get_ordered_ops()) < n and "mask read from attention_mask" in said


@pytest.mark.parametrize("target, users, dropped", [((0, 2, 0, 4), 1, 1), ((0, 1, 0, 8), 1, 0), ((0, 2, 0, 4), 2, 0)])
def test_openvino_reshape_after_attention_is_left_out_only_where_it_keeps_every_dimension(target, users, dropped):
    """identity_reshapes leaves out a Reshape right after an attention op only where its constant target keeps every
    dimension ((0, H, 0, D), 0 copying the dynamic B and L); one that regroups the heads, or whose attention output
    has another user, stays; the outputs are unchanged either way."""
    import numpy as np

    ov = pytest.importorskip("openvino")
    from openvino import opset13 as ops

    from multihead.deploy.openvino import identity_reshapes

    qkv = [ops.parameter([-1, 2, -1, 4], np.float32, name=n) for n in "qkv"]  # (B, H, L, D)
    att = ops.scaled_dot_product_attention(*qkv, causal=False)  # (B, H, L, D)
    outs = [ops.relu(ops.reshape(att, np.array(target), special_zero=True))] + [ops.negative(att)] * (users - 1)
    ir = ov.Model(outs, qkv)
    feed = {n: np.random.default_rng(i).standard_normal((3, 2, 5, 4)).astype(np.float32) for i, n in enumerate("qkv")}
    f32 = {"INFERENCE_PRECISION_HINT": "f32"}  # no bf16 where the CPU has it
    before = [ov.Core().compile_model(ir, "CPU", f32)(feed)[i] for i in range(users)]
    assert identity_reshapes(ir) == dropped
    assert sum(o.get_type_name() == "Reshape" for o in ir.get_ordered_ops()) == 1 - dropped
    after = ov.Core().compile_model(ir, "CPU", f32)(feed)
    # the same arithmetic up to float32 rounding (a kernel fused differently may sum in another order)
    gaps = [float(np.abs(after[i] - before[i]).max()) for i in range(users)]
    assert max(gaps) <= 1e-6, gaps


def _quantized_attention(case: str):
    """An OpenVINO model shaped like NNCF's int8 attention: x (B, L, 8) -> query and key products with int8 weights
    (a scale per output channel, a bias, the output quantized: limits per tensor for one, per channel for the other),
    reshaped to (B, 2, L, 4); a float value product; one attention op. ``case`` breaks one thing the merge needs:
    "other input" (the key reads another tensor), "levels" (the key quantized to 16 levels), "zero point" (the key's
    weights shifted before their scale), "input scale" (the key's scale on its input channels, (1, E): N == E here, so
    only the axis tells it from NNCF's (N, 1))."""
    import numpy as np
    import openvino as ov
    from openvino import opset13 as ops

    rng = np.random.default_rng(3)
    x, x2 = (ops.parameter([-1, -1, 8], np.float32, name=n) for n in ("x", "x2"))

    def product(inp, limits, levels=256, zero=False, scale=(8, 1)):
        w = ops.convert(ops.constant(rng.integers(-127, 128, (8, 8)).astype(np.int8)), "f32")  # (N, E)
        if zero:
            w = ops.subtract(w, ops.constant(np.full((8, 1), 3, np.float32)))
        w = ops.multiply(w, ops.constant(rng.uniform(0.001, 0.01, scale).astype(np.float32)))
        y = ops.add(ops.matmul(inp, w, False, True), ops.constant(rng.standard_normal((1, 1, 8)).astype(np.float32)))
        y = ops.fake_quantize(y, *(ops.constant(np.asarray(v, np.float32)) for v in limits), levels)  # (B, L, N)
        return ops.transpose(ops.reshape(y, np.array([0, 0, 2, 4]), True), np.array([0, 2, 1, 3]))  # (B, H, L, D)

    per_channel = [np.linspace(-2, -1, 8).reshape(1, 1, 8), np.linspace(1, 2, 8).reshape(1, 1, 8)]
    q = product(x, [-1.5, 1.5, -1.5, 1.5])
    k = product(x2 if case == "other input" else x, per_channel * 2, 16 if case == "levels" else 256,
                zero=case == "zero point", scale=(1, 8) if case == "input scale" else (8, 1))
    v = ops.transpose(ops.reshape(ops.matmul(x, ops.constant(rng.standard_normal((8, 8)).astype(np.float32)), False,
                                             True), np.array([0, 0, 2, 4]), True), np.array([0, 2, 1, 3]))
    return ov.Model([ops.scaled_dot_product_attention(q, k, v, causal=False)], [x, x2])


@pytest.mark.parametrize("case, merged", [("", 1), ("other input", 0), ("levels", 0), ("zero point", 0),
                                          ("input scale", 0)])
def test_openvino_int8_query_and_key_products_merge_into_one_only_where_the_arithmetic_is_the_same(case, merged):
    """merge_query_key gives an attention op its query and key from one int8 product (weights stacked, biases
    joined, one FakeQuantize with each half's own limits, a split after) where both are NNCF's int8 products of one
    input; the outputs are NNCF's model's to float32 rounding. Left alone: a key reading another tensor, quantized
    to other levels, with a zero point in its weights, or scaled along its input channels."""
    import numpy as np

    ov = pytest.importorskip("openvino")
    from multihead.deploy.openvino import merge_query_key

    ir = _quantized_attention(case)
    kinds = [o.get_type_name() for o in ir.get_ordered_ops()]
    feed = {n: np.random.default_rng(i).standard_normal((3, 5, 8)).astype(np.float32) for i, n in enumerate(("x", "x2"))}
    f32 = {"INFERENCE_PRECISION_HINT": "f32"}
    before = ov.Core().compile_model(ir, "CPU", f32)(feed)[0]
    assert merge_query_key(ir) == merged
    after_kinds = [o.get_type_name() for o in ir.get_ordered_ops()]
    assert after_kinds.count("MatMul") == kinds.count("MatMul") - merged
    assert after_kinds.count("VariadicSplit") == merged and after_kinds.count("FakeQuantize") == 2 - merged
    after = ov.Core().compile_model(ir, "CPU", f32)(feed)[0]
    assert np.abs(after - before).max() <= 1e-5 * np.abs(before).max(), case
