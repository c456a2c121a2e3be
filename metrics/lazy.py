"""Heavy libraries imported on first use, so commands that never touch them start fast.

``from roseinfer.metrics.lazy import pandas as pd`` binds a module object whose
first attribute access imports pandas, so a module can name pandas at its top
without every command that imports it paying for it: ``rose-sim --help`` and a
refused flag no longer import pandas and pyarrow (``rose-sim --help`` 0.23 s
against 0.47 s before, best of 5, QUIET, 2 cores), nor does a simulation, whose
records stay columns (``SimResult.columns``) that ``summarize`` reads as they
are. Type checkers see the real module through an ``if TYPE_CHECKING`` import
beside it::

    if TYPE_CHECKING:
        import pandas as pd
    else:
        from roseinfer.metrics.lazy import pandas as pd

A package whose ``__init__`` re-exports its submodules' names binds them the
same way with :func:`lazy_exports`, so importing one light submodule does not
load the package's heavy ones.
"""

from __future__ import annotations

import importlib
import types
from collections.abc import Callable, Mapping
from typing import Any


class LazyModule(types.ModuleType):
    """A stand-in for the module named ``name``: every attribute it lacks is read
    from the real module, imported (once, by ``importlib``) on that first read."""

    def __getattr__(self, attr: str) -> Any:
        return getattr(importlib.import_module(self.__name__), attr)


pandas = LazyModule("pandas")
tqdm = LazyModule("tqdm")


def lazy_exports(
    package: str, homes: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A module ``__getattr__`` and ``__dir__`` (PEP 562) for ``package``: an
    exported name is imported from its module on first use, then kept in the
    package's namespace.

    Args:
        package: the package's ``__name__``.
        homes: exported name -> the module defining it, relative to ``package``
            when it starts with a dot (``".schema"``), absolute otherwise.

    Returns:
        ``(__getattr__, __dir__)``; ``__getattr__`` raises AttributeError for a
        name not in ``homes``.
    """
    namespace = importlib.import_module(package).__dict__

    def __getattr__(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(home, package), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *homes})

    return __getattr__, __dir__
