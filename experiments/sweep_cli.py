"""``rose-sim sweep GRID.toml`` and ``rose-sim capacity``.

A grid file (TOML) has three parts::

    [base]                  # rose-sim flags (dashes or underscores), shared by every point
    workload = "azure-conv-sample"
    num_requests = 400
    model = "llama-3.1-8b"
    hardware = "h100-sxm"

    [grid]
    request_rates = [2, 4, 8, 16]   # req/s (arrivals re-drawn, vLLM bench semantics)
    num_replicas = [1, 2, 4]        # or "P:D": P prefill + D decode replicas
    seeds = [0]

    [variants.fifo]         # label -> overrides: SchedulerConfig fields, policy
    policy = "fifo"         # options, and router / router_args / router_staleness_s
    [variants."budget-2048-prefix"]
    policy = "budget"
    prefill_max_tokens = 2048
    router = "prefix-aware"

``rose-sim sweep`` runs every point (a Ray task each with ``--backend ray``,
the default when Ray is installed) and saves the rows as Parquet.
``rose-sim capacity --goodput ttft:MS tpot:MS`` finds the highest request rate
meeting the SLOs, for the flags' configuration or for every (variant, replicas,
seed) of ``--grid GRID.toml`` (see ``roseinfer.experiments.capacity``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import pandas as pd

from roseinfer.cli import (
    ArgumentParser,
    CliError,
    add_flag,
    add_quiet_args,
    build_workload,
    fit_workload,
    float_in,
    friendly_errors,
    int_in,
    scheduler_config,
    warn_to,
)
from roseinfer.experiments.capacity import (
    DEFAULT_ATTAINMENT,
    DEFAULT_MIN_DURATION_S,
    DEFAULT_TOLERANCE,
    MIN_MEASURED_REQUESTS,
    CapacitySearch,
    parse_criteria,
    search_point,
)
from roseinfer.experiments.sweep import (
    BACKENDS,
    GridInputs,
    GridPoint,
    grid_points,
    map_points,
    run_grid,
)
from roseinfer.metrics import parse_goodput
from roseinfer.registry import load_registry, warning_sink

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

GRID_AXES = {"request_rates", "num_replicas", "seeds"}


def _add_backend_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("execution")
    g.add_argument(
        "--backend",
        choices=BACKENDS,
        default="auto",
        help="run points serially or as Ray tasks (default auto: Ray when installed)",
    )
    g.add_argument(
        "--ray-address", help="address of a running Ray cluster (default: start one locally)"
    )
    g.add_argument("--output", type=Path, help="save the rows (.parquet or .csv)")


def sweep_parser() -> argparse.ArgumentParser:
    """The ``rose-sim sweep`` parser."""
    parser = ArgumentParser(
        prog="rose-sim sweep",
        description="Simulate every point of a grid (policies x knobs x request rates x "
        "replicas) and save one row per point as Parquet.",
    )
    parser.add_argument("grid", type=Path, help="grid file (TOML; see the module docs)")
    add_flag(parser, "--goodput")
    add_quiet_args(parser)
    _add_backend_args(parser)
    return parser


def capacity_parser() -> argparse.ArgumentParser:
    """The ``rose-sim capacity`` parser: rose-sim's flags plus the search's."""
    from roseinfer.simulator.cli import build_parser

    parser = build_parser()
    parser.prog = "rose-sim capacity"
    parser.epilog = None
    parser.description = (
        "Find the highest steady-state request rate meeting the SLOs (bisection on the rate "
        "from a fluid estimate, as Vidur-Search), for the flags' configuration or every "
        "configuration of --grid. --goodput takes METRIC:MS (joint attainment) or "
        "METRIC:pXX:MS (a percentile), METRIC one of ttft, tpot, e2el, queue."
    )
    g = parser.add_argument_group("capacity search")
    g.add_argument("--grid", type=Path, help="search every (variant, replicas, seed) of a grid")
    g.add_argument(
        "--pd-ratios",
        nargs="+",
        metavar="P:D|N",
        help="search each replica layout: P:D prefill:decode replicas or N colocated ones, "
        "e.g. 2 1:1 (the table adds capacity per GPU)",
    )
    g.add_argument(
        "--min-rate",
        type=float_in(0, lo_open=True),
        default=0.01,
        help="lowest rate probed (req/s; default 0.01)",
    )
    g.add_argument(
        "--max-rate",
        type=float_in(0, lo_open=True),
        default=1e6,
        help="highest rate probed (req/s; default 1e6)",
    )
    g.add_argument(
        "--min-duration-s",
        type=float_in(0, lo_open=True),
        default=DEFAULT_MIN_DURATION_S,
        help="shortest probe horizon in simulated seconds; a probe runs for max(this, "
        f"2 x the largest SLO / --tolerance) (default {DEFAULT_MIN_DURATION_S:g})",
    )
    g.add_argument(
        "--min-measured-requests",
        type=int_in(1),
        default=MIN_MEASURED_REQUESTS,
        help="fewest requests a probe measures: the attainment's precision "
        f"(default {MIN_MEASURED_REQUESTS}: sampling error < 1 point at 90%%)",
    )
    g.add_argument(
        "--tolerance",
        type=float_in(0, 1, lo_open=True),
        default=DEFAULT_TOLERANCE,
        help=f"stop when the bracket is this fraction of the rate (default {DEFAULT_TOLERANCE})",
    )
    g.add_argument(
        "--attainment",
        type=float_in(0, 1, lo_open=True),
        default=DEFAULT_ATTAINMENT,
        help=f"share of requests that must meet every SLO (default {DEFAULT_ATTAINMENT}, DistServe)",
    )
    _add_backend_args(parser)
    return parser


# ------------------------------------------------------------------- grid file
def read_grid(path: Path) -> dict[str, Any]:
    """The grid file's ``base``, ``grid`` and ``variants`` tables.

    Raises:
        CliError: if it cannot be read or has unknown sections or axes.
    """
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise CliError(f"cannot read grid {path}: {err}") from None
    unknown = set(data) - {"base", "grid", "variants"}
    axes = set(data.get("grid", {})) - GRID_AXES
    if unknown or axes:
        raise CliError(
            f"grid {path}: unknown {sorted(unknown | axes)}; sections are [base], [grid] "
            f"({', '.join(sorted(GRID_AXES))}) and [variants.LABEL]"
        )
    if not data.get("variants"):
        raise CliError(f"grid {path} has no [variants.LABEL] table")
    return data


def base_argv(base: dict[str, Any], grid_dir: Path) -> list[str]:
    """rose-sim flags from a ``[base]`` table (``trace`` relative to the grid file)."""
    argv: list[str] = []
    for key, value in base.items():
        flag = "--" + key.replace("_", "-")
        if key == "trace":
            value = str(grid_dir / value)
        if value is True:
            argv.append(flag)
        elif value is False:
            argv.append("--no-" + flag[2:])
        elif isinstance(value, list):
            argv += [flag, *map(str, value)]
        else:
            argv += [flag, str(value)]
    return argv


def grid_inputs(
    args: argparse.Namespace, goodput: dict[str, float] | None, *, whole_trace: bool = False
) -> GridInputs:
    """Requests, base config, cost model and KV handoff pricing from rose-sim flags
    (and the replicas of a ``--replica-config``); ``whole_trace`` ignores
    ``--num-requests`` (a capacity search draws from the whole mix)."""
    if whole_trace:
        args = argparse.Namespace(**{**vars(args), "num_requests": None})
    from roseinfer.simulator.cli import _profile_setup, _roofline_setup
    from roseinfer.simulator.cluster_cli import kv_transfer_link, replica_specs

    registry = load_registry()
    requests, _ = build_workload(args)
    setup = _profile_setup(args) if args.cost_model is not None else _roofline_setup(args)
    max_model_len = args.max_model_len or setup.max_model_len
    requests, _ = fit_workload(args, requests, max_model_len, default=setup.fit_lengths)
    config = scheduler_config(
        args, registry, num_kv_blocks=setup.num_kv_blocks, max_model_len=setup.max_model_len
    )
    replicas: tuple = ()
    if getattr(args, "replica_config", None) is not None:
        name = f"{setup.model.name}@{setup.device_name}"
        kv = setup.model.kv_bytes_per_token
        replicas = tuple(replica_specs(args, config, name, setup.cost_model, kv))
    return GridInputs(
        requests, config, setup.cost_model, args.burstiness, goodput,
        kv_bytes_per_token=setup.model.kv_bytes_per_token,
        kv_transfer_link=kv_transfer_link(args),
        num_gpus_per_replica=args.tensor_parallel_size * args.pipeline_parallel_size,
        replicas=replicas,
    )  # fmt: skip


def load_grid(
    path: Path, goodput: dict[str, float] | None = None, *, whole_trace: bool = False
) -> tuple[dict, GridInputs]:
    """A grid file's tables and the inputs its ``[base]`` flags describe
    (``whole_trace``: see :func:`grid_inputs`).

    Raises:
        CliError: on a bad grid file or flag.
    """
    from roseinfer.simulator.cli import build_parser

    data = read_grid(path)
    args = build_parser().parse_args(base_argv(data.get("base", {}), path.parent))
    return data, grid_inputs(args, goodput, whole_trace=whole_trace)


def save_rows(frame: pd.DataFrame, path: Path | None) -> None:
    """Write the rows as Parquet (pyarrow) or CSV, by extension.

    Raises:
        CliError: on another extension.
    """
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".parquet":
        frame.to_parquet(path, index=False)
    elif path.suffix == ".csv":
        frame.to_csv(path, index=False)
    else:
        raise CliError(f"--output needs a .parquet or .csv name, got {path.name!r}")


# -------------------------------------------------------------------- commands
def sweep_main(argv: list[str]) -> int:
    """``rose-sim sweep GRID.toml``."""
    args = sweep_parser().parse_args(argv)
    with friendly_errors("rose-sim sweep"), warning_sink(warn_to("rose-sim sweep")):
        goodput = parse_goodput(args.goodput) if args.goodput else None
        data, inputs = load_grid(args.grid, goodput)
        axes = data.get("grid", {})
        frame = run_grid(
            inputs.requests,
            base=inputs.base,
            cost_model=inputs.cost_model,
            variants=data["variants"],
            request_rates=axes.get("request_rates"),
            num_replicas=axes.get("num_replicas", [1]),
            seeds=axes.get("seeds", [0]),
            burstiness=inputs.burstiness,
            goodput=goodput,
            backend=args.backend,
            ray_address=args.ray_address,
            progress=not args.quiet,
            kv_bytes_per_token=inputs.kv_bytes_per_token,
            kv_transfer_link=inputs.kv_transfer_link,
            num_gpus_per_replica=inputs.num_gpus_per_replica,
        )
        output = args.output or args.grid.with_suffix(".parquet")
        save_rows(frame, output)
        if not args.no_summary:
            cols = ["variant", "router", "replicas", "request_rate", "p99_ttft_ms"]
            print(frame[cols + ["p99_tpot_ms", "request_throughput"]].round(2).to_string())
            print(f"{len(frame)} points -> {output}")
    return 0


def capacity_main(argv: list[str]) -> int:
    """``rose-sim capacity --goodput ttft:MS ...``."""
    args = capacity_parser().parse_args(argv)
    with friendly_errors("rose-sim capacity"), warning_sink(warn_to("rose-sim capacity")):
        if not args.goodput:
            raise CliError("capacity needs SLOs: --goodput ttft:MS [tpot:MS e2el:MS queue:pXX:MS]")
        points, inputs, num_requests = _capacity_points(args)
        search = CapacitySearch(
            parse_criteria(args.goodput), args.min_rate, args.max_rate, args.tolerance,
            args.attainment, args.min_duration_s, num_requests or 0, args.min_measured_requests,
        )  # fmt: skip
        rows = map_points(
            lambda p, i: search_point(p, i, search),
            points,
            inputs,
            args.backend,
            args.ray_address,
            progress=not args.quiet,
        )
        frame = pd.DataFrame(rows)
        save_rows(frame, args.output)
        if args.no_summary:
            return 0
        slo_text = " ".join(str(c) for c in search.slos)
        print(
            f"steady-state capacity at {slo_text}, attainment >= {args.attainment:.0%}, "
            f"tolerance {args.tolerance:.0%}, probes of {frame['horizon_s'].max():.0f} "
            "simulated s (first 20% and last 10% not measured):"
        )
        print(frame.drop(columns=["probes", "horizon_s"]).to_string(index=False))
    return 0


def _capacity_points(
    args: argparse.Namespace,
) -> tuple[list[GridPoint], GridInputs, int | None]:
    """The configurations to search, their inputs (the whole workload), and the
    fewest requests a probe simulates (``--num-requests`` or the grid's)."""
    if args.grid is not None:
        data, inputs = load_grid(args.grid, whole_trace=True)
        axes = data.get("grid", {})
        points = grid_points(
            data["variants"], None, axes.get("num_replicas", [1]), axes.get("seeds", [0])
        )
        return points, inputs, data.get("base", {}).get("num_requests", args.num_requests)
    inputs = grid_inputs(args, None, whole_trace=True)
    if inputs.replicas and args.pd_ratios:
        raise CliError("--replica-config lists the replicas: drop --pd-ratios")
    layouts = _layouts(args) if not inputs.replicas else [len(inputs.replicas)]
    overrides: dict[str, Any] = {}
    if any(str(x) != "1" for x in layouts):
        overrides = {
            "router": args.router or "round-robin",
            "router_staleness_s": args.router_staleness_s,
        }
    try:
        points = grid_points({args.policy: overrides}, None, layouts, [args.seed])
    except ValueError as err:
        raise CliError(f"--pd-ratios: {err}") from None
    return points, inputs, args.num_requests


def _layouts(args: argparse.Namespace) -> list[int | str]:
    """The replica layouts to search: ``--pd-ratios``, or the one the flags describe.

    Raises:
        CliError: with --pd-ratios and replica counts too.
    """
    counts = (args.num_replicas, args.num_prefill_replicas, args.num_decode_replicas)
    if args.pd_ratios:
        if any(c is not None for c in counts):
            raise CliError("--pd-ratios lists the layouts: drop the replica counts")
        return list(args.pd_ratios)
    if args.num_prefill_replicas is not None or args.num_decode_replicas is not None:
        if args.num_prefill_replicas is None or args.num_decode_replicas is None:
            raise CliError("give both --num-prefill-replicas and --num-decode-replicas")
        return [f"{args.num_prefill_replicas}:{args.num_decode_replicas}"]
    return [args.num_replicas or 1]
