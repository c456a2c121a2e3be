"""Attention launch choices shared by the processes of one machine.

The ``triton`` backend times a few launch options per kind of pass in the
warm-up (:meth:`~roseinfer.executor.attn_base.AttentionBackend.tune`) and keeps
the fastest within a margin. Timed in every process, the choice can differ from
one process to the next on the same card, so two runs compared for a policy (or a
profile and the runs it prices) may run different kernels. This file keeps the
first process's choice, keyed by everything the timing depended on (GPU, torch
and triton versions, the model's attention shape, dtype, KV block size, the
limits the tuned passes came from, the backend's options), and later processes
adopt it: their launches are the same, and their warm-up skips the timing.

Where: ``$ROSEINFER_TUNE_CACHE`` (a file path; ``off`` disables the file and
every process tunes), else ``$XDG_CACHE_HOME/roseinfer/attention-tune.json``
(``~/.cache`` without it). A damaged or unreadable file is ignored (the process
tunes) and replaced on the next write; writes go through a temporary file and a
rename, so a reader never sees half a file.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

TUNE_CACHE_ENV = "ROSEINFER_TUNE_CACHE"
TUNE_CACHE_NAME = "attention-tune.json"


def tune_cache_path() -> Path | None:
    """The cache file (see the module doc); None when ``$ROSEINFER_TUNE_CACHE`` is
    ``off``."""
    value = os.environ.get(TUNE_CACHE_ENV, "").strip()
    if value.lower() == "off":
        return None
    if value:
        return Path(value).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "roseinfer" / TUNE_CACHE_NAME


def tune_key(facts: Mapping[str, Any]) -> str:
    """The cache key of ``facts`` (JSON-able values): canonical JSON, keys sorted."""
    return json.dumps(dict(facts), sort_keys=True, separators=(",", ":"))


def _read(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def load_tuned(path: Path, key: str) -> dict[str, Any] | None:
    """The launches stored under ``key`` in ``path``; None when absent, or when the
    file is missing or unreadable."""
    entry = _read(path).get(key)
    return entry if isinstance(entry, dict) else None


def store_tuned(path: Path, key: str, launches: Mapping[str, Any]) -> bool:
    """Store ``launches`` under ``key`` in ``path`` (other keys kept). Returns
    whether it was written (False where the folder is not writable: the process
    keeps its own choice, later ones tune again)."""
    doc = _read(path)
    doc[key] = dict(launches)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        return False
    return True
