"""A key/value cache for incremental decoding, passed into ``forward`` (never module state).

    cache = multihead.KVCache(model, batch_size=B, max_len=256)
    for t in range(steps):
        y = decoder_layer(x_t, cache=cache)   # each MultiHeadAttention call: cache=cache

Per attention module of ``model`` it holds preallocated keys (B, Hkv, Lmax, D) and values
(B, Hkv, Lmax, Dv), GQA-aware (Hkv heads, not H). Self-attention appends the step's
projected keys and values and attends to every cached position plus its own
(bottom-right causal); cross-attention projects its memory once, on the first call,
and reuses it.
"""

from __future__ import annotations

from torch import Tensor, nn

from multihead.core import validation
from multihead.layer.hooks import hooked_modules

__all__ = ["KVCache"]


class _Layer:
    """One module's cache: k (B, Hkv, Lmax, D), v (B, Hkv, Lmax, Dv), ``length`` positions filled;
    or, for cross-attention, the projected memory (``static``). ``step``: what the module's last
    self-attention step was planned on, when its plan may be run again unchanged (see
    :meth:`multihead.MultiHeadAttention.forward`), else None; ``chosen``: the registry's choice for such a step
    (:class:`multihead.backends.registry.Kept`)."""

    def __init__(self, name: str):
        self.name = name
        self.k: Tensor | None = None
        self.v: Tensor | None = None
        self.length = 0
        self.static: tuple[Tensor, Tensor] | None = None
        self.step: tuple | None = None
        self.chosen: tuple | None = None

    def __getstate__(self) -> dict:
        """A copy (``copy.deepcopy(cache)``, to fork a decoding) or a pickle carries the cached positions, not
        what the last step was planned on: that names the model's projection modules, which would be copied
        with it. The copy's first step is planned in full."""
        state = self.__dict__.copy()
        state["step"] = state["chosen"] = None
        return state

    def push(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write k (B, Hkv, n, D), v (B, Hkv, n, Dv) after the filled positions (checked by the caller:
        the buffers exist, match and have room) -> every cached key (B, Hkv, L, D) and value
        (B, Hkv, L, Dv), L = length + n."""
        start, end = self.length, self.length + k.shape[2]
        self.k.narrow(2, start, end - start).copy_(k)  # (B, Hkv, n, D) into positions start..end
        self.v.narrow(2, start, end - start).copy_(v)
        self.length = end
        return self.k.narrow(2, 0, end), self.v.narrow(2, 0, end)  # (B, Hkv, L, D), (B, Hkv, L, Dv)


class KVCache:
    """Keys and values of past positions for every attention module of ``model``.

    Args:
        model: the model (or a single module) whose multihead attention modules will use it;
            a module outside it is refused.
        batch_size: B, the batch every step must have.
        max_len: Lmax, the most positions a self-attention layer can hold.
    """

    def __init__(self, model: nn.Module, batch_size: int, max_len: int):
        self.batch_size = validation.positive_int("batch_size", batch_size)
        self.max_len = validation.positive_int("max_len", max_len)
        if not isinstance(model, nn.Module):
            raise TypeError(f"KVCache(model, batch_size, max_len) takes the model (an nn.Module; several modules: "
                            f"an nn.ModuleList); got {type(model).__name__}.")
        self._names = {id(m): n or type(m).__name__ for n, m in hooked_modules(model).items()}
        if not self._names:
            raise ValueError(f"{type(model).__name__} has no multihead attention module to cache for.")
        self._model = type(model).__name__
        self._layers: dict[int, _Layer] = {}

    def layer(self, module: nn.Module) -> _Layer:
        """This module's cache (created on first use); a module of another model is refused."""
        key = id(module)
        if key not in self._names:
            raise ValueError(f"this KVCache was made for {self._model}, and this {type(module).__name__} is not one "
                             f"of its attention modules ({', '.join(list(self._names.values())[:4])}...); make a "
                             "KVCache for the model that holds the module.")
        if key not in self._layers:
            self._layers[key] = _Layer(self._names[key])
        return self._layers[key]

    def append(self, module: nn.Module, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Add one step's keys k (B, Hkv, n, D) and values v (B, Hkv, n, Dv) to ``module``'s
        cache -> every cached key (B, Hkv, L, D) and value (B, Hkv, L, Dv), L = length + n."""
        layer = self.layer(module)
        B, Hkv, n, D = k.shape
        if B != self.batch_size or layer.length + n > self.max_len:
            self.check(module, B, n)  # raises, naming what does not fit
        if layer.k is None:
            layer.k = k.new_zeros(B, Hkv, self.max_len, D)  # (B, Hkv, Lmax, D)
            layer.v = v.new_zeros(B, Hkv, self.max_len, v.shape[-1])  # (B, Hkv, Lmax, Dv)
        elif layer.k.shape[1] != Hkv or layer.k.shape[3] != D:
            raise ValueError(f"{layer.name}: the cache holds Hkv={layer.k.shape[1]} heads of D={layer.k.shape[3]}; this "
                             f"step has {Hkv} of {D} (the module changed: make a new KVCache).")
        return layer.push(k, v)

    def again(self, module: nn.Module, step: tuple) -> _Layer | None:
        """``module``'s cache when its last self-attention step was planned on ``step`` (and may run
        again unchanged) and one more position fits; else None (the call is planned in full)."""
        layer = self._layers.get(id(module))
        if layer is None or layer.step != step or layer.length >= self.max_len:
            return None
        return layer

    def check(self, module: nn.Module, B: int, n: int) -> None:
        """Refuse a step of B sequences and n new positions that the cache cannot take (before any computation)."""
        layer = self.layer(module)
        if B != self.batch_size:
            raise ValueError(f"the cache holds batches of {self.batch_size}; this step has B={B}. Make a KVCache with "
                             f"batch_size={B}, or keep the batch size fixed while decoding.")
        if layer.length + n > self.max_len:
            raise ValueError(f"{layer.name}: {layer.length} cached positions + {n} new ones exceed max_len="
                             f"{self.max_len}; make the KVCache with a larger max_len.")

    def memory(self, module: nn.Module) -> tuple[Tensor, Tensor] | None:
        """Cross-attention's projected memory (k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv)), or None before the first call."""
        return self.layer(module).static

    def set_memory(self, module: nn.Module, k: Tensor, v: Tensor) -> None:
        if k.shape[0] != self.batch_size:
            raise ValueError(f"the cache holds batches of {self.batch_size}; the memory has B={k.shape[0]}.")
        self.layer(module).static = (k, v)

    def length(self, module: nn.Module) -> int:
        """Positions cached for ``module``."""
        return self.layer(module).length

    def reset(self) -> None:
        """Forget every cached position (the buffers are kept)."""
        for layer in self._layers.values():
            layer.length, layer.static, layer.step, layer.chosen = 0, None, None, None

    def __repr__(self) -> str:
        filled = {layer.name: layer.length for layer in self._layers.values()}
        return f"KVCache(batch_size={self.batch_size}, max_len={self.max_len}, cached={filled})"
