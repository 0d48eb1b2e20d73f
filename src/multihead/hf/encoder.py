"""A served encoder: a BERT-family model's forward rebuilt lean for prediction, ``multihead.hf.serve(model)``.

At batch 1 a sentence encoder spends as much time in Python as in arithmetic: transformers' module
tree (a dozen module calls a layer, the attention interface, mask preparation) and three query, key and
value projections that are each too small to use the machine. :class:`Encoder` computes the same
function with the least of both:

- the query, key and value projections of each layer fused into one (:func:`multihead.quantize.fused`:
  float, or the int8 layers of a quantized model with their own rows and scales);
- the real tokens only: a padded batch (B, L) is unpadded once after the embeddings, every layer runs on
  the N real tokens (attention per sequence, :func:`multihead.core.varlen.attention_varlen`) and the last
  hidden states are padded back, zeros at padding; a batch without padding runs dense
  (:func:`multihead.attention`);
- each layer's norms, feed-forward and activation called as functions of the model's own weights.

The embeddings are BERT's (word + position + token type, LayerNorm) computed from the model's weights where
that gives the model's own embeddings module on the probe, else that module itself (RoBERTa's positions, for
one). What it takes is checked, never assumed: every layer must have BERT's parts
(``attention.self.query/key/value``, ``attention.output.dense/LayerNorm``, ``intermediate.dense`` and its
activation, ``output.dense/LayerNorm``) and no cross-attention, and :func:`serve` compares the encoder with the
model on probe batches before returning it (one without padding; one with padding, for an int8 model on its
dequantized float twin, since int8 activations are rounded over what a call holds), naming where it first
differs. It is a copy: later changes to the model (pruning, training) do not reach it. Prediction only: no
dropout (training mode is refused), no attention weights, no hooks (use the model itself for ``capture`` and
``heads``).
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.modeling_outputs import BaseModelOutput

from multihead.backends import registry
from multihead.core.functional import attention
from multihead.core.padding import Unpadding
from multihead.core.varlen import attention_varlen
from multihead.hf import probe
from multihead.quantize import fused, is_int8_linear, kernel_kind, linear

__all__ = ["Encoder", "serve"]

#: a layer's parts, by their names in transformers' BERT layer (BERT, RoBERTa, MiniLM, ELECTRA, XLM-R)
PARTS = ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense",
         "attention.output.LayerNorm", "intermediate.dense", "output.dense", "output.LayerNorm")


class EncoderLayer(nn.Module):
    """One post-norm layer: x = norm1(x + out(attention(qkv(x)))); x = norm2(x + down(act(up(x)))).
    ``qkv``: the fused projection (E -> 3*H*D); H heads of size D; ``scale`` on the scores."""

    def __init__(self, qkv: nn.Module | None, out: nn.Module, up: nn.Module, down: nn.Module, *, act, norm1: nn.LayerNorm,
                 norm2: nn.LayerNorm, head_dim: int, scale: float):
        super().__init__()
        self.qkv, self.out, self.norm1, self.up, self.down, self.norm2 = qkv, out, norm1, up, down, norm2
        self.act = act
        self.head_dim, self.scale = head_dim, scale
        # resolved once, not per call (~10 us a projection, ~9 us the activation's module call at batch 1)
        self.kinds = tuple(None if m is None else kernel_kind(m) for m in (qkv, out, up, down))
        self.exact_gelu = exact_gelu(act)

    @property
    def num_heads(self) -> int:
        """H, from the fused projection's rows (3*H*D; no projection: every head pruned)."""
        return 0 if self.qkv is None else self.qkv.out_features // (3 * self.head_dim)

    def forward(self, x: Tensor, rows: Unpadding | None, B: int, L: int, call: EncoderCall) -> Tensor:
        """x: (N, E), the real tokens of the batch sequence after sequence (``rows``), or all B*L
        positions of a batch without padding (``rows`` None) -> (N, E). ``call``: what the layers of one
        encoder call share (the attention backend chosen by the first)."""
        a = self.attend(x, rows, B, L, call)  # (N, E)
        _, _, k_up, k_down = self.kinds
        # the residual sums and the activation in place, on products this layer just made (the same numbers): a
        # fresh buffer a step (2.8 MB for the feed-forward's at batch 16) costs page faults, most on a busy machine:
        # 0.98x at batch 16 and 0.88x at 64 in place (bench/served_in_place.py, bench/results/served_in_place.md)
        n1, n2 = self.norm1, self.norm2
        x = F.layer_norm(a.add_(x), n1.normalized_shape, n1.weight, n1.bias, n1.eps)  # (N, E)
        u = linear(self.up, x, kind=k_up)  # (N, the feed-forward size)
        u = torch.ops.aten.gelu_(u) if self.exact_gelu else self.act(u)
        h = linear(self.down, u, kind=k_down)  # (N, E)
        return F.layer_norm(h.add_(x), n2.normalized_shape, n2.weight, n2.bias, n2.eps)  # (N, E)

    def attend(self, x: Tensor, rows: Unpadding | None, B: int, L: int, call: EncoderCall) -> Tensor:
        """The attention block, up to its output projection (before the residual): x (N, E) -> (N, E), a fresh
        tensor (see :meth:`forward` for the arguments)."""
        H, D = self.num_heads, self.head_dim
        N = x.shape[0]
        k_qkv, k_out, _, _ = self.kinds
        if H:
            qkv = linear(self.qkv, x, kind=k_qkv).view(N, 3, H, D)  # (N, 3*H*D) -> (N, 3, H, D)
            if rows is None:
                q, k, v = qkv.view(B, L, 3, H, D).permute(2, 0, 3, 1, 4)  # 3 x (B, H, L, D)
                a = call.attention(q, k, v, self.scale).transpose(1, 2).reshape(N, H * D)  # (B, H, L, D) -> (N, H*D)
            else:
                q, k, v = qkv.unbind(1)  # 3 x (N, H, D)
                cu = rows.cu_seqlens
                a = attention_varlen(q, k, v, cu, cu, scale=self.scale).reshape(N, H * D)  # (N, H, D) -> (N, H*D)
            a = linear(self.out, a, kind=k_out)  # (N, E)
        else:  # every head pruned: the output projection gives its bias
            a = linear(self.out, x.new_zeros(N, 0), kind=k_out)  # (N, E)
        return a


def exact_gelu(act) -> bool:
    """Whether the activation module computes ``F.gelu`` (erf form) and nothing else: ``nn.GELU()``, or
    transformers' ``GELUActivation`` holding ``F.gelu`` with no hooks. (:func:`serve` also compares the whole
    encoder with the model before returning it.)"""
    if not isinstance(act, nn.Module) or act._forward_hooks or act._forward_pre_hooks:
        return False
    if type(act) is nn.GELU:
        return act.approximate == "none"
    return type(act).__name__ == "GELUActivation" and act.__dict__.get("act") is F.gelu and \
        type(act).forward.__qualname__ == "GELUActivation.forward"


class EncoderCall:
    """What the layers of one :class:`Encoder` call share: the first layer's attention goes through
    :func:`multihead.attention` (validated, the backend chosen as for any call), the next ones run that
    backend again through :func:`multihead.backends.registry.run_kept` (the registry's own checks: the same
    registry generation, dtype, no gradients; otherwise the full path again). Lives for one call only."""

    def __init__(self):
        self.kept: registry.Kept | None = None

    def attention(self, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        """q, k, v (B, H, L, D), no mask -> (B, H, L, D)."""
        out = registry.run_kept(self.kept, q, k, v) if self.kept is not None and self.kept.scale == scale else None
        if out is None:
            out = attention(q, k, v, scale=scale)
            self.kept = registry.keep(q, k, v, scale)
        return out


class ModelEmbeddings(nn.Module):
    """The model's own embeddings module, called with token ids and token types: (B, L) -> (B, L, E)."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, input_ids: Tensor, token_type_ids: Tensor | None) -> Tensor:
        return self.module(input_ids=input_ids, token_type_ids=token_type_ids)  # (B, L, E)


class ServedBertEmbeddings(nn.Module):
    """BERT's embeddings as functions of its weights: word + position (0..L-1) + token type (0 when not
    given), then LayerNorm (dropout is off in prediction). Used only where it equals the model's own
    module on the probe inputs (:func:`serve`). Raises ValueError for more tokens than the model has positions
    or a token id outside its vocabulary (transformers' own errors there are a broadcast's and an index's)."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.word = module.word_embeddings
        self.position = module.position_embeddings
        self.token_type = module.token_type_embeddings
        self.norm = module.LayerNorm

    @staticmethod
    def of(module: nn.Module) -> ServedBertEmbeddings | None:
        """For a module with BERT's parts (word, position and token-type nn.Embedding, an nn.LayerNorm), else None."""
        parts = [getattr(module, n, None) for n in
                 ("word_embeddings", "position_embeddings", "token_type_embeddings")]
        if not all(type(p) is nn.Embedding for p in parts) or type(getattr(module, "LayerNorm", None)) is not \
                nn.LayerNorm:
            return None
        return ServedBertEmbeddings(module)

    def forward(self, input_ids: Tensor, token_type_ids: Tensor | None) -> Tensor:
        L = input_ids.shape[1]
        if L > self.position.num_embeddings:
            raise ValueError(f"input_ids (B, L) = {tuple(input_ids.shape)}: the model takes at most "
                             f"{self.position.num_embeddings} tokens (max_position_embeddings); truncate the text.")
        _ids("input_ids", input_ids, self.word.num_embeddings, "the model's vocabulary has {n}", "use its own tokenizer")
        if token_type_ids is not None:
            _ids("token_type_ids", token_type_ids, self.token_type.num_embeddings, "the model has {n} token types",
                 "they come from its tokenizer (0 for a single text)")
        tt = self.token_type.weight[0] if token_type_ids is None else self.token_type.weight[token_type_ids]
        # summed in transformers' order, (word + token type) + position: the same float numbers as the model's
        # module, so an int8 model's first activations round alike (one ulp moves every rounding of a call)
        x = self.word.weight[input_ids] + tt + self.position.weight[:L]  # (B, L, E)
        n = self.norm
        return F.layer_norm(x, n.normalized_shape, n.weight, n.bias, n.eps)  # (B, L, E)


def _ids(name: str, t: Tensor, n: int, has: str, fix: str) -> None:
    """Refuse ids that are not integers in 0..n-1, naming ``name``, what they hold, and ``fix``."""
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(f"{name} must be integer ids (torch.long); got {t.dtype}.")
    if t.numel():
        lo, hi = torch.aminmax(t)
        if int(lo) < 0 or int(hi) >= n:
            ids = "token ids" if name == "input_ids" else "ids"
            raise ValueError(f"{name} hold {ids} {int(lo)}..{int(hi)}; {has.format(n=n)} (ids 0..{n - 1}): {fix}.")


class Encoder(nn.Module):
    """``Encoder(input_ids (B, L), attention_mask (B, L) of 0/1 or None, token_type_ids (B, L) or None)``
    -> transformers' ``BaseModelOutput`` with ``last_hidden_state`` (B, L, E) (also ``out[0]``), zeros at padded
    positions: what the model returns, so pooling code written for it works unchanged (``return_dict=False``: the
    tuple ``(last_hidden_state,)``). It has the model's ``config``, so it takes the model's place inside
    sentence-transformers (``st[0].model = serve(model)``). Built by
    :func:`serve` (see the module's docstring)."""

    def __init__(self, embeddings: nn.Module, layers: list[EncoderLayer], name: str, config):
        super().__init__()
        self.embeddings = embeddings
        self.layers = nn.ModuleList(layers)
        self.name = name  # the model's class, for messages
        self.config = config  # a copy of the model's (sentence-transformers reads hidden_size and output flags)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, token_type_ids: Tensor | None = None,
                *, return_dict: bool = True) -> BaseModelOutput | tuple[Tensor]:
        if self.training:
            raise ValueError(f"{self.name} (served) is for prediction: it has no dropout to train with. Call .eval(), "
                             "or train the model it was served from and serve it again.")
        if not isinstance(input_ids, Tensor) or input_ids.dim() != 2:
            got = tuple(input_ids.shape) if isinstance(input_ids, Tensor) else type(input_ids).__name__
            raise ValueError(f"{self.name} (served): input_ids must be (B, L) token ids; got {got}.")
        B, L = input_ids.shape
        for arg, t in (("attention_mask", attention_mask), ("token_type_ids", token_type_ids)):
            if t is not None and (not isinstance(t, Tensor) or t.shape != input_ids.shape):
                got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
                raise ValueError(f"{self.name} (served): {arg} must be (B, L) like input_ids {(B, L)}; got {got}.")
        rows = None
        if attention_mask is not None and attention_mask.numel():
            if attention_mask.dtype == torch.bool:
                full = bool(attention_mask.all())
            else:
                lo, hi = torch.aminmax(attention_mask)
                full = float(lo) == float(hi) == 1.0
                if not full and not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
                    raise ValueError(f"{self.name} (served): attention_mask must hold 0 (padding) and 1 (a token); "
                                     "other masks (4-D, float biases) are not served: call the model itself.")
            if not full:
                rows = Unpadding.of(attention_mask.bool())  # (B, L) -> where the N real tokens are
        x = self.embeddings(input_ids, token_type_ids)  # (B, L, E)
        E = x.shape[-1]
        h = x.reshape(B * L, E) if rows is None else rows.pack(x)  # (B, L, E) -> (N, E)
        call = EncoderCall()
        for layer in self.layers:
            h = layer(h, rows, B, L, call)
        out = h.view(B, L, E) if rows is None else rows.unpack(h)  # (N, E) -> (B, L, E), zeros at padding
        return BaseModelOutput(last_hidden_state=out) if return_dict else (out,)


def serve(model: nn.Module, *, example: dict | None = None) -> Encoder:
    """A lean copy of a BERT-family encoder for prediction (see the module's docstring): float or int8
    (a :func:`multihead.quantize.quantize`'d model), pruned or not (each layer keeps its own head count).
    ``example``: the model's keyword inputs for the probe calls (default: made from its config). Raises
    TypeError or ValueError, before anything is built, naming the layer or part that is not BERT's, or
    after the probes, naming the first layer whose output differs from the model's."""
    from multihead.hf.attention import PreTrainedModel
    from multihead.hf.layouts import probe_inputs
    from multihead.hf.packed import _stack

    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"serve takes a transformers PreTrainedModel (a BERT-family encoder); got "
                        f"{type(model).__name__}.")
    name = type(model).__name__
    cfg = model.config
    if getattr(cfg, "is_decoder", False) or getattr(cfg, "add_cross_attention", False):
        raise ValueError(f"serve: {name} is configured as a decoder (is_decoder / add_cross_attention); serve "
                         "rebuilds encoders only.")
    base = getattr(model, "base_model", model)
    embeddings = getattr(base, "embeddings", None)
    if not isinstance(embeddings, nn.Module):
        raise ValueError(f"serve: {name} has no embeddings module on its base model; serve rebuilds BERT-family "
                         "encoders (BERT, RoBERTa, MiniLM, ELECTRA).")
    stack_name, _ = _stack(base, _self_attentions(base, name))
    example = example if example is not None else probe_inputs(model)
    enc = _build(base, stack_name, name, example)
    if any(is_int8_linear(m) for m in base.modules()):
        # int8 activations are quantized per call, over what the call holds: a model that runs padded rounds
        # them over its padding too, so only a batch without padding gives both the same arithmetic. The
        # padded batch is compared on the float model the int8 weights stand for (same structure, exact).
        _verify(base, enc, example, stack_name, padded=False)
        twin = _dequantized(base)
        _verify(twin, _build(twin, stack_name, name, example), example, stack_name, padded=True)
    else:
        _verify(base, enc, example, stack_name, padded=True)
    return enc


def _build(base: nn.Module, stack_name: str, name: str, example: dict) -> Encoder:
    stack = base.get_submodule(stack_name)
    layers = [_layer(layer, f"{stack_name}.{i}", name) for i, layer in enumerate(stack)]
    return Encoder(_embeddings(copy.deepcopy(base.embeddings), example), layers, name,
                   copy.deepcopy(base.config)).eval()


def _dequantized(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose int8 Linear layers are float ones holding their dequantized weights."""
    twin = copy.deepcopy(module)
    for parent in list(twin.modules()):
        for child_name, child in list(parent.named_children()):
            if is_int8_linear(child):
                lin = nn.Linear(child.in_features, child.out_features, bias=child.bias() is not None)
                with torch.no_grad():
                    lin.weight.copy_(child.weight().dequantize())  # (out, in)
                    if lin.bias is not None:
                        lin.bias.copy_(child.bias())
                setattr(parent, child_name, lin)
    return twin.eval()


def _embeddings(module: nn.Module, example: dict) -> nn.Module:
    """:class:`ServedBertEmbeddings` where it gives the module's output on the probe's token ids (with and without
    token types), else the module itself (:class:`ModelEmbeddings`: RoBERTa's positions, for one)."""
    own = ModelEmbeddings(module).eval()
    fast = ServedBertEmbeddings.of(module)
    if fast is None or module.training:
        return own
    ids = probe.padded_example(example)["input_ids"]  # (B, L)
    tt = (torch.arange(ids.shape[1]) >= ids.shape[1] // 2).long().expand_as(ids)  # (B, L): two segments
    with torch.no_grad():
        for t in (None, tt):
            try:
                ref = own(ids, t)
            except (IndexError, RuntimeError):  # no second token type: compare without it
                continue
            if probe.differs(ref, fast(ids, t)):
                return own
    return fast


def _self_attentions(base: nn.Module, name: str) -> dict[str, nn.Module]:
    found = {n: m for n, m in base.named_modules() if n.endswith("attention.self")}
    if not found:
        raise ValueError(f"serve: {name} has no BERT attention modules (attention.self); serve rebuilds "
                         "BERT-family encoders (BERT, RoBERTa, MiniLM, ELECTRA).")
    return found


def _layer(layer: nn.Module, where: str, name: str) -> EncoderLayer:
    """One layer of the model as an :class:`EncoderLayer` (copied weights), or a ValueError naming what is missing."""
    if hasattr(layer, "crossattention"):
        raise ValueError(f"serve: {where} ({type(layer).__name__}) has cross-attention; serve rebuilds encoders only.")
    parts = {}
    for p in PARTS:
        try:
            parts[p] = layer.get_submodule(p)
        except AttributeError:
            raise ValueError(f"serve: {where} ({type(layer).__name__}) has no {p}: its layers are not BERT's "
                             f"(needed: {', '.join(PARTS)}); call {name} itself.") from None
    for p in ("attention.output.LayerNorm", "output.LayerNorm"):
        if type(parts[p]) is not nn.LayerNorm:
            raise ValueError(f"serve: {where}.{p} is {type(parts[p]).__name__}, not nn.LayerNorm; call {name} itself.")
    for p in PARTS:
        if "LayerNorm" not in p and not (type(parts[p]) is nn.Linear or is_int8_linear(parts[p])):
            raise ValueError(f"serve: {where}.{p} is {type(parts[p]).__name__}; serve computes nn.Linear layers and "
                             "multihead.quantize's int8 ones. Call the model itself.")
    act = getattr(layer.intermediate, "intermediate_act_fn", None)
    if act is None:
        raise ValueError(f"serve: {where}.intermediate has no intermediate_act_fn (BERT's activation); call "
                         f"{name} itself.")
    attn = layer.get_submodule("attention.self")
    q, k, v = (parts[f"attention.self.{p}"] for p in ("query", "key", "value"))
    D = getattr(attn, "attention_head_size", None)
    if not isinstance(D, int) or D <= 0 or q.out_features % D or k.out_features != q.out_features or \
            v.out_features != q.out_features:
        raise ValueError(f"serve: {where}.attention.self: projections of {q.out_features}, {k.out_features} and "
                         f"{v.out_features} rows do not make heads of attention_head_size {D}; call {name} itself.")
    scale = getattr(attn, "scaling", None)
    scale = float(scale) if isinstance(scale, int | float) else 1.0 / math.sqrt(D)
    H = q.out_features // D
    with torch.no_grad():
        return EncoderLayer(
            fused(q, k, v) if H else None, copy.deepcopy(parts["attention.output.dense"]),
            copy.deepcopy(parts["intermediate.dense"]), copy.deepcopy(parts["output.dense"]), act=copy.deepcopy(act),
            norm1=copy.deepcopy(parts["attention.output.LayerNorm"]), norm2=copy.deepcopy(parts["output.LayerNorm"]),
            head_dim=D, scale=scale).eval()


def _verify(base: nn.Module, enc: Encoder, example: dict, stack: str, *, padded: bool) -> None:
    """The encoder against the base model on a batch without padding and (``padded``) on a padded one (real
    tokens), within :mod:`multihead.hf.probe`'s tolerance; a difference is a ValueError naming where: between
    the embeddings and the first layer, or the first layer whose output differs."""
    pad = probe.padded_example(example)
    ids, am = pad["input_ids"], pad["attention_mask"]
    full = {"input_ids": ids[:1].expand(2, -1).clone(), "attention_mask": torch.ones_like(ids[:2])}  # (2, L)
    was = base.training
    base.eval()
    try:
        with torch.no_grad():
            for x in [full, {"input_ids": ids, "attention_mask": am}][: 2 if padded else 1]:
                keep = x["attention_mask"].bool()
                outs, first = _layer_outputs(base, stack, len(enc.layers), x)
                ref = first.pop("output")  # (B, L, E)
                try:
                    got = enc(**x).last_hidden_state
                except (RuntimeError, ValueError) as e:  # shapes that do not fit: told below, where
                    got, err = None, e
                if got is not None and not probe.differs(ref[keep], got[keep]):
                    continue
                where = _where(enc, x, outs, first, stack)
                gap = "it raised " + str(err).splitlines()[0][:200] if got is None else \
                    f"max difference {float((ref[keep].float() - got[keep].float()).abs().max()):.3g}"
                raise ValueError(f"serve: the served {enc.name} does not compute the model's function ({gap}, on a "
                                 f"probe batch{' with padding' if not bool(keep.all()) else ''}){where}; call the "
                                 "model itself.")
    finally:
        base.train(was)


def _layer_outputs(base: nn.Module, stack: str, n: int, x: dict) -> tuple[dict[int, Tensor], dict[str, Tensor]]:
    """The base model on ``x``: ({i: layer i's output}, {"input": what layer 0 received, "output": the model's})."""
    layers = base.get_submodule(stack)
    first = {}
    h = layers[0].register_forward_pre_hook(
        lambda m, a, kw: first.__setitem__("input", a[0] if a else kw.get("hidden_states")), with_kwargs=True)
    try:
        with probe.recording(layers) as (rec, _):  # every module under the stack, by its name in it ("0", "0.attention")
            first["output"] = probe.first_output(base(**x))
    finally:
        h.remove()
    return {i: rec[str(i)] for i in range(n) if str(i) in rec}, first


def _where(enc: Encoder, x: dict, outs: dict[int, Tensor], first: dict[str, Tensor], stack: str) -> str:
    """'; <where the served encoder first differs>' from the model's recorded layer inputs and outputs, or ''."""
    keep = x["attention_mask"].bool()
    B, L = keep.shape
    h = enc.embeddings(x["input_ids"], None)  # (B, L, E)
    entry = first.get("input")
    if not isinstance(entry, Tensor) or entry.shape != h.shape or probe.differs(entry[keep], h[keep]):
        got = tuple(entry.shape) if isinstance(entry, Tensor) else type(entry).__name__
        return (f"; its first layer {stack}.0 does not receive the embeddings' output (it gets {got} where the "
                f"embeddings give {tuple(h.shape)}): the model computes something between them that serve does not "
                "(ELECTRA's embeddings_project, for one)")
    rows = None if bool(keep.all()) else Unpadding.of(keep)
    h = h.reshape(B * L, -1) if rows is None else rows.pack(h)  # (B, L, E) -> (N, E)
    call = EncoderCall()
    for i, layer in enumerate(enc.layers):
        h = layer(h, rows, B, L, call)
        ref = outs.get(i)
        if ref is None or ref.dim() != 3 or ref.shape[:2] != (B, L):
            return ""  # a packed model's layers see (1, N, E): no per-layer comparison
        if probe.differs(ref[keep], h if rows is not None else h[keep.reshape(-1)]):
            return f"; the first layer that differs is {stack}.{i}"
    return ""
