"""Per-tenant breakdown and Jain's fairness index.

Fairness here is over latency, not throughput: ``tenant_fairness`` is Jain's
index over the tenants' mean *normalized latency* (E2EL divided by output
tokens, ms per token; the "normalized latency" of the vLLM/PagedAttention
paper), a slowdown that does not need a reference latency. Output-token share
is reported per tenant but not folded into the index, because a fair share of
tokens depends on each tenant's demand, which records do not carry.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
from numpy.typing import ArrayLike

from .schema import validate_records

NO_TENANT = "(none)"  # label for requests whose tenant is None


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
        One row per tenant (sorted; ``None`` tenants as ``"(none)"``) with
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
