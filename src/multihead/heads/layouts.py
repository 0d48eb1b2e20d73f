"""Head layouts: which weights of an attention module hold head h (its q/k/v/o projections, one
fused qkv, a per-head parameter), proposed from the module's layers and the sizes of one recorded
call, verified by cutting a copy (cut = gate on that call), and the head surgery ``heads.prune``
runs through them. Used for transformers modules (:mod:`multihead.hf.layouts` derives them on a
probe call) and for any module seen through its SDPA call (:mod:`multihead.heads.observe`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from multihead.heads.surgery import fold_into_bias, head_rows, is_conv1d, kept_heads, out_in, select
from multihead.layer.hooks import Seen

__all__ = ["HeadLayout", "candidates", "differs", "in_features", "mixing_norm", "out_features", "run_call", "verify",
           "zero_gate"]


@dataclass
class HeadLayout:
    """One attention module's head surgery: the names of its q/k/v/o projections (one fused
    qkv projection when ``fused``), where the output projection lives (``o_from_parent``: a
    path from the attention module's parent, for BERT's ``output.dense``), its per-head
    parameters and buffers (shape (H,): gpt-oss' sinks, Bloom's ALiBi head index), and which attributes hold the head count and
    inner size. Derived from the module and verified on a recorded call (:func:`derive`)."""

    family: str
    q: str
    k: str
    v: str
    o: str
    o_from_parent: bool = False
    #: False: separate q/k/v; "blocks": one projection [Q | K | V] (GPT-2's Conv1D, Phi-3's qkv_proj,
    #: ModernBERT's Wqkv); "interleaved": per head [q_h k_h v_h] (GPT-NeoX's query_key_value);
    #: "grouped": per key/value group [q .. q k v] (Falcon's new decoder architecture)
    fused: bool | str = False
    #: whether the family's forward works with zero heads; if not, pruning every head keeps one
    #: head whose output-projection columns are zero (it contributes nothing: the output is the bias)
    zero_heads_ok: bool = True
    count_attrs: tuple[str, ...] = ("num_heads", "num_attention_heads", "n_heads")
    kv_count_attrs: tuple[str, ...] = ("num_kv_heads", "num_key_value_heads")  # Hkv, where the module keeps it
    size_attrs: tuple[str, ...] = ("all_head_size", "inner_dim", "split_size", "attn_dim")
    per_head: tuple[str, ...] = ()  # parameters of shape (H,), one entry per query head
    head_size: int | None = None  # D, for a module with no head-size attribute
    #: lists of one module per head (StableLM's per-head q/k layer norms): (path, True where one per key/value head)
    per_head_lists: tuple[tuple[str, bool], ...] = ()
    #: layers beside q/k/v whose output is the heads' H Dv features (timm's output ``gate``): rows cut per head
    head_row_layers: tuple[str, ...] = ()
    #: a fused projection's own q/k/v biases, (name, role) (EVA's ``q_bias``, ``k_bias``, ``v_bias``): cut per head
    qkv_biases: tuple[tuple[str, str], ...] = ()
    #: tables with one column per head, (..., H) (Swin's ``relative_position_bias_table``): columns cut per head
    per_head_cols: tuple[str, ...] = ()

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
        """Keep query heads ``keep`` and key/value heads ``kv`` (every kept key/value head serving as many kept
        query heads: :func:`multihead.heads.surgery.kept_heads` refuses uneven groups); q/k/v/o weights shrink.
        ``mean_out`` (H, Dv): the removed heads' (``gone``) mean output is folded into the output projection's
        bias."""
        _prune(self, m, keep, kv, mean_out, gone)

    def counts(self, m: nn.Module, parent: nn.Module | None) -> tuple[int, int]:
        """(H, Hkv) from the projections' sizes."""
        D = self.head_dim(m)
        q, k, _, _ = self.projections(m, parent)
        if self.fused:
            total = out_features(q) // D  # H + 2 Hkv
            hkv = next((m.__dict__[a] for a in self.kv_count_attrs if isinstance(m.__dict__.get(a), int)), None)
            if self.fused in ("blocks", "grouped") and hkv is not None and 0 < hkv and total > 2 * hkv:  # Falcon
                return total - 2 * hkv, hkv
            g = m.__dict__.get("num_key_value_groups")
            g = g if isinstance(g, int) and g > 0 and self.fused == "blocks" else 1  # H = g Hkv
            H = total * g // (g + 2)
            return H, H // g
        return out_features(q) // D, out_features(k) // D



def out_features(p: nn.Module) -> int:
    return out_in(p).shape[0]



def _inside(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def candidates(m: nn.Module, name: str, parent: nn.Module, parent_name: str, seen: Seen) -> list[HeadLayout] | str:
    """The head layouts m's projections allow (names by role, sizes by the recorded call ``seen``), or why none."""
    H, Hkv, D, Dv = seen
    from multihead.heads.surgery import role_of

    lin = {n: c for n, c in m.named_children() if isinstance(c, nn.Linear) or is_conv1d(c)}
    roles: dict[str, list[str]] = {}
    for n in lin:
        roles.setdefault(role_of(n), []).append(n)
    o_name, from_parent = (roles.get("o") or roles.get("o?") or [None])[-1], False
    if o_name is not None and (in_features(lin[o_name]) != H * Dv):
        o_name = None
    if o_name is None:  # BERT: the output projection is the parent's (output.dense)
        own = name[len(parent_name) + 1:] if parent_name else name
        for n, c in parent.named_modules():
            if n and not _inside(n, own) and (isinstance(c, nn.Linear) or is_conv1d(c)) and \
                    role_of(n) in ("o", "o?") and in_features(c) == H * Dv:
                o_name, from_parent = n, True
                break
    if o_name is None:
        return f"no output projection taking the {H} heads' {H * Dv} features among {sorted(lin) or 'no layers'}"
    per_head = tuple(n for n, p in [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)]
                     if p is not None and p.dim() == 1 and p.shape[0] == H)  # gpt-oss' sinks, Bloom's ALiBi heads
    lists = tuple((n, len(c) != H) for n, c in m.named_modules() if isinstance(c, nn.ModuleList) and n
                  and len(c) in (H, Hkv) and all(any(True for _ in e.parameters()) for e in c))  # StableLM's norms
    extra = _beside(m, lin, roles, seen)
    q, k, v, qkv = (roles.get(r, [None])[0] for r in ("q", "k", "v", "qkv"))
    if q and k and v:
        sizes = (out_features(lin[q]), out_features(lin[k]), out_features(lin[v]))
        if sizes != (H * D, Hkv * D, Hkv * Dv):
            return f"{q}/{k}/{v} give {sizes} features; the call has H={H}, Hkv={Hkv}, D={D}, Dv={Dv}"
        return [HeadLayout("separate q/k/v", q, k, v, o_name, from_parent, per_head=per_head, head_size=D,
                           per_head_lists=lists, **extra)]
    if qkv:
        out = out_features(lin[qkv])
        lays = []
        if D == Dv and out == (H + 2 * Hkv) * D:
            lays.append(HeadLayout("fused [Q | K | V]", qkv, qkv, qkv, o_name, from_parent, fused="blocks",
                                   per_head=per_head, head_size=D, per_head_lists=lists, **extra))
        if D == Dv and H == Hkv and out == 3 * H * D:
            lays.append(HeadLayout("fused per head [q k v]", qkv, qkv, qkv, o_name, from_parent, fused="interleaved",
                                   per_head=per_head, head_size=D, per_head_lists=lists, **extra))
        groups = next((m.__dict__[a] for a in HeadLayout.kv_count_attrs if isinstance(m.__dict__.get(a), int)), None)
        if D == Dv and groups and H % groups == 0 and groups < H and out == (H + 2 * groups) * D:
            # Falcon's new decoder architecture: keys/values broadcast to every query head before the call
            lays.append(HeadLayout("fused per group [q .. q k v]", qkv, qkv, qkv, o_name, from_parent,
                                   fused="grouped", per_head=per_head, head_size=D, per_head_lists=lists, **extra))
        return lays or f"{qkv} gives {out} features; the call has H={H}, Hkv={Hkv}, D={D}, Dv={Dv}"
    return f"no query/key/value projections among {sorted(lin) or 'no layers'}"


def mixing_norm(m: nn.Module, H: int, Dv: int) -> str | None:
    """Why no cut was exact, when ``m`` has a norm as wide as all heads' outputs (timm's ``scale_norm``: a norm over
    the H Dv merged features, so each head's output depends on the others'), or None. Read only after every
    candidate layout failed to verify (an input norm of that width, E = H Dv, cuts fine)."""
    if H < 2:
        return None
    for n, c in m.named_children():
        shape = getattr(c, "normalized_shape", None)
        shape = (shape,) if isinstance(shape, int) else tuple(shape) if shape is not None else None
        if shape == (H * Dv,):
            return (f"its {n} ({type(c).__name__}) normalises all {H} heads' {H * Dv} output features together, so "
                    "each head's output depends on the others': no model with fewer heads computes the same "
                    "(seen and gated, not cut)")
    return None


def _beside(m: nn.Module, lin: dict, roles: dict, seen: Seen) -> dict:
    """The per-head parts of ``m`` beside its q/k/v/o projections, as :class:`HeadLayout` fields: layers giving the
    heads' H Dv features (an output gate), a fused projection's separate q/k/v biases, tables with a column per head."""
    from multihead.heads.surgery import role_of

    H, Hkv, D, Dv = seen
    taken = {n for r in ("q", "k", "v", "qkv", "o", "o?") for n in roles.get(r, [])}
    rows = tuple(n for n, c in lin.items() if n not in taken and role_of(n) is None and out_features(c) == H * Dv)
    own = [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)]
    size = {"q": H * D, "k": Hkv * D, "v": Hkv * Dv}
    biases = tuple((n, role_of(n)) for n, p in own if p is not None and p.dim() == 1 and role_of(n) in size
                   and p.shape[0] == size[role_of(n)])
    cols = tuple(n for n, p in own if p is not None and p.dim() == 2 and p.shape[-1] == H and p.shape[0] != H
                 and p.is_floating_point())
    return {"head_row_layers": rows, "qkv_biases": biases, "per_head_cols": cols}


def in_features(p: nn.Module) -> int:
    return out_in(p).shape[1]


def _first(out):
    return out[0] if isinstance(out, tuple | list) else out


def run_call(mod: nn.Module, call: tuple[tuple, dict], transform=None):
    """``mod`` on a copy of the recorded ``call`` = (args, kwargs), its main output, without gradients; ``transform``:
    a per-head transform (:class:`~multihead.layer.hooks.AttentionHooks`) for this run only. The module's parent
    (shared by the layers) is never copied with the call."""
    args, kwargs = call
    hooks = mod.attention_hooks
    memo = {id(hooks.parent): hooks.parent}
    h = hooks.add_transform(transform) if transform is not None else None
    try:
        with torch.no_grad():
            a, kw = copy.deepcopy((args, kwargs), memo=memo)
            return _first(mod(*a, **kw))
    finally:
        if h is not None:
            h.remove()


def zero_gate(H: int, remove: list[int]):
    """A transform gating off heads ``remove`` of ``H`` (their outputs zero)."""
    gate = torch.ones(H).index_fill(0, torch.tensor(sorted(remove), dtype=torch.long), 0.0)
    return lambda _m, out, _l: out * gate.to(out)[None, None, :, None]


def differs(got: Tensor, ref: Tensor, ungated: Tensor | None = None) -> str | None:
    """Why ``got`` is not ``ref`` within the cut's rounding (the same products over fewer terms), or None.
    ``ungated``: the module's output with every head, so that in half precision (where rounding allows a loose
    tolerance) a cut must also be much closer to the gated output than the removed heads' contribution."""
    if got.shape != ref.shape:
        return f"output shape {tuple(got.shape)} against the gated module's {tuple(ref.shape)}"
    tol = max(1e-4, 16 * torch.finfo(ref.dtype).eps) * (float(ref.abs().max()) + 1e-6)
    err = float((got.double() - ref.double()).abs().max())
    if err > tol:
        return f"max |cut - gated| = {err:.3g} (tolerance {tol:.3g})"
    gap = float((ungated.double() - ref.double()).abs().max()) if ungated is not None and \
        ungated.shape == ref.shape else 0.0  # what the removed heads contribute
    if gap > tol and err > 0.25 * gap:
        return f"max |cut - gated| = {err:.3g}, a quarter or more of what the removed heads contribute ({gap:.3g})"
    return None


def verify(lay: HeadLayout, m: nn.Module, call: tuple[tuple, dict], seen: Seen) -> str | None:
    """None if pruning by ``lay`` equals gating on the recorded call ``call`` = (args, kwargs) of sizes ``seen``
    (the first group of heads removed, one head of a group where groups are larger than one, and every head); else
    why not. The module itself is left unchanged (copies are cut)."""
    H, Dv = seen.H, seen.Dv
    hooks = m.attention_hooks
    memo = {id(hooks.parent): hooks.parent}  # the parent is shared, never copied
    H_lay, Hkv = lay.counts(m, hooks.parent)  # the call may show keys/values broadcast to every head (Falcon)
    if H_lay != H:
        return f"its projections hold {H_lay} query heads; the call has {H}"
    tries = [list(range(H // Hkv)) if Hkv > 1 else [0]] if H > 1 else []
    if H > Hkv > 0 and H // Hkv > 1:  # the first query head of every group: rows inside each group (an even cut)
        tries.append(list(range(0, H, H // Hkv)))
    for remove in tries:
        keep, kv = kept_heads(H, Hkv, set(remove))
        ref = run_call(m, call, zero_gate(H, remove))
        cp = copy.deepcopy(m, memo=dict(memo))
        try:
            _prune(lay, cp, keep, kv, None, None, with_o=not lay.o_from_parent)
            got = run_call(cp, call)
        except Exception as e:  # noqa: BLE001 - the family's forward on a cut module
            return f"its forward fails once heads {remove} are cut ({type(e).__name__}: {str(e)[:120]})"
        if lay.o_from_parent:
            ref = ref[..., head_rows(keep, Dv)]
        if differs(got, ref) is not None:
            return (f"cutting heads {remove} does not equal gating them (the rows it assigns to a head are not "
                    "that head's)")
    cp = copy.deepcopy(m, memo=dict(memo))
    lay.zero_heads_ok = False
    try:
        lay.zero_heads_ok = True
        _prune(lay, cp, [], [], None, None, with_o=not lay.o_from_parent)
        got = run_call(cp, call)
        lay.zero_heads_ok = bool(torch.isfinite(got).all())
    except Exception:  # noqa: BLE001 - the family cannot run without heads: keep one null head
        lay.zero_heads_ok = False
    return None


def _group_rows(keep: list[int], kv: list[int], g: int, D: int) -> list[int]:
    """Rows of a per-group fused projection ([q_{jg} .. q_{jg+g-1} | k_j | v_j], (g + 2) D rows per group j)
    for query heads ``keep`` and key/value heads ``kv`` (one per kept query head when groups became uneven)."""
    slots = [([h], j) for h, j in zip(keep, kv)] if len(kv) == len(keep) else \
        [([h for h in keep if h // g == j], j) for j in kv]
    rows: list[int] = []
    for qs, j in slots:
        base = j * (g + 2)  # the group's first head slot
        rows += head_rows([base + h % g for h in qs] + [base + g, base + g + 1], D)
    return rows


def _set(owner: nn.Module, path: str, new: nn.Module) -> None:
    parent, _, leaf = path.rpartition(".")
    setattr(owner.get_submodule(parent) if parent else owner, leaf, new)


def _cut_per_head(layout: HeadLayout, m: nn.Module, keep: list[int], kv: list[int]) -> None:
    """The per-head parts beside the projections: lists of one module per head, layers and biases with rows per
    head, tables with a column per head, parameters of shape (H,)."""
    for name, by_kv in layout.per_head_lists:  # one module per head: each kept head's own (a copy where repeated)
        holder = m.get_submodule(name)
        owner, _, leaf = name.rpartition(".")
        _set(m, name, nn.ModuleList([copy.deepcopy(holder[i]) for i in (kv if by_kv else keep)]))
        count = m.get_submodule(owner) if owner else m
        if isinstance(count.__dict__.get("num_heads"), int):  # StableLmLayerNormPerHead's own count
            count.__dict__["num_heads"] = len(kv if by_kv else keep)
    D, Dv = layout.head_dim(m), _value_size(layout, m)
    for name in layout.head_row_layers:  # (H Dv, E) -> (len(keep) Dv, E)
        _set(m, name, select(m.get_submodule(name), out_rows=head_rows(keep, Dv)))
    for name, role in layout.qkv_biases:  # (H D,) or (Hkv D,) -> the kept heads' rows
        _replace(m, name, lambda p, role=role: p[head_rows(keep, D) if role == "q" else head_rows(kv, D if role == "k" else Dv)])
    for name in layout.per_head_cols:  # (..., H) -> (..., len(keep))
        _replace(m, name, lambda p: p[..., keep])
    for name in layout.per_head:  # (H,) -> (len(keep),)
        _replace(m, name, lambda p: p[keep])


def _value_size(layout: HeadLayout, m: nn.Module) -> int:
    """Dv: the head size of the values (D unless the module's output projection says otherwise)."""
    hooks = m.__dict__.get("attention_hooks")
    seen = getattr(hooks, "seen", None)
    return seen.Dv if seen is not None else layout.head_dim(m)


def _replace(m: nn.Module, name: str, part) -> None:
    """Parameter or buffer ``name`` of ``m`` replaced by ``part(tensor)`` (a copy): a buffer stays one (saved or not,
    as it was), a parameter keeps its requires_grad."""
    owner, _, leaf = name.rpartition(".")
    holder = m.get_submodule(owner) if owner else m
    p = getattr(holder, leaf)
    if leaf in holder._buffers:
        holder._buffers[leaf] = part(p).clone()
    else:
        setattr(holder, leaf, nn.Parameter(part(p.detach()).clone(), requires_grad=p.requires_grad))


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
            _set(m, layout.q, select(q, out_rows=head_rows(keep, 3 * D)))
        elif layout.fused == "grouped":
            _set(m, layout.q, select(q, out_rows=_group_rows(keep, kv, H0 // Hkv0, D)))
        elif layout.fused:  # [Q (H D) | K (Hkv D) | V (Hkv D)] along the output
            rows = head_rows(keep, D) + [H0 * D + r for r in head_rows(kv, D)] + [(H0 + Hkv0) * D + r for r in head_rows(kv, D)]
            _set(m, layout.q, select(q, out_rows=rows))
        else:
            _set(m, layout.q, select(q, out_rows=head_rows(keep, D)))
            _set(m, layout.k, select(k, out_rows=head_rows(kv, D)))
            _set(m, layout.v, select(v, out_rows=head_rows(kv, D)))
        _cut_per_head(layout, m, keep, kv)
        if with_o:
            new_o = select(o, in_cols=head_rows(keep, D))
            if null:
                new_o.weight.zero_()
            if mean_out is not None and gone:  # the removed heads' mean output, through o, into its bias
                fold_into_bias(new_o, o, head_rows(gone, D), mean_out[gone])
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
    for a in layout.kv_count_attrs:
        if isinstance(m.__dict__.get(a), int):
            m.__dict__[a] = Hkv
    if isinstance(m.__dict__.get("num_key_value_groups"), int):
        m.__dict__["num_key_value_groups"] = H // Hkv if Hkv else 1
    before = hooks.kept if hooks.kept is not None else list(range(H0))
    hooks.kept = [before[i] for i in keep]  # the original indices: a shared per-head input (T5's bias) is cut to them
    hooks.num_heads = H
