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

from typing import TYPE_CHECKING

from roseinfer.metrics.lazy import lazy_exports

# Names load their module on first use (PEP 562), so that importing one
# submodule (the core imports ``histogram`` and ``schema``) costs no pandas.
_EXPORTS: dict[str, str] = {
    "COLUMNS": ".schema",
    "Column": ".schema",
    "DEFAULT_PERCENTILES": ".summary",
    "LATENCY_METRICS": ".summary",
    "MAX_EXTRAPOLATION": ".schema",
    "MAX_EXTRAPOLATION_AXIS": ".schema",
    "MAX_REJECTED_SHARE": ".summary",
    "STEPS_OUTSIDE_FIT_SHARE": ".schema",
    "LogHistogram": ".histogram",
    "NO_TENANT": ".fairness",
    "RECORD_SUFFIXES": ".io",
    "SCHEMA": ".schema",
    "SLO_METRICS": ".summary",
    "STATUSES": ".schema",
    "VTC_WEIGHTS": ".fairness",
    "check_output_path": ".io",
    "escape_formula": ".io",
    "format_summary": ".summary",
    "fair_share_fairness": ".fairness",
    "jain_index": ".fairness",
    "latency_values_ms": ".summary",
    "parse_goodput": ".summary",
    "per_class": ".classes",
    "per_tenant": ".fairness",
    "plot_cdf": ".plots",
    "plot_p99_vs_rate": ".plots",
    "plot_sim_vs_real": ".plots",
    "plot_tenant_ttft": ".plots",
    "service_fairness": ".classes",
    "slo_met": ".classes",
    "summarize": ".summary",
    "summary_warnings": ".summary",
    "tenant_fair_share": ".fairness",
    "tenant_fairness": ".fairness",
    "tenant_service": ".classes",
    "validate_records": ".schema",
    "write_records": ".io",
    "write_result": ".io",
}


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)


if TYPE_CHECKING:
    from .classes import per_class, service_fairness, slo_met, tenant_service
    from .fairness import (
        NO_TENANT,
        VTC_WEIGHTS,
        fair_share_fairness,
        jain_index,
        per_tenant,
        tenant_fair_share,
        tenant_fairness,
    )
    from .histogram import LogHistogram
    from .io import RECORD_SUFFIXES, check_output_path, escape_formula, write_records, write_result
    from .plots import plot_cdf, plot_p99_vs_rate, plot_sim_vs_real, plot_tenant_ttft
    from .schema import (
        COLUMNS,
        MAX_EXTRAPOLATION,
        MAX_EXTRAPOLATION_AXIS,
        SCHEMA,
        STATUSES,
        STEPS_OUTSIDE_FIT_SHARE,
        Column,
        validate_records,
    )
    from .summary import (
        DEFAULT_PERCENTILES,
        LATENCY_METRICS,
        MAX_REJECTED_SHARE,
        SLO_METRICS,
        format_summary,
        latency_values_ms,
        parse_goodput,
        summarize,
        summary_warnings,
    )

__all__ = [
    "LogHistogram",
    "COLUMNS",
    "RECORD_SUFFIXES",
    "DEFAULT_PERCENTILES",
    "LATENCY_METRICS",
    "MAX_EXTRAPOLATION",
    "MAX_EXTRAPOLATION_AXIS",
    "MAX_REJECTED_SHARE",
    "NO_TENANT",
    "SCHEMA",
    "SLO_METRICS",
    "STEPS_OUTSIDE_FIT_SHARE",
    "VTC_WEIGHTS",
    "STATUSES",
    "Column",
    "check_output_path",
    "escape_formula",
    "fair_share_fairness",
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
    "summary_warnings",
    "tenant_fair_share",
    "tenant_fairness",
    "tenant_service",
    "validate_records",
    "write_records",
    "write_result",
]
