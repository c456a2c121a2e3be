"""``rose-sim capacity --goodput ttft:MS ...``: the highest steady-state request rate
meeting the SLOs, for the flags' configuration or for every (variant, replicas,
seed) of ``--grid GRID.toml`` (the search: :mod:`roseinfer.experiments.capacity`).

Each search says its plan once the fluid estimate is known (probes expected,
requests per probe, an estimate of the wall time) and one line per probe as it
finishes, unless ``--quiet``; with the Ray backend the probes run in workers
and only the table reports them.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
from tqdm.auto import tqdm

from roseinfer.cli.flags import CliError, float_in, friendly_errors, int_in, warn_to
from roseinfer.cli.sim_flags import build_parser
from roseinfer.cli.sweep import add_backend_args, check_output, grid_inputs, load_grid, save_rows
from roseinfer.experiments.capacity import (
    DEFAULT_ATTAINMENT,
    DEFAULT_MIN_DURATION_S,
    DEFAULT_TOLERANCE,
    MAX_DURATION_S,
    MAX_MEASURED_REQUESTS,
    MAX_TOLERANCE,
    MIN_MEASURED_REQUESTS,
    MIN_TOLERANCE,
    CapacitySearch,
    parse_criteria,
    search_point,
)
from roseinfer.experiments.sweep import (
    GridInputs,
    GridPoint,
    check_variants,
    grid_points,
    map_points,
    resolve_backend,
)
from roseinfer.registry import load_registry, warning_sink

PROG = "rose-sim capacity"
NUM_REQUESTS_HELP = (
    "fewest requests a probe simulates (its horizon grows to hold them at the probed rate; "
    "default: none beyond --min-measured-requests). Probes draw from the whole workload: "
    "this is no cut of the trace"
)


def capacity_parser() -> argparse.ArgumentParser:
    """The ``rose-sim capacity`` parser: rose-sim's flags plus the search's."""
    parser = build_parser(num_requests_help=NUM_REQUESTS_HELP)
    parser.prog = PROG
    parser.epilog = None
    parser.description = (
        "Find the highest steady-state request rate meeting the SLOs (bisection on the rate "
        "from a fluid estimate, as Vidur-Search), for the flags' configuration or every "
        "configuration of --grid. --goodput takes METRIC:MS (joint attainment) or "
        "METRIC:pXX:MS (a percentile), METRIC one of ttft, tpot, e2el, queue."
    )
    g = parser.add_argument_group("capacity search")
    g.add_argument("--grid", type=Path, help="search every (variant, replicas, seed) of a grid")
    g.add_argument("--pd-ratios", nargs="+", metavar="P:D|N", help="search each replica layout: "
                   "P:D prefill:decode replicas or N colocated ones, e.g. 2 1:1 (the table adds "
                   "capacity per GPU)")  # fmt: skip
    rate = float_in(0, lo_open=True)
    g.add_argument("--min-rate", type=rate, default=0.01,
                   help="lowest rate probed (req/s; default 0.01)")  # fmt: skip
    g.add_argument("--max-rate", type=rate, default=1e6,
                   help="highest rate probed (req/s; default 1e6)")  # fmt: skip
    g.add_argument("--min-duration-s", type=float_in(0, MAX_DURATION_S, lo_open=True),
                   default=DEFAULT_MIN_DURATION_S, help="shortest probe horizon in simulated "
                   "seconds; a probe runs for max(this, 2 x the largest SLO / --tolerance), at "
                   f"most a simulated day (default {DEFAULT_MIN_DURATION_S:g})")  # fmt: skip
    g.add_argument("--min-measured-requests", type=int_in(1, MAX_MEASURED_REQUESTS),
                   default=MIN_MEASURED_REQUESTS, help="fewest requests a probe measures: the "
                   f"attainment's precision (default {MIN_MEASURED_REQUESTS}: sampling error < "
                   "1 point at 90%%)")  # fmt: skip
    g.add_argument("--tolerance", type=float_in(MIN_TOLERANCE, MAX_TOLERANCE),
                   default=DEFAULT_TOLERANCE, help="stop when the bracket is this fraction of "
                   f"the rate (default {DEFAULT_TOLERANCE})")  # fmt: skip
    g.add_argument("--attainment", type=float_in(0, 1, lo_open=True), default=DEFAULT_ATTAINMENT,
                   help="share of requests that must meet every SLO (default "
                   f"{DEFAULT_ATTAINMENT}, DistServe)")  # fmt: skip
    add_backend_args(parser)
    return parser


def capacity_main(argv: list[str]) -> int:
    """``rose-sim capacity --goodput ttft:MS ...``."""
    args = capacity_parser().parse_args(argv)
    with friendly_errors(PROG), warning_sink(warn_to(PROG)):
        if not args.goodput:
            raise CliError("capacity needs SLOs: --goodput ttft:MS [tpot:MS e2el:MS queue:pXX:MS]")
        check_output(args.output)
        points, inputs, num_requests = _capacity_points(args)
        search = CapacitySearch(
            parse_criteria(args.goodput), args.min_rate, args.max_rate, args.tolerance,
            args.attainment, args.min_duration_s, num_requests or 0, args.min_measured_requests,
        )  # fmt: skip
        say = _say(args)
        rows = map_points(
            lambda p, i: search_point(p, i, search, say), points, inputs, args.backend,
            args.ray_address, progress=not args.quiet,
        )  # fmt: skip
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


def _say(args: argparse.Namespace) -> Callable[[str], None] | None:
    """Progress lines of a search on stderr (above the bar), in this process only:
    none with --quiet or with Ray, whose workers' output is not shown."""
    if args.quiet or resolve_backend(args.backend) != "serial":
        return None

    def say(line: str) -> None:
        tqdm.write(f"{PROG}: {line}", file=sys.stderr)

    return say


def _capacity_points(
    args: argparse.Namespace,
) -> tuple[list[GridPoint], GridInputs, int | None]:
    """The configurations to search, their inputs (the whole workload), and the
    fewest requests a probe simulates (``--num-requests`` or the grid's)."""
    if args.grid is not None:
        data, inputs = load_grid(args.grid, whole_trace=True)
        # a bad variant fails now, naming it, not at its first probe
        check_variants(data["variants"], inputs.base, load_registry())
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
