"""Head layouts of transformers attention modules: which weights hold head h, derived from the
module and verified on a recorded call (:func:`derive`), shown by :func:`explain`, and the head
surgery ``heads.prune`` runs through them (with :mod:`multihead.heads.surgery`'s row/column selector and
mean-into-bias fold, shared with multihead's own modules).

Dependency order: hf_attention -> hf_heads -> hf.
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor, nn

from multihead.heads.layouts import HeadLayout, candidates, in_features, out_features, verify  # noqa: F401
from multihead.hf.attention import attention_modules, refusal

__all__ = ["HeadLayout", "derive", "explain"]


# --- head layouts, derived from the module and verified on a recorded call ---


def probe_inputs(model: nn.Module) -> dict:
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
        x = example if example is not None else probe_inputs(model)
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
            parent = hooks.parent
            lays = candidates(m, name, parent, rev.get(id(parent), ""), hooks.seen)
            reasons = []
            for lay in [] if isinstance(lays, str) else lays:
                r = verify(lay, m, calls[name], hooks.seen)
                if r is None:
                    hooks.layout, hooks.num_heads, hooks.layout_reason = lay, hooks.seen.H, None
                    hooks.probe = calls[name]
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
        return refusal(model)
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
            a = args  # a multihead.hf.attention.Computed
            parts = [f"scaling={a.scaling:.4g}" if a.scaling is not None else "scaling=1/sqrt(D)"]
            parts += ["causal"] * a.causal + ["mask"] * a.mask
            parts += [f"dropout={a.dropout:g}"] if a.dropout else []
            parts += [f"softcap={a.softcap:g}"] if a.softcap is not None else []
            parts += ["sinks (H,)"] * a.sinks
            parts += [f"sliding_window={a.sliding_window}"] if a.sliding_window is not None else []
            parts += ["position_bias"] * a.position_bias + ["packed rows (varlen)"] * a.packed
            got = ", ".join(parts)
        lines += [f"- {name} ({type(m).__name__}): {heads}", f"    {cut}", f"    computes: {got}"]
    return "\n".join(lines)


