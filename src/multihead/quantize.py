"""Integer arithmetic for prediction: the Linear layers of a (pruned) model in int8.

``quantize(model, "int8")`` returns a copy whose ``nn.Linear`` layers compute with int8
weights (one scale per output row) and int8 activations quantized per call (dynamic
quantization, PyTorch's fbgemm/onednn kernels on CPU); attention, norms and embeddings stay in
float. Measured on all-MiniLM-L6-v2 (README, Performance): mean cosine 0.975 to the float model
unpruned, about 2x the float model's speed at batch 16 on 2 cores. Quantize last: a quantized
model is for prediction (no gradients, no further pruning).

PyTorch marks its quantized-tensor API deprecated (torch.ao, issue 184982) in favour of torchao;
the kernels used here are the ones torch 2.13 ships. The deprecation notice is silenced around
the conversion only, so it does not reach a user who asked for int8.
"""

from __future__ import annotations

import contextlib
import copy
import warnings

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

__all__ = ["DTYPES", "fake_quantized", "is_quantized", "quantize"]

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
        q = quantize_dynamic(copy.deepcopy(model).eval(), {nn.Linear: per_channel_dynamic_qconfig}, inplace=True)
    q.__dict__[KEY] = dtype
    return q


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
    the whole tensor from its min and max (uint8; 7 bits where the engine reduces the range)."""
    (x,) = args
    lo, hi = x.detach().amin().clamp_max(0.0), x.detach().amax().clamp_min(0.0)
    qmax = 127 if torch.backends.quantized.engine in ("fbgemm", "x86") else 255
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
    linears = [m for m in model.modules() if type(m) is nn.Linear]
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
