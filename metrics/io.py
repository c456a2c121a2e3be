"""Writing results: the flat summary JSON and the per-request records file."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pandas as pd

RECORD_SUFFIXES = (".csv", ".parquet")


def write_result(result: dict[str, Any], path: Path) -> None:
    """Write a flat result dict as JSON (NaN becomes null), creating parent folders."""
    clean = {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in result.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(clean, indent=2, default=str) + "\n")


def write_records(records: pd.DataFrame, path: Path) -> None:
    """Write records as CSV (token times space-separated) or Parquet, by extension.

    ``token_times_s`` becomes space-separated seconds in CSV and a list in
    Parquet; token-id lists, when kept, are JSON lists in CSV.

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
    frame["token_times_s"] = [" ".join(f"{x:.6f}" for x in t) for t in frame["token_times_s"]]
    frame.to_csv(path, index=False)
