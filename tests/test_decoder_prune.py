"""``multihead prune --hf DIR`` on a causal LM (multihead.apps.prune.decoder): the cut planned in the units the runtime
stores (whole key/value groups, or query heads evenly inside every group, the same in every layer), the folder it
writes loaded by ``AutoModelForCausalLM.from_pretrained`` as it is and equal to the unpruned model with those heads
gated, the target search's invariant, and every bad input refused in one line before any work. Tiny configs of three
families (Llama: groups; Gemma 3: one key/value head, so query heads; Qwen2: biases) with a word-level tokenizer
(the behaviour's names one token each)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
import multihead.hf as mhf  # noqa: E402
from multihead import heads  # noqa: E402
from multihead.apps.prune import decoder  # noqa: E402
from multihead_cli import main  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def tok():
    return _word_tokenizer()


@pytest.fixture(scope="module")
def bpe():
    return _byte_bpe()


def _byte_bpe(size: int = 2000):
    """A byte-level BPE tokenizer (GPT-2's kind, SmolLM2's kind: what the GGUF vocabulary is written from, and what
    AutoTokenizer rebuilds a Qwen2 folder's tokenizer as) trained here in half a second on the language reference and
    the IOI set's words (names, places and objects one token each, with their leading space): 2,000 tokens, where
    SmolLM2's own 49,152 made every step of these tests slow (its real vocabulary: test_decoder_export)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from multihead.apps.common import ioi
    from multihead.apps.common.data import sentences

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    words = " " + " ".join([*ioi.NAMES, *ioi.PLACES, *ioi.OBJECTS])
    trainer = trainers.BpeTrainer(vocab_size=size, special_tokens=["<|endoftext|>", "<|pad|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    t.train_from_iterator([*sentences(), *ioi.TEMPLATES, *[words] * 50], trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<|endoftext|>",
                                                eos_token="<|endoftext|>", pad_token="<|pad|>")


def _word_tokenizer():
    """A word-level tokenizer over the language reference's most common words and every word of the IOI set (names,
    places, objects and templates: one token each, as the behaviour needs), 3,000 words: the tiny models' vocabulary
    costs little (SmolLM2's 49,152 made every step of these tests slow)."""
    from collections import Counter

    from tokenizers import Tokenizer, models, pre_tokenizers

    from multihead.apps.common import ioi
    from multihead.apps.common.data import sentences

    pre = pre_tokenizers.Whitespace()
    words = Counter(w for s in sentences() for w, _ in pre.pre_tokenize_str(s))
    ioi_words = [w for t in ioi.TEMPLATES for w, _ in pre.pre_tokenize_str(t) if "{" not in w and "}" not in w]
    vocab = {"[PAD]": 0, "[UNK]": 1, "[BOS]": 2, "[EOS]": 3}
    for w in [*ioi.NAMES, *ioi.PLACES, *ioi.OBJECTS, *ioi_words, *(w for w, _ in words.most_common(3000))]:
        if len(vocab) < 3000:
            vocab.setdefault(w, len(vocab))
    t = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    t.pre_tokenizer = pre
    return transformers.PreTrainedTokenizerFast(tokenizer_object=t, pad_token="[PAD]", unk_token="[UNK]",
                                                bos_token="[BOS]", eos_token="[EOS]")


def _tiny(folder, tok, family: str):
    """A random tiny causal LM of ``family`` saved with the tokenizer: Llama (and Llama 3's RoPE scaling), Qwen2,
    Qwen3 and Mistral with 6 query heads sharing 3 key/value heads, Gemma 3 with 4 sharing 1."""
    torch.manual_seed(0)
    common = dict(vocab_size=len(tok), hidden_size=96, intermediate_size=64, num_hidden_layers=2,
                  max_position_embeddings=256, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    grouped = dict(num_attention_heads=6, num_key_value_heads=3, head_dim=16)
    if family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(num_attention_heads=6, num_key_value_heads=3,
                                                                       **common))
    elif family == "llama3":  # Llama 3's RoPE scaling
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(rope_parameters=rope, **grouped, **common))
    elif family == "qwen3":  # query/key norms
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**grouped, **common))
    elif family == "mistral":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**grouped, **common))
    elif family == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(num_attention_heads=6, num_key_value_heads=3,
                                                                       **common))
    else:
        model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
            num_attention_heads=4, num_key_value_heads=1, head_dim=24, sliding_window=8, **common))
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    cfg = folder / "tokenizer_config.json"  # read as this tokenizer, not rebuilt as the family's own (Qwen2's BPE)
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "tokenizer_class": "PreTrainedTokenizerFast"}))
    return folder


SMALL = dict(held_out=16, prompts=8, seq=32, batch=2)


@pytest.mark.parametrize("family, unit, heads_after, kv_after", [
    ("llama", "group", 4, 2), ("qwen2", "group", 4, 2), ("gemma3", "query", 2, 1), ("qwen3", "group", 4, 2),
    ("mistral", "group", 4, 2), ("llama3", "group", 4, 2)])
def test_the_cut_is_even_and_the_folder_loads_as_it_is_equal_to_the_gated_model(tmp_path, request, family, unit,
                                                                                 heads_after, kv_after):
    """No recovery: the kept model is the cut itself, so the folder read back by from_pretrained must equal the
    unpruned model with the removed heads gated off (an independent route); its parameters are the family's own
    (no o_proj bias added, Qwen2's q/k/v biases cut with their heads), its KV cache per token the kept share, every
    layer the same counts."""
    tok = request.getfixturevalue("bpe" if family == "qwen2" else "tok")
    src = _tiny(tmp_path / "src", tok, family)
    r = decoder.run(src, tmp_path / "out", decoder.DecoderOptions(fraction=0.5 if family == "gemma3" else 0.34, recover=0,
                                                           **SMALL))
    assert r["met"] and r["unit"] == unit and [c["k"] for c in r["tried"]] == [2 if family == "gemma3" else 1]
    cfg = json.loads((tmp_path / "out" / "model" / "config.json").read_text())
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (heads_after, kv_after)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "model", dtype=torch.float32).eval()
    unpruned = mhf.attach(transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval())
    assert set(back.state_dict()) == set(unpruned.state_dict())  # nothing the family lacks
    removed = r["tried"][0]["removed"]
    H = 6 if family != "gemma3" else 4
    G = H // (3 if family != "gemma3" else 1)
    for name, gone in removed.items():  # the same count in every layer, whole groups or even inside each group
        per_group = [sum(1 for h in gone if h // G == g) for g in range(H // G)]
        assert set(per_group) <= ({0, G} if unit == "group" else {len(gone) // (H // G)}), (name, gone)
    ids = tok(["When Mary and John went to the store, John gave a drink to"], return_tensors="pt")
    gates = {n: torch.ones(H).index_fill(0, torch.tensor(g), 0.0) for n, g in removed.items()}
    with torch.no_grad(), heads.gated(unpruned, gates):
        want = unpruned(**ids).logits
    with torch.no_grad():
        got = back(**ids).logits
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()
    s0, s1 = r["sizes"]["unpruned"], r["sizes"]["kept"]
    assert s1["kv_bytes_per_token_f16"] * 3 == s0["kv_bytes_per_token_f16"] * (2 if family != "gemma3" else 3)
    assert r["peak_rss_mib"] > 0 and "peak resident memory" in (tmp_path / "out" / "report.md").read_text()


def test_plan_removes_the_least_important_groups_or_the_same_heads_in_every_group():
    counts = {"a": (6, 3), "b": (6, 3)}
    scores = {"a": torch.tensor([5., 4, 1, 2, 3, 7]), "b": torch.tensor([0., 8, 9, 7, 1, 9])}
    assert decoder.plan(scores, counts, "group", 1) == {"a": [2, 3], "b": [0, 1]}  # group sums 9/3/10, 8/16/10
    assert decoder.plan(scores, counts, "group", 2) == {"a": [0, 1, 2, 3], "b": [0, 1, 4, 5]}
    assert decoder.plan(scores, counts, "query", 1) == {"a": [1, 2, 4], "b": [0, 3, 4]}  # each group's least


@pytest.mark.parametrize("family, kind", [("llama", "group"), ("gemma3", "query")])
def test_each_units_importance_is_what_cutting_it_costs(tmp_path, tok, family, kind):
    """The importance the cut is chosen by is measured, not estimated: each unit's cost (a key/value group, or one
    query head where the layer has one key/value head) equals the next-token KL from the unpruned model on the
    importance windows and the fall of the behaviour's logit difference of the model with that unit cut by
    heads.prune (float rounding); importance() sums the two normalised over the model, a group's cost spread over
    its query heads."""
    import copy

    path = _tiny(tmp_path / "m", tok, family)
    o = decoder.DecoderOptions(fraction=0.34, recover=1, held_out=8, prompts=8)
    t, beh, ref = decoder.text(tok, o), decoder.behaviour(tok, o), decoder.load(path)
    counts = decoder.layer_counts(ref)
    text_cost, task_cost = decoder.unit_costs(ref, t, beh, counts, kind)
    with torch.no_grad():
        reference = decoder._logprobs(ref, t)
        base = decoder._measures(ref, t, beh, reference)
    assert base[0] == pytest.approx(0, abs=1e-6) and len(t.select) * 2 == decoder.IMPORTANCE_WINDOWS
    for name, (H, Hkv) in counts.items():
        G = H // Hkv if kind == "group" else 1
        for first in range(0, H, G):
            cut = copy.deepcopy(ref)
            heads.prune(cut, {name: list(range(first, first + G))})
            with torch.no_grad():
                kl, diff = decoder._measures(cut, t, beh, reference)
            assert float(text_cost[name][first:first + G].sum()) == pytest.approx(kl, abs=1e-5) and kl > 0
            assert float(task_cost[name][first:first + G].sum()) == pytest.approx(base[1] - diff, abs=1e-4)
            assert len(set(text_cost[name][first:first + G].tolist())) == 1  # spread evenly over the unit's heads
    scores = decoder.importance(ref, t, beh, counts, kind)
    a, b = torch.stack(list(text_cost.values())), torch.stack(list(task_cost.values()))
    assert torch.allclose(torch.stack(list(scores.values())).double(), a / a.abs().sum() + b / b.abs().sum(), atol=1e-6)


def test_units_and_fractions_that_cannot_be_cut_evenly_are_refused_naming_what_can():
    with pytest.raises(ValueError, match=r"cuts 0 of the 3 key/value groups .*0\.33 cuts 1, 0\.67 cuts 2"):
        decoder.units_cut(0.1, 3, "group")
    with pytest.raises(ValueError, match="cuts 3 of the 3"):
        decoder.units_cut(0.9, 3, "group")
    with pytest.raises(ValueError, match=r"unit 'group' needs two key/value heads .*cut query heads"):
        decoder.unit_of({"a": (4, 1)}, "group")
    with pytest.raises(ValueError, match="each key/value head serves one query head"):
        decoder.unit_of({"a": (4, 4)}, "query")
    with pytest.raises(ValueError, match="different head counts"):
        decoder.unit_of({"a": (4, 2), "b": (6, 2)}, "auto")
    assert decoder.unit_of({"a": (4, 1)}, "auto") == ("query", 4)
    assert decoder.unit_of({"a": (9, 3)}, "auto") == ("group", 3)


def test_the_search_keeps_the_furthest_cut_tried_that_meets_the_target(tmp_path, tok, monkeypatch):
    """The search's invariant with the judgement of each cut set by its size (the cuts themselves real): 1 and 2
    groups of 3 meet a perplexity ratio of 1.2, so 2 is kept; at 1.05 only 1 is; at 1.0 none (exit path: nothing
    kept). The search stops at the first cut that misses."""
    src = _tiny(tmp_path / "src", tok, "llama")
    ref = decoder.load(src)
    counts = decoder.layer_counts(ref)
    scores = {n: torch.arange(6.0) for n in counts}
    base = decoder.Judgement(10.0, 1.0, 0.0, 100, 1.0, 1.0, 2.0, 8)
    ratio = {4: 1.04, 2: 1.15}  # query heads left in a layer -> perplexity ratio

    def judged(model, reference, t, beh, unpruned=None):
        H = next(iter(decoder.layer_counts(model).values()))[0]
        return decoder.Judgement(10.0, ratio[H], 0.1, 100, 1.0, 1.0, 2.0, 8)

    monkeypatch.setattr(decoder, "judge", judged)
    for target, kept, tried in ((1.2, 1, [1, 2]), (1.05, 0, [1, 2]), (1.0, None, [1])):
        o = decoder.DecoderOptions(target=("perplexity", target), recover=0)
        cands, k, model = decoder.search(decoder.Context(ref, None, None, base, o), scores, counts, "group", 2)
        assert [c.k for c in cands] == tried and k == kept
        assert (model is None) == (kept is None)
        if model is not None:
            assert next(iter(decoder.layer_counts(model).values())) == ((2, 1) if kept == 1 else (4, 2))


def test_a_behaviour_file_is_read_and_each_bad_line_refused_naming_it(tmp_path, tok):
    good = [{"clean": "When Mary and John went out, John gave it to", "corrupted":
             "When Mary and John went out, Mary gave it to", "answer": " Mary", "wrong": " John"}] * 4
    f = tmp_path / "b.jsonl"
    f.write_text("\n".join(json.dumps(x) for x in good))
    rows = decoder.read_behaviour(f, tok)
    assert len(rows) == 4 and rows[0][2] == tok(" Mary", add_special_tokens=False)["input_ids"][0]
    two = tmp_path / "two.jsonl"  # two pairs of different lengths: one chooses, one is judged
    two.write_text(json.dumps(good[0]) + "\n" + json.dumps({**good[0], "clean": good[0]["clean"] + " the",
                                                               "corrupted": good[0]["corrupted"] + " the"}))
    beh = decoder.behaviour(tok, decoder.DecoderOptions(behaviour=two))
    assert [len(b["io"]) for b in beh.importance] == [1] and [len(b["io"]) for b in beh.judged] == [1]
    bad = {"not json": ("{clean: 1}", r"line 1: not JSON"),
           "missing": (json.dumps({"clean": "a b"}), r"line 1: corrupted, answer, wrong missing"),
           "two tokens": (json.dumps({**good[0], "answer": " Maryland-ish"}), r"line 1: answer .* is \d+ tokens"),
           "lengths": (json.dumps({**good[0], "corrupted": "When Mary went out"}), r"line 1: the clean text is \d+ "
                                                                                   r"tokens, the corrupted \d+"),
           "one pair": (json.dumps(good[0]), r"holds 1 pair\(s\); give at least 2")}
    for line, message in bad.values():
        f.write_text(line + "\n")
        with pytest.raises(ValueError, match=message):
            decoder.read_behaviour(f, tok)


def test_the_command_refuses_bad_input_in_one_line_before_any_work(tmp_path, tok, capsys):
    src = _tiny(tmp_path / "src", tok, "llama")
    gemma = _tiny(tmp_path / "gemma", tok, "gemma3")
    (tmp_path / "bad.jsonl").write_text("{nope\n")
    capsys.readouterr()  # the folders' writing
    cases = [(["--hf", str(src), "--fraction", "0.1"], "cuts 0 of the 3 key/value groups"),
             (["--hf", str(src), "--quantize", "int8"], "--quantize applies to encoders"),
             (["--hf", str(src), "--ffn", "0.5"], "--ffn applies to encoders"),
             (["--hf", str(gemma), "--unit", "group"], "unit 'group' needs two key/value heads"),
             (["--hf", str(src), "--behaviour", str(tmp_path / "none.jsonl")], "does not exist"),
             (["--hf", str(src), "--behaviour", str(tmp_path / "bad.jsonl")], "line 1: not JSON"),
             (["--hf", str(src), "--decode-contexts", "64"], "--decode-contexts times the files --formats writes"),
             (["--hf", str(src), "--formats", "genai-fp32", "--decode-contexts", "64,512"],
              "--decode-contexts 512: longer than the model's 256 positions"),
             (["--hf", str(src), "--formats", "genai-fp32", "--decode-contexts", "16"],
              "above the 32 decoded")]
    for argv, message in cases:
        out = tmp_path / "o"
        assert main(["prune", *argv, "--out", str(out)]) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], (argv, err)
        assert not (out / "report.md").exists()
    with pytest.raises(SystemExit):
        main(["prune", "--hf", str(src), "--target-perplexity", "0.9"])
    assert "must be a ratio >= 1" in capsys.readouterr().err
    assert main(["prune", "--model", "toy", "--unit", "group", "--out", str(tmp_path / "t")]) == 2
    assert "--unit applies to causal language models" in capsys.readouterr().err


def test_a_target_no_cut_meets_exits_1_and_saves_nothing(tmp_path, tok, capsys):
    src = _tiny(tmp_path / "src", tok, "llama")
    code = main(["prune", "--hf", str(src), "--target-kl", "1e-9", "--recover", "0", "--out", str(tmp_path / "o")])
    assert code == 1
    assert "no cut tried meets the target" in capsys.readouterr().err
    r = json.loads((tmp_path / "o" / "report.json").read_text())
    assert not r["met"] and r["kept"] is None and [c["k"] for c in r["tried"]] == [1]
    assert not (tmp_path / "o" / "model").exists() and "nothing saved" in (tmp_path / "o" / "report.md").read_text()


def test_the_formats_users_run_are_written_and_each_read_back(tmp_path, bpe):
    """--formats on a tiny Llama (a byte-level BPE tokenizer: the GGUF vocabulary is written from it): Q8_0's
    perplexity cost is measured beside the unpruned model's at Q8_0 and within it; Q4_K_M says in one line that
    llama.cpp's quantizer is not built (where it is not); GenAI int4 read back with the builder's int4 weights
    (fp32's equality: tests/test_decoder_export.py). Every file loads: GGUF through transformers' reader, GenAI
    through onnxruntime_genai."""
    pytest.importorskip("onnxruntime_genai")
    import importlib.util

    src = _tiny(tmp_path / "src", bpe, "llama")
    formats = ("gguf-q8_0", "gguf-q4_k_m", "genai-int4")  # f16 and genai-fp32: tests/test_decoder_export.py
    r = decoder.run(src, tmp_path / "out", decoder.DecoderOptions(fraction=0.34, recover=0, formats=formats,
                                                                  decode_contexts=(40,), decode_rounds=1, **SMALL))
    rows = {f["format"]: f for f in r["formats"]}
    assert list(rows) == list(formats)
    q8 = rows["gguf-q8_0"]
    assert q8["within"] and 0.9 < q8["cost"] < 1.1 and 0.9 < q8["unpruned_cost"] < 1.1
    if importlib.util.find_spec("llama_cpp") is None:
        assert rows["gguf-q4_k_m"]["checks"] == ["not written: Q4_K_M is made by llama.cpp's own quantizer, which is "
                                                 "not built here (make decoder-llama-cpp builds it)"]
    assert "(int4)" in rows["genai-int4"]["checks"][0]
    import onnx

    graph = onnx.load(str(Path(rows["genai-int4"]["path"]) / "model.onnx"), load_external_data=False).graph
    assert "MatMulNBits" in {n.op_type for n in graph.node}  # the builder's int4 weights
    import gguf

    f = gguf.GGUFReader(rows["gguf-q8_0"]["path"]).fields
    assert f["llama.attention.head_count_kv"].contents() == 2 and len(f["tokenizer.ggml.tokens"].contents()) == len(bpe)
    assert "| gguf-q8_0 | model-q8_0.gguf |" in (tmp_path / "out" / "report.md").read_text()
    _decode_table_times_each_file_against_its_peer(r, tmp_path / "out", src, llama_cpp=bool(
        importlib.util.find_spec("llama_cpp")))


def _decode_table_times_each_file_against_its_peer(r: dict, out: Path, src: Path, llama_cpp: bool) -> None:
    """--decode-contexts: each written file timed against its peer, the unpruned model made into the same format by
    the runtime's own tools (GenAI's builder on the checkpoint folder: the peer is exactly what it writes), beside the
    bound of the multiply-adds removed (computed here from the config) and the KV bytes of each side."""
    from multihead.deploy.decoding import decode_macs

    d = r["decode"]
    rows = {row["format"]: row for row in d["rows"]}
    assert set(rows) == ({"gguf-q8_0", "gguf-q4_k_m", "genai-int4"} if llama_cpp else {"genai-int4"})
    if not llama_cpp:
        assert any("gguf-q8_0: not timed: llama.cpp is not built here" in n for n in d["notes"])
    g = rows["genai-int4"]
    assert g["context"] == 40 and g["rounds"] == 1
    for side in ("peer", "pruned"):
        assert g[side]["decode_tps"]["median"] > 0 and g[side]["prefill_ms"]["median"] > 0
    assert g["decode"] == 32 and g["speedup"] > 0  # one round: its paired speed-up, no spread to speak of
    assert g["speedup_spread"] == {"min": g["speedup"], "max": g["speedup"]}
    cfg = json.loads((src / "config.json").read_text())
    shape = {"E": cfg["hidden_size"], "F": cfg["intermediate_size"], "V": cfg["vocab_size"],
             "D": cfg["hidden_size"] // cfg["num_attention_heads"]}
    L = cfg["num_hidden_layers"]
    assert g["bound"] == pytest.approx(decode_macs(shape, [(6, 3)] * L, 40) / decode_macs(shape, [(4, 2)] * L, 40))
    genai_config = json.loads((out / "peers" / "genai-int4" / "genai_config.json").read_text())
    assert genai_config["model"]["decoder"]["num_key_value_heads"] == 3  # the peer: the unpruned model
    kv0, kv1 = d["kv_bytes"]["genai-int4"]
    assert kv1 * 3 == kv0 * 2  # one group of three cut in every layer
    text = (out / "report.md").read_text()
    assert "| genai-int4 | genai | 40 | pruned |" in text and f"| {kv1:,} |" in text


def test_a_gemma3_cut_by_the_command_loads_at_the_pruned_size_in_transformers_and_llama_cpp(tmp_path):
    """The goal's last sentence on a tiny Gemma 3 (Gemma's head size, five sliding layers in six, a BPE with byte
    fallback as Gemma's tokenizer is): the command cuts 2 of the 4 query heads of its one group in every layer and
    writes gguf-f16 as llama.cpp's gemma3 architecture with the model's own vocabulary; the folder loads in
    transformers as it is and the file through transformers' GGUF reader, both at 2 query heads, logits within f16's
    rounding; where llama.cpp is built, it loads the file at 2 query heads and gives the folder's logits within
    that rounding at every position."""
    import importlib.util

    from test_decoder_export import _sentencepiece_bpe, _tiny_gemma

    spm, src = _sentencepiece_bpe(), tmp_path / "src"
    _tiny_gemma(len(spm)).save_pretrained(src)
    spm.save_pretrained(src)
    r = decoder.run(src, tmp_path / "out", decoder.DecoderOptions(fraction=0.5, recover=0, formats=("gguf-f16",),
                                                                  held_out=8, prompts=4, seq=16, batch=2))
    (row,) = r["formats"]
    assert "failed" not in row and row["path"].endswith("gguf/model-f16.gguf"), row
    assert any("3 texts tokenized as the tokenizer does" in c for c in row["checks"])
    folder = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "model").eval()
    path = Path(row["path"])
    back = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                             dtype=torch.float32).eval()
    for m in (folder, back):
        assert (m.config.num_attention_heads, m.config.num_key_value_heads, m.config.head_dim) == (2, 1, 256)
    ids = spm("When Mary and John went to the store, John gave a drink to")["input_ids"]
    with torch.no_grad():
        want = folder(input_ids=torch.tensor([ids])).logits  # (1, L, V)
        assert (back(input_ids=torch.tensor([ids])).logits - want).abs().max() <= 2e-2 * max(1.0, want.abs().max())
    if importlib.util.find_spec("llama_cpp") is None:  # out of make test: make decoder-llama-cpp builds it
        return
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, n_threads=2, logits_all=True, verbose=False)
    assert llama_cpp.llama_model_n_head(llm.model) == 2 and llama_cpp.llama_model_n_head_kv(llm.model) == 1
    llm.eval(ids)
    got = torch.from_numpy(np.array(llm.scores[:len(ids)]))  # (L, V) llama.cpp's logits at every position
    served = []  # llama.cpp's 4 greedy tokens after the prompt
    for t in llm.generate(ids, top_k=1, temp=0.0, reset=True):
        served.append(int(t))
        if len(served) == 4:
            break
    llm.close()
    tol = 2e-2 * max(1.0, want.abs().max())
    # within f16's rounding at every position (a random tiny model's greedy token can flip on a near-tie there)
    assert (got - want[0]).abs().max() <= tol
    with torch.no_grad():  # each greedy token llama.cpp chose is the folder's best, or tied with it within rounding
        logits = folder(input_ids=torch.tensor([ids + served])).logits[0, len(ids) - 1:-1]  # (4, V)
    chosen = logits.gather(1, torch.tensor(served)[:, None])[:, 0]  # (4,)
    assert (logits.max(-1).values - chosen).max() <= 2 * tol


def test_formats_a_runtime_cannot_hold_are_refused_before_any_work(tmp_path, bpe, tok, capsys):
    """Qwen2 (no writer), Gemma 3 in GenAI (its builder fails on transformers 5's config), a Gemma 3 llama.cpp's
    gemma3 graph scales otherwise (head_dim 24, query_pre_attn_scalar 256), a per-layer Gemma 3 cut as GGUF: one line
    each, before any work."""
    from test_decoder_export import _sentencepiece_bpe, _tiny_gemma

    src = _tiny(tmp_path / "src", bpe, "qwen2")
    scaled = _tiny(tmp_path / "scaled", tok, "gemma3")
    spm = _sentencepiece_bpe()
    _tiny_gemma(len(spm), layers=2).save_pretrained(tmp_path / "gemma")
    spm.save_pretrained(tmp_path / "gemma")
    capsys.readouterr()
    cases = [([str(src), "--formats", "gguf-q8_0"], "hold LlamaForCausalLM, Gemma3ForCausalLM only; "
                                                     "Qwen2ForCausalLM is refused"),
             ([str(tmp_path / "gemma"), "--formats", "gguf-f16,genai-int4"],
              "--formats genai-int4: ONNX Runtime GenAI's builder (onnxruntime-genai"),
             ([str(scaled), "--formats", "gguf-f16"], "Gemma 3: query_pre_attn_scalar=256 with head_dim=24"),
             ([str(tmp_path / "gemma"), "--formats", "gguf-f16", "--per-layer"],
              "gemma3 graph makes every layer at one head count")]
    for argv, message in cases:
        assert main(["prune", "--hf", *argv, "--out", str(tmp_path / "o")]) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], (argv, err)
        assert not (tmp_path / "o").exists()
    with pytest.raises(SystemExit):
        main(["prune", "--hf", str(src), "--formats", "gguf-q2"])
    assert "unknown format(s) ['gguf-q2']" in capsys.readouterr().err


def test_the_command_line_names_every_format():
    import multihead_cli

    assert multihead_cli.DECODER_FORMATS == tuple(decoder.FORMATS)


def test_plan_per_layer_places_the_models_units_where_they_matter_least_each_layer_even_inside():
    counts = {"a": (6, 3), "b": (6, 3)}
    scores = {"a": torch.tensor([5., 4, 1, 2, 3, 7]), "b": torch.tensor([0., 8, 9, 7, 1, 9])}
    # group sums: a 9/3/10, b 8/16/10 -> the two cheapest of the model: a's group 1 (3), b's group 0 (8)
    assert decoder.plan_per_layer(scores, counts, "group", 2) == {"a": [2, 3], "b": [0, 1]}
    # three: then a's group 0 (9); a keeps one group (its last never offered), b one cut
    assert decoder.plan_per_layer(scores, counts, "group", 3) == {"a": [0, 1, 2, 3], "b": [0, 1]}
    low = {"a": scores["a"] / 100, "b": scores["b"]}  # layer a far less important: both its cuttable groups go first
    assert decoder.plan_per_layer(low, counts, "group", 2) == {"a": [0, 1, 2, 3]}
    # query heads: a unit is one head of every group of a layer (the j-th least important of each, summed)
    assert decoder.plan_per_layer(low, counts, "query", 1) == {"a": [1, 2, 4]}
    with pytest.raises(ValueError, match="the model has 4 to cut"):
        decoder.plan_per_layer(scores, counts, "group", 5)


def test_per_layer_cut_is_kept_per_layer_in_the_folder_and_the_gguf_and_runs_as_the_cut_model(tmp_path, bpe,
                                                                                              monkeypatch, capsys):
    """--per-layer on a tiny Llama (a byte-level BPE: GGUF's vocabulary), layer 0 scored far below layer 1 (the
    importance set, everything else real): both cut groups come out of layer 0, so the layers keep 2/1 and 6/3
    heads. The folder loads with multihead.hf.load (from_pretrained refuses it, as the one line says) and equals
    the unpruned model with those heads gated; the GGUF file holds each layer's counts (llama.cpp's deci layout) and
    run from the file its greedy tokens are the cut model's."""
    import gguf

    from multihead.deploy.gguf import gguf_model

    src = _tiny(tmp_path / "src", bpe, "llama")

    def scored(model, t, beh, counts, kind):  # layer 0's heads far less important than layer 1's
        names = list(mhf.attention_modules(model))
        return {n: torch.arange(1.0, 7.0) * (1e-3 if i == 0 else 1.0) for i, n in enumerate(names)}

    monkeypatch.setattr(decoder, "importance", scored)
    out = tmp_path / "out"
    capsys.readouterr()
    code = main(["prune", "--hf", str(src), "--fraction", "0.34", "--per-layer", "--recover", "0",
                 "--formats", "gguf-f16", "--out", str(out)])
    said = capsys.readouterr().out
    assert code == 0, said
    r = json.loads((out / "report.json").read_text())
    names = list(r["kept_counts"])
    assert r["per_layer"] and [r["kept_counts"][n] for n in names] == [[2, 1], [6, 3]]
    assert r["tried"][0]["removed"] == {names[0]: [0, 1, 2, 3]}
    line = "transformers' from_pretrained cannot load it (one count per model), multihead.hf.load does"
    assert sum(line in x for x in said.splitlines()) == 1 and "per-layer counts: H=2, Hkv=1 in layer 0" in said
    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):  # what the line says
        transformers.AutoModelForCausalLM.from_pretrained(out / "model")
    back = mhf.load(out / "model")
    unpruned = mhf.attach(transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval())
    ids = bpe(["When Mary and John went to the store, John gave a drink to"], return_tensors="pt")["input_ids"]
    with torch.no_grad(), heads.gated(unpruned, {names[0]: torch.tensor([0.0, 0, 0, 0, 1, 1])}):
        want = unpruned(input_ids=ids).logits
    with torch.no_grad():
        assert (back(input_ids=ids).logits - want).abs().max() <= 1e-4 * want.abs().max()
    f = {k: v.contents() for k, v in gguf.GGUFReader(str(out / "model" / "gguf" / "model-f16.gguf")).fields.items()}
    assert f["general.architecture"] == "deci"
    assert f["deci.attention.head_count"] == [2, 6] and f["deci.attention.head_count_kv"] == [1, 3]

    def greedy(m, n=6):
        seq = ids
        with torch.no_grad():
            for _ in range(n):
                seq = torch.cat([seq, m(input_ids=seq).logits[:, -1:].argmax(-1)], dim=1)  # (1, L + step)
        return seq[0, ids.shape[1]:].tolist()

    assert greedy(gguf_model(out / "model" / "gguf" / "model-f16.gguf")) == greedy(back)
    s0, s1 = r["sizes"]["unpruned"], r["sizes"]["kept"]  # as many groups cut as the even cut: the KV cache 2/3
    assert s1["kv_bytes_per_token_f16"] * 3 == s0["kv_bytes_per_token_f16"] * 2


def test_per_layer_refuses_genai_before_any_work(tmp_path, bpe, capsys):
    src = _tiny(tmp_path / "src", bpe, "llama")
    capsys.readouterr()
    assert main(["prune", "--hf", str(src), "--per-layer", "--formats", "genai-fp32", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "GenAI's builder holds one head count for every layer" in err[0]
    assert main(["prune", "--model", "toy", "--per-layer", "--out", str(tmp_path / "t")]) == 2
    assert "--per-layer applies to causal language models" in capsys.readouterr().err


def test_the_decode_bound_reads_only_a_sliding_layers_window():
    """The bound of the work removed counts a sliding-window layer's attention over its window, not the whole cache:
    Gemma 3's layer types (five sliding layers to a full one) from its config; every layer full where the config
    names no layer types; a window list of the wrong length refused naming both counts."""
    from multihead.deploy.decoding import attention_windows, decode_macs

    cfg = transformers.Gemma3TextConfig(num_hidden_layers=6, sliding_window=512)
    windows = attention_windows(cfg)
    assert windows == [512] * 5 + [None]
    assert attention_windows(transformers.LlamaConfig(num_hidden_layers=3)) == [None] * 3
    shape, counts = {"E": 640, "F": 2048, "V": 1000, "D": 256}, [(4, 1)] * 6
    full, windowed = decode_macs(shape, counts, 8192), decode_macs(shape, counts, 8192, windows)
    assert full - windowed == 5 * 2 * (8192 - 512) * 4 * 256  # five layers read 512 keys and values, not 8192
    assert decode_macs(shape, counts, 300, windows) == decode_macs(shape, counts, 300)  # inside the window: the same
    with pytest.raises(ValueError, match=r"windows: 2 given for 6 layers"):
        decode_macs(shape, counts, 100, [None, 512])


def test_a_decode_cell_whose_rounds_spread_wide_is_said_unsettled():
    """The decode table's cells whose paired speed-up spreads over the rounds by more than 20% of its median get one
    line each in the report's notes, naming the format, the context and the spread; a cell within it gets none, and
    neither does a single round. The first row is issue 78's Q8_0 at 8192 tokens, its two unpaired runs (1.12x and
    1.31x) taken as rounds about 1.20x: 16%, within; the second's rounds 1.09x to 1.94x are not."""
    def row(fmt, median, lo, hi):
        return {"format": fmt, "context": 8192, "speedup": median, "speedup_spread": {"min": lo, "max": hi}}

    said = decoder.unsettled([row("gguf-q8_0", 1.20, 1.12, 1.31), row("genai-int4", 1.30, 1.09, 1.94),
                              {"format": "gguf-q4_k_m", "context": 8192, "speedup": 1.4}])
    assert said == [
        "genai-int4 at 8192 tokens: the machine was busy: the paired speed-up spread over the rounds from 1.09x to "
        "1.94x, 65% of its median (> 20%); that speed-up is not settled (more --decode-rounds, or a quieter machine)"]
