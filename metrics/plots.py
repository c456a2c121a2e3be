"""Matplotlib plots of summaries and records (object API; never ``plt.show``).

Every function draws on ``ax`` when given, else on a new figure, and returns
the Axes. pyplot is imported on first use, not at import time, so importing
``roseinfer.metrics`` stays cheap for the command-line tools.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from .summary import latency_values_ms

if TYPE_CHECKING:
    from matplotlib.axes import Axes

# Axis names for the latency metrics (values are always ms).
METRIC_LABELS: dict[str, str] = {
    "ttft": "TTFT",
    "tpot": "TPOT",
    "itl": "ITL",
    "e2el": "E2E latency",
    "queue": "queue time",
}

_QUANTILE_LABELS = {"mean": "Mean", "median": "Median", "std": "Std of"}


def _axes(ax: Axes | None) -> Axes:
    if ax is not None:
        return ax
    import matplotlib.pyplot as plt  # lazy: no pyplot work at import time

    _, new_ax = plt.subplots()
    return new_ax


def _metric_label(metric: str) -> str:
    return METRIC_LABELS.get(metric, metric.upper())


def _quantile_label(quantile: str) -> str:
    return _QUANTILE_LABELS.get(quantile, quantile.upper())


def plot_p99_vs_rate(
    sweep_df: pd.DataFrame,
    metric: str = "ttft",
    quantile: str = "p99",
    by: str = "policy",
    ax: Axes | None = None,
) -> Axes:
    """One line per ``by`` value: ``{quantile}_{metric}_ms`` against request rate.

    Args:
        sweep_df: one row per run with ``request_rate`` (req/s), the ``by``
            column and summary keys such as ``p99_ttft_ms``
            (``roseinfer.experiments.sweep.run_grid`` makes one).
        metric: ``ttft``, ``tpot``, ``itl``, ``e2el`` or ``queue``.
        quantile: ``p99``, ``p50``, ``mean``, ``median``... (the key prefix).
        by: column naming the lines (``policy``, ``variant``...).

    Raises:
        ValueError: if a needed column is missing or no row has a request rate.
    """
    column = f"{quantile}_{metric}_ms"
    missing = [c for c in ("request_rate", by, column) if c not in sweep_df.columns]
    if missing:
        raise ValueError(f"sweep_df lacks column(s) {missing}; it has {list(sweep_df.columns)}")
    rows = sweep_df[pd.to_numeric(sweep_df["request_rate"], errors="coerce").notna()]
    if rows.empty:
        raise ValueError("no row of sweep_df has a request_rate to plot against")
    ax = _axes(ax)
    for i, (label, group) in enumerate(rows.groupby(by, sort=False)):
        group = group.sort_values("request_rate")
        ax.plot(
            group["request_rate"].astype(float), group[column], label=str(label), **series_style(i)
        )
    ax.set_xlabel("Request rate (req/s)")
    ax.set_ylabel(f"{_quantile_label(quantile)} {_metric_label(metric)} (ms)")
    ax.legend(title=by, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    ax.grid(True, alpha=0.3)
    return ax


_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "*", "h", "p")


def series_style(index: int) -> dict[str, Any]:
    """Colour, marker and line style of the ``index``-th series: 20 colours of
    matplotlib's ``tab20`` (pairs reordered so neighbours differ) times 12 markers,
    so no two of the first 60 series look alike and none relies on colour alone."""
    import matplotlib

    cmap = matplotlib.colormaps["tab20"]
    colour = cmap(((2 * index) % 20 + (index // 10) % 2) / 20 + 1e-3)
    return {
        "color": colour,
        "marker": _MARKERS[index % len(_MARKERS)],
        "linestyle": ("-", "--", ":")[(index // 20) % 3],
    }


def _plot_one_cdf(ax: Axes, values_ms: np.ndarray, label: str, index: int) -> None:
    values = np.sort(values_ms[~np.isnan(values_ms)])
    fraction = np.arange(1, values.size + 1) / max(values.size, 1)
    style = series_style(index)
    ax.step(values, fraction, where="post", label=label, color=style["color"],
            linestyle=style["linestyle"])  # fmt: skip


def plot_cdf(
    records_by_label: Mapping[str, pd.DataFrame],
    metric: str = "ttft",
    ax: Axes | None = None,
) -> Axes:
    """Empirical CDF of a latency metric (ms) for each labelled records frame.

    Args:
        records_by_label: legend label -> records (``roseinfer.metrics.schema``).
        metric: ``ttft``, ``tpot``, ``e2el``, ``queue`` (one value per finished
            request) or ``itl`` (one value per token gap).

    Raises:
        ValueError: on an unknown metric.
    """
    ax = _axes(ax)
    for i, (label, records) in enumerate(records_by_label.items()):
        _plot_one_cdf(ax, latency_values_ms(records, metric), label, i)
    unit = "token gaps" if metric == "itl" else "requests"
    ax.set_xlabel(f"{_metric_label(metric)} (ms)")
    ax.set_ylabel(f"CDF (fraction of {unit})")
    ax.set_ylim(0.0, 1.02)
    if records_by_label:
        ax.legend(loc="lower right", fontsize="small")
    ax.grid(True, alpha=0.3)
    return ax


def plot_sim_vs_real(
    sim_df: pd.DataFrame,
    real_df: pd.DataFrame,
    metric: str = "ttft",
    ax: Axes | None = None,
) -> Axes:
    """Overlay the simulator's and the executor's CDFs of one latency metric (ms).

    The legend gives each side's p50 and p99 so the gap reads off directly.

    Raises:
        ValueError: on an unknown metric.
    """
    labelled = {
        _with_quantiles(name, df, metric): df
        for name, df in (("simulator", sim_df), ("executor", real_df))
    }
    ax = plot_cdf(labelled, metric=metric, ax=ax)
    ax.set_title(f"Simulator vs executor: {_metric_label(metric)}")
    return ax


def _with_quantiles(name: str, df: pd.DataFrame, metric: str) -> str:
    values = latency_values_ms(df, metric)
    values = values[~np.isnan(values)]
    if values.size == 0:
        return f"{name} (no data)"
    p50, p99 = np.percentile(values, [50, 99])
    return f"{name} (p50 {p50:.1f} ms, p99 {p99:.1f} ms)"


def plot_tenant_ttft(
    runs: Mapping[str, pd.DataFrame], quantile: float = 0.99, ax: Axes | None = None
) -> Axes:
    """Grouped bars: per-tenant TTFT quantile (ms, log scale) for each run.

    Args:
        runs: records by run label (e.g. policy name); tenants are read from
            each run's ``tenant`` column (None as "(none)").
        quantile: in (0, 1]; default 0.99 (p99 TTFT).
    """
    from .fairness import per_tenant

    ax = _axes(ax)
    tables = {label: per_tenant(df).set_index("tenant") for label, df in runs.items()}
    tenants = sorted({t for table in tables.values() for t in table.index})
    width = 0.8 / max(len(tables), 1)
    for i, (label, df) in enumerate(runs.items()):
        done = df[df["status"] == "finished"]
        ttft = (done["first_token_s"] - done["arrival_s"]) * 1000.0
        col = done["tenant"].astype(object)
        values = ttft.groupby(col.where(col.notna(), "(none)").astype(str)).quantile(quantile)
        xs = np.arange(len(tenants)) + i * width
        colour = series_style(i)["color"]
        ax.bar(xs, [values.get(t, np.nan) for t in tenants], width, label=label, color=colour)
    ax.set_xticks(np.arange(len(tenants)) + 0.4 - width / 2, tenants)
    ax.set_yscale("log")
    ax.set_xlabel("tenant")
    ax.set_ylabel(f"p{quantile * 100:g} TTFT (ms)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    return ax
