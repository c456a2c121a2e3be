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
"""

from __future__ import annotations

import importlib
import types
from typing import Any


class LazyModule(types.ModuleType):
    """A stand-in for the module named ``name``: every attribute it lacks is read
    from the real module, imported (once, by ``importlib``) on that first read."""

    def __getattr__(self, attr: str) -> Any:
        return getattr(importlib.import_module(self.__name__), attr)


pandas = LazyModule("pandas")
tqdm = LazyModule("tqdm")
