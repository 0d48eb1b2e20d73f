"""A (pruned) decoder language model served where decoders run, at its pruned size: a GGUF file (llama.cpp's layout,
written with the ``gguf`` package) and ONNX Runtime GenAI's model (its own builder). The ``decoder`` extra.

    from multihead.hf import decoder_export
    decoder_export.export_gguf(model, "model.gguf", vocab="source.gguf")  # read back by gguf and by transformers
    decoder_export.export_genai(model, "genai", tokenizer=tokenizer)     # ONNX Runtime GenAI's builder, then generate

Both take a ``LlamaForCausalLM`` (SmolLM2 and Llama 2/3 checkpoints are this class): each layer's query heads H,
key/value heads Hkv and head size D are read from its projections (not from the config, which a prune leaves at the
original counts), and a cut the same in every layer is written as the standard configuration
(``num_attention_heads=H``, ``num_key_value_heads=Hkv``, ``head_dim=D``) every runtime loads. A cut that differs
between layers (an uneven cut) keeps each layer's counts in GGUF only: llama.cpp's ``deci`` architecture (DeciLM's
Llama body) reads per-layer head-count arrays, and ``export_gguf`` says in one line that the file loads in llama.cpp,
not in transformers' GGUF reader. ONNX Runtime GenAI's builder and a standard transformers config hold one count for
every layer: ``export_genai`` and ``standard_folder`` refuse an uneven cut, naming the layers. No file is ever
written at full size with zeros.

Every file is read back and compared with the torch model before it is returned: the GGUF through ``gguf``'s reader
(each tensor, the head counts) and through transformers (``AutoModelForCausalLM.from_pretrained(folder,
gguf_file=...)``: logits within the file's rounding, greedy tokens equal); the GenAI model through
``onnxruntime_genai`` (the prompt's logits within fp32 rounding, greedy tokens equal). A file that differs is deleted
and a ValueError says by how much.
"""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from multihead.extras import require
from multihead.hf.attention import PreTrainedModel

__all__ = ["Served", "export_genai", "export_gguf", "gguf_model", "layer_counts", "standard_folder"]

#: the model classes these exports write (llama.cpp's ``llama`` architecture; GenAI's ``LlamaForCausalLM``)
ARCHITECTURES = ("LlamaForCausalLM",)
#: the largest |logit difference| accepted, relative to the largest |logit| of the torch model: fp32 files hold
#: the weights exactly (the difference is summation order); fp16 rounds each weight to 11 bits
TOLERANCE = {"f32": 1e-4, "f16": 2e-2, "fp32": 1e-4}
GGUF_DTYPES = ("f32", "f16", "q8_0")
#: GGUF types quantized in blocks (gguf's own quantizer): the file's logits move by the quantization, so
#: export_gguf reports their difference and the greedy tokens that agree instead of holding them to a tolerance; a
#: caller judges the file by its perplexity beside the unpruned model's at the same type (``multihead prune`` does)
QUANTIZED = {"q8_0": "Q8_0", "int4": "int4"}
GENAI_PRECISIONS = ("fp32", "int4")


@dataclass
class Served:
    """A runtime's file, checked: ``max_logit_diff`` = max |logits - torch logits| over the prompt's positions
    (GenAI: its last position, the logits its generator gives), ``tolerance`` the bound it was held to, ``tokens`` the
    greedy tokens the runtime produced (equal to the torch model's), ``counts`` (H, Hkv, D) written: a list of them,
    one per layer, for an uneven cut's GGUF file (then no runtime ran it: ``max_logit_diff`` and ``tolerance`` are
    NaN, ``tokens`` empty, and ``checks`` says where it loads)."""

    path: Path
    runtime: str
    max_logit_diff: float
    tolerance: float
    tokens: list[int]
    counts: tuple[int, int, int] | list[tuple[int, int, int]]
    checks: list[str] = field(default_factory=list)


# --- the model, read from its weights ---


def _layers(model: nn.Module) -> list[nn.Module]:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no model.layers: give a LlamaForCausalLM.")
    return list(layers)


def layer_counts(model: nn.Module) -> list[tuple[int, int, int]]:
    """(H, Hkv, D) of every decoder layer, read from its projections: q_proj holds H*D rows (head-major, as
    LlamaAttention reshapes them), k_proj and v_proj Hkv*D, o_proj H*D columns. Raises ValueError for a layer whose
    projections disagree."""
    out = []
    for i, layer in enumerate(_layers(model)):
        a = layer.self_attn
        D = int(a.head_dim)
        q, k, v, o = a.q_proj.weight.shape[0], a.k_proj.weight.shape[0], a.v_proj.weight.shape[0], a.o_proj.weight.shape[1]
        if q % D or k % D or k != v or o != q or (k and (q // D) % (k // D)):
            raise ValueError(f"layer {i}: q/k/v/o projections of {q}/{k}/{v}/{o} features do not make whole heads of "
                             f"head_dim={D} with key/value groups of equal size.")
        out.append((q // D, k // D, D))
    return out


def _check_layers(model: nn.Module, what: str) -> list[tuple[int, int, int]]:
    """Everything a decoder export refuses but an uneven cut, before any work: returns the (H, Hkv, D) of every
    layer."""
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"{what} takes a transformers model; got {type(model).__name__}.")
    cfg = model.config
    archs = getattr(cfg, "architectures", None) or [type(model).__name__]
    if type(model).__name__ not in ARCHITECTURES:
        raise ValueError(f"{what} writes {', '.join(ARCHITECTURES)} (llama.cpp's llama graph, GenAI's Llama builder); "
                         f"got {type(model).__name__} ({archs[0]}): save it as a transformers folder with "
                         "multihead.hf.save instead.")
    for name, m in model.named_modules():
        hooks = getattr(m, "attention_hooks", None)
        if hooks is not None and hooks.transforms:
            raise ValueError(f"{what}: {name} has hooks that change its heads (heads.gated or a transform): the file "
                             "would compute the model without them; cut the heads with heads.prune first.")
    counts = layer_counts(model)
    if all(H == 0 for H, _, _ in counts):
        raise ValueError(f"{what}: every layer has every head cut (H=0): a model with no attention head is not a "
                         "Llama.")
    for i, layer in enumerate(_layers(model)):
        a, mlp = layer.self_attn, layer.mlp
        with_bias = [n for n in ("q_proj", "k_proj", "v_proj", "o_proj") if getattr(a, n).bias is not None]
        with_bias += [n for n in ("gate_proj", "up_proj", "down_proj") if getattr(mlp, n).bias is not None]
        if with_bias:
            raise ValueError(f"{what}: layer {i}'s {with_bias} have biases (a mean-compensated prune, or a model with "
                             "attention biases); this export writes bias-free Llama projections only: prune without "
                             "mean_outputs.")
        if mlp.gate_proj.weight.shape[0] != _layers(model)[0].mlp.gate_proj.weight.shape[0]:
            raise ValueError(f"{what}: the feed-forward widths differ between layers (layer {i}); a Llama holds one "
                             "intermediate_size.")
        if counts[i][2] != counts[0][2]:
            raise ValueError(f"{what}: the head size differs between layers (layer {i}: {counts[i][2]}, layer 0: "
                             f"{counts[0][2]}); a Llama holds one head_dim.")
    rope = dict(getattr(cfg, "rope_parameters", None) or {})
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"{what}: RoPE of type {rope.get('rope_type')!r}; this export writes the default RoPE only.")
    return counts


def _uneven(counts: list[tuple[int, int, int]]) -> str:
    """The layers of each (H, Hkv), as a refusal names them: "layers [0] H=2, Hkv=1; layers [1] H=4, Hkv=2"."""
    by: dict[tuple[int, int, int], list[int]] = {}
    for i, c in enumerate(counts):
        by.setdefault(c, []).append(i)
    return "; ".join(f"layers {ls} H={c[0]}, Hkv={c[1]}" for c, ls in by.items())


def _check(model: nn.Module, what: str) -> tuple[int, int, int]:
    """:func:`_check_layers`, and a cut that differs between layers refused: returns the (H, Hkv, D) of every layer."""
    counts = _check_layers(model, what)
    if len(set(counts)) > 1:
        raise ValueError(f"{what}: the cut differs between layers ({_uneven(counts)}); this format holds one head "
                         "count for every layer (GenAI's builder, a standard transformers config): cut the same heads "
                         "in every layer, write it with export_gguf (llama.cpp's deci architecture reads per-layer "
                         "counts), or keep it as a transformers folder (multihead.hf.save).")
    return counts[0]


def _standard_config(model: nn.Module, counts: tuple[int, int, int]):
    """The model's config at its pruned size: the standard keys, multihead's own records dropped."""
    H, Hkv, D = counts
    cfg = copy.deepcopy(model.config)
    for key in [k for k in vars(cfg) if k.startswith("multihead_")]:
        delattr(cfg, key)
    cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim = H, Hkv, D
    cfg.intermediate_size = int(_layers(model)[0].mlp.gate_proj.weight.shape[0])
    cfg.architectures = [type(model).__name__]
    return cfg


def standard_folder(model: nn.Module, folder: str | Path, *, tokenizer=None) -> Path:
    """``model`` as a plain transformers folder at its pruned size (config.json with the standard head counts,
    model.safetensors, and ``tokenizer``'s files when given): a fresh model of the class is built from that config
    and loads the weights strictly (every shape must fit), so ``AutoModelForCausalLM.from_pretrained(folder)`` and
    every runtime's converter read it. Refuses (ValueError) a cut that differs between layers."""
    counts = _check(model, "standard_folder")
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"standard_folder writes a directory; {folder} is a file.")
    cfg = _standard_config(model, counts)
    cfg._attn_implementation = "eager"
    fresh = type(model)(cfg)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    fresh.load_state_dict(state, strict=True)
    fresh.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return folder


# --- the checks against the torch model ---


def _prompt(model: nn.Module, prompt_ids, new_tokens: int, what: str) -> Tensor:
    cfg = model.config
    if prompt_ids is None:
        g = torch.Generator().manual_seed(0)
        return torch.randint(0, int(cfg.vocab_size), (1, 16), generator=g)  # (1, L)
    ids = torch.as_tensor(prompt_ids)
    if ids.dtype not in (torch.int32, torch.int64) or ids.ndim not in (1, 2) or ids.shape[-1] == 0:
        raise ValueError(f"{what}: prompt_ids must be token ids, shape (L,) or (1, L); got {tuple(ids.shape)} "
                         f"{ids.dtype}.")
    ids = ids.reshape(1, -1).long()  # (1, L)
    if int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab_size:
        raise ValueError(f"{what}: prompt_ids hold ids outside the vocabulary 0..{cfg.vocab_size - 1}.")
    limit = getattr(cfg, "max_position_embeddings", None)
    if limit is not None and ids.shape[1] + new_tokens > limit:
        raise ValueError(f"{what}: a prompt of {ids.shape[1]} tokens plus {new_tokens} new ones is longer than the "
                         f"model's {limit} positions; give a shorter prompt.")
    return ids


@torch.no_grad()
def _greedy(model: nn.Module, ids: Tensor, n: int) -> tuple[Tensor, list[int]]:
    """(the prompt's logits (1, L, V) in float32, the next n greedy tokens): every step runs the whole sequence, no
    cache, no end-of-text stop, so the reference depends on nothing but the weights."""
    logits = model(input_ids=ids).logits.float()  # (1, L, V)
    seq, out = ids, []
    last = logits[:, -1]  # (1, V)
    for _ in range(n):
        t = int(last.argmax(-1))
        out.append(t)
        seq = torch.cat([seq, seq.new_tensor([[t]])], dim=1)  # (1, L + step)
        last = model(input_ids=seq).logits[:, -1].float()  # (1, V)
    return logits, out


def _compare(what: str, path: Path, diff: float, tol: float, got: list[int], want: list[int]) -> None:
    if diff > tol or got != want:
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
        raise ValueError(f"{what}: the file differs from the torch model (max |logit difference| {diff:.3g}, "
                         f"tolerance {tol:.3g}; greedy tokens {got} vs {want}); it was deleted.")


# --- GGUF ---


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf ``LlamaModel.permute``: within each head, the rotary halves (HF's
    rotate_half layout) interleaved as pairs (GGML's rope): rows (n_head, 2, D/2) -> (n_head, D/2, 2)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def export_gguf(model: nn.Module, path: str | Path, *, dtype: str = "f32", vocab: str | Path | None = None,
                tokenizer=None, prompt_ids=None, new_tokens: int = 8) -> Served:
    """Write ``model`` (a LlamaForCausalLM, pruned or not) as a GGUF file of llama.cpp's ``llama`` architecture, as
    llama.cpp's ``convert_hf_to_gguf.py`` writes a Llama: its tensor names (``token_embd``, ``blk.N.attn_q`` ...,
    ``output``, left out when tied), q/k rows permuted to GGML's rotary layout, the head counts, head size
    (``rope.dimension_count``, ``attention.key_length``/``value_length``: a pruned model's H*D differs from its
    width), 1-D tensors in f32 and the matrices in ``dtype`` ("f32" or "f16").

    A cut that differs between layers (an uneven cut) is written in llama.cpp's ``deci`` architecture instead, as
    convert_hf_to_gguf.py writes a DeciLM / Llama-3.1-Nemotron-NAS model: a Llama body whose
    ``deci.attention.head_count`` and ``head_count_kv`` are arrays, one count per layer, each layer's q/k/v/o tensors
    at its own size; a layer with every head cut is written as deci's attention-free layer (counts 0, no attention
    tensors: the layer adds nothing before its MLP, as the pruned model computes). llama.cpp loads that file
    (llama-cpp-python 0.3.36, checked by ``bench/gguf_uneven.py``); transformers' GGUF reader does not (it reads one
    head count per model), so the file is checked by ``gguf``'s reader only and a UserWarning says so in one line.
    Refused: an uneven cut whose layer 0 has every head cut (llama.cpp takes the head size from layer 0's count).

    ``vocab``: a GGUF file (the one the model came from) whose ``tokenizer.*`` fields are copied unchanged, so
    llama.cpp tokenizes as before; or the model's own transformers ``tokenizer`` (a byte-level BPE, as SmolLM2's,
    Llama 3's and Qwen's are), written as convert_hf_to_gguf.py writes a ``gpt2`` vocabulary (tokens, types,
    merges, special ids; no ``tokenizer.ggml.pre``: llama.cpp then splits words by its default expression); neither
    writes none (transformers and gguf read the file; llama.cpp needs one). ``dtype`` "q8_0": the matrices in
    blocks of 32 at 8 bits (gguf's quantizer), the file's greedy tokens and logit difference reported
    (:data:`QUANTIZED`).

    Checked before it is returned (else deleted, ValueError): read back with ``gguf.GGUFReader`` (every tensor equal
    to the weights as written, the counts), then (one count for every layer) loaded by
    ``AutoModelForCausalLM.from_pretrained(folder, gguf_file=...)`` and run on ``prompt_ids`` (default: 16 fixed
    random ids): logits within the dtype's rounding (:data:`TOLERANCE`) and ``new_tokens`` greedy tokens equal to the
    torch model's. An uneven file's :class:`Served` has ``counts`` per layer, ``max_logit_diff`` and ``tolerance``
    NaN and no ``tokens``: no runtime was run."""
    counts, path = _gguf_args(model, path, dtype, vocab, new_tokens)
    uneven = len(set(counts)) > 1
    ids = _prompt(model, prompt_ids, new_tokens, "export_gguf")
    gguf = require("gguf", "multihead.deploy.gguf.export_gguf")
    if vocab is not None and tokenizer is not None:
        raise ValueError("export_gguf: give vocab= (a GGUF file's vocabulary) or tokenizer= (the model's own), not "
                         "both.")
    vocab_fields = (_vocab_fields(gguf, vocab) if vocab is not None else
                    tokenizer_fields(gguf, tokenizer, int(model.config.vocab_size)) if tokenizer is not None else [])

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".part")
    written = _write_gguf(gguf, model, tmp, counts, dtype, vocab_fields)
    os.replace(tmp, path)

    checks = _read_back(gguf, path, written, counts)
    if uneven:
        where = (f"export_gguf: {path.name} is llama.cpp's deci architecture (per-layer head counts: "
                 f"{_uneven(counts)}): it loads in llama.cpp (llama_cpp.Llama), not in transformers' GGUF reader "
                 "(one head count per model), so no runtime checked it here.")
        warnings.warn(where, UserWarning, stacklevel=2)
        return Served(path, "gguf", float("nan"), float("nan"), [], counts, [*checks, where])
    return _run_back(model, path, dtype, ids, new_tokens, checks)


def gguf_model(path: str | Path) -> nn.Module:
    """A GGUF file as transformers reads it (``AutoModelForCausalLM.from_pretrained(folder, gguf_file=...)``, the
    weights dequantized to float32), in eval mode."""
    transformers = require("transformers", "multihead.deploy.gguf.gguf_model")
    path = Path(path)
    with tempfile.TemporaryDirectory() as d:  # transformers reads the file from a folder: link it there
        os.symlink(path.resolve(), Path(d) / path.name)
        return transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=path.name, dtype=torch.float32).eval()


def _run_back(model: nn.Module, path: Path, dtype: str, ids: Tensor, new_tokens: int, checks: list[str]) -> Served:
    """The GGUF file read by transformers (dequantized) and run on ``ids``: logits within the dtype's rounding and
    greedy tokens equal to ``model``'s (a quantized type: the difference and the tokens that agree, reported)."""
    with torch.no_grad():
        ref_logits, ref_tokens = _greedy(model, ids, new_tokens)
        got_logits, got_tokens = _greedy(gguf_model(path), ids, new_tokens)
    counts = layer_counts(model)
    diff = float((got_logits - ref_logits).abs().max())
    if dtype in QUANTIZED:
        same = sum(a == b for a, b in zip(got_tokens, ref_tokens))
        checks.append(f"transformers gguf_file= (dequantized): logits max |diff| {diff:.3g} ({dtype}: judged by "
                      f"perplexity, not a tolerance), {same} of {new_tokens} greedy tokens equal")
        return Served(path, "gguf", diff, float("inf"), got_tokens, counts[0], checks)
    tol = TOLERANCE[dtype] * max(1.0, float(ref_logits.abs().max()))
    _compare("export_gguf", path, diff, tol, got_tokens, ref_tokens)
    checks.append(f"transformers gguf_file=: logits max |diff| {diff:.3g} (tolerance {tol:.3g}), {new_tokens} greedy "
                  "tokens equal")
    return Served(path, "gguf", diff, tol, got_tokens, counts[0], checks)


def _gguf_args(model: nn.Module, path: str | Path, dtype: str, vocab, new_tokens) -> tuple[list, Path]:
    """export_gguf's refusals, before any work: returns the (H, Hkv, D) of every layer and the path."""
    counts = _check_layers(model, "export_gguf")
    if len(set(counts)) > 1 and counts[0][0] == 0:
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


def _gguf_header(gguf, model: nn.Module, tmp: Path, counts: list[tuple[int, int, int]], dtype: str):
    """A GGUFWriter on ``tmp`` holding the model's fields: llama's, or deci's with per-layer head-count arrays."""
    cfg = model.config
    layers = _layers(model)
    uneven = len(set(counts)) > 1
    D = counts[0][2]
    w = gguf.GGUFWriter(str(tmp), "deci" if uneven else "llama")
    w.add_name(str(getattr(cfg, "_name_or_path", "") or "multihead").rstrip("/").split("/")[-1] or "multihead")
    w.add_vocab_size(int(cfg.vocab_size))
    w.add_context_length(int(cfg.max_position_embeddings))
    w.add_embedding_length(int(cfg.hidden_size))
    w.add_block_count(len(layers))
    w.add_feed_forward_length(int(layers[0].mlp.gate_proj.weight.shape[0]))
    w.add_rope_dimension_count(D)
    w.add_head_count([c[0] for c in counts] if uneven else counts[0][0])
    w.add_head_count_kv([c[1] for c in counts] if uneven else counts[0][1])
    w.add_key_length(D)
    w.add_value_length(D)
    w.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    w.add_rope_freq_base(float((getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0)))
    w.add_file_type({"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                     "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[dtype])
    return w


#: the tensors of a layer's attention block, which a layer with every head cut does not have in deci's layout
_ATTENTION_TENSORS = ("input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
                      "self_attn.v_proj.weight", "self_attn.o_proj.weight")


def _write_gguf(gguf, model: nn.Module, tmp: Path, counts: list[tuple[int, int, int]], dtype: str,
                vocab_fields: list[tuple]) -> dict[str, np.ndarray]:
    """Write the GGUF file ``tmp`` as convert_hf_to_gguf.py writes a Llama (a DeciLM when the counts differ between
    layers); returns {tensor name: array written}."""
    cfg = model.config
    layers = _layers(model)
    arch = gguf.MODEL_ARCH.DECI if len(set(counts)) > 1 else gguf.MODEL_ARCH.LLAMA
    names = gguf.get_tensor_name_map(arch, len(layers))
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    state = model.state_dict()
    cut = {f"model.layers.{i}.{t}" for i, c in enumerate(counts) if c[0] == 0 for t in _ATTENTION_TENSORS}
    tensors = [(names.get_name(n, try_suffixes=(".weight", ".bias")), n, t) for n, t in state.items()
               if not (tied and n == "lm_head.weight") and n not in cut]  # tied: llama.cpp reads token_embd twice
    unnamed = [n for name, n, _ in tensors if name is None]
    if unnamed:
        raise ValueError(f"export_gguf: {unnamed[:3]} have no name in llama.cpp's Llama layout.")
    w = _gguf_header(gguf, model, tmp, counts, dtype)
    for key, val, vtype, sub in vocab_fields:
        w.add_key_value(key, val, vtype, sub_type=sub)
    written = {}
    for name, hf_name, t in tensors:
        data = t.detach().float().cpu().numpy()
        if hf_name.endswith(("q_proj.weight", "k_proj.weight")):
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
    """(key, value, type, sub_type) of a ``gpt2`` GGUF vocabulary from a transformers byte-level BPE tokenizer:
    every token by id, its type (control: the special tokens; user-defined: other added ones), the merges, and the
    special tokens' ids; a model whose embedding has more rows than the tokenizer has tokens gets ``[PAD<i>]``
    tokens marked unused up to ``vocab_size``, as convert_hf_to_gguf.py pads. ValueError for a tokenizer of another
    kind (naming it), or with more tokens than the model's vocabulary."""
    import json

    backend = getattr(tokenizer, "backend_tokenizer", None)
    model = json.loads(backend.to_str())["model"] if backend is not None else {}
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        raise ValueError(f"export_gguf: tokenizer= is a {model.get('type', type(tokenizer).__name__)} tokenizer"
                         f"{' with byte fallback (SentencePiece-style)' if model.get('byte_fallback') else ''}; "
                         "this writes byte-level BPE vocabularies (gpt2) only: give vocab= the GGUF file the model "
                         "came from instead.")
    T = gguf.GGUFValueType
    n = len(tokenizer)
    if n > vocab_size:
        raise ValueError(f"export_gguf: the tokenizer has {n} tokens, the model's vocabulary {vocab_size} rows: give "
                         "the model's own tokenizer.")
    added = {t.content: t.special for t in tokenizer.added_tokens_decoder.values()}
    tokens = tokenizer.convert_ids_to_tokens(list(range(n)))
    types = [int(gguf.TokenType.CONTROL if added.get(t) else gguf.TokenType.USER_DEFINED if t in added
                 else gguf.TokenType.NORMAL) for t in tokens]
    tokens += [f"[PAD{i}]" for i in range(n, vocab_size)]  # the embedding's rows past the tokenizer's tokens
    types += [int(gguf.TokenType.UNUSED)] * (vocab_size - n)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    out = [("tokenizer.ggml.model", "gpt2", T.STRING, None), ("tokenizer.ggml.tokens", tokens, T.ARRAY, T.STRING),
           ("tokenizer.ggml.token_type", types, T.ARRAY, T.INT32), ("tokenizer.ggml.merges", merges, T.ARRAY, T.STRING)]
    for key, tid in (("bos", tokenizer.bos_token_id), ("eos", tokenizer.eos_token_id),
                     ("unknown", tokenizer.unk_token_id), ("padding", tokenizer.pad_token_id)):
        if tid is not None:
            out.append((f"tokenizer.ggml.{key}_token_id", int(tid), T.UINT32, None))
    return out


def _read_back(gguf, path: Path, written: dict, counts: list[tuple[int, int, int]]) -> list[str]:
    uneven = len(set(counts)) > 1
    arch = "deci" if uneven else "llama"
    H, Hkv = ([c[0] for c in counts], [c[1] for c in counts]) if uneven else counts[0][:2]
    D = counts[0][2]
    reader = gguf.GGUFReader(str(path))

    def field(key):
        f = reader.fields.get(key)
        return None if f is None else f.contents()

    meta = {"general.architecture": arch, f"{arch}.attention.head_count": H, f"{arch}.attention.head_count_kv": Hkv,
            f"{arch}.rope.dimension_count": D, f"{arch}.attention.key_length": D, f"{arch}.block_count": len(counts)}
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
    return [f"gguf reader: {len(written)} tensors equal to the weights written; architecture {arch}, head_count {H}, "
            f"head_count_kv {Hkv}, head size {D}"]


# --- ONNX Runtime GenAI ---


def export_genai(model: nn.Module, folder: str | Path, *, tokenizer, precision: str = "fp32", prompt_ids=None,
                 new_tokens: int = 8) -> Served:
    """Write ``model`` (a LlamaForCausalLM, pruned or not) as ONNX Runtime GenAI's model folder (model.onnx with
    GroupQueryAttention, genai_config.json, the tokenizer) with GenAI's own builder
    (``python -m onnxruntime_genai.models.builder``, CPU) run on :func:`standard_folder`'s plain transformers folder
    at the pruned size. ``tokenizer``: the model's transformers tokenizer (the builder copies it). ``precision``:
    "fp32" (the one a comparison can hold to the weights' rounding) or "int4" (the builder's MatMulNBits int4, what
    GenAI's CPU users run: its greedy tokens and last logits' difference are reported, :data:`QUANTIZED`).

    Checked before it is returned (else deleted, ValueError): ``onnxruntime_genai`` runs ``prompt_ids`` (default:
    16 fixed random ids) with greedy search: the prompt's last logits within fp32 rounding and ``new_tokens`` greedy
    tokens equal to the torch model's (fewer when GenAI stops at the end-of-text token, the torch model's token
    there being the same)."""
    counts = _check(model, "export_genai")
    if precision not in GENAI_PRECISIONS:
        raise ValueError(f"export_genai: precision={precision!r}; use one of {GENAI_PRECISIONS}.")
    if tokenizer is None or not hasattr(tokenizer, "save_pretrained"):
        raise TypeError(f"export_genai: tokenizer must be the model's transformers tokenizer (GenAI's builder reads "
                        f"it); got {type(tokenizer).__name__}.")
    folder = Path(folder)
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise ValueError(f"export_genai writes a new folder; {folder} exists and is not an empty directory.")
    if not isinstance(new_tokens, int) or isinstance(new_tokens, bool) or new_tokens < 1:
        raise ValueError(f"export_genai: new_tokens must be a whole number >= 1; got {new_tokens!r}.")
    ids = _prompt(model, prompt_ids, new_tokens, "export_genai")
    og = require("onnxruntime_genai", "multihead.deploy.gguf.export_genai")

    with tempfile.TemporaryDirectory() as d:
        src = standard_folder(model, Path(d) / "hf", tokenizer=tokenizer)
        cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(src), "-o", str(folder),
               "-p", precision, "-e", "cpu", "-c", str(Path(d) / "cache")]
        run = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if run.returncode != 0:
        shutil.rmtree(folder, ignore_errors=True)
        tail = (run.stderr or run.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"export_genai: GenAI's builder failed ({' '.join(cmd[1:4])}): {' | '.join(tail)}")

    ref_logits, ref_tokens = _greedy(model, ids, new_tokens)
    got_last, got_tokens = _genai_greedy(og, folder, ids, new_tokens)
    diff = float(np.abs(got_last - ref_logits[0, -1].numpy()).max())
    if precision in QUANTIZED:
        same = sum(a == b for a, b in zip(got_tokens, ref_tokens))
        return Served(folder, "onnxruntime-genai", diff, float("inf"), got_tokens, counts,
                      [f"onnxruntime_genai greedy ({precision}): last logits max |diff| {diff:.3g} (quantized: not held "
                       f"to a tolerance), {same} of {len(got_tokens)} greedy tokens equal"])
    tol = TOLERANCE[precision] * max(1.0, float(ref_logits.abs().max()))
    _compare("export_genai", folder, diff, tol, got_tokens, ref_tokens[: len(got_tokens)])
    return Served(folder, "onnxruntime-genai", diff, tol, got_tokens, counts,
                  [f"onnxruntime_genai greedy: last logits max |diff| {diff:.3g} (tolerance {tol:.3g}), "
                   f"{len(got_tokens)} greedy tokens equal"])


def _genai_greedy(og, folder: Path, ids: Tensor, n: int) -> tuple[np.ndarray, list[int]]:
    """(GenAI's logits after the prompt (V,), its greedy tokens, at most n)."""
    m = og.Model(str(folder))
    params = og.GeneratorParams(m)
    params.set_search_options(max_length=ids.shape[1] + n, do_sample=False)
    gen = og.Generator(m, params)
    gen.append_tokens(ids.numpy().astype(np.int32))
    last = np.asarray(gen.get_output("logits"), dtype=np.float32)[0, -1]  # (V,)
    tokens = []
    while not gen.is_done() and len(tokens) < n:
        gen.generate_next_token()
        tokens.append(int(gen.get_next_tokens()[0]))
    return last, tokens
