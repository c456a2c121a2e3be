"""Sweeps (serial and Ray), ``rose-sim sweep`` and the capacity search."""

from __future__ import annotations

import importlib.util
import math

import pandas as pd
import pytest

from roseinfer import workloads
from roseinfer.calibration.cost_model import make_cost_model
from roseinfer.config import SchedulerConfig
from roseinfer.experiments.capacity import CapacitySearch, find_capacity, slo_attainment
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
    with pytest.raises(ValueError, match="num_replicas must be >= 1"):
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
    """Attainment 1 below ``boundary`` req/s, 0 at or above it."""
    return lambda rate: 1.0 if rate < boundary else 0.0


def test_capacity_bisects_to_within_tolerance_below_the_boundary() -> None:
    search = CapacitySearch({"ttft": 100.0}, min_rate=1.0, max_rate=1000.0, tolerance=0.02)
    found = find_capacity(step(37.0), search)
    assert 37.0 * (1 - 0.03) <= found.capacity_rate < 37.0
    assert not found.capped and all(ok == (r < 37.0) for r, _, ok in found.probes)


def test_capacity_edges_zero_and_capped() -> None:
    search = CapacitySearch({"ttft": 100.0}, min_rate=1.0, max_rate=8.0)
    assert find_capacity(step(0.5), search).capacity_rate == 0.0
    capped = find_capacity(step(math.inf), search)
    assert capped.capacity_rate == 8.0 and capped.capped


def test_capacity_search_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match="at least one SLO"):
        CapacitySearch({})
    with pytest.raises(ValueError, match="--tolerance"):
        CapacitySearch({"ttft": 1.0}, tolerance=0)


def test_slo_attainment_counts_good_requests_over_all_submitted() -> None:
    assert slo_attainment({"request_goodput": 2.0, "duration": 5.0}, 20) == 0.5
    assert slo_attainment({"request_goodput": float("nan"), "duration": 5.0}, 20) == 0.0


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
    )  # fmt: skip
    assert code == 0, err
    row = pd.read_csv(out_file).iloc[0]
    assert 0.25 < row["capacity_rate"] < 256 and not row["capped"]
    assert "capacity at ttft:300" in out


def test_rose_sim_capacity_over_a_grid(monkeypatch, capsys, tmp_path) -> None:
    grid = tmp_path / "g.toml"
    grid.write_text(GRID)
    out_file = tmp_path / "cap.parquet"
    code, _, err = rose_sim(
        monkeypatch, capsys, "capacity", "--grid", str(grid), "--goodput", "ttft:300",
        "--backend", "serial", "--quiet", "--output", str(out_file), "--tolerance", "0.2",
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
        (["sweep", "missing.toml"], "cannot read grid"),
    ],
)
def test_sweep_and_capacity_errors_are_one_line(monkeypatch, capsys, args, message) -> None:
    code, _, err = rose_sim(monkeypatch, capsys, *args)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1
