"""Clusters of simulated replicas behind routers (``rose-sim --num-replicas``)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pandas as pd
import pytest

from roseinfer import hookimpl
from roseinfer.calibration.cost_model import make_cost_model
from roseinfer.config import SchedulerConfig
from roseinfer.registry import UnknownPolicyError, load_registry, make_plugin_manager
from roseinfer.request import Request
from roseinfer.routing import ReplicaView, Router
from roseinfer.simulator.cluster import ReplicaSpec, simulate_cluster
from roseinfer.simulator.engine import simulate
from tests.test_rose_sim import rose_sim

COST = make_cost_model("llama-3.1-8b", "h100-sxm")
CONFIG = SchedulerConfig(num_kv_blocks=4000, block_size=16, max_model_len=8192)


def grouped_requests(num: int, num_groups: int, rate: float = 20.0) -> list[Request]:
    """Requests whose prompts share one of ``num_groups`` 1024-token prefixes
    (request i gets prefix i mod num_groups), plus a 32-token unique tail."""
    rng = np.random.default_rng(0)
    prefixes = [tuple(int(x) for x in rng.integers(1000, 50000, 1024)) for _ in range(num_groups)]
    reqs = []
    for i in range(num):
        ids = prefixes[i % num_groups] + tuple(int(x) for x in rng.integers(1000, 50000, 32))
        reqs.append(Request(f"r{i}", i / rate, len(ids), 16, prompt_token_ids=ids))
    return reqs


def router(name: str, **options: str) -> Router:
    return load_registry().router(name)(seed=0, options=options)


def test_one_replica_cluster_matches_the_single_simulator() -> None:
    reqs = grouped_requests(60, 3)
    single = simulate(reqs, CONFIG, COST).records
    cluster = simulate_cluster(reqs, [ReplicaSpec("a", CONFIG, COST)], router("round-robin"))
    assert (cluster.records["replica"] == 0).all()
    cols = ["request_id", "first_token_s", "finish_s", "num_cached_prompt_tokens"]
    pd.testing.assert_frame_equal(cluster.records[cols], single[cols])


def test_a_cluster_without_token_times_summarizes_from_histograms() -> None:
    """Without kept token times (rose-sim without --save-records) a cluster is
    flat in memory: records carry no token times, the ITL comes from the
    replicas' merged histograms, within the histogram's resolution."""
    from roseinfer.metrics import summarize

    reqs = grouped_requests(80, 4)
    specs = [ReplicaSpec("a", CONFIG, COST)] * 3
    kept = simulate_cluster(reqs, specs, router("round-robin"))
    flat = simulate_cluster(reqs, specs, router("round-robin"), keep_token_times=False)
    assert flat.records["token_times_s"].isna().all() and flat.itl is not None
    a = summarize(kept.records, duration_s=kept.duration_s)
    b = summarize(flat.records, duration_s=flat.duration_s, itl=flat.itl)
    for key in ("mean_itl_ms", "p99_itl_ms", "p50_itl_ms", "p99_ttft_ms"):
        assert b[key] == pytest.approx(a[key], rel=1e-3), key
    per_kept, per_flat = kept.replica_summaries(), flat.replica_summaries()
    assert np.allclose(per_flat["p99_itl_ms"], per_kept["p99_itl_ms"], rtol=1e-3)


def test_round_robin_spreads_requests_evenly_and_records_the_replica() -> None:
    reqs = grouped_requests(40, 4)
    result = simulate_cluster(reqs, [ReplicaSpec("a", CONFIG, COST)] * 4, router("round-robin"))
    assert result.info["routed"] == [10, 10, 10, 10]
    assert list(result.records["replica"][:4]) == [0, 1, 2, 3]
    assert (result.records["status"] == "finished").all()
    assert len(result.replica_summaries()) == 4


def test_prefix_aware_raises_the_hit_rate_over_round_robin() -> None:
    reqs = grouped_requests(120, 5)
    specs = [ReplicaSpec("a", CONFIG, COST)] * 4
    rr = simulate_cluster(reqs, specs, router("round-robin"))
    pa = simulate_cluster(reqs, specs, router("prefix-aware", load_weight="0.1"))
    default = simulate_cluster(reqs, specs, router("prefix-aware"))
    runs = (("rr", rr), ("pa", pa), ("default", default))
    cold = {n: (r.records["num_cached_prompt_tokens"] == 0).sum() for n, r in runs}
    # the default load weight trades some hits for balance (67 outstanding
    # blocks per request against 64 cached ones here)
    assert cold["default"] < cold["rr"]
    # round-robin computes each of the 5 prefixes on every replica (20 cold
    # prefills); prefix-aware on about one replica each
    assert cold["rr"] >= 16 and cold["pa"] <= 8
    assert (
        pa.records["num_cached_prompt_tokens"].sum() > rr.records["num_cached_prompt_tokens"].sum()
    )
    # requests of one prefix group end up together
    groups = pa.records.assign(group=[int(r[1:]) % 5 for r in pa.records["request_id"]])
    assert groups.groupby("group")["replica"].nunique().max() <= 2


def test_least_loaded_avoids_a_slower_replica() -> None:
    slow = make_cost_model("llama-3.1-8b", "a100-80gb")
    specs = [ReplicaSpec("fast", CONFIG, COST), ReplicaSpec("slow", CONFIG, slow)]
    reqs = grouped_requests(200, 50, rate=60.0)
    result = simulate_cluster(reqs, specs, router("least-loaded"))
    assert result.info["routed"][0] > result.info["routed"][1]


def test_random_router_is_reproducible_with_its_seed() -> None:
    reqs = grouped_requests(30, 3)
    specs = [ReplicaSpec("a", CONFIG, COST)] * 3
    a = simulate_cluster(reqs, specs, router("random")).records["replica"]
    b = simulate_cluster(reqs, specs, router("random")).records["replica"]
    assert a.tolist() == b.tolist() and a.nunique() == 3


def test_stale_router_views_still_count_what_the_router_sent() -> None:
    reqs = grouped_requests(80, 80, rate=100.0)
    specs = [ReplicaSpec("a", CONFIG, COST)] * 2
    fresh = simulate_cluster(reqs, specs, router("least-loaded"))
    stale = simulate_cluster(reqs, specs, router("least-loaded"), router_staleness_s=10.0)
    assert len(stale.records) == 80 and (stale.records["status"] == "finished").all()
    # with stale load the router still alternates (it counts what it sent)
    assert abs(stale.info["routed"][0] - stale.info["routed"][1]) <= 1
    assert fresh.info["routed"] != [80, 0]


def test_a_plugin_router_picks_through_filter_score_pick() -> None:
    class LastOne(Router):
        name = "last-one"

        def score(self, request: Request, candidates, now_s: float) -> list[float]:
            return [float(c.index) for c in candidates]

    reqs = grouped_requests(10, 2)
    result = simulate_cluster(reqs, [ReplicaSpec("a", CONFIG, COST)] * 3, LastOne())
    assert result.info["routed"] == [0, 0, 10]


def test_a_request_too_long_for_every_replica_is_rejected_not_raised() -> None:
    small = dataclasses.replace(CONFIG, max_model_len=512)
    reqs = grouped_requests(4, 1)
    result = simulate_cluster(reqs, [ReplicaSpec("a", small, COST)] * 2, router("prefix-aware"))
    assert (result.records["status"] == "rejected").all()


def test_registry_lists_routers_and_rejects_unknown_ones() -> None:
    registry = load_registry()
    assert {"round-robin", "least-loaded", "prefix-aware", "random"} <= set(registry.routers)
    assert "routers (--router" in registry.describe()
    with pytest.raises(UnknownPolicyError, match="known: least-loaded"):
        registry.router("nope")


def test_a_router_plugin_registers_through_the_hook() -> None:
    class Sticky(Router):
        name = "sticky"
        description = "always replica 0"

    class Plugin:
        @hookimpl
        def register_routers(self) -> list[type[Router]]:
            return [Sticky]

    pm = make_plugin_manager(load_entry_points=False)
    pm.register(Plugin(), name="my-routers")
    registry = load_registry(pm)
    assert registry.router("sticky") is Sticky
    assert "sticky" in registry.describe() and "my-routers" in registry.describe()
    pm.register(type("Again", (Plugin,), {})(), name="again")
    with pytest.raises(ValueError, match="both register 'sticky'"):
        load_registry(pm)


def test_replica_view_outstanding_blocks() -> None:
    view = ReplicaView(0, "a", 0, 0, 160, 10, 10, 16, 100, lambda r: 0)
    assert view.outstanding_blocks == 10


def test_cli_cluster_writes_per_replica_summaries(monkeypatch, capsys, tmp_path) -> None:
    out = tmp_path / "r.json"
    recs = tmp_path / "r.csv"
    code, text, err = rose_sim(
        monkeypatch, capsys, "--num-replicas", "3", "--router", "least-loaded",
        "--num-requests", "60", "--save-result", str(out), "--save-records", str(recs),
    )  # fmt: skip
    assert code == 0, err
    result = json.loads(out.read_text())
    assert result["num_replicas"] == 3 and result["router"] == "least-loaded"
    assert sum(r["num_routed"] for r in result["replica_summaries"]) == 60
    assert set(pd.read_csv(recs)["replica"]) == {0, 1, 2}
    assert "replica  name" in text


def test_cli_replica_config_builds_heterogeneous_replicas(monkeypatch, capsys, tmp_path) -> None:
    cfg = tmp_path / "replicas.toml"
    cfg.write_text(
        '[[replica]]\ndevice = "h100-sxm"\ncount = 2\n\n'
        '[[replica]]\ndevice = "a100-80gb"\nnum_kv_blocks = 3000\n'
    )
    out = tmp_path / "r.json"
    code, _, err = rose_sim(
        monkeypatch, capsys, "--replica-config", str(cfg), "--num-requests", "30",
        "--save-result", str(out), "--quiet",
    )  # fmt: skip
    assert code == 0, err
    result = json.loads(out.read_text())
    assert result["num_replicas"] == 3 and result["num_kv_blocks"][2] == 3000
    assert result["replica_summaries"][2]["name"].endswith("a100-80gb")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--num-replicas", "0"], "--num-replicas: must be an integer in [1, 4096]"),
        (["--num-replicas", "2", "--router", "nope"], "unknown router 'nope'"),
        (["--num-replicas", "2", "--router-arg", "x"], "--router-arg takes KEY=VALUE"),
        (["--num-replicas", "2", "--router-staleness-s", "-1"], "must be a finite number >= 0"),
        (["--router", "prefix-aware"], "need --num-replicas N > 1"),
    ],
)
def test_cli_cluster_errors_are_one_line(monkeypatch, capsys, args, message) -> None:
    code, _, err = rose_sim(monkeypatch, capsys, "--num-requests", "5", *args)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1
