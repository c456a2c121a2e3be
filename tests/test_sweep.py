"""Sweeps (serial and Ray), ``rose-sim sweep`` and the capacity search."""

from __future__ import annotations

import importlib.util
import math

import pandas as pd
import pytest

from roseinfer import workloads
from roseinfer.calibration.cost_model import make_cost_model
from roseinfer.config import SchedulerConfig
from roseinfer.experiments.capacity import (
    CapacitySearch,
    Criterion,
    find_capacity,
    fluid_capacity,
    judge,
    measured,
    parse_criteria,
    probe_requests,
)
from roseinfer.experiments.sweep import grid_points, resolve_backend, run_grid
from tests.test_rose_sim import rose_sim

BASE = SchedulerConfig(num_kv_blocks=8000, max_model_len=16384)
COST = make_cost_model("llama-3.1-8b", "h100-sxm")
VARIANTS = {
    "fifo": {"policy": "fifo"},
    "budget+ll": {"policy": "budget", "prefill_max_tokens": 2048, "router": "least-loaded"},
}
GRID = """
[base]
num_requests = 30
[grid]
request_rates = [4, 16]
num_replicas = [1, 2]
[variants.fifo]
policy = "fifo"
[variants.pa]
policy = "fifo"
router = "prefix-aware"
"""


FAST = ("--min-duration-s", "20", "--min-measured-requests", "200")  # small probes for tests


def small_grid(backend: str) -> pd.DataFrame:
    reqs = workloads.load_default_trace()[:30]
    return run_grid(
        reqs, base=BASE, cost_model=COST, variants=VARIANTS, request_rates=[4, 16],
        num_replicas=[1, 2], backend=backend, progress=False, goodput={"ttft": 200},
    )  # fmt: skip


def test_grid_points_cover_every_combination_in_order() -> None:
    points = grid_points(VARIANTS, [1, 2, 3], [1, 4], [0, 1])
    assert len(points) == 2 * 3 * 2 * 2
    assert [p.index for p in points] == list(range(24))
    assert (points[0].variant, points[1].variant) == ("fifo", "budget+ll")
    with pytest.raises(ValueError, match=r"num_replicas must be in \[1, 4096\]"):
        grid_points(VARIANTS, [1], [0])


def test_serial_grid_has_replica_and_router_columns() -> None:
    df = small_grid("serial")
    assert len(df) == 8
    assert set(df["num_replicas"]) == {1, 2}
    clustered = df[df["variant"] == "budget+ll"]
    assert set(clustered["router"]) == {"least-loaded"}
    assert (df.loc[(df["variant"] == "fifo") & (df["num_replicas"] == 1), "router"] == "").all()
    assert (df["completed"] == 30).all() and df["request_goodput"].notna().all()


def test_unknown_backend_and_sweep_key_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="unknown sweep backend 'dask'"):
        resolve_backend("dask")
    with pytest.raises(ValueError, match="unknown sweep keys"):
        run_grid([], base=BASE, cost_model=COST, variants={"x": {"bogus": 1}}, backend="serial")


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="Ray not installed")
def test_ray_backend_gives_the_serial_rows() -> None:
    import ray

    try:
        ray_rows = small_grid("ray")
    finally:
        ray.shutdown()
    serial = small_grid("serial")
    pd.testing.assert_frame_equal(
        ray_rows.drop(columns="sim_wall_s"), serial.drop(columns="sim_wall_s")
    )


def step(boundary: float):
    """A probe passing below ``boundary`` req/s and failing at or above it."""
    return lambda rate: (rate < boundary, 1.0 if rate < boundary else 0.0)


@pytest.mark.parametrize("estimate", [None, 10.0, 37.0, 300.0])
def test_capacity_bisects_to_within_tolerance_below_the_boundary(estimate) -> None:
    search = CapacitySearch({"ttft": 100.0}, min_rate=1.0, max_rate=1000.0, tolerance=0.02)
    found = find_capacity(step(37.0), search, estimate)
    assert 37.0 * (1 - 0.03) <= found.capacity_rate < 37.0
    assert not found.capped and all(ok == (r < 37.0) for r, _, ok in found.probes)


def test_a_close_fluid_estimate_saves_probes() -> None:
    search = CapacitySearch({"ttft": 100.0}, tolerance=0.05)
    blind = find_capacity(step(37.0), search)
    informed = find_capacity(step(37.0), search, estimate_rate=40.0)
    assert len(informed.probes) < len(blind.probes) <= 30


def test_fluid_capacity_is_the_drain_rate_of_a_burst() -> None:
    reqs = workloads.load_default_trace()[:600]
    fluid = fluid_capacity(reqs, BASE, COST)
    # the notebooks' rates bracket it: at 0.5x nothing queues, at 1.2x the queue grows
    low = run_grid(reqs, base=BASE, cost_model=COST, variants={"fifo": {}},
                   request_rates=[0.5 * fluid, 1.2 * fluid], progress=False)  # fmt: skip
    assert 0 < fluid < 1000
    assert low.mean_ttft_ms.iloc[1] > 3 * low.mean_ttft_ms.iloc[0]
    with pytest.raises(ValueError, match="at least one request"):
        fluid_capacity([], BASE, COST)


def test_capacity_edges_zero_and_capped() -> None:
    search = CapacitySearch({"ttft": 100.0}, min_rate=1.0, max_rate=8.0)
    assert find_capacity(step(0.5), search).capacity_rate == 0.0
    capped = find_capacity(step(math.inf), search)
    assert capped.capacity_rate == 8.0 and capped.capped


def test_capacity_search_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match="at least one SLO"):
        CapacitySearch({})
    for bad in (0, math.nan, 1.5):
        with pytest.raises(ValueError, match="--tolerance"):
            CapacitySearch({"ttft": 1.0}, tolerance=bad)
    with pytest.raises(ValueError, match="--min-duration-s"):
        CapacitySearch({"ttft": 1.0}, min_duration_s=math.nan)


def test_slos_take_a_percentile_per_metric() -> None:
    assert parse_criteria("ttft:2000 tpot:p99:100 queue:p90:5000") == [
        Criterion("ttft", 2000.0), Criterion("tpot", 100.0, 99.0), Criterion("queue", 5000.0, 90.0),
    ]  # fmt: skip
    for bad, message in [("ttft", "expected METRIC"), ("itl:5", "expected METRIC"),
                         ("ttft:p0:5", "percentile"), ("ttft:nan", "finite"),
                         ("ttft:1 ttft:2", "twice"), ("", "needs SLOs")]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            parse_criteria(bad)


def records(ttft_ms: list[float], rejected: int = 0) -> pd.DataFrame:
    n = len(ttft_ms) + rejected
    first = [t / 1e3 for t in ttft_ms] + [math.nan] * rejected
    return pd.DataFrame({
        "status": ["finished"] * len(ttft_ms) + ["rejected"] * rejected,
        "arrival_s": [0.0] * n, "admitted_s": [0.0] * len(ttft_ms) + [math.nan] * rejected,
        "first_token_s": first, "finish_s": [f + 1.0 for f in first],
        "num_output_tokens": [11] * len(ttft_ms) + [0] * rejected,
    })  # fmt: skip


def test_judging_counts_rejected_requests_as_misses() -> None:
    recs = records([100.0] * 8 + [900.0], rejected=1)  # 8 of 10 meet ttft:500
    assert judge(recs, [Criterion("ttft", 500.0)], 0.8) == (True, 0.8)
    assert judge(recs, [Criterion("ttft", 500.0)], 0.9) == (False, 0.8)
    # a percentile criterion is on its own: p50 holds, p95 does not (the rejected one is inf)
    assert judge(recs, [Criterion("ttft", 500.0, 50.0)], 0.9)[0]
    assert not judge(recs, [Criterion("ttft", 500.0, 95.0)], 0.9)[0]
    assert judge(recs, [Criterion("tpot", 100.0)], 1.0) == (False, 0.9)  # 1 s / 10 tokens


def test_probes_draw_the_same_requests_at_every_rate() -> None:
    pool = workloads.load_default_trace()[:50]
    slow, fast = (probe_requests(pool, rate, 100.0, 1.0, seed=3) for rate in (2.0, 8.0))
    assert 150 < len(slow) < 250 and 650 < len(fast) < 950
    assert max(r.arrival_time_s for r in fast) < 100.0
    assert [r.num_prompt_tokens for r in slow] == [r.num_prompt_tokens for r in fast[: len(slow)]]
    assert len({r.request_id for r in fast}) == len(fast)


def test_the_measured_window_skips_warm_up_and_drain() -> None:
    recs = pd.DataFrame({"arrival_s": [0.0, 19.0, 20.0, 50.0, 90.0, 95.0]})
    assert measured(recs, 100.0)["arrival_s"].tolist() == [20.0, 50.0, 90.0]


def test_rose_sim_sweep_writes_parquet(monkeypatch, capsys, tmp_path) -> None:
    grid = tmp_path / "g.toml"
    grid.write_text(GRID)
    code, out, err = rose_sim(monkeypatch, capsys, "sweep", str(grid), "--backend", "serial")
    assert code == 0, err
    df = pd.read_parquet(tmp_path / "g.parquet")
    assert len(df) == 8 and "8 points" in out
    assert set(df.loc[df["variant"] == "pa", "router"]) == {"prefix-aware"}


def test_rose_sim_capacity_finds_a_rate(monkeypatch, capsys, tmp_path) -> None:
    out_file = tmp_path / "cap.csv"
    code, out, err = rose_sim(
        monkeypatch, capsys, "capacity", "--goodput", "ttft:300", "--num-requests", "60",
        "--backend", "serial", "--quiet", "--output", str(out_file), "--tolerance", "0.1",
        *FAST,
    )  # fmt: skip
    assert code == 0, err
    row = pd.read_csv(out_file).iloc[0]
    assert 0.25 < row["capacity_rate"] < 2 * row["estimate_rate"] and not row["capped"]
    assert "capacity at ttft:300" in out


def test_capacity_does_not_depend_on_the_request_count(monkeypatch, capsys, tmp_path) -> None:
    """Regression: a finite burst of N requests drains after its last arrival, so
    capacity used to fall with N (42 req/s at 400 requests, 18.5 at 6,000). Probes
    are now steady-state draws from the whole mix: the count only sets a floor."""
    rates = []
    for n in ("100", "3000"):
        out_file = tmp_path / f"cap{n}.csv"
        code, _, err = rose_sim(
            monkeypatch, capsys, "capacity", "--goodput", "ttft:300", "--num-requests", n,
            "--backend", "serial", "--quiet", "--output", str(out_file), "--tolerance", "0.1",
        )  # fmt: skip
        assert code == 0, err
        rates.append(pd.read_csv(out_file)["capacity_rate"].iloc[0])
    assert rates[1] == pytest.approx(rates[0], rel=0.1)


def test_rose_sim_capacity_searches_prefill_decode_ratios(monkeypatch, capsys, tmp_path) -> None:
    out_file = tmp_path / "cap.csv"
    code, out, err = rose_sim(
        monkeypatch, capsys, "capacity", "--goodput", "ttft:400", "queue:p99:300",
        "--pd-ratios", "2", "1:1", "--router", "least-loaded", "--backend", "serial",
        "--quiet", "--output", str(out_file), "--tolerance", "0.2", *FAST,
    )  # fmt: skip
    assert code == 0, err
    df = pd.read_csv(out_file, dtype={"replicas": str})
    assert df["replicas"].tolist() == ["2", "1P+1D"] and (df["num_gpus"] == 2).all()
    assert (df["capacity_rate"] > 0).all()
    assert (df["capacity_per_gpu"] == df["capacity_rate"] / 2).all()


def test_rose_sim_capacity_over_a_grid(monkeypatch, capsys, tmp_path) -> None:
    grid = tmp_path / "g.toml"
    grid.write_text(GRID)
    out_file = tmp_path / "cap.parquet"
    code, _, err = rose_sim(
        monkeypatch, capsys, "capacity", "--grid", str(grid), "--goodput", "ttft:300",
        "--backend", "serial", "--quiet", "--output", str(out_file), "--tolerance", "0.2", *FAST,
    )  # fmt: skip
    assert code == 0, err
    df = pd.read_parquet(out_file)
    assert len(df) == 4  # 2 variants x 2 replica counts
    two = df[df["num_replicas"] == 2].set_index("variant")["capacity_rate"]
    one = df[df["num_replicas"] == 1].set_index("variant")["capacity_rate"]
    assert (two >= one).all()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["capacity", "--num-requests", "5"], "capacity needs SLOs"),
        (["capacity", "--goodput", "ttft:5", "--min-rate", "0"], "--min-rate"),
        (["capacity", "--goodput", "ttft:p100x:5"], "not a finite number"),
        (
            ["capacity", "--goodput", "ttft:5", "--pd-ratios", "1:0"],
            "num_replicas must be in [1, 4096]",
        ),
        (
            ["capacity", "--goodput", "ttft:5", "--pd-ratios", "1:1", "--num-replicas", "2"],
            "drop the replica counts",
        ),
        (["sweep", "missing.toml"], "cannot read grid"),
    ],
)
def test_sweep_and_capacity_errors_are_one_line(monkeypatch, capsys, args, message) -> None:
    code, _, err = rose_sim(monkeypatch, capsys, *args)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1
