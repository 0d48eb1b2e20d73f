"""Ways of computing attention, one file each, behind one registry.

``register(name, run, supports=..., priority=...)``, ``available()``,
``use(name)`` (a context manager), ``get(name)``; :func:`multihead.explain`
reports which backend runs a call and why the others do not.

Shipped, in the order "auto" tries them: ``blocked`` (banded masks, masked
blocks skipped), ``flex`` (FlexAttention; "auto" only on CUDA), ``sdpa``
(torch's fused kernel, everything else) and ``reference`` (the float64 spec).
"""

from multihead.backends import blocked, flex, reference, sdpa  # noqa: E402,F401  (registers the built-ins)
from multihead.backends.registry import (  # noqa: F401
    Backend,
    Explanation,
    Request,
    available,
    explain_request,
    get,
    register,
    select,
    unregister,
    use,
)

__all__ = ["Backend", "Explanation", "Request", "available", "get", "register", "select", "unregister", "use"]
