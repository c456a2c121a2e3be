"""The per-request records schema that both backends produce.

One row per submitted request, finished or rejected. Times are seconds from
the start of the run (simulated clock in ``rose-sim``, wall clock in
``rose-run``); the summary turns them into milliseconds.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    import pandas as pd


class Column(NamedTuple):
    """One column of the records DataFrame."""

    name: str
    dtype: str  # the pandas/numpy kind the column holds
    doc: str


SCHEMA: tuple[Column, ...] = (
    Column("request_id", "str", "unique id of the request"),
    Column("tenant", "str | None", "client the request belongs to (None: no tenant)"),
    Column("status", "str", '"finished" or "rejected"'),
    Column("reject_reason", "str", 'why it was rejected ("" when finished)'),
    Column("arrival_s", "float64", "arrival time (s from run start)"),
    Column(
        "admitted_s",
        "float64",
        "start of the first step that prefilled it (s; NaN if rejected)",
    ),
    Column("first_token_s", "float64", "time of the first output token (s; NaN if rejected)"),
    Column("finish_s", "float64", "time the request finished (s; NaN if rejected)"),
    Column("num_prompt_tokens", "int64", "prompt length (tokens)"),
    Column("num_output_tokens", "int64", "output tokens generated"),
    Column(
        "num_cached_prompt_tokens",
        "int64",
        "prompt tokens served from the prefix cache on first admission",
    ),
    Column("num_preemptions", "int64", "times the request was preempted (recompute)"),
    Column(
        "stop_reason",
        "str",
        '"length" (output length reached), "stop" (EOS or a stop token), "abort", or "" (rejected)',
    ),
    Column(
        "token_times_s",
        "object",
        "1-D float64 array: time (s) of every output token, length num_output_tokens "
        "(empty for rejected)",
    ),
)

OPTIONAL_SCHEMA: tuple[Column, ...] = (
    Column("priority", "int64", "priority class (lower is more urgent, vLLM's convention)"),
    Column(
        "deadline_s",
        "float64",
        "first-token deadline, s after arrival (NaN: none); SLO attainment is TTFT <= it",
    ),
)
"""Columns both backends write but older record files may lack (not validated)."""

COLUMNS: tuple[str, ...] = tuple(c.name for c in SCHEMA)
OPTIONAL_COLUMNS: tuple[str, ...] = tuple(c.name for c in OPTIONAL_SCHEMA)
STATUSES: tuple[str, ...] = ("finished", "rejected")

# Result-file keys a simulator writes for a fitted cost model (read by the summary).
STEPS_OUTSIDE_FIT_SHARE = "cost_model_steps_outside_fit_share"
"""Share of simulated steps a fitted cost model priced outside the step shapes it was
fitted on."""
MAX_EXTRAPOLATION = "cost_model_max_extrapolation"
"""The largest factor by which a priced step exceeded the fitted range (1.0: none)."""
MAX_EXTRAPOLATION_AXIS = "cost_model_max_extrapolation_axis"
"""The axis of that factor (prefill tokens, decode sequences, context tokens)."""


def validate_records(df: pd.DataFrame | Mapping[str, Any]) -> None:
    """Check that ``df`` (a DataFrame, or columns by name as
    ``roseinfer.records.RecordBuilder.drain_columns`` gives them) has every
    schema column and only known statuses.

    Extra columns are allowed. Dtypes are not checked (cheap check only).

    Raises:
        ValueError: naming the missing columns, or the unknown status values.
    """
    names = df.keys() if isinstance(df, Mapping) else df.columns
    missing = [name for name in COLUMNS if name not in names]
    if missing:
        raise ValueError(
            f"records are missing column(s) {missing}; the schema is {list(COLUMNS)} "
            "(roseinfer.metrics.schema)"
        )
    unknown = set(df["status"]) - set(STATUSES)
    if unknown:
        raise ValueError(
            f"records have unknown status value(s) {sorted(map(str, unknown))}; "
            f"expected one of {list(STATUSES)}"
        )
