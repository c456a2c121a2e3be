"""Step logs: every executed step of a run, in one schema any backend can write.

A step log is a JSON Lines file. The first line is a header; every other line
is one step (one forward pass) in the order the steps ran::

    {"schema": "roseinfer-steplog/1", "backend": "rose-run", "created": "...",
     "model": {"name": "gpt2", "spec": {...ModelSpec fields...} | null},
     "executor": {"device", "dtype", "num_kv_blocks", "block_size", "max_model_len",
                  "max_num_seqs", "max_num_batched_tokens", "fit_lengths", ...},
     "scheduler": {...the run's scheduler settings...},
     "environment": {...torch, threads, load average...}}
    {"step": 0, "start_s": 0.0, "end_s": 0.412, "forward_s": 0.405, "host_s": 0.007,
     "phase": "prefill", "request_ids": ["r0"], "num_new_tokens": [731],
     "num_context_tokens": [731], "is_decode": [false]}

Step fields (times in seconds on the run's clock, t=0 at the start of the run):

* ``start_s``: when the step's planning began: the end of the previous step,
  or the arrival that woke an idle engine. Everything from there to ``end_s``
  is the step's cost: applying the previous step's results, releasing
  arrivals, planning, preparing inputs, the forward, sampling, synchronizing.
* ``end_s``: when its sampled tokens were ready (after a device synchronize).
* ``forward_s``: the device part of it (inputs, forward, sampling, sync), or
  null when the backend does not split it (the simulator).
* ``host_s``: ``end_s - start_s - forward_s``, the host time outside the
  forward (null with ``forward_s``).
* ``phase``: ``prefill``, ``decode`` or ``mixed`` (what the scheduler planned;
  ``""`` when the engine does not say).
* per scheduled request, in the order the step holds them: its id, the tokens
  it computes this step (``num_new_tokens``: a whole prompt, a chunk, or 1 for a
  decode), its context length after the step (``num_context_tokens``: cached
  and earlier tokens plus the new ones), and whether it is a decode.

The header's ``executor`` section holds what ``rose-sim --cost-model STEPLOG``
takes as its defaults (the KV pool, block size, max model length, how lengths
were fitted), as a ``rose-run profile`` file does. ``rose-run --save-steps``,
``rose-serve --save-steps``, ``rose-sim --save-steps`` and roseinfer's vLLM
scheduler class (``ROSEINFER_STEP_LOG``) write this schema; any engine can.
"""

from __future__ import annotations

import datetime
import gzip
import json
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from roseinfer.calibration.cost_model import BatchShape
from roseinfer.calibration.specs import ModelSpec

STEP_LOG_SCHEMA = "roseinfer-steplog/1"

__all__ = [
    "STEP_LOG_SCHEMA",
    "StepLogError",
    "StepLogFile",
    "StepLogWriter",
    "StepRecord",
    "is_step_log",
    "load_step_log",
]


class StepLogError(ValueError):
    """A step log that cannot be used (the message names the file, the line and the fix)."""


MAX_STEP_S = 86_400.0
"""Longest step a log may record (a day): 1e308 s overflowed every sum of step times."""
MIN_STEP_S = 1e-6
"""Shortest step a log may record besides 0 (an empty step, skipped by fits): no forward
pass of a transformer takes under a microsecond; 1e-15 s steps priced TTFT at 0.00 ms."""
MAX_STEP_TOKENS = 2**31 - 1
"""Largest token count a step may record per request (new or context tokens), as a
trace may give (``roseinfer.workloads.traces.MAX_TRACE_TOKENS``); 10^18 overflowed sums."""
PHASES = ("prefill", "decode", "mixed", "")
"""The ``phase`` values a step may have (``""``: the engine does not say)."""


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One executed step (see the module docstring for the meaning of each field).

    Attributes:
        step: index of the step in its run (0-based).
        start_s, end_s: seconds on the run's clock.
        forward_s: device seconds of the step, or None when not split out.
        phase: ``prefill``, ``decode``, ``mixed`` or ``""``.
        request_ids: one id per scheduled request.
        num_new_tokens: tokens each computes (>= 1).
        num_context_tokens: each one's context after the step (>= its new tokens).
        is_decode: True for decodes.

    Raises:
        ValueError: on columns of different lengths, a negative duration, or
            token counts out of range.
    """

    step: int
    start_s: float
    end_s: float
    forward_s: float | None
    phase: str
    request_ids: tuple[str, ...]
    num_new_tokens: tuple[int, ...]
    num_context_tokens: tuple[int, ...]
    is_decode: tuple[bool, ...]

    def __post_init__(self) -> None:
        n = len(self.request_ids)
        lengths = (len(self.num_new_tokens), len(self.num_context_tokens), len(self.is_decode))
        if any(length != n for length in lengths):
            raise ValueError(f"step {self.step}: columns of different lengths ({n}, {lengths})")
        if not (math.isfinite(self.start_s) and math.isfinite(self.end_s)):
            raise ValueError(f"step {self.step}: start_s and end_s must be finite")
        if self.end_s < self.start_s:
            raise ValueError(f"step {self.step}: end_s {self.end_s} < start_s {self.start_s}")
        duration = self.end_s - self.start_s
        if duration > MAX_STEP_S:
            raise ValueError(
                f"step {self.step}: lasts {duration:.3g} s, more than "
                f"{MAX_STEP_S:g} s (a day); the log is damaged"
            )
        if 0 < duration < MIN_STEP_S:
            raise ValueError(
                f"step {self.step}: end_s - start_s is {duration:.3g} s, under {MIN_STEP_S:g} s "
                "(no forward pass is that short); the log is damaged or not in seconds"
            )
        if self.phase not in PHASES:
            raise ValueError(
                f"step {self.step}: phase must be one of {', '.join(map(repr, PHASES))}, "
                f"got {self.phase!r:.40}"
            )
        for new, context in zip(self.num_new_tokens, self.num_context_tokens):
            if not 1 <= new <= context <= MAX_STEP_TOKENS:
                raise ValueError(
                    f"step {self.step}: needs 1 <= num_new_tokens <= num_context_tokens <= "
                    f"{MAX_STEP_TOKENS}, got {new} and {context}"
                )

    @property
    def duration_s(self) -> float:
        """``end_s - start_s``: what the step cost, host work included (s)."""
        return self.end_s - self.start_s

    @property
    def host_s(self) -> float | None:
        """Host seconds outside the forward, or None when ``forward_s`` is unknown."""
        return None if self.forward_s is None else max(0.0, self.duration_s - self.forward_s)

    @property
    def num_seqs(self) -> int:
        """Requests in the step."""
        return len(self.request_ids)

    @property
    def kind(self) -> str:
        """``prefill`` (no decodes), ``decode`` (decodes only) or ``mixed``."""
        num_decodes = sum(self.is_decode)
        if num_decodes == self.num_seqs:
            return "decode"
        return "prefill" if num_decodes == 0 else "mixed"

    @property
    def shape(self) -> BatchShape:
        """The cost model's view of the step."""
        decode = np.asarray(self.is_decode, dtype=bool)
        new = np.asarray(self.num_new_tokens, dtype=np.int64)
        context = np.asarray(self.num_context_tokens, dtype=np.int64)
        return BatchShape(new[~decode], context[~decode], context[decode])

    def key(self) -> tuple[tuple[int, int, bool], ...]:
        """The step's shape as a sorted tuple of (new, context, is_decode): equal
        for two steps that compute the same thing, whatever the request ids."""
        return tuple(sorted(zip(self.num_new_tokens, self.num_context_tokens, self.is_decode)))

    def to_json(self) -> dict[str, Any]:
        """One JSON line of the log."""
        host = self.host_s
        return {
            "step": self.step,
            "start_s": self.start_s,
            "end_s": self.end_s,
            "forward_s": self.forward_s,
            "host_s": host,
            "phase": self.phase,
            "request_ids": list(self.request_ids),
            "num_new_tokens": list(self.num_new_tokens),
            "num_context_tokens": list(self.num_context_tokens),
            "is_decode": list(self.is_decode),
        }

    @classmethod
    def from_json(cls, row: Mapping[str, Any]) -> StepRecord:
        """The inverse of :meth:`to_json` (``host_s`` is derived, not read).

        Raises:
            ValueError: on a malformed row, naming the field and what it must be.
        """
        forward = row.get("forward_s")
        return cls(
            step=_field(row, "step", _is_int, "an integer"),
            start_s=float(_field(row, "start_s", _is_number, "a number of seconds")),
            end_s=float(_field(row, "end_s", _is_number, "a number of seconds")),
            forward_s=None
            if forward is None
            else float(_field(row, "forward_s", _is_number, "a number of seconds or null")),
            phase=_field({"phase": row.get("phase", "")}, "phase", _is_str, "a string"),
            request_ids=tuple(
                str(r) for r in _column(row, "request_ids", _is_id, "strings or integers")
            ),
            num_new_tokens=_column(row, "num_new_tokens", _is_int, "integers"),
            num_context_tokens=_column(row, "num_context_tokens", _is_int, "integers"),
            is_decode=_column(row, "is_decode", _is_bool, "true or false"),
        )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_str(value: Any) -> bool:
    return isinstance(value, str)


def _is_id(value: Any) -> bool:
    return isinstance(value, str) or _is_int(value)


def _is_bool(value: Any) -> bool:
    return isinstance(value, bool)


def _field(row: Mapping[str, Any], key: str, ok: Any, what: str) -> Any:
    """``row[key]`` when ``ok(row[key])``; else ValueError naming ``key`` and ``what``."""
    if key not in row:
        raise ValueError(f"missing field {key!r}")
    value = row[key]
    if not ok(value):
        raise ValueError(f"{key} must be {what}, got {_echo(value)}")
    return value


def _column(row: Mapping[str, Any], key: str, ok: Any, what: str) -> tuple[Any, ...]:
    """``row[key]`` as a tuple when it is a list whose items pass ``ok``."""
    values = _field(row, key, lambda v: isinstance(v, list), f"a list of {what}")
    for value in values:
        if not ok(value):
            raise ValueError(f"{key} must be a list of {what}, got an item {_echo(value)}")
    return tuple(values)


def _echo(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:40] + "..."


def make_header(
    backend: str,
    *,
    model: Mapping[str, Any] | None = None,
    executor: Mapping[str, Any] | None = None,
    scheduler: Mapping[str, Any] | None = None,
    environment: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The header line of a step log (see the module docstring)."""
    created = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return {
        "schema": STEP_LOG_SCHEMA,
        "backend": backend,
        "created": created,
        "model": dict(model or {}),
        "executor": dict(executor or {}),
        "scheduler": dict(scheduler or {}),
        "environment": dict(environment or {}),
    }


class StepLogWriter:
    """Writes a step log as steps happen (a header, then one line per step).

    Lines are buffered and written in batches; :meth:`close` (or leaving a
    ``with`` block) writes the rest. Not thread-safe: one writer per engine loop.

    Args:
        path: the file to write (parents created), or an open text file.
        header: the header (:func:`make_header`).
        flush_every: steps buffered before a write.
    """

    def __init__(
        self, path: str | Path | IO[str], header: Mapping[str, Any], flush_every: int = 256
    ) -> None:
        if isinstance(path, (str, Path)):
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._file: IO[str] = open(path, "w")  # noqa: SIM115 -- closed by close()
            self._owns = True
        else:
            self._file, self._owns = path, False
        self._buffer: list[str] = [json.dumps(dict(header))]
        self._flush_every = flush_every
        self.num_steps = 0

    def write(self, record: StepRecord) -> None:
        """Add one step."""
        self._buffer.append(json.dumps(record.to_json()))
        self.num_steps += 1
        if len(self._buffer) >= self._flush_every:
            self.flush()

    def flush(self) -> None:
        """Write the buffered lines."""
        if self._buffer:
            self._file.write("\n".join(self._buffer) + "\n")
            self._buffer = []
        self._file.flush()

    def close(self) -> None:
        """Write what is buffered and close the file (if this writer opened it)."""
        if self._file.closed:
            return
        self.flush()
        if self._owns:
            self._file.close()

    def __enter__(self) -> StepLogWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class StepLogFile:
    """A step log read back.

    Attributes:
        path: where it was read from.
        header: the header line (schema, backend, model, executor, scheduler, environment).
        records: the steps, in file order.
    """

    path: str
    header: dict[str, Any]
    records: list[StepRecord]

    @property
    def executor(self) -> dict[str, Any]:
        """The header's executor section (rose-sim's defaults)."""
        return dict(self.header.get("executor") or {})

    def durations_s(self) -> np.ndarray:
        """``end_s - start_s`` of every step, float64 ``[num_steps]``."""
        return np.array([r.duration_s for r in self.records], dtype=np.float64)


def is_step_log(path: str | Path) -> bool:
    """True when ``path``'s first line is a step-log header (False when unreadable)."""
    return first_line_schema(path) == STEP_LOG_SCHEMA


def first_line_schema(path: str | Path) -> str | None:
    """The ``schema`` of ``path``'s first line when it is a JSON object that names
    one (a step log's header, of any version); None otherwise or when unreadable."""
    if not Path(path).is_file():  # a device (/dev/zero) or a folder: never read
        return None
    try:
        with _open_text(path) as f:
            first = f.readline(1 << 20)
        schema = json.loads(first).get("schema")
    except (OSError, EOFError, ValueError, AttributeError, RecursionError):
        return None
    return schema if isinstance(schema, str) else None


def _open_text(path: str | Path) -> IO[str]:
    """``path`` opened for reading text, through gzip when it ends in ``.gz``."""
    if str(path).endswith(".gz"):
        return gzip.open(path, "rt")
    return open(path)


def load_step_log(path: str | Path) -> StepLogFile:
    """Read a step log (``FILE.jsonl``, or gzipped ``FILE.jsonl.gz``).

    Raises:
        StepLogError: if the file is missing, is not a step log, or a line is
            malformed (naming the line and what is wrong).
    """
    if Path(path).exists() and not Path(path).is_file():  # a device or a folder: never read
        raise StepLogError(f"{path}: not a file; give a step log (--save-steps writes one)")
    try:
        with _open_text(path) as f:
            lines = f.read().splitlines()
    except (OSError, EOFError) as err:
        why = getattr(err, "strerror", None) or str(err)
        raise StepLogError(f"cannot read step log {path}: {why}") from None
    except UnicodeDecodeError:
        raise StepLogError(f"{path} is not a text file; expected a step log (JSON lines)") from None
    header = _header(path, lines[0] if lines else "")
    records = list(_records(path, lines))
    if not records:
        raise StepLogError(f"step log {path} holds no steps; record a run with --save-steps")
    return StepLogFile(str(path), header, records)


def _header(path: str | Path, line: str) -> dict[str, Any]:
    try:
        header = json.loads(line)
    except (ValueError, RecursionError):
        header = None
    if not isinstance(header, dict) or header.get("schema") != STEP_LOG_SCHEMA:
        raise StepLogError(
            f"{path}:1: not a roseinfer step log (expected a header with schema "
            f"{STEP_LOG_SCHEMA!r}); write one with `rose-run --save-steps FILE`"
        )
    try:
        _check_header(header)
    except ValueError as err:
        raise StepLogError(f"{path}:1: bad header: {err}; re-record the run") from None
    return header


_HEADER_COUNTS = ("num_kv_blocks", "block_size", "max_model_len", "max_num_seqs",
                  "max_num_batched_tokens")  # fmt: skip
"""Header ``executor`` fields that are counts (ints > 0, or null) when present."""


def _check_header(header: Mapping[str, Any]) -> None:
    """The header's ``model`` and ``executor`` sections are objects; ``model.spec`` is
    null or a valid model shape; the executor's counts are positive integers.

    Raises:
        ValueError: naming the field.
    """
    for section in ("model", "executor", "scheduler", "environment"):
        value = header.get(section)
        if value is not None and not isinstance(value, dict):
            raise ValueError(f"{section} must be an object, got {_echo(value)}")
    spec = (header.get("model") or {}).get("spec")
    if spec is not None:
        if not isinstance(spec, dict):
            raise ValueError(
                f"model.spec must be an object of model-shape fields, got {_echo(spec)}"
            )
        try:
            ModelSpec(**spec)
        except (TypeError, ValueError) as err:
            raise ValueError(f"model.spec is not a model shape ({str(err)[:120]})") from None
    executor = header.get("executor") or {}
    for key in _HEADER_COUNTS:
        value = executor.get(key)
        if value is not None and not (_is_int(value) and 0 < value <= MAX_STEP_TOKENS):
            raise ValueError(f"executor.{key} must be a positive integer, got {_echo(value)}")


def _records(path: str | Path, lines: Sequence[str]) -> Iterator[StepRecord]:
    for number, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row, dict):
                raise ValueError("not a JSON object")
            yield StepRecord.from_json(row)
        except RecursionError:
            raise StepLogError(
                f"{path}:{number}: bad step: JSON nested too deep to read; the log is damaged"
            ) from None
        except (ValueError, KeyError, TypeError) as err:
            detail = f"missing field {err}" if isinstance(err, KeyError) else str(err)[:200]
            raise StepLogError(f"{path}:{number}: bad step: {detail}") from None


def records_of(
    scheduled: Iterable[tuple[str, int, int, bool]],
    *,
    first_step: int,
    start_s: float,
    end_times_s: Sequence[float],
    forward_s: float | None,
    phase: str,
) -> list[StepRecord]:
    """Step records of one scheduler output covering ``len(end_times_s)`` steps.

    Args:
        scheduled: per request ``(request_id, num_computed_tokens, num_new_tokens,
            is_decode)`` of the first step; a multi-step decode output repeats it
            with every context one token longer per step.
        first_step: the first step's index; start_s: its start (s).
        end_times_s: end of each step (s); each step starts where the last ended.
        forward_s: device seconds of a single step, or None.
        phase: the scheduler's phase.
    """
    items = list(scheduled)
    ids = tuple(i[0] for i in items)
    new = tuple(i[2] for i in items)
    decode = tuple(i[3] for i in items)
    records, start = [], start_s
    for j, end in enumerate(end_times_s):
        context = tuple(i[1] + i[2] + j for i in items)
        fwd = forward_s if len(end_times_s) == 1 else None
        records.append(
            StepRecord(first_step + j, start, float(end), fwd, phase, ids, new, context, decode)
        )
        start = float(end)
    return records


class StepRecorder:
    """A step observer (``roseinfer.driver.StepObserver``) that turns every applied
    scheduler output into :class:`StepRecord` s: written to a step log, kept in
    memory, or both.

    Args:
        writer: where to write them, or None.
        keep: also keep them in :attr:`records`.
    """

    def __init__(self, writer: StepLogWriter | None = None, *, keep: bool = False) -> None:
        self.writer = writer
        self.records: list[StepRecord] | None = [] if keep else None

    def __call__(self, out: Any, start_s: float, result: Any) -> None:
        """Record the steps of ``out`` (a ``SchedulerOutput``) that started at
        ``start_s`` (s) and gave ``result`` (a ``StepResult``)."""
        items = [
            (i.seq.request_id, i.num_computed_tokens, i.num_new_tokens, i.is_decode)
            for i in out.scheduled
        ]
        phase = out.phase.value if out.phase is not None else ""
        for record in records_of(
            items,
            first_step=out.step_index,
            start_s=start_s,
            end_times_s=result.end_times_s,
            forward_s=result.forward_s,
            phase=phase,
        ):
            if self.writer is not None:
                self.writer.write(record)
            if self.records is not None:
                self.records.append(record)
