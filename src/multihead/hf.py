"""Your own model: Hugging Face transformers models on multihead (the ``hf`` extra).

    import multihead.hf                                   # registers "multihead" with transformers
    model = multihead.hf.attach(AutoModel.from_pretrained(path))   # or attn_implementation="multihead"
    with multihead.capture(model) as cap: model(**batch)  # (B, H, Lq, Lk) per attention module
    heads.prune(model, {"encoder.layer.0.attention.self": [0, 3]})
    multihead.hf.save(model, "pruned");  multihead.hf.load("pruned")

Importing this module registers ``"multihead"`` through transformers' public extension
points: :class:`transformers.AttentionInterface` (the attention function) and
``transformers.masking_utils.AttentionMaskInterface`` (its mask function; without it a
custom implementation silently receives no padding mask). Every attention call then
goes through :func:`multihead.attention` (backends, ``explain``, a row with nothing to
attend to gives zeros), with the module's hook list around it, so ``capture``,
``heads.gated``, ``heads.importance`` and ``heads.mean_head_outputs`` work on the
model unchanged. :func:`attach` gives each attention module its hook list and its
head layout (which weights hold head h), which ``heads.prune`` uses.

This is the only file of the package that imports transformers.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from multihead import masks
from multihead.functional import _weights, attention
from multihead.hooks import AttentionHooks

__all__ = ["SUPPORTED", "HeadLayout", "attach", "attention_forward", "attention_modules", "load", "save"]

#: the transformers versions this integration is tested with (the ``hf`` extra pins them)
SUPPORTED = (5, 6)  # >= 5.0, < 6
NAME = "multihead"
HEADS_KEY = "multihead_head_counts"


def _check_version():
    import transformers

    major = int(transformers.__version__.split(".")[0])
    if not SUPPORTED[0] <= major < SUPPORTED[1]:
        raise ImportError(
            f"multihead.hf supports transformers >= {SUPPORTED[0]}.0, < {SUPPORTED[1]}.0; found "
            f"{transformers.__version__}. Install a supported version: pip install 'multihead[hf]'."
        )


_check_version()

from transformers import AttentionInterface, PreTrainedModel  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask  # noqa: E402


def attention_forward(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                      dropout: float = 0.0, scaling: float | None = None, is_causal: bool | None = None,
                      position_bias: Tensor | None = None, **kwargs) -> tuple[Tensor, Tensor | None]:
    """transformers' attention-function contract on multihead.

    query (B, H, Lq, D), key (B, Hkv, Lk, D), value (B, Hkv, Lk, Dv); attention_mask a bool
    keep mask or float bias broadcastable to (B, H, Lq, Lk) (or None); position_bias (T5) a
    float bias -> (out (B, Lq, H, Dv), weights (B, H, Lq, Lk) when ``output_attentions`` else None).
    """
    Lq, Lk = query.shape[2], key.shape[2]
    causal = is_causal if is_causal is not None else bool(module.__dict__.get("is_causal", False))
    mask = masks.from_hf(attention_mask)
    if attention_mask is None and causal and Lq > 1:
        if Lk > Lq:  # prefill into an empty static cache: the keys past Lq are not written yet (as sdpa)
            key, value = key[:, :, :Lq], value[:, :, :Lq]
            position_bias = None if position_bias is None else position_bias[..., :Lq]
        mask = masks.Causal()
    if position_bias is not None:
        mask = masks.Dense(position_bias) if mask is None else mask & masks.Dense(position_bias)
    hooks = module.__dict__.get("attention_hooks")
    if hooks is None:  # a model loaded with attn_implementation="multihead" and not attached yet
        hooks = module.__dict__["attention_hooks"] = AttentionHooks()
    if query.shape[1] == 0:  # every head pruned: nothing to attend; the output projection gives its bias
        return query.new_zeros(query.shape[0], Lq, 0, value.shape[-1]), None
    if hooks.observers:
        hooks.observe(module, query, key, mask, scaling)
    out = attention(query, key, value, mask, scale=scaling, dropout_p=dropout)  # (B, H, Lq, Dv)
    out = out.transpose(1, 2)  # (B, H, Lq, Dv) -> (B, Lq, H, Dv)
    if hooks.transforms:
        out = hooks.transform(module, out, None)
    weights = _weights(query, key, mask, scaling) if kwargs.get("output_attentions") else None
    return out.contiguous(), weights


AttentionInterface.register(NAME, attention_forward)
AttentionMaskInterface.register(NAME, sdpa_mask)  # the boolean masks sdpa gets: padding is never dropped


# --- head layouts: which weights hold head h, per family ---


@dataclass
class HeadLayout:
    """One attention module's head surgery: the names of its q/k/v/o projections (a
    fused qkv projection for GPT-2's ``c_attn``), where the output projection lives
    (``o_parent``: a path from the attention module's parent, for BERT's ``output.dense``),
    and which attributes hold the head count and inner size."""

    family: str
    q: str
    k: str
    v: str
    o: str
    o_from_parent: bool = False
    fused: bool = False  # GPT-2: one Conv1D (E, 3E) holding q, k, v
    #: whether the family's forward works with zero heads; if not, pruning every head keeps one
    #: head whose output-projection columns are zero (it contributes nothing: the output is the bias)
    zero_heads_ok: bool = True
    count_attrs: tuple[str, ...] = ("num_heads", "num_attention_heads", "n_heads")
    size_attrs: tuple[str, ...] = ("all_head_size", "inner_dim", "split_size")

    def head_dim(self, m: nn.Module) -> int:
        for a in ("head_dim", "attention_head_size", "key_value_proj_dim"):
            if isinstance(m.__dict__.get(a), int):
                return m.__dict__[a]
        raise ValueError(f"{type(m).__name__}: cannot tell its head size")

    def projections(self, m: nn.Module, parent: nn.Module | None):
        o = parent.get_submodule(self.o) if self.o_from_parent else m.get_submodule(self.o)
        if self.fused:
            return m.get_submodule(self.q), None, None, o
        return m.get_submodule(self.q), m.get_submodule(self.k), m.get_submodule(self.v), o

    def prune(self, m: nn.Module, keep: list[int], kv: list[int], mean_out: Tensor | None = None,
              gone: list[int] | None = None) -> None:
        """Keep query heads ``keep`` and key/value heads ``kv`` (indices may repeat: a key/value
        head copied for uneven groups); q/k/v/o weights shrink. ``mean_out`` (H, Dv): the
        removed heads' (``gone``) mean output is folded into the output projection's bias."""
        _prune(self, m, keep, kv, mean_out, gone)

    def counts(self, m: nn.Module, parent: nn.Module | None) -> tuple[int, int]:
        """(H, Hkv) from the projections' sizes."""
        D = self.head_dim(m)
        q, k, _, _ = self.projections(m, parent)
        if self.fused:
            H = _out_features(q) // 3 // D
            return H, H
        return _out_features(q) // D, _out_features(k) // D


def _out_features(p: nn.Module) -> int:
    return p.weight.shape[1] if _is_conv1d(p) else p.weight.shape[0]


def _is_conv1d(p: nn.Module) -> bool:
    return type(p).__name__ == "Conv1D"  # transformers' Conv1D: weight (in, out), y = x W + b


LAYOUTS: dict[str, HeadLayout] = {}


def _layout(family: str, classes: tuple[str, ...], **kw) -> None:
    layout = HeadLayout(family, **kw)
    for c in classes:
        LAYOUTS[c] = layout


_layout("bert", ("BertSelfAttention", "RobertaSelfAttention", "ElectraSelfAttention", "CamembertSelfAttention",
                 "XLMRobertaSelfAttention", "BertCrossAttention", "RobertaCrossAttention", "ElectraCrossAttention"),
        q="query", k="key", v="value", o="output.dense", o_from_parent=True)
_layout("distilbert", ("DistilBertSelfAttention",), q="q_lin", k="k_lin", v="v_lin",
        o="out_lin")
_layout("llama", ("LlamaAttention", "MistralAttention", "Qwen2Attention", "ViTAttention", "DeiTAttention"),
        q="q_proj", k="k_proj", v="v_proj", o="o_proj")
_layout("bart", ("BartAttention", "MBartAttention", "MarianAttention"), q="q_proj", k="k_proj", v="v_proj",
        o="out_proj")
_layout("whisper", ("WhisperAttention",), q="q_proj", k="k_proj", v="v_proj", o="out_proj", zero_heads_ok=False)
_layout("gpt2", ("GPT2Attention",), q="c_attn", k="c_attn", v="c_attn", o="c_proj", fused=True)


def supported_families() -> str:
    return ", ".join(sorted({f"{layout.family} ({', '.join(sorted(c for c, lo in LAYOUTS.items() if lo is layout))})"
                             for layout in LAYOUTS.values()}))


def _is_attention(m: nn.Module) -> bool:
    return type(m).__name__ in LAYOUTS


def attention_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Every attention module of a transformers model that multihead knows the layout of."""
    return {n: m for n, m in model.named_modules() if _is_attention(m)}


def attach(model: nn.Module) -> nn.Module:
    """Switch a loaded transformers model to multihead's attention and give every attention
    module its hook list and head layout. Returns the model."""
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"attach takes a transformers PreTrainedModel; got {type(model).__name__}. For torch.nn "
                        "models use multihead.interop.patch.")
    model.set_attn_implementation(NAME)
    if model.config._attn_implementation != NAME:
        raise ValueError(f"{type(model).__name__} does not route its attention through transformers' "
                         "AttentionInterface, so multihead cannot attach to it.")
    parents = dict(model.named_modules())
    found = 0
    for name, m in model.named_modules():
        if not _is_attention(m):
            continue
        layout = LAYOUTS[type(m).__name__]
        parent = parents[name.rsplit(".", 1)[0]] if "." in name else model
        H, Hkv = layout.counts(m, parent)
        hooks = m.__dict__.get("attention_hooks") or AttentionHooks()
        hooks.num_heads, hooks.layout, hooks.parent = H, layout, parent
        m.__dict__["attention_hooks"] = hooks
        found += 1
    if not found:
        raise ValueError(f"{type(model).__name__} has no attention module multihead knows the heads of; supported "
                         f"families: {supported_families()}.")
    return model


# --- pruning ---


def _rows(idx: list[int], size: int) -> list[int]:
    return [i * size + d for i in idx for d in range(size)]


def _select(p: nn.Module, out_rows: list[int] | None = None, in_cols: list[int] | None = None) -> nn.Module:
    """A copy of Linear / Conv1D ``p`` keeping output rows ``out_rows`` and input columns ``in_cols``."""
    w = p.weight.detach()
    conv = _is_conv1d(p)
    wt = w.t() if conv else w  # (out, in)
    if out_rows is not None:
        wt = wt[out_rows]
    if in_cols is not None:
        wt = wt[:, in_cols]
    b = p.bias.detach() if p.bias is not None else None
    if b is not None and out_rows is not None:
        b = b[out_rows]
    if conv and wt.shape[1] == 0:  # transformers' Conv1D cannot take zero input features; Linear can
        conv = False
    if conv:
        new = type(p)(wt.shape[0], wt.shape[1])
        new.weight = nn.Parameter(wt.t().contiguous())
    else:
        new = nn.Linear(wt.shape[1], wt.shape[0], bias=b is not None, device=w.device, dtype=w.dtype)
        new.weight = nn.Parameter(wt.contiguous())
    if b is not None:
        new.bias = nn.Parameter(b.contiguous())
    elif conv:
        new.bias = None
    return new.to(device=w.device, dtype=w.dtype)


def _set(owner: nn.Module, path: str, new: nn.Module) -> None:
    parent, _, leaf = path.rpartition(".")
    setattr(owner.get_submodule(parent) if parent else owner, leaf, new)


def _prune(layout: HeadLayout, m: nn.Module, keep: list[int], kv: list[int], mean_out: Tensor | None,
           gone: list[int] | None) -> None:
    hooks = m.__dict__["attention_hooks"]
    parent = hooks.parent
    D = layout.head_dim(m)
    q, k, v, o = layout.projections(m, parent)
    null = not keep and not layout.zero_heads_ok
    if null:  # keep one head that contributes nothing (its output-projection columns are zeroed below)
        keep, kv = [0], [0]
    with torch.no_grad():
        if layout.fused:  # (E, 3E): [q | k | v] along the output
            H = hooks.num_heads
            rows = _rows(keep, D) + [H * D + r for r in _rows(kv, D)] + [2 * H * D + r for r in _rows(kv, D)]
            _set(m, layout.q, _select(q, out_rows=rows))
        else:
            _set(m, layout.q, _select(q, out_rows=_rows(keep, D)))
            _set(m, layout.k, _select(k, out_rows=_rows(kv, D)))
            _set(m, layout.v, _select(v, out_rows=_rows(kv, D)))
        new_o = _select(o, in_cols=_rows(keep, D))
        if null:
            new_o.weight.zero_()
        if mean_out is not None and gone:
            w = o.weight.t() if _is_conv1d(o) else o.weight  # (out, H*Dv)
            const = w[:, _rows(gone, D)] @ mean_out[gone].reshape(-1).to(w.dtype)  # (out,)
            if new_o.bias is None:
                new_o.bias = nn.Parameter(torch.zeros_like(const))
            new_o.bias += const
        _set(parent if layout.o_from_parent else m, layout.o, new_o)
    H, Hkv = len(keep), len(kv)
    for a in layout.count_attrs:
        if isinstance(m.__dict__.get(a), int):
            m.__dict__[a] = H
    for a in layout.size_attrs:
        if isinstance(m.__dict__.get(a), int | list):
            m.__dict__[a] = H * D
    if layout.fused and H == 0 and not m.__dict__.get("is_cross_attention"):
        m.__dict__["split_size"] = [0, 0, 0]  # GPT-2 splits c_attn's (B, L, 0) output into q, k, v: three empty parts
    if isinstance(m.__dict__.get("num_key_value_groups"), int):
        m.__dict__["num_key_value_groups"] = H // Hkv if Hkv else 1
    hooks.num_heads = H


# --- saving and loading pruned models ---


def save(model: nn.Module, path: str | Path) -> Path:
    """A transformers-style directory: ``save_pretrained``'s config.json (plus the head counts
    of every attention module, {name: [H, Hkv]}) and model.safetensors holding the model's own
    parameter names (tied weights stored once), so that :func:`load` rebuilds the pruned model."""
    from safetensors.torch import save_model

    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"save takes a transformers PreTrainedModel; got {type(model).__name__}.")
    path = Path(path)
    model.save_pretrained(path)
    for f in path.glob("model*.safetensors*"):  # transformers' (possibly sharded, renamed) weights
        f.unlink()
    save_model(model, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg[HEADS_KEY] = {name: list(LAYOUTS[type(m).__name__].counts(m, m.attention_hooks.parent))
                      for name, m in attention_modules(model).items()}
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path


def load(path: str | Path, *, model_class: Callable | None = None) -> nn.Module:
    """Rebuild a model written by :func:`save` (pruned or not) from its directory: the model is
    built from config.json, its attention modules resized to the recorded head counts, the
    weights loaded (strictly); returned attached, in eval mode."""
    import transformers
    from safetensors import SafetensorError
    from safetensors.torch import load_model

    path = Path(path)
    cfg_file, w_file = path / "config.json", path / "model.safetensors"
    for f in (cfg_file, w_file):
        if not f.is_file():
            raise ValueError(f"{f} does not exist: give a directory written by multihead.hf.save.")
    raw = json.loads(cfg_file.read_text())
    counts = raw.get(HEADS_KEY, {})
    config = transformers.AutoConfig.from_pretrained(path)
    if model_class is None:
        archs = raw.get("architectures") or []
        if not archs or not hasattr(transformers, archs[0]):
            raise ValueError(f"{cfg_file} names no transformers architecture; pass model_class=.")
        model_class = getattr(transformers, archs[0])
    model = attach(model_class._from_config(config, attn_implementation=NAME))
    mods = attention_modules(model)
    for name, (H, Hkv) in counts.items():
        if name not in mods:
            raise ValueError(f"{cfg_file} records heads for {name!r}, not an attention module of {model_class.__name__}.")
        m = mods[name]
        layout = LAYOUTS[type(m).__name__]
        H0, Hkv0 = layout.counts(m, m.attention_hooks.parent)
        if (H, Hkv) != (H0, Hkv0):  # sizes only (the weights are loaded next); uneven GQA groups may hold Hkv > Hkv0
            layout.prune(m, list(range(H)), [i % Hkv0 for i in range(Hkv)])
    from safetensors import safe_open

    with safe_open(str(w_file), "pt") as f:
        keys = set(f.keys())
    for name, m in mods.items():  # a mean-compensated prune gave a bias-free output projection a bias
        layout = LAYOUTS[type(m).__name__]
        owner, owner_name = (m.attention_hooks.parent, name.rsplit(".", 1)[0]) if layout.o_from_parent else (m, name)
        o = owner.get_submodule(layout.o)
        if o.bias is None and f"{owner_name}.{layout.o}.bias" in keys:
            o.bias = nn.Parameter(torch.zeros(_out_features(o), device=o.weight.device, dtype=o.weight.dtype))
    try:
        missing, unexpected = load_model(model, str(w_file), strict=False)
    except (SafetensorError, OSError, RuntimeError) as e:
        raise ValueError(f"{w_file} does not load into {model_class.__name__} with the recorded head counts: "
                         f"{str(e).splitlines()[0][:300]}") from None
    if missing or unexpected:
        raise ValueError(f"the weights in {w_file} do not fit {model_class.__name__} with the recorded head counts: "
                         f"missing {list(missing)[:5]}, unexpected {list(unexpected)[:5]}.")
    return model.eval()
