"""Which simulator core runs: the compiled one or the pure-Python reference.

The core's per-step modules (:data:`CORE_SOURCES`: the scheduler, the check
of policies' answers, the block manager, the step log, the drive loop and the
simulator's cost-model backend) are compiled at install time by ``setup.py``
with Cython from their own ``.py`` files, typed by the ``.pxd`` files beside
them. The ``.py`` files are the reference: they run as they are when

- ``ROSEINFER_PURE_PYTHON=1`` is set,
- the install built no compiled core (no Cython or no C compiler), or
- the sources changed since the build (an edited checkout: ``pip install -e .``
  builds again), checked against the hashes the build recorded.

:func:`core_info` says which core runs, and why, in one line. The choice is
made once, before the first core module loads, by a finder that
``roseinfer/__init__.py`` installs (an import hook on these module names only).

This module imports nothing from roseinfer (``setup.py`` reads it before the
package can be imported).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import ModuleType

CORE_SOURCES: dict[str, str] = {
    "roseinfer.sequence": "roseinfer/sequence.py",
    "roseinfer.contract": "roseinfer/contract.py",
    "roseinfer.records": "roseinfer/records.py",
    "roseinfer.block_manager": "roseinfer/block_manager.py",
    "roseinfer.scheduler": "roseinfer/scheduler.py",
    "roseinfer.driver": "roseinfer/driver.py",
    "roseinfer.simulator.engine": "simulator/engine.py",
}
"""Compiled module -> its source in the checkout, in import (cimport) order."""

PURE_ENV = "ROSEINFER_PURE_PYTHON"
BUILD_INFO = "_core_build.json"
"""Written by ``setup.py`` beside the compiled modules: each module's source
path (relative to this folder) and the SHA-256 of its ``.py`` and ``.pxd``."""


def file_digest(path: str | Path) -> str | None:
    """SHA-256 of a file's bytes (hex), or None when it does not exist."""
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None


def _decide() -> tuple[bool, str]:
    """(compiled?, the line :func:`core_info` returns)."""
    if os.environ.get(PURE_ENV, "") not in ("", "0"):
        return False, f"pure-Python core: {PURE_ENV}={os.environ[PURE_ENV]} asks for it"
    here = Path(__file__).resolve().parent
    try:
        info = json.loads((here / BUILD_INFO).read_text())
    except (OSError, ValueError):
        return False, (
            "pure-Python core: this install has no compiled core (building it needs "
            "Cython and a C compiler; pip install -e . builds it)"
        )
    for name in CORE_SOURCES:
        entry = info.get("modules", {}).get(name)
        if entry is None:
            return False, f"pure-Python core: the compiled core lacks {name} (a partial build)"
        source = here / entry["source"]
        stale = file_digest(source) != entry["py"]
        pxd = file_digest(source.with_suffix(".pxd"))
        if stale or (pxd is not None and pxd != entry["pxd"]):
            return False, (
                f"pure-Python core: {source.name} changed since the compiled core was "
                "built (pip install -e . builds it again)"
            )
    return True, f"compiled core (Cython {info.get('cython', '?')})"


COMPILED, _INFO = _decide()


def core_info() -> str:
    """One line: which core runs (compiled, or pure Python and why)."""
    return _INFO


class _PureFinder:
    """Loads the core modules from their ``.py`` files (the compiled ones, built
    beside them, would otherwise load first)."""

    def find_spec(
        self, name: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        """The ``.py`` file's spec of a core module; None for any other module."""
        if name not in CORE_SOURCES or not path:
            return None
        leaf = name.rpartition(".")[2] + ".py"
        for folder in path:
            source = os.path.join(folder, leaf)
            if os.path.exists(source):
                return importlib.util.spec_from_file_location(name, source)
        return None


def install() -> None:
    """Make the core modules load as :data:`COMPILED` says (idempotent)."""
    if not COMPILED and not any(isinstance(f, _PureFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _PureFinder())
