"""Workloads: trace loaders, slicing and rate scaling, synthetic seed workloads.

Everything here returns ``list[Request]`` sorted by arrival time, with the first
request at 0.0 s. Three trace formats are read (see ``../shared/traces/README.md``):

- ``azure``: Azure LLM inference trace 2023 CSV, header
  ``TIMESTAMP,ContextTokens,GeneratedTokens`` (wall-clock timestamps with 7
  fractional digits). Source: Azure/AzurePublicDataset, CC-BY 4.0.
- ``mooncake``: Mooncake JSONL, keys ``timestamp`` (ms), ``input_length``,
  ``output_length``, ``hash_ids`` (one id per 512-token prompt block).
  Source: kvcache-ai/Mooncake ``FAST25-release/traces``.
- ``plain``: CSV or JSONL with ``arrival_s, prompt_tokens, output_tokens`` and
  optional ``tenant``, ``request_id``.

Bad input raises :class:`WorkloadError` whose message names ``file:line``, the
field, and what was expected. Nothing is read or computed at import time.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from roseinfer.request import Request

KNOWN_FORMATS = ("auto", "azure", "mooncake", "plain")
FIT_MODES = ("clip", "scale")
DEFAULT_TRACE_NAME = "azure_conv_2023_first2000.csv"
"""The embedded trace (package ``roseinfer.data``): the first 2,000 of 19,366
rows of ``AzureLLMInferenceTrace_conv.csv``, unmodified (see its ATTRIBUTION.md)."""
GPT2_VOCAB_SIZE = 50257
MOONCAKE_BLOCK_TOKENS = 512
UNIQUE_SUFFIX_TOKENS = 3
"""Tokens appended by ``synthetic(unique_prompts=True)``, like the seeds' ``" [i]"``
(GPT-2: ``' ['``, ``'i'``, ``']'``)."""

AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
MOONCAKE_KEYS = ("timestamp", "input_length", "output_length", "hash_ids")
PLAIN_COLUMNS = ("arrival_s", "prompt_tokens", "output_tokens")


class WorkloadError(ValueError):
    """Bad workload input; the message names ``file:line``, the field and the fix."""


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
    ref = resources.files("roseinfer.data").joinpath(DEFAULT_TRACE_NAME)
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
    return _build(ids, arrival_s, prompt, output, tenants=tenants)


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
    for n, (line_no, row) in enumerate(_json_rows(path)):
        rid = str(row.get("request_id", f"{path.stem}-{n}"))
        if rid in ids:
            raise WorkloadError(f"{path}:{line_no}: request_id must be unique, got {rid!r}")
        ids.append(rid)
        times.append(float(_field(path, line_no, row, "arrival_s", "number")))
        prompt.append(int(_field(path, line_no, row, "prompt_tokens", "positive")))
        output.append(int(_field(path, line_no, row, "output_tokens", "positive")))
        tenants.append(None if row.get("tenant") is None else str(row["tenant"]))
    if not ids:
        raise WorkloadError(f"{path}: no rows; the trace is empty")
    return _build(ids, np.array(times), np.array(prompt), np.array(output), tenants=tenants)


def _build(
    ids: Sequence[str],
    arrival_s: np.ndarray,
    prompt: np.ndarray,
    output: np.ndarray,
    *,
    tenants: Sequence[str | None] | None = None,
    hash_ids: Sequence[tuple[int, ...]] | None = None,
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
        )
        for i in np.argsort(rel_s, kind="stable")
    ]


# -------------------------------------------------------- slicing, scaling
def select(
    requests: Sequence[Request],
    *,
    num_requests: int | None = None,
    start_s: float | None = None,
    end_s: float | None = None,
    skip: int = 0,
) -> list[Request]:
    """A window of a workload, re-based so the first kept request arrives at 0 s.

    Order of operations: keep arrivals in ``[start_s, end_s]`` (seconds, both
    ends inclusive, None = open), then drop the first ``skip``, then keep the
    first ``num_requests`` (None = all). The result may be empty.

    Raises:
        WorkloadError: on ``num_requests <= 0`` or ``skip < 0``.
    """
    if num_requests is not None and num_requests <= 0:
        raise WorkloadError(f"num_requests must be > 0 (or None for all), got {num_requests}")
    if skip < 0:
        raise WorkloadError(f"skip must be >= 0, got {skip}")
    lo = -math.inf if start_s is None else start_s
    hi = math.inf if end_s is None else end_s
    kept = [r for r in _by_arrival(requests) if lo <= r.arrival_time_s <= hi][skip:]
    kept = kept if num_requests is None else kept[:num_requests]
    return _rebase(kept)


def _by_arrival(requests: Iterable[Request]) -> list[Request]:
    return sorted(requests, key=lambda r: r.arrival_time_s)


def _rebase(requests: list[Request]) -> list[Request]:
    if not requests or requests[0].arrival_time_s == 0.0:
        return list(requests)
    t0 = requests[0].arrival_time_s
    return [dataclasses.replace(r, arrival_time_s=r.arrival_time_s - t0) for r in requests]


def _with_arrivals(requests: Sequence[Request], arrival_s: np.ndarray) -> list[Request]:
    return [dataclasses.replace(r, arrival_time_s=float(t)) for r, t in zip(requests, arrival_s)]


def rescale_arrivals(
    requests: Sequence[Request],
    *,
    request_rate: float,
    burstiness: float = 1.0,
    seed: int = 0,
) -> list[Request]:
    """New arrival times at ``request_rate`` req/s, as vLLM ``benchmark_serving``.

    Requests keep their order and lengths. ``request_rate=inf`` puts every
    arrival at 0 s. Otherwise the gaps between consecutive requests are drawn
    from Gamma(shape=burstiness, scale=1 / (request_rate * burstiness)) with
    ``numpy.random.default_rng(seed)``: mean gap 1 / request_rate seconds,
    coefficient of variation 1 / sqrt(burstiness) (burstiness 1 = Poisson,
    < 1 burstier, > 1 more regular). As in vLLM (which sends a request, then
    sleeps a gap), the first request arrives at 0 s and n requests use n - 1 gaps.

    Raises:
        WorkloadError: on a rate or burstiness that is not > 0.
    """
    if not request_rate > 0:
        raise WorkloadError(f"request_rate must be > 0 req/s (or inf), got {request_rate}")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise WorkloadError(f"burstiness must be a finite number > 0, got {burstiness}")
    num = len(requests)
    if num == 0:
        return []
    if math.isinf(request_rate):
        return _with_arrivals(requests, np.zeros(num))
    rng = np.random.default_rng(seed)
    gaps_s = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num - 1)
    return _with_arrivals(requests, np.concatenate([[0.0], np.cumsum(gaps_s)]))


def time_scale(requests: Sequence[Request], factor: float) -> list[Request]:
    """Arrival times multiplied by ``factor`` (0.5 replays a trace twice as fast).

    Raises:
        WorkloadError: on a factor that is not a finite number > 0.
    """
    if not (factor > 0 and math.isfinite(factor)):
        raise WorkloadError(f"factor must be a finite number > 0, got {factor}")
    times = np.array([r.arrival_time_s for r in requests], dtype=float)
    return _with_arrivals(requests, times * factor)


# ---------------------------------------------------------------- synthetic
@dataclass(frozen=True, slots=True)
class SyntheticSpec:
    """Parameters of :func:`synthetic` (the seeds' ``benchmark_streaming`` flags).

    Attributes:
        num_requests: requests to make (``--num-requests``).
        prompt_tokens: tokens of the base prompt (``--prompt "Hello"`` = 1 GPT-2 token).
        prompt_repeats: base-prompt repeat counts cycled per request
            (``--prompt-repeats``); None = 1 for all.
        output_tokens: output tokens per request (``--max-new-tokens`` with
            ``--no-stop-on-eos``).
        submit_interval_s: seconds between arrivals (``--submit-interval-ms`` / 1000).
        unique_prompts: append a distinct ``UNIQUE_SUFFIX_TOKENS``-token suffix
            per request (``--unique-prompts``: ``f"{p} [{i}]"``).
        vocab_size: token ids are drawn from ``[0, vocab_size)``.
        seed: seeds the base prompt's token ids.

    Raises:
        WorkloadError: on a non-positive count or length, or a negative interval
            or seed.
    """

    num_requests: int
    prompt_tokens: int = 4
    prompt_repeats: tuple[int, ...] | None = None
    output_tokens: int = 32
    submit_interval_s: float = 0.0
    unique_prompts: bool = True
    vocab_size: int = GPT2_VOCAB_SIZE
    seed: int = 0

    def __post_init__(self) -> None:
        if self.prompt_repeats is not None:
            object.__setattr__(self, "prompt_repeats", tuple(self.prompt_repeats))
        for name in ("num_requests", "prompt_tokens", "output_tokens", "vocab_size"):
            if getattr(self, name) <= 0:
                raise WorkloadError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.prompt_repeats is not None and (
            not self.prompt_repeats or min(self.prompt_repeats) <= 0
        ):
            raise WorkloadError(
                f"prompt_repeats needs positive integers, got {self.prompt_repeats}"
            )
        if self.seed < 0:
            raise WorkloadError(f"seed must be >= 0, got {self.seed}")
        if not self.submit_interval_s >= 0:
            raise WorkloadError(f"submit_interval_s must be >= 0, got {self.submit_interval_s}")
        if self.unique_prompts and self.num_requests > self.vocab_size**2:
            raise WorkloadError(
                f"unique_prompts supports at most vocab_size**2 = {self.vocab_size**2} "
                f"requests, got {self.num_requests}; raise vocab_size"
            )


def synthetic(
    num_requests: int,
    *,
    prompt_tokens: int = 4,
    prompt_repeats: Sequence[int] | None = None,
    output_tokens: int = 32,
    submit_interval_s: float = 0.0,
    unique_prompts: bool = True,
    vocab_size: int = GPT2_VOCAB_SIZE,
    seed: int = 0,
) -> list[Request]:
    """Requests like the seeds' ``benchmark_streaming`` makes, with token ids.

    Request i (id ``"syn-{i}"``) arrives at ``i * submit_interval_s`` seconds;
    its prompt is the base prompt (``prompt_tokens`` ids drawn once from
    ``default_rng(seed)``) repeated ``prompt_repeats[i % len(prompt_repeats)]``
    times, plus, with ``unique_prompts``, a ``UNIQUE_SUFFIX_TOKENS``-token suffix
    (a marker id, then i in base ``vocab_size``) that differs per request, like
    the seeds' ``" [i]"``. So ``num_prompt_tokens = prompt_tokens * repeat + 3``
    (unique) or ``prompt_tokens * repeat`` (shared: every prompt with the same
    repeat is identical, so the prefix cache hits on its full blocks).
    NOTE: unique prompts still share the repeated base as a prefix, so a
    block-hash prefix cache hits on its full blocks (the seeds' whole-prompt
    cache did not); the seed variants turn prefix caching off where the post
    had no hits.

    Example: ``prompt_tokens=1`` (GPT-2 "Hello") with unique prompts gives 4
    tokens per short prompt, reproducing the seeds' printed totals (see
    ``SEED_EXPERIMENTS``).

    Raises:
        WorkloadError: see :class:`SyntheticSpec`.
    """
    spec = SyntheticSpec(
        num_requests,
        prompt_tokens,
        None if prompt_repeats is None else tuple(prompt_repeats),
        output_tokens,
        submit_interval_s,
        unique_prompts,
        vocab_size,
        seed,
    )
    return generate(spec)


def generate(spec: SyntheticSpec) -> list[Request]:
    """The requests :class:`SyntheticSpec` describes (see :func:`synthetic`)."""
    rng = np.random.default_rng(spec.seed)
    base = tuple(rng.integers(0, spec.vocab_size, size=spec.prompt_tokens).tolist())
    marker = int(rng.integers(0, spec.vocab_size))
    repeats = spec.prompt_repeats or (1,)
    out = []
    for i in range(spec.num_requests):
        ids = base * repeats[i % len(repeats)]
        if spec.unique_prompts:
            ids += (marker, i // spec.vocab_size, i % spec.vocab_size)
        arrival_s = i * spec.submit_interval_s
        out.append(Request(f"syn-{i}", arrival_s, len(ids), spec.output_tokens, ids))
    return out


@dataclass(frozen=True)
class SeedExperiment:
    """One benchmark run of a seed post, as a workload plus its scheduler flags.

    Attributes:
        seed_file: the post in ``../shared/seeds/``.
        title: what the post studies.
        workload: the benchmark's request shape.
        num_prompt_tokens_total: the post's printed "Prompt tokens (total)".
        num_output_tokens_total: the post's printed "Completion tokens (total)".
        variants: label -> ``SchedulerConfig`` fields and policy options (the
            keys of ``roseinfer.simulator.sweep.apply_overrides``) for each run
            the post compares; flags the post left at its defaults are absent.
        device: where the post ran (GPT-2 via HF transformers).
    """

    seed_file: str
    title: str
    workload: SyntheticSpec
    num_prompt_tokens_total: int
    num_output_tokens_total: int
    variants: dict[str, dict[str, Any]] = field(default_factory=dict)
    device: str = "cpu"


def _seed_027() -> SeedExperiment:
    # 003_bf58523580b0c411.txt: --prompt "Hello" --unique-prompts --num-requests 32
    # --max-new-tokens 8 --no-stop-on-eos --no-prefix-cache (cpu). Prints 128 / 256 tokens.
    # Before/after is an implementation change (add_request only enqueues), not a flag.
    return SeedExperiment(
        "003_bf58523580b0c411.txt",
        "027 pending queue admission: a burst of 32 short prompts",
        SyntheticSpec(32, prompt_tokens=1, output_tokens=8),
        128,
        256,
        {"fifo": {"policy": "fifo", "enable_prefix_caching": False}},
    )


def _seed_031() -> SeedExperiment:
    # 001_d7fea02014171b97.txt: --prompt "Hello" --prompt-repeats 1,1,1,64 --unique-prompts
    # --num-requests 32 --submit-interval-ms 20 --max-batch-size 8 --prefill-max-batch-size 32
    # --max-new-tokens 32 --no-stop-on-eos (cpu, prefix cache on); after: --prefill-max-tokens 224.
    # Prints 632 / 1024 tokens: 24 x 4 + 8 x (64 + 3).
    # NOTE: the post kept its prefix cache on, but that cache was keyed by the whole
    # prompt, so unique prompts never hit; our block-hash cache would hit the shared
    # "Hello" x 64 blocks, so it is off here to match the post.
    # NOTE: the post's --max-batch-size 8 caps each decode forward, not the set of
    # admitted sessions (its prefill admits up to --prefill-max-batch-size and all of
    # them stay active). Our running set is also the decode batch (vLLM's
    # max_num_seqs), so the closest match is a running cap equal to the admission cap;
    # with max_num_seqs=8 admission would be seat-bound and the budget never bind.
    base = {"max_num_seqs": 32, "prefill_max_seqs": 32, "enable_prefix_caching": False}
    return SeedExperiment(
        "001_d7fea02014171b97.txt",
        "031 prefill token budget: 3 short + 1 long prompt, 20 ms apart",
        SyntheticSpec(32, prompt_tokens=1, prompt_repeats=(1, 1, 1, 64), submit_interval_s=0.020),
        632,
        1024,
        {
            "fifo": {**base, "policy": "fifo"},
            "budget-224": {**base, "policy": "budget", "prefill_max_tokens": 224},
        },
    )


def _seed_032() -> SeedExperiment:
    # 002_9726b183f600ca55.txt: --prompt "Hello" --prompt-repeats 1,1,1,64 --unique-prompts
    # --num-requests 128 --submit-interval-ms 5 --max-batch-size 8 --prefill-max-batch-size 128
    # --max-new-tokens 32 --no-stop-on-eos --no-prefix-cache (cuda); after: --decode-first.
    # Prints 2528 / 4096 tokens: 96 x 4 + 32 x 67.
    # NOTE: the post's --max-batch-size 8 caps each decode forward, not the set of
    # admitted sessions (its prefill admits up to --prefill-max-batch-size and all of
    # them stay active). Our running set is also the decode batch (vLLM's
    # max_num_seqs), so the closest match is a running cap equal to the admission cap;
    # with max_num_seqs=8 admission would be seat-bound and the budget never bind.
    base = {"max_num_seqs": 128, "prefill_max_seqs": 128, "enable_prefix_caching": False}
    return SeedExperiment(
        "002_9726b183f600ca55.txt",
        "032 decode-first: prefill vs decode order under a steady stream",
        SyntheticSpec(128, prompt_tokens=1, prompt_repeats=(1, 1, 1, 64), submit_interval_s=0.005),
        2528,
        4096,
        {
            "prefill-first": {**base, "loop_order": "prefill-first"},
            "decode-first": {**base, "loop_order": "decode-first"},
        },
        device="cuda",
    )


def _seed_033() -> SeedExperiment:
    # 000_315f5f351c27c002.txt: --prompt "Hello" --prompt-repeats 512,1,1,1 --unique-prompts
    # --num-requests 128 --submit-interval-ms 0 --max-batch-size 8 --prefill-max-batch-size 128
    # --prefill-max-tokens 256 --max-new-tokens 32 --no-stop-on-eos --no-prefix-cache (cuda);
    # after: --prefill-admission-policy pack --prefill-admission-lookahead 64
    # --prefill-force-fifo-every 8. Prints 16864 / 4096 tokens: 32 x (512 + 3) + 96 x 4.
    # NOTE: the post's --max-batch-size 8 caps each decode forward, not the set of
    # admitted sessions (its prefill admits up to --prefill-max-batch-size and all of
    # them stay active). Our running set is also the decode batch (vLLM's
    # max_num_seqs), so the closest match is a running cap equal to the admission cap;
    # with max_num_seqs=8 admission would be seat-bound and the budget never bind.
    base = {
        "max_num_seqs": 128,
        "prefill_max_seqs": 128,
        "prefill_max_tokens": 256,
        "enable_prefix_caching": False,
    }
    return SeedExperiment(
        "000_315f5f351c27c002.txt",
        "033 lookahead packing: oversize heads block short prompts",
        SyntheticSpec(128, prompt_tokens=1, prompt_repeats=(512, 1, 1, 1)),
        16864,
        4096,
        {
            "budget": {**base, "policy": "budget"},
            "pack+ff8": {**base, "policy": "pack", "lookahead": 64, "force_fifo_every": 8},
        },
        device="cuda",
    )


def _seed_004(shared: bool) -> SeedExperiment:
    # 004_7f2c034a10ee99fa.txt: --prompt "Hello" --unique-prompts --num-requests 32
    # --max-new-tokens 8 --no-stop-on-eos (cpu, prefix cache on). Prints 128 / 256 tokens.
    # Before/after is an implementation change (batched prefill of cache misses).
    # NOTE: "-shared" was not run in the post. Its prefix cache was keyed by whole
    # prompt; ours hashes full KV blocks, which a 1-token prompt never fills, so the
    # shared variant uses a 64-token prompt (4 blocks of 16) to give the cache hits.
    spec = SyntheticSpec(
        32, prompt_tokens=64 if shared else 1, output_tokens=8, unique_prompts=not shared
    )
    return SeedExperiment(
        "004_7f2c034a10ee99fa.txt",
        "004 prefix cache with batched prefill: " + ("shared" if shared else "unique") + " prompts",
        spec,
        32 * 64 if shared else 128,
        256,
        {
            "prefix-cache": {"enable_prefix_caching": True},
            "no-prefix-cache": {"enable_prefix_caching": False},
        },
    )


SEED_EXPERIMENTS: dict[str, SeedExperiment] = {
    "027": _seed_027(),
    "031": _seed_031(),
    "032": _seed_032(),
    "033": _seed_033(),
    "004-prefix": _seed_004(shared=False),
    "004-prefix-shared": _seed_004(shared=True),
}
"""Seed post experiments by name: workload, printed token totals, compared flags."""


def seed_workload(name: str, **overrides: Any) -> list[Request]:
    """The requests of seed experiment ``name``, with :func:`synthetic` keywords replaced.

    Example: ``seed_workload("033", num_requests=256, seed=1)``.

    Raises:
        WorkloadError: on an unknown name (lists the known ones) or override key.
    """
    if name not in SEED_EXPERIMENTS:
        raise WorkloadError(
            f"unknown seed experiment {name!r}; known: {', '.join(SEED_EXPERIMENTS)}"
        )
    known = [f.name for f in dataclasses.fields(SyntheticSpec)]
    unknown = sorted(set(overrides) - set(known))
    if unknown:
        raise WorkloadError(f"unknown workload keys {unknown}; known: {', '.join(known)}")
    return generate(dataclasses.replace(SEED_EXPERIMENTS[name].workload, **overrides))


# ------------------------------------------------------- executor helpers
def with_token_ids(
    requests: Sequence[Request], vocab_size: int = GPT2_VOCAB_SIZE, seed: int = 0
) -> list[Request]:
    """Copies with made-up, deterministic ``prompt_token_ids`` where they are missing.

    For replaying a length-only trace on the real executor. A request with
    ``prefix_hash_ids`` gets, for each hash id, ``prefix_hash_block_tokens`` ids
    drawn from ``default_rng([seed, 0, hash_id])``, so equal leading hash ids give
    equal leading tokens and prefix sharing survives; tokens past the hashed
    blocks (and all tokens of a request without hash ids) come from a generator
    seeded by ``seed`` and the request id. Requests that have ids are kept as is.

    Args:
        requests: any workload.
        vocab_size: ids are drawn from ``[0, vocab_size)``.
        seed: a non-negative int.

    Raises:
        WorkloadError: on ``vocab_size <= 0`` or a negative seed.
    """
    if vocab_size <= 0 or seed < 0:
        raise WorkloadError(f"need vocab_size > 0 and seed >= 0, got {vocab_size}, {seed}")
    blocks: dict[tuple[int, int], np.ndarray] = {}  # NOTE: shared hash blocks made once
    return [
        r
        if r.prompt_token_ids is not None
        else dataclasses.replace(r, prompt_token_ids=_made_up_ids(r, vocab_size, seed, blocks))
        for r in requests
    ]


def _made_up_ids(
    r: Request, vocab_size: int, seed: int, blocks: dict[tuple[int, int], np.ndarray]
) -> tuple[int, ...]:
    span = r.prefix_hash_block_tokens
    parts = []
    for hash_id in r.prefix_hash_ids or ():
        key = (hash_id, span)
        if key not in blocks:
            rng = np.random.default_rng([seed, 0, hash_id % 2**64])
            blocks[key] = rng.integers(0, vocab_size, size=span)
        parts.append(blocks[key])
    num_rest = r.num_prompt_tokens - len(parts) * span
    if num_rest > 0:
        rng = np.random.default_rng([seed, 1, _stable_int(r.request_id)])
        parts.append(rng.integers(0, vocab_size, size=num_rest))
    return tuple(np.concatenate(parts)[: r.num_prompt_tokens].tolist())


def _stable_int(text: str) -> int:
    """A 64-bit int from ``text``, equal across processes (unlike ``hash``)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def fit_lengths(
    requests: Sequence[Request], max_model_len: int, mode: str = "clip"
) -> tuple[list[Request], str]:
    """Make every request fit ``prompt + output <= max_model_len`` tokens.

    Modes:
        ``"clip"``: shorten only the requests that do not fit: the prompt first
            (keeping its leading tokens/hash ids), then the output, keeping at
            least 1 token of each.
        ``"scale"``: multiply every prompt and output length by one factor
            ``max_model_len / longest`` (floored, at least 1 token), so the
            longest request just fits and the length distribution keeps its
            shape; ``prefix_hash_block_tokens`` is scaled too (rounded up), so
            hash-id prefix sharing keeps its proportions.

    Returns:
        (new requests in the same order, a one-line description of the change
        for the results). Requests that already fit are returned unchanged.

    Raises:
        WorkloadError: on an unknown mode (lists ``FIT_MODES``) or
            ``max_model_len < 2``.
    """
    if mode not in FIT_MODES:
        raise WorkloadError(f"unknown fit mode {mode!r}; known: {', '.join(FIT_MODES)}")
    if max_model_len < 2:
        raise WorkloadError(f"max_model_len must be >= 2 tokens, got {max_model_len}")
    longest = max((r.max_num_tokens for r in requests), default=0)
    if longest <= max_model_len:
        return list(requests), f"all {len(requests)} requests fit max_model_len={max_model_len}"
    if mode == "clip":
        return _clip_all(requests, max_model_len)
    return _scale_all(requests, max_model_len, longest)


def _resized(r: Request, num_prompt: int, num_output: int, span: int) -> Request:
    ids = None if r.prompt_token_ids is None else r.prompt_token_ids[:num_prompt]
    hashes = r.prefix_hash_ids
    if hashes is not None:
        hashes = hashes[: -(-num_prompt // span)]
    return dataclasses.replace(
        r,
        num_prompt_tokens=num_prompt,
        max_output_tokens=num_output,
        prompt_token_ids=ids,
        prefix_hash_ids=hashes,
        prefix_hash_block_tokens=span,
    )


def _clip(r: Request, max_model_len: int) -> Request:
    if r.max_num_tokens <= max_model_len:
        return r
    num_prompt = min(r.num_prompt_tokens, max(1, max_model_len - r.max_output_tokens))
    num_output = min(r.max_output_tokens, max_model_len - num_prompt)
    return _resized(r, num_prompt, num_output, r.prefix_hash_block_tokens)


def _clip_all(requests: Sequence[Request], max_model_len: int) -> tuple[list[Request], str]:
    out = [_clip(r, max_model_len) for r in requests]
    num_changed = sum(a is not b for a, b in zip(requests, out))
    num_prompt_cut = sum(a.num_prompt_tokens - b.num_prompt_tokens for a, b in zip(requests, out))
    num_output_cut = sum(a.max_output_tokens - b.max_output_tokens for a, b in zip(requests, out))
    return out, (
        f"clipped {num_changed} of {len(out)} requests to max_model_len={max_model_len} "
        f"(removed {num_prompt_cut} prompt and {num_output_cut} output tokens)"
    )


def _scale_all(
    requests: Sequence[Request], max_model_len: int, longest: int
) -> tuple[list[Request], str]:
    factor = max_model_len / longest

    def scaled(r: Request) -> Request:
        num_prompt = max(1, math.floor(r.num_prompt_tokens * factor))
        num_output = max(1, math.floor(r.max_output_tokens * factor))
        span = max(1, math.ceil(r.prefix_hash_block_tokens * factor))
        return _clip(_resized(r, num_prompt, num_output, span), max_model_len)

    out = [scaled(r) for r in requests]
    return out, (
        f"scaled prompt and output lengths of {len(out)} requests by {factor:.4g} "
        f"(longest request {longest} tokens -> max_model_len={max_model_len})"
    )
