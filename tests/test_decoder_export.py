"""A decoder served where decoders run (multihead.deploy.gguf, multihead.deploy.genai): a tiny random Llama with grouped key/value
heads (4 query / 2 key-value heads), pruned by a whole key/value group in every layer, written as GGUF (read back by
gguf and by transformers) and as ONNX Runtime GenAI's model (its builder; run by its generator); a cut that differs
between layers written as llama.cpp's deci GGUF (per-layer head counts; read back by gguf and run at its per-layer
counts by gguf_model here, run in llama.cpp by bench/gguf_uneven.py)."""

import importlib.util
import json
import sys

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

import multihead.hf as mh  # noqa: E402
from multihead import heads  # noqa: E402
from multihead.deploy.genai import export_genai  # noqa: E402
from multihead.deploy.gguf import _permute, export_gguf, gguf_model  # noqa: E402
from multihead.deploy.llama import layer_counts, standard_folder  # noqa: E402

V = 128


def _tiny(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   bos_token_id=0, eos_token_id=V - 1, tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(cfg).eval()


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(V)}, unk_token="t1"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="t0", eos_token=f"t{V - 1}",
                                                unk_token="t1")


def _pruned(groups=((2, 3), (2, 3))):
    """The tiny model with the query heads of ``groups[i]`` cut in layer i (heads 2, 3 share key/value head 1)."""
    m = mh.attach(_tiny())
    names = list(mh.attention_modules(m))
    heads.prune(m, {n: list(g) for n, g in zip(names, groups) if g})
    return m


IDS = torch.tensor([[5, 17, 33, 2, 90, 11, 64, 3, 40, 41]])  # (1, L)


@torch.no_grad()
def _greedy(model, n=6):
    seq = IDS
    for _ in range(n):
        seq = torch.cat([seq, model(input_ids=seq).logits[:, -1:].argmax(-1)], dim=1)  # (1, L + step)
    return seq[0, IDS.shape[1]:].tolist()


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_gguf_of_a_pruned_model_is_llama_at_the_pruned_size_and_reads_back(tmp_path, dtype):
    m = _pruned()
    served = export_gguf(m, tmp_path / "p.gguf", dtype=dtype, prompt_ids=IDS, new_tokens=6)
    assert served.counts == (2, 1, 16) and served.max_logit_diff <= served.tolerance
    r = gguf.GGUFReader(str(served.path))
    assert r.fields["llama.attention.head_count"].contents() == 2
    assert r.fields["llama.attention.head_count_kv"].contents() == 1
    shapes = {t.name: tuple(int(x) for x in t.shape) for t in r.tensors}  # GGUF order: (in, out)
    assert shapes["blk.0.attn_q.weight"] == (64, 32) and shapes["blk.1.attn_k.weight"] == (64, 16)
    assert shapes["blk.0.attn_output.weight"] == (32, 64)
    # read by transformers on its own: the pruned model's logits and greedy tokens
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="p.gguf", dtype=torch.float32).eval()
    assert (back.config.num_attention_heads, back.config.num_key_value_heads, back.config.head_dim) == (2, 1, 16)
    with torch.no_grad():
        diff = (back(input_ids=IDS).logits - m(input_ids=IDS).logits).abs().max().item()
    assert diff <= (1e-5 if dtype == "f32" else 1e-2)
    assert _greedy(back) == _greedy(m) == served.tokens


def test_gguf_q_and_k_rows_are_in_llama_cpp_rotary_order(tmp_path):
    """The file's attn_q rows are llama.cpp's permutation of q_proj's: within each head, row 2i is rotary pair i's
    first half, row 2i+1 its second half (HF keeps the halves apart: rows i and i + D/2)."""
    m = _pruned()
    export_gguf(m, tmp_path / "p.gguf", prompt_ids=IDS)
    q = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(str(tmp_path / "p.gguf")).tensors}["blk.0.attn_q.weight"]
    hf = m.model.layers[0].self_attn.q_proj.weight.detach().numpy()  # (H*D, E)
    D = 16
    for h in range(2):
        for i in range(D // 2):
            np.testing.assert_array_equal(q[h * D + 2 * i], hf[h * D + i])
            np.testing.assert_array_equal(q[h * D + 2 * i + 1], hf[h * D + i + D // 2])


def test_a_wrong_file_is_caught_and_deleted(tmp_path, monkeypatch):
    # q/k rows left in HF's order: transformers reads them wrong
    monkeypatch.setattr("multihead.deploy.gguf._permute", lambda w, n: w)
    with pytest.raises(ValueError, match="differs from the torch model.*deleted"):
        export_gguf(_pruned(), tmp_path / "p.gguf", prompt_ids=IDS)
    assert not (tmp_path / "p.gguf").exists()


def test_gguf_copies_the_source_vocabulary(tmp_path):
    src = tmp_path / "src.gguf"
    w = gguf.GGUFWriter(str(src), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(V)])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    served = export_gguf(_pruned(), tmp_path / "p.gguf", vocab=src, prompt_ids=IDS)
    f = gguf.GGUFReader(str(served.path)).fields
    assert f["tokenizer.ggml.model"].contents() == "gpt2" and f["tokenizer.ggml.tokens"].contents()[5] == "t5"


def test_gguf_q8_0_holds_each_matrix_in_blocks_within_their_rounding(tmp_path):
    """Q8_0 (what llama.cpp's users run at 8 bits): every matrix written by gguf's quantizer, read back byte for byte,
    and each dequantized weight within the rounding of its block (half a step of max |w| / 127 over 32 weights, the
    step itself stored in f16) of the model's; the
    1-D tensors stay f32; transformers reads the file (dequantized) and its greedy tokens are reported."""
    m = _pruned()
    served = export_gguf(m, tmp_path / "p.gguf", dtype="q8_0", prompt_ids=IDS, new_tokens=6)
    r = gguf.GGUFReader(str(served.path))
    types = {t.name: t.tensor_type for t in r.tensors}
    assert types["blk.0.attn_q.weight"] == gguf.GGMLQuantizationType.Q8_0
    assert types["blk.0.attn_norm.weight"] == gguf.GGMLQuantizationType.F32
    k = {t.name: t for t in r.tensors}["blk.1.attn_k.weight"]
    got = gguf.quants.dequantize(np.asarray(k.data), k.tensor_type)  # (Hkv*D, E), GGML's rotary row order
    want = _permute(m.model.layers[1].self_attn.k_proj.weight.detach().numpy(), 1)
    step = np.abs(want).reshape(want.shape[0], -1, 32).max(-1, keepdims=True) / 127  # (rows, blocks, 1)
    err = np.abs(got - want).reshape(step.shape[0], -1, 32)
    # q = round(w / d) with d = max/127, then d stored in f16 (2^-11 relative): |w - q d16| <= d/2 + 127 d 2^-11
    assert (err <= step * (0.5 + 127 * 2.0 ** -11) + 1e-7).all()
    assert served.tolerance == float("inf") and "greedy tokens equal" in served.checks[-1]
    assert r.fields["general.file_type"].contents() == int(gguf.LlamaFileType.MOSTLY_Q8_0)


def test_gguf_vocabulary_written_from_the_models_own_tokenizer(tmp_path):
    """No source GGUF: the transformers tokenizer (byte-level BPE) written as a gpt2 vocabulary -- every token by id,
    the special ones as control tokens, its merges and its special ids, padded to the model's vocabulary -- and read
    back by transformers as the same tokenizer; a tokenizer larger than the vocabulary refused. The file is written
    with a small BPE trained in the test; SmolLM2's own tokenizer (49,152 tokens) gives the fields the same way."""
    from multihead.deploy.gguf import tokenizer_fields
    from multihead.models import smollm2_path
    from test_decoder_prune import _byte_bpe

    tok = _byte_bpe()
    torch.manual_seed(0)  # an embedding 8 rows past the tokenizer (as models pad theirs): [PAD<i>] tokens, unused
    cfg = transformers.LlamaConfig(vocab_size=len(tok) + 8, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    m = mh.attach(transformers.LlamaForCausalLM(cfg).eval())
    heads.prune(m, {n: [0, 1] for n in mh.attention_modules(m)})
    served = export_gguf(m, tmp_path / "p.gguf", tokenizer=tok, prompt_ids=IDS)
    f = gguf.GGUFReader(str(served.path)).fields
    tokens = f["tokenizer.ggml.tokens"].contents()
    assert f["tokenizer.ggml.model"].contents() == "gpt2" and len(tokens) == len(tok) + 8
    assert tokens[:len(tok)] == tok.convert_ids_to_tokens(list(range(len(tok)))) and tokens[-1] == f"[PAD{len(tok) + 7}]"
    types = f["tokenizer.ggml.token_type"].contents()
    assert types[tok.eos_token_id] == int(gguf.TokenType.CONTROL) and types[300] == int(gguf.TokenType.NORMAL)
    assert types[-1] == int(gguf.TokenType.UNUSED)
    model = json.loads(tok.backend_tokenizer.to_str())["model"]
    assert f["tokenizer.ggml.merges"].contents() == [" ".join(x) if not isinstance(x, str) else x
                                                     for x in model["merges"]]
    assert f["tokenizer.ggml.eos_token_id"].contents() == tok.eos_token_id
    # llama.cpp's name for GPT-2's split (without it llama.cpp splits " --" as " ", "--"); no BOS added, as tok adds none
    assert f["tokenizer.ggml.pre"].contents() == "gpt-2" and f["tokenizer.ggml.add_bos_token"].contents() is False
    assert any("tokenized as the tokenizer does" in c for c in served.checks)
    back = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="p.gguf")
    text = "When Mary and John went to the store, John gave a drink to Mary."
    assert back(text)["input_ids"][-12:] == tok(text)["input_ids"][-12:]
    with pytest.raises(ValueError, match=r"the tokenizer has \d+ tokens, the model's vocabulary 128 rows"):
        export_gguf(_pruned(), tmp_path / "q.gguf", tokenizer=tok, prompt_ids=IDS)
    try:  # the real thing's fields (no file: writing and reading 49,152 tokens is what made this test slow)
        real = transformers.AutoTokenizer.from_pretrained(smollm2_path())
    except (FileNotFoundError, ImportError) as e:
        pytest.skip(str(e))
    fields = {k: v for k, v, *_ in tokenizer_fields(gguf, real, len(real) + 8)}
    assert fields["tokenizer.ggml.tokens"][:len(real)] == real.convert_ids_to_tokens(list(range(len(real))))
    assert len(fields["tokenizer.ggml.merges"]) > 40000 and fields["tokenizer.ggml.eos_token_id"] == real.eos_token_id
    assert fields["tokenizer.ggml.pre"] == "gpt-2"  # SmolLM2's tokenizer.json: GPT-2's byte-level split alone


def _split_bpe(pre):
    """A byte-level BPE of 600 tokens trained here on the language reference behind the pre-tokenizer ``pre``, with a
    BOS it puts before every text (Llama 3's way)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    from multihead.apps.common.data import sentences

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    t.train_from_iterator(sentences(), trainer)
    t.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    t.decoder = decoders.ByteLevel()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<s>", eos_token="</s>")


def test_a_byte_level_split_is_named_as_llama_cpp_names_it_or_refused(tmp_path):
    """Llama 3's split (a Split of its regex, then bytes) is written as llama.cpp's ``llama-bpe`` with the BOS the
    tokenizer adds, and the file tokenizes the check texts (digits, punctuation runs, Unicode) as the tokenizer does
    in transformers' reader and, where it is built, llama.cpp; a split llama.cpp has no name for is refused in one
    line before anything is written."""
    from tokenizers import Regex, pre_tokenizers

    from multihead.deploy.gguf import LLAMA3_SPLIT

    tok = _split_bpe(pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3_SPLIT), "isolated"),
                                              pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]))
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    m = mh.attach(transformers.LlamaForCausalLM(cfg).eval())
    served = export_gguf(m, tmp_path / "l3.gguf", tokenizer=tok, prompt_ids=IDS)
    f = gguf.GGUFReader(str(served.path)).fields
    assert f["tokenizer.ggml.pre"].contents() == "llama-bpe" and f["tokenizer.ggml.add_bos_token"].contents() is True
    line = next(c for c in served.checks if "tokenized as the tokenizer does" in c)
    assert "transformers' GGUF tokenizer" in line
    if importlib.util.find_spec("llama_cpp") is not None:
        assert "llama.cpp" in line
    other = _split_bpe(pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                pre_tokenizers.ByteLevel(add_prefix_space=False)]))
    with pytest.raises(ValueError, match=r"^export_gguf: tokenizer='s pre-tokenizer \(\{\"type\": \"Sequence\".* is "
                                         r"not one llama.cpp names here .*give vocab= the GGUF file"):
        export_gguf(m, tmp_path / "other.gguf", tokenizer=other, prompt_ids=IDS)
    assert not (tmp_path / "other.gguf").exists() and not (tmp_path / "other.gguf.part").exists()


def test_standard_folder_loads_at_the_pruned_size(tmp_path):
    m = _pruned()
    standard_folder(m, tmp_path / "hf", tokenizer=_tokenizer())
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (2, 1, 16)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=IDS).logits, m(input_ids=IDS).logits, atol=1e-5, rtol=0)


def test_genai_builds_the_pruned_model_and_generates_its_tokens(tmp_path):
    pytest.importorskip("onnxruntime_genai")
    m = _pruned()
    served = export_genai(m, tmp_path / "g", tokenizer=_tokenizer(), prompt_ids=IDS, new_tokens=6)
    cfg = json.loads((tmp_path / "g" / "genai_config.json").read_text())["model"]["decoder"]
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_size"]) == (2, 1, 16)
    assert served.tokens == _greedy(m) and served.max_logit_diff <= 1e-4  # int4: test_decoder_prune's formats test
    _genai_model_scores_text_as_the_torch_model(served.path, m)


def _genai_model_scores_text_as_the_torch_model(folder, m):
    """genai_model: the folder called like the torch model on a right-padded batch (each row's real tokens run by
    onnxruntime_genai): every real position's logits within fp32 rounding of the torch model's (what the formats'
    perplexity cost is measured with); padded positions zeros; a folder that is not GenAI's refused."""
    from multihead.deploy.check import TOLERANCE
    from multihead.deploy.genai import genai_model

    ids = torch.cat([IDS, IDS.flip(1)])  # (2, L)
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0  # the second row: 3 padded positions
    got = genai_model(folder)(input_ids=ids, attention_mask=mask).logits  # (2, L, V)
    with torch.no_grad():
        want0, want1 = m(input_ids=ids[:1]).logits[0], m(input_ids=ids[1:, :-3]).logits[0]  # (L, V), (L - 3, V)
    tol = TOLERANCE["fp32"] * max(1.0, float(want0.abs().max()))
    assert (got[0] - want0).abs().max() <= tol and (got[1, :-3] - want1).abs().max() <= tol
    assert not got[1, -3:].any()
    with pytest.raises(ValueError, match="holds no genai_config.json"):
        genai_model(folder.parent)


def test_genais_peer_is_its_builder_on_the_unpruned_checkpoint_made_once(tmp_path):
    """standard_genai: GenAI's builder on the unpruned folder as its users run it (fp32, CPU) -- the unpruned head
    counts, the torch model's greedy tokens -- and kept where the folder already holds it (the builder runs once: ~15 s)."""
    og = pytest.importorskip("onnxruntime_genai")
    from multihead.deploy.genai import _genai_greedy, standard_genai

    m = _tiny()
    m.save_pretrained(tmp_path / "hf")
    _tokenizer().save_pretrained(tmp_path / "hf")
    peer = standard_genai(tmp_path / "hf", tmp_path / "peer")
    cfg = json.loads((peer / "genai_config.json").read_text())["model"]["decoder"]
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_size"]) == (4, 2, 16)
    assert _genai_greedy(og, peer, IDS, 6)[1] == _greedy(m)
    made = (peer / "genai_config.json").stat().st_mtime_ns
    assert standard_genai(tmp_path / "hf", tmp_path / "peer") == peer
    assert (peer / "genai_config.json").stat().st_mtime_ns == made


def _unpermute(w, n_head):
    """The inverse of llama.cpp's q/k permutation: rows (n_head, D/2, 2) back to HF's (n_head, 2, D/2)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


GGUF_OF = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
           "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
           "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def _uneven(layers, groups):
    """A tiny model of ``layers`` layers with the query heads of ``groups[i]`` cut in layer i."""
    m = mh.attach(_tiny_layers(layers))
    heads.prune(m, {n: list(g) for n, g in zip(mh.attention_modules(m), groups) if g})
    return m


def _tiny_layers(layers):
    torch.manual_seed(1)
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   bos_token_id=0, eos_token_id=V - 1, tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_uneven_cut_written_as_deci_with_each_layers_counts_and_weights(tmp_path, dtype):
    """Layer 0 keeps 2 of 4 query heads and 1 of 2 key/value groups, layer 1 keeps all: llama.cpp's deci layout
    (per-layer head-count arrays), each layer's tensors at its own size and equal to the pruned model's weights."""
    m = _pruned(groups=((2, 3), ()))
    with pytest.warns(UserWarning, match="loads in llama.cpp.*not in transformers' GGUF reader") as rec:
        served = export_gguf(m, tmp_path / "u.gguf", dtype=dtype, prompt_ids=IDS)
    assert "\n" not in str(rec[0].message) and str(rec[0].message) in served.checks
    assert served.counts == [(2, 1, 16), (4, 2, 16)] and served.max_logit_diff <= served.tolerance
    # run from the file at its per-layer counts (gguf_model): the pruned model's greedy tokens
    back = gguf_model(served.path)
    assert [layer_counts(back)[i][:2] for i in (0, 1)] == [(2, 1), (4, 2)]
    with torch.no_grad():
        assert (back(input_ids=IDS).logits - m(input_ids=IDS).logits).abs().max() <= (1e-5 if dtype == "f32" else 1e-2)
    assert _greedy(back, 8) == _greedy(m, 8) == served.tokens
    r = gguf.GGUFReader(str(served.path))
    f = {k: v.contents() for k, v in r.fields.items()}
    assert f["general.architecture"] == "deci"
    assert f["deci.attention.head_count"] == [2, 4] and f["deci.attention.head_count_kv"] == [1, 2]
    assert f["deci.attention.key_length"] == f["deci.rope.dimension_count"] == 16
    tensors = {t.name: t for t in r.tensors}
    shapes = {n: tuple(int(x) for x in t.shape) for n, t in tensors.items()}  # GGUF order: (in, out)
    assert [shapes[f"blk.{i}.attn_{x}.weight"] for i in (0, 1) for x in ("q", "k", "v", "output")] == [
        (64, 32), (64, 16), (64, 16), (32, 64), (64, 64), (64, 32), (64, 32), (64, 64)]
    counts = layer_counts(m)
    want_dtype = np.float16 if dtype == "f16" else np.float32
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    for hf_name, w in m.state_dict().items():  # every tensor of the torch model, each found in the file
        i, rest = (int(hf_name.split(".")[2]), ".".join(hf_name.split(".")[3:-1])) if "layers" in hf_name else (0, "")
        got = np.asarray(tensors[top.get(hf_name) or f"blk.{i}.{GGUF_OF[rest]}.weight"].data).reshape(w.shape)
        if rest in ("self_attn.q_proj", "self_attn.k_proj"):
            got = _unpermute(got, counts[i][0] if rest.endswith("q_proj") else counts[i][1])
        w = w.detach().numpy()
        np.testing.assert_array_equal(got, w.astype(want_dtype) if w.ndim > 1 else w)
    assert len(tensors) == len(m.state_dict())
    # what the warning says: transformers' GGUF reader does not load it
    with pytest.raises(ValueError, match="deci"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="u.gguf")


def test_a_layer_with_every_head_cut_is_deci_attention_free_layer(tmp_path):
    """Layer 1 loses all 4 heads: counts 0 and no attention tensors (not even its norm), as llama.cpp's deci graph
    runs an attention-free layer (the pruned model's attention adds zero there)."""
    m = _uneven(3, ((2, 3), (0, 1, 2, 3), ()))
    with torch.no_grad():  # the pruned model: layer 1's attention adds exactly nothing
        x = torch.randn(1, 5, 64)
        pos = (torch.zeros(1, 5, 16), torch.ones(1, 5, 16))
        assert m.model.layers[1].self_attn(x, pos, None)[0].abs().max() == 0
    with pytest.warns(UserWarning, match="layers \\[1\\] H=0, Hkv=0"):
        served = export_gguf(m, tmp_path / "u.gguf", prompt_ids=IDS, new_tokens=8)
    r = gguf.GGUFReader(str(served.path))
    assert r.fields["deci.attention.head_count"].contents() == [2, 0, 4]
    assert r.fields["deci.attention.head_count_kv"].contents() == [1, 0, 2]
    names = {t.name for t in r.tensors}
    assert not {n for n in names if n.startswith("blk.1.attn")}
    assert {"blk.1.ffn_norm.weight", "blk.1.ffn_up.weight", "blk.0.attn_norm.weight", "blk.2.attn_q.weight"} <= names
    assert served.tokens == _greedy(m, 8) == _greedy(gguf_model(served.path), 8)  # run at its counts, layer 1 none


def test_uneven_cut_refused_where_one_count_holds_every_layer(tmp_path):
    m = _pruned(groups=((2, 3), ()))  # layer 0 cut, layer 1 whole
    assert layer_counts(m) == [(2, 1, 16), (4, 2, 16)]
    with pytest.raises(ValueError, match=r"differs between layers \(layers \[0\] H=2, Hkv=1; layers \[1\] H=4.*"
                       "export_gguf"):
        export_genai(m, tmp_path / "g", tokenizer=_tokenizer())
    with pytest.raises(ValueError, match="one head count for every layer"):
        standard_folder(m, tmp_path / "hf")
    # llama.cpp takes the head size from layer 0's count: a first layer with no head is refused, naming it
    with pytest.raises(ValueError, match="layer 0 has every head cut.*keep a head in layer 0") as e:
        export_gguf(_uneven(2, ((0, 1, 2, 3), ())), tmp_path / "p.gguf")
    assert "\n" not in str(e.value)
    assert list(tmp_path.iterdir()) == []


def test_bad_input_refused_in_one_line(tmp_path):
    m = _pruned()
    cases = [
        (lambda: export_gguf(m, tmp_path / "p.bin"), ValueError, r"\*\.gguf"),
        (lambda: export_gguf(m, tmp_path / "p.gguf", dtype="q4_0"), ValueError, "dtype='q4_0'"),
        (lambda: export_gguf(m, tmp_path / "p.gguf", vocab=tmp_path / "none.gguf"), ValueError, "not a file"),
        (lambda: export_gguf(m, tmp_path / "p.gguf", prompt_ids=torch.zeros(1, 60, dtype=torch.long)),
         ValueError, "longer than the model's 64 positions"),
        (lambda: export_gguf(m, tmp_path / "p.gguf", prompt_ids=[3, V]), ValueError, "outside the vocabulary"),
        (lambda: export_genai(m, tmp_path / "g", tokenizer=None), TypeError, "tokenizer must be"),
        (lambda: export_genai(m, tmp_path / "g", tokenizer=_tokenizer(), precision="int8"), ValueError,
         "precision='int8'"),
        (lambda: export_gguf(m, tmp_path / "p.gguf", tokenizer=_tokenizer()), ValueError,
         "this writes byte-level BPE vocabularies"),
        (lambda: export_gguf(torch.nn.Linear(2, 2), tmp_path / "p.gguf"), TypeError, "transformers model"),
    ]
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=V))
    cases.append((lambda: export_gguf(gpt2, tmp_path / "p.gguf"), ValueError, "got GPT2LMHeadModel"))
    for call, exc, msg in cases:
        with pytest.raises(exc, match=msg) as e:
            call()
        assert "\n" not in str(e.value)
    assert list(tmp_path.iterdir()) == []


def test_gated_or_mean_compensated_models_refused(tmp_path):
    m = _pruned()
    name = next(iter(mh.attention_modules(m)))
    with heads.gated(m, {name: torch.tensor([1.0, 0.0])}), pytest.raises(ValueError, match="heads.prune first"):
        export_gguf(m, tmp_path / "p.gguf")
    m.model.layers[0].self_attn.o_proj.bias = torch.nn.Parameter(torch.zeros(64))
    with pytest.raises(ValueError, match="mean_outputs"):
        export_gguf(m, tmp_path / "p.gguf")


def test_missing_extra_names_what_installs_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)
    with pytest.raises(ImportError, match=r"multihead\[decoder\]"):
        export_gguf(_pruned(), tmp_path / "p.gguf")
    monkeypatch.setitem(sys.modules, "onnxruntime_genai", None)
    with pytest.raises(ImportError, match=r"multihead\[decoder\]"):
        export_genai(_pruned(), tmp_path / "g", tokenizer=_tokenizer())


# --- Gemma 3: llama.cpp's gemma3 architecture, and a SentencePiece-style vocabulary ---


def _sentencepiece_bpe(size: int = 1500):
    """A BPE with byte fallback laid out as Gemma's tokenizer.json is (SentencePiece's kind: spaces as "▁", no prefix
    space, the specials then the newline -- an added token matched whole, inside the vocabulary -- then the 256 byte
    tokens <0x00>..<0xFF>, BOS added), trained here in a second on the language reference and the IOI set's words (one
    token each, with their "▁"): what export_gguf writes as llama.cpp's llama vocabulary. Gemma's own (262,144 tokens)
    takes a minute to write: checked by hand."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    from multihead.apps.common import ioi
    from multihead.apps.common.data import sentences

    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    t = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    t.normalizer = normalizers.Replace(" ", "▁")
    t.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never")  # merges inside words only, as SentencePiece
    words = " " + " ".join([*ioi.NAMES, *ioi.PLACES, *ioi.OBJECTS])
    t.train_from_iterator([*sentences(), *ioi.TEMPLATES, *[words] * 50],
                          trainers.BpeTrainer(vocab_size=size, special_tokens=specials, show_progress=False))
    trained = json.loads(t.to_str())["model"]
    vocab = {s: i for i, s in enumerate([*specials, "\n", *(f"<0x{b:02X}>" for b in range(256))])}
    for piece, _ in sorted(trained["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    bpe.normalizer = normalizers.Replace(" ", "▁")
    bpe.pre_tokenizer = pre_tokenizers.Split(" ", "merged_with_previous")  # Gemma's: nothing left to split
    bpe.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    bpe.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A $B:1",
                                                       special_tokens=[("<bos>", 2)])
    bpe.add_special_tokens(specials)
    bpe.add_tokens([AddedToken("\n", normalized=False)])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<bos>", eos_token="<eos>",
                                                unk_token="<unk>", pad_token="<pad>")


@pytest.fixture(scope="module")
def spm():
    return _sentencepiece_bpe()


def _tiny_gemma(vocab_size: int, layers: int = 6, **kw):
    """A random tiny Gemma 3: 4 query heads sharing 1 key/value head of Gemma's size (256, the query scale), five
    sliding layers (a window of 4 tokens) in every six, the norms drawn around 0 so that llama.cpp's weight = 1 +
    Gemma's matters."""
    torch.manual_seed(0)
    cfg = transformers.Gemma3TextConfig(**{**dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, sliding_window=4, max_position_embeddings=64,
        bos_token_id=2, eos_token_id=1, pad_token_id=0), **kw})
    m = transformers.Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0.0, 0.3)
    return m


def _pruned_gemma(vocab_size: int, **kw):
    """The tiny Gemma 3 with query heads 1 and 3 of its one group cut in every layer (H 4 -> 2, Hkv 1)."""
    m = mh.attach(_tiny_gemma(vocab_size, **kw))
    heads.prune(m, {n: [1, 3] for n in mh.attention_modules(m)})
    return m


def test_gguf_of_a_pruned_gemma3_is_gemma3_at_the_pruned_size_with_its_tokenizer_and_reads_back(tmp_path, spm):
    """llama.cpp's gemma3 architecture as convert_hf_to_gguf.py writes Gemma 3: the pruned counts, its norms plus one,
    q/k rows as transformers keeps them (NEOX rotary), the full layers' RoPE base and the window; read back by
    transformers on its own (a prompt longer than the window: the sliding layers see only their last 4 tokens), its
    logits within f16's rounding and its greedy tokens the pruned model's. The vocabulary from the model's own BPE
    with byte fallback (Gemma's kind) as llama.cpp's llama (SentencePiece) one: every token by id, byte tokens typed
    byte, the specials control, the newline (an added token inside the vocabulary) user-defined, each merge's token
    scored minus its rank (llama.cpp merges the highest score first, BPE the lowest rank), no prefix space, BOS added,
    padded to the model's rows; tokenized back alike by transformers' reader of the file (and by llama.cpp where it
    is built: the check's line names it)."""
    n = len(spm)
    m = _pruned_gemma(n + 3)
    ids = torch.tensor([spm("When Mary and John went to the store, John gave a drink to")["input_ids"]])  # (1, L)
    assert ids.shape[1] > 4
    served = export_gguf(m, tmp_path / "g.gguf", dtype="f16", tokenizer=spm, prompt_ids=ids, new_tokens=6)
    assert served.counts == (2, 1, 256) and served.max_logit_diff <= served.tolerance
    assert any(c.startswith("transformers' GGUF tokenizer") and "3 texts tokenized as the tokenizer does" in c
               for c in served.checks)
    r = gguf.GGUFReader(str(served.path))
    f = {k: v.contents() for k, v in r.fields.items()}
    assert f["general.architecture"] == "gemma3" and f["gemma3.block_count"] == 6
    assert (f["gemma3.attention.head_count"], f["gemma3.attention.head_count_kv"]) == (2, 1)
    assert f["gemma3.attention.key_length"] == f["gemma3.attention.value_length"] == 256
    assert f["gemma3.attention.sliding_window"] == 4 and f["gemma3.rope.freq_base"] == 1e6
    assert "gemma3.rope.dimension_count" not in f
    tensors = {t.name: np.asarray(t.data) for t in r.tensors}
    shapes = {t.name: tuple(int(x) for x in t.shape) for t in r.tensors}  # GGUF order: (in, out)
    assert shapes["blk.0.attn_q.weight"] == (64, 512) and shapes["blk.0.attn_k.weight"] == (64, 256)
    assert shapes["blk.0.attn_output.weight"] == (512, 64) and shapes["blk.0.attn_q_norm.weight"] == (256,)
    assert "output.weight" not in tensors  # tied: llama.cpp reads token_embd twice
    layer = m.model.layers[5]
    for name, norm in (("blk.5.attn_k_norm.weight", layer.self_attn.k_norm), ("output_norm.weight", m.model.norm),
                       ("blk.5.post_ffw_norm.weight", layer.post_feedforward_layernorm)):
        np.testing.assert_array_equal(tensors[name], norm.weight.detach().numpy() + np.float32(1))
    q = layer.self_attn.q_proj.weight.detach().numpy()  # (H*D, E): HF's rows, unpermuted
    np.testing.assert_array_equal(tensors["blk.5.attn_q.weight"], q.astype(np.float16))
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="g.gguf", dtype=torch.float32).eval()
    assert type(back).__name__ == "Gemma3ForCausalLM" and back.config.layer_types == m.config.layer_types
    assert (back.config.num_attention_heads, back.config.num_key_value_heads, back.config.sliding_window) == (2, 1, 4)
    with torch.no_grad():
        assert (back(input_ids=ids).logits - m(input_ids=ids).logits).abs().max().item() <= 2e-2
    seq, want = ids, []
    with torch.no_grad():
        for _ in range(6):
            want.append(int(m(input_ids=seq).logits[0, -1].argmax()))
            seq = torch.cat([seq, torch.tensor([[want[-1]]])], dim=1)  # (1, L + step)
    assert served.tokens == want
    # the vocabulary
    tokens, scores, types = (f[f"tokenizer.ggml.{k}"] for k in ("tokens", "scores", "token_type"))
    assert f["tokenizer.ggml.model"] == "llama" and len(tokens) == len(scores) == len(types) == n + 3
    assert tokens[:n] == spm.convert_ids_to_tokens(list(range(n))) and tokens[n:] == [f"[PAD{i}]" for i in range(n, n + 3)]
    T = gguf.TokenType
    assert [types[i] for i in (2, 4, 5 + 0x41, n - 1, n)] == [T.CONTROL, T.USER_DEFINED, T.BYTE, T.NORMAL, T.UNUSED]
    merges = json.loads(spm.backend_tokenizer.to_str())["model"]["merges"]
    first = {}
    for r, (a, b) in enumerate(x.split(" ") if isinstance(x, str) else x for x in merges):
        first.setdefault(a + b, r)
    assert len(first) > 1000 and all(scores[spm.convert_tokens_to_ids(t)] == -r for t, r in first.items())
    assert scores[spm.convert_tokens_to_ids("▁")] == -len(merges)  # made by no merge: below every merge
    assert f["tokenizer.ggml.add_space_prefix"] is False and f["tokenizer.ggml.add_bos_token"] is True
    assert (f["tokenizer.ggml.bos_token_id"], f["tokenizer.ggml.eos_token_id"]) == (2, 1)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="g.gguf")
    text = "When Mary and John went to the park,\nJohn gave a ring to Mary. 東京"
    assert tok(text)["input_ids"] == spm(text)["input_ids"]


def test_a_sentencepiece_vocabulary_that_tokenizes_otherwise_is_caught_and_deleted(tmp_path, spm, monkeypatch):
    """Two tokens' texts swapped in the vocabulary written: transformers' reader of the file tokenizes the first of
    TOKENIZER_TEXTS otherwise, and the file is deleted."""
    import multihead.deploy.gguf as g

    a, b = spm("When Mary", add_special_tokens=False)["input_ids"][:2]
    real = g._llama_fields

    def swapped(*args):
        out = real(*args)
        for key, value, *_ in out:
            if key == "tokenizer.ggml.tokens":
                value[a], value[b] = value[b], value[a]
        return out

    monkeypatch.setattr(g, "_llama_fields", swapped)
    with pytest.raises(ValueError, match=r"tokenizes 'When Mary.*the vocabulary written is not the tokenizer's; the "
                                         r"file was deleted") as e:
        export_gguf(_pruned_gemma(len(spm)), tmp_path / "g.gguf", tokenizer=spm, prompt_ids=[2, 40, 41])
    assert "\n" not in str(e.value) and not (tmp_path / "g.gguf").exists()


def test_llama_cpp_runs_the_pruned_gemma3_file_at_its_size(tmp_path, spm, monkeypatch):
    """Where llama.cpp is built (make decoder-llama-cpp): the pruned Gemma 3 file loads at 2 query heads and gives the
    pruned model's greedy tokens, and export_gguf's check tokenizes in llama.cpp too -- which catches gguf's
    LlamaHfVocab's scores alone (-1000 for every token: llama.cpp would merge from the left), that transformers'
    reader of the file (which orders merges by position) lets through."""
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is None:  # out of make test: a C++ build of an hour on 2 cores
        pytest.skip("llama.cpp is not built here (make decoder-llama-cpp builds it)")
    import llama_cpp

    import multihead.deploy.gguf as g

    m = _pruned_gemma(len(spm))
    ids = spm("When Mary and John went to the store, John gave a drink to")["input_ids"]
    served = export_gguf(m, tmp_path / "g.gguf", dtype="f16", tokenizer=spm, prompt_ids=ids, new_tokens=6)
    assert any(c.startswith("transformers' GGUF tokenizer and llama.cpp:") for c in served.checks)
    llm = llama_cpp.Llama(model_path=str(served.path), n_ctx=64, n_threads=2, verbose=False)
    assert llama_cpp.llama_model_n_head(llm.model) == 2 and llama_cpp.llama_model_n_head_kv(llm.model) == 1
    tokens = []
    for t in llm.generate(ids, top_k=1, temp=0.0, reset=True):
        tokens.append(int(t))
        if len(tokens) == 6:
            break
    llm.close()
    assert tokens == served.tokens
    real = g._llama_fields

    def flat(*args):
        return [(k, [-1000.0] * len(v) if k == "tokenizer.ggml.scores" else v, *rest) for k, v, *rest in real(*args)]

    monkeypatch.setattr(g, "_llama_fields", flat)
    with pytest.raises(ValueError, match="llama.cpp tokenizes .* the file was deleted"):
        export_gguf(m, tmp_path / "flat.gguf", tokenizer=spm, prompt_ids=ids)


def test_gemma3_refused_in_one_line_where_a_runtime_would_compute_another_model(tmp_path):
    """Before any work: what llama.cpp's gemma3 graph, or transformers' GGUF reader of the file (the read-back),
    would compute otherwise -- and GenAI's builder, which fails on transformers 5's Gemma 3 config."""
    uneven = mh.attach(_tiny_gemma(V, layers=2))
    heads.prune(uneven, {next(iter(mh.attention_modules(uneven))): [1, 3]})  # layer 0 cut, layer 1 whole
    rope = {"full_attention": {"rope_type": "default", "rope_theta": 1e6}}
    cases = [
        (uneven, r"the cut differs between layers \(layers \[0\] H=2, Hkv=1; layers \[1\] H=4, Hkv=1\); llama.cpp's "
                 "gemma3 graph makes every layer's tensors at one head count"),
        (_tiny_gemma(V, 2, head_dim=32), "query_pre_attn_scalar=256 with head_dim=32; llama.cpp's gemma3 graph "
                                         r"scales queries by 1/sqrt\(head_dim\)"),
        (_tiny_gemma(V, 2, head_dim=32, query_pre_attn_scalar=32), "query_pre_attn_scalar=32; transformers' GGUF "
                                                                   r"reader \(the read-back\) does not read it"),
        (_tiny_gemma(V, 2, attn_logit_softcapping=50.0), "attention-logit softcapping; llama.cpp's gemma3 graph has "
                                                         "none"),
        (_tiny_gemma(V, 2, final_logit_softcapping=30.0), "final-logit softcapping; transformers' GGUF reader"),
        (_tiny_gemma(V, 2, layer_types=["full_attention", "sliding_attention"]), "sliding layers other than five in "
                                                                                 "every six"),
        (_tiny_gemma(V, 2, rope_parameters={**rope, "sliding_attention": {"rope_type": "default",
                                                                          "rope_theta": 2e4}}),
         "a sliding-window RoPE base of 20000"),
        (_tiny_gemma(V, 2, rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
         "RoPE of type 'linear' in the full_attention layers; this export writes the default RoPE only"),
    ]
    for model, message in cases:
        with pytest.raises(ValueError, match=message) as e:
            export_gguf(model, tmp_path / "g.gguf")
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="GenAI's builder .* fails on Gemma3ForCausalLM: it reads transformers 4's "
                                         "Gemma 3 config") as e:
        export_genai(_tiny_gemma(V, 2), tmp_path / "genai", tokenizer=_tokenizer())
    assert "\n" not in str(e.value)
    # a BPE with byte fallback llama.cpp's SentencePiece tokenizer would read otherwise
    from tokenizers import Tokenizer, decoders, models, normalizers

    def byte_fallback(normalizer, decoder):
        t = Tokenizer(models.BPE({"<unk>": 0, "a": 1, "<0x61>": 2}, [], unk_token="<unk>", byte_fallback=True))
        t.normalizer, t.decoder = normalizer, decoder
        return transformers.PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<unk>")

    sentencepiece = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    for tok, message in [(byte_fallback(normalizers.NFKC(), sentencepiece), "normalizer NFKC .* is not what "
                                                                            "llama.cpp's SentencePiece tokenizer"),
                         (byte_fallback(None, decoders.ByteFallback()), "whose decoder is ByteFallback, not "
                                                                        "SentencePiece's sequence")]:
        with pytest.raises(ValueError, match=message) as e:
            export_gguf(_tiny_gemma(V, 2), tmp_path / "g.gguf", tokenizer=tok)
        assert "\n" not in str(e.value)
    assert list(tmp_path.iterdir()) == []
