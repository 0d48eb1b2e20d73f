"""GGUF, for llama.cpp: a (pruned) decoder language model written as a GGUF file at its pruned size (llama.cpp's
layout, written with the ``gguf`` package). The ``decoder`` extra.

    from multihead.deploy import gguf
    gguf.export_gguf(model, "model.gguf", tokenizer=tokenizer)  # read back by gguf and by transformers

It takes a ``LlamaForCausalLM`` (SmolLM2 and Llama 2/3 checkpoints are this class) or a ``Gemma3ForCausalLM`` (Gemma 3
270M): each layer's counts are read from its projections (:func:`multihead.deploy.llama.layer_counts`), and a cut the
same in every layer is written as the standard configuration every runtime loads: llama.cpp's ``llama`` or ``gemma3``
architecture. A Llama cut that differs between layers (an uneven cut) keeps each layer's counts: llama.cpp's ``deci``
architecture (DeciLM's Llama body) reads per-layer head-count arrays, and ``export_gguf`` says in one line that the
file loads in llama.cpp, not in transformers' GGUF reader. llama.cpp's ``gemma3`` graph makes every layer's tensors at
one head count, so a Gemma 3 cut unevenly is refused. No file is ever written at full size with zeros.

The vocabulary comes from the model's own transformers tokenizer (:func:`tokenizer_fields`) or is copied from the GGUF
file the model came from: a byte-level BPE (SmolLM2's, Llama 3's) is written as llama.cpp's ``gpt2`` vocabulary with
the name llama.cpp gives its split (``gpt-2``, ``llama-bpe``; another split is refused), a BPE with byte fallback
(SentencePiece-style: Gemma's, Llama 2's ``tokenizer.json``) as its ``llama`` (SentencePiece) one.

The file is read back and compared with the torch model before it is returned (:mod:`multihead.deploy.check`): through
``gguf``'s reader (each tensor, the head counts) and through transformers (``AutoModelForCausalLM.from_pretrained(folder,
gguf_file=...)``: logits within the file's rounding, greedy tokens equal); a vocabulary written from a tokenizer must
tokenize :data:`TOKENIZER_TEXTS` as the tokenizer does, read by transformers (``AutoTokenizer.from_pretrained(folder,
gguf_file=...)``) and by llama.cpp where it is built. A deci file, which transformers' reader refuses, is run by
:func:`gguf_model` instead: a Llama built at the file's per-layer counts, each tensor dequantized by ``gguf`` and its
q/k rows put back in transformers' order by transformers' own GGUF tensor processor. A file that differs is deleted
and a ValueError says by how much.

The peer's file is the unpruned model through the same writer (:func:`export_gguf`, f16 or f32): what llama.cpp's
``convert_hf_to_gguf.py`` writes for a Llama or a Gemma 3.
"""

from __future__ import annotations

import importlib.util
import json
import os
import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from multihead.deploy.check import QUANTIZED, TOLERANCE, Served, _compare, _greedy, _prompt
from multihead.deploy.llama import _check_layers, _layers, _rope_kinds, _uneven, layer_counts
from multihead.extras import require

__all__ = ["export_gguf", "gguf_model", "tokenizer_fields"]


GGUF_DTYPES = ("f32", "f16", "q8_0")

#: texts a vocabulary written from a SentencePiece-style tokenizer must tokenize as the tokenizer does: spaces and a
#: run of them, a tab, a newline, digits, accents, another script and an emoji (byte fallback)
TOKENIZER_TEXTS = ("When Mary and John went to the store, John gave a drink to Mary.",
                   "  two  spaces,\ttabs and a newline\nin 2024: 3.14159 -- naïve café",
                   "東京タワーは高い。 Ünïcödé 🙂 <b>tags</b>")


#: Llama 3's pre-tokenizer split (its ``tokenizer.json``'s Split regex), which llama.cpp runs as ``llama-bpe``
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf ``LlamaModel.permute``: within each head, the rotary halves (HF's
    rotate_half layout) interleaved as pairs (GGML's rope): rows (n_head, 2, D/2) -> (n_head, D/2, 2)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def export_gguf(model: nn.Module, path: str | Path, *, dtype: str = "f32", vocab: str | Path | None = None,
                tokenizer=None, prompt_ids=None, new_tokens: int = 8) -> Served:
    """Write ``model`` (a LlamaForCausalLM or a Gemma3ForCausalLM, pruned or not) as a GGUF file of llama.cpp's
    ``llama`` or ``gemma3`` architecture, as llama.cpp's ``convert_hf_to_gguf.py`` writes the model: its tensor names
    (``token_embd``, ``blk.N.attn_q`` ..., ``output``, left out when tied), the head counts, head size
    (``attention.key_length``/``value_length``: a pruned model's H*D differs from its width), 1-D tensors in f32 and
    the matrices in ``dtype`` ("f32" or "f16"). A Llama's q/k rows are permuted to GGML's interleaved rotary layout
    (and ``rope.dimension_count`` written); Gemma 3's RoPE is GGML's NEOX kind, which keeps transformers' rows, and
    every norm weight is written plus one (Gemma's RMSNorm multiplies by 1 + weight, llama.cpp's by the weight),
    with ``rope.freq_base`` the full-attention layers' base and ``attention.sliding_window`` the window.

    A Llama cut that differs between layers (an uneven cut) is written in llama.cpp's ``deci`` architecture, as
    convert_hf_to_gguf.py writes a DeciLM / Llama-3.1-Nemotron-NAS model: a Llama body whose
    ``deci.attention.head_count`` and ``head_count_kv`` are arrays, one count per layer, each layer's q/k/v/o tensors
    at its own size; a layer with every head cut is written as deci's attention-free layer (counts 0, no attention
    tensors: the layer adds nothing before its MLP, as the pruned model computes). llama.cpp loads that file
    (llama-cpp-python 0.3.36, checked by ``bench/gguf_uneven.py``); transformers' GGUF reader does not (it reads one
    head count per model), so a UserWarning says so in one line and the file is run by :func:`gguf_model` (a Llama
    built at the file's per-layer counts) instead.
    Refused: an uneven cut whose layer 0 has every head cut (llama.cpp takes the head size from layer 0's count); a
    Gemma 3, in one line each, where llama.cpp's ``gemma3`` graph or transformers' reader of it (the read-back)
    would compute another model: an uneven cut (the graph makes every layer at one head count), a
    ``query_pre_attn_scalar`` other than the head size and 256, attention-logit or final-logit softcapping,
    bidirectional attention, sliding layers other than five in every six, a sliding RoPE base other than 10000.

    ``vocab``: a GGUF file (the one the model came from) whose ``tokenizer.*`` fields are copied unchanged, so
    llama.cpp tokenizes as before; or the model's own transformers ``tokenizer`` (:func:`tokenizer_fields`: a
    byte-level BPE as a ``gpt2`` vocabulary, a BPE with byte fallback as a ``llama`` SentencePiece one, then checked
    to tokenize :data:`TOKENIZER_TEXTS` alike); neither writes none (transformers and gguf read the file; llama.cpp
    needs one). ``dtype`` "q8_0": the matrices in blocks of 32 at 8 bits (gguf's quantizer), the file's greedy
    tokens and logit difference reported (:data:`QUANTIZED`).

    Checked before it is returned (else deleted, ValueError): read back with ``gguf.GGUFReader`` (every tensor equal
    to the weights as written, the counts), then loaded by ``AutoModelForCausalLM.from_pretrained(folder,
    gguf_file=...)`` (an uneven file: by :func:`gguf_model`) and run on ``prompt_ids`` (default: 16 fixed random ids):
    logits within the dtype's rounding (:data:`TOLERANCE`) and ``new_tokens`` greedy tokens equal to the torch
    model's. An uneven file's :class:`Served` has ``counts`` per layer."""
    counts, path = _gguf_args(model, path, dtype, vocab, new_tokens)
    uneven = len(set(counts)) > 1
    ids = _prompt(model, prompt_ids, new_tokens, "export_gguf")
    gguf = require("gguf", "multihead.deploy.gguf.export_gguf")
    vocab_fields = _vocabulary_fields(gguf, model, vocab, tokenizer)

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".part")
    written = _write_gguf(gguf, model, tmp, counts, dtype, vocab_fields)
    os.replace(tmp, path)

    checks, reader = _read_back(gguf, path, written, _expected_fields(model, counts))
    del written  # the arrays as written (Gemma 3's embedding alone: 335 MB at f16), not needed to run the file
    if tokenizer is not None:
        checks.append(_tokenized_back(path, tokenizer, deci=uneven))
    if uneven:
        where = (f"export_gguf: {path.name} is llama.cpp's deci architecture (per-layer head counts: "
                 f"{_uneven(counts)}): it loads in llama.cpp (llama_cpp.Llama) and multihead's gguf_model, not in "
                 "transformers' GGUF reader (one head count per model).")
        warnings.warn(where, UserWarning, stacklevel=2)
        checks.append(where)
    return _run_back(model, path, dtype, ids, new_tokens, checks, reader=reader)


def gguf_model(path: str | Path) -> nn.Module:
    """A GGUF file as transformers reads it (``AutoModelForCausalLM.from_pretrained(folder, gguf_file=...)``, the
    weights dequantized to float32), in eval mode. A ``deci`` file (per-layer head counts, which transformers' reader
    refuses) is built here instead: a ``LlamaForCausalLM`` on multihead's attention whose layers have the file's
    counts, every tensor dequantized by ``gguf`` and its q/k rows put back by transformers' own
    ``LlamaTensorProcessor`` (the inverse of llama.cpp's rotary permutation), at each layer's counts."""
    return _gguf_model(Path(path))


def _gguf_model(path: Path, reader=None) -> nn.Module:
    """:func:`gguf_model`, with the file's ``gguf.GGUFReader`` when it was read already (a 49,152-token vocabulary
    takes seconds to parse)."""
    transformers = require("transformers", "multihead.deploy.gguf.gguf_model")
    gguf = require("gguf", "multihead.deploy.gguf.gguf_model")
    reader = reader if reader is not None else gguf.GGUFReader(str(path))
    if reader.fields["general.architecture"].contents() == "deci":
        return _deci_model(gguf, transformers, reader)
    # llama and gemma3: transformers' own reader (its tensor processors undo the q/k permutation, Gemma's norm + 1)
    with tempfile.TemporaryDirectory() as d:  # transformers reads the file from a folder: link it there
        os.symlink(path.resolve(), Path(d) / path.name)
        return transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=path.name, dtype=torch.float32).eval()


def _deci_model(gguf, transformers, reader) -> nn.Module:
    """The deci file ``reader`` reads as a LlamaForCausalLM at its per-layer counts (see :func:`gguf_model`)."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    import multihead.hf as mhf

    def field(key):
        f = reader.fields.get(key)
        if f is None:
            raise ValueError(f"gguf_model: the deci file has no {key} field.")
        return f.contents()

    H, Hkv = field("deci.attention.head_count"), field("deci.attention.head_count_kv")  # one count a layer each
    tensors = {t.name: t for t in reader.tensors}
    cfg = transformers.LlamaConfig(
        vocab_size=field("deci.vocab_size"), hidden_size=field("deci.embedding_length"),
        intermediate_size=field("deci.feed_forward_length"), num_hidden_layers=field("deci.block_count"),
        num_attention_heads=max(H), num_key_value_heads=max(H), head_dim=field("deci.attention.key_length"),
        max_position_embeddings=field("deci.context_length"),
        rms_norm_eps=field("deci.attention.layer_norm_rms_epsilon"),
        rope_parameters={"rope_type": "default", "rope_theta": field("deci.rope.freq_base")},
        tie_word_embeddings="output.weight" not in tensors)
    with mhf.loading():
        model = mhf.attach(transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="multihead"))
    for i, m in enumerate(mhf.attention_modules(model).values()):  # each layer at the file's counts (sizes only)
        m.attention_hooks.layout.prune(m, list(range(H[i])), list(range(Hkv[i])))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.DECI, len(H))
    state = model.state_dict()
    with torch.no_grad():
        for hf_name, p in state.items():
            name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
            if name not in tensors:
                i = int(hf_name.split(".")[2]) if ".layers." in hf_name else -1
                if i >= 0 and H[i] == 0 or hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
                    continue  # deci's attention-free layer holds no attention tensors; a tied output reads token_embd
                raise ValueError(f"gguf_model: the deci file has no tensor {name} ({hf_name}).")
            t = tensors[name]
            w = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(tuple(p.shape))  # (out, in)
            if ".attn_q." in name or ".attn_k." in name:
                i = int(name.split(".")[1])  # blk.<i>.attn_q.weight
                counts = {"num_attention_heads": H[i], "num_key_value_heads": Hkv[i]}
                w = LlamaTensorProcessor(config=counts).process(w, name).weights
            p.copy_(torch.tensor(np.asarray(w, dtype=np.float32)))
    return model.eval()


def _run_back(model: nn.Module, path: Path, dtype: str, ids: Tensor, new_tokens: int, checks: list[str], *,
              reader=None) -> Served:
    """The GGUF file read by transformers (dequantized) and run on ``ids``: logits within the dtype's rounding and
    greedy tokens equal to ``model``'s (a quantized type: the difference and the tokens that agree, reported)."""
    with torch.no_grad():
        ref_logits, ref_tokens = _greedy(model, ids, new_tokens)
        got_logits, got_tokens = _greedy(_gguf_model(path, reader), ids, new_tokens)
    counts = layer_counts(model)
    uneven = len(set(counts)) > 1
    counts = counts if uneven else counts[0]  # an uneven file: each layer's
    by = "multihead gguf_model (deci" + (", dequantized)" if dtype in QUANTIZED else ")") if uneven else \
        "transformers gguf_file=" + (" (dequantized)" if dtype in QUANTIZED else "")
    diff = float((got_logits - ref_logits).abs().max())
    if dtype in QUANTIZED:
        same = sum(a == b for a, b in zip(got_tokens, ref_tokens))
        checks.append(f"{by}: logits max |diff| {diff:.3g} ({dtype}: judged by "
                      f"perplexity, not a tolerance), {same} of {new_tokens} greedy tokens equal")
        return Served(path, "gguf", diff, float("inf"), got_tokens, counts, checks)
    tol = TOLERANCE[dtype] * max(1.0, float(ref_logits.abs().max()))
    _compare("export_gguf", path, diff, tol, got_tokens, ref_tokens)
    checks.append(f"{by}: logits max |diff| {diff:.3g} (tolerance {tol:.3g}), {new_tokens} greedy "
                  "tokens equal")
    return Served(path, "gguf", diff, tol, got_tokens, counts, checks)


def _gguf_args(model: nn.Module, path: str | Path, dtype: str, vocab, new_tokens) -> tuple[list, Path]:
    """export_gguf's refusals, before any work: returns the (H, Hkv, D) of every layer and the path."""
    counts = _check_layers(model, "export_gguf")
    if _arch(model, counts) == "gemma3":
        _check_gemma3(model.config, "export_gguf", counts)
    elif len(set(counts)) > 1 and counts[0][0] == 0:
        raise ValueError(f"export_gguf: layer 0 has every head cut ({_uneven(counts)}); llama.cpp's deci graph takes "
                         "the head size from layer 0's head count, so the file would not load: keep a head in layer 0.")
    if dtype not in GGUF_DTYPES:
        raise ValueError(f"export_gguf: dtype={dtype!r}; use one of {GGUF_DTYPES}.")
    path = Path(path)
    if path.suffix != ".gguf" or path.is_dir():
        raise ValueError(f"export_gguf writes a file named *.gguf; got {path}.")
    if vocab is not None and not Path(vocab).is_file():
        raise ValueError(f"export_gguf: vocab={vocab} is not a file; give the GGUF file the model came from, or None.")
    if not isinstance(new_tokens, int) or isinstance(new_tokens, bool) or new_tokens < 1:
        raise ValueError(f"export_gguf: new_tokens must be a whole number >= 1; got {new_tokens!r}.")
    return counts, path


def _arch(model: nn.Module, counts: list[tuple[int, int, int]]) -> str:
    """llama.cpp's architecture for ``model``: gemma3 for a Gemma 3, deci for a Llama whose layers' counts differ,
    else llama."""
    if type(model).__name__ == "Gemma3ForCausalLM":
        return "gemma3"
    return "deci" if len(set(counts)) > 1 else "llama"


def _check_gemma3(cfg, what: str, counts: list[tuple[int, int, int]] | None = None) -> None:
    """A Gemma 3 config (and its layers' (H, Hkv, D), given) refused in one line (ValueError) where llama.cpp's
    gemma3 graph, or transformers' GGUF reader of the file (the read-back: Gemma3TextConfig's defaults for what a
    file converted as convert_hf_to_gguf.py converts Gemma 3 does not say), would compute another model."""
    D, n, scalar = int(cfg.head_dim), int(cfg.num_hidden_layers), cfg.query_pre_attn_scalar
    H = counts[0][0] if counts else int(cfg.num_attention_heads)
    local = _rope_kinds(cfg).get("sliding_attention", {}).get("rope_theta", 10000.0)
    every_sixth = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n)]
    reader = "transformers' GGUF reader (the read-back) does not read it"
    refusals = [
        (counts is not None and len(set(counts)) > 1,
         f"the cut differs between layers ({_uneven(counts or [])}); llama.cpp's gemma3 graph makes every layer's "
         "tensors at one head count: cut the same heads in every layer, or keep it as a transformers folder "
         "(multihead.hf.save)"),
        (scalar != D, f"query_pre_attn_scalar={scalar} with head_dim={D}; llama.cpp's gemma3 graph scales queries by "
                      "1/sqrt(head_dim)"),
        (n == 62 and scalar != cfg.hidden_size / max(H, 1),
         f"query_pre_attn_scalar={scalar} at 62 layers; llama.cpp's gemma3 graph scales Gemma 3 27B's queries by "
         "1/sqrt(hidden_size / query heads), which a cut changes"),
        (scalar != 256, f"query_pre_attn_scalar={scalar}; {reader} (it takes 256)"),
        (cfg.attn_logit_softcapping is not None, "attention-logit softcapping; llama.cpp's gemma3 graph has none"),
        (cfg.final_logit_softcapping is not None, f"final-logit softcapping; {reader}"),
        (bool(getattr(cfg, "use_bidirectional_attention", False)),
         "bidirectional attention (EmbeddingGemma's); llama.cpp's gemma3 graph is causal"),
        (list(cfg.layer_types) != every_sixth,
         f"layer_types {list(cfg.layer_types)}: sliding layers other than five in every six; {reader} (it takes that "
         "pattern, as llama.cpp does from a file converted by convert_hf_to_gguf.py)"),
        (float(local) != 10000.0, f"a sliding-window RoPE base of {local:g}; {reader} (it takes 10000)"),
    ]
    for refused, why in refusals:
        if refused:
            raise ValueError(f"{what}: Gemma 3: {why}.")


def _gguf_header(gguf, model: nn.Module, tmp: Path, counts: list[tuple[int, int, int]], dtype: str):
    """A GGUFWriter on ``tmp`` holding the model's fields as convert_hf_to_gguf.py writes them: llama's, deci's (per-layer
    head-count arrays) or gemma3's (no rotary dimension: NEOX rotary over the whole head; the full-attention layers'
    RoPE base; the sliding window)."""
    cfg = model.config
    layers = _layers(model)
    arch = _arch(model, counts)
    uneven = arch == "deci"
    D = counts[0][2]
    w = gguf.GGUFWriter(str(tmp), arch)
    w.add_name(str(getattr(cfg, "_name_or_path", "") or "multihead").rstrip("/").split("/")[-1] or "multihead")
    w.add_vocab_size(int(cfg.vocab_size))
    w.add_context_length(int(cfg.max_position_embeddings))
    w.add_embedding_length(int(cfg.hidden_size))
    w.add_block_count(len(layers))
    w.add_feed_forward_length(int(layers[0].mlp.gate_proj.weight.shape[0]))
    if arch != "gemma3":
        w.add_rope_dimension_count(D)
    w.add_head_count([c[0] for c in counts] if uneven else counts[0][0])
    w.add_head_count_kv([c[1] for c in counts] if uneven else counts[0][1])
    w.add_key_length(D)
    w.add_value_length(D)
    w.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    rope = _rope_kinds(cfg)
    w.add_rope_freq_base(float(rope.get("full_attention", rope.get("all", {})).get("rope_theta", 10000.0)))
    if arch == "gemma3":
        w.add_sliding_window(int(cfg.sliding_window))
    w.add_file_type({"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                     "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[dtype])
    return w


#: the tensors of a layer's attention block, which a layer with every head cut does not have in deci's layout
_ATTENTION_TENSORS = ("input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
                      "self_attn.v_proj.weight", "self_attn.o_proj.weight")


def _write_gguf(gguf, model: nn.Module, tmp: Path, counts: list[tuple[int, int, int]], dtype: str,
                vocab_fields: list[tuple]) -> dict[str, np.ndarray]:
    """Write the GGUF file ``tmp`` as convert_hf_to_gguf.py writes a Llama (a DeciLM when the counts differ between
    layers) or a Gemma 3; returns {tensor name: array written}."""
    cfg = model.config
    layers = _layers(model)
    arch = _arch(model, counts)
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch.upper()), len(layers))
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    state = model.state_dict()
    cut = {f"model.layers.{i}.{t}" for i, c in enumerate(counts) if c[0] == 0 for t in _ATTENTION_TENSORS}
    tensors = [(names.get_name(n, try_suffixes=(".weight", ".bias")), n, t) for n, t in state.items()
               if not (tied and n == "lm_head.weight") and n not in cut]  # tied: llama.cpp reads token_embd twice
    unnamed = [n for name, n, _ in tensors if name is None]
    if unnamed:
        raise ValueError(f"export_gguf: {unnamed[:3]} have no name in llama.cpp's {arch} layout.")
    w = _gguf_header(gguf, model, tmp, counts, dtype)
    for key, val, vtype, sub in vocab_fields:
        w.add_key_value(key, val, vtype, sub_type=sub)
    written = {}
    for name, hf_name, t in tensors:
        data = t.detach().float().cpu().numpy()
        if arch == "gemma3" and hf_name.endswith("norm.weight"):
            data = data + np.float32(1.0)  # Gemma's RMSNorm multiplies by 1 + weight, llama.cpp's by the weight
        elif arch != "gemma3" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            H, Hkv, _ = counts[int(hf_name.split(".")[2])]  # model.layers.<i>.self_attn...
            # (H*D, E) or (Hkv*D, E), each head's rows in GGML's rotary order
            data = _permute(data, H if hf_name.endswith("q_proj.weight") else Hkv)
        raw = None
        if dtype in QUANTIZED and data.ndim == 2 and data.shape[1] % 32 == 0:  # blocks of 32 along each row
            raw = getattr(gguf.GGMLQuantizationType, QUANTIZED[dtype])
            data = gguf.quants.quantize(np.ascontiguousarray(data), raw)  # (rows, bytes per row) uint8
        elif dtype != "f32" and data.ndim > 1:  # f16, and a quantized file's matrices that make no whole blocks
            data = data.astype(np.float16)
        written[name] = np.ascontiguousarray(data)
        w.add_tensor(name, written[name], raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return written


def _vocabulary_fields(gguf, model: nn.Module, vocab, tokenizer) -> list[tuple]:
    """The ``tokenizer.*`` fields export_gguf writes: ``vocab``'s (a GGUF file), ``tokenizer``'s, or none."""
    if vocab is not None and tokenizer is not None:
        raise ValueError("export_gguf: give vocab= (a GGUF file's vocabulary) or tokenizer= (the model's own), not "
                         "both.")
    if vocab is not None:
        return _vocab_fields(gguf, vocab)
    return tokenizer_fields(gguf, tokenizer, int(model.config.vocab_size)) if tokenizer is not None else []


def _vocab_fields(gguf, vocab: str | Path) -> list[tuple]:
    """(key, value, type, sub_type) of every ``tokenizer.*`` field of the GGUF file ``vocab``."""
    reader = gguf.GGUFReader(str(vocab))
    out = []
    for key, f in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        out.append((key, f.contents(), vtype, sub))
    if not any(k == "tokenizer.ggml.model" for k, *_ in out):
        raise ValueError(f"export_gguf: vocab={vocab} holds no tokenizer (no tokenizer.ggml.model field).")
    return out


def tokenizer_fields(gguf, tokenizer, vocab_size: int) -> list[tuple]:
    """(key, value, type, sub_type) of the GGUF vocabulary of a transformers tokenizer, as convert_hf_to_gguf.py writes
    it: a byte-level BPE (SmolLM2's, Llama 3's) as a ``gpt2`` vocabulary -- every token by id, its type (control: the
    special tokens; user-defined: other added ones), the merges, the special tokens' ids, whether the tokenizer adds
    its BOS and EOS, and llama.cpp's name for its split (:func:`_bpe_pre`); a BPE with byte
    fallback (SentencePiece-style: Gemma's, Llama 2's ``tokenizer.json``) as a ``llama`` (SentencePiece) vocabulary --
    tokens, scores and types (:func:`_llama_fields`). A model whose embedding has more rows than the tokenizer has
    tokens gets ``[PAD<i>]`` tokens marked unused up to ``vocab_size``, as convert_hf_to_gguf.py pads. ValueError, in
    one line, for a tokenizer of another kind (naming it), one whose normalizer llama.cpp's SentencePiece tokenizer
    does not apply, a byte-level split llama.cpp has no name for, or with more tokens than the model's vocabulary."""
    kind, j = _vocabulary(tokenizer, vocab_size)
    if kind == "llama":
        return _llama_fields(gguf, tokenizer, vocab_size, j)
    T = gguf.GGUFValueType
    n = len(tokenizer)
    added = {t.content: t.special for t in tokenizer.added_tokens_decoder.values()}
    tokens = tokenizer.convert_ids_to_tokens(list(range(n)))
    types = [int(gguf.TokenType.CONTROL if added.get(t) else gguf.TokenType.USER_DEFINED if t in added
                 else gguf.TokenType.NORMAL) for t in tokens]
    tokens += [f"[PAD{i}]" for i in range(n, vocab_size)]  # the embedding's rows past the tokenizer's tokens
    types += [int(gguf.TokenType.UNUSED)] * (vocab_size - n)
    merges = [m if isinstance(m, str) else " ".join(m) for m in j["model"].get("merges", [])]
    out = [("tokenizer.ggml.model", "gpt2", T.STRING, None), ("tokenizer.ggml.pre", _bpe_pre(j), T.STRING, None),
           ("tokenizer.ggml.tokens", tokens, T.ARRAY, T.STRING),
           ("tokenizer.ggml.token_type", types, T.ARRAY, T.INT32), ("tokenizer.ggml.merges", merges, T.ARRAY, T.STRING)]
    for key, tid in (("bos", tokenizer.bos_token_id), ("eos", tokenizer.eos_token_id),
                     ("unknown", tokenizer.unk_token_id), ("padding", tokenizer.pad_token_id)):
        if tid is not None:
            out.append((f"tokenizer.ggml.{key}_token_id", int(tid), T.UINT32, None))
    ids = list(tokenizer("a")["input_ids"])  # whether the tokenizer puts its BOS and EOS around a text
    out += [("tokenizer.ggml.add_bos_token", tokenizer.bos_token_id is not None and ids[:1] == [tokenizer.bos_token_id],
             T.BOOL, None),
            ("tokenizer.ggml.add_eos_token", tokenizer.eos_token_id is not None and len(ids) > 1
             and ids[-1:] == [tokenizer.eos_token_id], T.BOOL, None)]
    return out


def _vocabulary(tokenizer, vocab_size: int) -> tuple[str, dict]:
    """("gpt2" or "llama": the GGUF vocabulary llama.cpp tokenizes ``tokenizer`` with, its ``tokenizer.json`` as a
    dict), or ValueError in one line (see :func:`tokenizer_fields`). Cheap: ``multihead prune`` asks it before any
    work."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    j = json.loads(backend.to_str()) if backend is not None else {}
    model = j.get("model") or {}
    if model.get("type") != "BPE":
        raise ValueError(f"export_gguf: tokenizer= is a {model.get('type', type(tokenizer).__name__)} tokenizer; this "
                         "writes byte-level BPE vocabularies (gpt2) and BPE ones with byte fallback (SentencePiece's "
                         "llama): give vocab= the GGUF file the model came from instead.")
    n = len(tokenizer)
    if n > vocab_size:
        raise ValueError(f"export_gguf: the tokenizer has {n} tokens, the model's vocabulary {vocab_size} rows: give "
                         "the model's own tokenizer.")
    if not model.get("byte_fallback"):
        _bpe_pre(j)  # its ValueError: a split llama.cpp has no name for
        return "gpt2", j
    decoder = (j.get("decoder") or {}).get("type")
    if decoder != "Sequence":  # gguf's LlamaHfVocab reads SentencePiece's: "▁" to a space, byte fallback, fuse
        raise ValueError(f"export_gguf: tokenizer= is a BPE with byte fallback whose decoder is {decoder}, not "
                         "SentencePiece's sequence (gguf's LlamaHfVocab reads that one only): give vocab= the GGUF "
                         "file the model came from instead.")
    _space_prefix(j)  # its ValueError: a normalizer llama.cpp does not apply
    return "llama", j


def _bpe_pre(j: dict) -> str:
    """The name llama.cpp gives the pre-tokenizer of the byte-level BPE whose ``tokenizer.json`` is ``j``
    (``tokenizer.ggml.pre``: without it llama.cpp splits text its own default way, which differs on punctuation):
    GPT-2's byte-level regex alone (SmolLM2's) is ``gpt-2``; Llama 3's Split then a byte-level step without its regex
    is ``llama-bpe``. ValueError, in one line, naming any other split: llama.cpp would tokenize another way."""
    pre = j.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers") or [] if pre.get("type") == "Sequence" else [pre]
    if len(steps) == 1 and steps[0].get("type") == "ByteLevel" and steps[0].get("use_regex", True) \
            and not steps[0].get("add_prefix_space"):
        return "gpt-2"
    if len(steps) == 2 and steps[0].get("type") == "Split" and steps[0].get("pattern") == {"Regex": LLAMA3_SPLIT} \
            and steps[0].get("behavior") == "Isolated" and not steps[0].get("invert") \
            and steps[1].get("type") == "ByteLevel" and not steps[1].get("use_regex", True) \
            and not steps[1].get("add_prefix_space"):
        return "llama-bpe"
    raise ValueError(f"export_gguf: tokenizer='s pre-tokenizer ({json.dumps(pre)[:100]}) is not one llama.cpp names "
                     "here (GPT-2's byte-level split, Llama 3's): llama.cpp would split text another way; give vocab= "
                     "the GGUF file the model came from instead.")


def _space_prefix(j: dict) -> bool:
    """Whether llama.cpp's SentencePiece tokenizer must put a space before the text (``add_space_prefix``) to
    tokenize as the tokenizer whose ``tokenizer.json`` is ``j``: its normalizer prepends "▁" (Llama 2's) or its
    Metaspace pre-tokenizer does; Gemma's only turns spaces into "▁". ValueError, in one line, for a normalizer or
    pre-tokenizer step llama.cpp's tokenizer does not take (it turns spaces into "▁" and may prefix one, nothing
    else)."""
    def steps(x: dict | None, key: str) -> list[dict]:
        return [] if not x else list(x.get(key) or []) if x.get("type") == "Sequence" else [x]

    normalizers, prefix, spaces = steps(j.get("normalizer"), "normalizers"), False, False
    for n in normalizers:
        if n.get("type") == "Prepend" and n.get("prepend") == "▁":
            prefix = True
        elif n.get("type") == "Replace" and n.get("pattern") == {"String": " "} and n.get("content") == "▁":
            spaces = True
        else:
            raise ValueError(f"export_gguf: tokenizer='s normalizer {n.get('type')} ({json.dumps(n)[:80]}) is not what "
                             "llama.cpp's SentencePiece tokenizer applies (spaces to '▁', a prefix space): give vocab= "
                             "the GGUF file the model came from instead.")
    for p in steps(j.get("pre_tokenizer"), "pretokenizers"):
        if p.get("type") == "Metaspace" and p.get("replacement") == "▁" and not p.get("split", True):
            prefix = prefix or p.get("prepend_scheme", "always") != "never"
        elif not (p.get("type") == "Split" and p.get("pattern") == {"String": " "} and spaces):  # Gemma's: no-op
            raise ValueError(f"export_gguf: tokenizer='s pre-tokenizer {p.get('type')} ({json.dumps(p)[:80]}) splits "
                             "text where llama.cpp's SentencePiece tokenizer does not: give vocab= the GGUF file the "
                             "model came from instead.")
    return prefix


def _llama_fields(gguf, tokenizer, vocab_size: int, j: dict) -> list[tuple]:
    """A ``llama`` (SentencePiece) GGUF vocabulary from a BPE tokenizer with byte fallback, as convert_hf_to_gguf.py's
    ``_set_vocab_llama_hf`` writes one: gguf's own ``LlamaHfVocab`` (every token by id, ``<0xNN>`` typed byte, the
    special tokens control) and ``SpecialVocab`` (special ids, whether BOS/EOS are added) on the tokenizer's saved
    files, with what ``LlamaHfVocab`` leaves out. The added tokens inside the vocabulary typed as transformers holds
    them (special: control; else user-defined, which llama.cpp matches whole: Gemma's newline runs, ``[multimodal]``).
    The scores: llama.cpp's SentencePiece tokenizer merges first the adjacent pair whose result scores highest, BPE
    the pair whose merge ranks first, so a token scores minus the rank of the first merge that makes it and tokens no
    merge makes score below every merge (``LlamaHfVocab``'s -1000 for all would merge from the left instead).
    ``add_space_prefix`` from the normalizer (:func:`_space_prefix`)."""
    T = gguf.TokenType
    with tempfile.TemporaryDirectory() as d:
        tokenizer.save_pretrained(d)
        vocab = gguf.LlamaHfVocab(Path(d))
        special = gguf.SpecialVocab(Path(d), load_merges=False, n_vocab=vocab_size)
    tokens, _, types = (list(x) for x in zip(*vocab.all_tokens()))
    texts = [t.decode("utf-8") for t in tokens]
    if texts != tokenizer.convert_ids_to_tokens(list(range(len(texts)))):
        raise ValueError("export_gguf: gguf's LlamaHfVocab lists the tokenizer's tokens out of id order (added tokens "
                         "between the vocabulary's); give vocab= the GGUF file the model came from instead.")
    for i, added in tokenizer.added_tokens_decoder.items():
        if i < len(types) and types[i] != T.BYTE:
            types[i] = T.CONTROL if added.special else T.USER_DEFINED
    merges = j["model"].get("merges", [])
    rank: dict[str, int] = {}
    for r, m in enumerate(merges):
        a, b = m.split(" ", 1) if isinstance(m, str) else m
        rank.setdefault(a + b, r)
    scores = [-float(rank.get(t, len(merges))) for t in texts]  # ranks < 2^24: exact in the file's float32
    pad = vocab_size - len(tokens)  # the embedding's rows past the tokenizer's tokens
    tokens += [f"[PAD{i}]".encode() for i in range(len(tokens), vocab_size)]
    scores += [-float(len(merges))] * pad
    types += [T.UNUSED] * pad
    w = gguf.GGUFWriter(None, "llama")  # no file: the writer's own keys and types, gathered
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_add_space_prefix(_space_prefix(j))
    special.add_to_gguf(w, quiet=True)
    return [(k, v.value, v.type, v.sub_type) for k, v in w.kv_data[0].items() if k.startswith("tokenizer.")]


def _tokenized_back(path: Path, tokenizer, *, deci: bool = False) -> str:
    """The file's vocabulary read by transformers (``AutoTokenizer.from_pretrained(folder, gguf_file=...)``; not a
    ``deci`` file, whose architecture its reader refuses) and, where llama.cpp is built (``llama_cpp`` imports), by
    llama.cpp (the vocabulary only): each must tokenize :data:`TOKENIZER_TEXTS` as ``tokenizer`` does (its special
    tokens added and recognised as it does them), else the file is deleted and a ValueError names the reader and the
    text. Returns the check's line (a deci file where llama.cpp is not built: that it was not tokenized back)."""
    transformers = require("transformers", "multihead.deploy.gguf.export_gguf")
    want = [list(tokenizer(t)["input_ids"]) for t in TOKENIZER_TEXTS]
    got = {}
    if not deci:
        with tempfile.TemporaryDirectory() as d:
            os.symlink(path.resolve(), Path(d) / path.name)
            back = transformers.AutoTokenizer.from_pretrained(d, gguf_file=path.name)
        got["transformers' GGUF tokenizer"] = [list(back(t)["input_ids"]) for t in TOKENIZER_TEXTS]
    if importlib.util.find_spec("llama_cpp") is not None:
        import llama_cpp

        llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
        got["llama.cpp"] = [llm.tokenize(t.encode(), add_bos=True, special=True) for t in TOKENIZER_TEXTS]
        llm.close()
    for who, ids in got.items():
        for text, a, b in zip(TOKENIZER_TEXTS, ids, want):
            if a != b:
                path.unlink()
                raise ValueError(f"export_gguf: {who} tokenizes {text!r} as {a[:16]}, the tokenizer as {b[:16]}: the "
                                 "vocabulary written is not the tokenizer's; the file was deleted.")
    if not got:
        return ("vocabulary not tokenized back: transformers' GGUF reader refuses a deci file and llama.cpp is not "
                "built here (make decoder-llama-cpp builds it)")
    return (f"{' and '.join(got)}: {len(TOKENIZER_TEXTS)} texts tokenized as the tokenizer does "
            f"({sum(map(len, want))} tokens)")


def _expected_fields(model: nn.Module, counts: list[tuple[int, int, int]]) -> dict:
    """The fields the file must hold: its architecture, head counts (a deci file: one a layer), head size, layers and
    (gemma3) sliding window."""
    arch = _arch(model, counts)
    H, Hkv = ([c[0] for c in counts], [c[1] for c in counts]) if arch == "deci" else counts[0][:2]
    D = counts[0][2]
    out = {"general.architecture": arch, f"{arch}.attention.head_count": H, f"{arch}.attention.head_count_kv": Hkv,
           f"{arch}.attention.key_length": D, f"{arch}.block_count": len(counts)}
    if arch == "gemma3":
        out[f"{arch}.attention.sliding_window"] = int(model.config.sliding_window)
    else:
        out[f"{arch}.rope.dimension_count"] = D
    return out


def _read_back(gguf, path: Path, written: dict, meta: dict) -> tuple[list[str], object]:
    """The file read back by ``gguf``'s reader and compared with what was written (``meta``: its fields, tensors
    byte for byte): (the check's line, the reader)."""
    reader = gguf.GGUFReader(str(path))

    def field(key):
        f = reader.fields.get(key)
        return None if f is None else f.contents()

    wrong = {k: (field(k), v) for k, v in meta.items() if field(k) != v}
    tensors = {t.name: t for t in reader.tensors}
    if wrong or set(tensors) != set(written):
        path.unlink()
        raise ValueError(f"export_gguf: the file read back differs: fields {wrong}, tensors missing "
                         f"{sorted(set(written) - set(tensors))[:5]} extra {sorted(set(tensors) - set(written))[:5]}; "
                         "it was deleted.")
    for name, want in written.items():
        got = np.asarray(tensors[name].data)
        if got.dtype != want.dtype or got.reshape(want.shape).tobytes() != want.tobytes():
            path.unlink()
            raise ValueError(f"export_gguf: tensor {name} read back differs from the weights written "
                             f"({got.dtype}{tuple(got.shape)} vs {want.dtype}{tuple(want.shape)}); it was deleted.")
    arch = meta["general.architecture"]
    return [f"gguf reader: {len(written)} tensors equal to the weights written; architecture {arch}, head_count "
            f"{meta[f'{arch}.attention.head_count']}, head_count_kv {meta[f'{arch}.attention.head_count_kv']}, head "
            f"size {meta[f'{arch}.attention.key_length']}"], reader
