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

import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from multihead import hooks as hooks_mod
from multihead import masks
from multihead.functional import _weights, attention
from multihead.hooks import AttentionHooks
from multihead.modules import linear

__all__ = ["SUPPORTED", "HeadLayout", "attach", "attention_forward", "attention_modules", "derive", "explain",
           "export_onnx", "load", "save"]

#: the transformers versions this integration is tested with (the ``hf`` extra pins them)
SUPPORTED = (5, 6)  # >= 5.0, < 6
NAME = "multihead"
HEADS_KEY = "multihead_head_counts"
PACKED_KEY = "multihead_packed"  # rebuilt padding-free (attach(packed=True))
QUANTIZE_KEY = "multihead_quantize"  # None or "int8": load() quantizes the float weights
KEPT_KEY = "multihead_kept_heads"  # {module: the original indices of its kept heads} (T5's shared bias needs them)


def _check_version():
    from multihead.extras import require

    transformers = require("transformers", "multihead.hf")

    major = int(transformers.__version__.split(".")[0])
    if not SUPPORTED[0] <= major < SUPPORTED[1]:
        raise ImportError(
            f"multihead.hf supports transformers >= {SUPPORTED[0]}.0, < {SUPPORTED[1]}.0; found "
            f"{transformers.__version__}. Install a supported version: pip install 'multihead[hf]'."
        )


_check_version()

from transformers import AttentionInterface, PreTrainedModel  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask  # noqa: E402

#: keywords transformers hands every attention function that do not change what attention computes,
#: with the reason each is safe to receive (anything else not named in the signature is refused)
NOT_ATTENTION = {
    "position_ids": "positions are applied by the model (rotary embeddings) before the call; packed rows reach "
                    "the call as the block-diagonal mask transformers builds from them",
    "use_cache": "the model's cache is updated before the call; the keys and values arrive complete",
    "output_hidden_states": "a model-level output flag",
    "output_router_logits": "a mixture-of-experts output flag",
    "num_items_in_batch": "a loss normaliser",
    "deterministic": "a flash-attention backward flag; multihead's forward is deterministic",
}


#: keywords some families pass that multihead does not compute, each refused with its reason
REFUSED = {
    "indices": "sparse top-k attention (a learned indexer picks the keys)",
    "block_indices": "block-sparse attention",
    "sinks": "a second sink convention (s_aux is gpt-oss'); not verified to mean the same",
    "query": "a model that hands its own query/key/value a second time by keyword",
    "key": "a model that hands its own query/key/value a second time by keyword",
    "value": "a model that hands its own query/key/value a second time by keyword",
    "cache": "transformers' paged cache (continuous batching)",
    "seq_idx": "packed-sequence indices of a state-space layer",
}


def _causal(module: nn.Module, is_causal: bool | None, attention_mask, Lq: int) -> bool:
    """transformers' sdpa rule: the argument, else the module's ``is_causal`` (default True); only
    when there is no mask and more than one query (a mask, when given, already holds causality)."""
    causal = is_causal if is_causal is not None else bool(getattr(module, "is_causal", True))
    return Lq > 1 and attention_mask is None and causal


def _refuse(module: nn.Module, kwargs: dict) -> None:
    unknown = sorted(k for k, v in kwargs.items() if k not in NOT_ATTENTION and v is not None)
    if unknown:
        why = "; ".join(f"{k}: {REFUSED[k]}" for k in unknown if k in REFUSED)
        raise TypeError(f"{type(module).__name__} passes {', '.join(repr(k) for k in unknown)} to its attention "
                        + (f"function ({why}); " if why else "function; ") + "multihead does not compute "
                        f"{'these arguments' if len(unknown) > 1 else 'this argument'} and will not ignore "
                        f"{'them' if len(unknown) > 1 else 'it'}. Load the model with attn_implementation='sdpa' "
                        "or 'eager' for this family.")


def _live(mask: Tensor | None, Lq: int, Lk: int) -> Tensor | None:
    """(B, Lq) True = a real query row, for head statistics: with self-attention over one sequence
    (Lq == Lk), row i is padding when key i may be seen by no row; otherwise a row with nothing to
    attend to. None: every row is real."""
    if mask is None:
        return None
    keep = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2  # (B|1, H|1, Lq|1, Lk)
    keep = keep.expand(keep.shape[0], keep.shape[1], Lq, Lk).any(1)  # (B|1, Lq, Lk)
    live = keep.any(1) if Lq == Lk else keep.any(-1)  # (B|1, Lq)
    return None if bool(live.all()) else live


def attention_forward(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                      dropout: float = 0.0, scaling: float | None = None, is_causal: bool | None = None,
                      position_bias: Tensor | None = None, softcap: float | None = None, s_aux: Tensor | None = None,
                      sliding_window: int | None = None, cu_seq_lens_q: Tensor | None = None,
                      cu_seq_lens_k: Tensor | None = None, max_length_q: int | None = None,
                      max_length_k: int | None = None, output_attentions: bool | None = False,
                      **kwargs) -> tuple[Tensor, Tensor | None]:
    """transformers' attention-function contract on multihead; every argument is computed or refused.

    query (B, H, Lq, D), key (B, Hkv, Lk, D), value (B, Hkv, Lk, Dv); attention_mask a bool
    keep mask or float bias broadcastable to (B, H, Lq, Lk) (or None)
    -> (out (B, Lq, H, Dv), weights (B, H, Lq, Lk) when ``output_attentions`` else None).

    - ``scaling``, ``dropout``, ``is_causal`` (defaulted as transformers' sdpa does);
    - ``position_bias`` (T5): added to the scores; a layer whose heads were pruned takes its rows;
    - ``softcap`` (Gemma 2) and ``s_aux`` (gpt-oss' sinks): score modifiers of the spec;
    - ``sliding_window``: the window is in the mask transformers' mask function builds (the one
      sdpa gets); a call without a mask whose window would cut keys is refused;
    - ``cu_seq_lens_q/k``, ``max_length_q/k``: packed rows (B = 1) run varlen, sequence by sequence;
    - the keywords in :data:`NOT_ATTENTION` do not change attention; any other is refused.
    """
    _refuse(module, kwargs)
    hooks = module.__dict__.get("attention_hooks")
    if hooks is None:  # a model loaded with attn_implementation="multihead" and not attached yet
        hooks = module.__dict__["attention_hooks"] = AttentionHooks()
    B, H, Lq, _ = query.shape
    Lk = key.shape[2]
    hooks.seen = (H, key.shape[1], query.shape[-1], value.shape[-1])
    if hooks.num_heads != H:
        if hooks:  # gates or observers were made for the count read before any call: refuse, never mis-gate
            raise ValueError(f"{type(module).__name__}: multihead read {hooks.num_heads} heads from its attributes or "
                             f"config, but it calls attention with H={H} (query {tuple(query.shape)}); run the model "
                             "once outside heads.gated / capture so the count is taken from the call.")
        hooks.num_heads = H  # the call is the truth
    if H == 0:  # every head pruned: nothing to attend; the output projection gives its bias
        return query.new_zeros(B, Lq, 0, value.shape[-1]), None
    if position_bias is not None and hooks.kept is not None and position_bias.shape[1] != H:
        position_bias = position_bias[:, hooks.kept]  # the shared bias (.., H0, Lq, Lk): this layer's kept heads
    if cu_seq_lens_q is not None or cu_seq_lens_k is not None:
        packed_causal = is_causal if is_causal is not None else bool(getattr(module, "is_causal", True))
        hooks.args = (scaling, dropout, packed_causal, softcap, s_aux is not None, sliding_window,
                      position_bias is not None, True, attention_mask is not None)
        return _packed(module, hooks, query, key, value, attention_mask, dropout, scaling, is_causal, position_bias,
                       softcap, s_aux, sliding_window, cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k,
                       output_attentions)
    causal = _causal(module, is_causal, attention_mask, Lq)
    hooks.args = (scaling, dropout, causal, softcap, s_aux is not None, sliding_window, position_bias is not None,
                  False, attention_mask is not None)
    if attention_mask is None and sliding_window is not None and Lk > sliding_window and Lq > 1:
        raise ValueError(f"{type(module).__name__} passes sliding_window={sliding_window} with Lk={Lk} keys but no "
                         "attention mask: the window is not in the mask, and its alignment is the model's. Build the "
                         "model's masks with transformers (multihead registers sdpa's mask function).")
    mask = masks.from_hf(attention_mask)
    if causal:
        if Lk > Lq:  # prefill into an empty static cache: the keys past Lq are not written yet (as sdpa)
            key, value = key[:, :, :Lq], value[:, :, :Lq]
            position_bias = None if position_bias is None else position_bias[..., :Lq]
        mask = masks.Causal()
    if position_bias is not None:
        mask = masks.Dense(position_bias) if mask is None else mask & masks.Dense(position_bias)
    mods = {"softcap": softcap, "sinks": None if s_aux is None else s_aux.to(query.dtype)}
    if hooks.observers:
        hooks.observe(module, query, key, mask, scaling, **{k: v for k, v in mods.items() if v is not None})
    out = attention(query, key, value, mask, scale=scaling, dropout_p=dropout, **mods)  # (B, H, Lq, Dv)
    out = out.transpose(1, 2)  # (B, H, Lq, Dv) -> (B, Lq, H, Dv)
    if hooks.transforms:
        out = hooks.transform(module, out, _live(attention_mask, Lq, key.shape[2]))
    weights = _weights(query, key, mask, scaling, **mods) if output_attentions else None
    return out.contiguous(), weights


def _packed(module, hooks, query, key, value, attention_mask, dropout, scaling, is_causal, position_bias, softcap,
            s_aux, sliding_window, cu_q, cu_k, max_q, max_k, output_attentions):
    """Packed rows (query (1, H, N, D)) with transformers' flash-attention arguments: sequence b is
    tokens cu[b]:cu[b+1]; causal within each sequence when the module is; a ``sliding_window`` w
    keeps keys with |i - j| < w inside each sequence (transformers' masks: ``kv > q - w`` causal,
    ``|q - kv| <= config.sliding_window = w - 1`` bidirectional, as ModernBERT passes it). Runs varlen."""
    from multihead.varlen import attention_varlen

    name = type(module).__name__
    cu_q = cu_k if cu_q is None else cu_q
    cu_k = cu_q if cu_k is None else cu_k
    extra = {"position_bias": position_bias, "softcap": softcap, "s_aux": s_aux}
    extra = [k for k, v in extra.items() if v is not None]
    if extra or output_attentions or hooks.observers:
        what = ", ".join(extra) or "recording the weights (output_attentions or capture)"
        raise ValueError(f"{name}: packed sequences (cu_seq_lens_q/k) with {what} are not computed varlen; pass a "
                         "padded batch instead.")
    if query.shape[0] != 1:
        raise ValueError(f"{name}: cu_seq_lens_q/k describe packed rows of batch 1; got query {tuple(query.shape)}.")
    for nm, cu, n, mx in (("q", cu_q, query.shape[2], max_q), ("k", cu_k, key.shape[2], max_k)):
        if int(cu[-1]) != n:
            raise ValueError(f"{name}: cu_seq_lens_{nm}[-1] = {int(cu[-1])} but the packed row holds {n} tokens.")
        if mx is not None and int(mx) != int((cu[1:] - cu[:-1]).max()):
            raise ValueError(f"{name}: max_length_{nm}={int(mx)} but the longest sequence in cu_seq_lens_{nm} has "
                             f"{int((cu[1:] - cu[:-1]).max())} tokens.")
    causal = is_causal if is_causal is not None else bool(getattr(module, "is_causal", True))
    if causal and not torch.equal(cu_q.cpu(), cu_k.cpu()):
        raise ValueError(f"{name}: causal packed sequences with different query and key boundaries (cu_seq_lens_q "
                         f"{cu_q.tolist()}, cu_seq_lens_k {cu_k.tolist()}): the causal alignment would be a guess.")
    q = query[0].transpose(0, 1)  # (1, H, N, D) -> (N, H, D)
    k, v = key[0].transpose(0, 1), value[0].transpose(0, 1)  # (1, Hkv, N, d) -> (N, Hkv, d)
    mask = masks.Causal() if causal else None
    if sliding_window is not None:  # transformers' window w (its flash path's (w-1, w-1)): |i - j| < w, causal or not
        mask = masks.SlidingWindow(int(sliding_window) - 1, 0 if causal else int(sliding_window) - 1)
    out = attention_varlen(q, k, v, cu_q, cu_k, mask, scale=scaling, dropout_p=dropout)  # (N, H, Dv)
    out = out[None]  # (N, H, Dv) -> (1, N, H, Dv)
    if hooks.transforms:
        out = hooks.transform(module, out, None)
    return out.contiguous(), None


AttentionInterface.register(NAME, attention_forward)
AttentionMaskInterface.register(NAME, sdpa_mask)  # the boolean masks sdpa gets: padding is never dropped


def _model_file_calls_interface(cls: type) -> bool:
    """Whether the modeling file of ``cls`` (or of a class it derives from) calls the attention
    interface at all: a model built from one that does not (Falcon, GPT-J, DeBERTa-v2) never reaches it."""
    known = _FILES.get(cls)
    if known is None:
        known = False
        for c in cls.__mro__:
            if c is PreTrainedModel or not issubclass(c, PreTrainedModel):
                continue  # the model's own classes only (the mixins live in modeling_utils)
            try:
                src = inspect.getsource(inspect.getmodule(c))
            except (OSError, TypeError):
                continue
            if "ALL_ATTENTION_FUNCTIONS" in src and "get_interface" in src:
                known = True
                break
        _FILES[cls] = known
    return known


_FILES: dict[type, bool] = {}


def _guard_construction() -> None:
    """A model whose attention never goes through the interface, built with
    ``attn_implementation="multihead"`` (``from_pretrained`` or a config), gets one clear ValueError
    before its layers are built, not a KeyError from inside them. The guard wraps transformers'
    ``PreTrainedModel.get_correct_attn_implementation`` and acts only on a request for "multihead"."""
    orig = PreTrainedModel.get_correct_attn_implementation
    if getattr(orig, "_multihead_guard", False):
        return

    def guarded(self, requested_attention, is_init_check=False):
        if requested_attention == NAME and not _model_file_calls_interface(type(self)) and \
                not getattr(self.config, "sub_configs", None):  # a composite model: its parts decide
            raise ValueError(f"{type(self).__name__}: its attention does not go through transformers' attention "
                             "interface (ALL_ATTENTION_FUNCTIONS), so attn_implementation='multihead' cannot reach "
                             "it; multihead can neither see nor replace its attention. Load it with "
                             "attn_implementation='sdpa' (or 'eager'), or use multihead's own modules.")
        return orig(self, requested_attention, is_init_check)

    guarded._multihead_guard = True
    PreTrainedModel.get_correct_attn_implementation = guarded


_guard_construction()


def _calls_interface(cls: type) -> bool:
    """Whether a module class's forward calls transformers' attention interface (read from its source,
    as transformers itself decides whether a model can switch implementation)."""
    known = _CALLS.get(cls)
    if known is None:
        fwd = next((c.__dict__["forward"] for c in cls.__mro__ if "forward" in c.__dict__), None)
        try:
            src = inspect.getsource(fwd) if fwd is not None else ""
        except (OSError, TypeError):
            src = ""
        known = _CALLS[cls] = "ALL_ATTENTION_FUNCTIONS" in src and "get_interface" in src
    return known


_CALLS: dict[type, bool] = {}


def _head_count(m: nn.Module) -> int | None:
    """H of an attention module before any call: its own attribute, else its config's."""
    for a in ("num_heads", "num_attention_heads", "n_heads", "n_head"):
        if isinstance(m.__dict__.get(a), int):
            return m.__dict__[a]
    cfg = getattr(m, "config", None)
    n = getattr(cfg, "num_attention_heads", None)
    return n if isinstance(n, int) else None


def _discover(model: nn.Module) -> None:
    """Give a hook list to every module of a transformers model running multihead's attention that
    calls the attention interface (what ``capture`` and ``heads`` look for)."""
    if not isinstance(model, PreTrainedModel) or model.config._attn_implementation != NAME:
        return
    for m in model.modules():
        if "attention_hooks" not in m.__dict__ and _calls_interface(type(m)):
            hooks = AttentionHooks()
            hooks.num_heads = _head_count(m)
            m.__dict__["attention_hooks"] = hooks


hooks_mod.DISCOVERERS.append(_discover)


# --- head layouts: which weights hold head h, per family ---


@dataclass
class HeadLayout:
    """One attention module's head surgery: the names of its q/k/v/o projections (one fused
    qkv projection when ``fused``), where the output projection lives (``o_from_parent``: a
    path from the attention module's parent, for BERT's ``output.dense``), its per-head
    parameters (shape (H,): gpt-oss' sinks), and which attributes hold the head count and
    inner size. Derived from the module and verified on a recorded call (:func:`derive`)."""

    family: str
    q: str
    k: str
    v: str
    o: str
    o_from_parent: bool = False
    #: False: separate q/k/v; "blocks": one projection [Q | K | V] (GPT-2's Conv1D, Phi-3's qkv_proj,
    #: ModernBERT's Wqkv); "interleaved": per head [q_h k_h v_h] (GPT-NeoX's query_key_value)
    fused: bool | str = False
    #: whether the family's forward works with zero heads; if not, pruning every head keeps one
    #: head whose output-projection columns are zero (it contributes nothing: the output is the bias)
    zero_heads_ok: bool = True
    count_attrs: tuple[str, ...] = ("num_heads", "num_attention_heads", "n_heads")
    size_attrs: tuple[str, ...] = ("all_head_size", "inner_dim", "split_size")
    per_head: tuple[str, ...] = ()  # parameters of shape (H,), one entry per query head
    head_size: int | None = None  # D, for a module with no head-size attribute

    def head_dim(self, m: nn.Module) -> int:
        for a in ("head_dim", "attention_head_size", "key_value_proj_dim", "head_size"):
            if isinstance(m.__dict__.get(a), int):
                return m.__dict__[a]
        if self.head_size is not None:
            return self.head_size
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
            total = _out_features(q) // D  # H + 2 Hkv
            g = m.__dict__.get("num_key_value_groups")
            g = g if isinstance(g, int) and g > 0 and self.fused == "blocks" else 1  # H = g Hkv
            H = total * g // (g + 2)
            return H, H // g
        return _out_features(q) // D, _out_features(k) // D


def _out_features(p: nn.Module) -> int:
    return p.weight.shape[1] if _is_conv1d(p) else p.weight.shape[0]


def _is_conv1d(p: nn.Module) -> bool:
    return type(p).__name__ == "Conv1D"  # transformers' Conv1D: weight (in, out), y = x W + b


def attention_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Every attention module of a transformers model running multihead's attention: the modules
    whose forward calls transformers' attention interface, by qualified name, in order."""
    _discover(model)
    return {n: m for n, m in model.named_modules() if isinstance(m.__dict__.get("attention_hooks"), AttentionHooks)}


def _refusal(model: nn.Module) -> str:
    attn = sorted({type(m).__name__ for m in model.modules() if "Attention" in type(m).__name__})
    return (f"{type(model).__name__}: none of its modules calls transformers' attention interface "
            f"(ALL_ATTENTION_FUNCTIONS){'; ' + ', '.join(attn) + ' compute attention themselves' if attn else ''}, "
            "so multihead can neither see nor replace its attention. Use multihead's own modules, or keep "
            "attn_implementation='sdpa' for this model.")


def attach(model: nn.Module, *, example: dict | None = None, packed: bool = False) -> nn.Module:
    """Switch a loaded transformers model to multihead's attention. Every module that calls
    transformers' attention interface gets its hook list (``capture``, ``heads.gated``,
    ``heads.importance`` work on it) and, where one derives and verifies (:func:`derive`), its
    head layout (which ``heads.prune`` uses). ``example``: the model's keyword inputs for the
    one probe call the derivation records (default: made from the config).

    ``packed=True``: a padded batch runs padding-free inside the layer stack (unpadded once after
    the embeddings, every layer on the real tokens only, padded back after the last layer; see
    :mod:`multihead.hf_packed`), verified on a padded probe batch first; a model whose layers are
    not per-token outside attention is refused, naming the module. Returns the model."""
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"attach takes a transformers PreTrainedModel; got {type(model).__name__}. For torch.nn "
                        "models use multihead.interop.patch.")
    if not any(_calls_interface(type(m)) for m in model.modules()):
        raise ValueError(_refusal(model))
    model.set_attn_implementation(NAME)
    if model.config._attn_implementation != NAME:
        raise ValueError(_refusal(model))
    parents = dict(model.named_modules())
    for name, m in attention_modules(model).items():
        m.attention_hooks.parent = parents[name.rsplit(".", 1)[0]] if "." in name else model
    derive(model, example)
    if packed:
        from multihead import hf_packed

        hf_packed.enable(model, attention_modules(model), example if example is not None else _probe_inputs(model))
    return model


# --- head layouts, derived from the module and verified on a recorded call ---


def _probe_inputs(model: nn.Module) -> dict:
    """The smallest inputs the model's forward takes, from its config: token ids, pixels, audio
    features, decoder ids (one sequence each)."""
    cfg = model.config
    params = inspect.signature(model.forward).parameters
    g = torch.Generator().manual_seed(0)
    dev = next(model.parameters()).device
    x = {}
    text = cfg.get_text_config(decoder=False) if hasattr(cfg, "get_text_config") else cfg
    vocab = getattr(text, "vocab_size", None) or getattr(cfg, "vocab_size", None)
    if "input_ids" in params and vocab:
        x["input_ids"] = torch.randint(1, max(2, min(vocab, 1000)), (1, 6), generator=g)
    if "pixel_values" in params:
        vc = getattr(cfg, "vision_config", None) or cfg
        size = getattr(vc, "image_size", 224)
        hw = tuple(size) if isinstance(size, list | tuple) else (size, size)
        x["pixel_values"] = torch.randn(1, getattr(vc, "num_channels", 3), *hw, generator=g)
    if "input_features" in params and hasattr(cfg, "num_mel_bins"):
        x["input_features"] = torch.randn(1, cfg.num_mel_bins, 2 * cfg.max_source_positions, generator=g)
    if getattr(cfg, "is_encoder_decoder", False) and "decoder_input_ids" in params and vocab:
        x["decoder_input_ids"] = torch.randint(1, max(2, min(vocab, 1000)), (1, 4), generator=g)
    if "use_cache" in params:
        x["use_cache"] = False
    return {k: v.to(dev) if isinstance(v, Tensor) else v for k, v in x.items()}


def _inside(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _candidates(m: nn.Module, name: str, parent: nn.Module, parent_name: str, H: int, Hkv: int, D: int,
                Dv: int) -> list[HeadLayout] | str:
    """The head layouts m's projections allow (names by role, sizes by the recorded call), or why none."""
    from multihead.locate import role_of

    lin = {n: c for n, c in m.named_children() if isinstance(c, nn.Linear) or _is_conv1d(c)}
    roles: dict[str, list[str]] = {}
    for n in lin:
        roles.setdefault(role_of(n), []).append(n)
    o_name, from_parent = (roles.get("o") or roles.get("o?") or [None])[-1], False
    if o_name is not None and (_in_features(lin[o_name]) != H * Dv):
        o_name = None
    if o_name is None:  # BERT: the output projection is the parent's (output.dense)
        own = name[len(parent_name) + 1:] if parent_name else name
        for n, c in parent.named_modules():
            if n and not _inside(n, own) and (isinstance(c, nn.Linear) or _is_conv1d(c)) and \
                    role_of(n) in ("o", "o?") and _in_features(c) == H * Dv:
                o_name, from_parent = n, True
                break
    if o_name is None:
        return f"no output projection taking the {H} heads' {H * Dv} features among {sorted(lin) or 'no layers'}"
    per_head = tuple(n for n, p in m.named_parameters(recurse=False) if p.dim() == 1 and p.shape[0] == H)
    q, k, v, qkv = (roles.get(r, [None])[0] for r in ("q", "k", "v", "qkv"))
    if q and k and v:
        sizes = (_out_features(lin[q]), _out_features(lin[k]), _out_features(lin[v]))
        if sizes != (H * D, Hkv * D, Hkv * Dv):
            return f"{q}/{k}/{v} give {sizes} features; the call has H={H}, Hkv={Hkv}, D={D}, Dv={Dv}"
        return [HeadLayout("separate q/k/v", q, k, v, o_name, from_parent, per_head=per_head, head_size=D)]
    if qkv:
        out = _out_features(lin[qkv])
        lays = []
        if D == Dv and out == (H + 2 * Hkv) * D:
            lays.append(HeadLayout("fused [Q | K | V]", qkv, qkv, qkv, o_name, from_parent, fused="blocks",
                                   per_head=per_head, head_size=D))
        if D == Dv and H == Hkv and out == 3 * H * D:
            lays.append(HeadLayout("fused per head [q k v]", qkv, qkv, qkv, o_name, from_parent, fused="interleaved",
                                   per_head=per_head, head_size=D))
        return lays or f"{qkv} gives {out} features; the call has H={H}, Hkv={Hkv}, D={D}, Dv={Dv}"
    return f"no query/key/value projections among {sorted(lin) or 'no layers'}"


def _in_features(p: nn.Module) -> int:
    return p.weight.shape[0] if _is_conv1d(p) else p.weight.shape[1]


def _first(out):
    return out[0] if isinstance(out, tuple | list) else out


def _verify(lay: HeadLayout, m: nn.Module, args: tuple, kwargs: dict, H: int, Hkv: int, Dv: int) -> str | None:
    """None if pruning by ``lay`` equals gating on the recorded call (the first group of heads removed,
    and every head); else why not. The module itself is left unchanged (copies are cut)."""
    import copy

    from multihead.heads import _kept

    hooks = m.attention_hooks
    memo = {id(hooks.parent): hooks.parent}  # the parent is shared, never copied

    def run(mod, gate):
        h = None
        if gate is not None:
            h = mod.attention_hooks.add_transform(lambda _m, out, _l: out * gate.to(out)[None, None, :, None])
        try:
            with torch.no_grad():
                a, kw = copy.deepcopy((args, kwargs), memo=dict(memo))
                return _first(mod(*a, **kw))
        finally:
            if h is not None:
                h.remove()

    tries = [list(range(H // Hkv)) if Hkv > 1 else [0]] if H > 1 else []
    for remove in tries:
        keep, kv = _kept(H, Hkv, set(remove))
        gate = torch.ones(H).index_fill(0, torch.tensor(remove), 0.0)
        ref = run(m, gate)
        cp = copy.deepcopy(m, memo=dict(memo))
        try:
            _prune(lay, cp, keep, kv, None, None, with_o=not lay.o_from_parent)
            got = run(cp, None)
        except Exception as e:  # noqa: BLE001 - the family's forward on a cut module
            return f"its forward fails once heads {remove} are cut ({type(e).__name__}: {str(e)[:120]})"
        if lay.o_from_parent:
            ref = ref[..., _rows(keep, Dv)]
        if got.shape != ref.shape or float((got - ref).abs().max()) > 1e-4 * (float(ref.abs().max()) + 1e-6):
            return (f"cutting heads {remove} does not equal gating them (the rows it assigns to a head are not "
                    "that head's)")
    cp = copy.deepcopy(m, memo=dict(memo))
    lay.zero_heads_ok = False
    try:
        lay.zero_heads_ok = True
        _prune(lay, cp, [], [], None, None, with_o=not lay.o_from_parent)
        got = run(cp, None)
        lay.zero_heads_ok = bool(torch.isfinite(got).all())
    except Exception:  # noqa: BLE001 - the family cannot run without heads: keep one null head
        lay.zero_heads_ok = False
    return None


def derive(model: nn.Module, example: dict | None = None) -> dict[str, str]:
    """Derive and verify every attention module's head layout on one recorded call of the model
    (``example``: its keyword inputs; default from the config). Returns {module name: the layout,
    or why none}; a module whose layout does not verify gets none (it can be seen and gated, not
    cut)."""
    import copy

    mods = attention_modules(model)
    calls, handles = {}, []

    def record(name):
        def pre(mod, args, kwargs):
            if name not in calls:
                try:
                    calls[name] = copy.deepcopy((args, kwargs))
                except Exception:  # noqa: BLE001 - an argument that does not copy: used as it is
                    calls[name] = (args, kwargs)
        return pre

    for name, m in mods.items():
        m.attention_hooks.seen = None
        handles.append(m.register_forward_pre_hook(record(name), with_kwargs=True))
    was = model.training
    model.eval()
    why = None
    try:
        x = example if example is not None else _probe_inputs(model)
        with torch.no_grad():
            model(**x)
    except Exception as e:  # noqa: BLE001 - the probe: say why, do not fail attach
        why = f"the probe call raised {type(e).__name__}: {str(e)[:160]}; pass example= (the model's inputs) to attach"
    finally:
        for h in handles:
            h.remove()
    out = {}
    names = dict(model.named_modules())
    rev = {id(mod): n for n, mod in names.items()}
    for name, m in mods.items():
        hooks = m.attention_hooks
        hooks.layout = None
        if name not in calls or hooks.seen is None:
            hooks.layout_reason = why or "the probe call did not reach it"
        else:
            H, Hkv, D, Dv = hooks.seen
            parent = hooks.parent
            lays = _candidates(m, name, parent, rev.get(id(parent), ""), H, Hkv, D, Dv)
            reasons = []
            for lay in [] if isinstance(lays, str) else lays:
                r = _verify(lay, m, *calls[name], H, Hkv, Dv)
                if r is None:
                    hooks.layout, hooks.num_heads, hooks.layout_reason = lay, H, None
                    break
                reasons.append(f"{lay.family}: {r}")
            if hooks.layout is None:
                hooks.layout_reason = lays if isinstance(lays, str) else "; ".join(reasons)
        out[name] = (f"{hooks.layout.family} (q={hooks.layout.q}, o={hooks.layout.o})" if hooks.layout
                     else f"no layout: {hooks.layout_reason}")
    model.train(was)
    return out


def explain(model: nn.Module) -> str:
    """Per attention module: its class (the family), H / Hkv / D from its last call, the head layout
    ``heads.prune`` uses (or why there is none), and the arguments transformers passed that
    multihead computes (scaling, softcap, sinks, sliding window, position bias, packed rows, ...)."""
    mods = attention_modules(model)
    if not mods:
        return _refusal(model)
    lines = [f"{type(model).__name__}: {len(mods)} attention modules on multihead"]
    for name, m in mods.items():
        hooks = m.attention_hooks
        seen = hooks.seen
        heads = f"H={seen[0]} Hkv={seen[1]} D={seen[2]}" + (f" Dv={seen[3]}" if seen[3] != seen[2] else "") if seen \
            else f"H={hooks.num_heads} (not called yet)"
        lay = hooks.layout
        if lay is not None:
            where = f"{'parent.' if lay.o_from_parent else ''}{lay.o}"
            cut = f"layout: {lay.family} (q={lay.q}" + ("" if lay.fused else f", k={lay.k}, v={lay.v}") + \
                f", o={where}" + (f", per head: {', '.join(lay.per_head)}" if lay.per_head else "") + \
                ("" if lay.zero_heads_ok else "; keeps one null head when all are cut") + ")"
            if hooks.kept is not None:
                cut += f"; kept heads {hooks.kept}"
        else:
            cut = f"no layout (seen and gated, not cut): {hooks.layout_reason or 'call multihead.hf.attach(model)'}"
        args = getattr(hooks, "args", None)
        if args is None:
            got = "no call recorded"
        else:
            scaling, dropout, is_causal, softcap, sinks, window, bias, packed, mask = args
            parts = [f"scaling={scaling:.4g}" if scaling is not None else "scaling=1/sqrt(D)"]
            parts += ["causal"] * bool(is_causal) + ["mask"] * bool(mask)
            parts += [f"dropout={dropout:g}"] if dropout else []
            parts += [f"softcap={softcap:g}"] if softcap is not None else []
            parts += ["sinks (H,)"] * bool(sinks)
            parts += [f"sliding_window={window}"] if window is not None else []
            parts += ["position_bias"] * bool(bias) + ["packed rows (varlen)"] * bool(packed)
            got = ", ".join(parts)
        lines += [f"- {name} ({type(m).__name__}): {heads}", f"    {cut}", f"    computes: {got}"]
    return "\n".join(lines)


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
        new = linear(wt.shape[1], wt.shape[0], b is not None, device=w.device, dtype=w.dtype)
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
           gone: list[int] | None, *, with_o: bool = True) -> None:
    hooks = m.__dict__["attention_hooks"]
    parent = hooks.parent
    D = layout.head_dim(m)
    H0, Hkv0 = layout.counts(m, parent)
    q, k, v, o = layout.projections(m, parent)
    null = not keep and not layout.zero_heads_ok
    if null:  # keep one head that contributes nothing (its output-projection columns are zeroed below)
        keep, kv = [0], [0]
    with torch.no_grad():
        if layout.fused == "interleaved":  # per head [q_h | k_h | v_h], 3 D rows each (H = Hkv)
            _set(m, layout.q, _select(q, out_rows=_rows(keep, 3 * D)))
        elif layout.fused:  # [Q (H D) | K (Hkv D) | V (Hkv D)] along the output
            rows = _rows(keep, D) + [H0 * D + r for r in _rows(kv, D)] + [(H0 + Hkv0) * D + r for r in _rows(kv, D)]
            _set(m, layout.q, _select(q, out_rows=rows))
        else:
            _set(m, layout.q, _select(q, out_rows=_rows(keep, D)))
            _set(m, layout.k, _select(k, out_rows=_rows(kv, D)))
            _set(m, layout.v, _select(v, out_rows=_rows(kv, D)))
        for name in layout.per_head:  # (H,) -> (len(keep),)
            owner, _, leaf = name.rpartition(".")
            holder = m.get_submodule(owner) if owner else m
            p = getattr(holder, leaf)
            setattr(holder, leaf, nn.Parameter(p.detach()[keep].clone(), requires_grad=p.requires_grad))
        if with_o:
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
    before = hooks.kept if hooks.kept is not None else list(range(H0))
    hooks.kept = [before[i] for i in keep]  # the original indices: a shared per-head input (T5's bias) is cut to them
    hooks.num_heads = H


# --- saving and loading pruned models ---


def save(model: nn.Module, path: str | Path, *, quantize: str | None = None) -> Path:
    """A transformers-style directory: ``save_pretrained``'s config.json (plus the head counts
    of every attention module, {name: [H, Hkv]}) and model.safetensors holding the model's own
    parameter names (tied weights stored once), so that :func:`load` rebuilds the pruned model.

    ``quantize="int8"``: :func:`load` returns the model quantized (:func:`multihead.quantize.quantize`
    of the float weights saved here, the same conversion as in memory, so the same outputs). A
    padding-free model (``attach(packed=True)``) is rebuilt padding-free."""
    from safetensors.torch import save_model

    from multihead import hf_packed
    from multihead.quantize import check_dtype, is_quantized

    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"save takes a transformers PreTrainedModel; got {type(model).__name__}.")
    if is_quantized(model):
        raise ValueError("save takes the float model: save(model, path, quantize='int8') and load() quantizes it "
                         "(the int8 conversion is deterministic, so the loaded model equals quantize(model)).")
    if quantize is not None:
        check_dtype(quantize)
    path = Path(path)
    model.save_pretrained(path)
    for f in path.glob("model*.safetensors*"):  # transformers' (possibly sharded, renamed) weights
        f.unlink()
    save_model(model, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    mods = attention_modules(model).items()
    cfg[HEADS_KEY] = {name: list(m.attention_hooks.layout.counts(m, m.attention_hooks.parent))
                      for name, m in mods if m.attention_hooks.layout is not None}
    cfg[KEPT_KEY] = {name: m.attention_hooks.kept for name, m in mods if m.attention_hooks.kept is not None}
    cfg[PACKED_KEY] = hf_packed.is_packed(model)
    cfg[QUANTIZE_KEY] = quantize
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path


def load(path: str | Path, *, model_class: Callable | None = None) -> nn.Module:
    """Rebuild a model written by :func:`save` (pruned or not) from its directory: the model is
    built from config.json, its attention modules resized to the recorded head counts, the
    weights loaded (strictly); returned attached, in eval mode, padding-free and quantized when
    it was saved so."""
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
        layout = m.attention_hooks.layout
        if layout is None:
            raise ValueError(f"{cfg_file} records heads for {name!r}, whose head layout multihead cannot derive: "
                             f"{m.attention_hooks.layout_reason}.")
        H0, Hkv0 = layout.counts(m, m.attention_hooks.parent)
        if (H, Hkv) != (H0, Hkv0):  # sizes only (the weights are loaded next); uneven GQA groups may hold Hkv > Hkv0
            layout.prune(m, list(range(H)), [i % Hkv0 for i in range(Hkv)])
    for name, kept in raw.get(KEPT_KEY, {}).items():
        if name in mods:
            mods[name].attention_hooks.kept = [int(h) for h in kept]
    from safetensors import safe_open

    with safe_open(str(w_file), "pt") as f:
        keys = set(f.keys())
    for name, m in mods.items():  # a mean-compensated prune gave a bias-free output projection a bias
        layout = m.attention_hooks.layout
        if layout is None:
            continue
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
    model.eval()
    if raw.get(PACKED_KEY):
        from multihead import hf_packed

        hf_packed.enable(model, attention_modules(model), _probe_inputs(model))
    if raw.get(QUANTIZE_KEY):
        from multihead.quantize import quantize

        model = quantize(model, raw[QUANTIZE_KEY])
    return model


class _TokensToHidden(nn.Module):
    """(input_ids (B, L), attention_mask (B, L)) -> the model's first output (last hidden state or logits)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        out = self.model(input_ids=input_ids, attention_mask=attention_mask)
        return out[0]  # (B, L, E) or (B, L, vocab)


def export_onnx(model: nn.Module, path: str | Path, *, example: dict | None = None) -> Path:
    """Write ``model`` (pruned or not) as an ONNX file taking ``input_ids`` and ``attention_mask``
    (B, L), both sizes dynamic (L up to the config's ``max_position_embeddings``), and giving its
    first output (``last_hidden_state`` or ``logits``). Uses ``torch.onnx.export`` (the ``onnx``
    extra). A padding-free model is exported padded (the same outputs on real tokens; ONNX gets
    one static graph). Refused with a clear error: a quantized model (export the float one and
    quantize in ONNX Runtime), a model whose forward takes no ``attention_mask``, a decoder whose
    call would make a cache, and masks other than a (B, L) 0/1 padding mask in ``example``."""
    from multihead import hf_packed
    from multihead.extras import require
    from multihead.quantize import is_quantized

    require("onnxscript", "multihead.hf.export_onnx")
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"export_onnx takes a transformers PreTrainedModel; got {type(model).__name__}.")
    if is_quantized(model):
        raise ValueError("export_onnx: the model is quantized (PyTorch's dynamic int8 kernels have no ONNX form); "
                         "export the float model and quantize the ONNX file with onnxruntime.quantization.")
    if "attention_mask" not in inspect.signature(model.forward).parameters:
        raise ValueError(f"export_onnx: {type(model).__name__}.forward takes no attention_mask; the exported graph's "
                         "inputs are input_ids and attention_mask (B, L).")
    x = example if example is not None else _probe_inputs(model)
    ids = x.get("input_ids")
    if not isinstance(ids, Tensor) or ids.dim() != 2:
        raise ValueError("export_onnx: example must hold input_ids (B, L).")
    am = x.get("attention_mask", torch.ones_like(ids))
    if not isinstance(am, Tensor) or am.shape != ids.shape or not bool(((am == 0) | (am == 1)).all()):
        got = tuple(am.shape) if isinstance(am, Tensor) else type(am).__name__
        raise ValueError(f"export_onnx: attention_mask must be a (B, L) padding mask of 0 and 1 like input_ids "
                         f"{tuple(ids.shape)}; got {got}. Other mask forms (4-D, float biases) are not exported.")
    if ids.shape[1] < 2:  # a length of 1 would be specialised as a constant
        ids, am = ids.repeat(1, 2), am.repeat(1, 2)
    if ids.shape[0] < 2:
        ids, am = ids.repeat(2, 1), am.repeat(2, 1)
    if getattr(model.config, "use_cache", False) and any(getattr(m, "is_causal", False)
                                                        for m in attention_modules(model).values()):
        raise ValueError("export_onnx: a decoder would make a key/value cache; set model.config.use_cache = False "
                         "to export the one-pass graph.")
    packing = model.__dict__.get(hf_packed.KEY)
    was, model_training = (packing.enabled if packing is not None else None), model.training
    if packing is not None:
        packing.enabled = False  # ONNX gets the padded graph: no data-dependent shapes
    model.eval()
    try:
        L_max = int(getattr(model.config, "max_position_embeddings", 4096) or 4096)
        B, L = torch.export.Dim("B"), torch.export.Dim("L", max=L_max)
        import warnings

        with warnings.catch_warnings():  # torch's own exporter deprecations, not the user's to act on
            warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
            warnings.filterwarnings("ignore", message=r"# The axis name: \w+ will not be used")  # B, L shared
            torch.onnx.export(_TokensToHidden(model).eval(), (ids, am), str(path), dynamo=True,
                              input_names=["input_ids", "attention_mask"], output_names=["output"],
                              dynamic_shapes={"input_ids": {0: B, 1: L}, "attention_mask": {0: B, 1: L}},
                              verbose=False)
    finally:
        if packing is not None:
            packing.enabled = was
        model.train(model_training)
    return Path(path)
