"""The documented door to context parallel (it lives in :mod:`multihead.core.ring`)::

    from multihead import distributed as cp
"""

from multihead.core.ring import *  # noqa: F403 - the door re-exports the module's public names
from multihead.core.ring import __all__  # noqa: F401
