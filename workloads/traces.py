"""Trace loaders: Azure LLM inference 2023 CSV, Mooncake JSONL, plain CSV/JSONL.

Everything here returns ``list[Request]`` sorted by arrival time, with the first
request at 0.0 s. Three trace formats are read (the public traces of each are named
in :mod:`~roseinfer.workloads.catalog`, which :func:`load_trace` fetches by name):

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

import csv
import gc
import json
import math
import re
import sys
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from roseinfer.request import Request
from roseinfer.workloads.catalog import CATALOGUE, fetch_trace, is_catalogued
from roseinfer.workloads.errors import WorkloadError

if TYPE_CHECKING:
    import pandas as pd
else:
    from roseinfer.metrics.lazy import pandas as pd

KNOWN_FORMATS = ("auto", "azure", "mooncake", "plain")
DEFAULT_TRACE_NAME = "azure_conv_2023_first2000.csv"
"""The embedded trace (package ``roseinfer.workloads.data``): the first 2,000 of 19,366
rows of ``AzureLLMInferenceTrace_conv.csv``, unmodified (see its ATTRIBUTION.md)."""
MOONCAKE_BLOCK_TOKENS = 512

AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
MOONCAKE_KEYS = ("timestamp", "input_length", "output_length", "hash_ids")
PLAIN_COLUMNS = ("arrival_s", "prompt_tokens", "output_tokens")
MAX_TRACE_TOKENS = 2**31 - 1
"""Largest prompt or output length a trace may give: no model's context comes near
2^31 tokens, and every count then fits numpy's int64 (a row of 1e30 would overflow)."""
MAX_TRACE_SPAN_S = 1e9
"""Largest spread of arrival times (about 31 years): past it a float clock loses the
sub-microsecond resolution step times need (rows of +-1e308 would give inf)."""
MAX_ECHO_CHARS = 200
"""Longest piece of a bad file an error message quotes (a 150 MB line must not reach stderr)."""


# ------------------------------------------------------------------ loading
def load_trace(path: str | Path, fmt: str = "auto") -> list[Request]:
    """Load a trace file: the single entry point of the CLIs.

    Args:
        path: an Azure CSV, a Mooncake JSONL, or a plain CSV/JSONL file; or the
            name of a public trace (:data:`~roseinfer.workloads.catalog.CATALOGUE`,
            e.g. ``azure-conv-2023``), downloaded and cached on first use.
        fmt: one of ``KNOWN_FORMATS``; ``"auto"`` detects it from the header
            (CSV) or the first object's keys (JSONL).

    Returns:
        Requests sorted by arrival, ``arrival_time_s`` in seconds from the
        earliest row (so the first is at 0.0), ids ``"{file stem}-{row}"``
        (row = 0-based data row in the file) unless the file gives ``request_id``.

    Raises:
        WorkloadError: missing/empty file, unknown format, a bad row (message
            ``file:line: field must be ..., got ...``), or a named trace that cannot
            be fetched (see :func:`~roseinfer.workloads.catalog.fetch_trace`).
    """
    if fmt not in KNOWN_FORMATS:
        raise WorkloadError(f"unknown trace format {fmt!r}; known: {', '.join(KNOWN_FORMATS)}")
    path = resolve_trace(path)
    _check_file(path)
    with _os_errors(path), collector_paused():
        is_jsonl, first = _first_line(path)
        if fmt == "auto":
            fmt = _detect(path, is_jsonl, first)
        if fmt == "azure":
            return _load_azure(path)
        if fmt == "mooncake":
            return _load_mooncake(path)
        return _load_plain_jsonl(path) if is_jsonl else _load_plain_csv(path)


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused for the ``with`` body, restored as it
    was after, also on an error.

    While a trace is parsed: parsing makes no reference cycles, yet its rows and
    requests (tens of thousands of tracked objects) trigger young collections every
    700 and a full one over all of them: 20 ms of the 0.1 s that the 19,366-row
    Azure conv trace takes to load. Around a CUDA graph capture
    (``executor/graph_runner.py``): a collection that starts by itself mid-capture
    runs the finalizers of whatever cyclic garbage it finds, and one that calls into
    CUDA (an event or a pinned buffer released) can invalidate the capture; vLLM and
    SGLang likewise keep the collector out of their captures (``freeze_gc``); the
    graph runner collects once before a round of captures (``torch.cuda.graph`` no
    longer does unless ``torch.compiler.config.force_cudagraph_gc``)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def detect_format(path: str | Path) -> str:
    """The format of a trace file: ``"azure"``, ``"mooncake"`` or ``"plain"``.

    Raises:
        WorkloadError: missing/empty file or an unrecognised header.
    """
    path = resolve_trace(path)
    _check_file(path)
    with _os_errors(path):
        return _detect(path, *_first_line(path))


def resolve_trace(path: str | Path) -> Path:
    """``path`` as a file: a catalogue name is fetched (or found in the cache), anything
    else is a path (a local file of a catalogued name wins over the name).

    Raises:
        WorkloadError: a named trace that cannot be fetched.
    """
    return fetch_trace(str(path)) if is_catalogued(path) else Path(path)


def load_default_trace() -> list[Request]:
    """The embedded Azure conv sample (``DEFAULT_TRACE_NAME``, 2,000 requests).

    Read through ``importlib.resources``, so it works from an installed wheel.
    """
    ref = resources.files("roseinfer.workloads.data").joinpath(DEFAULT_TRACE_NAME)
    with resources.as_file(ref) as path:
        return load_trace(path, "azure")


def _check_file(path: Path) -> None:
    if not path.exists():
        raise WorkloadError(
            f"{path}: no such file; check the trace path, or name a public trace "
            f"({', '.join(CATALOGUE)})"
        )
    if not path.is_file():
        raise WorkloadError(f"{path}: not a file; give a trace file (.csv or .jsonl)")


@contextmanager
def _os_errors(path: Path) -> Iterator[None]:
    """Turn an ``OSError`` while reading (no permission, I/O error) into a WorkloadError."""
    try:
        yield
    except OSError as err:
        reason = err.strerror or type(err).__name__
        raise WorkloadError(
            f"{path}: cannot read the trace ({reason}); check its permissions"
        ) from None


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


def clip(text: str, max_chars: int = MAX_ECHO_CHARS) -> str:
    """``text`` cut to ``max_chars`` characters (with a count of what was cut)."""
    if len(text) <= max_chars:
        return text
    return f"{text[:max_chars]}... ({len(text) - max_chars} more chars)"


def _detect(path: Path, is_jsonl: bool, first: str) -> str:
    if is_jsonl:
        keys = set(_parse_json(path, 1, first))
        if {"input_length", "output_length"} <= keys:
            return "mooncake"
        if set(PLAIN_COLUMNS) <= keys:
            return "plain"
        found = f"a JSON object with {len(keys)} keys, none a trace's"
    else:
        header = {c.strip() for c in first.split(",")}
        if set(AZURE_COLUMNS) <= header:
            return "azure"
        if set(PLAIN_COLUMNS) <= header:
            return "plain"
        found = f"a line of {len(first)} characters, not a trace header"
    # NOTE: the line itself is not echoed: a file given by mistake (/etc/passwd, a
    # key file) must not have its content copied to stderr and logs.
    raise WorkloadError(
        f"{path}:1: unrecognised trace format (found {found}); expected an Azure header "
        f"{','.join(AZURE_COLUMNS)}, Mooncake keys {', '.join(MOONCAKE_KEYS)}, or plain "
        f"{', '.join(PLAIN_COLUMNS)}; or give the format (--trace-format) as one of "
        f"{', '.join(KNOWN_FORMATS[1:])}"
    )


# ---------------------------------------------------------------- CSV input
def _read_csv(path: Path, columns: Sequence[str], fmt: str) -> pd.DataFrame:
    """All cells as strings, blank lines dropped; row index i is file line i + 2.

    NOTE: read with ``header=None`` so the header fixes the field count: a row
    with more fields is a parse error naming its line, where pandas would
    otherwise turn the extra leading cells of the first row into an index.
    """
    try:
        df = pd.read_csv(
            path,
            header=None,
            dtype=str,
            keep_default_na=False,
            skip_blank_lines=False,
            encoding="utf-8-sig",
        )
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError, csv.Error) as err:
        detail = clip(str(err).strip().removeprefix("Error tokenizing data. C error: "))
        raise WorkloadError(f"{path}: not a valid CSV ({detail}); fix that row") from None
    df = df.fillna("")  # NOTE: a row with fewer fields than the header is padded with NaN
    header = [str(c).strip() for c in df.iloc[0]]
    df = df.iloc[1:].set_axis(header, axis=1).set_axis(range(len(df) - 1), axis=0)
    _check_header(path, header, columns, fmt)
    df = df[(df != "").any(axis=1)]  # NOTE: blank lines (all cells empty) are skipped
    if df.empty:
        raise WorkloadError(f"{path}: no rows after the header; the trace is empty")
    return df


def _check_header(path: Path, header: list[str], columns: Sequence[str], fmt: str) -> None:
    missing = [c for c in columns if c not in header]
    if missing:
        raise WorkloadError(
            f"{path}:1: missing column(s) {', '.join(missing)} for the {fmt} format; "
            f"the header must contain {','.join(columns)}"
        )
    twice = sorted(c for c, n in Counter(header).items() if c and n > 1)
    if twice:
        raise WorkloadError(
            f"{path}:1: column(s) {clip(', '.join(twice))} appear more than once in the header; "
            "keep one of each"
        )


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
    got = "an empty value" if raw == "" else repr(clip(raw))
    raise WorkloadError(f"{path}:{line}: {column} must be {what}, got {got}")


def _positive_ints(path: Path, df: pd.DataFrame, column: str) -> np.ndarray:
    # NOTE: parsed as floats, so 1e30 or 20 digits cannot overflow int64 before the check.
    values = pd.to_numeric(df[column].str.strip(), errors="coerce").astype(float)
    _bad_row(path, df, column, ~(values > 0) | (values % 1 != 0), "a positive integer")
    _bad_row(path, df, column, values > MAX_TRACE_TOKENS, f"at most {MAX_TRACE_TOKENS} tokens")
    return values.to_numpy(dtype=np.int64)


def _finite_floats(path: Path, df: pd.DataFrame, column: str) -> np.ndarray:
    values = pd.to_numeric(df[column].str.strip(), errors="coerce").astype(float)
    _bad_row(path, df, column, ~np.isfinite(values), "a number of seconds")
    values = values.to_numpy(dtype=float)
    _bad_row(path, df, column, _beyond_span(values), f"within {MAX_TRACE_SPAN_S:g} s of the others")
    return values


def _beyond_span(arrival_s: np.ndarray) -> np.ndarray:
    """True for the rows farthest from the earliest arrival when the arrivals
    span more than ``MAX_TRACE_SPAN_S`` (all False otherwise)."""
    if not len(arrival_s):
        return np.zeros(0, dtype=bool)
    with np.errstate(over="ignore", invalid="ignore"):
        rel_s = arrival_s - arrival_s.min()
    return ~(rel_s <= MAX_TRACE_SPAN_S)


def _row_ids(path: Path, df: pd.DataFrame) -> list[str]:
    return [f"{path.stem}-{i}" for i in df.index]


def _check_unique_ids(path: Path, ids: Sequence[str], lines: Sequence[int]) -> None:
    """Raise for the first id already taken (a given id may equal another row's
    automatic ``{stem}-{row}`` id), naming both file lines."""
    first_line: dict[str, int] = {}
    for rid, line in zip(ids, lines):
        if rid in first_line:
            raise WorkloadError(
                f"{path}:{line}: request_id {clip(rid)!r} is already used at line "
                f"{first_line[rid]} (automatic ids are '{path.stem}-<row>'); give unique ids"
            )
        first_line[rid] = line


_ISO_STAMP = re.compile(r"\d{4}-\d{2}-\d{2}[ T]\d{2}:\d{2}:\d{2}(\.\d{1,9})?")


def _azure_without_pandas(path: Path) -> list[Request] | None:
    """The requests of a well-formed Azure CSV read with the ``csv`` module and
    numpy (no pandas import: a third of a short simulation's wall time), or None
    for anything else (blank or ragged rows, timestamps other than plain
    ``YYYY-MM-DD hh:mm:ss[.fffffffff]``, counts that are not plain positive
    integers), which the pandas path then reads, naming the bad row. The same
    requests as that path, to the bit (``tests/test_traces.py``): timestamps
    parse to the same nanoseconds (naive = UTC), and both divide nanoseconds by
    1e9 in float64 (correctly rounded)."""
    with _open_text(path) as f:
        rows = list(csv.reader(f))
    header = [c.strip() for c in rows[0]] if rows else []
    if len(rows) < 2 or len(set(header)) != len(header) or not set(AZURE_COLUMNS) <= set(header):
        return None
    body = rows[1:]
    if any(len(r) != len(header) for r in body):
        return None
    stamp_col, prompt_col, output_col = (header.index(c) for c in AZURE_COLUMNS)
    stamps = [r[stamp_col].strip() for r in body]
    if not all(_ISO_STAMP.fullmatch(t) for t in stamps):
        return None
    counts = []
    for col in (prompt_col, output_col):
        cells = [r[col].strip() for r in body]
        digits = "".join(cells)  # every cell 1-10 ASCII digits, checked in C
        lengths = list(map(len, cells))
        if not (
            digits.isascii() and digits.isdecimal() and 1 <= min(lengths) <= max(lengths) <= 10
        ):
            return None
        values = np.array(cells, dtype=np.int64)
        if not ((values > 0) & (values <= MAX_TRACE_TOKENS)).all():
            return None
        counts.append(values)
    ns = np.array(stamps, dtype="datetime64[ns]").astype(np.int64)
    stem = path.stem
    return _build([f"{stem}-{i}" for i in range(len(body))], (ns - ns.min()) / 10**9, *counts)


def _load_azure(path: Path) -> list[Request]:
    fast = _azure_without_pandas(path)
    if fast is not None:
        return fast
    df = _read_csv(path, AZURE_COLUMNS, "azure")
    stamps = pd.to_datetime(
        df["TIMESTAMP"].str.strip(), format="ISO8601", errors="coerce", utc=True
    )
    what = "a timestamp like '2023-11-16 18:15:46.6800000'"
    _bad_row(path, df, "TIMESTAMP", stamps.isna(), what)
    since = (stamps - stamps.min()).to_numpy().astype("timedelta64[ns]").astype(np.int64)
    arrival_s = since / 10**9  # as the csv path: not total_seconds, whose rounding varies
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
        _bad_row(path, df, "request_id", (given != "") & given.duplicated(), "unique")
        ids = [g or i for g, i in zip(given, ids)]  # NOTE: a blank cell: the automatic id
        lines = [int(i) + 2 for i in df.index]
        _check_unique_ids(path, ids, lines)
    tenants = None
    if "tenant" in df.columns:
        tenants = [escape_controls(t.strip()) or None for t in df["tenant"]]
    return _build(ids, arrival_s, prompt, output, tenants=tenants, **_classes_csv(path, df))


def _classes_csv(path: Path, df: pd.DataFrame) -> dict[str, Any]:
    """The optional ``priority`` and ``deadline_s`` columns (an empty deadline: none)."""
    out: dict[str, Any] = {}
    if "priority" in df.columns:
        values = pd.to_numeric(df["priority"].str.strip(), errors="coerce")
        bad = ~np.isfinite(values) | (values % 1 != 0) | (values.abs() > _MAX_PRIORITY)
        _bad_row(path, df, "priority", bad, f"an integer of at most {_MAX_PRIORITY} in magnitude")
        out["priorities"] = values.to_numpy(dtype=np.int64)
    if "deadline_s" in df.columns:
        text = df["deadline_s"].str.strip()
        values = pd.to_numeric(text, errors="coerce")
        bad = (text != "") & ~((values > 0) & (values < np.inf))
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
    except (ValueError, RecursionError) as err:  # e.g. a 5,000-digit integer, deep nesting
        raise WorkloadError(
            f"{path}:{line_no}: unreadable JSON ({clip(str(err) or type(err).__name__)}); "
            "a JSONL trace has one flat object per line"
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
    # NOTE: compare before any float(): float(10**400) raises OverflowError.
    if check == "positive" and not (
        is_num and 0 < value <= MAX_TRACE_TOKENS and value == int(value)
    ):
        cap = f" (at most {MAX_TRACE_TOKENS})" if is_num and value > MAX_TRACE_TOKENS else ""
        raise WorkloadError(
            f"{path}:{line_no}: {key} must be a positive integer{cap}, got {clip(repr(value))}"
        )
    if check == "number" and not (is_num and -_MAX_JSON_NUMBER <= value <= _MAX_JSON_NUMBER):
        raise WorkloadError(
            f"{path}:{line_no}: {key} must be a finite number, got {clip(repr(value))}"
        )
    return value


_MAX_JSON_NUMBER = sys.float_info.max  # NaN fails both comparisons; larger ints overflow float()


def _hash_ids(path: Path, line_no: int, row: dict[str, Any], num_tokens: int) -> tuple[int, ...]:
    ids = row.get("hash_ids")
    if not isinstance(ids, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in ids
    ):
        raise WorkloadError(
            f"{path}:{line_no}: hash_ids must be a list of integers, got {clip(repr(ids))}"
        )
    expected = -(-num_tokens // MOONCAKE_BLOCK_TOKENS)
    if len(ids) != expected:
        raise WorkloadError(
            f"{path}:{line_no}: hash_ids has {len(ids)} ids but input_length {num_tokens} needs "
            f"{expected} (one per {MOONCAKE_BLOCK_TOKENS}-token block)"
        )
    return tuple(ids)


def _load_mooncake(path: Path) -> list[Request]:
    ids, lines, times, prompt, output, hashes = [], [], [], [], [], []
    for n, (line_no, row) in enumerate(_json_rows(path)):
        ids.append(f"{path.stem}-{n}")
        lines.append(line_no)
        times.append(_field(path, line_no, row, "timestamp", "number") / 1000.0)
        prompt.append(int(_field(path, line_no, row, "input_length", "positive")))
        output.append(int(_field(path, line_no, row, "output_length", "positive")))
        hashes.append(_hash_ids(path, line_no, row, prompt[-1]))
    if not ids:
        raise WorkloadError(f"{path}: no rows; the trace is empty")
    arrival_s = _json_arrivals(path, lines, times, "timestamp")
    return _build(ids, arrival_s, np.array(prompt), np.array(output), hash_ids=hashes)


def _load_plain_jsonl(path: Path) -> list[Request]:
    ids: list[str] = []
    lines, times, prompt, output, tenants = [], [], [], [], []
    priorities: list[int] = []
    deadlines: list[float | None] = []
    for n, (line_no, row) in enumerate(_json_rows(path)):
        ids.append(_json_request_id(path, line_no, row) or f"{path.stem}-{n}")
        lines.append(line_no)
        times.append(float(_field(path, line_no, row, "arrival_s", "number")))
        prompt.append(int(_field(path, line_no, row, "prompt_tokens", "positive")))
        output.append(int(_field(path, line_no, row, "output_tokens", "positive")))
        tenants.append(_json_tenant(path, line_no, row))
        priorities.append(_optional(path, line_no, row, "priority", int))
        deadlines.append(_optional(path, line_no, row, "deadline_s", float))
    if not ids:
        raise WorkloadError(f"{path}: no rows; the trace is empty")
    _check_unique_ids(path, ids, lines)
    arrival_s = _json_arrivals(path, lines, times, "arrival_s")
    return _build(
        ids,
        arrival_s,
        np.array(prompt),
        np.array(output),
        tenants=tenants,
        priorities=np.array(priorities, dtype=np.int64),
        deadlines=deadlines,
    )


def _json_tenant(path: Path, line_no: int, row: dict[str, Any]) -> str | None:
    """The row's ``tenant``: a string or an integer (as its digits), None when absent
    or null; an object, list, number with a fraction or bool is refused (it would
    become a label like ``"{'a': 1}"``)."""
    tenant = row.get("tenant")
    if tenant is None:
        return None
    if isinstance(tenant, bool) or not isinstance(tenant, str | int):
        raise WorkloadError(
            f"{path}:{line_no}: tenant must be a string or an integer, got {clip(repr(tenant), 40)}"
        )
    return escape_controls(str(tenant).strip()) or None


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def escape_controls(text: str) -> str:
    """``text`` with control characters (C0, DEL, C1: ANSI escapes, newlines, tabs)
    written as ``\\xNN``, so a label from a file cannot drive the terminal it is
    printed on; other characters (any script) are kept."""
    if not _CONTROL.search(text):
        return text
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def _json_request_id(path: Path, line_no: int, row: dict[str, Any]) -> str:
    """The row's ``request_id`` as a string; "" (use the automatic id) when absent,
    null or blank."""
    rid = row.get("request_id")
    if rid is None:
        return ""
    if isinstance(rid, bool) or not isinstance(rid, str | int):
        raise WorkloadError(
            f"{path}:{line_no}: request_id must be a string or an integer, got {clip(repr(rid))}"
        )
    return str(rid).strip()


def _json_arrivals(path: Path, lines: list[int], times: list[float], key: str) -> np.ndarray:
    """Arrival times as an array; a spread past ``MAX_TRACE_SPAN_S`` names its line."""
    arrival_s = np.array(times, dtype=float)
    beyond = _beyond_span(arrival_s)
    if beyond.any():
        row = int(np.argmax(beyond))
        raise WorkloadError(
            f"{path}:{lines[row]}: {key} must be within {MAX_TRACE_SPAN_S:g} s of the other "
            f"arrivals, got {clip(repr(times[row]))} s"
        )
    return arrival_s


_MAX_PRIORITY = 2**31 - 1


def _optional(path: Path, line_no: int, row: dict[str, Any], key: str, kind: type) -> Any:
    """``priority`` (an integer, |p| <= 2**31-1, default 0) or ``deadline_s``
    (> 0 s, finite, default None)."""
    value = row.get(key)
    if value is None:
        return 0 if kind is int else None
    is_num = isinstance(value, int | float) and not isinstance(value, bool)
    if kind is int and not (
        is_num and math.isfinite(value) and float(value).is_integer()
        and abs(value) <= _MAX_PRIORITY
    ):  # fmt: skip
        raise WorkloadError(
            f"{path}:{line_no}: {key} must be an integer of at most {_MAX_PRIORITY} in magnitude, "
            f"got {clip(repr(value))}"
        )
    if kind is float and not (is_num and 0 < value < math.inf):
        raise WorkloadError(
            f"{path}:{line_no}: {key} must be a positive number of seconds, got {clip(repr(value))}"
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
    rel = arrival_s - arrival_s.min()
    # NOTE: Python lists first: indexing numpy arrays per request costs more than the Request
    rel_s = rel.astype(np.float64).tolist()
    prompts, outputs = (np.asarray(a, dtype=np.int64).tolist() for a in (prompt, output))
    ranks = None if priorities is None else np.asarray(priorities, dtype=np.int64).tolist()
    return [
        Request(
            ids[i],
            rel_s[i],
            prompts[i],
            outputs[i],
            prefix_hash_ids=None if hash_ids is None else hash_ids[i],
            prefix_hash_block_tokens=MOONCAKE_BLOCK_TOKENS,
            tenant=None if tenants is None else tenants[i],
            priority=0 if ranks is None else ranks[i],
            deadline_s=None if deadlines is None else deadlines[i],
        )
        for i in np.argsort(rel, kind="stable").tolist()
    ]
