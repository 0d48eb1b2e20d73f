"""`multihead prune --hf DIR` and `multihead viz --hf DIR` on local transformers checkpoints
(tiny models with a word-level tokenizer, built here)."""

from __future__ import annotations

import copy
import json
import re
import time
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
import multihead.hf as mhf  # noqa: E402
from multihead import heads  # noqa: E402
from multihead.apps.common.data import sentences  # noqa: E402
from multihead.apps.prune import hf_models, pruning  # noqa: E402
from multihead_cli import main  # noqa: E402

warnings.filterwarnings("ignore", message=".*token_id.*")
T = transformers


def _save(tmp_path, model, words):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[PAD]": 0, "[UNK]": 1, "[BOS]": 2}
    for w in words:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = T.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]")
    d = tmp_path / "ckpt"
    model.save_pretrained(d)
    fast.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def corpus():
    return sentences(80)


def _words(corpus):
    return sorted({w for s in corpus for w in s.replace(".", " ").split()})[:200]


def _bert(tmp_path, corpus):
    torch.manual_seed(0)
    cfg = T.BertConfig(vocab_size=210, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                       intermediate_size=64, max_position_embeddings=160)
    return _save(tmp_path, T.BertModel(cfg).eval(), _words(corpus))


@pytest.fixture
def bert_dir(tmp_path, corpus):
    return _bert(tmp_path, corpus)


@pytest.fixture(scope="module")
def st_ffn_pruned(tmp_path_factory, corpus):
    """One `prune --hf` run read by two tests (its export chain is most of each test's time): the tiny BERT saved as
    a sentence-transformers directory (mean pooling, normalised), 25% of its heads and 50% of every feed-forward
    block's neurons cut, 2 recovery steps, no runtime peers. {"bert", "src", "out", "said", "sentences"}."""
    import contextlib
    import io

    tmp = tmp_path_factory.mktemp("st_ffn")
    bert = src = _bert(tmp, corpus)
    try:  # (without sentence-transformers: the BERT directory itself, for the --ffn test; the other is skipped)
        from sentence_transformers import SentenceTransformer
        from sentence_transformers.sentence_transformer import modules as models
    except ImportError:
        pass
    else:
        src = tmp / "st"
        SentenceTransformer(modules=[models.Transformer(str(bert)), models.Pooling(32, "mean"),
                                     models.Normalize()]).save(str(src))
    corpus_file = tmp / "corpus.txt"
    corpus_file.write_text("\n".join(corpus[:64]))
    out = tmp / "p"
    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        code = main(["prune", "--hf", str(src), "--fraction", "0.25", "--step", "0.25", "--ffn", "0.5", "--recover", "2",
                     "--corpus", str(corpus_file), "--sentences", "16", "32", "--max-seconds", "0.2",
                     "--no-runtime-peers", "--out", str(out)])
    assert code == 0
    return {"bert": bert, "src": src, "out": out, "said": said.getvalue(), "sentences": corpus[:64]}


def test_prune_hf_encoder_writes_a_loadable_pruned_model_and_recovers(bert_dir, tmp_path, corpus):

    setup = hf_models.hf_setup(bert_dir, corpus, 16, 32)
    out = tmp_path / "out"
    # a deadline, as --time-budget sets one: its speed table runs 3 rounds per batch size, not 7 (ample: no step cut);
    # no runtime files (their export is test_prune_recover_quantize's and the --ffn test's): none written, as said
    report = pruning.run(setup, out, pruning.Options(0.25, step=0.25, progress=False, max_seconds=0.3, recover=5,
                                                     runtime_peers=False, runtime_files=False,
                                                     deadline=time.monotonic() + 600))
    assert report["runtimes"]["note"].startswith("no runtime files written, as asked (--no-runtime-files)")
    assert not (out / "model" / "onnx").exists() and not (out / "model" / "openvino").exists()
    assert report["curve"][-1]["heads_pruned"] == 2
    r = report["recovery"]
    assert r["steps"] == 5 and report["final"]["metric"] == r["metric_after"]
    loaded = mhf.load(out / "model")  # the documented call
    assert sum(m.attention_hooks.num_heads for m in mhf.attention_modules(loaded).values()) == 6
    ids, am = setup.speed_inputs[16][0]
    with torch.no_grad():
        a = loaded(input_ids=ids, attention_mask=am).last_hidden_state
        b = setup.pruned(input_ids=ids, attention_mask=am).last_hidden_state
    assert torch.allclose(a, b, atol=1e-6)
    assert abs(setup.metric_fn(loaded) - report["final"]["metric"]) < 1e-6
    text = (out / "report.md").read_text()
    assert "Recovery: 5 distillation steps" in text and "transformers BertModel (sdpa)" in text
    assert "Note: no runtime files written, as asked" in text and "Where prediction happens" not in text
    # viz draws the pruned model itself: its 2 pruned heads are "pruned" in their places, not the uniform attention
    # of the zero rows the full-size directory holds for them (what transformers' own loading computes)
    kept = {n: m.attention_hooks.kept for n, m in mhf.attention_modules(loaded).items()}
    assert main(["viz", "--hf", str(out / "model"), "--text", corpus[0], "--out", str(tmp_path / "v")]) == 0
    page = (tmp_path / "v" / "model_explorer.html").read_text()
    data = json.loads(re.search(r'<script id="data" type="application/json">(.*?)</script>', page, re.S).group(1))
    assert {m["name"]: [h for h, e in enumerate(m["heads"]) if e is not None] for m in data["modules"]} == \
        {n: (list(range(4)) if k is None else sorted(k)) for n, k in kept.items()}
    assert sum(e is None for m in data["modules"] for e in m["heads"]) == 2


def test_prune_and_viz_hf_command_line(tmp_path, corpus, capsys):
    torch.manual_seed(0)
    lm = T.LlamaForCausalLM(T.LlamaConfig(vocab_size=210, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)).eval()
    d = _save(tmp_path, lm, _words(corpus))
    corpus_file = tmp_path / "corpus.txt"
    corpus_file.write_text("\n".join(corpus[:48]))
    out = tmp_path / "p"
    # a causal LM is cut by the decoder command (tests/test_decoder_prune.py): the encoders' options refused
    assert main(["prune", "--hf", str(d), "--fraction", "0.25", "--step", "0.25", "--corpus", str(corpus_file),
                 "--sentences", "16", "32", "--max-seconds", "0.2", "--out", str(out)]) == 2
    assert "--corpus applies to encoders; a causal LM is cut by --fraction/--unit" in capsys.readouterr().err
    cut = mhf.attach(copy.deepcopy(lm))  # a cut that differs between layers, through the Python API
    heads.prune(cut, {"model.layers.0.self_attn": [0, 1]})
    hf_models.save_with_files(cut, out / "model", d)  # with the source's tokenizer, as prune --hf writes a folder
    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):  # per-layer counts: multihead.hf.load only
        T.AutoModelForCausalLM.from_pretrained(out / "model")
    assert main(["viz", "--hf", str(d), "--text", "The value of the object", "--out", str(tmp_path / "v"),
                 "--explain"]) == 0
    text = capsys.readouterr().out
    assert "- model.layers.0.self_attn (LlamaAttention): H=4 Hkv=2 D=8" in text
    assert "layout: separate q/k/v (q=q_proj, k=k_proj, v=v_proj, o=o_proj)" in text
    assert "computes: scaling=0.3536, causal" in text, text
    assert (tmp_path / "v" / "ckpt_explorer.html").stat().st_size > 1000
    assert (tmp_path / "v" / "ckpt_heads.png").stat().st_size > 1000
    # the pruned directory, which transformers cannot open (grouped key/value heads, stored at the pruned sizes)
    assert main(["viz", "--hf", str(out / "model"), "--text", "The value of the object", "--out",
                 str(tmp_path / "vp")]) == 0
    page = (tmp_path / "vp" / "model_explorer.html").read_text()
    data = json.loads(re.search(r'<script id="data" type="application/json">(.*?)</script>', page, re.S).group(1))
    assert sum(e is None for m in data["modules"] for e in m["heads"]) == 2  # 8 heads, 6 kept


def test_hf_bad_directories(tmp_path, capsys):
    assert main(["viz", "--hf", str(tmp_path), "--out", str(tmp_path / "v")]) == 2
    err = capsys.readouterr().err
    assert "config.json does not exist: --hf takes a local transformers checkpoint" in err and "Traceback" not in err


def test_prune_recover_quantize_is_one_command_and_loads_back_int8(bert_dir, tmp_path, corpus, capsys, monkeypatch):
    """`prune --hf DIR --fraction F --recover STEPS --quantize int8`: the model it writes loads back
    quantized and padding-free with multihead.hf.load, equal to the model the report measured. The files made only
    for its runtime table leave nothing in the temporary folder but the process's scratch (removed at exit)."""
    import tempfile

    from multihead.quantize import is_quantized

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    corpus_file = tmp_path / "corpus.txt"
    corpus_file.write_text("\n".join(corpus[:64]))
    out = tmp_path / "q"
    assert main(["prune", "--hf", str(bert_dir), "--fraction", "0.25", "--step", "0.25", "--recover", "3",
                 "--quantize", "int8", "--corpus", str(corpus_file), "--sentences", "16", "32",
                 "--max-seconds", "0.2", "--serve-batch", "16", "--out", str(out)]) == 0
    said = capsys.readouterr().out
    report = json.loads((out / "report.json").read_text())
    assert report["final"]["quantize"] == "int8" and report["recovery"]["steps"] == 3
    assert "pruned 25% + int8 (multihead)" in report["speed"] and "quantized to int8:" in said
    assert set(report["speed"]["pruned 25% + int8 (multihead)"]) == {"1", "16", "64"}
    assert set(report["speed"]["pruned 25% + int8 (multihead served)"]) == {"1", "16", "64"}  # BERT: served too
    try:
        import onnxruntime  # noqa: F401
    except ImportError:
        pass
    else:  # the onnx extra: ONNX Runtime's int8 model of the unpruned checkpoint, exported as users export it
        std = "ONNX Runtime int8 (unpruned, standard export)"
        assert set(report["speed"][std]) == {"1", "16", "64"}
        assert 0.5 < report["peer_metrics"][std] <= 1.0 + 1e-6
    loaded = mhf.load(out / "model")
    from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear

    assert is_quantized(loaded) == "int8" and any(isinstance(m, DynamicLinear) for m in loaded.modules())
    from multihead.hf import packed as hf_packed

    assert hf_packed.is_packed(loaded)
    from multihead.apps.prune import hf_models

    setup = hf_models.hf_setup(bert_dir, corpus[:64], 16, 32)  # the same held-out sentences as the command's
    assert abs(setup.metric_fn(loaded) - report["final"]["metric"]) < 1e-5
    assert "Quantized to int8 last" in (out / "report.md").read_text()
    _runtime_files_match_the_model(out, report, said)
    assert [p.name for p in (tmp_path / "tmp").iterdir() if not p.name.startswith("multihead-runtimes-")] == []


def _runtime_files_match_the_model(out, report, said):
    """The kept model's runtime files (onnx/, openvino/ in OUT/model) run by a plain ONNX Runtime session and by
    OpenVINO on the tokenizer's own outputs equal the pruned float model (fp32 within float rounding, int8 within
    the rounding torch's own int8 model of it shows; OpenVINO's int8 file with each layer's query and key products
    merged), at its pruned size; the report times them against the unpruned files beside the bound and says so in
    report.md and on the command line."""
    ort = pytest.importorskip("onnxruntime")
    import numpy as np

    from multihead.quantize import quantize

    model = mhf.load(out / "model", quantized=False)
    tok = T.AutoTokenizer.from_pretrained(out / "model")
    enc = tok(sentences(80)[40:43], padding=True, return_token_type_ids=True, return_tensors="np")
    feed = {k: enc[k].astype(np.int64) for k in ("input_ids", "attention_mask", "token_type_ids")}
    keep = torch.from_numpy(enc["attention_mask"]).bool()  # (B, L): the real tokens
    with torch.no_grad():
        want = model(**{k: torch.from_numpy(v) for k, v in feed.items()}).last_hidden_state  # (B, L, E)
        torch_int8 = quantize(model, "int8")(**{k: torch.from_numpy(v) for k, v in feed.items()}).last_hidden_state
    int8_err = float((torch_int8 - want)[keep].abs().max())
    for f, tol in (("onnx/model.onnx", 1e-4), ("onnx/model_int8.onnx", 3 * int8_err), ("onnx/serve.onnx", 1e-4),
                   ("onnx/serve_int8.onnx", 3 * int8_err)):  # the files to serve: loaded as the docs load them
        session = ort.InferenceSession(str(out / "model" / f))
        assert [o.name for o in session.get_outputs()] == ["last_hidden_state"]
        got = torch.from_numpy(session.run(None, feed)[0])
        assert (got - want)[keep].abs().max() <= tol, f
    ov = pytest.importorskip("openvino") if (out / "model" / "openvino").is_dir() else None
    for f in ("openvino_model.xml", "openvino_model_int8.xml") if ov is not None else ():
        compiled = ov.Core().compile_model(str(out / "model" / "openvino" / f), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
        got = torch.from_numpy(compiled(feed)[compiled.output(0)])
        if f == "openvino_model.xml":  # fp32: the same model
            assert (got - want)[keep].abs().max() <= 1e-4
        else:  # NNCF's static int8 (activations' ranges calibrated): the same model within its rounding
            assert torch.nn.functional.cosine_similarity(got[keep], want[keep], dim=-1).min() > 0.9
    if ov is not None:  # each attention op's query and key come from one int8 product (merge_query_key), said
        ops = [o.get_type_name() for o in ov.Core().read_model(str(out / "model/openvino/openvino_model_int8.xml"))
               .get_ordered_ops()]
        said_int8 = json.loads((out / "model/onnx/export.json").read_text())["openvino_int8"]
        assert ops.count("VariadicSplit") == ops.count("ScaledDotProductAttention") > 0, ops
        assert f"of {ops.count('VariadicSplit')} attention ops merged" in said_int8, said_int8
    kept_rows = model.encoder.layer[0].attention.self.query.weight.shape[0]  # the kept heads' rows
    import onnx

    sizes = {i.name: list(i.dims) for i in onnx.load(str(out / "model/onnx/model.onnx")).graph.initializer}
    assert sizes["model.encoder.layer.0.attention.self.query.bias"] == [kept_rows] and kept_rows < 32
    r = report["runtimes"]
    assert set(r["files"]) >= {"onnx", "onnx_int8"}
    ov = "openvino" in r["files"]
    assert {(row["runtime"], row["batch"]) for row in r["rows"]} >= {
        (n, b) for n in ("ONNX Runtime fp32", "ONNX Runtime int8") + (("OpenVINO fp32",) if ov else ()) for b in (1, 16)}
    assert all(row["bound"] > 1.0 and row["speedup"] > 0 for row in r["rows"])
    assert "## Where prediction happens" in (out / "report.md").read_text() and "bound (work removed)" in said
    _served_is_the_fastest_printed(out, r, said)


def _served_is_the_fastest_printed(out, r, said):
    """--serve-batch 16: each runtime's file to serve is the fastest pruned form of the batch-16 row of the runtime
    table the run printed (the forms' line lists the fastest first), the same bytes as that form; the report names it
    and the CPU's flags, as every results file does."""
    import filecmp

    from multihead.timing import cpu_flags

    for label, served in ((k, v) for k, v in r["serve"].items() if isinstance(v, dict)):
        row = next(row for row in r["rows"] if row["runtime"] == label and row["batch"] == 16)
        fastest = min(row["forms"], key=lambda k: row["forms"][k]["median_ms"])
        assert served["key"] == fastest == row["pruned_file"] and served["chosen_by"] == "the fastest at batch 16"
        assert f"| {label} | 16 | {fastest}: " in said or len(row["forms"]) == 1, (label, fastest)
        assert filecmp.cmp(out / "model" / served["file"], out / "model" / served["files"][fastest], shallow=False)
    assert {"ONNX Runtime fp32", "ONNX Runtime int8"} <= set(r["serve"])
    assert set(r["rows"][0]["forms"]) >= {"onnx_int8", "onnx_eager_int8"} or r["rows"][0]["runtime"] != "ONNX Runtime int8"
    flags = " ".join(cpu_flags())
    assert r["serve"]["cpu_flags"] == cpu_flags() and json.loads((out / "report.json").read_text())["cpu_flags"] == cpu_flags()
    assert json.loads((out / "model/onnx/export.json").read_text())["serve"]["cpu_flags"] == cpu_flags()
    text = (out / "report.md").read_text()
    assert f"Files to serve, chosen on this CPU (flags: {flags}" in text and "`onnx/serve_int8.onnx` = `" in text


def test_serve_batch_and_runtimes_are_refused_in_one_line_before_any_work(bert_dir, tmp_path, capsys, monkeypatch):
    """--serve-batch that is not a positive whole number, an unknown runtime, a runtime asked for whose extra is
    missing: one line each naming the fix (the install line), exit 2, nothing written."""
    import importlib.util

    out = tmp_path / "o"
    for value in ("0", "-3", "1.5", "x"):
        assert main(["prune", "--hf", str(bert_dir), "--serve-batch", value, "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err == (f"multihead prune: --serve-batch must be a positive whole number (the batch size served, "
                       f"e.g. 16); got {value!r}\n")
    assert main(["prune", "--hf", str(bert_dir), "--runtimes", "onnx,tensorrt", "--out", str(out)]) == 2
    assert capsys.readouterr().err == "multihead prune: --runtimes: unknown runtime(s) ['tensorrt']; choose from onnx,openvino\n"
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "openvino" else real(name, *a))
    assert main(["prune", "--hf", str(bert_dir), "--runtimes", "onnx,openvino", "--serve-batch", "16",
                 "--out", str(out)]) == 2
    assert capsys.readouterr().err == ("multihead prune: the openvino runtime needs openvino, which is not installed: "
                                       "pip install 'multihead[openvino]'\n")
    assert not out.exists()


def test_quantize_refuses_what_it_cannot_do(bert_dir, tmp_path, capsys):
    import multihead_cli
    from multihead import quantize

    assert multihead_cli.QUANTIZE == quantize.DTYPES  # the parser lists the library's dtypes
    with pytest.raises(SystemExit) as e:
        main(["prune", "--hf", str(bert_dir), "--quantize", "int4"])
    assert e.value.code == 2 and "invalid choice: 'int4'" in capsys.readouterr().err
    assert main(["prune", "--model", "toy", "--quantize", "int8"]) == 2
    assert "--quantize applies to transformers checkpoints: give --hf DIR" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"quantize: unknown dtype 'fp8'; supported: int8"):
        quantize.quantize(torch.nn.Linear(2, 2), "fp8")
    model = mhf.attach(T.BertModel.from_pretrained(bert_dir))
    q = quantize.quantize(model)
    with pytest.raises(ValueError, match=r"save takes the float model"):
        mhf.save(q, tmp_path / "x")
    with pytest.raises(ValueError, match=r"already quantized"):
        quantize.quantize(q)


def test_viz_hf_on_a_text_longer_than_the_model_draws_its_first_positions(bert_dir, tmp_path, corpus, capsys):
    """A text past the model's positions (here 160) was a RuntimeError from inside the model: it is
    truncated to what the model takes, and the command says so."""
    text = " ".join(corpus[:60])
    assert main(["viz", "--hf", str(bert_dir), "--text", text, "--out", str(tmp_path / "v")]) == 0
    err = capsys.readouterr().err
    assert re.search(r"multihead viz: the text is \d+ tokens and BertModel takes at most 160 positions: its first "
                     r"160 tokens are drawn\.", err), err
    assert "Traceback" not in err and (tmp_path / "v" / "ckpt_explorer.html").stat().st_size > 1000


def test_the_pruned_directory_opens_in_transformers_and_sentence_transformers(st_ffn_pruned, corpus):
    """`prune --hf` on a sentence-transformers directory: the directory it writes opens with
    AutoModel.from_pretrained (attention weights at full size, the pruned heads zero; the feed-forward blocks at
    their cut width, as --ffn writes them) and with SentenceTransformer (its pooling and normalisation copied), both
    giving what multihead.hf.load gives; and multihead's models (loaded pruned, served, or attached padding-free) run
    inside a SentenceTransformer, encode unchanged. (The run is st_ffn_pruned's, shared with the --ffn test.)"""
    pytest.importorskip("sentence_transformers")
    from sentence_transformers import SentenceTransformer

    src, out = st_ffn_pruned["src"], st_ffn_pruned["out"]
    assert not any("ONNX Runtime" in name or "OpenVINO" in name  # left out of the speed table, as asked
                   for name in json.loads((out / "report.json").read_text())["speed"])
    ours = mhf.load(out / "model")
    assert sum(m.attention_hooks.num_heads for m in mhf.attention_modules(ours).values()) == 6
    theirs = T.AutoModel.from_pretrained(out / "model").eval()
    tok = T.AutoTokenizer.from_pretrained(out / "model")
    batch = tok(corpus[:3], padding=True, return_tensors="pt")
    real = batch["attention_mask"].bool()
    with torch.no_grad():
        a = ours(**batch).last_hidden_state
        b = theirs(**batch).last_hidden_state
    assert (a - b)[real].abs().max() < 1e-5
    model = SentenceTransformer(str(out / "model"), device="cpu")
    got = torch.as_tensor(model.encode(corpus[:3]))
    m = batch["attention_mask"][..., None].float()
    want = torch.nn.functional.normalize((a * m).sum(1) / m.sum(1), dim=-1)
    assert (got - want).abs().max() < 1e-5
    model[0].model = ours  # multihead's pruned, padding-free model inside sentence-transformers: encode unchanged
    assert model[0].auto_model is ours  # (auto_model is a read-only view of .model: assigning it changes nothing)
    assert (torch.as_tensor(model.encode(corpus[:3])) - want).abs().max() < 1e-5
    model[0].model = mhf.serve(ours)  # served in its place: encode unchanged
    assert (torch.as_tensor(model.encode(corpus[:3])) - want).abs().max() < 1e-5
    assert (torch.as_tensor(model.encode(corpus[:1])) - want[:1]).abs().max() < 1e-5  # one sentence: no padding
    unpruned = SentenceTransformer(str(src), device="cpu")
    before = torch.as_tensor(unpruned.encode(corpus[:5]))
    mhf.attach(unpruned[0].auto_model, packed=True)  # attached inside it, padding-free
    assert (torch.as_tensor(unpruned.encode(corpus[:5])) - before).abs().max() < 1e-5


def test_prune_refuses_an_out_folder_holding_other_files(tmp_path, capsys):
    """--out must be new, empty or a folder a prune wrote: one line, exit 2, before any work; --force writes
    beside the files (here refused next for another reason, after the folder check)."""
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    (out / "report.md").write_text("an earlier prune's report")
    assert main(["prune", "--model", "toy", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == (f"multihead prune: --out {out} holds files prune did not write (notes.txt): give a new or "
                           "empty folder, or --force to write beside them")
    assert main(["prune", "--model", "toy", "--quantize", "int8", "--force", "--out", str(out)]) == 2
    assert "--quantize applies to transformers checkpoints" in capsys.readouterr().err
    assert (out / "notes.txt").read_text() == "keep me"


def test_prune_ffn_cuts_neurons_too_and_the_folder_loads_everywhere_at_its_cut_size(st_ffn_pruned, tmp_path, capsys):
    """`prune --hf DIR --ffn F`: the kept model has F of every feed-forward block's neurons cut (verified against
    the gated model) before its recovery; the folder loads in multihead and in transformers at the cut width, the
    runtime files are at that size, and the bound counts the neurons' work too. (The run is st_ffn_pruned's: the
    tiny BERT as a sentence-transformers directory, shared with the test above.)"""
    bert_dir, out, said = st_ffn_pruned["bert"], st_ffn_pruned["out"], st_ffn_pruned["said"]
    assert "25% of heads and 50% of every feed-forward block's neurons pruned" in said
    report = json.loads((out / "report.json").read_text())
    assert report["recovery"]["steps"] == 2
    assert set(report["final"]["ffn_widths"].values()) == {31}  # 64 -> 32, one fewer: never as wide as the stream
    from multihead.apps.prune import hf_models

    setup = hf_models.hf_setup(st_ffn_pruned["src"], st_ffn_pruned["sentences"], 16, 32)  # the command's sentences
    for loaded in (mhf.load(out / "model"), mhf.attach(T.BertModel.from_pretrained(out / "model").eval())):
        assert loaded.encoder.layer[0].intermediate.dense.out_features == 31
        assert abs(setup.metric_fn(loaded) - report["final"]["metric"]) < 1e-5
    from multihead.deploy import compare

    batch = {"input_ids": torch.randint(3, 200, (2, 12)), "attention_mask": torch.ones(2, 12, dtype=torch.long)}
    bound = compare.work(mhf.attach(T.BertModel.from_pretrained(bert_dir).eval()), batch) / compare.work(loaded, batch)
    assert bound > 1.2  # a quarter of the heads and half the neurons: past the heads' share of the work
    assert (out / "model" / "onnx" / "model_int8.onnx").is_file()  # the files are written without the table too
    assert main(["prune", "--model", "toy", "--ffn", "0.5", "--out", str(tmp_path / "t")]) == 2
    assert "multihead prune: --ffn applies to transformers checkpoints: give --hf DIR" in capsys.readouterr().err
