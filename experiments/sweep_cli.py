"""``rose-sim sweep GRID.toml`` and ``rose-sim capacity``.

A grid file (TOML) has three parts::

    [base]                  # rose-sim flags (dashes or underscores), shared by every point
    workload = "azure-conv-sample"
    num_requests = 400
    model = "llama-3.1-8b"
    device = "h100-sxm"

    [grid]
    request_rates = [2, 4, 8, 16]   # req/s (arrivals re-drawn, vLLM bench semantics)
    num_replicas = [1, 2, 4]
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
    build_workload,
    friendly_errors,
    scheduler_config,
)
from roseinfer.experiments.capacity import (
    DEFAULT_ATTAINMENT,
    DEFAULT_TOLERANCE,
    CapacitySearch,
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
from roseinfer.registry import load_registry

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
    parser.add_argument("--goodput", nargs="+", metavar="METRIC:MS", help="SLOs for goodput")
    parser.add_argument("--quiet", action="store_true", help="no progress bar or table")
    _add_backend_args(parser)
    return parser


def capacity_parser() -> argparse.ArgumentParser:
    """The ``rose-sim capacity`` parser: rose-sim's flags plus the search's."""
    from roseinfer.simulator.cli import build_parser

    parser = build_parser()
    parser.prog = "rose-sim capacity"
    parser.description = (
        "Find the highest request rate whose goodput meets the SLOs (binary search on "
        "rate, as Vidur-Search), for the flags' configuration or every configuration of --grid."
    )
    g = parser.add_argument_group("capacity search")
    g.add_argument("--grid", type=Path, help="search every (variant, replicas, seed) of a grid")
    g.add_argument("--min-rate", type=float, default=0.25, help="first rate probed (req/s)")
    g.add_argument("--max-rate", type=float, default=256.0, help="highest rate probed (req/s)")
    g.add_argument(
        "--tolerance",
        type=float,
        default=DEFAULT_TOLERANCE,
        help=f"stop when the bracket is this fraction of the rate (default {DEFAULT_TOLERANCE})",
    )
    g.add_argument(
        "--attainment",
        type=float,
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


def grid_inputs(args: argparse.Namespace, goodput: dict[str, float] | None) -> GridInputs:
    """Requests, base config and cost model from rose-sim flags."""
    from roseinfer.simulator.cli import _profile_setup, _roofline_setup

    registry = load_registry()
    requests, _ = build_workload(args)
    setup = _profile_setup(args) if args.cost_model is not None else _roofline_setup(args)
    config = scheduler_config(
        args, registry, num_kv_blocks=setup.num_kv_blocks, max_model_len=setup.max_model_len
    )
    return GridInputs(requests, config, setup.cost_model, args.burstiness, goodput)


def load_grid(path: Path, goodput: dict[str, float] | None = None) -> tuple[dict, GridInputs]:
    """A grid file's tables and the inputs its ``[base]`` flags describe.

    Raises:
        CliError: on a bad grid file or flag.
    """
    from roseinfer.simulator.cli import build_parser

    data = read_grid(path)
    args = build_parser().parse_args(base_argv(data.get("base", {}), path.parent))
    return data, grid_inputs(args, goodput)


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
    with friendly_errors("rose-sim sweep"):
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
        )
        output = args.output or args.grid.with_suffix(".parquet")
        save_rows(frame, output)
        if not args.quiet:
            cols = ["variant", "router", "num_replicas", "request_rate", "p99_ttft_ms"]
            print(frame[cols + ["p99_tpot_ms", "request_throughput"]].round(2).to_string())
            print(f"{len(frame)} points -> {output}")
    return 0


def capacity_main(argv: list[str]) -> int:
    """``rose-sim capacity --goodput ttft:MS ...``."""
    args = capacity_parser().parse_args(argv)
    with friendly_errors("rose-sim capacity"):
        if not args.goodput:
            raise CliError("capacity needs SLOs: --goodput ttft:MS [tpot:MS e2el:MS]")
        slos = parse_goodput(args.goodput)
        search = CapacitySearch(slos, args.min_rate, args.max_rate, args.tolerance, args.attainment)
        points, inputs = _capacity_points(args, slos)
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
        slo_text = " ".join(args.goodput)
        print(
            f"capacity at {slo_text}, attainment >= {args.attainment:.0%}, tolerance {args.tolerance:.0%}:"
        )
        print(frame.drop(columns=["probes"]).to_string(index=False))
    return 0


def _capacity_points(
    args: argparse.Namespace, slos: dict[str, float]
) -> tuple[list[GridPoint], GridInputs]:
    if args.grid is not None:
        data, inputs = load_grid(args.grid, slos)
        axes = data.get("grid", {})
        points = grid_points(
            data["variants"], None, axes.get("num_replicas", [1]), axes.get("seeds", [0])
        )
        return points, inputs
    inputs = grid_inputs(args, slos)
    overrides: dict[str, Any] = {}
    if (args.num_replicas or 1) > 1:
        overrides = {
            "router": args.router or "round-robin",
            "router_staleness_s": args.router_staleness_s,
        }
    label = args.policy
    return [GridPoint(0, label, overrides, None, args.num_replicas or 1, args.seed)], inputs
