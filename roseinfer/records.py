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
from collections.abc import Sequence as SequenceABC

import numpy as np
import pandas as pd

from roseinfer.metrics.schema import COLUMNS, OPTIONAL_COLUMNS
from roseinfer.sequence import SeqStatus, Sequence


class StepLog:
    """End times of every step of a run and which of them carried decodes.

    Stored in flat typed arrays (8 bytes per step), so a run of millions of
    steps stays small.
    """

    __slots__ = ("_end_s", "_decode_steps")

    def __init__(self) -> None:
        self._end_s = array("d")
        self._decode_steps = array("q")  # indices of decode-carrying steps, ascending

    @property
    def num_steps(self) -> int:
        """Steps logged so far."""
        return len(self._end_s)

    @property
    def end_s(self) -> np.ndarray:
        """End time (s) of every step, float64 ``[num_steps]`` (a read-only view)."""
        view = np.frombuffer(self._end_s, dtype=np.float64) if self._end_s else np.empty(0)
        view.flags.writeable = False
        return view

    @property
    def carries_decodes(self) -> np.ndarray:
        """bool ``[num_steps]``: True for steps that carried decodes."""
        flags = np.zeros(self.num_steps, dtype=bool)
        flags[self._decode_indices()] = True
        return flags

    def append(self, end_times_s: SequenceABC[float], *, carries_decodes: bool) -> None:
        """Log consecutive steps ending at ``end_times_s`` (s)."""
        first = len(self._end_s)
        self._end_s.extend(float(t) for t in end_times_s)
        if carries_decodes:
            self._decode_steps.extend(range(first, len(self._end_s)))

    def _decode_indices(self) -> np.ndarray:
        if not self._decode_steps:
            return np.empty(0, dtype=np.int64)
        return np.frombuffer(self._decode_steps, dtype=np.int64)

    def token_times_s(self, stays: SequenceABC[SequenceABC[int | None]]) -> np.ndarray:
        """Times (s) of every token sampled in ``stays`` (``[first_token_step,
        last_step]`` pairs; a stay with no first token produced none)."""
        end_s, decode_idx = self.end_s, self._decode_indices()
        parts: list[np.ndarray] = []
        for first, last in stays:
            if first is None or last is None or last < first:
                continue
            lo = int(np.searchsorted(decode_idx, first, side="right"))
            hi = int(np.searchsorted(decode_idx, last, side="right"))
            parts.append(end_s[first : first + 1])
            parts.append(end_s[decode_idx[lo:hi]])
        if not parts:
            return np.empty(0)
        return np.concatenate(parts)


class RecordBuilder:
    """Collects one row per ended request (schema: ``roseinfer.metrics.schema``).

    Thread-safe: a server's worker may add rows while another thread reads the frame.

    Args:
        keep_token_ids: also keep ``prompt_token_ids`` and ``output_token_ids``
            columns (lists), to compare a run with another implementation.
    """

    def __init__(self, *, keep_token_ids: bool = False) -> None:
        self.keep_token_ids = keep_token_ids
        self._rows: dict[str, list] = {name: [] for name in (*COLUMNS, *OPTIONAL_COLUMNS)}
        self._order: list[int] = []  # submission index of each row
        self._lock = threading.Lock()
        if keep_token_ids:
            self._rows["prompt_token_ids"] = []
            self._rows["output_token_ids"] = []

    def __len__(self) -> int:
        return len(self._rows["request_id"])

    def add(self, seq: Sequence, step_log: StepLog) -> None:
        """Append the row of an ended request.

        Raises:
            AssertionError: if its derived token count disagrees with its output
                count (a scheduler bug, never silent).
        """
        times = step_log.token_times_s(seq.stays)
        assert len(times) == seq.num_output_tokens, f"{seq}: {len(times)} token times"
        with self._lock:
            self._add(seq, times)

    def _add(self, seq: Sequence, times: np.ndarray) -> None:
        finished = seq.status is SeqStatus.FINISHED
        req, rows = seq.request, self._rows
        self._order.append(seq.seq_id)
        rows["request_id"].append(req.request_id)
        rows["tenant"].append(req.tenant)
        rows["status"].append("finished" if finished else "rejected")
        rows["reject_reason"].append(seq.reject_reason)
        rows["arrival_s"].append(req.arrival_time_s)
        rows["admitted_s"].append(np.nan if seq.admitted_s is None else seq.admitted_s)
        rows["first_token_s"].append(times[0] if len(times) else np.nan)
        rows["finish_s"].append(seq.finish_s if finished else np.nan)
        rows["num_prompt_tokens"].append(req.num_prompt_tokens)
        rows["num_output_tokens"].append(seq.num_output_tokens)
        rows["num_cached_prompt_tokens"].append(seq.num_cached_prompt_tokens or 0)
        rows["num_preemptions"].append(seq.num_preemptions)
        rows["stop_reason"].append(seq.stop_reason)
        rows["token_times_s"].append(times)
        rows["priority"].append(req.priority)
        rows["deadline_s"].append(np.nan if req.deadline_s is None else req.deadline_s)
        if self.keep_token_ids:
            rows["prompt_token_ids"].append(list(req.prompt_token_ids or ()))
            rows["output_token_ids"].append(list(seq.output_token_ids))

    def extend(self, seqs: SequenceABC[Sequence], step_log: StepLog) -> None:
        """Append the rows of several ended requests."""
        for seq in seqs:
            self.add(seq, step_log)

    def frame(self) -> pd.DataFrame:
        """The records so far as a DataFrame, in submission order."""
        with self._lock:
            order = np.argsort(np.asarray(self._order, dtype=np.int64), kind="stable")
            frame = pd.DataFrame(self._rows)
        return frame.iloc[order].reset_index(drop=True)
