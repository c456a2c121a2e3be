"""``rose-sim``'s parser and what its flags price: the cost model setup, the KV
pool and the scheduler config. Shared by ``rose-sim`` (:mod:`roseinfer.cli.sim`)
and its subcommands ``sweep`` and ``capacity``, whose flags are rose-sim's.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from roseinfer.calibration.graph_replay import (
    CUDAGRAPH_MODES,
    DEFAULT_CUDAGRAPH_MODE,
    MIXED_GRAPH_MAX_TOKENS,
    GraphReplay,
)
from roseinfer.calibration.specs import LINKS, MODELS, summarize_devices
from roseinfer.cli.cluster import add_cluster_args
from roseinfer.cli.config import scheduler_config, scheduler_knobs
from roseinfer.cli.flags import ArgumentParser, CliError, DeprecatedAlias, add_flag, int_in
from roseinfer.cli.groups import NUM_REQUESTS_HELP, add_common_args
from roseinfer.config import SchedulerConfig
from roseinfer.interface import PolicyOptions
from roseinfer.registry import Registry
from roseinfer.simulator.setup import (
    DEFAULT_HARDWARE,
    DEFAULT_MODEL,
    KVPool,
    SimSetup,
    calibrated_setup,
    roofline_setup,
)


def build_parser(num_requests_help: str = NUM_REQUESTS_HELP) -> argparse.ArgumentParser:
    """The ``rose-sim`` argument parser (``num_requests_help``: what ``--num-requests``
    means; ``rose-sim capacity`` reads it as a probe's size)."""
    parser = ArgumentParser(
        prog="rose-sim",
        description="Simulate an LLM-serving scheduling policy on a workload with a cost "
        "model (default: the embedded Azure conv trace sample, Llama-3.1-8B on one H100).",
        epilog="subcommands (each has its own --help): `rose-sim sweep GRID.toml` simulates "
        "every point of a grid (policies x knobs x rates x replicas) into one table; "
        "`rose-sim capacity --goodput METRIC:MS ...` finds the highest steady-state "
        "request rate meeting the SLOs (these flags plus the search's).",
    )
    add_common_args(parser, num_requests_help=num_requests_help)
    _add_cost_model_args(parser.add_argument_group("cost model"))
    add_cluster_args(parser)
    parser.set_defaults(block_size=None)  # None: the profile's, else DEFAULT_BLOCK_SIZE
    # NOTE: nobody crafts colliding prompts in a simulation, and SHA-256 made a 2,000-request
    # synthetic run with 1,024-token prompts 1.45-1.59x slower (benchmarks/input_costs.py).
    parser.set_defaults(prefix_caching_hash_algo="builtin")
    return parser


def _add_cost_model_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--model",
        help=f"model shape (default {DEFAULT_MODEL}, or the profiled model with "
        f"--cost-model): a built-in name ({', '.join(sorted(MODELS))}) or a transformers "
        "config.json",
    )
    g.add_argument("--hardware", dest="device", metavar="SPEC", help="simulated hardware, one "
                   f"GPU's spec (default {DEFAULT_HARDWARE}), and what its constants stand on: "
                   f"{summarize_devices().replace('%', '%%')}")  # fmt: skip  # NOTE: argparse formats %
    g.add_argument("--device", dest="device", action=DeprecatedAlias, new="--hardware",
                   metavar="SPEC", help="deprecated name of --hardware, kept for this release "
                   "(rose-run's --device is the torch device)")  # fmt: skip
    g.add_argument(
        "--cost-model",
        type=Path,
        nargs="+",
        action="extend",
        metavar="FILE",
        help="price steps with a calibration: a profile from `rose-run profile` (PROFILE.json) "
        "and/or step logs of real runs (`--save-steps FILE.jsonl`; several are pooled and "
        "fitted together). Its fitted step times price the calibrated model, its calibrated "
        "roofline another --model; the calibrated KV pool, block size, max model length and "
        "--fit-lengths become the defaults",
    )
    g.add_argument("--tensor-parallel-size", "-tp", type=int_in(1, 1024), default=1,
                   help="GPUs a replica's layers are sharded over, as vLLM (default 1): weights "
                   "and KV split, two all-reduces per layer over --interconnect")  # fmt: skip
    g.add_argument("--pipeline-parallel-size", "-pp", type=int_in(1, 1024), default=1,
                   help="pipeline stages a replica's layers are split into, as vLLM (default "
                   "1): weights and KV split, one activation handoff per stage")  # fmt: skip
    g.add_argument("--interconnect", choices=sorted(LINKS), help="link between a replica's "
                   "GPUs (default: the device's: NVLink on A100/H100/H200); bandwidths and "
                   "sources in calibration/specs.py")  # fmt: skip
    add_flag(g, "--gpu-memory-utilization")
    add_flag(
        g,
        "--cudagraph-mode",
        default=None,
        help=f"which steps of the priced rose-run replay CUDA graphs ({', '.join(CUDAGRAPH_MODES)}"
        f", rose-run's flag): FULL_DECODE_ONLY decode batches; FULL also passes of up to "
        f"{MIXED_GRAPH_MAX_TOKENS} new tokens. The others launch from the host: a measured "
        "spec's launch roof and --step-jitter apply to them. Default: the calibration's "
        "with --cost-model (which must be the mode it names), else rose-run's default, "
        f"{DEFAULT_CUDAGRAPH_MODE}",
    )
    g.add_argument(
        "--step-jitter",
        choices=("profile", "measured", "off"),
        default="profile",
        help="multiply each simulated step's median time by a ratio drawn from measured "
        "repetitions, seeded (a run is reproducible), so means and tails include the "
        "executor's step-to-step spread. 'profile' (default): with --cost-model PROFILE, the "
        "profile's own (eager steps and CUDA-graph decodes apart); rooflines price medians. "
        "'measured': that, and with a measured --hardware spec (h100-sxm) its fitted "
        "profiles' eager steps (steps replayed from graphs, by --cudagraph-mode, at their "
        "roofline time). 'off': every step at its median. Step logs and unmeasured specs "
        "carry no repetitions",
    )
    g.add_argument(
        "--no-jump",
        action="store_true",
        help="plan every decode step alone (slower; same result, for checking)",
    )


def kv_pool(args: argparse.Namespace) -> KVPool:
    """How the flags size the simulated KV pool."""
    return KVPool(
        args.block_size, args.kv_cache_memory_gb, args.gpu_memory_utilization, args.num_kv_blocks
    )


def setup_of(args: argparse.Namespace) -> SimSetup:
    """What prices the run: the ``--cost-model`` calibration, else the roofline of
    ``--model`` on ``--hardware``.

    Raises:
        CliError: for flags a calibration cannot honour (it is the device).
        SetupError: on a bad spec, file or layout.
    """
    if args.cost_model is None:
        graphs = GraphReplay.of_mode(args.cudagraph_mode or DEFAULT_CUDAGRAPH_MODE)
        return roofline_setup(
            args.model, args.device, kv_pool(args), args.tensor_parallel_size,
            args.pipeline_parallel_size, args.interconnect,
            step_jitter=args.step_jitter == "measured", graphs=graphs,
        )  # fmt: skip
    if args.device is not None:
        raise CliError("--cost-model prices the profiled device; drop --hardware")
    if args.tensor_parallel_size > 1 or args.pipeline_parallel_size > 1 or args.interconnect:
        raise CliError(
            "--cost-model prices what was measured on one device; drop "
            "--tensor-parallel-size/--pipeline-parallel-size/--interconnect (or price a "
            "parallel replica with the roofline: --model and --hardware)"
        )
    max_num_seqs = scheduler_knobs(args)["max_num_seqs"]
    return calibrated_setup(
        args.cost_model, args.model, kv_pool(args), max_num_seqs, args.max_model_len,
        step_jitter=args.step_jitter != "off", cudagraph_mode=args.cudagraph_mode,
    )  # fmt: skip


def run_config(
    args: argparse.Namespace, registry: Registry, options: PolicyOptions, setup: SimSetup
) -> SchedulerConfig:
    """The run's scheduler config on ``setup``'s defaults."""
    return scheduler_config(
        args, registry, options, num_kv_blocks=setup.num_kv_blocks,
        max_model_len=setup.max_model_len, kv_bytes_per_token=setup.model.kv_bytes_per_token,
        block_size=setup.block_size,
    )  # fmt: skip
