"""A (pruned) decoder language model served where decoders run, at its pruned size: a GGUF file (llama.cpp's layout,
written with the ``gguf`` package) and ONNX Runtime GenAI's model (its own builder). The ``decoder`` extra.

    from multihead.hf import decoder_export
    decoder_export.export_gguf(model, "model.gguf", vocab="source.gguf")  # read back by gguf and by transformers
    decoder_export.export_genai(model, "genai", tokenizer=tokenizer)     # ONNX Runtime GenAI's builder, then generate

Both take a ``LlamaForCausalLM`` (SmolLM2 and Llama 2/3 checkpoints are this class) whose layers hold the same head
counts: each layer's query heads H, key/value heads Hkv and head size D are read from its projections (not from the
config, which a prune leaves at the original counts), and written as the standard configuration
(``num_attention_heads=H``, ``num_key_value_heads=Hkv``, ``head_dim=D``) every runtime loads. A cut that differs
between layers is refused, naming the layers: llama.cpp's ``llama`` graph and ONNX Runtime GenAI's builder read one
count for every layer (llama.cpp reads per-layer counts only in its DeciLM graph, which transformers cannot load to
check the file), and neither file is ever written at full size with zeros.

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
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from multihead.extras import require
from multihead.hf.attention import PreTrainedModel

__all__ = ["Served", "export_genai", "export_gguf", "layer_counts", "standard_folder"]

#: the model classes these exports write (llama.cpp's ``llama`` architecture; GenAI's ``LlamaForCausalLM``)
ARCHITECTURES = ("LlamaForCausalLM",)
#: the largest |logit difference| accepted, relative to the largest |logit| of the torch model: fp32 files hold
#: the weights exactly (the difference is summation order); fp16 rounds each weight to 11 bits
TOLERANCE = {"f32": 1e-4, "f16": 2e-2, "fp32": 1e-4}
GGUF_DTYPES = ("f32", "f16")
GENAI_PRECISIONS = ("fp32",)


@dataclass
class Served:
    """A runtime's file, checked: ``max_logit_diff`` = max |logits - torch logits| over the prompt's positions
    (GenAI: its last position, the logits its generator gives), ``tolerance`` the bound it was held to, ``tokens`` the
    greedy tokens the runtime produced (equal to the torch model's), ``counts`` (H, Hkv, D) written."""

    path: Path
    runtime: str
    max_logit_diff: float
    tolerance: float
    tokens: list[int]
    counts: tuple[int, int, int]
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


def _check(model: nn.Module, what: str) -> tuple[int, int, int]:
    """Everything a decoder export refuses, before any work: returns the (H, Hkv, D) of every layer."""
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
    if len(set(counts)) > 1:
        by = {}
        for i, c in enumerate(counts):
            by.setdefault(c, []).append(i)
        seen = "; ".join(f"layers {ls} H={c[0]}, Hkv={c[1]}" for c, ls in by.items())
        raise ValueError(f"{what}: the cut differs between layers ({seen}); the runtime's format holds one head count "
                         "for every layer (llama.cpp's llama graph, GenAI's builder): cut the same heads in every "
                         "layer, or keep this model as a transformers folder (multihead.hf.save).")
    H, Hkv, D = counts[0]
    if H == 0 or Hkv == 0:
        raise ValueError(f"{what}: every layer has H={H}, Hkv={Hkv}: a model with no attention head is not a Llama.")
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
    rope = dict(getattr(cfg, "rope_parameters", None) or {})
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"{what}: RoPE of type {rope.get('rope_type')!r}; this export writes the default RoPE only.")
    return H, Hkv, D


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
                prompt_ids=None, new_tokens: int = 8) -> Served:
    """Write ``model`` (a LlamaForCausalLM, pruned or not) as a GGUF file of llama.cpp's ``llama`` architecture, as
    llama.cpp's ``convert_hf_to_gguf.py`` writes a Llama: its tensor names (``token_embd``, ``blk.N.attn_q`` ...,
    ``output``, left out when tied), q/k rows permuted to GGML's rotary layout, the head counts, head size
    (``rope.dimension_count``, ``attention.key_length``/``value_length``: a pruned model's H*D differs from its
    width), 1-D tensors in f32 and the matrices in ``dtype`` ("f32" or "f16").

    ``vocab``: a GGUF file (the one the model came from) whose ``tokenizer.*`` fields are copied unchanged, so
    llama.cpp tokenizes as before; None writes none (transformers and gguf read the file; llama.cpp needs one).

    Checked before it is returned (else deleted, ValueError): read back with ``gguf.GGUFReader`` (every tensor equal
    to the weights as written, the counts), then loaded by ``AutoModelForCausalLM.from_pretrained(folder,
    gguf_file=...)`` and run on ``prompt_ids`` (default: 16 fixed random ids): logits within the dtype's rounding
    (:data:`TOLERANCE`) and ``new_tokens`` greedy tokens equal to the torch model's."""
    counts = _check(model, "export_gguf")
    if dtype not in GGUF_DTYPES:
        raise ValueError(f"export_gguf: dtype={dtype!r}; use one of {GGUF_DTYPES}.")
    path = Path(path)
    if path.suffix != ".gguf" or path.is_dir():
        raise ValueError(f"export_gguf writes a file named *.gguf; got {path}.")
    if vocab is not None and not Path(vocab).is_file():
        raise ValueError(f"export_gguf: vocab={vocab} is not a file; give the GGUF file the model came from, or None.")
    if not isinstance(new_tokens, int) or isinstance(new_tokens, bool) or new_tokens < 1:
        raise ValueError(f"export_gguf: new_tokens must be a whole number >= 1; got {new_tokens!r}.")
    ids = _prompt(model, prompt_ids, new_tokens, "export_gguf")
    gguf = require("gguf", "multihead.hf.decoder_export.export_gguf")
    transformers = require("transformers", "multihead.hf.decoder_export.export_gguf")
    vocab_fields = _vocab_fields(gguf, vocab) if vocab is not None else []

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".part")
    written = _write_gguf(gguf, model, tmp, counts, dtype, vocab_fields)
    os.replace(tmp, path)

    checks = _read_back(gguf, path, written, counts, len(_layers(model)))
    with torch.no_grad():
        ref_logits, ref_tokens = _greedy(model, ids, new_tokens)
        with tempfile.TemporaryDirectory() as d:  # transformers reads the file from a folder: link it there
            os.symlink(path.resolve(), Path(d) / path.name)
            back = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=path.name, dtype=torch.float32)
        back.eval()
        got_logits, got_tokens = _greedy(back, ids, new_tokens)
    diff = float((got_logits - ref_logits).abs().max())
    tol = TOLERANCE[dtype] * max(1.0, float(ref_logits.abs().max()))
    _compare("export_gguf", path, diff, tol, got_tokens, ref_tokens)
    checks.append(f"transformers gguf_file=: logits max |diff| {diff:.3g} (tolerance {tol:.3g}), {new_tokens} greedy "
                  "tokens equal")
    return Served(path, "gguf", diff, tol, got_tokens, counts, checks)


def _write_gguf(gguf, model: nn.Module, tmp: Path, counts: tuple[int, int, int], dtype: str,
                vocab_fields: list[tuple]) -> dict[str, np.ndarray]:
    """Write the GGUF file ``tmp`` as convert_hf_to_gguf.py writes a Llama; returns {tensor name: array written}."""
    H, Hkv, D = counts
    cfg = model.config
    layers = _layers(model)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, len(layers))
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    tensors = [(names.get_name(n, try_suffixes=(".weight", ".bias")), n, t) for n, t in model.state_dict().items()
               if not (tied and n == "lm_head.weight")]  # tied: llama.cpp reads token_embd for the output too
    unnamed = [n for name, n, _ in tensors if name is None]
    if unnamed:
        raise ValueError(f"export_gguf: {unnamed[:3]} have no name in llama.cpp's Llama layout.")
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_name(str(getattr(cfg, "_name_or_path", "") or "multihead").rstrip("/").split("/")[-1] or "multihead")
    w.add_vocab_size(int(cfg.vocab_size))
    w.add_context_length(int(cfg.max_position_embeddings))
    w.add_embedding_length(int(cfg.hidden_size))
    w.add_block_count(len(layers))
    w.add_feed_forward_length(int(layers[0].mlp.gate_proj.weight.shape[0]))
    w.add_rope_dimension_count(D)
    w.add_head_count(H)
    w.add_head_count_kv(Hkv)
    w.add_key_length(D)
    w.add_value_length(D)
    w.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    w.add_rope_freq_base(float((getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0)))
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if dtype == "f32" else gguf.LlamaFileType.MOSTLY_F16)
    for key, val, vtype, sub in vocab_fields:
        w.add_key_value(key, val, vtype, sub_type=sub)
    written = {}
    for name, hf_name, t in tensors:
        data = t.detach().float().cpu().numpy()
        if hf_name.endswith("q_proj.weight"):
            data = _permute(data, H)  # (H*D, E), each head's rows in GGML's rotary order
        elif hf_name.endswith("k_proj.weight"):
            data = _permute(data, Hkv)  # (Hkv*D, E)
        if dtype == "f16" and data.ndim > 1:
            data = data.astype(np.float16)
        written[name] = np.ascontiguousarray(data)
        w.add_tensor(name, written[name])
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


def _read_back(gguf, path: Path, written: dict, counts: tuple[int, int, int], n_layers: int) -> list[str]:
    H, Hkv, D = counts
    reader = gguf.GGUFReader(str(path))

    def field(key):
        f = reader.fields.get(key)
        return None if f is None else f.contents()

    meta = {"general.architecture": "llama", "llama.attention.head_count": H, "llama.attention.head_count_kv": Hkv,
            "llama.rope.dimension_count": D, "llama.attention.key_length": D, "llama.block_count": n_layers}
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
    return [f"gguf reader: {len(written)} tensors equal to the weights written; head_count {H}, head_count_kv {Hkv}, "
            f"head size {D}"]


# --- ONNX Runtime GenAI ---


def export_genai(model: nn.Module, folder: str | Path, *, tokenizer, precision: str = "fp32", prompt_ids=None,
                 new_tokens: int = 8) -> Served:
    """Write ``model`` (a LlamaForCausalLM, pruned or not) as ONNX Runtime GenAI's model folder (model.onnx with
    GroupQueryAttention, genai_config.json, the tokenizer) with GenAI's own builder
    (``python -m onnxruntime_genai.models.builder``, CPU) run on :func:`standard_folder`'s plain transformers folder
    at the pruned size. ``tokenizer``: the model's transformers tokenizer (the builder copies it). ``precision``:
    "fp32" (the one a comparison can hold to the weights' rounding).

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
    og = require("onnxruntime_genai", "multihead.hf.decoder_export.export_genai")

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
