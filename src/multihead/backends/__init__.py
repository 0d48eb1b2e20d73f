"""Ways of computing attention, one file each, behind one registry.

``register(name, run, can_run=..., prefer=..., priority=...)``, ``available()``,
``use(name)`` (a context manager), ``get(name)``; :func:`multihead.explain`
reports which backend runs a call and why the others do not (a :class:`Choice`).

Shipped, in the order "auto" tries them: ``blocked`` (banded masks, masked
blocks skipped), ``flex`` (FlexAttention; "auto" only on CUDA), ``short`` (short sequences with key
padding on the CPU, prediction: scores materialized, softmax in place), ``sdpa`` (torch's fused kernel,
everything else), ``math`` (the spec in the inputs' dtype) and ``reference`` (the float64 spec).
"""

from multihead.backends import blocked, flex, reference, sdpa, short  # noqa: E402,F401  (registers the built-ins)
from multihead.backends.registry import (  # noqa: F401
    Backend,
    Choice,
    Request,
    available,
    explain_request,
    get,
    register,
    select,
    unregister,
    use,
)

__all__ = ["Backend", "Choice", "Request", "available", "get", "register", "select", "unregister", "use"]
