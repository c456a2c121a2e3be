"""Per-tenant breakdown and Jain's fairness indices.

Two indices, for two questions:

- :func:`fair_share_fairness` (the result files' fairness figure) measures
  fairness as VTC defines it (Sheng et al., "Fairness in Serving Large Language
  Models", OSDI 2024): a tenant's *service* is its weighted tokens,
  ``w_in * prompt + w_out * output`` (VTC's weights 1 and 2,
  :data:`VTC_WEIGHTS`), and a fair scheduler splits the service it delivers
  max-min fairly among the tenants that ask for it: a tenant that asks for
  less than an equal split gets all it asks, backlogged tenants split the rest
  equally. The run is cut into windows; in each, the capacity is the service
  delivered to all tenants, a tenant's *demand* is the service it received
  plus the service of its requests still waiting (arrived, not admitted) at
  the window's end (a tenant with nothing waiting asked for no more than it
  got), and its *fair share* is its water-filling (max-min) share of the
  capacity under those demands. A tenant's normalized service is
  the service it received over the windows divided by its fair share; the
  index is Jain's over those ratios. It is 1.0 when every tenant got its fair
  share (e.g. under ``vtc``, or when nothing queues) and falls toward
  ``1/num_tenants`` as one tenant takes the others' shares (e.g. under
  ``fifo`` when a heavy tenant floods the queue). Each request's prompt
  service is spread evenly from its admission to its first token, its output
  service from its first token to its finish.
- :func:`tenant_fairness` is Jain's index over the tenants' mean *normalized
  latency* (E2EL per output token, the vLLM/PagedAttention paper's normalized
  latency): equality of slowdown. It is not VTC's fairness: FIFO makes every
  tenant wait alike, so it scores high when a heavy tenant delays a light one.

Jain's index over the tenants' total weighted service (the pre-issue-18
``jain_service_fairness``) is not kept: once a run drains, every tenant has
received exactly what it asked for, so it measures the workload's demand
imbalance and is the same for every policy (0.612 on the two-tenant 10:1
workload, vtc included).
"""

from __future__ import annotations

import hashlib
import math
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import ArrayLike

from .schema import validate_records

if TYPE_CHECKING:
    import pandas as pd
else:
    from roseinfer.metrics.lazy import pandas as pd

NO_TENANT = "(none)"  # label for requests whose tenant is None
MAX_LABEL_CHARS = 48
"""Longest tenant label a table shows: a longer one keeps its first characters and a
short hash of the whole (two long tenants stay apart; a 100k-character tenant no
longer prints 100k-character lines)."""


def short_label(text: str, max_chars: int = MAX_LABEL_CHARS) -> str:
    """``text``, or when longer than ``max_chars`` its start, ``...`` and 8 hex digits
    of its BLAKE2b hash (``max_chars`` characters in all)."""
    if len(text) <= max_chars:
        return text
    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=4).hexdigest()
    return f"{text[: max_chars - 11]}...{digest}"


VTC_WEIGHTS = (1.0, 2.0)
"""(input, output) token weights of service, VTC's defaults (Sheng et al., OSDI 2024)."""

DEFAULT_NUM_WINDOWS = 50
"""Windows :func:`fair_share_fairness` cuts a run into when no ``window_s`` is given."""


def jain_index(values: ArrayLike) -> float:
    """Jain's fairness index ``(sum x)^2 / (n * sum x^2)`` of non-negative values.

    1.0 when all values are equal, ``1/n`` when one value holds everything.
    NaNs are dropped; no values gives NaN; all zeros gives 1.0 (all equal).
    Source: Jain, Chiu, Hawe, DEC-TR-301 (1984).

    Raises:
        ValueError: if a value is negative.
    """
    x = np.asarray(values, dtype=np.float64)
    x = x[~np.isnan(x)]
    if x.size == 0:
        return math.nan
    if (x < 0).any():
        raise ValueError(f"Jain's index needs non-negative values, got min {x.min()}")
    sum_sq = float((x * x).sum())
    return float(x.sum() ** 2 / (x.size * sum_sq)) if sum_sq > 0 else 1.0


def _tenant_frame(df: pd.DataFrame) -> pd.DataFrame:
    """One row per request: tenant label, finished flag, latencies (ms, NaN if rejected)."""
    finished = df["status"].to_numpy() == "finished"
    arrival_s = df["arrival_s"].to_numpy(dtype=np.float64)
    num_out = df["num_output_tokens"].to_numpy(dtype=np.float64)
    ttft_ms = (df["first_token_s"].to_numpy(dtype=np.float64) - arrival_s) * 1000.0
    e2el_ms = (df["finish_s"].to_numpy(dtype=np.float64) - arrival_s) * 1000.0
    tenant = df["tenant"].astype(object)
    return pd.DataFrame(
        {
            "tenant": tenant.where(tenant.notna(), NO_TENANT).astype(str).to_numpy(),
            "finished": finished,
            "ttft_ms": np.where(finished, ttft_ms, np.nan),
            "e2el_ms": np.where(finished, e2el_ms, np.nan),
            "norm_latency_ms": np.where(
                finished & (num_out > 0), e2el_ms / np.maximum(num_out, 1), np.nan
            ),
            "num_output_tokens": np.where(finished, num_out, 0.0),
        }
    )


def _p99(values: pd.Series) -> float:
    return float(values.quantile(0.99))  # linear interpolation, NaNs skipped


def per_tenant(df: pd.DataFrame) -> pd.DataFrame:
    """Per-tenant latency and service breakdown of a run's records.

    Returns:
        One row per tenant (sorted; ``None`` tenants as ``"(none)"``, labels over
        :data:`MAX_LABEL_CHARS` shortened by :func:`short_label`) with
        ``tenant``, ``num_requests``, ``completed``, ``rejected``,
        ``mean_ttft_ms``, ``p99_ttft_ms``, ``mean_e2el_ms``, ``p99_e2el_ms``,
        ``mean_norm_latency_ms`` (E2EL per output token, ms/token),
        ``num_output_tokens`` and ``output_token_share`` (fraction of all
        output tokens of finished requests). Latencies use finished requests.

    Raises:
        ValueError: on missing columns.
    """
    validate_records(df)
    out = (
        _tenant_frame(df)
        .groupby("tenant", sort=True)
        .agg(
            num_requests=("finished", "size"),
            completed=("finished", "sum"),
            mean_ttft_ms=("ttft_ms", "mean"),
            p99_ttft_ms=("ttft_ms", _p99),
            mean_e2el_ms=("e2el_ms", "mean"),
            p99_e2el_ms=("e2el_ms", _p99),
            mean_norm_latency_ms=("norm_latency_ms", "mean"),
            num_output_tokens=("num_output_tokens", "sum"),
        )
        .reset_index()
    )
    out.insert(3, "rejected", out["num_requests"] - out["completed"])
    out["tenant"] = [short_label(t) for t in out["tenant"]]
    out["num_output_tokens"] = out["num_output_tokens"].astype(np.int64)
    total = out["num_output_tokens"].sum()
    out["output_token_share"] = out["num_output_tokens"] / total if total else math.nan
    return out


def tenant_fairness(df: pd.DataFrame) -> float:
    """Jain's index over tenants' mean normalized latency (E2EL per output token).

    1.0 when every tenant sees the same per-token latency; lower means some
    tenants wait longer per token than others (minimum ``1/num_tenants``).
    NaN when no tenant has a finished request with output tokens.
    """
    return jain_index(per_tenant(df)["mean_norm_latency_ms"])


def _water_fill(demand: np.ndarray, capacity: float) -> np.ndarray:
    """Max-min fair shares of ``capacity`` among ``demand`` (each share <= its demand)."""
    share = np.zeros_like(demand)
    left, active = capacity, demand > 0
    while left > 1e-12 and active.any():
        level = left / active.sum()
        small = active & (demand - share <= level)
        if small.any():
            left -= float((demand[small] - share[small]).sum())
            share[small] = demand[small]
            active &= ~small
        else:
            share[active] += level
            left = 0.0
    return share


def _spread(
    start: np.ndarray, end: np.ndarray, amount: np.ndarray, edges: np.ndarray
) -> np.ndarray:
    """``amount`` of each request spread evenly over [start, end] (a point when
    equal), summed per window between ``edges``: shape (requests, windows)."""
    lo, hi = edges[:-1][None, :], edges[1:][None, :]
    s, e = start[:, None], end[:, None]
    length = e - s
    overlap = np.clip(np.minimum(e, hi) - np.maximum(s, lo), 0.0, None)
    point = (s >= lo) & ((s < hi) | (hi == edges[-1]))  # zero-length: the window it falls in
    frac = np.where(length > 0, overlap / np.where(length > 0, length, 1.0), point)
    return frac * amount[:, None]


def tenant_fair_share(
    df: pd.DataFrame,
    weights: tuple[float, float] = VTC_WEIGHTS,
    *,
    window_s: float | None = None,
) -> pd.DataFrame:
    """Per tenant: service received, its max-min fair share, and their ratio
    (see the module docstring for the definitions).

    Args:
        df: a run's records (``roseinfer.metrics.schema``).
        weights: ``(w_in, w_out)``, service per prompt and per output token.
        window_s: window length in seconds (default: the run's span / 50).

    Returns:
        One row per tenant (sorted; ``None`` tenants as ``"(none)"``):
        ``tenant``, ``service`` (weighted tokens received), ``fair_share``
        (weighted tokens) and ``normalized_service`` (service / fair share;
        NaN when the fair share is 0). Empty when nothing finished.

    Raises:
        ValueError: on missing columns, negative weights or a window <= 0.
    """
    validate_records(df)
    w_in, w_out = (float(w) for w in weights)
    if not (w_in >= 0 and w_out >= 0 and math.isfinite(w_in + w_out)):
        raise ValueError(f"service weights must be finite and >= 0, got {weights!r}")
    if window_s is not None and not (math.isfinite(window_s) and window_s > 0):
        raise ValueError(f"window_s must be a finite number > 0, got {window_s!r}")
    done = df[df["status"].to_numpy() == "finished"]
    columns = ["tenant", "service", "fair_share", "normalized_service"]
    if done.empty:
        return pd.DataFrame(columns=columns)
    tenant = done["tenant"].astype(object)
    labels = tenant.where(tenant.notna(), NO_TENANT).astype(str).to_numpy()
    arrival = done["arrival_s"].to_numpy(dtype=np.float64)
    admitted = done["admitted_s"].to_numpy(dtype=np.float64)
    admitted = np.where(np.isnan(admitted), arrival, admitted)
    first = done["first_token_s"].to_numpy(dtype=np.float64)
    finish = done["finish_s"].to_numpy(dtype=np.float64)
    prompt = w_in * done["num_prompt_tokens"].to_numpy(dtype=np.float64)
    output = w_out * done["num_output_tokens"].to_numpy(dtype=np.float64)
    t0, t1 = float(arrival.min()), float(finish.max())
    span = max(t1 - t0, 1e-9)
    num = max(1, math.ceil(span / window_s)) if window_s else DEFAULT_NUM_WINDOWS
    edges = np.linspace(t0, t0 + (num * window_s if window_s else span), num + 1)
    got = _spread(admitted, first, prompt, edges) + _spread(first, finish, output, edges)
    end = edges[1:][None, :]
    queued = ((arrival[:, None] <= end) & (admitted[:, None] > end)) * (prompt + output)[:, None]
    names = sorted(set(labels))
    index = np.array([names.index(x) for x in labels])
    received = np.zeros((len(names), num))
    waiting = np.zeros((len(names), num))
    np.add.at(received, index, got)
    np.add.at(waiting, index, queued)
    demand = received + waiting
    fair = np.zeros_like(received)
    for k in range(num):
        fair[:, k] = _water_fill(demand[:, k], float(received[:, k].sum()))
    service, share = received.sum(axis=1), fair.sum(axis=1)
    ratio = np.divide(service, share, out=np.full_like(service, np.nan), where=share > 0)
    return pd.DataFrame(
        {"tenant": names, "service": service, "fair_share": share, "normalized_service": ratio}
    )


def fair_share_fairness(
    df: pd.DataFrame,
    weights: tuple[float, float] = VTC_WEIGHTS,
    *,
    window_s: float | None = None,
) -> float:
    """Jain's index over the tenants' normalized service (service received /
    max-min fair share, VTC's service measure; see the module docstring).

    1.0 when every tenant received its fair share; toward ``1/num_tenants`` as
    one tenant takes the others'. NaN with no finished request; 1.0 with one
    tenant.

    Args:
        df: a run's records.
        weights: ``(w_in, w_out)`` service per prompt and output token (VTC's 1, 2).
        window_s: window length in seconds (default: the run's span / 50).

    Raises:
        ValueError: on missing columns, negative weights or a window <= 0.
    """
    table = tenant_fair_share(df, weights, window_s=window_s)
    if table.empty:
        return math.nan
    return jain_index(table["normalized_service"].to_numpy(dtype=np.float64))
