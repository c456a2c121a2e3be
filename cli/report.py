"""A run's summary: printed as a table and written to the files the flags name."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from roseinfer.metrics import (
    LogHistogram,
    fair_share_fairness,
    format_summary,
    parse_goodput,
    per_class,
    per_tenant,
    summarize,
    summary_warnings,
    write_records,
    write_result,
)
from roseinfer.metrics.summary import Records
from roseinfer.records import frame_of
from roseinfer.registry import current_warning_sink

if TYPE_CHECKING:
    import pandas as pd
else:
    from roseinfer.metrics.lazy import pandas as pd


def report(
    args: argparse.Namespace,
    records: Records,
    *,
    duration_s: float,
    title: str,
    extra: dict[str, Any],
    itl: LogHistogram | None = None,
) -> dict[str, Any]:
    """Summarize, print the table (unless ``--no-summary``) and write the files asked for
    (``records``: a DataFrame, or a simulation's columns, read without pandas unless
    the run has several tenants or priority classes or ``--save-records`` is given;
    ``itl``: the run's ITL histogram when its records carry no token times).

    Returns:
        The flat result dict (what ``--save-result`` writes).
    """
    goodput = parse_goodput(args.goodput) if args.goodput else None
    summary = summarize(records, duration_s=duration_s, goodput=goodput, itl=itl)
    groups, tables = _group_results(records, goodput)
    result: dict[str, Any] = {**summary, **extra, **groups}
    if not args.no_summary:
        # KV tier lines and the cost model's extrapolation warning
        shown = {k: v for k, v in extra.items() if k.startswith(("kv_", "cost_model_"))}
        print(format_summary({**summary, **shown}, title))
        for table in tables:
            print(table)
    else:  # no table to carry them: the warnings still reach the user
        warn = current_warning_sink() or _stderr_warning
        for line in summary_warnings(result, records):
            warn(line)
    if args.save_result is not None:
        write_result(result, args.save_result)
    if args.save_records is not None:
        write_records(_frame(records), args.save_records)
    return result


def _frame(records: Records) -> pd.DataFrame:
    return frame_of(records) if isinstance(records, Mapping) else records


def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def _group_results(
    records: Records, goodput: dict[str, float] | None
) -> tuple[dict[str, Any], list[str]]:
    """Per-tenant and per-priority-class figures when the run has several: flat
    keys for the result file, and the tables as text."""
    out: dict[str, Any] = {}
    tables: list[str] = []
    if len({None if _missing(t) else t for t in records["tenant"]}) > 1:
        frame = _frame(records)
        table = per_tenant(frame)
        out["jain_fair_share"] = fair_share_fairness(frame)
        for row in table.itertuples():
            out[f"tenant_{row.tenant}_p99_ttft_ms"] = row.p99_ttft_ms
        tables.append("per tenant:\n" + table.round(1).to_string(index=False))
    has_deadlines = "deadline_s" in records and not all(map(_missing, records["deadline_s"]))
    if "priority" in records and (len(set(records["priority"])) > 1 or has_deadlines):
        table = per_class(_frame(records), goodput=goodput)
        for row in table.to_dict("records"):
            for key in ("p99_ttft_ms", "slo_attainment", "request_goodput"):
                if key in row:
                    out[f"class_{row['class']}_{key}"] = row[key]
        tables.append("per priority class:\n" + table.round(3).to_string(index=False))
    return out, tables


def _stderr_warning(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)
