"""Integer arithmetic for prediction: the Linear layers of a (pruned) model in int8.

``quantize(model, "int8")`` returns a copy whose ``nn.Linear`` layers compute with int8
weights (one scale per output row) and int8 activations quantized per call (dynamic
quantization, PyTorch's fbgemm/onednn kernels on CPU); attention, norms and embeddings stay in
float. Quantize last: a quantized model is for prediction (no gradients, no further pruning).

Activations use the full 8 bits where the machine's kernel computes them exactly. PyTorch's
dynamic Linear always asks for 7 (``reduce_range``), because CPUs without VNNI multiply-add
unsigned 8-bit activations with signed 8-bit weights into saturating 16-bit pairs; with VNNI
(or where the kernel otherwise does not saturate) the 8th bit halves the activations' rounding
error: on all-MiniLM-L6-v2 unpruned, mean cosine to the float model 0.993 instead of 0.977, at
the same speed. Which one a machine gets is not guessed from its name: :func:`full_range_exact`
runs the kernel once on inputs that would saturate and compares with exact integer arithmetic.

PyTorch marks its quantized-tensor API deprecated (torch.ao, issue 184982) in favour of torchao;
the kernels used here are the ones torch 2.13 ships. The deprecation notice is silenced around
the conversion only, so it does not reach a user who asked for int8.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import warnings

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

__all__ = ["DTYPES", "fake_quantized", "fused", "is_quantized", "kernel_kind", "linear", "quantize"]

DTYPES = ("int8",)
KEY = "multihead_quantized"


def check_dtype(dtype: object) -> str:
    if dtype not in DTYPES:
        raise ValueError(f"quantize: unknown dtype {dtype!r}; supported: {', '.join(DTYPES)}.")
    return dtype


def quantize(model: nn.Module, dtype: str = "int8") -> nn.Module:
    """A copy of ``model`` with every ``nn.Linear`` in ``dtype`` (weights per output row, activations
    per call); the original is left as it was. Raises ValueError for an unknown dtype, before any work."""
    check_dtype(dtype)
    if is_quantized(model):
        raise ValueError("quantize: the model is already quantized; quantize the float model once.")
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"torch\.quantize_per_tensor, torch\.quantize_per_channel")
        warnings.filterwarnings("ignore", message=r"torch\.ao\.quantization is deprecated", category=DeprecationWarning)
        q = copy.deepcopy(model).eval()
        spec = {name: per_channel_dynamic_qconfig for name in _linears(q)}  # by name: empty layers stay float
        q = quantize_dynamic(q, spec, inplace=True)
    if full_range_exact():
        from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear

        for m in q.modules():
            if type(m) is DynamicLinear:
                m.__class__ = __getattr__("FullRangeLinear")
    q.__dict__[KEY] = dtype
    return q


def fused(*linears: nn.Module) -> nn.Module:
    """One layer computing ``linears`` side by side: ``fused(q, k, v)(x)`` is ``cat([q(x), k(x), v(x)], -1)``,
    in one call instead of three. The layers share their input size and kind: ``nn.Linear`` (weights and
    biases concatenated by rows), or the int8 layers :func:`quantize` makes (their int8 rows and per-row
    scales concatenated: nothing is rounded again, and the activations are quantized once per call, as each
    layer would quantize the same input, so the outputs are the separate layers' own). A new module; the
    layers are left as they are. Raises TypeError or ValueError naming what differs."""
    if not linears:
        raise ValueError("fused: give at least one layer.")
    kinds = {type(m) for m in linears}
    if len(kinds) != 1:
        raise TypeError(f"fused: the layers must be of one kind; got {sorted(k.__name__ for k in kinds)}.")
    sizes = [m.in_features for m in linears]
    if len(set(sizes)) != 1:
        raise ValueError(f"fused: the layers must take one input size; got in_features {sizes}.")
    kind, E = kinds.pop(), sizes[0]
    biased = [_bias(m) is not None for m in linears]
    if len(set(biased)) != 1:
        raise ValueError("fused: either every layer has a bias or none has.")
    out = sum(m.out_features for m in linears)
    if kind is nn.Linear:
        w0 = linears[0].weight
        f = nn.Linear(E, out, bias=biased[0], device=w0.device, dtype=w0.dtype)
        with torch.no_grad():
            f.weight.copy_(torch.cat([m.weight for m in linears]))  # (sum out, E)
            if biased[0]:
                f.bias.copy_(torch.cat([m.bias for m in linears]))  # (sum out,)
        return f.train(linears[0].training)
    if not all(is_int8_linear(m) for m in linears):
        raise TypeError(f"fused: {kind.__name__} is neither nn.Linear nor one of quantize()'s int8 layers.")
    ws = [m.weight() for m in linears]  # per-row (out, E) qint8 tensors
    if any(w.qscheme() != torch.per_channel_affine or w.q_per_channel_axis() != 0 for w in ws):
        raise ValueError("fused: int8 layers must have one scale per output row (as quantize() makes them).")
    w = torch._make_per_channel_quantized_tensor(
        torch.cat([w.int_repr() for w in ws]), torch.cat([w.q_per_channel_scales() for w in ws]),
        torch.cat([w.q_per_channel_zero_points() for w in ws]), 0)  # (sum out, E) int8, the same rows and scales
    bias = torch.cat([_bias(m) for m in linears]) if biased[0] else None  # (sum out,)
    f = kind(E, out)
    f.set_weight_bias(w, bias)
    return f


#: :func:`kernel_kind`'s answer for an ``nn.Linear`` (an int8 layer's is its ``reduce_range``, a bool)
FLOAT = "float"


def kernel_kind(m: nn.Module) -> str | bool:
    """How :func:`linear` computes ``m``: :data:`FLOAT` for an ``nn.Linear``, else the ``reduce_range`` of one of
    :func:`quantize`'s int8 layers (:func:`is_int8_linear`). Raises TypeError for any other module. A loop that
    calls the same layers again resolves them once and passes ``kind=`` to :func:`linear`."""
    kind = type(m)
    if kind is nn.Linear:
        return FLOAT
    reduce_range = _int8_kinds().get(kind)
    if reduce_range is None or m._packed_params.dtype != torch.qint8:
        raise TypeError(f"linear: {kind.__name__} is neither nn.Linear nor one of quantize()'s int8 layers.")
    return reduce_range


def linear(m: nn.Module, x: Tensor, *, kind: str | bool | None = None) -> Tensor:
    """``m(x)`` for an ``nn.Linear`` or one of :func:`quantize`'s int8 layers (:func:`is_int8_linear`), computed
    as the module computes it but without the module call: for loops where the call costs as much as the
    product (a served encoder at batch 1). ``kind``: :func:`kernel_kind` of ``m``, resolved once by the caller
    (None: resolved here). Raises TypeError for any other module."""
    kind = kernel_kind(m) if kind is None else kind
    if kind == FLOAT:
        return torch.nn.functional.linear(x, m.weight, m.bias)
    y = _kernel(x, m._packed_params._packed_params, reduce_range=kind)
    return y if y.dtype is x.dtype else y.to(x.dtype)


@functools.cache
def _int8_kinds() -> dict[type, bool]:
    """The int8 layer classes :func:`quantize` makes -> the ``reduce_range`` each one's forward passes."""
    from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear

    return {DynamicLinear: True, __getattr__("FullRangeLinear"): False}


def is_int8_linear(m: nn.Module) -> bool:
    """Whether ``m`` is one of the int8 layers :func:`quantize` makes (torch's dynamic int8 Linear, qint8
    weights, or multihead's full-range subclass of it), so :func:`linear` and :func:`fused` compute it."""
    return type(m) in _int8_kinds() and m._packed_params.dtype == torch.qint8


def _bias(m: nn.Module) -> Tensor | None:
    b = m.bias
    return b() if callable(b) else b  # torch's int8 Linear keeps its bias behind a method


@functools.cache
def _full_range_linear_class():
    """The one FullRangeLinear class of the process (a second class would not be one of :func:`_int8_kinds`: every
    call of :func:`__getattr__` made a new one, so a model quantized before the first :func:`is_int8_linear` was
    not int8 to it)."""
    from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear

    class FullRangeLinear(DynamicLinear):
        """torch's dynamic int8 Linear with activations quantized to all 8 bits (see the module's
        docstring; used only where :func:`full_range_exact` holds)."""

        def forward(self, x):
            return _kernel(x, self._packed_params._packed_params, reduce_range=False).to(x.dtype)

    FullRangeLinear.__module__ = __name__
    FullRangeLinear.__qualname__ = "FullRangeLinear"
    return FullRangeLinear


_EXACT: dict[str, bool] = {}


def _kernel(x, packed, *, reduce_range: bool):
    """torch's dynamic int8 Linear kernel (the one function every int8 call here goes through)."""
    return torch.ops.quantized.linear_dynamic(x, packed, reduce_range=reduce_range)


def full_range_exact() -> bool:
    """Whether this machine's dynamic int8 Linear kernel (the current quantized engine) computes
    8-bit activations exactly: one call on inputs chosen to saturate a 16-bit pair accumulation
    (every activation at 255, every weight at 127), compared with the exact integer result.
    Measured once per engine and process."""
    engine = torch.backends.quantized.engine
    if engine not in _EXACT:
        from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear

        K = 64
        lin = nn.Linear(K, 2, bias=False)
        with torch.no_grad():
            lin.weight.fill_(1.0)
        x = torch.ones(1, K)  # quantized to 255 (scale 1/255, zero point 0); weights to 127
        with warnings.catch_warnings():  # torch.ao's deprecation notices: not the user's to act on
            warnings.simplefilter("ignore")
            q = DynamicLinear.from_float(_with_qconfig(lin))
            y = _kernel(x, q._packed_params._packed_params, reduce_range=False)
        exact = q.weight().dequantize().sum(1)  # x is exactly 255 * (1/255): y = the dequantized rows' sums
        _EXACT[engine] = bool(torch.allclose(y[0], exact, rtol=1e-4))
    return _EXACT[engine]


def _with_qconfig(lin: nn.Linear) -> nn.Linear:
    from torch.ao.quantization import per_channel_dynamic_qconfig

    lin.qconfig = per_channel_dynamic_qconfig
    return lin


def __getattr__(name: str):
    if name == "FullRangeLinear":  # made on first use: torch.ao is imported only when int8 is asked for
        cls = _full_range_linear_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)


def _linears(model: nn.Module) -> dict[str, nn.Linear]:
    """The model's nn.Linear layers that have weights to round: a layer emptied by pruning (every head of
    an attention module cut: q/k/v (0, E), the output projection (E, 0)) computes only its bias and stays
    float (exact, and the int8 kernels take no empty weight)."""
    return {n: m for n, m in model.named_modules() if type(m) is nn.Linear and m.weight.numel() > 0}


def is_quantized(model: nn.Module) -> str | None:
    """The dtype ``model`` was quantized to, or None."""
    return model.__dict__.get(KEY)


class _RowInt8(nn.Module):
    """A weight (out, in) rounded as ``quantize`` stores it: int8, symmetric, one scale per output
    row; the gradient passes straight through the rounding."""

    def forward(self, w: Tensor) -> Tensor:
        scale = (w.detach().abs().amax(1) / 127.5).clamp_min(1e-12).float()  # (out,)
        zero = torch.zeros_like(scale, dtype=torch.int32)
        return torch.fake_quantize_per_channel_affine(w, scale, zero, 0, -128, 127)


def _activation_int8(module: nn.Module, args: tuple):
    """The input rounded as the dynamic int8 kernel rounds it on each call: one affine scale for
    the whole tensor from its min and max (uint8; 7 bits where the kernel would saturate 8)."""
    (x,) = args
    lo, hi = x.detach().amin().clamp_max(0.0), x.detach().amax().clamp_min(0.0)
    qmax = 255 if full_range_exact() else 127
    scale = float((hi - lo) / qmax) or 1.0
    zero = int(min(qmax, max(0, round(-float(lo) / scale))))
    return (torch.fake_quantize_per_tensor_affine(x, scale, zero, 0, qmax),)


@contextlib.contextmanager
def fake_quantized(model: nn.Module, dtype: str = "int8"):
    """Inside the block every ``nn.Linear`` of ``model`` computes with its weight and its input
    rounded as :func:`quantize` will round them (weights per output row, activations per call),
    gradients passing straight through: training inside it (``prune --hf --recover N --quantize
    int8``'s distillation) fits the model the int8 layers will run. The weights themselves stay
    float and are left as trained when the block ends."""
    check_dtype(dtype)
    linears = list(_linears(model).values())
    hooks = []
    try:
        for m in linears:
            parametrize.register_parametrization(m, "weight", _RowInt8())
            hooks.append(m.register_forward_pre_hook(_activation_int8))
        yield model
    finally:
        for h in hooks:
            h.remove()
        for m in model.modules():
            if parametrize.is_parametrized(m, "weight"):
                parametrize.remove_parametrizations(m, "weight", leave_parametrized=False)
