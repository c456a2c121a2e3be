"""``rose-sim --num-replicas N``: the cluster flags, the run and its tables.

Example::

    rose-sim --num-replicas 8 --router prefix-aware --trace synthetic_trace.jsonl \\
        --model llama-3.1-8b --hardware h100-sxm --enable-prefix-caching
    rose-sim --replica-config replicas.toml --router least-loaded
    rose-sim --num-prefill-replicas 1 --num-decode-replicas 3 --kv-transfer-link rdma-400g

The replica config format is in :mod:`roseinfer.simulator.replicas`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from roseinfer.calibration.graph_replay import DEFAULT_CUDAGRAPH_MODE, GraphReplay
from roseinfer.calibration.specs import (
    DEFAULT_KV_TRANSFER_LINK,
    LINKS,
    LinkSpec,
    get_link_spec,
)
from roseinfer.cli.config import config_facts
from roseinfer.cli.flags import CliError, clip, float_in, int_in
from roseinfer.cli.report import report
from roseinfer.config import SchedulerConfig
from roseinfer.kv_tiers import kv_tier_summary
from roseinfer.registry import Registry
from roseinfer.request import Request
from roseinfer.simulator.setup import MAX_REPLICAS, KVPool, SimSetup

# NOTE: the cluster simulator, its replicas and routers are imported by the functions
# that run a cluster: a one-replica rose-sim run parses these flags but never needs
# them (10 ms of a 0.8 s run).
if TYPE_CHECKING:
    import pandas as pd

    from roseinfer.routing import Router
    from roseinfer.simulator.cluster import ClusterResult, ReplicaSpec
else:
    from roseinfer.metrics.lazy import pandas as pd

PER_REPLICA_KEYS = (
    "role", "utilization", "num_routed", "completed", "prefix_cache_hit_rate",
    "p99_ttft_ms", "mean_ttft_ms", "p99_tpot_ms",
)  # fmt: skip


def add_cluster_args(parser: argparse.ArgumentParser) -> None:
    """Add the replica counts, routers, replica config and KV handoff link flags."""
    g = parser.add_argument_group("cluster (rose-sim only; rose-run serves one replica)")
    count = int_in(1, MAX_REPLICAS)
    g.add_argument("--num-replicas", type=count, help="replicas behind a router, each with its "
                   "own KV pool and prefix cache (default 1)")  # fmt: skip
    g.add_argument(
        "--router",
        help="routing policy with several replicas (default round-robin; see --list-policies)",
    )
    g.add_argument("--router-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="router knob, e.g. load_weight=0.5 for prefix-aware (repeatable)")  # fmt: skip
    g.add_argument(
        "--router-staleness-s",
        type=float_in(0),
        default=0.0,
        help="the router sees replica load as of its last refresh, at most this old "
        "(simulated s; default 0 = fresh at every arrival)",
    )
    g.add_argument(
        "--replica-config",
        type=Path,
        metavar="FILE.toml|json",
        help="heterogeneous replicas: a list of {model, hardware, num_kv_blocks, count, role, ...}",
    )
    g.add_argument("--num-prefill-replicas", type=count, help="disaggregated serving: replicas "
                   "that only prefill and hand the KV on (with --num-decode-replicas; DistServe, "
                   "vLLM's disaggregated prefill)")  # fmt: skip
    g.add_argument("--num-decode-replicas", type=count, help="disaggregated serving: replicas "
                   "that only decode, from handed-over KV")  # fmt: skip
    g.add_argument("--decode-router", help="routing policy of the decode stage (default: "
                   "--router's)")  # fmt: skip
    g.add_argument(
        "--kv-transfer-link",
        help="link KV handoffs cross between replicas, one per GPU: "
        f"{', '.join(LINKS)} (default {DEFAULT_KV_TRANSFER_LINK})",
    )


def wants_cluster(args: argparse.Namespace) -> bool:
    """True when the flags ask for more than one replica, a replica config, or
    prefill and decode replicas.

    Raises:
        CliError: with only one of the prefill/decode counts, both them and
            --num-replicas, or cluster flags without a cluster.
    """
    disagg = wants_disaggregation(args)
    cluster = (args.num_replicas or 1) > 1 or args.replica_config is not None or disagg
    if not cluster and (args.router or args.router_arg or args.router_staleness_s):
        raise CliError("--router, --router-arg and --router-staleness-s need --num-replicas N > 1")
    if not disagg and args.replica_config is None and (args.decode_router or args.kv_transfer_link):
        raise CliError(
            "--decode-router and --kv-transfer-link need prefill and decode replicas "
            "(--num-prefill-replicas and --num-decode-replicas, or roles in --replica-config)"
        )
    return cluster


def wants_disaggregation(args: argparse.Namespace) -> bool:
    """True with --num-prefill-replicas and --num-decode-replicas.

    Raises:
        CliError: with one of them only, or with --num-replicas / --replica-config too.
    """
    given = (args.num_prefill_replicas is not None, args.num_decode_replicas is not None)
    if given == (False, False):
        return False
    if given != (True, True):
        raise CliError(
            "disaggregated serving needs both --num-prefill-replicas and --num-decode-replicas"
        )
    if args.num_replicas is not None or args.replica_config is not None:
        raise CliError(
            "--num-prefill-replicas/--num-decode-replicas count the replicas: drop "
            "--num-replicas (or give roles in --replica-config instead)"
        )
    return True


def make_router(args: argparse.Namespace, registry: Registry, name: str | None = None) -> Router:
    """The router ``name`` (default ``--router``, else round-robin) with its
    ``--router-arg`` knobs.

    Raises:
        CliError: on a malformed ``--router-arg``.
        UnknownPolicyError: on an unknown router name.
    """
    options = {}
    for item in args.router_arg:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise CliError(f"--router-arg takes KEY=VALUE, got {clip(item)!r}")
        options[key] = value
    from roseinfer.routing import build_router

    cls = registry.router(name or args.router or "round-robin")
    try:
        return build_router(cls, seed=args.seed, options=options)
    except ValueError as err:
        raise CliError(str(err)) from None


def kv_transfer_link(args: argparse.Namespace) -> LinkSpec:
    """The ``--kv-transfer-link`` preset (default :data:`DEFAULT_KV_TRANSFER_LINK`).

    Raises:
        CliError: on an unknown link name.
    """
    try:
        return get_link_spec(args.kv_transfer_link or DEFAULT_KV_TRANSFER_LINK)
    except ValueError as err:
        raise CliError(f"--kv-transfer-link: {err}") from None


def replica_specs(
    args: argparse.Namespace, base: SchedulerConfig, setup: SimSetup, pool: KVPool
) -> list[ReplicaSpec]:
    """The cluster's replicas: ``--num-replicas`` copies of the setup,
    ``--num-prefill-replicas`` + ``--num-decode-replicas`` of it, or the
    ``--replica-config`` entries (keys not given take the flags' values, the
    pool sized as ``pool`` says).

    Raises:
        CliError: when ``--num-replicas`` disagrees with the config's count.
        SetupError: on a bad replica config.
    """
    from roseinfer.simulator.replicas import ReplicaDefaults, configured_replicas, copies

    gpus = args.tensor_parallel_size * args.pipeline_parallel_size
    if args.replica_config is None:
        counts = {"mixed": args.num_replicas or 1}
        if wants_disaggregation(args):
            counts = {"prefill": args.num_prefill_replicas, "decode": args.num_decode_replicas}
        name = f"{setup.model.name}@{setup.device_name}"
        return copies(base, name, setup.cost_model, setup.model.kv_bytes_per_token, gpus, counts)
    defaults = ReplicaDefaults(
        args.model, args.device, args.tensor_parallel_size, args.pipeline_parallel_size,
        args.interconnect, pool, args.max_model_len,
        args.step_jitter == "measured", GraphReplay.of_mode(args.cudagraph_mode or DEFAULT_CUDAGRAPH_MODE),
    )  # fmt: skip
    specs = configured_replicas(args.replica_config, base, defaults)
    if args.num_replicas is not None and args.num_replicas != len(specs):
        raise CliError(
            f"--num-replicas {args.num_replicas} but --replica-config lists {len(specs)}; drop one"
        )
    return specs


def run_cluster(
    args: argparse.Namespace,
    registry: Registry,
    requests: list[Request],
    specs: list[ReplicaSpec],
    *,
    title: str,
    extra: dict[str, Any],
) -> ClusterResult:
    """Simulate the cluster, print the cluster-wide and per-replica summaries and
    write the files asked for (``--save-result`` gets ``replica_summaries``)."""
    from roseinfer.simulator.cluster import simulate_cluster

    router = make_router(args, registry)
    disagg = any(s.role != "mixed" for s in specs)
    try:
        result = simulate_cluster(
            requests, specs, router, registry=registry, jump=not args.no_jump,
            router_staleness_s=args.router_staleness_s,
            keep_token_times=args.save_records is not None,
            decode_router=make_router(args, registry, args.decode_router) if disagg else None,
            kv_transfer_link=kv_transfer_link(args) if disagg else None,
        )  # fmt: skip
    except ValueError as err:
        raise CliError(str(err)) from None
    per = result.replica_summaries()
    per.insert(2, "num_routed", result.info["routed"])
    tier_keys = add_kv_tier_columns(per, result)
    extra = {
        **extra,
        "policy": result.policy,
        "num_replicas": len(specs),
        "router": router.name,
        "router_staleness_s": args.router_staleness_s,
        **config_facts(specs[0].config),
        "num_kv_blocks": [s.config.num_kv_blocks for s in specs],
        "sim_wall_s": result.wall_s,
        "num_steps": result.num_steps,
        **kv_tier_summary(s.block_manager.kv_tier_counters() for s in result.schedulers),
        "replica_summaries": per[["replica", "name", *PER_REPLICA_KEYS, *tier_keys]].to_dict(
            "records"
        ),
    }
    if result.disaggregation is not None:
        extra["num_prefill_replicas"] = sum(s.role == "prefill" for s in specs)
        extra["num_decode_replicas"] = sum(s.role == "decode" for s in specs)
        extra["disaggregation"] = result.disaggregation
    title = f"{title} | {len(specs)} replicas, router {router.name}"
    report(args, result.records, duration_s=result.duration_s, title=title, extra=extra,
           itl=result.itl)  # fmt: skip
    if not args.no_summary:
        if result.disaggregation is not None:
            print(format_disaggregation(result.disaggregation))
        print(format_replicas(per))
        print(
            f"simulated {len(requests)} requests on {len(specs)} replicas, "
            f"{result.num_steps} steps in {result.wall_s:.2f} s wall"
        )
    return result


def add_kv_tier_columns(per: pd.DataFrame, result: ClusterResult) -> list[str]:
    """Add each replica's KV tier hit rates and bytes moved to the per-replica table
    (``kv_hit_rate_device``, ``kv_hit_rate_<tier>``, ``kv_offloaded_bytes``,
    ``kv_loaded_bytes``); returns the columns added (none without tiers)."""
    rows = [kv_tier_summary([s.block_manager.kv_tier_counters()]) for s in result.schedulers]
    if not rows or not rows[0]:
        return []
    keys = [k for k in rows[0] if k.startswith("kv_hit_rate_")]
    keys += ["kv_offloaded_bytes", "kv_loaded_bytes"]
    for key in keys:
        per[key] = [row.get(key, 0.0) for row in rows]
    return keys


def format_replicas(per: pd.DataFrame) -> str:
    """The per-replica table: role, busy fraction, requests routed and finished, hit
    rate (and per KV tier, with tiers), TTFT and TPOT (a disaggregated replica's of
    its own stage)."""
    tiers = [c for c in per.columns if c.startswith("kv_hit_rate_")]
    head = "".join(f" {c.removeprefix('kv_hit_rate_')[:8]:>8}%" for c in tiers)
    lines = [
        "replica  name                           role     busy%  routed   done  hit%"
        + head
        + "  p99 TTFT ms  mean TTFT ms  p99 TPOT ms"
    ]
    for row in per.itertuples():
        cells = "".join(f" {100 * getattr(row, c):>9.1f}" for c in tiers)
        lines.append(
            f"{row.replica:>7}  {row.name[:30]:<30} {row.role:<8} {100 * row.utilization:>5.1f} "
            f"{row.num_routed:>7} {row.completed:>6} {100 * row.prefix_cache_hit_rate:>5.1f}"
            f"{cells} {row.p99_ttft_ms:>12.1f} {row.mean_ttft_ms:>13.1f} {row.p99_tpot_ms:>12.1f}"
        )
    return "\n".join(lines)


def format_disaggregation(summary: dict[str, Any]) -> str:
    """Two lines: per-stage queueing and the KV handoffs."""
    s = summary
    return (
        f"stages: prefill queue mean {s['mean_prefill_queue_ms']:.1f} / p99 "
        f"{s['p99_prefill_queue_ms']:.1f} ms, decode queue mean "
        f"{s['mean_decode_queue_ms']:.1f} / p99 {s['p99_decode_queue_ms']:.1f} ms\n"
        f"KV handoffs over {s['kv_transfer_link']}: {s['num_kv_transfers']} moved "
        f"{s['kv_transfer_gb']:.2f} GB, transfer mean {s['mean_kv_transfer_ms']:.2f} / "
        f"p99 {s['p99_kv_transfer_ms']:.2f} ms (waiting for a busy link "
        f"{s['mean_kv_transfer_wait_ms']:.2f} ms mean)"
    )
