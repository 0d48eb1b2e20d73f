"""A decoder as the decoder runtimes read it (:mod:`multihead.deploy.gguf`, :mod:`multihead.deploy.genai`): a Llama, or
a Gemma 3 (the same projections, with query/key norms, norms after attention and MLP, sliding-window layers and one
RoPE base per kind of layer). Each layer's query heads H, key/value heads Hkv and head size D read from its
projections (:func:`layer_counts`: not from the config, which a prune leaves at the original counts), everything a
decoder export refuses (:func:`_check_layers`; :func:`_check` also refuses an uneven cut), and the model at its pruned
size as a plain transformers folder with the standard configuration (:func:`standard_folder`:
``num_attention_heads=H``, ``num_key_value_heads=Hkv``, ``head_dim=D``) every runtime's converter loads.
"""

from __future__ import annotations

import copy
from pathlib import Path

from torch import nn

from multihead.hf.attention import PreTrainedModel

__all__ = ["ARCHITECTURES", "layer_counts", "standard_folder"]


#: the model classes these exports write: llama.cpp's ``llama`` (``deci`` for an uneven cut) and ``gemma3`` graphs;
#: GenAI's builder takes the Llama (its Gemma 3 class fails on transformers 5's config: multihead.deploy.genai)
ARCHITECTURES = ("LlamaForCausalLM", "Gemma3ForCausalLM")


def _layers(model: nn.Module) -> list[nn.Module]:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no model.layers: give one of {', '.join(ARCHITECTURES)}.")
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
        raise ValueError(f"{what} writes {', '.join(ARCHITECTURES)} (llama.cpp's llama and gemma3 graphs, GenAI's "
                         "builder for the Llama); "
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
                         f"{type(model).__name__}.")
    for i, layer in enumerate(_layers(model)):
        a, mlp = layer.self_attn, layer.mlp
        with_bias = [n for n in ("q_proj", "k_proj", "v_proj", "o_proj") if getattr(a, n).bias is not None]
        with_bias += [n for n in ("gate_proj", "up_proj", "down_proj") if getattr(mlp, n).bias is not None]
        if with_bias:
            raise ValueError(f"{what}: layer {i}'s {with_bias} have biases (a mean-compensated prune, or a model with "
                             "attention biases); this export writes bias-free projections only: prune without "
                             "mean_outputs.")
        if mlp.gate_proj.weight.shape[0] != _layers(model)[0].mlp.gate_proj.weight.shape[0]:
            raise ValueError(f"{what}: the feed-forward widths differ between layers (layer {i}); the config holds "
                             "one intermediate_size.")
        if counts[i][2] != counts[0][2]:
            raise ValueError(f"{what}: the head size differs between layers (layer {i}: {counts[i][2]}, layer 0: "
                             f"{counts[0][2]}); the config holds one head_dim.")
    for kind, rope in _rope_kinds(cfg).items():
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"{what}: RoPE of type {rope.get('rope_type')!r}"
                             f"{'' if kind == 'all' else ' in the ' + kind + ' layers'}; this export writes the "
                             "default RoPE only.")
    return counts


def _rope_kinds(cfg) -> dict[str, dict]:
    """{kind of layer: its RoPE parameters}: Gemma 3's ``rope_parameters`` hold one entry per kind
    ("full_attention", "sliding_attention"), a Llama's one for every layer (returned as "all")."""
    rope = dict(getattr(cfg, "rope_parameters", None) or {})
    kinds = {k: dict(v) for k, v in rope.items() if isinstance(v, dict)}
    return kinds or {"all": rope}


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
