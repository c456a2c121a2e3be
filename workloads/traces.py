"""Trace loaders: Azure LLM inference 2023 CSV, Mooncake JSONL, plain CSV/JSONL.

Everything here returns ``list[Request]`` sorted by arrival time, with the first
request at 0.0 s. Three trace formats are read (see ``../shared/traces/README.md``):

- ``azure``: Azure LLM inference trace 2023 CSV, header
  ``TIMESTAMP,ContextTokens,GeneratedTokens`` (wall-clock timestamps with 7
  fractional digits). Source: Azure/AzurePublicDataset, CC-BY 4.0.
- ``mooncake``: Mooncake JSONL, keys ``timestamp`` (ms), ``input_length``,
  ``output_length``, ``hash_ids`` (one id per 512-token prompt block).
  Source: kvcache-ai/Mooncake ``FAST25-release/traces``.
- ``plain``: CSV or JSONL with ``arrival_s, prompt_tokens, output_tokens`` and
  optional ``tenant``, ``request_id``, ``priority`` (int, lower is more urgent)
  and ``deadline_s`` (first-token deadline, s after arrival; empty: none).

Bad input raises :class:`WorkloadError` whose message names ``file:line``, the
field, and what was expected. Nothing is read or computed at import time.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from roseinfer.request import Request
from roseinfer.workloads.errors import WorkloadError

KNOWN_FORMATS = ("auto", "azure", "mooncake", "plain")
DEFAULT_TRACE_NAME = "azure_conv_2023_first2000.csv"
"""The embedded trace (package ``roseinfer.workloads.data``): the first 2,000 of 19,366
rows of ``AzureLLMInferenceTrace_conv.csv``, unmodified (see its ATTRIBUTION.md)."""
MOONCAKE_BLOCK_TOKENS = 512

AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
MOONCAKE_KEYS = ("timestamp", "input_length", "output_length", "hash_ids")
PLAIN_COLUMNS = ("arrival_s", "prompt_tokens", "output_tokens")


# ------------------------------------------------------------------ loading
def load_trace(path: str | Path, fmt: str = "auto") -> list[Request]:
    """Load a trace file: the single entry point of the CLIs.

    Args:
        path: an Azure CSV, a Mooncake JSONL, or a plain CSV/JSONL file.
        fmt: one of ``KNOWN_FORMATS``; ``"auto"`` detects it from the header
            (CSV) or the first object's keys (JSONL).

    Returns:
        Requests sorted by arrival, ``arrival_time_s`` in seconds from the
        earliest row (so the first is at 0.0), ids ``"{file stem}-{row}"``
        (row = 0-based data row in the file) unless the file gives ``request_id``.

    Raises:
        WorkloadError: missing/empty file, unknown format, or a bad row
            (message ``file:line: field must be ..., got ...``).
    """
    path = Path(path)
    if fmt not in KNOWN_FORMATS:
        raise WorkloadError(f"unknown trace format {fmt!r}; known: {', '.join(KNOWN_FORMATS)}")
    _check_file(path)
    is_jsonl, first = _first_line(path)
    if fmt == "auto":
        fmt = _detect(path, is_jsonl, first)
    if fmt == "azure":
        return _load_azure(path)
    if fmt == "mooncake":
        return _load_mooncake(path)
    return _load_plain_jsonl(path) if is_jsonl else _load_plain_csv(path)


def detect_format(path: str | Path) -> str:
    """The format of a trace file: ``"azure"``, ``"mooncake"`` or ``"plain"``.

    Raises:
        WorkloadError: missing/empty file or an unrecognised header.
    """
    path = Path(path)
    _check_file(path)
    return _detect(path, *_first_line(path))


def load_default_trace() -> list[Request]:
    """The embedded Azure conv sample (``DEFAULT_TRACE_NAME``, 2,000 requests).

    Read through ``importlib.resources``, so it works from an installed wheel.
    """
    ref = resources.files("roseinfer.workloads.data").joinpath(DEFAULT_TRACE_NAME)
    with resources.as_file(ref) as path:
        return load_trace(path, "azure")


def _check_file(path: Path) -> None:
    if not path.exists():
        raise WorkloadError(f"{path}: no such file; check the trace path")
    if not path.is_file():
        raise WorkloadError(f"{path}: not a file; give a trace file (.csv or .jsonl)")


def _first_line(path: Path) -> tuple[bool, str]:
    """(is JSONL, first non-blank line)."""
    with _open_text(path) as f:
        for line in f:
            if line.strip():
                return line.lstrip().startswith("{"), line.strip()
    raise WorkloadError(f"{path}: the file is empty; a trace needs a header and rows")


@contextmanager
def _open_text(path: Path) -> Iterator[Iterator[str]]:
    """The file's lines; a binary file raises :class:`WorkloadError`."""
    with path.open(encoding="utf-8-sig") as f:
        try:
            yield f
        except UnicodeDecodeError:
            raise WorkloadError(f"{path}: not UTF-8 text; give a CSV or JSONL trace") from None


def _detect(path: Path, is_jsonl: bool, first: str) -> str:
    if is_jsonl:
        keys = set(_parse_json(path, 1, first))
        if {"input_length", "output_length"} <= keys:
            return "mooncake"
        if set(PLAIN_COLUMNS) <= keys:
            return "plain"
        found = ", ".join(sorted(keys))
    else:
        header = {c.strip() for c in first.split(",")}
        if set(AZURE_COLUMNS) <= header:
            return "azure"
        if set(PLAIN_COLUMNS) <= header:
            return "plain"
        found = first
    raise WorkloadError(
        f"{path}:1: unrecognised trace format (found {found!r}); expected an Azure header "
        f"{','.join(AZURE_COLUMNS)}, Mooncake keys {', '.join(MOONCAKE_KEYS)}, or plain "
        f"{', '.join(PLAIN_COLUMNS)}; or pass fmt= one of {', '.join(KNOWN_FORMATS[1:])}"
    )


# ---------------------------------------------------------------- CSV input
def _read_csv(path: Path, columns: Sequence[str], fmt: str) -> pd.DataFrame:
    """All cells as strings, blank lines dropped; row index i is file line i + 2."""
    try:
        df = pd.read_csv(
            path, dtype=str, keep_default_na=False, skip_blank_lines=False, encoding="utf-8-sig"
        )
    except (pd.errors.ParserError, UnicodeDecodeError) as err:
        detail = str(err).strip().removeprefix("Error tokenizing data. C error: ")
        raise WorkloadError(f"{path}: not a valid CSV ({detail}); fix that row") from None
    df.columns = [str(c).strip() for c in df.columns]
    missing = [c for c in columns if c not in df.columns]
    if missing:
        raise WorkloadError(
            f"{path}:1: missing column(s) {', '.join(missing)} for the {fmt} format; "
            f"the header must contain {','.join(columns)}"
        )
    df = df[(df != "").any(axis=1)]  # NOTE: blank lines (all cells empty) are skipped
    if df.empty:
        raise WorkloadError(f"{path}: no rows after the header; the trace is empty")
    return df


def _bad_row(
    path: Path, df: pd.DataFrame, column: str, bad: pd.Series | np.ndarray, what: str
) -> None:
    """Raise for the first True in ``bad``, naming its file line."""
    mask = np.asarray(bad, dtype=bool)
    if not mask.any():
        return
    row = int(np.argmax(mask))
    line = int(df.index[row]) + 2
    raw = df[column].iloc[row]
    got = "an empty value" if raw == "" else repr(raw)
    raise WorkloadError(f"{path}:{line}: {column} must be {what}, got {got}")


def _positive_ints(path: Path, df: pd.DataFrame, column: str) -> np.ndarray:
    values = pd.to_numeric(df[column].str.strip(), errors="coerce")
    bad = ~(values > 0) | (values % 1 != 0)
    _bad_row(path, df, column, bad, "a positive integer")
    return values.to_numpy(dtype=np.int64)


def _finite_floats(path: Path, df: pd.DataFrame, column: str) -> np.ndarray:
    values = pd.to_numeric(df[column].str.strip(), errors="coerce").astype(float)
    _bad_row(path, df, column, ~np.isfinite(values), "a number of seconds")
    return values.to_numpy(dtype=float)


def _row_ids(path: Path, df: pd.DataFrame) -> list[str]:
    return [f"{path.stem}-{i}" for i in df.index]


def _load_azure(path: Path) -> list[Request]:
    df = _read_csv(path, AZURE_COLUMNS, "azure")
    stamps = pd.to_datetime(
        df["TIMESTAMP"].str.strip(), format="ISO8601", errors="coerce", utc=True
    )
    what = "a timestamp like '2023-11-16 18:15:46.6800000'"
    _bad_row(path, df, "TIMESTAMP", stamps.isna(), what)
    arrival_s = (stamps - stamps.min()).dt.total_seconds().to_numpy()
    prompt = _positive_ints(path, df, "ContextTokens")
    output = _positive_ints(path, df, "GeneratedTokens")
    return _build(_row_ids(path, df), arrival_s, prompt, output)


def _load_plain_csv(path: Path) -> list[Request]:
    df = _read_csv(path, PLAIN_COLUMNS, "plain")
    arrival_s = _finite_floats(path, df, "arrival_s")
    prompt = _positive_ints(path, df, "prompt_tokens")
    output = _positive_ints(path, df, "output_tokens")
    ids = _row_ids(path, df)
    if "request_id" in df.columns:
        given = df["request_id"].str.strip()
        _bad_row(path, df, "request_id", given.duplicated(), "unique")
        ids = [g or i for g, i in zip(given, ids)]
    tenants = None
    if "tenant" in df.columns:
        tenants = [t.strip() or None for t in df["tenant"]]
    return _build(ids, arrival_s, prompt, output, tenants=tenants, **_classes_csv(path, df))


def _classes_csv(path: Path, df: pd.DataFrame) -> dict[str, Any]:
    """The optional ``priority`` and ``deadline_s`` columns (an empty deadline: none)."""
    out: dict[str, Any] = {}
    if "priority" in df.columns:
        values = pd.to_numeric(df["priority"].str.strip(), errors="coerce")
        _bad_row(path, df, "priority", ~np.isfinite(values) | (values % 1 != 0), "an integer")
        out["priorities"] = values.to_numpy(dtype=np.int64)
    if "deadline_s" in df.columns:
        text = df["deadline_s"].str.strip()
        values = pd.to_numeric(text, errors="coerce")
        bad = (text != "") & ~(values > 0)
        _bad_row(path, df, "deadline_s", bad, "a positive number of seconds or empty")
        out["deadlines"] = [None if t == "" else float(v) for t, v in zip(text, values)]
    return out


# -------------------------------------------------------------- JSONL input
def _parse_json(path: Path, line_no: int, text: str) -> dict[str, Any]:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as err:
        raise WorkloadError(
            f"{path}:{line_no}: not valid JSON ({err.msg}); a JSONL trace has one object per line"
        ) from None
    if not isinstance(obj, dict):
        raise WorkloadError(f"{path}:{line_no}: expected a JSON object per line, got {text[:40]!r}")
    return obj


def _json_rows(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(1-based line number, object) for every non-blank line."""
    with _open_text(path) as f:
        for line_no, text in enumerate(f, start=1):
            if text.strip():
                yield line_no, _parse_json(path, line_no, text)


def _field(path: Path, line_no: int, row: dict[str, Any], key: str, check: str) -> Any:
    """``row[key]`` checked as ``"positive"`` (integer > 0) or ``"number"`` (finite)."""
    if key not in row:
        raise WorkloadError(f"{path}:{line_no}: missing key {key!r}; every line needs it")
    value = row[key]
    is_num = isinstance(value, int | float) and not isinstance(value, bool)
    if check == "positive" and not (is_num and value > 0 and float(value).is_integer()):
        raise WorkloadError(f"{path}:{line_no}: {key} must be a positive integer, got {value!r}")
    if check == "number" and not (is_num and math.isfinite(value)):
        raise WorkloadError(f"{path}:{line_no}: {key} must be a finite number, got {value!r}")
    return value


def _hash_ids(path: Path, line_no: int, row: dict[str, Any], num_tokens: int) -> tuple[int, ...]:
    ids = row.get("hash_ids")
    if not isinstance(ids, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in ids
    ):
        raise WorkloadError(f"{path}:{line_no}: hash_ids must be a list of integers, got {ids!r}")
    expected = -(-num_tokens // MOONCAKE_BLOCK_TOKENS)
    if len(ids) != expected:
        raise WorkloadError(
            f"{path}:{line_no}: hash_ids has {len(ids)} ids but input_length {num_tokens} needs "
            f"{expected} (one per {MOONCAKE_BLOCK_TOKENS}-token block)"
        )
    return tuple(ids)


def _load_mooncake(path: Path) -> list[Request]:
    ids, times, prompt, output, hashes = [], [], [], [], []
    for n, (line_no, row) in enumerate(_json_rows(path)):
        ids.append(f"{path.stem}-{n}")
        times.append(_field(path, line_no, row, "timestamp", "number") / 1000.0)
        prompt.append(int(_field(path, line_no, row, "input_length", "positive")))
        output.append(int(_field(path, line_no, row, "output_length", "positive")))
        hashes.append(_hash_ids(path, line_no, row, prompt[-1]))
    if not ids:
        raise WorkloadError(f"{path}: no rows; the trace is empty")
    return _build(ids, np.array(times), np.array(prompt), np.array(output), hash_ids=hashes)


def _load_plain_jsonl(path: Path) -> list[Request]:
    ids: list[str] = []
    times, prompt, output, tenants = [], [], [], []
    priorities: list[int] = []
    deadlines: list[float | None] = []
    for n, (line_no, row) in enumerate(_json_rows(path)):
        rid = str(row.get("request_id", f"{path.stem}-{n}"))
        if rid in ids:
            raise WorkloadError(f"{path}:{line_no}: request_id must be unique, got {rid!r}")
        ids.append(rid)
        times.append(float(_field(path, line_no, row, "arrival_s", "number")))
        prompt.append(int(_field(path, line_no, row, "prompt_tokens", "positive")))
        output.append(int(_field(path, line_no, row, "output_tokens", "positive")))
        tenants.append(None if row.get("tenant") is None else str(row["tenant"]))
        priorities.append(_optional(path, line_no, row, "priority", int))
        deadlines.append(_optional(path, line_no, row, "deadline_s", float))
    if not ids:
        raise WorkloadError(f"{path}: no rows; the trace is empty")
    return _build(
        ids,
        np.array(times),
        np.array(prompt),
        np.array(output),
        tenants=tenants,
        priorities=np.array(priorities, dtype=np.int64),
        deadlines=deadlines,
    )


def _optional(path: Path, line_no: int, row: dict[str, Any], key: str, kind: type) -> Any:
    """``priority`` (an integer, default 0) or ``deadline_s`` (> 0 s, default None)."""
    value = row.get(key)
    if value is None:
        return 0 if kind is int else None
    is_num = isinstance(value, int | float) and not isinstance(value, bool)
    if kind is int and not (is_num and float(value).is_integer()):
        raise WorkloadError(f"{path}:{line_no}: {key} must be an integer, got {value!r}")
    if kind is float and not (is_num and value > 0):
        raise WorkloadError(
            f"{path}:{line_no}: {key} must be a positive number of seconds, got {value!r}"
        )
    return kind(value)


def _build(
    ids: Sequence[str],
    arrival_s: np.ndarray,
    prompt: np.ndarray,
    output: np.ndarray,
    *,
    tenants: Sequence[str | None] | None = None,
    hash_ids: Sequence[tuple[int, ...]] | None = None,
    priorities: np.ndarray | None = None,
    deadlines: Sequence[float | None] | None = None,
) -> list[Request]:
    """Requests in arrival order (stable), times re-based to the earliest."""
    rel_s = arrival_s - arrival_s.min()
    return [
        Request(
            ids[i],
            float(rel_s[i]),
            int(prompt[i]),
            int(output[i]),
            prefix_hash_ids=None if hash_ids is None else hash_ids[i],
            prefix_hash_block_tokens=MOONCAKE_BLOCK_TOKENS,
            tenant=None if tenants is None else tenants[i],
            priority=0 if priorities is None else int(priorities[i]),
            deadline_s=None if deadlines is None else deadlines[i],
        )
        for i in np.argsort(rel_s, kind="stable")
    ]
