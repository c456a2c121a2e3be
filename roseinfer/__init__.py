"""roseinfer: a lab for LLM-serving scheduling policies.

One set of pluggy policy plugins drives two backends: a discrete-event
simulator (``roseinfer.simulator``) and a real PyTorch executor
(``roseinfer.executor``). This package is the shared, device-free core:
requests, KV block accounting, the scheduler and the plugin interface.

Plugins write ``from roseinfer import hookimpl``.
"""

from roseinfer import _core

_core.install()  # the compiled core or the pure-Python one, before any core module loads

from roseinfer.hookspecs import hookimpl, hookspec  # noqa: E402

__version__ = "0.1.0"
__all__ = ["hookimpl", "hookspec", "__version__"]
