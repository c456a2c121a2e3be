"""roseinfer: a lab for LLM-serving scheduling policies.

One set of pluggy policy plugins drives two backends: a discrete-event
simulator (``roseinfer.simulator``) and a real PyTorch executor
(``roseinfer.executor``). This package is the shared, device-free core:
requests, KV block accounting, the scheduler and the plugin interface.

Plugins write ``from roseinfer import hookimpl``.
"""

from roseinfer.hookspecs import hookimpl, hookspec

__version__ = "0.1.0"
__all__ = ["hookimpl", "hookspec", "__version__"]
