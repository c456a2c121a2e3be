"""roseinfer.metrics: pure functions from per-request records to summaries and plots.

The bottom layer of roseinfer: it imports nothing else from the package (and
never torch). Both backends emit the same records DataFrame
(``roseinfer.metrics.schema``); ``summarize`` turns it into vLLM-bench keys
(TTFT, TPOT, ITL, E2EL, queue time in ms; throughput; goodput), and
``format_summary`` prints them as ``vllm bench serve`` does.

Example::

    from roseinfer.metrics import summarize, format_summary, parse_goodput
    summary = summarize(records, goodput=parse_goodput("ttft:200 tpot:50"))
    print(format_summary(summary, "fifo @ 8 req/s"))
"""

from .classes import VTC_WEIGHTS, per_class, service_fairness, slo_met, tenant_service
from .fairness import NO_TENANT, jain_index, per_tenant, tenant_fairness
from .histogram import LogHistogram
from .io import RECORD_SUFFIXES, check_output_path, escape_formula, write_records, write_result
from .plots import plot_cdf, plot_p99_vs_rate, plot_sim_vs_real, plot_tenant_ttft
from .schema import COLUMNS, SCHEMA, STATUSES, Column, validate_records
from .summary import (
    DEFAULT_PERCENTILES,
    LATENCY_METRICS,
    SLO_METRICS,
    format_summary,
    latency_values_ms,
    parse_goodput,
    summarize,
)

__all__ = [
    "LogHistogram",
    "COLUMNS",
    "RECORD_SUFFIXES",
    "DEFAULT_PERCENTILES",
    "LATENCY_METRICS",
    "NO_TENANT",
    "SCHEMA",
    "SLO_METRICS",
    "VTC_WEIGHTS",
    "STATUSES",
    "Column",
    "check_output_path",
    "escape_formula",
    "format_summary",
    "jain_index",
    "latency_values_ms",
    "parse_goodput",
    "per_class",
    "per_tenant",
    "plot_cdf",
    "plot_p99_vs_rate",
    "plot_sim_vs_real",
    "plot_tenant_ttft",
    "service_fairness",
    "slo_met",
    "summarize",
    "tenant_fairness",
    "tenant_service",
    "validate_records",
    "write_records",
    "write_result",
]
