"""Per-class tables, SLO attainment and goodput per class, and per-tenant service.

A *class* is a request's ``priority`` (lower is more urgent, vLLM's
convention) or any other records column (``by=``, e.g. ``"tenant"``). A
request's SLO is its ``deadline_s`` (first token due that many seconds after
arrival): attainment is the fraction of requests with a deadline whose TTFT
met it, rejected ones (e.g. dropped by ``edf --drop-late``) counting as
missed. Goodput per class uses vLLM's ``--goodput`` SLOs (``parse_goodput``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from .fairness import NO_TENANT, VTC_WEIGHTS, fair_share_fairness
from .schema import validate_records
from .summary import _check_slos, _num_good

if TYPE_CHECKING:
    import pandas as pd
else:
    from roseinfer.metrics.lazy import pandas as pd


def _labels(df: pd.DataFrame, by: str) -> pd.Series:
    if by not in df.columns:
        raise ValueError(
            f"records have no {by!r} column; classes need it (e.g. 'priority', 'tenant')"
        )
    col = df[by].astype(object)
    return col.where(col.notna(), NO_TENANT).astype(str)


def slo_met(df: pd.DataFrame) -> np.ndarray:
    """bool per request: it has a ``deadline_s`` and its first token came in time.

    Requests without a deadline give False (see :func:`per_class` for the denominator).
    """
    if "deadline_s" not in df.columns:
        return np.zeros(len(df), dtype=bool)
    ttft_s = df["first_token_s"].to_numpy(dtype=float) - df["arrival_s"].to_numpy(dtype=float)
    deadline = df["deadline_s"].to_numpy(dtype=float)
    finished = df["status"].to_numpy() == "finished"
    return finished & ~np.isnan(deadline) & (ttft_s <= deadline)


def per_class(
    df: pd.DataFrame,
    by: str = "priority",
    *,
    goodput: Mapping[str, float] | None = None,
    duration_s: float | None = None,
) -> pd.DataFrame:
    """One row per class: counts, TTFT and E2EL (ms), SLO attainment, goodput.

    Args:
        by: the records column that names the class (default ``priority``).
        goodput: SLOs in ms (``parse_goodput``); adds ``request_goodput``
            (finished requests meeting all of them, per second of ``duration_s``)
            and ``goodput_fraction`` (of the class's requests).
        duration_s: the run's duration (default: last finish - first arrival).

    Returns:
        Columns ``class, num_requests, completed, rejected, mean_ttft_ms,
        p99_ttft_ms, mean_e2el_ms, p99_e2el_ms, with_deadline, slo_attainment``
        (NaN without deadlines) and, with ``goodput``, the two goodput columns.

    Raises:
        ValueError: on missing columns or an unknown SLO metric.
    """
    validate_records(df)
    slos = _check_slos(goodput) if goodput is not None else None
    if duration_s is None:
        duration_s = float(np.nanmax(df["finish_s"]) - df["arrival_s"].min()) if len(df) else 0.0
    labels, met = _labels(df, by), slo_met(df)
    has_deadline = df["deadline_s"].notna().to_numpy() if "deadline_s" in df.columns else met
    rows = []
    for label in sorted(labels.unique(), key=_sort_key):
        mask = (labels == label).to_numpy()
        rows.append(_class_row(df[mask], label, met[mask], has_deadline[mask], slos, duration_s))
    return pd.DataFrame(rows)


def _sort_key(label: str) -> tuple[int, float | str]:
    try:
        return (0, float(label))
    except ValueError:
        return (1, label)


def _class_row(part, label, met, has_deadline, slos, duration_s) -> dict:  # type: ignore[no-untyped-def]
    done = part[part["status"].to_numpy() == "finished"]
    ttft = (done["first_token_s"] - done["arrival_s"]) * 1000.0
    e2el = (done["finish_s"] - done["arrival_s"]) * 1000.0
    num_deadline = int(has_deadline.sum())
    row = {
        "class": label,
        "num_requests": len(part),
        "completed": len(done),
        "rejected": len(part) - len(done),
        "mean_ttft_ms": float(ttft.mean()) if len(done) else math.nan,
        "p99_ttft_ms": float(ttft.quantile(0.99)) if len(done) else math.nan,
        "mean_e2el_ms": float(e2el.mean()) if len(done) else math.nan,
        "p99_e2el_ms": float(e2el.quantile(0.99)) if len(done) else math.nan,
        "with_deadline": num_deadline,
        "slo_attainment": float(met.sum() / num_deadline) if num_deadline else math.nan,
    }
    if slos is not None:
        good = _num_good(done, slos)
        row["request_goodput"] = good / duration_s if duration_s > 0 else math.nan
        row["goodput_fraction"] = good / len(part) if len(part) else math.nan
    return row


def tenant_service(df: pd.DataFrame, weights: tuple[float, float] = VTC_WEIGHTS) -> pd.Series:
    """Weighted service per tenant: ``w_in * prompt + w_out * output`` tokens of its
    finished requests (VTC's service measure), indexed by tenant label."""
    validate_records(df)
    done = df[df["status"].to_numpy() == "finished"]
    service = weights[0] * done["num_prompt_tokens"] + weights[1] * done["num_output_tokens"]
    return service.groupby(_labels(done, "tenant")).sum().sort_index()


def service_fairness(
    df: pd.DataFrame,
    weights: tuple[float, float] = VTC_WEIGHTS,
    *,
    window_s: float | None = None,
) -> float:
    """Deprecated name of :func:`roseinfer.metrics.fairness.fair_share_fairness`
    (Jain's index over each tenant's service normalized by its max-min fair
    share). Before, it was Jain's index over the tenants' total service,
    which a drained run makes the same for every policy (the demand imbalance).

    ``window_s`` here is the window length in seconds (it was a (start, end)
    filter); a tuple is refused.

    Raises:
        ValueError: on missing columns, negative weights, or a bad window.
    """
    if isinstance(window_s, tuple):
        raise ValueError(
            "service_fairness(window_s=(start, end)) is gone: filter the records by finish_s, "
            "or use fair_share_fairness(df, window_s=SECONDS)"
        )
    return fair_share_fairness(df, weights, window_s=window_s)
