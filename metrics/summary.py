"""Serving-benchmark summary of a records DataFrame.

Definitions follow vLLM's ``benchmarks/benchmark_serving.py``
(``calculate_metrics``), with times measured from the request's arrival:

- TTFT (time to first token) = ``first_token_s - arrival_s``.
- TPOT (time per output token, excluding the first) =
  ``(finish_s - first_token_s) / (num_output_tokens - 1)``, only for requests
  with more than one output token.
- ITL (inter-token latency) = every gap between consecutive output tokens of
  one request, pooled over all requests (a gap never spans two requests).
- E2EL (end-to-end latency) = ``finish_s - arrival_s``.
- queue time = ``admitted_s - arrival_s`` (not in vLLM bench; the scheduler's
  own waiting time).

Latencies use finished requests only; rejected ones are counted in
``rejected``. Records hold seconds; summary latencies are milliseconds
(``*_ms``), durations seconds, throughputs per second. Percentiles use numpy's
default linear interpolation, std is the population std (``ddof=0``), as vLLM.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

import numpy as np

from .histogram import LogHistogram
from .schema import (
    MAX_EXTRAPOLATION,
    MAX_EXTRAPOLATION_AXIS,
    STEPS_OUTSIDE_FIT_SHARE,
    validate_records,
)

if TYPE_CHECKING:
    import pandas as pd
else:
    from roseinfer.metrics.lazy import pandas as pd

LATENCY_METRICS: tuple[str, ...] = ("ttft", "tpot", "itl", "e2el", "queue")
SLO_METRICS: tuple[str, ...] = ("ttft", "tpot", "e2el")  # vLLM's --goodput names
DEFAULT_PERCENTILES: tuple[float, ...] = (50, 90, 95, 99)
_MS_PER_S = 1000.0

Summary = dict[str, float | int]


# ------------------------------------------------------------ per-request values
Records: TypeAlias = "pd.DataFrame | Mapping[str, Any]"
"""Records as a DataFrame, or as columns by name (numpy arrays and lists, as
``roseinfer.records.RecordBuilder.drain_columns`` gives them: a simulation
summarised without building a DataFrame, so without importing pandas)."""


def _num_rows(df: Records) -> int:
    return len(df["status"])


def _finished(df: Records) -> Records:
    mask = np.asarray(df["status"]) == "finished"
    if isinstance(df, Mapping):
        return _Where(df, mask)
    return df[mask]


class _Where(Mapping[str, Any]):
    """The rows of ``columns`` where ``mask`` holds, each column cut when read (a
    summary reads 8 of some 20 columns; a million rows of every one would be 0.1 GB)."""

    def __init__(self, columns: Mapping[str, Any], mask: np.ndarray) -> None:
        self._columns, self._mask = columns, mask

    def __getitem__(self, name: str) -> Any:
        return _rows_of(self._columns[name], self._mask)

    def __iter__(self) -> Iterator[str]:
        return iter(self._columns)

    def __len__(self) -> int:
        return len(self._columns)


def _rows_of(values: Any, mask: np.ndarray) -> Any:
    """The rows of one column where ``mask`` holds (a numpy array or a list)."""
    if isinstance(values, np.ndarray):
        return values[mask]
    return [v for v, keep in zip(values, mask.tolist()) if keep]


def _col(df: Records, name: str) -> np.ndarray:
    if isinstance(df, Mapping):
        return np.asarray(df[name], dtype=np.float64)
    return df[name].to_numpy(dtype=np.float64)


def _total(df: Records, name: str) -> int:
    """The sum of an integer column."""
    return int(np.asarray(df[name], dtype=np.int64).sum())


def _ttft_s(done: Records) -> np.ndarray:
    return _col(done, "first_token_s") - _col(done, "arrival_s")


def _e2el_s(done: Records) -> np.ndarray:
    return _col(done, "finish_s") - _col(done, "arrival_s")


def _queue_s(done: Records) -> np.ndarray:
    return _col(done, "admitted_s") - _col(done, "arrival_s")


def _tpot_or_zero_s(done: Records) -> np.ndarray:
    """TPOT per request, 0 where it has at most one output token (vLLM's goodput rule)."""
    num_out = _col(done, "num_output_tokens")
    decode_s = _col(done, "finish_s") - _col(done, "first_token_s")
    return np.where(num_out > 1, decode_s / np.maximum(num_out - 1, 1), 0.0)


def _tpot_s(done: Records) -> np.ndarray:
    """TPOT of the requests with more than one output token."""
    return _tpot_or_zero_s(done)[_col(done, "num_output_tokens") > 1]


def _itl_s(done: Records) -> np.ndarray:
    """All gaps between consecutive tokens of the same request (s), pooled.

    Vectorized: one concatenate and one diff over every token time, then the
    gaps that span the end of one request and the start of the next are dropped.
    """
    arrays = list(done["token_times_s"])
    if not arrays:
        return np.empty(0)
    if any(a is None for a in arrays):
        raise ValueError(
            "these records carry no token times (a run that kept only an ITL histogram, "
            "e.g. rose-sim without --save-records): pass its histogram as itl=..."
        )
    lengths = np.fromiter((len(a) for a in arrays), dtype=np.int64, count=len(arrays))
    flat = np.concatenate(arrays, dtype=np.float64)
    gaps = np.diff(flat)
    starts = np.cumsum(lengths)[:-1]  # flat index where each later request begins
    crossing = starts[(starts > 0) & (starts < flat.size)] - 1
    keep = np.ones(gaps.size, dtype=bool)
    keep[crossing] = False
    return gaps[keep]


_VALUES_S: dict[str, Callable[[Records], np.ndarray]] = {
    "ttft": _ttft_s,
    "tpot": _tpot_s,
    "itl": _itl_s,
    "e2el": _e2el_s,
    "queue": _queue_s,
}


def latency_values_ms(df: Records, metric: str) -> np.ndarray:
    """The values (ms) a latency metric is summarized over, finished requests only.

    Args:
        df: records (``roseinfer.metrics.schema``), a DataFrame or columns.
        metric: one of ``LATENCY_METRICS``; ``"itl"`` gives one value per token
            gap, ``"tpot"`` one per request with more than one output token,
            the others one per finished request.

    Raises:
        ValueError: on an unknown metric (the message lists the known ones) or
            missing columns.
    """
    validate_records(df)
    if metric not in _VALUES_S:
        raise ValueError(f"unknown latency metric {metric!r}; known: {', '.join(LATENCY_METRICS)}")
    return _VALUES_S[metric](_finished(df)) * _MS_PER_S


# -------------------------------------------------------------------- summary
def summarize(
    df: Records,
    *,
    duration_s: float | None = None,
    goodput: Mapping[str, float] | None = None,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
    itl: LogHistogram | None = None,
) -> Summary:
    """Flat vLLM-bench summary of one run's records.

    Args:
        df: records, one row per submitted request (``roseinfer.metrics.schema``):
            a DataFrame, or columns by name (a simulation's, without pandas).
        duration_s: run length (s) the throughputs divide by; default: last
            finish minus first arrival.
        goodput: SLOs in ms, e.g. ``{"ttft": 200.0, "tpot": 50.0}`` (see
            ``parse_goodput``); adds ``request_goodput``, finished requests per
            second that meet every SLO (TPOT counts as 0 with one output token).
        percentiles: which ``p{N}_*_ms`` keys to add (0..100).
        itl: the run's inter-token gaps as a histogram, for records built without
            token times (a long simulation): ITL statistics come from it (mean
            and std exact, percentiles within its relative error) instead of
            ``token_times_s``.

    Returns:
        ``duration`` (s), ``completed``, ``num_requests``, ``rejected``,
        ``total_input_tokens``, ``total_output_tokens`` (finished requests),
        ``request_throughput`` (req/s), ``output_throughput`` and
        ``total_token_throughput`` (tok/s), ``preemptions``,
        ``prefix_cache_hit_rate`` (fraction of finished prompt tokens), optional
        ``request_goodput`` (req/s), then ``mean_/median_/std_/p{N}_`` +
        ``{ttft,tpot,itl,e2el,queue}_ms``. No finished requests gives NaN
        latencies, never an exception.

    Raises:
        ValueError: on missing columns, bad SLOs or percentiles out of [0, 100].
    """
    validate_records(df)
    _check_percentiles(percentiles)
    done = _finished(df)
    duration = _duration_s(df, done) if duration_s is None else float(duration_s)
    out = _counts(df, done, duration)
    if goodput is not None:
        out["request_goodput"] = _per_s(_num_good(done, _check_slos(goodput)), duration)
    for metric in LATENCY_METRICS:
        if metric == "itl" and itl is not None:
            out.update(_histogram_stats_ms(metric, itl, percentiles))
        else:
            out.update(_stats_ms(metric, _VALUES_S[metric](done) * _MS_PER_S, percentiles))
    return out


def _histogram_stats_ms(metric: str, hist: LogHistogram, percentiles: Sequence[float]) -> Summary:
    """The keys of :func:`_stats_ms` from a histogram of values in seconds."""
    median, *quantiles = hist.percentiles([50, *percentiles])
    out: Summary = {
        f"mean_{metric}_ms": hist.mean * _MS_PER_S,
        f"median_{metric}_ms": median * _MS_PER_S,
        f"std_{metric}_ms": hist.std * _MS_PER_S,
    }
    keys = [f"p{_percentile_word(p)}_{metric}_ms" for p in percentiles]
    out.update(zip(keys, (q * _MS_PER_S for q in quantiles)))
    return out


def _duration_s(df: Records, done: Records) -> float:
    if not _num_rows(done):
        return math.nan
    return float(np.nanmax(_col(done, "finish_s")) - np.nanmin(_col(df, "arrival_s")))


def _per_s(count: float, duration_s: float) -> float:
    return count / duration_s if duration_s > 0 and math.isfinite(duration_s) else math.nan


def _counts(df: Records, done: Records, duration_s: float) -> Summary:
    num_in = _total(done, "num_prompt_tokens")
    num_out = _total(done, "num_output_tokens")
    num_cached = _total(done, "num_cached_prompt_tokens")
    completed = _num_rows(done)
    return {
        "duration": duration_s,
        "completed": completed,
        "num_requests": _num_rows(df),
        "rejected": int((np.asarray(df["status"]) == "rejected").sum()),
        "total_input_tokens": num_in,
        "total_output_tokens": num_out,
        "request_throughput": _per_s(completed, duration_s),
        "output_throughput": _per_s(num_out, duration_s),
        "total_token_throughput": _per_s(num_in + num_out, duration_s),
        "preemptions": _total(df, "num_preemptions"),
        "prefix_cache_hit_rate": num_cached / num_in if num_in else math.nan,
    }


def _percentile_word(p: float) -> str:
    """``99`` -> ``"99"``, ``99.9`` -> ``"99.9"`` (vLLM's key spelling)."""
    return str(int(p)) if int(p) == p else str(p)


def _check_percentiles(percentiles: Sequence[float]) -> None:
    bad = [p for p in percentiles if not 0 <= p <= 100]
    if bad:
        raise ValueError(f"percentiles must lie in [0, 100], got {bad}")


def _stats_ms(metric: str, values_ms: np.ndarray, percentiles: Sequence[float]) -> Summary:
    """mean/median/std/p{N} of ``values_ms`` (NaNs dropped; all NaN if none left)."""
    values = values_ms[~np.isnan(values_ms)]
    keys = [f"p{_percentile_word(p)}_{metric}_ms" for p in percentiles]
    if values.size == 0:
        nan_keys = [f"mean_{metric}_ms", f"median_{metric}_ms", f"std_{metric}_ms", *keys]
        return dict.fromkeys(nan_keys, math.nan)
    median, *quantiles = linear_percentiles(values, [50, *percentiles])
    out: Summary = {
        f"mean_{metric}_ms": float(values.mean()),
        f"median_{metric}_ms": float(median),
        f"std_{metric}_ms": float(values.std()),
    }
    out.update(zip(keys, quantiles))
    return out


def linear_percentiles(values: np.ndarray, percentiles: Sequence[float]) -> list[float]:
    """``np.percentile(values, percentiles)`` (its default ``linear`` method,
    Hyndman & Fan's definition 7) to the bit, without importing ``numpy.ma``,
    which ``np.percentile`` does on first use (10-25 ms, a tenth of a short
    simulation's summary).

    Args:
        values: 1-D float array without NaNs, at least one value; partially
            sorted in place (one ``np.partition`` for all percentiles, fast on
            4M ITLs).
        percentiles: each in [0, 100].

    Returns:
        One float per percentile, in the order given.
    """
    last = values.size - 1
    spots = []
    for p in percentiles:
        virtual = last * (p / 100)  # numpy: (n - 1) * (q / 100), both in float64
        lo = min(math.floor(virtual), last)
        spots.append((virtual, lo, min(lo + 1, last)))
    # numpy's own pivots (the ends too), so equal values (0.0 and -0.0) land alike
    values.partition(sorted({0, last, *(i for _, lo, hi in spots for i in (lo, hi))}))
    out = []
    for virtual, lo, hi in spots:
        a, b = float(values[lo]), float(values[hi])
        gamma = virtual - lo if virtual < last else virtual + 1  # numpy: index -1 there
        diff = b - a  # numpy's _lerp, both branches
        out.append(b - diff * (1 - gamma) if gamma >= 0.5 else a + diff * gamma)
    return out


# -------------------------------------------------------------------- goodput
def parse_goodput(specs: str | Iterable[str]) -> dict[str, float]:
    """Parse goodput SLOs from ``"METRIC:MS"`` pairs (vLLM's ``--goodput``).

    Args:
        specs: e.g. ``["ttft:200", "tpot:50"]`` or ``"ttft:200 tpot:50"``;
            names are ``ttft``, ``tpot``, ``e2el``; values are milliseconds.

    Returns:
        ``{"ttft": 200.0, "tpot": 50.0}`` (ms).

    Raises:
        ValueError: on no pairs, a pair without ``:``, a value that is not a
            number, a negative or NaN value, a repeated or unknown name.
    """
    pairs = [specs] if isinstance(specs, str) else list(specs)
    tokens = [token for pair in pairs for token in pair.split()]
    if not tokens:
        raise ValueError("no goodput SLOs given; expected METRIC:MS pairs like 'ttft:200 tpot:50'")
    slos: dict[str, float] = {}
    for token in tokens:
        name, value_ms = _parse_slo(token)
        if name in slos:
            raise ValueError(f"goodput SLO {name!r} given twice")
        slos[name] = value_ms
    return _check_slos(slos)


def _parse_slo(token: str) -> tuple[str, float]:
    name, sep, value = token.partition(":")
    if not sep or not name:
        raise ValueError(
            f"bad goodput SLO {token!r}: expected METRIC:MS, e.g. 'ttft:200' "
            f"(METRIC one of {', '.join(SLO_METRICS)}, MS in milliseconds)"
        )
    try:
        return name.strip().lower(), float(value)
    except ValueError:
        raise ValueError(
            f"bad goodput SLO {token!r}: {value!r} is not a number of milliseconds"
        ) from None


def _check_slos(slos: Mapping[str, float]) -> dict[str, float]:
    """Return ``slos`` as a plain dict after checking names and values (ms)."""
    for name, value_ms in slos.items():
        if name not in SLO_METRICS:
            raise ValueError(f"unknown goodput metric {name!r}; known: {', '.join(SLO_METRICS)}")
        if not value_ms >= 0:  # also rejects NaN
            raise ValueError(f"goodput SLO {name}:{value_ms} must be a non-negative number of ms")
    return {name: float(v) for name, v in slos.items()}


def _num_good(done: Records, slos_ms: Mapping[str, float]) -> int:
    """Finished requests that meet every SLO (vLLM: value <= SLO)."""
    values_s = {"ttft": _ttft_s, "tpot": _tpot_or_zero_s, "e2el": _e2el_s}
    good = np.ones(_num_rows(done), dtype=bool)
    for name, slo_ms in slos_ms.items():
        good &= values_s[name](done) * _MS_PER_S <= slo_ms
    return int(good.sum())


# ------------------------------------------------------------------ warnings
MAX_REJECTED_SHARE = 0.01
"""Above this share of rejected requests a summary warns: its latencies then describe
only the requests that got through, not the workload."""


def summary_warnings(result: Mapping[str, Any], records: Records | None = None) -> list[str]:
    """Warnings a reader of a run's figures must not miss, one line each.

    - more than :data:`MAX_REJECTED_SHARE` of the requests were rejected (the most
      common ``reject_reason`` named when ``records`` are given);
    - a fitted cost model priced steps outside the shapes it was fitted on
      (:data:`STEPS_OUTSIDE_FIT_SHARE`, :data:`MAX_EXTRAPOLATION`).

    Args:
        result: a flat result (``summarize`` output plus run facts).
        records: the run's records, to name why requests were rejected.
    """
    out: list[str] = []
    rejected, total = int(result.get("rejected", 0)), int(result.get("num_requests", 0))
    if total and rejected > MAX_REJECTED_SHARE * total:
        why = _common_reason(records)
        out.append(
            f"{rejected:,} of {total:,} requests ({rejected / total:.1%}) were rejected"
            f"{why}; the latencies describe only the {total - rejected:,} completed"
        )
    share = result.get(STEPS_OUTSIDE_FIT_SHARE)
    if isinstance(share, float | int) and share > 0:
        factor, axis = result.get(MAX_EXTRAPOLATION, math.nan), result.get(MAX_EXTRAPOLATION_AXIS)
        out.append(
            f"{share:.1%} of steps were priced outside the step shapes the cost model was "
            f"fitted on (up to {factor:.3g}x its largest {axis}); their times are "
            "extrapolations: calibrate on steps as large as the run's"
        )
    return out


def _common_reason(records: Records | None) -> str:
    if records is None or "reject_reason" not in records:
        return ""
    rejected = np.asarray(records["status"]) == "rejected"
    reasons = Counter(_rows_of(list(records["reject_reason"]), rejected))
    if not reasons:
        return ""
    reason, count = reasons.most_common(1)[0]  # ties: the first seen, as value_counts
    return f" (most: {str(reason)[:120]}, {count:,} requests)"


# ---------------------------------------------------------------- text table
_WIDTH = 50

# (label, summary key, format spec, scale) for the headline block.
_HEADLINE: tuple[tuple[str, str, str, float], ...] = (
    ("Successful requests:", "completed", "", 1.0),
    ("Rejected requests:", "rejected", "", 1.0),
    ("Benchmark duration (s):", "duration", ".2f", 1.0),
    ("Total input tokens:", "total_input_tokens", "", 1.0),
    ("Total generated tokens:", "total_output_tokens", "", 1.0),
    ("Request throughput (req/s):", "request_throughput", ".2f", 1.0),
    ("Request goodput (req/s):", "request_goodput", ".2f", 1.0),
    ("Output token throughput (tok/s):", "output_throughput", ".2f", 1.0),
    ("Total Token throughput (tok/s):", "total_token_throughput", ".2f", 1.0),
    ("Preemptions:", "preemptions", "", 1.0),
    ("Prefix cache hit rate (%):", "prefix_cache_hit_rate", ".2f", 100.0),
)

# (metric, short name, section header) for the latency blocks.
_SECTIONS: tuple[tuple[str, str, str], ...] = (
    ("ttft", "TTFT", "Time to First Token"),
    ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl", "ITL", "Inter-token Latency"),
    ("e2el", "E2EL", "End-to-end Latency"),
    ("queue", "Queue", "Queue Time (admitted - arrival)"),
)


def format_summary(
    summary: Mapping[str, float | int], title: str = "Serving Benchmark Result"
) -> str:
    """A vLLM-bench-style text table of a ``summarize`` result.

    Lines whose key is absent are left out (e.g. goodput without SLOs); the
    latency blocks show Mean, Median and every ``p{N}`` key present, in ms. With
    rejected requests a line says the latencies cover the completed ones only, and
    :func:`summary_warnings` close the table (``Warning: ...``).
    """
    banner = f" {title} "
    lines = [f"{banner:=^{max(_WIDTH, len(banner) + 4)}}"]  # long titles keep some '='
    for label, key, spec, scale in _HEADLINE:
        if key in summary:
            value = summary[key] * scale if scale != 1.0 else summary[key]
            lines.append(f"{label:<40} {value:<10{spec}}")
    lines += _kv_tier_lines(summary)
    if summary.get("rejected"):
        covered = f"the {summary.get('completed', 0):,} completed requests only"
        lines.append(f"{'Latencies below cover:':<40} {covered}")
    for metric, name, header in _SECTIONS:
        lines += _section_lines(summary, metric, name, header)
    lines += [f"Warning: {w}" for w in summary_warnings(summary)]
    lines.append("=" * _WIDTH)
    return "\n".join(lines)


def _kv_tier_lines(summary: Mapping[str, Any]) -> list[str]:
    """Hit rate per KV tier and bytes moved, when the run had tiers
    (``roseinfer.kv_tiers.kv_tier_summary`` keys)."""
    if "kv_hit_rate_device" not in summary:
        return []
    prefix = "kv_hit_rate_"
    lines = [
        f"{'  hit rate, ' + key[len(prefix) :] + ' (%):':<40} {100 * summary[key]:<10.2f}"
        for key in summary
        if key.startswith(prefix)
    ]
    for label, key in (("  KV offloaded (GiB):", "kv_offloaded_bytes"),
                       ("  KV loaded (GiB):", "kv_loaded_bytes")):  # fmt: skip
        if key in summary:
            lines.append(f"{label:<40} {summary[key] / 2**30:<10.2f}")
    if "kv_load_time_s" in summary:
        label = "  KV load time at tier bandwidth (s):"  # NOTE: bytes / bandwidth, not measured
        lines.append(f"{label:<40} {summary['kv_load_time_s']:<10.3f}")
    return lines


def _section_lines(
    summary: Mapping[str, float | int], metric: str, name: str, header: str
) -> list[str]:
    suffix = f"_{metric}_ms"
    rows = [(f"Mean {name} (ms):", f"mean{suffix}"), (f"Median {name} (ms):", f"median{suffix}")]
    rows += [
        (f"P{key[1 : -len(suffix)]} {name} (ms):", key) for key in summary if _is_pkey(key, suffix)
    ]
    rows = [(label, key) for label, key in rows if key in summary]
    if not rows:
        return []
    return [f"{header:-^{_WIDTH}}"] + [f"{label:<40} {summary[key]:<10.2f}" for label, key in rows]


def _is_pkey(key: str, suffix: str) -> bool:
    """``p99_ttft_ms`` is a percentile key for suffix ``_ttft_ms``."""
    if not (key.startswith("p") and key.endswith(suffix)):
        return False
    try:
        float(key[1 : -len(suffix)])
    except ValueError:
        return False
    return True
