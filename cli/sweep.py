"""``rose-sim sweep GRID.toml``: simulate every point of a grid into one table.

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

Every point runs serially or as a Ray task (``--backend``; ``auto``: Ray when
installed, said on stderr) and the rows are saved as Parquet. ``rose-sim
capacity --grid`` reads the same file (:mod:`roseinfer.cli.capacity`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import pandas as pd

from roseinfer.cli.cluster import kv_transfer_link, replica_specs
from roseinfer.cli.config import check_engine_args, check_output_paths
from roseinfer.cli.flags import (
    ArgumentParser,
    CliError,
    add_flag,
    add_quiet_args,
    check_aliases,
    friendly_errors,
    warn_to,
)
from roseinfer.cli.sim_flags import build_parser, kv_pool, run_config, setup_of
from roseinfer.cli.workload import build_workload, burstiness_of, fit_workload
from roseinfer.experiments.sweep import BACKENDS, GridInputs, run_grid
from roseinfer.metrics import parse_goodput
from roseinfer.registry import load_registry, warning_sink

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

GRID_AXES = {"request_rates", "num_replicas", "seeds"}


def add_backend_args(parser: argparse.ArgumentParser) -> None:
    """``--backend``, ``--ray-address`` and ``--output`` (sweep and capacity)."""
    g = parser.add_argument_group("execution")
    g.add_argument(
        "--backend",
        choices=BACKENDS,
        default="auto",
        help="run points serially or as Ray tasks (default auto: Ray when installed; the "
        "backend chosen is said on stderr)",
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
    add_backend_args(parser)
    return parser


def read_grid(path: Path) -> dict[str, Any]:
    """The grid file's ``base``, ``grid`` and ``variants`` tables.

    Raises:
        CliError: if it cannot be read or has unknown sections or axes.
    """
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as err:
        raise CliError(f"cannot read grid {path}: {str(err)[:200]}") from None
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
    ``--num-requests`` (a capacity search draws from the whole mix).

    Raises:
        CliError: on a bad flag.
    """
    if whole_trace:
        args = argparse.Namespace(**{**vars(args), "num_requests": None})
    registry = load_registry()
    check_aliases(args)
    options = check_engine_args(args, registry)
    requests, _ = build_workload(args)
    setup = setup_of(args)
    max_model_len = args.max_model_len or setup.max_model_len
    requests, _ = fit_workload(args, requests, max_model_len, default=setup.fit_lengths)
    config = run_config(args, registry, options, setup)
    replicas: tuple = ()
    if args.replica_config is not None:
        replicas = tuple(replica_specs(args, config, setup, kv_pool(args)))
    return GridInputs(
        requests, config, setup.cost_model, burstiness_of(args), goodput,
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
    data = read_grid(path)
    args = build_parser().parse_args(base_argv(data.get("base", {}), path.parent))
    return data, grid_inputs(args, goodput, whole_trace=whole_trace)


def save_rows(frame: pd.DataFrame, path: Path | None) -> None:
    """Write the rows as Parquet (pyarrow) or CSV, by extension (its folder must exist:
    :func:`check_output` runs before the sweep)."""
    if path is None:
        return
    if path.suffix == ".parquet":
        frame.to_parquet(path, index=False)
    else:
        frame.to_csv(path, index=False)


def check_output(path: Path | None) -> None:
    """``--output``: a .parquet or .csv file a sweep can write, in a folder that exists.

    Raises:
        CliError: naming the fix.
    """
    check_output_paths(argparse.Namespace(output=path), ("output",))
    if path is not None and path.suffix not in (".parquet", ".csv"):
        raise CliError(f"--output needs a .parquet or .csv name, got {path.name!r}")


def sweep_main(argv: list[str]) -> int:
    """``rose-sim sweep GRID.toml``."""
    args = sweep_parser().parse_args(argv)
    with friendly_errors("rose-sim sweep"), warning_sink(warn_to("rose-sim sweep")):
        goodput = parse_goodput(args.goodput) if args.goodput else None
        output = args.output or args.grid.with_suffix(".parquet")
        check_output(output)
        data, inputs = load_grid(args.grid, goodput)
        axes = data.get("grid", {})
        frame = run_grid(
            inputs.requests, base=inputs.base, cost_model=inputs.cost_model,
            variants=data["variants"], request_rates=axes.get("request_rates"),
            num_replicas=axes.get("num_replicas", [1]), seeds=axes.get("seeds", [0]),
            burstiness=inputs.burstiness, goodput=goodput, backend=args.backend,
            ray_address=args.ray_address, progress=not args.quiet,
            kv_bytes_per_token=inputs.kv_bytes_per_token,
            kv_transfer_link=inputs.kv_transfer_link,
            num_gpus_per_replica=inputs.num_gpus_per_replica,
        )  # fmt: skip
        save_rows(frame, output)
        if not args.no_summary:
            cols = ["variant", "router", "replicas", "request_rate", "p99_ttft_ms"]
            print(frame[cols + ["p99_tpot_ms", "request_throughput"]].round(2).to_string())
            print(f"{len(frame)} points -> {output}")
    return 0
