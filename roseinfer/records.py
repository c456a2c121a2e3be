"""Per-request records from a finished scheduler run (both backends).

Token times are derived from the step log rather than stored per token: a
request's tokens come from its prefill step and every decode step while it was
running, so one array of step end times and each stay's first and last step
give all of them (the schema is ``roseinfer.metrics.schema``).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from roseinfer.metrics.schema import COLUMNS
from roseinfer.scheduler import Scheduler
from roseinfer.sequence import SeqStatus, Sequence


def _decode_index(decode_steps: np.ndarray) -> np.ndarray:
    """Step indices of decode steps, from their cumulative count."""
    if decode_steps.size == 0:
        return np.empty(0, dtype=np.int64)
    flags = np.diff(decode_steps, prepend=0)
    return np.flatnonzero(flags)


def records_frame(scheduler: Scheduler) -> pd.DataFrame:
    """One row per submitted request (schema: ``roseinfer.metrics.schema``).

    Raises:
        AssertionError: if a request's derived token count disagrees with its
            output count (a scheduler bug, never silent).
    """
    step_end_s = np.asarray(scheduler.step_end_s, dtype=np.float64)
    decode_steps = np.cumsum(np.asarray(scheduler.step_is_decode, dtype=np.int64))
    decode_idx = _decode_index(decode_steps)
    rows: dict[str, list] = {name: [] for name in COLUMNS}
    for seq in scheduler.seqs:
        times = _times(seq, step_end_s, decode_steps, decode_idx)
        assert len(times) == seq.num_output_tokens, f"{seq}: {len(times)} token times"
        finished = seq.status is SeqStatus.FINISHED
        req = seq.request
        rows["request_id"].append(req.request_id)
        rows["tenant"].append(req.tenant)
        rows["status"].append("finished" if finished else "rejected")
        rows["reject_reason"].append(seq.reject_reason)
        rows["arrival_s"].append(req.arrival_time_s)
        rows["admitted_s"].append(seq.admitted_s)
        rows["first_token_s"].append(times[0] if len(times) else np.nan)
        rows["finish_s"].append(seq.finish_s if finished else np.nan)
        rows["num_prompt_tokens"].append(req.num_prompt_tokens)
        rows["num_output_tokens"].append(seq.num_output_tokens)
        rows["num_cached_prompt_tokens"].append(max(seq.num_cached_prompt_tokens, 0))
        rows["num_preemptions"].append(seq.num_preemptions)
        rows["token_times_s"].append(times)
    return pd.DataFrame(rows)


def _times(
    seq: Sequence, step_end_s: np.ndarray, decode_steps: np.ndarray, decode_idx: np.ndarray
) -> np.ndarray:
    """Times (s) of every output token of ``seq``: its prefill step and the
    decode steps after it, for each stay in the running set."""
    parts: list[np.ndarray] = []
    for first, last in seq.segments:
        if last < first:
            continue
        parts.append(step_end_s[first : first + 1])
        parts.append(step_end_s[decode_idx[decode_steps[first] : decode_steps[last]]])
    if not parts:
        return np.empty(0)
    return parts[0] if len(parts) == 1 else np.concatenate(parts)
