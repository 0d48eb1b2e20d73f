"""MultiHeadAttention: project, attend, merge the heads, project.

Inputs are (B, L, E). A call is planned once (:meth:`MultiHeadAttention.plan`, a
:class:`multihead.layer.plan.Plan`: dense, packed, cached or sharded) and ``forward`` executes that plan;
``explain`` shows the same plan. The projections give (B, L, H, D); the one attention call
(:meth:`AttentionCore._attend`) runs the functional core on (B, H, L, D) views, or
:func:`multihead.core.varlen.attention_varlen` on packed tokens (N, H, D) when padding
need not be computed, or ring attention on sequence shards; the heads are merged and projected.

Dependency order (each file imports only those before it): masks -> checks ->
backends -> functional -> varlen -> distributed -> plan -> hooks -> modules.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from multihead import backends
from multihead.backends import registry
from multihead.core import validation, varlen
from multihead.core.functional import run
from multihead.core.ring import Sharded
from multihead.layer import plan as planning
from multihead.layer.cache import KVCache
from multihead.layer.hooks import AttentionHooks
from multihead.layer.plan import Plan

__all__ = ["AttentionCore", "MultiHeadAttention", "transpose_qkv", "transpose_output"]


def transpose_qkv(X: Tensor, num_heads: int) -> Tensor:
    """Split the heads and fold them into the batch, as the course does:
    (B, L, H*D) -> (B*H, L, D), sequence b's head h at index b*H + h."""
    X = X.reshape(X.shape[0], X.shape[1], num_heads, -1)  # (B, L, H*D) -> (B, L, H, D)
    X = X.permute(0, 2, 1, 3)  # (B, L, H, D) -> (B, H, L, D)
    return X.reshape(-1, X.shape[2], X.shape[3])  # (B, H, L, D) -> (B*H, L, D)


def transpose_output(X: Tensor, num_heads: int) -> Tensor:
    """Undo :func:`transpose_qkv`: (B*H, L, D) -> (B, L, H*D)."""
    X = X.reshape(-1, num_heads, X.shape[1], X.shape[2])  # (B*H, L, D) -> (B, H, L, D)
    X = X.permute(0, 2, 1, 3)  # (B, H, L, D) -> (B, L, H, D)
    return X.reshape(X.shape[0], X.shape[1], -1)  # (B, L, H, D) -> (B, L, H*D)


def linear(in_features: int, out_features: int, bias: bool, **factory) -> nn.Linear:
    """nn.Linear that may have no rows or columns (a layer whose heads were all pruned) without
    torch's "Initializing zero-element tensors is a no-op" warning reaching the user: an empty
    weight has nothing to initialise. factory: device, dtype."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Initializing zero-element tensors is a no-op")
        return nn.Linear(in_features, out_features, bias=bias, **factory)


def _linear(in_features: int | None, out_features: int, bias: bool) -> nn.Module:
    """nn.Linear, or nn.LazyLinear (becomes nn.Linear on the first call) when the input size is not given."""
    if in_features is None:
        return nn.LazyLinear(out_features, bias=bias)
    return linear(in_features, out_features, bias)


_GLOBAL_HOOKS = (nn.modules.module._global_forward_hooks, nn.modules.module._global_forward_pre_hooks,
                 nn.modules.module._global_forward_hooks_always_called, nn.modules.module._global_backward_hooks,
                 nn.modules.module._global_backward_pre_hooks)


def _bare(lin: nn.Module, no_global_hooks: bool) -> tuple[Tensor, Tensor | None] | None:
    """(weight, bias) of a plain nn.Linear that no hook could observe (forward or backward, its own or
    global): F.linear with them is then the same as calling it; None otherwise. Read from the
    module's parameter table (``lin.weight`` goes through nn.Module.__getattr__, ~1.5 us each here)."""
    if not no_global_hooks or type(lin) is not nn.Linear or (lin._forward_hooks or lin._forward_pre_hooks or
                                                             lin._backward_hooks or lin._backward_pre_hooks):
        return None
    p = lin._parameters
    w = p.get("weight")
    return None if w is None or "bias" not in p else (w, p["bias"])


def _apply(lin: nn.Module, x: Tensor, no_global_hooks: bool) -> Tensor:
    """``lin(x)``; a plain nn.Linear is applied as F.linear directly (the module call machinery is a
    third of a toy-size projection's time)."""
    if (wb := _bare(lin, no_global_hooks)) is not None:
        return F.linear(x, *wb)
    return lin(x)


class AttentionCore:
    """The one place every multihead module attends: :class:`MultiHeadAttention`,
    the course's compat modules and the torch.nn drop-in call :meth:`_attend` with
    per-head tensors made by their own projections and a mask they have validated.

    Attributes it needs (set by :meth:`_init_core` and the module): ``num_heads``,
    ``value_head_dim``, ``dropout`` (float), ``scale`` (float or None), ``backend``,
    ``training`` and ``attention_hooks`` (:class:`multihead.layer.hooks.AttentionHooks`)."""

    #: every multihead attention module alive (weakly held), for ``capture()`` without a model;
    #: no forward reads it
    _alive: weakref.WeakSet = weakref.WeakSet()

    def _init_core(self, *, dropout, scale, backend: str) -> None:
        self.dropout = validation.valid_dropout(dropout)
        self.scale = validation.valid_scale(scale)
        if backend != "auto":
            backends.get(backend)  # an unknown name lists the valid ones
        self.backend = backend
        self.attention_hooks = AttentionHooks()
        AttentionCore._alive.add(self)

    @staticmethod
    def alive() -> list:
        """Every multihead attention module alive now."""
        return list(AttentionCore._alive)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, mask, plan: Plan | None = None, *,
                heads_first: bool = False) -> Tensor:
        """The one attention call, with the module's hooks around it, as ``plan`` says (None: a dense call
        under ``mask``, the drop-in's).

        Dense: q (B, Lq, H, D), k (B, Lk, Hkv, D), v (B, Lk, Hkv, Dv) -> (B, Lq, H, Dv);
        with ``heads_first`` k and v come as (B, Hkv, Lk, D), (B, Hkv, Lk, Dv) (a KV cache's layout);
        sharded: they are this rank's shards and the call is ring attention over the whole sequence.
        Packed: q (Nq, H, D), k (Nk, Hkv, D), v (Nk, Hkv, Dv) -> (Nq, H, Dv), the plan's schedule run."""
        hooks = self.attention_hooks
        p = self.dropout if self.training else 0.0
        if self.num_heads == 0:  # every head pruned (multihead.heads.prune): nothing to attend
            return q.new_zeros(*q.shape[:-2], 0, self.value_head_dim)
        if plan is not None and plan.packed is not None:
            return self._attend_packed(q, k, v, plan, p)
        sharded = None if plan is None else plan.sharded
        q = q.transpose(1, 2)  # (B, Lq, H, D) -> (B, H, Lq, D)
        if not heads_first:
            k, v = k.transpose(1, 2), v.transpose(1, 2)  # (B, Lk, Hkv, d) -> (B, Hkv, Lk, d)
        if hooks.inputs:
            q, k, v = hooks.transform_inputs(self, q, k, v)
        if hooks.observers:
            hooks.observe(self, q, k, mask, self.scale)
        if sharded is None:
            out = run(q, k, v, mask, scale=self.scale, dropout_p=p, backend=self.backend)  # (B, H, Lq, Dv)
        else:
            out = sharded.attention(q, k, v, mask, scale=self.scale)  # (B, H, Lq, Dv)
        out = out.transpose(1, 2)  # (B, H, Lq, Dv) -> (B, Lq, H, Dv)
        if hooks.transforms:
            live = None if mask is None else self._query_keep(mask, out.shape[1], out.device, sharded)  # (B, Lq)
            out = hooks.transform(self, out, live)
        return out

    def _attend_packed(self, q: Tensor, k: Tensor, v: Tensor, plan: Plan, p: float) -> Tensor:
        """The packed layout: q (Nq, H, D), k (Nk, Hkv, D), v (Nk, Hkv, Dv) -> (Nq, H, Dv), the plan's schedule."""
        hooks, packed = self.attention_hooks, plan.packed
        if hooks.inputs:
            raise ValueError(f"{type(self).__name__}: an input transform (path patching) takes a padded call; this one "
                             "is packed (masks.Padding or a padding-free model): pass a mask that keeps it padded.")
        if hooks.observers:
            qp, kp = packed.padded(q, k)  # (B, H, Lq, D), (B, Hkv, Lk, D)
            hooks.observe(self, qp, kp, packed.mask, self.scale)
        out = varlen.run_schedule(q, k, v, plan.schedule, scale=self.scale, dropout_p=p,
                                  backend=self.backend)  # (Nq, H, Dv)
        return hooks.transform(self, out, None) if hooks.transforms else out

    def _check_sharded(self) -> None:
        """What sequence-sharded inputs cannot do, refused before any computation."""
        if self.training and self.dropout > 0:
            raise ValueError(f"dropout={self.dropout} on the attention weights is not supported on sequence-sharded "
                             "inputs (context_parallel); call model.eval(), or build the module with dropout=0.")
        if self.backend != "auto":
            raise ValueError(f"backend={self.backend!r} cannot run on sequence-sharded inputs: their attention is "
                             "ring attention (multihead.distributed), which picks its own kernels; set the module's "
                             "backend to 'auto' for the sharded call.")
        if self.attention_hooks.observers:
            raise ValueError("capture() cannot record weights on sequence-sharded inputs (context_parallel: each rank "
                             "sees a shard of the keys); gather the inputs and capture on one process.")

    @staticmethod
    def _query_keep(mask, Lq: int, device, sharded: Sharded | None) -> Tensor | None:
        """(B, Lq) True = a real query row (``Padding``'s padded rows come out as zeros), None = every
        row is real; by global position on sequence-sharded inputs."""
        if mask is None:
            return None
        return mask.query_keep(Lq, device) if sharded is None else sharded.query_keep(mask, Lq, device)


class MultiHeadAttention(AttentionCore, nn.Module):
    """Multi-head attention (Vaswani et al. 2017), as the course builds it.

    ``h`` learned projections of queries, keys and values, scaled dot-product
    attention for every head in parallel, the heads concatenated and projected:

        q_proj: query_size -> H*D     k_proj: key_size -> Hkv*D
        v_proj: value_size -> Hkv*Dv  o_proj: H*Dv -> out_features

    Args:
        num_hiddens: the model size E; the output size unless ``out_features`` is
            given, and H*D unless ``head_dim`` is given.
        num_heads: H, the number of query heads.
        dropout: dropout rate on the attention weights, applied only in training.
        bias: whether the four projections have biases.
        query_size, key_size, value_size: input sizes; None = inferred on the
            first call (as the course's MXNet/DJL versions and Keras do).
        num_kv_heads: Hkv (grouped-query attention; 1 = multi-query); default H.
        head_dim: D, the query/key size of a head; default num_hiddens // num_heads.
        value_head_dim: Dv, the value size of a head; default D.
        out_features: size of the output; default num_hiddens.
        scale: multiplies the scores; default 1/sqrt(D).
        backend: "auto" or a registered backend name (see :func:`multihead.explain`).

    The ViT notebook's ``MultiHeadAttention(d_model, num_head, d_k)`` (with bias)
    is ``MultiHeadAttention(num_hiddens=d_model, num_heads=num_head, head_dim=d_k,
    bias=True, out_features=d_model)``.
    """

    #: attribute names of the q, k, v and output projections (compat classes rename them)
    _proj_names = ("q_proj", "k_proj", "v_proj", "o_proj")

    def __init__(
        self,
        num_hiddens: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = False,
        *,
        query_size: int | None = None,
        key_size: int | None = None,
        value_size: int | None = None,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        value_head_dim: int | None = None,
        out_features: int | None = None,
        scale: float | None = None,
        backend: str = "auto",
    ):
        super().__init__()
        num_hiddens = validation.positive_int("num_hiddens", num_hiddens)
        H = validation.positive_int("num_heads", num_heads)
        if not isinstance(bias, bool):  # bias="no" is truthy: it gave every projection a bias
            raise TypeError(f"bias must be True or False; got {bias!r}.")
        for name, v in (("query_size", query_size), ("key_size", key_size), ("value_size", value_size),
                        ("head_dim", head_dim), ("value_head_dim", value_head_dim), ("out_features", out_features),
                        ("num_kv_heads", num_kv_heads)):
            validation.positive_int(name, v, optional=True)
        if head_dim is None and num_hiddens % H:
            raise ValueError(
                f"num_hiddens={num_hiddens} is not divisible by num_heads={H}; choose num_heads that divides "
                "num_hiddens, or give head_dim."
            )
        Hkv = H if num_kv_heads is None else int(num_kv_heads)
        if H % Hkv:
            raise ValueError(f"num_heads={H} must be a multiple of num_kv_heads={Hkv} (grouped-query attention).")
        self._init_core(dropout=dropout, scale=scale, backend=backend)
        D = int(head_dim) if head_dim is not None else num_hiddens // H
        Dv = int(value_head_dim) if value_head_dim is not None else D
        self.num_hiddens = num_hiddens
        self.num_heads, self.num_kv_heads, self.head_dim, self.value_head_dim = H, Hkv, D, Dv
        self.built_heads = (H, Hkv)  # the counts it was built with; pruning changes num_heads, num_kv_heads
        self.out_features = int(out_features) if out_features is not None else num_hiddens
        q, k, v, o = self._proj_names
        setattr(self, q, _linear(query_size, H * D, bias))
        setattr(self, k, _linear(key_size, Hkv * D, bias))
        setattr(self, v, _linear(value_size, Hkv * Dv, bias))
        setattr(self, o, linear(H * Dv, self.out_features, bias))

    def projections(self) -> tuple[nn.Module, nn.Module, nn.Module, nn.Module]:
        """The (q, k, v, o) projections, whatever they are named (read on every call,
        so a replaced or quantized projection is the one that runs)."""
        mods = self._modules
        q, k, v, o = self._proj_names
        return mods[q], mods[k], mods[v], mods[o]

    def extra_repr(self) -> str:
        s = f"num_heads={self.num_heads}, head_dim={self.head_dim}"
        if self.num_kv_heads != self.num_heads:
            s += f", num_kv_heads={self.num_kv_heads}"
        if self.value_head_dim != self.head_dim:
            s += f", value_head_dim={self.value_head_dim}"
        return s + f", dropout={self.dropout}, backend={self.backend!r}"

    def plan(self, queries: Tensor, keys: Tensor | None = None, values: Tensor | None = None,
             valid_lens: Tensor | None = None, *, mask=None, cache: KVCache | None = None,
             sharded: Sharded | None = None) -> Plan:
        """How :meth:`forward` with these arguments runs (checked as forward checks them; nothing is
        projected or computed): a :class:`multihead.layer.plan.Plan`."""
        call = planning.Call(queries, keys, values, valid_lens, mask, cache, sharded)
        return planning.make(self, self.projections(), call)[0]

    def _project(self, projs, plain: bool, queries: Tensor, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(..., Lq, query_size), (..., Lk, key_size), (..., Lk, value_size) ->
        q (..., Lq, H, D), k (..., Lk, Hkv, D), v (..., Lk, Hkv, Dv)."""
        H, Hkv, D, Dv = self.num_heads, self.num_kv_heads, self.head_dim, self.value_head_dim
        q, k, v = _apply(projs[0], queries, plain), _apply(projs[1], keys, plain), _apply(projs[2], values, plain)
        q = q.view(*q.shape[:-1], H, D)  # (..., Lq, H*D) -> (..., Lq, H, D)
        k = k.view(*k.shape[:-1], Hkv, D)  # (..., Lk, Hkv*D) -> (..., Lk, Hkv, D)
        v = v.view(*v.shape[:-1], Hkv, Dv)  # (..., Lk, Hkv*Dv) -> (..., Lk, Hkv, Dv)
        return q, k, v

    def forward(
        self,
        queries: Tensor,
        keys: Tensor | None = None,
        values: Tensor | None = None,
        valid_lens: Tensor | None = None,
        *,
        mask=None,
        cache: KVCache | None = None,
        sharded: Sharded | None = None,
    ) -> Tensor:
        """queries (B, Lq, query_size), keys (B, Lk, key_size) (default: queries),
        values (B, Lk, value_size) (default: keys) -> (B, Lq, out_features).

        valid_lens: (B,) or (B, Lq) integers, the course's masking: keys at
        positions >= the length are ignored. mask: any :mod:`multihead.masks`
        value (or a bool keep / float bias tensor broadcastable to (B, H, Lq, Lk)),
        combined with valid_lens. Under ``masks.Padding`` padded query rows come out
        as zeros.

        cache: a :class:`multihead.KVCache` for incremental decoding. Self-attention
        (no keys given) appends this step's keys and values and attends to every cached
        position plus its own (bottom-right causal; masks then cover Lk = all cached
        positions); cross-attention projects ``keys``/``values`` once and reuses them.

        sharded: a :class:`multihead.distributed.Sharded`: the inputs are this rank's shards of
        sequences spread over a process group and attention is ring attention over the whole
        sequence (:func:`multihead.distributed.context_parallel` passes it to every module of a model);
        the module's backend must then be "auto" and its attention dropout off (both refused otherwise).

        The call is planned once (:meth:`plan`; :meth:`explain` shows the same plan) and executed.
        """
        if cache is not None and keys is None and values is None and valid_lens is None and mask is None and \
                sharded is None and (out := self._step_again(queries, cache)) is not None:
            return out
        projs = self.projections()  # read once per call (a replaced or quantized projection is the one that runs)
        call = planning.Call(queries, keys, values, valid_lens, mask, cache, sharded)
        plan, queries, keys, values = planning.make(self, projs, call)
        plain = not any(_GLOBAL_HOOKS)
        if plan.layout == "cached":
            return self._step(plan, projs, plain, queries, keys, values, cache=cache)
        packed = plan.packed
        if packed is not None:  # padding is not computed: (B, L, ·) -> the real tokens (N, ·)
            queries, keys, values = packed.gather(queries, keys, values)
        q, k, v = self._project(projs, plain, queries, keys, values)  # (.., L, H, D), (.., L, Hkv, D), (.., Dv)
        out = self._attend(q, k, v, plan.mask, plan)  # (..., Lq, H, Dv)
        del q, k, v, queries, keys, values  # freed before the output projection allocates
        out = _apply(projs[3], out.flatten(-2), plain)  # merge the heads, project: (..., Lq, out_features)
        if packed is not None:
            return packed.scatter(out)  # (Nq, out) -> (B, Lq, out); padded query rows are zeros
        if (real := self._query_keep(plan.mask, out.shape[1], out.device, plan.sharded)) is not None:
            out = out.masked_fill(~real[..., None], 0.0)  # padded query rows: zeros, as on the packed path
        return out

    def _step(self, plan: Plan, projs, plain: bool, queries: Tensor, keys: Tensor, values: Tensor, *,
              cache: KVCache) -> Tensor:
        """One planned decoding step with the cache: (B, n, query_size) -> (B, n, out_features)."""
        if keys is queries:  # self-attention: the step's keys and values join the cache
            q, k, v = self._project(projs, plain, queries, keys, values)  # (B, n, H, D), (B, n, Hkv, D), (.., Dv)
            k_all, v_all = cache.append(self, k.transpose(1, 2), v.transpose(1, 2))  # (B, Hkv, Lk, D), (.., Dv)
            again = plan.mask is None and queries.shape[1] == 1 and self._repeatable(plain, queries)
            cache.layer(self).step = self._step_key(queries, projs) if again else None
        else:
            H, Hkv, D, Dv = self.num_heads, self.num_kv_heads, self.head_dim, self.value_head_dim
            memory = cache.memory(self)
            if memory is None:  # the first step projects the memory once
                B, Lk = keys.shape[0], keys.shape[1]
                k = _apply(projs[1], keys, plain).view(B, Lk, Hkv, D).transpose(1, 2)  # (B, Lk, Hkv*D) -> (B, Hkv, Lk, D)
                v = _apply(projs[2], values, plain).view(B, Lk, Hkv, Dv).transpose(1, 2)  # -> (B, Hkv, Lk, Dv)
                memory = (k, v)
                cache.set_memory(self, k, v)
            k_all, v_all = memory
            q = _apply(projs[0], queries, plain).view(*queries.shape[:2], H, D)  # (B, n, H*D) -> (B, n, H, D)
        out = self._attend(q, k_all, v_all, plan.mask, plan, heads_first=True)  # (B, n, H, Dv)
        return _apply(projs[3], out.flatten(-2), plain)  # (B, n, H*Dv) -> (B, n, out_features)

    # A decoding step planned like the previous one. Greedy decoding calls each layer once per token with
    # the same (B, 1, E) queries: the plan (checks, layout, mask, backend request) is the same every step
    # but for one more cached position. Between two big matrix-vector products every Python step runs on
    # cold caches (~1 us an attribute read on this 2-core CPU), and planning plus the registry's lookup
    # cost a 512-wide layer ~100 us a token more than a hand-written F.linear + buffers + SDPA step. So the
    # cache remembers what the last self-attention step of this module was planned on (_step_key); a step
    # with the same, no mask, and nothing that could see or change its computation (_repeatable) runs that
    # plan again: the same projections, the same cache write, the same output projection, and the backend
    # the registry chose for it (kept with the registry's generation, which any change to what "auto" picks
    # moves on: register, unregister, use(), forget, a failure), while gradients are off and the dtype holds.

    def _repeatable(self, plain: bool, queries: Tensor) -> bool:
        """Whether a one-position step of this module may run its previous plan again: no hooks (global, or the
        module's attention hooks), no attention dropout, not traced by torch.compile, a plain dense tensor, and
        heads left (gradients may be on: the plan does not depend on them, the backend's choice is the registry's)."""
        return (plain and not self.attention_hooks and self.num_heads > 0 and
                not (self.training and self.dropout > 0) and type(queries) is Tensor and not queries.is_nested and
                not torch.compiler.is_compiling())

    def _step_key(self, queries: Tensor, projs) -> tuple:
        """What a self-attention step's plan was made on beyond the cache: the queries' (B, 1, query_size)
        shape, dtype and device, the projection modules, the head counts (H, Hkv), the scale and the backend."""
        return (queries.shape, queries.dtype, queries.device, projs, self.num_heads, self.num_kv_heads, self.scale,
                self.backend)

    def _step_again(self, queries, cache) -> Tensor | None:
        """A self-attention step (B, 1, query_size) -> (B, 1, out_features) run with the plan of this module's
        previous step on ``cache``, when that plan holds (see the comment above); None when the call must be
        planned in full."""
        if type(cache) is not KVCache or not self._repeatable(not any(_GLOBAL_HOOKS), queries):
            return None
        projs = self.projections()
        layer = cache.again(self, self._step_key(queries, projs))
        if layer is None:
            return None
        q, k, v = self._project(projs, True, queries, queries, queries)  # (B, 1, H, D), (B, 1, Hkv, D), (.., Dv)
        k_all, v_all = layer.push(k.transpose(1, 2), v.transpose(1, 2))  # (B, Hkv, L, D), (B, Hkv, L, Dv)
        q = q.transpose(1, 2)  # (B, 1, H, D) -> (B, H, 1, D)
        out = registry.run_kept(layer.chosen, q, k_all, v_all)  # the registry's choice for the last such step
        if out is None:  # the registry chooses (or finds its remembered choice); the choice is kept for the next step
            out = run(q, k_all, v_all, None, scale=self.scale, dropout_p=0.0, backend=self.backend)  # (B, H, 1, Dv)
            layer.chosen = registry.keep(q, k_all, v_all, self.scale) if self.backend == "auto" else None
        return _apply(projs[3], out.transpose(1, 2).flatten(-2), True)  # (B, 1, H*Dv) -> (B, 1, out_features)

    def forward_packed(self, x: Tensor, cu_seqlens: Tensor, max_seqlen: int) -> Tensor:
        """Self-attention on packed tokens: x (N, E), sequence b being
        ``x[cu_seqlens[b]:cu_seqlens[b+1]]`` (see :func:`multihead.core.padding.unpad`) -> (N, out_features).
        Padding never exists here, so nothing is computed for it."""
        packed = varlen.Packed.self_attention(cu_seqlens, max_seqlen)
        if x.dim() != 2 or x.shape[0] != packed.cu_q[-1]:
            raise ValueError(f"x must be packed tokens (N, E) with N = cu_seqlens[-1] = {packed.cu_q[-1]}; "
                             f"got shape {tuple(x.shape)}.")
        projs, plain = self.projections(), not any(_GLOBAL_HOOKS)
        plan = planning.packed_plan(self, packed, packed.mask)
        q, k, v = self._project(projs, plain, x, x, x)  # (N, H, D), (N, Hkv, D), (N, Hkv, Dv)
        out = self._attend(q, k, v, plan.mask, plan)  # (N, H, Dv)
        return _apply(projs[3], out.flatten(-2), plain)  # (N, H*Dv) -> (N, out)

    def explain(self, queries: Tensor, keys: Tensor | None = None, values: Tensor | None = None,
                valid_lens: Tensor | None = None, *, mask=None, cache: KVCache | None = None,
                sharded: Sharded | None = None) -> planning.Explanation:
        """What :meth:`forward` with these arguments does, from the same plan (:meth:`plan`): the
        layout (dense, packed, cached, sharded) and why, the request each attention-core call makes
        (``.requests``) and which backend runs it and why not the others. ``str()`` is the text; a
        notebook shows a table. Nothing is projected or cached. On sequence-sharded inputs over
        several ranks it is collective (every rank calls it) and says what the ring does on this rank."""
        call = planning.Call(queries, keys, values, valid_lens, mask, cache, sharded)
        plan, queries, keys, values = planning.make(self, self.projections(), call)
        dtype, needs_grad = self._probe(queries, keys, values, cache if plan.layout == "cached" else None)
        H, Hkv, D, Dv = self.num_heads, self.num_kv_heads, self.head_dim, self.value_head_dim
        p = self.dropout if self.training and plan.layout != "sharded" else 0.0
        reqs = plan.requests(H=H, Hkv=Hkv, D=D, Dv=Dv, dtype=dtype, device_type=queries.device.type, dropout_p=p,
                             needs_grad=needs_grad)
        ring = None
        if plan.layout == "sharded" and plan.sharded.size > 1:
            B, Lq, Lk = queries.shape[0], queries.shape[1], keys.shape[1]
            q = queries.new_empty(B, H, Lq, D, dtype=dtype)  # (B, H, Lq, D): only shapes matter
            k = queries.new_empty(B, Hkv, Lk, D, dtype=dtype)  # (B, Hkv, Lk, D)
            v = queries.new_empty(B, Hkv, Lk, Dv, dtype=dtype)  # (B, Hkv, Lk, Dv)
            ring = plan.sharded.explain(q, k, v, plan.mask, scale=self.scale)
        return planning.explanation(plan, reqs, self.backend, ring)  # sharded: "auto" (checked by _check_sharded)

    def _probe(self, queries: Tensor, keys: Tensor, values: Tensor, cache: KVCache | None) -> tuple[torch.dtype, bool]:
        """(dtype, needs grad) of the per-head tensors the core would get: the projections applied to
        one token each in the current modes (grad, autocast), without their hooks firing (a lazy
        projection not built yet: the input's dtype, and whether anything could need grad)."""
        grad = torch.is_grad_enabled()
        dtypes, rg = [], []
        for lin, x in zip(self.projections()[:3], (queries, keys, values)):
            x1 = x[..., :1, :]  # one token: (B, 1, ·), or none when there are none
            if isinstance(lin, nn.modules.lazy.LazyModuleMixin) and lin.has_uninitialized_params():
                dtypes.append(x.dtype)
                rg.append(grad and (x.requires_grad or any(p.requires_grad for p in lin.parameters())))
                continue
            y = F.linear(x1, lin.weight, lin.bias) if type(lin) is nn.Linear else lin.forward(x1)
            dtypes.append(y.dtype)
            rg.append(y.requires_grad)
        if cache is not None:
            layer = cache.layer(self)
            if keys is not queries and (memory := cache.memory(self)) is not None:  # the cached memory is the keys
                rg[1:] = [memory[0].requires_grad, memory[1].requires_grad]
            elif keys is queries and layer.k is not None:  # the step is copied into the cache's buffers
                rg[1:] = [rg[1] or layer.k.requires_grad, rg[2] or layer.v.requires_grad]
        return dtypes[0], grad and any(rg)
