"""Your own model: Hugging Face transformers models on multihead (the ``hf`` extra).

    import multihead.hf                                   # registers "multihead" with transformers
    model = multihead.hf.attach(AutoModel.from_pretrained(path))   # or attn_implementation="multihead"
    with multihead.capture(model) as cap: model(**batch)  # (B, H, Lq, Lk) per attention module
    heads.prune(model, {"encoder.layer.0.attention.self": [0, 3]})
    multihead.hf.save(model, "pruned");  multihead.hf.load("pruned")
    encoder = multihead.hf.serve(multihead.hf.load("pruned"))  # a BERT-family encoder, lean for prediction

Importing this module registers ``"multihead"`` with transformers (see :mod:`multihead.hf.attention`:
every attention call then goes through :func:`multihead.attention` with the module's hook list
around it, so ``capture``, ``heads.gated``, ``heads.importance`` work on the model unchanged).
:func:`attach` gives each attention module its hook list and its
head layout (which weights hold head h), which ``heads.prune`` uses.

The package's transformers code lives in six files, imported one way:
:mod:`multihead.hf.attention` (the attention function, its registration, module discovery),
:mod:`multihead.hf.layouts` (head layouts: derived, verified, explained, cut), this file (``attach``,
save / load, and the public names: the runtimes' writers from :mod:`multihead.deploy`), :mod:`multihead.hf.packed` (padding-free
models), :mod:`multihead.hf.encoder` (a BERT-family encoder rebuilt lean for prediction) and
:mod:`multihead.hf.forms` (SDPA forms of families that compute attention by hand, for
:func:`multihead.heads.observe`). Nothing else in the package imports transformers.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from multihead.heads.neurons import cut_block, ffn_blocks
from multihead.heads.surgery import head_rows
from multihead.hf import forms, probe  # noqa: F401 - forms registers Bloom's SDPA form with heads.observe
from multihead.hf.attention import (  # noqa: F401
    NAME,
    NAMES,
    NOT_ATTENTION,
    REFUSED,
    SUPPORTED,
    PreTrainedModel,
    attention_forward,
    attention_modules,
    calls_interface,
    discover,
    loading,
    refusal,
)
from multihead.hf.encoder import serve
from multihead.hf.layouts import HeadLayout, derive, explain, out_features, probe_inputs

if TYPE_CHECKING:  # the runtimes' writers documented here live a floor up, in multihead.deploy: see __getattr__
    from multihead.deploy.fastembed import fastembed
    from multihead.deploy.folder import export
    from multihead.deploy.onnx import export_onnx

__all__ = ["SUPPORTED", "HeadLayout", "attach", "attention_forward", "attention_modules", "derive", "explain",
           "export", "export_onnx", "fastembed", "load", "loading", "save", "serve"]

HEADS_KEY = "multihead_head_counts"
PACKED_KEY = "multihead_packed"  # rebuilt padding-free (attach(packed=True))
QUANTIZE_KEY = "multihead_quantize"  # None or "int8": load() quantizes the float weights
KEPT_KEY = "multihead_kept_heads"  # {module: the original indices of its kept heads} (T5's shared bias needs them)
#: True: the weights are stored at the architecture's full size, a pruned head's rows (and output columns) zero,
#: so transformers (AutoModel.from_pretrained) and sentence-transformers load the directory as it is; load() cuts
FULL_SIZE_KEY = "multihead_full_size"
#: {feed-forward block's down projection: its width} where a block's width is not the config's intermediate_size
#: (neurons cut unevenly: multihead.heads.neurons); load() builds those blocks at their widths
FFN_KEY = "multihead_ffn_widths"
#: one line in config.json: what opens the directory (transformers' from_pretrained, or multihead.hf.load only)
LOADS_KEY = "multihead_loads_with"


def attach(model: nn.Module, *, example: dict | None = None, packed: bool = False) -> nn.Module:
    """Switch a loaded transformers model to multihead's attention. Every module that calls
    transformers' attention interface gets its hook list (``capture``, ``heads.gated``,
    ``heads.importance`` work on it) and, where one derives and verifies (:func:`derive`), its
    head layout (which ``heads.prune`` uses). ``example``: the model's keyword inputs for the
    one probe call the derivation records (default: made from the config).

    ``packed=True``: a padded batch runs padding-free inside the layer stack (unpadded once after
    the embeddings, every layer on the real tokens only, padded back after the last layer; see
    :mod:`multihead.hf.packed`), verified on a padded probe batch first; a model whose layers are
    not per-token outside attention is refused, naming the module. Returns the model."""
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"attach takes a transformers PreTrainedModel; got {type(model).__name__}. For torch.nn "
                        "models use multihead.interop.patch.")
    if not any(calls_interface(type(m)) for m in model.modules()):
        raise ValueError(refusal(model))
    previous = model.config._attn_implementation
    with loading():  # each (sub-)model gets the masks its class was written for
        model.set_attn_implementation(NAME)
        if model.config._attn_implementation not in NAMES:
            raise ValueError(refusal(model))
        _verify_switch(model, example if example is not None else probe_inputs(model), previous)
    parents = dict(model.named_modules())
    for name, m in attention_modules(model).items():
        m.attention_hooks.parent = parents[name.rsplit(".", 1)[0]] if "." in name else model
    derive(model, example)
    if packed:
        from multihead.hf import packed as hf_packed

        hf_packed.enable(model, attention_modules(model), example if example is not None else probe_inputs(model))
    return model


def _verify_switch(model: nn.Module, example: dict, previous) -> None:
    """The whole model on multihead's attention against transformers' eager attention, on one probe
    call (a padded batch where the model takes an attention mask), compared on the real tokens: a
    module that computes attention itself from the mask, or leaves causality to a mask it no longer
    gets, would change the output with no attention call to blame. On a difference the model goes
    back to ``previous`` and a ValueError names the first module whose output differs
    (:mod:`multihead.hf.probe`)."""
    x = dict(example)
    if isinstance(x.get("input_ids"), Tensor) and "attention_mask" in inspect.signature(model.forward).parameters:
        x = probe.padded_example(x)
    keep = x.get("attention_mask")
    target = model.config._attn_implementation
    was = model.training
    model.eval()
    runs = []
    try:
        for impl in ("eager", target):
            try:
                model.set_attn_implementation(impl)
                runs.append(probe.run(model, x))
            except Exception:  # noqa: BLE001 - no eager, or a probe the model cannot take: derive() says why
                return
    finally:
        model.train(was)
        model.set_attn_implementation(target)
    eager, ours = runs

    def real(t: Tensor) -> Tensor:  # (B, L, ...) -> (N, ...) the real tokens, when t is per token
        return t[keep.bool()] if keep is not None and t.shape[:2] == keep.shape else t

    if not probe.differs(real(eager.output), real(ours.output)):
        return
    name = probe.first_difference(eager, ours, real, real)
    model.set_attn_implementation(previous)
    where = ""
    if name is not None:
        where = f"; the first module whose output differs is {name} ({type(model.get_submodule(name)).__name__})"
        if "." in name:
            up = name.rsplit(".", 1)[0]
            where += f", in {up} ({type(model.get_submodule(up)).__name__})"
    a, b = real(eager.output).float(), real(ours.output).float()
    gap = f"max {float((a - b).abs().max()):.3g}" if a.shape == b.shape else f"shape {tuple(b.shape)} != {tuple(a.shape)}"
    raise ValueError(f"{type(model).__name__}: on multihead's attention the output differs from transformers' eager "
                     f"attention ({gap} on a probe call){where}: it computes attention outside transformers' "
                     "attention interface, or expects masks this implementation does not give. multihead will not "
                     f"run it differently; it stays on attn_implementation={previous!r}.")


# --- saving and loading pruned models ---


def save(model: nn.Module, path: str | Path, *, quantize: str | None = None) -> Path:
    """A transformers-style directory: ``save_pretrained``'s config.json (plus the head counts
    of every attention module, {name: [H, Hkv]}) and model.safetensors holding the model's own
    parameter names (tied weights stored once), so that :func:`load` rebuilds the pruned model.
    A cut the same in every layer of a model whose config gives the counts (Llama, Qwen, Mistral, ...:
    ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``) is written as a standard config at the pruned
    size: transformers' ``from_pretrained`` builds it as it is (verified before writing: a model built from that
    config has the pruned model's parameters, shape for shape, and the config passes the family's own checks when
    read back; Gemma 3's refuses query heads that do not divide the hidden size). Otherwise, a pruned model whose
    modules have separate q/k/v projections and one key/value head per query head (BERT, MiniLM) is stored at its
    architecture's full size instead, each pruned head's rows and output columns zero: ``AutoModel.from_pretrained``
    and sentence-transformers open the directory as it is (same outputs, unpruned speed) and :func:`load` cuts the
    heads again. Any other cut (an uneven one, or counts the family's config refuses) keeps each layer's counts,
    which only :func:`load` reads. config.json's ``multihead_loads_with``
    says in one line which of these the directory is.

    ``quantize="int8"``: :func:`load` returns the model quantized (:func:`multihead.quantize.quantize`
    of the float weights saved here, the same conversion as in memory, so the same outputs). A
    padding-free model (``attach(packed=True)``) is rebuilt padding-free."""
    from safetensors.torch import save_model

    from multihead.quantize import check_dtype, is_quantized

    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"save takes a transformers PreTrainedModel; got {type(model).__name__}.")
    if is_quantized(model):
        raise ValueError("save takes the float model: save(model, path, quantize='int8') and load() quantizes it "
                         "(the int8 conversion is deterministic, so the loaded model equals quantize(model)).")
    if quantize is not None:
        check_dtype(quantize)
    path = Path(path)
    if path.exists() and not path.is_dir():  # transformers only logs it; the weights' write then failed obscurely
        raise ValueError(f"save writes a directory; {path} is a file. Give a folder (new or existing).")
    model.save_pretrained(path)
    for f in path.glob("model*.safetensors*"):  # transformers' (possibly sharded, renamed) weights
        f.unlink()
    widths, inter = {b.width for b in ffn_blocks(model)}, getattr(model.config, "intermediate_size", None)
    # every block cut alike: the config says it, transformers reads it
    ffn = {"intermediate_size": widths.pop()} if len(widths) == 1 and isinstance(inter, int) else {}
    counts = _even_counts(model)
    even = None if counts is None else _with(model.config, {**ffn, **counts})
    fits = even is not None and _fits(model, even)
    refused = _refusal(even) if fits else None  # the shapes fit, but the family's config may refuse the counts
    standard = counts if fits and refused is None else None
    full = _full_size(model) if standard is None else None
    save_model(full if full is not None else model, str(path / "model.safetensors"), metadata={"format": "pt"})
    _write_config(model, path, full, {**ffn, **(standard or {})}, quantize, refused)
    return path


def _write_config(model: nn.Module, path: Path, full: nn.Module | None, standard: dict, quantize: str | None,
                  refused: str | None = None) -> None:
    """config.json as :func:`save` leaves it: ``save_pretrained``'s, with ``standard`` (the counts or width every
    layer shares) set and multihead's entries: the head counts and feed-forward widths it cannot say, the kept heads,
    packed, quantized, and the one line of what opens the folder (``refused``: why transformers refuses the even
    cut's standard config, said in that line)."""
    from multihead.hf import packed as hf_packed

    cfg = json.loads((path / "config.json").read_text())
    mods = attention_modules(model).items()
    cfg[FULL_SIZE_KEY] = full is not None
    cfg.update(standard)
    cfg[HEADS_KEY] = {} if full is not None or "head_dim" in standard else {
        name: list(m.attention_hooks.layout.counts(m, m.attention_hooks.parent))
        for name, m in mods if m.attention_hooks.layout is not None}
    cfg[KEPT_KEY] = {name: m.attention_hooks.kept for name, m in mods if m.attention_hooks.kept is not None}
    cfg[PACKED_KEY] = hf_packed.is_packed(model)
    cfg[QUANTIZE_KEY] = quantize
    inter = getattr(model.config, "intermediate_size", None)
    if "intermediate_size" not in standard and any(b.width != inter for b in ffn_blocks(model)):
        cfg[FFN_KEY] = {b.down: b.width for b in ffn_blocks(model)}
    config = _with(model.config, standard)
    fits = _fits(full if full is not None else model, config)
    refused = refused or (_refusal(config) if fits else None)
    cfg[LOADS_KEY] = (f"{type(model).__name__}.from_pretrained('{path}') (transformers) or multihead.hf.load('{path}')"
                      if fits and refused is None else
                      f"multihead.hf.load('{path}') only: transformers' own check of the config refuses the pruned "
                      f"head counts ({refused}), so each layer keeps its own ({HEADS_KEY}) and from_pretrained "
                      "refuses the folder" if refused else
                      f"multihead.hf.load('{path}') only: its layers keep their own head counts ({HEADS_KEY}) or "
                      f"feed-forward widths ({FFN_KEY}), which a transformers config cannot say (from_pretrained refuses "
                      "it: the weights' shapes differ from the config's)")
    (path / "config.json").write_text(json.dumps(cfg, indent=2))


def _even_counts(model: nn.Module) -> dict | None:
    """``{"num_attention_heads": H, "num_key_value_heads": Hkv, "head_dim": D}`` when the model's heads were cut
    and every attention module now has these same counts (a cut the same in every layer) in a family whose config
    gives them; None otherwise (nothing cut, an uneven cut, a config without those keys). :func:`save` writes them
    only where :func:`_fits` shows transformers builds the model at that size."""
    cfg = model.config
    if not all(isinstance(getattr(cfg, k, None), int) for k in ("num_attention_heads", "num_key_value_heads")):
        return None
    mods = attention_modules(model).values()
    if not mods or any(m.attention_hooks.layout is None for m in mods):
        return None
    counts = {tuple(m.attention_hooks.layout.counts(m, m.attention_hooks.parent)) for m in mods}
    dims = {m.attention_hooks.layout.head_dim(m) for m in mods}
    if len(counts) != 1 or len(dims) != 1:
        return None
    (H, Hkv), D = counts.pop(), dims.pop()
    if (H, Hkv) == (cfg.num_attention_heads, cfg.num_key_value_heads):
        return None  # nothing cut: the config already says it
    return {"num_attention_heads": H, "num_key_value_heads": Hkv, "head_dim": D}


def _with(config, changes: dict):
    """A copy of ``config`` with ``changes`` set."""
    import copy

    out = copy.deepcopy(config)
    for k, v in changes.items():
        setattr(out, k, v)
    return out


def _refusal(config) -> str | None:
    """What transformers says when it reads ``config`` back as ``from_pretrained`` does (from its dict, the family's
    own checks run: Gemma 3's wants the hidden size a multiple of the query heads, even with ``head_dim`` given);
    None when it reads it. ``_with``'s attribute changes run no such check."""
    try:
        type(config).from_dict(config.to_dict())
    except Exception as e:  # noqa: BLE001 - any refusal: the folder is then not written as a standard config
        cause = e.__cause__ if e.__cause__ is not None else e
        return f"{type(config).__name__}: {str(cause).strip()}"
    return None


def _fits(model: nn.Module, config) -> bool:
    """Whether transformers builds from ``config`` a model with exactly ``model``'s parameters, name for name and
    shape for shape (built on the meta device: no memory, no weights)."""
    try:
        with torch.device("meta"), loading():
            built = type(model)._from_config(config)
    except Exception:  # noqa: BLE001 - a family whose config does not take the counts: it does not fit
        return False
    shapes = lambda m: {k: tuple(v.shape) for k, v in m.state_dict().items()}  # noqa: E731
    return shapes(built) == shapes(model)


def _full_size(model: nn.Module) -> nn.Module | None:
    """A copy of a pruned model at its architecture's full size (each pruned head's q/k/v rows and output
    columns zero: it contributes nothing, the outputs are the pruned model's), when every pruned module has
    separate q/k/v projections with one key/value head per query head and its config gives the full count;
    None otherwise (or when nothing was pruned)."""
    import copy

    H0 = getattr(model.config, "num_attention_heads", None)
    pruned = {n: m for n, m in attention_modules(model).items() if m.attention_hooks.kept is not None}
    if not pruned or not isinstance(H0, int) or getattr(model.config, "num_key_value_heads", H0) != H0:
        return None  # nothing cut, no full count, or grouped key/value heads (which the kept list does not name)
    for m in pruned.values():
        lay, (H, Hkv) = m.attention_hooks.layout, m.attention_hooks.layout.counts(m, m.attention_hooks.parent)
        if lay.fused or lay.per_head or lay.per_head_lists or H != Hkv or max(m.attention_hooks.kept, default=0) >= H0:
            return None
    full = copy.deepcopy(model)
    names = dict(full.named_modules())
    for name in pruned:
        m = names[name]
        lay, kept = m.attention_hooks.layout, m.attention_hooks.kept
        parent = m.attention_hooks.parent
        D = lay.head_dim(m)
        rows = head_rows(kept, D)
        q, k, v, o = lay.projections(m, parent)
        with torch.no_grad():
            for lin in (q, k, v):
                w = lin.weight.new_zeros(H0 * D, lin.weight.shape[1])  # (H0*D, E): zero rows for pruned heads
                w[rows] = lin.weight
                lin.weight = nn.Parameter(w)
                if lin.bias is not None:
                    b = lin.bias.new_zeros(H0 * D)
                    b[rows] = lin.bias
                    lin.bias = nn.Parameter(b)
            w = o.weight.new_zeros(o.weight.shape[0], H0 * D)  # (E, H0*D): zero columns for pruned heads
            w[:, rows] = o.weight
            o.weight = nn.Parameter(w)
    return full


def load(path: str | Path, *, model_class: Callable | None = None, quantized: bool = True) -> nn.Module:
    """Rebuild a model written by :func:`save` (pruned or not) from its directory: the model is
    built from config.json, its attention modules resized to the recorded head counts, the
    weights loaded (strictly); returned attached, in eval mode, padding-free and quantized when
    it was saved so (``quantized=False``: the float model it was quantized from, e.g. to export it
    with :func:`export_onnx` and quantize it in another runtime)."""
    import transformers
    from safetensors import SafetensorError
    from safetensors.torch import load_model

    path = Path(path)
    cfg_file, w_file = path / "config.json", path / "model.safetensors"
    for f in (cfg_file, w_file):
        if not f.is_file():
            raise ValueError(f"{f} does not exist: give a directory written by multihead.hf.save.")
    raw = json.loads(cfg_file.read_text())
    config = transformers.AutoConfig.from_pretrained(path)
    if model_class is None:
        archs = raw.get("architectures") or []
        if not archs or not hasattr(transformers, archs[0]):
            raise ValueError(f"{cfg_file} names no transformers architecture; pass model_class=.")
        model_class = getattr(transformers, archs[0])
    with loading():
        model = attach(model_class._from_config(config, attn_implementation=NAME))
    _resize(model, raw, cfg_file, w_file)
    try:
        missing, unexpected = load_model(model, str(w_file), strict=False)
    except (SafetensorError, OSError, RuntimeError) as e:
        raise ValueError(f"{w_file} does not load into {model_class.__name__} with the recorded head counts: "
                         f"{str(e).splitlines()[0][:300]}") from None
    if missing or unexpected:
        raise ValueError(f"the weights in {w_file} do not fit {model_class.__name__} with the recorded head counts: "
                         f"missing {list(missing)[:5]}, unexpected {list(unexpected)[:5]}.")
    model.eval()
    if raw.get(FULL_SIZE_KEY):  # stored at full size, pruned heads zero: cut them (exact: they are zero)
        mods = attention_modules(model)
        for name, kept in raw.get(KEPT_KEY, {}).items():
            m, kept = mods[name], [int(h) for h in kept]
            m.attention_hooks.kept = None  # the full-size module: kept are indices into it
            m.attention_hooks.layout.prune(m, kept, kept)
    if raw.get(PACKED_KEY):
        from multihead.hf import packed as hf_packed

        hf_packed.enable(model, attention_modules(model), probe_inputs(model))
    if raw.get(QUANTIZE_KEY) and quantized:
        from multihead.quantize import quantize

        model = quantize(model, raw[QUANTIZE_KEY])
    return model


def _resize(model: nn.Module, raw: dict, cfg_file: Path, w_file: Path) -> None:
    """Give a freshly built model the head counts (and output biases) ``raw`` (config.json) records,
    sizes only: the weights are loaded next."""
    from safetensors import safe_open

    mods = attention_modules(model)
    for name, (H, Hkv) in raw.get(HEADS_KEY, {}).items():
        if name not in mods:
            raise ValueError(f"{cfg_file} records heads for {name!r}, not an attention module of "
                             f"{type(model).__name__}.")
        m = mods[name]
        layout = m.attention_hooks.layout
        if layout is None:
            raise ValueError(f"{cfg_file} records heads for {name!r}, whose head layout multihead cannot derive: "
                             f"{m.attention_hooks.layout_reason}.")
        H0, Hkv0 = layout.counts(m, m.attention_hooks.parent)
        if (H, Hkv) != (H0, Hkv0):  # uneven GQA groups may hold Hkv > Hkv0
            layout.prune(m, list(range(H)), [i % Hkv0 for i in range(Hkv)])
    for name, kept in raw.get(KEPT_KEY, {}).items():
        if name in mods:
            mods[name].attention_hooks.kept = [int(h) for h in kept]
    _resize_ffn(model, raw.get(FFN_KEY) or {}, cfg_file)
    with safe_open(str(w_file), "pt") as f:
        keys = set(f.keys())
    for name, m in mods.items():  # a mean-compensated prune gave a bias-free output projection a bias
        layout = m.attention_hooks.layout
        if layout is None:
            continue
        owner, owner_name = (m.attention_hooks.parent, name.rsplit(".", 1)[0]) if layout.o_from_parent else (m, name)
        o = owner.get_submodule(layout.o)
        if o.bias is None and f"{owner_name}.{layout.o}.bias" in keys:
            o.bias = nn.Parameter(torch.zeros(out_features(o), device=o.weight.device, dtype=o.weight.dtype))


def _resize_ffn(model: nn.Module, widths: dict, cfg_file: Path) -> None:
    """Give a freshly built model's feed-forward blocks the widths ``widths`` ({down: width}, config.json's
    :data:`FFN_KEY`) records, sizes only: the weights are loaded next."""
    blocks = {b.down: b for b in ffn_blocks(model)}
    for down, width in widths.items():
        if down not in blocks:
            raise ValueError(f"{cfg_file} records a feed-forward width for {down!r}, not a feed-forward block of "
                             f"{type(model).__name__}.")
        if int(width) != blocks[down].width:
            cut_block(model, blocks[down], list(range(int(width))), None)


def __getattr__(name: str):
    """``export``, ``export_onnx`` and ``fastembed``, documented here (``multihead.hf.export(model, DIR)``), live in
    :mod:`multihead.deploy` (the floor above, with every runtime's room): imported when first asked for, so that
    importing this package loads none of it and the rooms can import this floor."""
    if name in ("export", "export_onnx", "fastembed"):
        from multihead.deploy import fastembed, folder, onnx

        globals()[name] = getattr({"export": folder, "export_onnx": onnx, "fastembed": fastembed}[name], name)
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
