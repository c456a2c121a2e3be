"""The flag groups of a run: workload, policy, scheduler and KV cache, output.

``rose-sim`` and ``rose-run`` take all of them (:func:`add_common_args`), so a
policy tried in the simulator runs for real by changing the command name;
``rose-serve`` takes the policy and scheduler groups (:func:`add_engine_args`).
Names are vLLM's where the concept is the same, the seeds' where it differs.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from roseinfer import workloads
from roseinfer.cli.flags import POSITIVE, add_flag, add_quiet_args, clip, float_in, parser_registry
from roseinfer.config import PREFIX_CACHING_HASH_ALGOS
from roseinfer.kv_tiers import MAX_CAPACITY_GIB, PCIE5_X16_BYTES_PER_S, KVTierError, tier_from_gib
from roseinfer.policy_args import (
    ADMISSION_FLAGS,
    POLICY_FLAGS,
    add_flags,
    add_plugin_option_flags,
)
from roseinfer.registry import Registry

WORKLOADS = (
    "azure-conv-sample",
    "synthetic",
    "two-tenant",
    *(f"seed-{n}" for n in workloads.SEED_WORKLOADS),
)


NUM_REQUESTS_HELP = "use the first N requests"


def add_common_args(
    parser: argparse.ArgumentParser,
    registry: Registry | None = None,
    *,
    num_requests_help: str = NUM_REQUESTS_HELP,
) -> None:
    """Add the workload, policy, scheduler and output flags to ``parser``, and one
    flag per typed option a registered plugin declares (``option_specs``);
    ``num_requests_help`` says what ``--num-requests`` means to the command."""
    add_workload_args(parser.add_argument_group("workload"), num_requests_help)
    add_engine_args(parser, registry)
    add_output_args(parser.add_argument_group("output"))
    add_quiet_args(parser)


def add_engine_args(parser: argparse.ArgumentParser, registry: Registry | None = None) -> None:
    """Add the policy flags, one flag per typed option a registered plugin declares,
    and the scheduler and KV cache flags (all a server takes of a run's flags)."""
    g = parser.add_argument_group("policy")
    add_flags(g, POLICY_FLAGS)
    g.add_argument(
        "--list-policies", action="store_true", help="list every registered policy and exit"
    )
    g.add_argument(
        "--strict-options",
        action="store_true",
        help="a knob no plugin of this run reads is an error (default: a warning, so one flag "
        "set can compare policies)",
    )
    add_plugin_option_flags(
        parser.add_argument_group("policy options (declared by the plugins; see --list-policies)"),
        registry if registry is not None else parser_registry(),
    )
    add_scheduler_args(parser.add_argument_group("scheduler and KV cache"))


def add_workload_args(
    g: argparse._ArgumentGroup, num_requests_help: str = NUM_REQUESTS_HELP
) -> None:
    """The trace or built-in workload, its selection and its arrivals."""
    g.add_argument(
        "--trace", type=Path, help="trace file (Azure CSV, Mooncake JSONL, plain CSV/JSONL)"
    )
    g.add_argument(
        "--trace-format",
        default="auto",
        choices=["auto", "azure", "mooncake", "plain"],
        help="trace format (default: detected from content)",
    )
    g.add_argument(
        "--workload",
        choices=WORKLOADS,
        help="built-in workload when no --trace: the embedded Azure conv sample "
        "(default), a seed experiment, 'synthetic' (the knobs below), or 'two-tenant' "
        "(tenants heavy at 20 req/s and light at 2 req/s for 120 s, same lengths)",
    )
    g.add_argument("--num-requests", type=POSITIVE, help=num_requests_help)
    g.add_argument(
        "--start-s", type=float_in(-math.inf), help="skip requests arriving before this time (s)"
    )
    g.add_argument(
        "--end-s", type=float_in(-math.inf), help="drop requests arriving after this time (s)"
    )
    g.add_argument(
        "--request-rate",
        type=float_in(0, lo_open=True, allow_inf=True),
        help="re-draw arrivals at this rate (req/s; 'inf' = all at t=0), as vLLM bench; "
        "default: keep the trace's times",
    )
    g.add_argument(
        "--burstiness",
        type=float_in(0, lo_open=True),
        help="gamma shape of inter-arrival gaps with --request-rate (default 1 = Poisson), "
        "as vLLM bench",
    )
    add_flag(g, "--seed")
    _add_synthetic_args(g)


def _add_synthetic_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--prompt-tokens", type=POSITIVE, help="synthetic: base prompt length in tokens")
    g.add_argument(
        "--prompt-repeats",
        help="synthetic: comma-separated repeat counts of the base prompt, cycled per "
        "request (seed 031: '1,1,1,64')",
    )
    g.add_argument("--output-tokens", type=POSITIVE, help="synthetic: output tokens per request")
    g.add_argument(
        "--submit-interval-ms", type=float_in(0), help="synthetic: gap between arrivals (ms)"
    )
    g.add_argument(
        "--unique-prompts",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="synthetic: a distinct suffix per prompt (no prefix-cache hits across requests)",
    )
    g.add_argument(
        "--fit-lengths",
        choices=[*workloads.FIT_MODES, "off"],
        help="requests longer than --max-model-len: clip each, or scale all by one factor; "
        "'off' (default) rejects them, as vLLM does, in rose-sim and rose-run alike (no token "
        "id is made up for them); rose-sim with a --cost-model file defaults to what its run did",
    )


def add_scheduler_args(g: argparse._ArgumentGroup) -> None:
    """The scheduler limits, chunked prefill, the KV pool and its tiers."""
    add_flags(g, ADMISSION_FLAGS)
    add_flag(g, "--max-num-seqs")
    add_flag(g, "--max-num-batched-tokens")
    g.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="cut a prefill that does not fit a step into chunks (default off; on in the "
        "vllm-v1 and sglang presets)",
    )
    g.add_argument(
        "--long-prefill-token-threshold",
        type=POSITIVE,
        help="cap on one request's prefill chunk per step (chunked prefill; default none)",
    )
    g.add_argument(
        "--max-num-partial-prefills",
        type=POSITIVE,
        help="most requests with an unfinished prefill at once (chunked prefill; default none)",
    )
    add_flag(g, "--block-size")
    add_flag(g, "--num-kv-blocks")
    add_flag(g, "--kv-cache-memory-gb")
    g.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse KV blocks by hashes of full prompt blocks (default on)",
    )
    g.add_argument(
        "--prefix-caching-hash-algo",
        choices=PREFIX_CACHING_HASH_ALGOS,
        help="hash of a prompt block's token ids for prefix caching: sha256 (collision-"
        "resistant; rose-run's default) or builtin (Python hash(), cheaper; rose-sim's default)",
    )
    add_flag(g, "--max-model-len")
    _add_kv_tier_args(g)


def _add_kv_tier_args(g: argparse._ArgumentGroup) -> None:
    host_gbps = PCIE5_X16_BYTES_PER_S / 1e9
    g.add_argument(
        "--kv-offloading-size",
        type=float_in(0, MAX_CAPACITY_GIB, lo_open=True),
        metavar="GIB",
        help=f"a host-DRAM KV tier of this many GiB below the device, as vLLM's flag: evicted "
        f"cached blocks move there and prefix hits load them back ({host_gbps:g} GB/s each way, "
        "a PCIe 5.0 x16 link; default: no tier)",
    )
    g.add_argument(
        "--kv-tier",
        action="append",
        default=[],
        type=kv_tier_arg,
        metavar="NAME:CAPACITY_GIB:READ_GBPS:WRITE_GBPS",
        help="a KV tier below the device (and below the --kv-offloading-size tier), e.g. "
        "nvme:2000:7:5; repeat for more tiers, in order from fast to slow",
    )
    g.add_argument(
        "--kv-tier-policy",
        help="which block a full KV tier evicts (and stores): lru (default), arc or reuse "
        "(see --list-policies)",
    )
    g.add_argument(
        "--kv-offloading-overlap",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="KV loads from a tier overlap the step's compute (step = max(compute, "
        "transfer), as vLLM's async loads); default off: the transfer stalls the step",
    )


def kv_tier_arg(text: str) -> tuple[str, float, float, float]:
    """argparse ``type`` of ``--kv-tier``: ``NAME:CAPACITY_GIB:READ_GBPS:WRITE_GBPS``."""
    parts = text.split(":")
    if len(parts) != 4:
        raise argparse.ArgumentTypeError(
            f"expected NAME:CAPACITY_GIB:READ_GBPS:WRITE_GBPS, got {clip(text)!r}"
        )
    name = parts[0]
    numbers: list[float] = []
    for what, piece in zip(("capacity (GiB)", "read GB/s", "write GB/s"), parts[1:]):
        try:
            value = float(piece)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value > 0):
            raise argparse.ArgumentTypeError(
                f"tier {clip(name)!r}: {what} must be a finite number > 0, got {clip(piece)!r}"
            )
        numbers.append(value)
    try:  # the name and range rules of KVTierSpec and tier_from_gib
        tier_from_gib(name, numbers[0], numbers[1], numbers[2], 1)
    except KVTierError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return name, numbers[0], numbers[1], numbers[2]


def add_output_args(g: argparse._ArgumentGroup) -> None:
    """The result, records and step-log files, and the goodput SLOs."""
    g.add_argument(
        "--save-result", type=Path, help="write the summary as flat JSON (vLLM bench keys)"
    )
    add_flag(g, "--save-records")
    add_flag(g, "--save-steps")
    add_flag(g, "--goodput")
