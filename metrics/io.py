"""Writing results: the flat summary JSON and the per-request records file.

Both writers have a check that runs before the work they record
(:func:`check_output_path`), so a bad path fails at once instead of after a run.
"""

from __future__ import annotations

import importlib.util
import json
import math
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pandas as pd
else:
    from roseinfer.metrics.lazy import pandas as pd


RECORD_SUFFIXES = (".csv", ".parquet")
FORMULA_PREFIXES = ("=", "+", "-", "@", "\t", "\r")
"""Leading characters that make a spreadsheet run a CSV cell as a formula (OWASP
"CSV Injection"); such string cells are written with a leading ``'``."""


def check_output_path(path: Path, flag: str, suffixes: tuple[str, ...] = ()) -> None:
    """Check that ``path`` can be written later, without writing anything.

    Args:
        path: the file a run will write (missing parent folders are created then).
        flag: the option that named it, for the message (e.g. ``"--save-result"``).
        suffixes: allowed extensions (lower case); empty allows any.

    Raises:
        ValueError: naming ``flag`` when ``path`` is a directory, has another
            extension, sits under a file, or cannot be written (a temporary file
            is created and removed in its nearest existing folder to find out).
    """
    if suffixes and path.suffix.lower() not in suffixes:
        raise ValueError(
            f"{flag} {path}: unsupported extension {path.suffix or '(none)'!r}; "
            f"use {' or '.join(suffixes)}"
        )
    if path.suffix.lower() == ".parquet" and importlib.util.find_spec("pyarrow") is None:
        raise ValueError(f"{flag} {path}: .parquet needs pyarrow; pip install pyarrow or use .csv")
    if path.is_dir():
        raise ValueError(f"{flag} {path}: is a directory; give a file name inside it")
    if path.exists():
        _probe(flag, path, lambda: path.open("a").close())  # NOTE: "a" leaves the file as is
        return
    folder = _nearest_existing(path.parent)
    if not folder.is_dir():
        raise ValueError(f"{flag} {path}: {folder} is a file, not a folder; fix the path")
    # NOTE: a real file probe, not os.access: root passes os.access on read-only mounts.
    _probe(flag, path, lambda: tempfile.TemporaryFile(dir=folder).close())


def _probe(flag: str, path: Path, touch: Callable[[], None]) -> None:
    try:
        touch()
    except OSError as err:
        reason = err.strerror or type(err).__name__
        raise ValueError(
            f"{flag} {path}: cannot be written ({reason}); choose another path"
        ) from None


def _nearest_existing(folder: Path) -> Path:
    """``folder`` or its closest ancestor that exists."""
    folder = folder.absolute()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return folder


def write_result(result: dict[str, Any], path: Path) -> None:
    """Write a flat result dict as strict JSON, creating parent folders.

    Non-finite floats (NaN, +-inf, at any depth) become ``null``: JSON has no
    such values, and ``Infinity`` would make the file unreadable to strict parsers.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(_finite(result), indent=2, default=str, allow_nan=False)
    path.write_text(text + "\n")


def _finite(value: Any) -> Any:
    """``value`` with every non-finite float replaced by None (dicts and lists walked)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def write_records(records: pd.DataFrame, path: Path) -> None:
    """Write records as CSV (token times space-separated) or Parquet, by extension.

    ``token_times_s`` becomes space-separated seconds in CSV and a list in
    Parquet; token-id lists, when kept, are JSON lists in CSV. In CSV, string
    cells starting with a formula character (:data:`FORMULA_PREFIXES`, e.g. a
    trace's ``request_id`` ``=HYPERLINK(...)``) get a leading ``'``; numbers
    are written as they are.

    Raises:
        ValueError: on an extension other than ``.csv`` or ``.parquet``.
    """
    suffix = path.suffix.lower()
    if suffix not in RECORD_SUFFIXES:
        raise ValueError(f"records need a .csv or .parquet file name, got {path.name!r}")
    path.parent.mkdir(parents=True, exist_ok=True)
    frame = records.copy()
    if suffix == ".parquet":
        frame["token_times_s"] = [list(map(float, t)) for t in frame["token_times_s"]]
        frame.to_parquet(path, index=False)
        return
    for column in frame.columns:
        if column != "token_times_s" and not pd.api.types.is_numeric_dtype(frame[column]):
            frame[column] = [escape_formula(v) for v in frame[column]]
    frame["token_times_s"] = [" ".join(f"{x:.6f}" for x in t) for t in frame["token_times_s"]]
    frame.to_csv(path, index=False)


def escape_formula(value: Any) -> Any:
    """A string starting with a formula character gets a leading ``'``; anything
    else (numbers, None, lists, other strings) is returned unchanged."""
    if isinstance(value, str) and value.startswith(FORMULA_PREFIXES):
        return "'" + value
    return value
