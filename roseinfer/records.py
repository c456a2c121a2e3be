"""The step log and per-request records (both backends).

Token times are derived from the step log rather than stored per token: in a
stay in the running set, a request samples its first token at the step that
completes its (re)prefill and then one token in every step that carries decodes
(every decode and mixed step holds every decoding request), until it leaves.
So one array of step end times, the indices of decode-carrying steps, and each
stay's first-token and last step give every token time (the schema is
``roseinfer.metrics.schema``). Records are built as requests end
(:class:`RecordBuilder`), so nothing per finished request stays in the scheduler.
"""

from __future__ import annotations

import threading
from array import array
from bisect import bisect_right
from collections.abc import Mapping
from collections.abc import Sequence as SequenceABC
from typing import TYPE_CHECKING, Any

import numpy as np

from roseinfer.metrics.histogram import LogHistogram
from roseinfer.metrics.schema import COLUMNS, OPTIONAL_COLUMNS
from roseinfer.sequence import SeqStatus, Sequence

if TYPE_CHECKING:
    import pandas as pd

COMPILED = not __file__.endswith(".py")  # built by setup.py: fill token times in a C loop


class StepLog:
    """End times of the steps of a run and which of them carried decodes.

    Stored in flat typed arrays (8 bytes per step, and 8 per step that carried
    no decodes). Step indices are absolute; :meth:`release` drops the steps
    before a given one once no request still to be recorded refers to them, so
    a long run keeps only a window of steps.
    """

    __slots__ = ("_end_s", "_prefill_steps", "_base")

    def __init__(self) -> None:
        self._end_s = array("d")
        self._prefill_steps = array("q")  # absolute indices of steps without decodes, ascending
        self._base = 0  # absolute index of self._end_s[0]

    @property
    def num_steps(self) -> int:
        """Steps logged so far (released ones included)."""
        return self._base + len(self._end_s)

    @property
    def first_kept_step(self) -> int:
        """Index of the oldest step still held (0 until :meth:`release`)."""
        return self._base

    @property
    def end_s(self) -> np.ndarray:
        """End time (s) of every held step, float64 ``[num_steps - first_kept_step]``
        (a read-only view)."""
        view = np.frombuffer(self._end_s, dtype=np.float64) if self._end_s else np.empty(0)
        view.flags.writeable = False
        return view

    @property
    def carries_decodes(self) -> np.ndarray:
        """bool ``[num_steps - first_kept_step]``: True for held steps that carried decodes."""
        flags = np.ones(len(self._end_s), dtype=bool)
        flags[self._prefill_indices() - self._base] = False
        return flags

    def append(self, end_times_s: SequenceABC[float], carries_decodes: bool) -> None:
        """Log consecutive steps ending at ``end_times_s`` (s)."""
        first = self._base + len(self._end_s)
        ends = end_times_s if isinstance(end_times_s, list) else list(end_times_s)
        self._end_s.fromlist(ends)
        if carries_decodes:
            return
        if len(ends) == 1:  # a prefill step (a run of steps carries decodes)
            self._prefill_steps.append(first)
        else:
            self._prefill_steps.fromlist(list(range(first, first + len(ends))))

    def release(self, before_step: int) -> None:
        """Forget the steps with index < ``before_step`` (their token times can no
        longer be asked for); the last step is always kept."""
        drop = min(before_step, self.num_steps - 1) - self._base
        if drop <= 0:
            return
        del self._end_s[:drop]
        self._base += drop
        cut = int(np.searchsorted(self._prefill_indices(), self._base, side="left"))
        del self._prefill_steps[:cut]

    def _prefill_indices(self) -> np.ndarray:
        if not self._prefill_steps:
            return np.empty(0, dtype=np.int64)
        return np.frombuffer(self._prefill_steps, dtype=np.int64)

    def token_times_s(self, stays: SequenceABC[SequenceABC[int | None]]) -> np.ndarray:
        """Times (s) of every token sampled in ``stays`` (``[first_token_step,
        last_step]`` pairs; a stay with no first token produced none).

        Raises:
            IndexError: if a stay refers to a released step.
        """
        spans, num_tokens = self._spans(stays)
        if COMPILED:
            times = np.empty(num_tokens)
            self._fill_times(spans, times, 0)
            return times
        base, end_s, prefill_idx = self._base, self.end_s, self._prefill_indices()
        parts: list[np.ndarray] = []
        for first, last, lo, hi in spans:
            part = end_s[first - base : last - base + 1]
            if hi > lo:  # drop the prefill-only steps after the first token
                keep = np.ones(len(part), dtype=bool)
                keep[prefill_idx[lo:hi] - first] = False
                part = part[keep]
            parts.append(part)
        if len(parts) == 1:
            return parts[0].copy()  # NOTE: a view would pin the log's buffer (no appends)
        if not parts:
            return np.empty(0)
        return np.concatenate(parts)

    def token_times_into(
        self, stays: SequenceABC[SequenceABC[int | None]], out: array, start: int
    ) -> int:
        """Write :meth:`token_times_s` into ``out[start:]`` (a float64 buffer with
        room for them) and return how many there are.

        Raises:
            IndexError: if a stay refers to a released step, or ``out`` is too short.
        """
        spans, num_tokens = self._spans(stays)
        if start + num_tokens > len(out):
            raise IndexError(f"{num_tokens} token times do not fit the buffer")
        self._fill_times(spans, out, start)
        return num_tokens

    def _spans(
        self, stays: SequenceABC[SequenceABC[int | None]]
    ) -> tuple[list[tuple[int, int, int, int]], int]:
        """The stays that sampled tokens, as ``(first, last, lo, hi)`` with the
        prefill-only steps inside at ``_prefill_steps[lo:hi]``, and the token count.
        In a stay, a token comes at its first-token step and at every later step up
        to its last that carried decodes: all but the prefill-only steps."""
        base, prefill = self._base, self._prefill_steps
        spans: list[tuple[int, int, int, int]] = []
        num_tokens = 0
        for first, last in stays:
            if first is None or last is None or last < first:
                continue
            if first < base:
                raise IndexError(f"step {first} was released (steps before {base} are gone)")
            if COMPILED:  # a typed binary search (bisect_right costs a Python call)
                lo, hi = _count_upto(prefill, first), _count_upto(prefill, last)
            else:
                lo, hi = bisect_right(prefill, first), bisect_right(prefill, last)
            spans.append((first, last, lo, hi))
            num_tokens += last - first + 1 - (hi - lo)
        return spans, num_tokens

    def _fill_times(
        self, spans: list[tuple[int, int, int, int]], out: array | np.ndarray, pos: int
    ) -> None:
        """Token times of ``spans`` into ``out[pos:]``, step by step (the compiled
        core's loop; ``out`` is a typed view there)."""
        end_s, prefill = self._end_s, self._prefill_steps  # typed views (records.pxd)
        base = self._base
        for first, last, lo, hi in spans:
            skip = prefill[lo] if lo < hi else last + 1  # the next prefill-only step
            for step in range(first, last + 1):
                if step == skip:
                    lo += 1
                    skip = prefill[lo] if lo < hi else last + 1
                    continue
                out[pos] = end_s[step - base]
                pos += 1


def _count_upto(values: array, x: int) -> int:
    """How many of the ascending ``values`` are <= ``x`` (``bisect_right``)."""
    lo, hi = 0, len(values)
    while lo < hi:
        mid = (lo + hi) // 2
        if values[mid] <= x:
            lo = mid + 1
        else:
            hi = mid
    return lo


def _diff_in_place(values: array, start: int, count: int) -> None:
    """Replace ``values[start:start + count]`` by its ``count - 1`` successive
    differences (``np.diff``'s, in place, from the front)."""
    for i in range(start, start + count - 1):
        values[i] = values[i + 1] - values[i]


_FLOAT_COLUMNS = ("arrival_s", "admitted_s", "first_token_s", "finish_s", "deadline_s")
_INT_COLUMNS = (
    "priority",
    "num_prompt_tokens",
    "num_output_tokens",
    "num_cached_prompt_tokens",
    "num_preemptions",
)


class RecordBuilder:
    """Collects one row per ended request (schema: ``roseinfer.metrics.schema``).

    Numeric columns are kept in typed arrays (8 bytes a cell). Thread-safe: a
    server's worker may add rows while another thread reads the frame.

    Args:
        keep_token_ids: also keep ``prompt_token_ids`` and ``output_token_ids``
            columns (lists), to compare a run with another implementation.
        keep_token_times: keep every token's time (``token_times_s``, 8 bytes a
            token: gigabytes for millions of requests). When False the column
            holds None and the inter-token gaps of finished requests are counted
            in :attr:`itl` (a :class:`~roseinfer.metrics.LogHistogram`) instead,
            for ``summarize(..., itl=builder.itl)``.
    """

    def __init__(self, *, keep_token_ids: bool = False, keep_token_times: bool = True) -> None:
        self.keep_token_ids = keep_token_ids
        self.keep_token_times = keep_token_times
        self.itl: LogHistogram | None = None if keep_token_times else LogHistogram()
        self._rows: dict[str, Any] = self._new_rows()
        self._order = array("q")  # submission index of each row
        self._gaps: list[np.ndarray] = []  # ITL gaps not yet in the histogram
        self._num_gaps = 0
        # NOTE: the compiled core writes them into one buffer instead (_gap_buffer[:_num_gaps])
        self._gap_buffer = array("d", bytes(8 << 16)) if COMPILED and not keep_token_times else None
        self._lock = threading.Lock()

    def _new_rows(self) -> dict[str, Any]:
        rows: dict[str, Any] = {name: [] for name in (*COLUMNS, *OPTIONAL_COLUMNS)}
        rows.update({name: array("d") for name in _FLOAT_COLUMNS})
        rows.update({name: array("q") for name in _INT_COLUMNS})
        if self.keep_token_ids:
            rows["prompt_token_ids"] = []
            rows["output_token_ids"] = []
        return rows

    def __len__(self) -> int:
        return len(self._rows["request_id"])

    def add(self, seq: Sequence, step_log: StepLog) -> None:
        """Append the row of an ended request.

        Raises:
            AssertionError: if its derived token count disagrees with its output
                count (a scheduler bug, never silent).
        """
        if self._gap_buffer is not None:
            with self._lock:
                self._add_lean(seq, step_log)
            return
        times = step_log.token_times_s(seq.stays)
        assert len(times) == seq.num_output_tokens, f"{seq}: {len(times)} token times"
        with self._lock:
            self._add(seq, times)

    def _add_lean(self, seq: Sequence, step_log: StepLog) -> None:
        """:meth:`add` without token times, as the compiled core runs it: the times
        go straight into the gap buffer, become gaps there (a finished request's)
        and are counted in :attr:`itl` in the same batches as :meth:`_count_gaps`."""
        buffer, start = self._gap_buffer, self._num_gaps
        assert buffer is not None
        if start + seq.num_output_tokens > len(buffer):
            grown = array("d", bytes(8 * (start + seq.num_output_tokens)))
            grown[:start] = buffer[:start]
            buffer = self._gap_buffer = grown
        count = step_log.token_times_into(seq.stays, buffer, start)
        assert count == seq.num_output_tokens, f"{seq}: {count} token times"
        first_s = buffer[start] if count else np.nan
        if seq.status is SeqStatus.FINISHED and count > 1:
            _diff_in_place(buffer, start, count)
            self._num_gaps = start + count - 1
        self._add(seq, None, first_s)
        if self._num_gaps >= 1 << 16:
            self._flush_gaps()

    def _add(self, seq: Sequence, times: np.ndarray | None, first_s: float = np.nan) -> None:
        """Append the row (``times``: the token times, or None when the lean path
        counted its gaps and gives its first token's time as ``first_s``)."""
        finished = seq.status is SeqStatus.FINISHED
        req, rows = seq.request, self._rows
        self._order.append(seq.seq_id)
        rows["request_id"].append(req.request_id)
        rows["tenant"].append(req.tenant)
        rows["status"].append("finished" if finished else "rejected")
        rows["reject_reason"].append(seq.reject_reason)
        rows["arrival_s"].append(req.arrival_time_s)
        rows["admitted_s"].append(np.nan if seq.admitted_s is None else seq.admitted_s)
        if times is not None:
            first_s = times[0] if len(times) else np.nan
        rows["first_token_s"].append(first_s)
        rows["finish_s"].append(seq.finish_s if finished else np.nan)
        rows["num_prompt_tokens"].append(req.num_prompt_tokens)
        rows["num_output_tokens"].append(seq.num_output_tokens)
        rows["num_cached_prompt_tokens"].append(seq.num_cached_prompt_tokens or 0)
        rows["num_preemptions"].append(seq.num_preemptions)
        rows["stop_reason"].append(seq.stop_reason)
        if self.keep_token_times:
            rows["token_times_s"].append(times)
        else:
            rows["token_times_s"].append(None)
            if times is not None and finished and len(times) > 1:
                self._count_gaps(np.diff(times))
        rows["priority"].append(req.priority)
        rows["deadline_s"].append(np.nan if req.deadline_s is None else req.deadline_s)
        if self.keep_token_ids:
            rows["prompt_token_ids"].append(list(req.prompt_token_ids or ()))
            rows["output_token_ids"].append(list(seq.output_token_ids))

    def _count_gaps(self, gaps: np.ndarray) -> None:
        self._gaps.append(gaps)
        self._num_gaps += gaps.size
        if self._num_gaps >= 1 << 16:
            self._flush_gaps()

    def _flush_gaps(self) -> None:
        if self._gap_buffer is not None:
            if self._num_gaps and self.itl is not None:
                # NOTE: a view, gone before the buffer is written again
                self.itl.add(
                    np.frombuffer(self._gap_buffer, dtype=np.float64, count=self._num_gaps)
                )
            self._num_gaps = 0
            return
        if self._gaps and self.itl is not None:
            self.itl.add(np.concatenate(self._gaps))
        self._gaps, self._num_gaps = [], 0

    def extend(self, seqs: SequenceABC[Sequence], step_log: StepLog) -> None:
        """Append the rows of several ended requests."""
        for seq in seqs:
            self.add(seq, step_log)

    def frame(self) -> pd.DataFrame:
        """The records so far as a DataFrame, in submission order (also moves
        pending gaps into :attr:`itl`)."""
        with self._lock:
            self._flush_gaps()
            return _frame(self._rows, self._order)

    def drain(self) -> pd.DataFrame:
        """The rows so far (as :meth:`frame`), then forgets them: a server hands
        them to its records file and keeps nothing per ended request (:attr:`itl`
        keeps counting)."""
        return frame_of(self.drain_columns())

    def drain_columns(self) -> dict[str, Any]:
        """As :meth:`drain`, without pandas: the columns in submission order by
        name (numpy arrays for numbers, lists otherwise), which
        ``roseinfer.metrics.summarize`` takes as they are and :func:`frame_of`
        makes a DataFrame of."""
        with self._lock:
            self._flush_gaps()
            rows, order = self._rows, self._order
            self._rows, self._order = self._new_rows(), array("q")
        return _ordered_columns(rows, order, consume=True)

    def clear(self) -> None:
        """Forget the rows so far without building a frame (:attr:`itl` keeps counting)."""
        with self._lock:
            self._flush_gaps()
            self._rows, self._order = self._new_rows(), array("q")


def frame_of(columns: Mapping[str, Any]) -> pd.DataFrame:
    """Record columns (:meth:`RecordBuilder.drain_columns`) as a DataFrame, the
    numpy columns handed over uncopied."""
    import pandas as pd  # NOTE: lazily: the scheduler imports this module, pandas costs 0.4 s

    return pd.DataFrame(columns, copy=False)


def _frame(rows: dict[str, Any], order: array, *, consume: bool = False) -> pd.DataFrame:
    """``rows`` as a DataFrame sorted by ``order`` (see :func:`_ordered_columns`)."""
    return frame_of(_ordered_columns(rows, order, consume=consume))


def _ordered_columns(
    rows: dict[str, Any], order: array, *, consume: bool = False
) -> dict[str, Any]:
    """``rows`` sorted by ``order`` (submission index), each column put in order
    once; ``consume`` empties ``rows`` column by column as it goes (a drained
    builder's rows), so the rows and their sorted copy are never both whole in
    memory (a million requests: 300 MB)."""
    perm = np.argsort(_copy(order), kind="stable")
    columns: dict[str, Any] = {}
    for name in list(rows):
        values = rows.pop(name) if consume else rows[name]
        if isinstance(values, array):
            columns[name] = _copy(values)[perm] if len(values) else _copy(values)
        else:
            columns[name] = [values[i] for i in perm.tolist()]
        del values
    return columns


def _copy(values: array) -> np.ndarray:
    """A typed array as a numpy array that owns its data (a view would pin the
    array's buffer and make later appends fail)."""
    dtype = np.float64 if values.typecode == "d" else np.int64
    return np.frombuffer(values, dtype=dtype).copy() if len(values) else np.empty(0, dtype)


class RecordFileWriter:
    """Appends record batches to a ``.csv`` or ``.parquet`` file as they come (a
    server's ``--save-records``: rows are written as requests end, none is kept).

    The file has :func:`roseinfer.metrics.write_records`'s columns and cell
    formats (CSV: token times space-separated, formula cells escaped). CSV gets
    the header with the first batch and is readable at any time; Parquet gets
    one row group per batch and is readable once :meth:`close` wrote its footer.

    Args:
        path: the file (created or truncated at the first batch).

    Raises:
        ValueError: on an extension other than ``.csv`` or ``.parquet``.
    """

    def __init__(self, path: Any) -> None:
        from pathlib import Path

        from roseinfer.metrics.io import RECORD_SUFFIXES

        self.path = Path(path)
        self.suffix = self.path.suffix.lower()
        if self.suffix not in RECORD_SUFFIXES:
            raise ValueError(f"records need a .csv or .parquet file name, got {self.path.name!r}")
        self.num_rows = 0
        self._started = False
        self._parquet: Any = None  # pyarrow.parquet.ParquetWriter, opened at the first batch
        self._lock = threading.Lock()

    def write(self, frame: pd.DataFrame) -> None:
        """Append ``frame``'s rows (a :meth:`RecordBuilder.drain` batch); the first
        batch creates the file, even with no rows (a header, a schema)."""
        with self._lock:
            if self._started and not len(frame):
                return
            if self.suffix == ".csv":
                self._write_csv(frame)
            else:
                self._write_parquet(frame)
            self._started = True
            self.num_rows += len(frame)

    def __call__(self, frame: pd.DataFrame) -> None:
        """:meth:`write` (the writer is a ``StreamingEngine`` record sink)."""
        self.write(frame)

    def _write_csv(self, frame: pd.DataFrame) -> None:
        import pandas as pd

        from roseinfer.metrics.io import escape_formula

        frame = frame.copy()
        for column in frame.columns:
            if column != "token_times_s" and not pd.api.types.is_numeric_dtype(frame[column]):
                frame[column] = [escape_formula(v) for v in frame[column]]
        frame["token_times_s"] = [
            "" if t is None else " ".join(f"{x:.6f}" for x in t) for t in frame["token_times_s"]
        ]
        first = not self._started
        if first:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        frame.to_csv(self.path, mode="w" if first else "a", header=first, index=False)

    def _write_parquet(self, frame: pd.DataFrame) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        frame = frame.copy()
        frame["token_times_s"] = [
            None if t is None else list(map(float, t)) for t in frame["token_times_s"]
        ]
        # NOTE: a fixed schema: a batch whose tenants are all None must not change a type
        schema = pa.schema([(name, _arrow_type(pa, name)) for name in frame.columns])
        table = pa.Table.from_pandas(frame, schema=schema, preserve_index=False)
        if self._parquet is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._parquet = pq.ParquetWriter(self.path, schema)
        self._parquet.write_table(table)

    def close(self) -> None:
        """Finish the file (Parquet's footer; CSV needs nothing). Idempotent."""
        with self._lock:
            if self._parquet is not None:
                self._parquet.close()
                self._parquet = None


def _arrow_type(pa: Any, column: str) -> Any:
    if column in _FLOAT_COLUMNS:
        return pa.float64()
    if column in _INT_COLUMNS:
        return pa.int64()
    if column == "token_times_s":
        return pa.list_(pa.float64())
    if column in ("prompt_token_ids", "output_token_ids"):
        return pa.list_(pa.int64())
    return pa.string()
