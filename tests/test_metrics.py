"""roseinfer.metrics: hand-computed summaries, goodput parsing, fairness, plots."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import matplotlib
import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from roseinfer.metrics import (
    COLUMNS,
    fair_share_fairness,
    format_summary,
    jain_index,
    latency_values_ms,
    parse_goodput,
    per_tenant,
    plot_cdf,
    plot_p99_vs_rate,
    plot_sim_vs_real,
    summarize,
    tenant_fair_share,
    tenant_fairness,
    validate_records,
)
from roseinfer.metrics.fairness import _water_fill

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

METRICS_DIR = Path(__file__).resolve().parents[1] / "metrics"


def finished(rid, arrival, admitted, tokens, *, prompt=10, cached=0, preempt=0, tenant=None):
    """A finished record whose finish time is its last token time."""
    times = np.asarray(tokens, dtype=np.float64)
    return {
        "request_id": rid,
        "tenant": tenant,
        "status": "finished",
        "reject_reason": "",
        "arrival_s": arrival,
        "admitted_s": admitted,
        "first_token_s": times[0],
        "finish_s": times[-1],
        "num_prompt_tokens": prompt,
        "num_output_tokens": len(times),
        "num_cached_prompt_tokens": cached,
        "num_preemptions": preempt,
        "stop_reason": "length",
        "token_times_s": times,
    }


def rejected(rid, arrival, *, prompt=5000, tenant=None):
    return {
        "request_id": rid,
        "tenant": tenant,
        "status": "rejected",
        "reject_reason": "prompt longer than max_model_len",
        "arrival_s": arrival,
        "admitted_s": math.nan,
        "first_token_s": math.nan,
        "finish_s": math.nan,
        "num_prompt_tokens": prompt,
        "num_output_tokens": 0,
        "num_cached_prompt_tokens": 0,
        "num_preemptions": 0,
        "stop_reason": "",
        "token_times_s": np.empty(0),
    }


def frame(rows) -> pd.DataFrame:
    return pd.DataFrame(rows, columns=list(COLUMNS))


@pytest.fixture
def records() -> pd.DataFrame:
    """Three finished requests and one rejected one, times in seconds.

    a: TTFT 1000, TPOT 750, gaps 500/1000, E2EL 2500, queue 500 (ms)
    b: TTFT 1000, TPOT 250, gap 250,       E2EL 1250, queue 0
    c: TTFT 2000, one token (no TPOT/gap), E2EL 2000, queue 0
    """
    return frame(
        [
            finished("a", 0.0, 0.5, [1.0, 1.5, 2.5], prompt=10, cached=4, preempt=1, tenant="x"),
            finished("b", 1.0, 1.0, [2.0, 2.25], prompt=20, tenant="y"),
            finished("c", 2.0, 2.0, [4.0], prompt=6, cached=6, tenant="x"),
            rejected("d", 2.5, tenant="y"),
        ]
    )


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


# ------------------------------------------------------------------ summary
def test_latencies_hand_computed(records):
    s = summarize(records)
    approx = pytest.approx
    assert s["mean_ttft_ms"] == approx(4000 / 3)
    assert s["median_ttft_ms"] == approx(1000.0)
    assert s["std_ttft_ms"] == approx(math.sqrt(2e6 / 9))  # population std
    assert s["p99_ttft_ms"] == approx(1980.0)  # linear: 1000 + 0.98 * 1000
    assert s["mean_tpot_ms"] == approx(500.0)
    assert s["p90_tpot_ms"] == approx(700.0)  # 250 + 0.9 * 500
    assert s["mean_itl_ms"] == approx(1750 / 3)
    assert s["median_itl_ms"] == approx(500.0)
    assert s["mean_e2el_ms"] == approx(5750 / 3)
    assert s["p50_e2el_ms"] == approx(2000.0)
    assert s["mean_queue_ms"] == approx(500 / 3)
    assert s["median_queue_ms"] == approx(0.0)


def test_counts_and_throughput(records):
    s = summarize(records)
    assert (s["num_requests"], s["completed"], s["rejected"]) == (4, 3, 1)
    assert s["duration"] == pytest.approx(4.0)  # last finish 4.0 - first arrival 0.0
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (36, 6)
    assert s["request_throughput"] == pytest.approx(0.75)
    assert s["output_throughput"] == pytest.approx(1.5)
    assert s["total_token_throughput"] == pytest.approx(42 / 4)
    assert s["preemptions"] == 1
    assert s["prefix_cache_hit_rate"] == pytest.approx(10 / 36)
    assert "request_goodput" not in s


def test_given_duration_sets_throughput(records):
    s = summarize(records, duration_s=8.0)
    assert s["duration"] == 8.0
    assert s["request_throughput"] == pytest.approx(3 / 8)


def test_itl_does_not_cross_requests(records):
    # The flat token times run 1, 1.5, 2.5 | 2, 2.25 | 4: gaps -0.5 and 1.75 span requests.
    np.testing.assert_allclose(latency_values_ms(records, "itl"), [500.0, 1000.0, 250.0])


def test_single_token_request_has_no_tpot(records):
    np.testing.assert_allclose(latency_values_ms(records, "tpot"), [750.0, 250.0])
    only_c = records[records["request_id"] == "c"]
    s = summarize(only_c)
    assert math.isnan(s["mean_tpot_ms"]) and math.isnan(s["p99_itl_ms"])
    assert s["mean_ttft_ms"] == pytest.approx(2000.0)


def test_rejected_rows_are_not_completed(records):
    s = summarize(records[records["status"] == "rejected"])
    assert (s["completed"], s["rejected"], s["num_requests"]) == (0, 1, 1)
    assert math.isnan(s["mean_ttft_ms"]) and math.isnan(s["duration"])
    assert math.isnan(s["request_throughput"]) and math.isnan(s["prefix_cache_hit_rate"])


def test_empty_records_give_nan_not_errors():
    s = summarize(frame([]), goodput={"ttft": 100.0})
    assert s["completed"] == 0 and s["num_requests"] == 0
    assert all(math.isnan(s[k]) for k in ("mean_itl_ms", "p99_e2el_ms", "request_goodput"))
    assert "nan" in format_summary(s, "empty")


def test_percentile_keys_follow_vllm_spelling(records):
    s = summarize(records, percentiles=(99.9, 25))
    assert "p99.9_ttft_ms" in s and "p25_queue_ms" in s and "p99_ttft_ms" not in s
    with pytest.raises(ValueError, match=r"\[0, 100\]"):
        summarize(records, percentiles=(101,))


@pytest.mark.parametrize(
    ("slos", "num_good"),
    [
        ({"ttft": 1000.0, "tpot": 500.0}, 1),  # a: TPOT 750 > 500; c: TTFT 2000 > 1000
        ({"tpot": 500.0}, 2),  # c has one token: TPOT counts as 0 (vLLM)
        ({"e2el": 2000.0}, 2),  # SLO is inclusive
        ({"ttft": 999.0}, 0),
    ],
)
def test_goodput_counts_requests_meeting_every_slo(records, slos, num_good):
    assert summarize(records, goodput=slos)["request_goodput"] == pytest.approx(num_good / 4.0)


def test_format_summary_prints_vllm_style_table(records):
    text = format_summary(summarize(records, goodput={"ttft": 1000.0}), "fifo")
    lines = text.splitlines()
    assert lines[0] == f"{' fifo ':=^50}" and lines[-1] == "=" * 50
    for needle in (
        "Successful requests:                     3",
        "Rejected requests:                       1",
        "Benchmark duration (s):                  4.00",
        "Request goodput (req/s):                 0.50",
        "Preemptions:                             1",
        "Prefix cache hit rate (%):               27.78",
        "---------------Time to First Token----------------",
        "P99 TTFT (ms):                           1980.00",
        "Mean Queue (ms):",
    ):
        assert needle in text, needle
    assert "goodput" not in format_summary(summarize(records), "x")


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.lists(st.floats(0.0, 5.0, allow_nan=False), min_size=1, max_size=12),
        min_size=1,
        max_size=8,
    )
)
def test_mean_tpot_equals_mean_of_per_request_mean_gaps(gap_lists):
    rows = []
    for i, gaps in enumerate(gap_lists):
        times = 0.5 * i + np.cumsum(gaps)  # requests overlap in time on purpose
        rows.append(finished(f"r{i}", 0.5 * i, 0.5 * i, times))
    df = frame(rows)
    per_request = [np.diff(r["token_times_s"]) for r in rows if len(r["token_times_s"]) > 1]
    s = summarize(df)
    itl = latency_values_ms(df, "itl")
    assert itl.size == sum(len(d) for d in per_request)
    if not per_request:
        assert math.isnan(s["mean_tpot_ms"])
        return
    expected_tpot = np.mean([d.mean() for d in per_request]) * 1000
    assert s["mean_tpot_ms"] == pytest.approx(expected_tpot, rel=1e-9, abs=1e-9)
    np.testing.assert_allclose(itl, np.concatenate(per_request) * 1000)


def test_summary_is_fast_on_four_million_tokens():
    rng = np.random.default_rng(0)
    num_requests, num_tokens = 20_000, 200
    flat = np.cumsum(rng.uniform(0.01, 0.03, num_requests * num_tokens))
    times = np.split(flat, num_requests)
    df = pd.DataFrame(
        {
            "request_id": np.arange(num_requests).astype(str),
            "tenant": None,
            "status": "finished",
            "reject_reason": "",
            "arrival_s": [t[0] - 0.1 for t in times],
            "admitted_s": [t[0] - 0.05 for t in times],
            "first_token_s": [t[0] for t in times],
            "finish_s": [t[-1] for t in times],
            "num_prompt_tokens": 100,
            "num_output_tokens": num_tokens,
            "num_cached_prompt_tokens": 0,
            "num_preemptions": 0,
            "stop_reason": "length",
            "token_times_s": times,
        }
    )
    s = summarize(df, goodput={"ttft": 200.0})
    assert s["completed"] == num_requests
    assert s["mean_itl_ms"] == pytest.approx(s["mean_tpot_ms"])


# ---------------------------------------------------------------- validation
def test_validate_records_names_missing_column(records):
    with pytest.raises(ValueError, match="token_times_s"):
        validate_records(records.drop(columns=["token_times_s"]))
    with pytest.raises(ValueError, match="first_token_s"):
        summarize(records.drop(columns=["first_token_s"]))


def test_validate_records_rejects_unknown_status(records):
    bad = records.assign(status=["finished", "finished", "aborted", "rejected"])
    with pytest.raises(ValueError, match="aborted"):
        validate_records(bad)


def test_unknown_latency_metric_lists_known(records):
    with pytest.raises(ValueError, match="ttft, tpot, itl, e2el, queue"):
        latency_values_ms(records, "latency")


# ------------------------------------------------------------------ goodput
@pytest.mark.parametrize(
    "specs",
    [["ttft:200", "tpot:50"], "ttft:200 tpot:50", ["ttft:200 tpot:50"], ["TTFT:200", "tpot:50.0"]],
)
def test_parse_goodput(specs):
    assert parse_goodput(specs) == {"ttft": 200.0, "tpot": 50.0}


@pytest.mark.parametrize(
    ("specs", "message"),
    [
        (["ttft"], "expected METRIC:MS"),
        ([":200"], "expected METRIC:MS"),
        (["ttft:fast"], "not a number"),
        (["itl:20"], "known: ttft, tpot, e2el"),
        (["ttft:-1"], "non-negative"),
        (["ttft:nan"], "non-negative"),
        (["ttft:1", "ttft:2"], "given twice"),
        ([], "no goodput SLOs"),
        ("  ", "no goodput SLOs"),
    ],
)
def test_parse_goodput_errors(specs, message):
    with pytest.raises(ValueError, match=message):
        parse_goodput(specs)


def test_summarize_checks_slo_names(records):
    with pytest.raises(ValueError, match="known: ttft, tpot, e2el"):
        summarize(records, goodput={"latency": 100.0})


# ----------------------------------------------------------------- fairness
def test_per_tenant(records):
    t = per_tenant(records).set_index("tenant")
    assert list(t.index) == ["x", "y"]
    assert t.loc["x", "num_requests"] == 2 and t.loc["y", "rejected"] == 1
    assert t.loc["x", "mean_ttft_ms"] == pytest.approx(1500.0)
    assert t.loc["y", "p99_e2el_ms"] == pytest.approx(1250.0)
    # normalized latency: a 2500/3, c 2000/1 -> mean; b 1250/2
    assert t.loc["x", "mean_norm_latency_ms"] == pytest.approx((2500 / 3 + 2000) / 2)
    assert t.loc["y", "mean_norm_latency_ms"] == pytest.approx(625.0)
    assert t.loc["x", "output_token_share"] == pytest.approx(4 / 6)


def test_per_tenant_labels_missing_tenant(records):
    t = per_tenant(records.assign(tenant=None))
    assert list(t["tenant"]) == ["(none)"] and t["num_requests"].iloc[0] == 4


def test_jain_index():
    assert jain_index([3.0, 3.0, 3.0]) == pytest.approx(1.0)
    assert jain_index([1.0, 0.0, 0.0, 0.0]) == pytest.approx(0.25)
    assert jain_index([1.0, 3.0]) == pytest.approx(16 / 20)
    assert math.isnan(jain_index([]))
    with pytest.raises(ValueError, match="non-negative"):
        jain_index([1.0, -1.0])


def test_tenant_fairness(records):
    x, y = (2500 / 3 + 2000) / 2, 625.0
    assert tenant_fairness(records) == pytest.approx((x + y) ** 2 / (2 * (x * x + y * y)))


def test_water_fill_is_max_min_fair():
    fill = lambda d, c: list(_water_fill(np.array(d, dtype=float), c))  # noqa: E731
    assert fill([10.0, 100.0], 40.0) == pytest.approx([10.0, 30.0])  # the small one gets all
    assert fill([30.0, 110.0], 40.0) == pytest.approx([20.0, 20.0])  # both backlogged: equal
    assert fill([5.0, 5.0, 50.0], 30.0) == pytest.approx([5.0, 5.0, 20.0])
    assert fill([0.0, 8.0], 4.0) == pytest.approx([0.0, 4.0])


def test_fair_share_fairness_is_one_when_nothing_waits(records):
    # nobody has a request waiting at a window's end: each got all it asked for
    table = tenant_fair_share(records, window_s=10.0).set_index("tenant")
    assert table.loc["x", "service"] == pytest.approx((10 + 6) + 2 * (3 + 1))
    assert table.loc["y", "service"] == pytest.approx(20 + 2 * 2)
    assert list(table["normalized_service"]) == pytest.approx([1.0, 1.0])
    assert fair_share_fairness(records) == pytest.approx(1.0)
    assert fair_share_fairness(records.assign(tenant=None)) == pytest.approx(1.0)


def test_fair_share_fairness_drops_when_one_tenant_takes_the_others_share():
    # one 10 s window: x is served 2 requests back to back while y's request waits all
    # along (admitted at 10.5 s); capacity = x's 2 * 30 = 60, demands x 60, y 30 -> shares
    # 30/30, normalized x 2.0, y 0.0 (then y is served alone: its share equals service)
    rows = [
        finished("x1", 0.0, 0.0, [5.0], prompt=28, tenant="x"),
        finished("x2", 0.0, 5.0, [9.9], prompt=28, tenant="x"),
        finished("y1", 0.0, 10.5, [19.9], prompt=28, tenant="y"),
    ]
    table = tenant_fair_share(frame(rows), window_s=10.0).set_index("tenant")
    assert table.loc["x", "normalized_service"] == pytest.approx(60 / 30)
    assert table.loc["y", "normalized_service"] == pytest.approx(30 / 60)
    assert fair_share_fairness(frame(rows), window_s=10.0) == pytest.approx(jain_index([2.0, 0.5]))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"window_s": 0.0}, "window_s must be"), ({"weights": (-1.0, 2.0)}, "weights must be")],
)
def test_fair_share_fairness_refuses_bad_arguments(records, kwargs, message):
    with pytest.raises(ValueError, match=message):
        fair_share_fairness(records, **kwargs)


# -------------------------------------------------------------------- plots
def sweep_frame() -> pd.DataFrame:
    return pd.DataFrame(
        {
            "policy": ["fifo", "fifo", "pack", "pack"],
            "request_rate": [4.0, 2.0, 2.0, 4.0],
            "p99_ttft_ms": [300.0, 100.0, 90.0, 200.0],
        }
    )


def test_plot_p99_vs_rate():
    ax = plot_p99_vs_rate(sweep_frame())
    assert ax.get_xlabel() == "Request rate (req/s)"
    assert ax.get_ylabel() == "P99 TTFT (ms)"
    assert [line.get_label() for line in ax.get_lines()] == ["fifo", "pack"]
    np.testing.assert_array_equal(ax.get_lines()[0].get_xdata(), [2.0, 4.0])  # sorted by rate


def test_plot_p99_vs_rate_missing_column():
    with pytest.raises(ValueError, match="p99_tpot_ms"):
        plot_p99_vs_rate(sweep_frame(), metric="tpot")


def test_plot_cdf_and_sim_vs_real(records):
    _, ax = plt.subplots()
    assert plot_cdf({"run": records}, metric="itl", ax=ax) is ax
    assert ax.get_xlabel() == "ITL (ms)" and "CDF" in ax.get_ylabel()
    ax = plot_sim_vs_real(records, records.iloc[:2], "e2el")
    assert ax.get_xlabel() == "E2E latency (ms)" and "requests" in ax.get_ylabel()
    assert len(ax.get_lines()) == 2 and "simulator" in ax.get_title().lower()


# ------------------------------------------------------------------ layering
def test_metrics_imports_nothing_else_from_roseinfer():
    """metrics is the bottom layer: no core, no backend, no torch."""
    for path in METRICS_DIR.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            for name in names:
                root = name.split(".")[0]
                assert root != "torch", f"{path.name} imports {name}"
                assert root != "roseinfer" or name.startswith("roseinfer.metrics"), (
                    f"{path.name} imports {name}"
                )


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(min_value=1e-6, max_value=100.0, allow_nan=False), min_size=1, max_size=300),
    st.integers(min_value=1, max_value=4),
)
def test_log_histogram_matches_numpy_within_its_resolution(values, num_batches) -> None:
    from roseinfer.metrics import LogHistogram

    data = np.asarray(values)
    hist = LogHistogram(relative_error=1e-4)
    for part in np.array_split(data, num_batches):
        hist.add(part)
    qs = [0, 1, 50, 90, 99, 100]
    got = hist.percentiles(qs)
    for q, value in zip(qs, got):
        # each order statistic is off by at most the bucket's half-width (1e-4 relative)
        assert value == pytest.approx(float(np.percentile(data, q)), rel=3e-4)
    assert hist.count == data.size
    assert hist.mean == pytest.approx(float(data.mean()), rel=1e-9)
    assert hist.std == pytest.approx(float(data.std()), rel=1e-6, abs=1e-12)


def _plain_buckets(hist, values: np.ndarray) -> np.ndarray:
    """The bucket counts of ``values`` by the plain expression the histogram documents."""
    from roseinfer.metrics import histogram

    values = values[~np.isnan(values)]
    clipped = np.clip(values, histogram._MIN_S, histogram._MAX_S)
    index = (np.log(clipped / histogram._MIN_S) / hist._log_base).astype(np.int64)
    return np.bincount(index, minlength=hist._counts.size)


@pytest.mark.parametrize("with_nan", [False, True])
def test_log_histogram_buckets_in_kept_buffers_and_passes_as_the_plain_expression(with_nan):
    """add() works in place, in buffers it keeps, and in passes over a large
    array: the buckets are those of the plain expression, NaNs are skipped, and
    a pickled histogram carries no buffers."""
    import pickle

    from roseinfer.metrics import LogHistogram, histogram

    rng = np.random.default_rng(7)
    parts = [rng.lognormal(-4.6, 2.0, n) for n in (10, histogram._PASS_VALUES * 2 + 5, 300)]
    parts[1][:3] = [0.0, 1e-12, 1e9]  # the clipped ends
    if with_nan:
        parts[0][::3] = np.nan
        parts[1][-7:] = np.nan
    hist = LogHistogram()
    for part in parts:
        hist.add(part)
    data = np.concatenate(parts)
    assert np.array_equal(hist._counts, _plain_buckets(hist, data))
    finite = data[~np.isnan(data)]
    assert hist.count == finite.size
    assert hist.mean == pytest.approx(float(finite.mean()), rel=1e-12)
    assert hist.std == pytest.approx(float(finite.std()), rel=1e-9)
    clone = pickle.loads(pickle.dumps(hist))
    assert clone._scratch.size == 0 and len(pickle.dumps(hist)) < 2 * hist._counts.nbytes
    assert clone.percentiles([50, 99]) == hist.percentiles([50, 99])
    clone.add(parts[2])  # a restored histogram grows its buffers again
    assert clone.count == hist.count + parts[2].size


def test_the_core_imports_without_pandas():
    """``import roseinfer.scheduler`` costs no pandas (0.4 s): the records frame
    and the metrics package's names load it on first use."""
    import subprocess
    import sys

    code = "import roseinfer.scheduler, roseinfer.driver, sys; print('pandas' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_log_histograms_merge_as_one():
    from roseinfer.metrics import LogHistogram

    rng = np.random.default_rng(3)
    a, b = rng.exponential(0.02, 5000), rng.exponential(0.2, 700)
    one, left, right = LogHistogram(), LogHistogram(), LogHistogram()
    one.add(np.concatenate([a, b]))
    left.add(a)
    right.add(b)
    left.merge(right)
    assert left.count == one.count
    assert left.mean == pytest.approx(one.mean) and left.std == pytest.approx(one.std)
    assert left.percentiles([50, 99]) == one.percentiles([50, 99])


def test_series_styles_differ_for_every_built_in_policy():
    from roseinfer.metrics.plots import series_style

    styles = [series_style(i) for i in range(24)]
    looks = {(s["color"], s["marker"], s["linestyle"]) for s in styles}
    assert len(looks) == 24
    assert len({s["color"] for s in styles[:20]}) == 20  # no two of the first 20 share a colour


def test_mass_rejection_is_a_warning_and_latencies_say_what_they_cover(records) -> None:
    """Before: 1,997 of 2,000 rejected exited 0 with percentiles of 3 requests and no word."""
    from roseinfer.metrics import MAX_REJECTED_SHARE, summary_warnings

    s = summarize(records)  # 1 of 4 rejected
    text = format_summary(s, "x")
    assert "Latencies below cover:                   the 3 completed requests only" in text
    assert "Warning: 1 of 4 requests (25.0%) were rejected;" in text
    assert summary_warnings(s, records)[0].startswith(
        "1 of 4 requests (25.0%) were rejected (most: "
    )
    few = {**s, "num_requests": 1000, "rejected": int(1000 * MAX_REJECTED_SHARE)}
    assert summary_warnings(few) == []  # at the threshold: no warning
    none = {**s, "rejected": 0}
    assert "Latencies below cover" not in format_summary(none, "x")


@pytest.mark.parametrize("keep_token_times", [True, False])
def test_a_simulations_columns_summarise_as_its_dataframe(keep_token_times: bool) -> None:
    """rose-sim summarises a simulation's columns without pandas: the summary, the
    per-tenant and per-class tables and the warnings equal the DataFrame's, bit for bit."""
    from conftest import ToyCostModel

    from roseinfer.cli.report import _group_results
    from roseinfer.config import SchedulerConfig
    from roseinfer.metrics import summary_warnings
    from roseinfer.request import Request
    from roseinfer.simulator import simulate

    rng = np.random.default_rng(3)
    reqs = [
        Request(
            f"r{i}",
            float(i) * 0.01,
            int(rng.integers(5, 300)),
            int(rng.integers(1, 40)),
            tenant=("a", "b", None)[i % 3],
            priority=i % 2,
            deadline_s=None if i % 4 else 2.0,
        )  # fmt: skip
        for i in range(120)
    ] + [Request("long", 0.5, 5000, 4)]  # rejected: longer than max_model_len
    config = SchedulerConfig(num_kv_blocks=200, block_size=16, max_num_seqs=16, max_model_len=512)
    result = simulate(reqs, config, ToyCostModel(), keep_token_times=keep_token_times)
    goodput = {"ttft": 500.0, "tpot": 30.0}
    args = dict(duration_s=result.duration_s, goodput=goodput, itl=result.itl)
    from_columns = summarize(result.columns, **args)
    from_frame = summarize(result.records, **args)

    def same(a: dict, b: dict) -> bool:
        return a.keys() == b.keys() and all(
            x == b[k] or (x != x and b[k] != b[k]) for k, x in a.items()
        )

    assert same(from_columns, from_frame) and from_columns["rejected"] == 1
    groups, tables = _group_results(result.columns, goodput)
    frame_groups, frame_tables = _group_results(result.records, goodput)
    assert same(groups, frame_groups) and tables == frame_tables and len(tables) == 2
    flat = {**from_columns, "num_requests": 2, "rejected": 1}  # half rejected: a warning
    assert summary_warnings(flat, result.columns) == summary_warnings(flat, result.records)
    assert "most:" in summary_warnings(flat, result.columns)[0]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.floats(allow_nan=False, allow_infinity=False, min_value=-1e12, max_value=1e12),
        min_size=1,
        max_size=60,
    ),
    st.lists(st.floats(min_value=0, max_value=100), min_size=1, max_size=6),
)
def test_linear_percentiles_equal_numpy_to_the_bit(values: list[float], ps: list[float]) -> None:
    """The summary's percentiles are numpy's default (linear) ones, bit for bit."""
    from roseinfer.metrics.summary import linear_percentiles

    ps = [50.0, 99.0, 0.0, 100.0, *ps]
    want = np.percentile(np.array(values), ps).tolist()
    got = linear_percentiles(np.array(values), ps)
    assert [x.hex() for x in got] == [float(x).hex() for x in want]
