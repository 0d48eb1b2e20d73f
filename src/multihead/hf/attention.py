"""transformers' attention, computed by multihead: the attention function and mask function
registered as ``"multihead"`` (importing :mod:`multihead.hf` imports this), and the discovery of
the modules that call transformers' attention interface (each gets its hook list).

Importing this module registers ``"multihead"`` through transformers' public extension
points: :class:`transformers.AttentionInterface` (the attention function) and
``transformers.masking_utils.AttentionMaskInterface`` (its mask function; without it a
custom implementation silently receives no padding mask). Every attention call then
goes through :func:`multihead.attention` (backends, ``explain``, a row with nothing to
attend to gives zeros), with the module's hook list around it, so ``capture``,
``heads.gated``, ``heads.importance`` and ``heads.mean_head_outputs`` work on the
model unchanged.

With :mod:`multihead.hf.layouts` and :mod:`multihead.hf.packed`, the only files of the package
that import transformers. Dependency order: hf_attention -> hf_heads -> hf.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import re
from typing import NamedTuple

import torch
from torch import Tensor, nn

from multihead import masks
from multihead.core.functional import attention, weights_of
from multihead.layer import hooks as hooks_mod
from multihead.layer.hooks import AttentionHooks, Seen

__all__ = ["ATTENTION_ARGUMENTS", "DECLARATIONS", "EAGER_MASKS", "NAME", "NAMES", "NOT_ATTENTION", "REFUSED", "SUPPORTED",
           "UNDECLARED", "Computed", "PackedRows", "attention_forward", "attention_modules", "calls_interface", "discover",
           "loading", "refusal"]

#: the transformers versions this integration is tested with (the ``hf`` extra pins them)
SUPPORTED = (5, 6)  # >= 5.0, < 6
NAME = "multihead"
#: the same attention function with the float masks eager attention gets, for the families whose
#: modules were written for them (``_supports_sdpa = False``: a module may add the mask to its own
#: scores, or leave causality to a mask sdpa's mask function would drop); chosen from the class
EAGER_MASKS = "multihead_eager_masks"
NAMES = (NAME, EAGER_MASKS)


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
from transformers.loss.loss_utils import LOSS_MAPPING  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask  # noqa: E402
from transformers.modeling_flash_attention_utils import FlashAttentionKwargs  # noqa: E402
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: E402
from transformers.utils.generic import TransformersKwargs  # noqa: E402

#: the typed keyword dictionaries transformers' models forward to their layers, and on to every attention call
#: (``**kwargs: Unpack[TransformersKwargs]``; ``FlashAttentionKwargs`` in the attention modules of older files)
DECLARATIONS = (TransformersKwargs, FlashAttentionKwargs)


def _attention_arguments() -> dict[str, str]:
    """Every keyword one of transformers' own attention functions names (``ALL_ATTENTION_FUNCTIONS``: sdpa,
    flash, flex, paged; multihead's excepted) -> the first function naming it: what transformers itself treats as
    an argument of attention."""
    found: dict[str, str] = {}
    for name in ALL_ATTENTION_FUNCTIONS.valid_keys():
        fn = ALL_ATTENTION_FUNCTIONS[name]
        if fn is attention_forward:
            continue
        for p in list(inspect.signature(fn).parameters.values())[5:]:  # past (module, query, key, value, mask)
            if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
                found.setdefault(p.name, f"{fn.__module__}.{fn.__qualname__}")
    return found


def _described(td: type) -> dict[str, str]:
    """A typed dictionary's fields -> the line its docstring gives each (``name (`type`): text``)."""
    doc = inspect.getdoc(td) or ""
    lines = {m.group(1): m.group(2).strip() for m in re.finditer(r"^\s*(\w+) \(.*\n\s*(\S.*)$", doc, re.M)}
    return {k: lines.get(k, "") for k in td.__required_keys__ | td.__optional_keys__}


def _declared() -> dict[str, str]:
    """Every keyword transformers declares as one a model forwards -> where and what: the fields of
    :data:`DECLARATIONS`, and the optional parameters of the loss functions its heads call (``LOSS_MAPPING``:
    ``model(ids, labels=..., shift_labels=..., ignore_index=...)`` hands the head's keywords to the loss and to
    the model below it, whose layers forward them to every attention call)."""
    found: dict[str, str] = {}
    for td in DECLARATIONS:
        for k, text in sorted(_described(td).items()):
            found.setdefault(k, f"declared in {td.__name__}" + (f" ({text.rstrip('.')})" if text else ""))
    losses: dict[str, list[str]] = {}
    for fn in dict.fromkeys(LOSS_MAPPING.values()):  # each function once, in the table's order
        for p in inspect.signature(fn).parameters.values():
            if p.default is not p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
                losses.setdefault(p.name, []).append(fn.__name__)
    for k, fns in losses.items():
        found.setdefault(k, f"an optional parameter of transformers' loss functions ({', '.join(sorted(fns))}), "
                            "read by the head after the model ran")
    return found


#: keywords transformers passes to attention without declaring them in :data:`DECLARATIONS` (the only hand-written
#: entries: ``tests/test_hf_families.py`` fails when transformers declares one, or stops passing it)
UNDECLARED = {
    "use_cache": "passed by decoder layers to their attention module; the model's cache is updated before the call, "
                 "the keys and values arrive complete",
    "deterministic": "ModernBERT's flash-attention backward flag; multihead's forward is deterministic",
}

#: keywords that reach the attention function and do not change what it computes, each with why (filled at import
#: by :func:`_not_attention`, from the installed transformers)
NOT_ATTENTION: dict[str, str] = {}
#: keywords transformers' own attention functions name as arguments -> the function (:func:`_attention_arguments`)
ATTENTION_ARGUMENTS: dict[str, str] = {}


#: keywords some families pass by name that multihead does not compute, each refused with its reason (any other
#: keyword outside multihead's signature and :data:`NOT_ATTENTION` is refused too, without one); never passed
#: through, even where transformers declares the name
REFUSED = {
    "indices": "sparse top-k attention (a learned indexer picks the keys)",
    "block_indices": "block-sparse attention",
    "sinks": "a second sink convention (s_aux is gpt-oss'); not verified to mean the same",
    "query": "a model that hands its own query/key/value a second time by keyword",
    "key": "a model that hands its own query/key/value a second time by keyword",
    "value": "a model that hands its own query/key/value a second time by keyword",
    "cache": "transformers' paged cache (continuous batching)",
}


def _module_causal(module: nn.Module, is_causal: bool | None) -> bool:
    """Whether a call is causal, as transformers' sdpa decides: the argument, else the module's
    ``is_causal`` attribute, else True."""
    return is_causal if is_causal is not None else bool(getattr(module, "is_causal", True))


def _causal(module: nn.Module, is_causal: bool | None, attention_mask, Lq: int) -> bool:
    """A padded call applies causality itself only when there is no mask and more than one query (a
    mask, when given, already holds causality)."""
    return Lq > 1 and attention_mask is None and _module_causal(module, is_causal)


class Computed(NamedTuple):
    """What multihead computed in a module's last attention call (``attention_hooks.args``, which
    :func:`multihead.hf.explain` prints)."""

    scaling: float | None
    dropout: float
    causal: bool
    softcap: float | None
    sinks: bool  # gpt-oss' s_aux
    sliding_window: int | None
    position_bias: bool  # T5's
    packed: bool  # packed rows (cu_seq_lens_q/k), run varlen
    mask: bool  # an attention mask was given


def _refuse(module: nn.Module, kwargs: dict) -> None:
    unknown = sorted(k for k, v in kwargs.items() if k not in NOT_ATTENTION and v is not None)
    if unknown:
        why = "; ".join(f"{k}: {REFUSED[k]}" for k in unknown if k in REFUSED)
        raise TypeError(f"{type(module).__name__} passes {', '.join(repr(k) for k in unknown)} to its attention "
                        + (f"function ({why}); " if why else "function; ") + "multihead does not compute "
                        f"{'these arguments' if len(unknown) > 1 else 'this argument'} and will not ignore "
                        f"{'them' if len(unknown) > 1 else 'it'}. Load the model with attn_implementation='sdpa' "
                        "or 'eager' for this family.")


def _check_masks(module: nn.Module, attention_mask) -> None:
    """A module of a class written for eager's float masks, built with attn_implementation="multihead"
    outside :func:`loading`, got sdpa's masks (boolean, or none where causality was left to the mask):
    refused at its first call, before anything is computed."""
    impl = getattr(getattr(module, "config", None), "_attn_implementation", None)
    sdpa_masks = impl == NAME or impl is None and attention_mask is not None and attention_mask.dtype == torch.bool
    if sdpa_masks and _written_for_eager_masks(module):
        raise ValueError(f"{type(module).__name__}: its model class does not support sdpa, so its modules expect "
                         "eager's float masks, and attn_implementation='multihead' gave it sdpa's (set by hand, past "
                         "the name's resolution). Load it with multihead.hf.attach(model), or build it with "
                         "attn_implementation='multihead', which give each class the masks it was written for.")


def _live(mask: Tensor | None, Lq: int, Lk: int) -> Tensor | None:
    """(B, Lq) True = a real query row, for head statistics: with self-attention over one sequence
    (Lq == Lk), row i is padding when key i may be seen by no row; otherwise a row with nothing to
    attend to. None: every row is real."""
    if mask is None:
        return None
    keep = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2  # (B|1, H|1, Lq|1, Lk)
    keep = keep.expand(keep.shape[0], keep.shape[1], Lq, Lk).any(1)  # (B|1, Lq, Lk)
    live = keep.any(1) if Lq == Lk else keep.any(-1)  # (B|1, Lq)
    return None if live.device.type == "meta" or bool(live.all()) else live


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
    hooks = _hooks_for(module, query, key, value, attention_mask)
    B, H, Lq, _ = query.shape
    if H == 0:  # every head pruned: nothing to attend; the output projection gives its bias
        return query.new_zeros(B, Lq, 0, value.shape[-1]), None
    if position_bias is not None and hooks.kept is not None and position_bias.shape[1] != H:
        position_bias = position_bias[:, hooks.kept]  # the shared bias (.., H0, Lq, Lk): this layer's kept heads
    packed = cu_seq_lens_q is not None or cu_seq_lens_k is not None
    causal = _module_causal(module, is_causal) if packed else _causal(module, is_causal, attention_mask, Lq)
    hooks.args = call = Computed(scaling, dropout, causal, softcap, s_aux is not None, sliding_window,
                                 position_bias is not None, packed, attention_mask is not None)
    if packed:
        extra = {"position_bias": position_bias, "softcap": softcap, "s_aux": s_aux}
        _packable(module, hooks, [k for k, v in extra.items() if v is not None], output_attentions)
        rows = PackedRows.of(module, query, key, cu_seq_lens_q, cu_seq_lens_k, max_q=max_length_q, max_k=max_length_k)
        return _packed(module, hooks, query, key, value, rows=rows, call=call), None
    return _padded(module, hooks, query, key, value, attention_mask=attention_mask, call=call, position_bias=position_bias,
                   s_aux=s_aux, output_attentions=output_attentions)


def _hooks_for(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask) -> AttentionHooks:
    """The module's hook list (made at its first call when the model was loaded with
    attn_implementation="multihead" and not attached), its head count taken from the call."""
    hooks = module.__dict__.get("attention_hooks")
    if hooks is None:
        _check_masks(module, attention_mask)
        hooks = module.__dict__["attention_hooks"] = AttentionHooks()
    H = query.shape[1]
    hooks.seen = Seen(H, key.shape[1], query.shape[-1], value.shape[-1])
    if hooks.num_heads != H:
        if hooks:  # gates or observers were made for the count read before any call: refuse, never mis-gate
            raise ValueError(f"{type(module).__name__}: multihead read {hooks.num_heads} heads from its attributes or "
                             f"config, but it calls attention with H={H} (query {tuple(query.shape)}); run the model "
                             "once outside heads.gated / capture so the count is taken from the call.")
        hooks.num_heads = H  # the call is the truth
    return hooks


def _padded(module: nn.Module, hooks: AttentionHooks, query: Tensor, key: Tensor, value: Tensor, *, attention_mask,
            call: Computed, position_bias: Tensor | None, s_aux: Tensor | None,
            output_attentions) -> tuple[Tensor, Tensor | None]:
    """A padded call: query (B, H, Lq, D), key (B, Hkv, Lk, D), value (B, Hkv, Lk, Dv)
    -> (out (B, Lq, H, Dv), weights (B, H, Lq, Lk) or None)."""
    Lq, Lk = query.shape[2], key.shape[2]
    if attention_mask is None and call.sliding_window is not None and Lk > call.sliding_window and Lq > 1:
        raise ValueError(f"{type(module).__name__} passes sliding_window={call.sliding_window} with Lk={Lk} keys but "
                         "no attention mask: the window is not in the mask, and its alignment is the model's. Build "
                         "the model's masks with transformers (multihead registers sdpa's mask function).")
    mask = masks.from_sdpa(attention_mask)  # 4-D as transformers builds them; any shape SDPA takes, as sdpa would
    if call.causal:
        if Lk > Lq:  # prefill into an empty static cache: the keys past Lq are not written yet (as sdpa)
            key, value = key[:, :, :Lq], value[:, :, :Lq]
            position_bias = None if position_bias is None else position_bias[..., :Lq]
        mask = masks.Causal()
    if position_bias is not None:
        mask = masks.Dense(position_bias) if mask is None else mask & masks.Dense(position_bias)
    mods = {"softcap": call.softcap, "sinks": None if s_aux is None else s_aux.to(query.dtype)}
    if hooks.inputs:
        query, key, value = hooks.transform_inputs(module, query, key, value)
    if hooks.observers:
        hooks.observe(module, query, key, mask, call.scaling, **{k: v for k, v in mods.items() if v is not None})
    out = attention(query, key, value, mask, scale=call.scaling, dropout_p=call.dropout, **mods)  # (B, H, Lq, Dv)
    out = out.transpose(1, 2)  # (B, H, Lq, Dv) -> (B, Lq, H, Dv)
    if hooks.transforms:
        out = hooks.transform(module, out, _live(attention_mask, Lq, key.shape[2]))
    weights = weights_of(query, key, mask, call.scaling, **mods) if output_attentions else None
    return out.contiguous(), weights


class PackedRows(NamedTuple):
    """transformers' packed-sequence arguments, checked: sequence b is tokens ``cu_q[b]:cu_q[b+1]``
    of the packed row (keys: ``cu_k``), read once as lists."""

    cu_q: Tensor  # (B+1,) int32
    cu_k: Tensor  # (B+1,) int32
    same: bool  # the query and key boundaries are the same

    @classmethod
    def of(cls, module: nn.Module, query: Tensor, key: Tensor, cu_q, cu_k, *, max_q, max_k) -> PackedRows:
        name = type(module).__name__
        if query.shape[0] != 1:
            raise ValueError(f"{name}: cu_seq_lens_q/k describe packed rows of batch 1; got query "
                             f"{tuple(query.shape)}.")
        cu_q = cu_k if cu_q is None else cu_q
        cu_k = cu_q if cu_k is None else cu_k
        cus = {}
        for nm, cu, n, mx in (("q", cu_q, query.shape[2], max_q), ("k", cu_k, key.shape[2], max_k)):
            if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.numel() < 1:
                raise ValueError(f"{name}: cu_seq_lens_{nm} must be a 1-D tensor (B+1,) of cumulative lengths; got "
                                 f"{cu!r}.")
            c = cus[nm] = cu.tolist()  # (B+1,) read once
            if c[-1] != n:
                raise ValueError(f"{name}: cu_seq_lens_{nm}[-1] = {c[-1]} but the packed row holds {n} tokens.")
            longest = max((b - a for a, b in zip(c, c[1:])), default=0)
            if mx is not None and int(mx) != longest:
                raise ValueError(f"{name}: max_length_{nm}={int(mx)} but the longest sequence in cu_seq_lens_{nm} "
                                 f"has {longest} tokens.")
        return cls(cu_q, cu_k, cus["q"] == cus["k"])


def _packable(module: nn.Module, hooks: AttentionHooks, extra: list[str], output_attentions) -> None:
    """Refuse what the packed path does not compute varlen (the call's score modifiers, recording)."""
    if extra or output_attentions or hooks.observers or hooks.inputs:
        what = ", ".join(extra) or ("recording the weights (output_attentions or capture)" if not hooks.inputs else
                                    "an input transform (path patching)")
        raise ValueError(f"{type(module).__name__}: packed sequences (cu_seq_lens_q/k) with {what} are not computed "
                         "varlen; pass a padded batch instead.")


def _packed(module: nn.Module, hooks: AttentionHooks, query: Tensor, key: Tensor, value: Tensor, *, rows: PackedRows,
            call: Computed) -> Tensor:
    """Packed rows (query (1, H, N, D)) with transformers' flash-attention arguments -> (1, N, H, Dv):
    causal within each sequence when the module is; a ``sliding_window`` w keeps keys with
    |i - j| < w inside each sequence (transformers' masks: ``kv > q - w`` causal,
    ``|q - kv| <= config.sliding_window = w - 1`` bidirectional, as ModernBERT passes it). Runs varlen."""
    from multihead.core.varlen import attention_varlen

    if call.causal and not rows.same:
        raise ValueError(f"{type(module).__name__}: causal packed sequences with different query and key boundaries "
                         f"(cu_seq_lens_q {rows.cu_q.tolist()}, cu_seq_lens_k {rows.cu_k.tolist()}): the causal "
                         "alignment would be a guess.")
    q = query[0].transpose(0, 1)  # (1, H, N, D) -> (N, H, D)
    k, v = key[0].transpose(0, 1), value[0].transpose(0, 1)  # (1, Hkv, N, d) -> (N, Hkv, d)
    mask = masks.Causal() if call.causal else None
    w = call.sliding_window
    if w is not None:  # transformers' window w (its flash path's (w-1, w-1)): |i - j| < w, causal or not
        mask = masks.SlidingWindow(int(w) - 1, 0 if call.causal else int(w) - 1)
    out = attention_varlen(q, k, v, rows.cu_q, rows.cu_k, mask, scale=call.scaling, dropout_p=call.dropout)
    out = out[None]  # (N, H, Dv) -> (1, N, H, Dv)
    if hooks.transforms:
        out = hooks.transform(module, out, None)
    return out.contiguous()


def _checked(make_mask):
    """A mask function that first checks, once per configuration class, that the family it builds masks for calls
    the attention interface (its modeling file, read as transformers itself decides): a model switched to multihead
    by hand (``config._attn_implementation = "multihead"``, past the name's resolution) is refused at its first
    call instead of computing by hand with masks it was not written for."""
    @functools.wraps(make_mask)
    def mask(*args, config=None, **kwargs):
        if config is not None and not _family_calls_interface(type(config)):
            raise ValueError(_never_reaches(f"a {getattr(config, 'model_type', type(config).__name__)!r} model"))
        return make_mask(*args, config=config, **kwargs)
    return mask


def _family_calls_interface(cfg: type) -> bool:
    """Whether the modeling file beside configuration class ``cfg``'s file calls the attention interface (True where
    there is none to read: a configuration of the user's own, whose model class was checked when it was built)."""
    known = _FAMILIES.get(cfg)
    if known is None:
        import importlib

        try:
            if ".configuration_" not in cfg.__module__:
                raise ImportError(cfg.__module__)  # a configuration of the user's own: no modeling file beside it
            src = inspect.getsource(importlib.import_module(cfg.__module__.replace(".configuration_", ".modeling_")))
            known = "ALL_ATTENTION_FUNCTIONS" in src and "get_interface" in src
        except (ImportError, OSError, TypeError):
            known = True
        _FAMILIES[cfg] = known
    return known


_FAMILIES: dict[type, bool] = {}

AttentionInterface.register(NAME, attention_forward)
AttentionMaskInterface.register(NAME, _checked(sdpa_mask))  # the boolean masks sdpa gets: padding is never dropped
AttentionInterface.register(EAGER_MASKS, attention_forward)
AttentionMaskInterface.register(EAGER_MASKS, _checked(eager_mask))  # always built, float: what eager-only families expect


def _not_attention() -> dict[str, str]:
    """The keywords that pass through, derived: every keyword transformers declares as one its models forward
    (:func:`_declared`) that none of its own attention functions names as an argument (:func:`_attention_arguments`),
    multihead's does not take and :data:`REFUSED` does not name, then :data:`UNDECLARED`. multihead is registered
    with sdpa's mask function, so such a keyword reaches it as it reaches sdpa, whatever it means for attention
    already in the mask (``position_ids`` of packed rows: the block-diagonal mask transformers builds from them)."""
    arguments = _attention_arguments()
    computed = set(inspect.signature(attention_forward).parameters)
    passing = {k: f"{where}; none of transformers' attention functions takes it" for k, where in _declared().items()
               if k not in computed and k not in arguments and k not in REFUSED}
    return passing | {k: v for k, v in UNDECLARED.items() if k not in passing}


ATTENTION_ARGUMENTS.update(_attention_arguments())
NOT_ATTENTION.update(_not_attention())


def _model_file_calls_interface(cls: type) -> bool:
    """Whether the modeling file of ``cls`` (or of a class it derives from) calls the attention
    interface at all: a model built from one that does not (Falcon, Bloom, DeBERTa-v2) never reaches it."""
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


def _choose(self, requested_attention, *args, **kwargs):
    """``PreTrainedModel.get_correct_attn_implementation`` -- where transformers resolves an implementation's name,
    for every model it builds or switches: a request for multihead gets the masks the class was written for, or a
    refusal when its attention never goes through the interface (Bloom and MPT computed with masks they were not
    written for, silently off; Falcon raised KeyError: 'multihead' from its own table of classes); any other request
    goes to transformers unchanged."""
    if requested_attention not in NAMES:
        return _ORIGINAL(self, requested_attention, *args, **kwargs)
    requested_attention = NAME if getattr(self, "_supports_sdpa", False) else EAGER_MASKS
    if not _model_file_calls_interface(type(self)) and \
            not getattr(self.config, "sub_configs", None):  # a composite model: its parts decide
        raise ValueError(_never_reaches(type(self).__name__))
    if (args[0] if args else kwargs.get("is_init_check", False)) and _picks_by_name(type(self)):
        raise ValueError(f"{type(self).__name__}: its modeling file builds attention classes from a table keyed by "
                         f"implementation name ({_picks_by_name(type(self))}), which has no entry for multihead. "
                         "Build it with attn_implementation='sdpa' (or 'eager'), then multihead.hf.attach(model).")
    return _ORIGINAL(self, requested_attention, *args, **kwargs)


_TABLE = re.compile(r"\b(?!ALL_)(\w+)\[(?:self\.)?config\._attn_implementation\]")  # not transformers' own


def _picks_by_name(cls: type) -> str:
    """The first table of classes keyed by implementation name (``GIT_SELF_ATTENTION_CLASSES[config.
    _attn_implementation]``) in the modeling files of ``cls``, read once per class; '' where there is none."""
    known = _TABLES.get(cls)
    if known is None:
        known = ""
        for c in cls.__mro__:
            if c is PreTrainedModel or not issubclass(c, PreTrainedModel):
                continue
            try:
                found = _TABLE.search(inspect.getsource(inspect.getmodule(c)))
            except (OSError, TypeError):
                continue
            if found:
                known = found.group(1)
                break
        _TABLES[cls] = known
    return known


_TABLES: dict[type, str] = {}


def _never_reaches(name: str) -> str:
    return (f"{name}: its attention does not go through transformers' attention interface (ALL_ATTENTION_FUNCTIONS), "
            "so attn_implementation='multihead' cannot reach it; multihead can neither see nor replace its attention. "
            "Load it with attn_implementation='sdpa' (or 'eager'), or use multihead's own modules.")


_ORIGINAL = PreTrainedModel.get_correct_attn_implementation
# The name "multihead" is registered for the whole process (AttentionInterface.register, above), so it is resolved
# for the whole process too: wherever transformers resolves an implementation's name, a request for multihead is
# checked (everything else passes through untouched). Installed once, at import, next to the registration.
if getattr(_ORIGINAL, "__name__", "") != "_choose":
    PreTrainedModel.get_correct_attn_implementation = _choose


@contextlib.contextmanager
def loading():
    """A block for code written before round 5, when the check below applied only inside it; it now holds
    everywhere. A transformers model built or switched with ``attn_implementation="multihead"``
    (``from_pretrained``, a config, ``set_attn_implementation``) is checked where transformers resolves the name,
    before its layers are built: a class whose attention never goes through the interface gets one clear
    ValueError (not a KeyError from inside its layers, nor outputs computed with masks it was not written for), and
    every model (each sub-model of a composite one) gets the masks its modules were written for -- sdpa's boolean
    masks (:data:`NAME`) when the class supports sdpa, eager's float masks (:data:`EAGER_MASKS`) otherwise::

        model = AutoModel.from_pretrained(path, attn_implementation="multihead")"""
    yield


def _written_for_eager_masks(module: nn.Module) -> bool:
    """Whether ``module``'s modeling file defines transformers models and none of them supports sdpa:
    its modules were written for eager's float masks (read once per class)."""
    known = _EAGER_ONLY.get(type(module))
    if known is None:
        defined = [c for c in vars(inspect.getmodule(type(module)) or object).values()
                   if isinstance(c, type) and issubclass(c, PreTrainedModel) and c is not PreTrainedModel]
        known = _EAGER_ONLY[type(module)] = bool(defined) and not any(getattr(c, "_supports_sdpa", False)
                                                                       for c in defined)
    return known


_EAGER_ONLY: dict[type, bool] = {}


def calls_interface(cls: type) -> bool:
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


def discover(model: nn.Module) -> None:
    """Give a hook list to every module of a transformers model running multihead's attention that
    calls the attention interface (what ``capture`` and ``heads`` look for)."""
    if not isinstance(model, PreTrainedModel) or model.config._attn_implementation not in NAMES:
        return
    for m in model.modules():
        if "attention_hooks" not in m.__dict__ and calls_interface(type(m)):
            hooks = AttentionHooks()
            hooks.num_heads = _head_count(m)
            m.__dict__["attention_hooks"] = hooks


hooks_mod.DISCOVERERS.append(discover)



def attention_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Every attention module of a transformers model running multihead's attention: the modules
    whose forward calls transformers' attention interface, by qualified name, in order."""
    discover(model)
    return {n: m for n, m in model.named_modules() if isinstance(m.__dict__.get("attention_hooks"), AttentionHooks)}


def refusal(model: nn.Module) -> str:
    attn = sorted({type(m).__name__ for m in model.modules() if "Attention" in type(m).__name__})
    return (f"{type(model).__name__}: none of its modules calls transformers' attention interface "
            f"(ALL_ATTENTION_FUNCTIONS){'; ' + ', '.join(attn) + ' compute attention themselves' if attn else ''}, "
            "so multihead can neither see nor replace its attention through transformers. Where those modules "
            "call torch's scaled_dot_product_attention (their sdpa branch), or multihead knows their SDPA form "
            "(Bloom), multihead.heads.observe(model, example) sees and gates their heads; otherwise use "
            "multihead's own modules, or keep attn_implementation='sdpa' for this model.")
