"""Command-line options shared by ``rose-sim`` and ``rose-run``.

Both front ends take the same workload, policy, scheduler and output flags
(vLLM's names where the concept is the same; the seeds' names where it
differs), so a policy tried in the simulator runs for real by changing the
command name. Bad input ends with one ``error:`` line, never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn

import pandas as pd

from roseinfer import workloads
from roseinfer.config import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_MAX_NUM_SEQS,
    PREFIX_CACHING_HASH_ALGOS,
    SCHEDULER_PRESETS,
    SchedulerConfig,
)
from roseinfer.interface import PolicyError, PolicyOptions
from roseinfer.kv_tiers import (
    HOST_TIER_NAME,
    MAX_CAPACITY_GIB,
    PCIE5_X16_BYTES_PER_S,
    KVTierConfig,
    KVTierError,
    tier_from_gib,
)
from roseinfer.metrics import (
    RECORD_SUFFIXES,
    LogHistogram,
    check_output_path,
    fair_share_fairness,
    format_summary,
    parse_goodput,
    per_class,
    per_tenant,
    summarize,
    write_records,
    write_result,
)
from roseinfer.prediction import LENGTH_PREDICTOR_OPTION
from roseinfer.registry import Registry, UnknownPolicyError, load_registry, warning_sink
from roseinfer.request import Request

WORKLOADS = (
    "azure-conv-sample",
    "synthetic",
    "two-tenant",
    *(f"seed-{n}" for n in workloads.SEED_WORKLOADS),
)
MAX_INT_FLAG = 2**31 - 1
"""Largest value of a count flag (tokens, sequences): int32, the index type of tensors."""
MAX_BLOCK_SIZE = 4096
"""Largest ``--block-size``: 8x Mooncake's 512-token blocks; vLLM allows at most 256."""
MAX_NUM_KV_BLOCKS = 2**24
"""Largest KV pool in blocks: the block manager keeps Python lists per block (about
100 B each, so 1.6 GB of host memory here); a larger pool needs a larger block size."""
MAX_SEED = 2**63 - 1
"""Largest ``--seed``: torch and numpy take any non-negative int64."""


class CliError(ValueError):
    """A bad flag or flag combination (message names it and the fix)."""


def int_in(lo: int, hi: int = MAX_INT_FLAG) -> Callable[[str], int]:
    """An argparse ``type``: an integer in ``[lo, hi]`` (the error names the range)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {_clip(text)!r}") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(
                f"must be an integer in [{lo}, {hi}], got {_clip(text)!r}"
            )
        return value

    return parse


def float_in(
    lo: float, hi: float = math.inf, *, lo_open: bool = False, allow_inf: bool = False
) -> Callable[[str], float]:
    """An argparse ``type``: a number in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``),
    never NaN, and infinite only with ``allow_inf`` (the error names the range)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {_clip(text)!r}") from None
        in_range = (lo < value if lo_open else lo <= value) and value <= hi
        if not in_range or (math.isinf(value) and not allow_inf):
            what = _range(lo, hi, lo_open, allow_inf)
            raise argparse.ArgumentTypeError(f"must be {what}, got {_clip(text)!r}")
        return value

    return parse


def _range(lo: float, hi: float, lo_open: bool, allow_inf: bool) -> str:
    if math.isfinite(hi):
        return f"a number in {'(' if lo_open else '['}{lo:g}, {hi:g}]"
    kind = "a number" if allow_inf else "a finite number"
    bound = "" if math.isinf(lo) else f" {'>' if lo_open else '>='} {lo:g}"
    return f"{kind}{bound}{' (or inf)' if allow_inf else ''}"


def _clip(text: str, max_chars: int = 40) -> str:
    return text if len(text) <= max_chars else text[:max_chars] + "..."


clip = _clip
"""``text`` cut to 40 characters (with ``...``), for echoing a user's value in an error."""


POSITIVE = int_in(1)
"""argparse type of a count flag: an integer in [1, 2^31 - 1]."""


DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
"""vLLM's default ``--gpu-memory-utilization``."""

FLAGS: dict[str, dict[str, Any]] = {
    "--seed": {
        "type": int_in(0, MAX_SEED),
        "default": 0,
        "help": "random seed of the run (default 0): the arrivals --request-rate re-draws, the "
        "synthetic and two-tenant workloads, made-up token ids, routers that draw; rose-run, "
        "rose-serve and rose-run profile: also the random weights of a built-in model, and the "
        "sampling of each request without a seed of its own (profile: its shape grid and split)",
    },
    "--gpu-memory-utilization": {
        "type": float_in(0, 1, lo_open=True),
        "default": DEFAULT_GPU_MEMORY_UTILIZATION,
        "help": "share of the device's total memory for the weights, activations and the KV "
        "pool, as vLLM: the default KV pool is what is left of it after the weights (default "
        f"{DEFAULT_GPU_MEMORY_UTILIZATION:g}). rose-run on CPU: a 1 GiB pool unless "
        "--kv-cache-memory-gb or --num-kv-blocks",
    },
    "--max-num-seqs": {
        "type": POSITIVE,
        "help": f"running-set cap = decode batch (default {DEFAULT_MAX_NUM_SEQS}, as vLLM)",
    },
    "--max-num-batched-tokens": {
        "type": POSITIVE,
        "help": "tokens computed per step, decodes included, as vLLM (default: no limit)",
    },
    "--block-size": {
        "type": int_in(1, MAX_BLOCK_SIZE),
        "default": DEFAULT_BLOCK_SIZE,
        "help": f"tokens per KV block (default {DEFAULT_BLOCK_SIZE})",
    },
    "--num-kv-blocks": {
        "type": int_in(1, MAX_NUM_KV_BLOCKS),
        "help": "KV blocks in the pool (default: from memory)",
    },
    "--kv-cache-memory-gb": {
        "type": float_in(0, lo_open=True),
        "help": "KV pool size in GiB (alternative to --num-kv-blocks)",
    },
    "--max-model-len": {
        "type": POSITIVE,
        "help": "longest request in tokens (default: the model's)",
    },
    "--save-records": {
        "type": Path,
        "help": "write per-request records (.csv or .parquet)",
    },
    "--save-steps": {
        "type": Path,
        "metavar": "FILE.jsonl",
        "help": "write every executed step (start, end, shape) as a step log (JSON lines; "
        "`rose-sim --cost-model FILE.jsonl` calibrates from it)",
    },
    "--goodput": {
        "nargs": "+",
        "metavar": "METRIC:MS",
        "help": "SLOs for goodput, e.g. ttft:200 tpot:50 e2el:2000",
    },
}
"""Every flag more than one command takes, defined once: its type, range and default.
A command adds one with :func:`add_flag` and may override only its help or default
(``rose-run profile``'s ``--max-num-seqs`` has a default; ``rose-serve``'s records are
appended while it serves)."""


def add_flag(g: argparse._ActionsContainer, flag: str, **overrides: Any) -> None:
    """Add the shared ``flag`` (:data:`FLAGS`) to ``g``; ``overrides`` may change its
    ``help`` or ``default`` only (its type and range stay one definition).

    Raises:
        KeyError: for a flag not in :data:`FLAGS`.
        ValueError: when ``overrides`` touches anything but help and default.
    """
    if set(overrides) - {"help", "default"}:
        raise ValueError(f"{flag}: a shared flag may override help and default only")
    g.add_argument(flag, **{**FLAGS[flag], **overrides})


class ArgumentParser(argparse.ArgumentParser):
    """argparse with the project's error contract: one ``prog: error: ...`` line on
    stderr and exit code 2 (no usage block; ``--help`` shows it)."""

    def error(self, message: str) -> NoReturn:
        """Print ``message`` as one line and exit with status 2."""
        _die(self.prog, f"{message} (see {self.prog} --help)")


def add_common_args(parser: argparse.ArgumentParser, registry: Registry | None = None) -> None:
    """Add the workload, policy, scheduler and output flags to ``parser``, and one
    flag per typed option a registered plugin declares (``option_specs``)."""
    _add_workload_args(parser.add_argument_group("workload"))
    _add_policy_args(parser.add_argument_group("policy"))
    _add_plugin_option_args(
        parser.add_argument_group("policy options (declared by the plugins; see --list-policies)"),
        registry if registry is not None else _parser_registry(),
    )
    _add_scheduler_args(parser.add_argument_group("scheduler and KV cache"))
    _add_output_args(parser.add_argument_group("output"))
    add_quiet_args(parser)


def add_engine_args(parser: argparse.ArgumentParser, registry: Registry | None = None) -> None:
    """Add only the policy flags, one flag per typed option a registered plugin
    declares, and the scheduler flags (a server: no workload, no summary)."""
    _add_policy_args(parser.add_argument_group("policy"))
    _add_plugin_option_args(
        parser.add_argument_group("policy options (declared by the plugins; see --list-policies)"),
        registry if registry is not None else _parser_registry(),
    )
    _add_scheduler_args(parser.add_argument_group("scheduler and KV cache"))


def _parser_registry() -> Registry:
    """The plugins whose options become flags, loaded quietly: :func:`run_main`
    loads them again and reports a broken plugin once, as ``prog: warning:``
    (a warning here too printed every one twice)."""
    return load_registry(warn=lambda message: None)


def _add_workload_args(g: argparse._ArgumentGroup) -> None:
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
    g.add_argument("--num-requests", type=POSITIVE, help="use the first N requests")
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
        default=1.0,
        help="gamma shape of inter-arrival gaps with --request-rate (default 1 = Poisson), as vLLM bench",
    )
    add_flag(g, "--seed")
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
        "'off' rejects them (default: clip in rose-run; in rose-sim what the --cost-model "
        "file's run did, else off)",
    )


def _add_policy_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--policy", default="fifo", help="admission policy (default fifo; see --list-policies)"
    )
    g.add_argument(
        "--loop-order",
        help="loop ordering: prefill-first (default), decode-first, mixed, prefill-priority",
    )
    g.add_argument(
        "--policy-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a knob a plugin declares, as KEY=VALUE (repeatable; an unknown key is an error)",
    )
    g.add_argument(
        "--list-policies", action="store_true", help="list every registered policy and exit"
    )


def _add_plugin_option_args(g: argparse._ArgumentGroup, registry: Registry) -> None:
    for spec in registry.all_option_specs().values():
        choices = f" ({', '.join(map(str, spec.choices))})" if spec.choices else ""
        kwargs: dict[str, Any] = {"dest": spec.name, "default": None, "help": spec.help + choices}
        if spec.type is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["metavar"] = spec.type.__name__.upper()
        # a name that clashes with a built-in flag stays reachable through --policy-arg
        with contextlib.suppress(argparse.ArgumentError):
            g.add_argument(spec.flag, **kwargs)


def _add_scheduler_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--scheduler-preset",
        choices=sorted(SCHEDULER_PRESETS),
        help="an engine's scheduler defaults (loop order, chunked prefill, token and seat "
        "limits): vllm-v1, sglang or seeds (default); explicit flags win",
    )
    g.add_argument(
        "--prefill-max-tokens",
        type=POSITIVE,
        help="prompt tokens prefilled per step, running chunks first (the seeds' token "
        "budget; admission honours it with budget/pack)",
    )
    g.add_argument(
        "--prefill-max-seqs",
        type=POSITIVE,
        help="requests admitted per step (default: --max-num-seqs)",
    )
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
        type=_kv_tier_arg,
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


def _kv_tier_arg(text: str) -> tuple[str, float, float, float]:
    """argparse ``type`` of ``--kv-tier``: ``NAME:CAPACITY_GIB:READ_GBPS:WRITE_GBPS``."""
    parts = text.split(":")
    if len(parts) != 4:
        raise argparse.ArgumentTypeError(
            f"expected NAME:CAPACITY_GIB:READ_GBPS:WRITE_GBPS, got {_clip(text)!r}"
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
                f"tier {_clip(name)!r}: {what} must be a finite number > 0, got {_clip(piece)!r}"
            )
        numbers.append(value)
    try:  # the name and range rules of KVTierSpec and tier_from_gib
        tier_from_gib(name, numbers[0], numbers[1], numbers[2], 1)
    except KVTierError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return name, numbers[0], numbers[1], numbers[2]


def wants_kv_tiers(args: argparse.Namespace) -> bool:
    """True when the flags configure KV tiers; checks the tier flags that need no model.

    Raises:
        CliError: on tier knobs without a tier, tiers without prefix caching, or a
            tier name given twice.
    """
    tiers = getattr(args, "kv_tier", None) or []
    wants = getattr(args, "kv_offloading_size", None) is not None or bool(tiers)
    if not wants:
        for flag, value in (
            ("--kv-tier-policy", getattr(args, "kv_tier_policy", None)),
            ("--kv-offloading-overlap", getattr(args, "kv_offloading_overlap", None)),
        ):
            if value is not None:
                raise CliError(f"{flag} needs a tier: add --kv-offloading-size GIB or --kv-tier")
        return False
    if not args.enable_prefix_caching:
        raise CliError(
            "KV tiers (--kv-offloading-size, --kv-tier) move cached blocks by hash: drop "
            "--no-enable-prefix-caching"
        )
    names = ([HOST_TIER_NAME] if args.kv_offloading_size is not None else []) + [
        t[0] for t in tiers
    ]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise CliError(
            f"KV tier name {repeated[0]!r} given twice (--kv-offloading-size is tier "
            f"{HOST_TIER_NAME!r}); give each --kv-tier its own name"
        )
    return True


def kv_tier_config(
    args: argparse.Namespace, registry: Registry, kv_bytes_per_token: int | None, block_size: int
) -> KVTierConfig | None:
    """The KV tiers the flags describe (None without tier flags): the
    ``--kv-offloading-size`` host tier first, then each ``--kv-tier`` in order;
    capacities in blocks of ``kv_bytes_per_token * block_size`` bytes.

    Raises:
        CliError: on a bad combination, a capacity below one block, or a front end
            that cannot size blocks (``kv_bytes_per_token`` None).
        UnknownPolicyError: for an unknown ``--kv-tier-policy``.
    """
    if not wants_kv_tiers(args):
        return None
    policy = registry.kv_tier_policy(args.kv_tier_policy or "lru")
    if kv_bytes_per_token is None:
        raise CliError("this command cannot size KV tiers (no model KV size); drop the tier flags")
    block_bytes = kv_bytes_per_token * block_size
    host = PCIE5_X16_BYTES_PER_S / 1e9
    raw = (
        [(HOST_TIER_NAME, args.kv_offloading_size, host, host)]
        if args.kv_offloading_size is not None
        else []
    )
    specs = []
    for i, (name, capacity_gib, read_gbps, write_gbps) in enumerate([*raw, *args.kv_tier]):
        try:
            specs.append(tier_from_gib(name, capacity_gib, read_gbps, write_gbps, block_bytes))
        except KVTierError as err:
            flag = "--kv-offloading-size" if raw and i == 0 else "--kv-tier"
            raise CliError(f"{flag}: {err}") from None
    return KVTierConfig(
        tuple(specs), block_bytes, policy=policy, overlap=bool(args.kv_offloading_overlap)
    )


def _add_output_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--save-result", type=Path, help="write the summary as flat JSON (vLLM bench keys)"
    )
    add_flag(g, "--save-records")
    add_flag(g, "--save-steps")
    add_flag(g, "--goodput")


def add_quiet_args(parser: argparse.ArgumentParser, *, summary: bool = True) -> None:
    """``--quiet`` (alias ``--no-progress``): no progress bar, in every command;
    with ``summary``, ``--no-summary``: no summary table. They are independent:
    ``--quiet`` alone still prints the summary."""
    g = parser.add_argument_group("terminal output")
    g.add_argument(
        "--quiet",
        "--no-progress",
        dest="quiet",
        action="store_true",
        help="no progress bar (the summary still prints; --no-progress is the same flag)",
    )
    if summary:
        g.add_argument(
            "--no-summary",
            action="store_true",
            help="print no summary table (the files asked for are still written)",
        )


class DeprecatedAlias(argparse.Action):
    """An old flag name kept for one release: stores into the new flag's ``dest``
    and prints ``prog: warning: OLD is deprecated; use NEW`` once per parse."""

    def __init__(self, option_strings: list[str], dest: str, *, new: str, **kwargs: Any) -> None:
        self.new = new
        super().__init__(option_strings, dest, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        print(
            f"{parser.prog}: warning: {option_string} is deprecated here and goes in the next "
            f"release; use {self.new}",
            file=sys.stderr,
        )
        setattr(namespace, self.dest, values)


# ----------------------------------------------------------------- workload
def fit_workload(
    args: argparse.Namespace, requests: list[Request], max_model_len: int, default: str
) -> tuple[list[Request], str]:
    """Apply ``--fit-lengths`` (``default`` when not given) to ``requests``.

    Both backends fit a workload with this one rule, so the same flags replay
    the same requests in rose-sim and rose-run.

    Returns:
        The requests and a note for the result file (``fit_lengths``).
    """
    mode = args.fit_lengths or default
    if mode == "off":
        return requests, "off"
    fitted, note = workloads.fit_lengths(requests, max_model_len, mode=mode)
    return fitted, note


def build_workload(args: argparse.Namespace) -> tuple[list[Request], str]:
    """The requests the flags describe, and a one-line description.

    Raises:
        CliError: on contradictory or invalid workload flags.
        workloads.WorkloadError: on a bad trace file.
    """
    _check_workload_flags(args)
    if args.trace is not None:
        reqs = workloads.load_trace(args.trace, args.trace_format)
        name = str(args.trace)
    elif args.workload in (None, "azure-conv-sample"):
        reqs, name = workloads.load_default_trace(), workloads.DEFAULT_TRACE_NAME
    elif args.workload == "two-tenant":
        reqs, name = workloads.two_tenant(seed=args.seed), args.workload
    else:
        reqs, name = _synthetic(args), args.workload
    reqs = workloads.select(
        reqs, num_requests=args.num_requests, start_s=args.start_s, end_s=args.end_s
    )
    if args.request_rate is not None:
        reqs = workloads.rescale_arrivals(
            reqs, request_rate=args.request_rate, burstiness=args.burstiness, seed=args.seed
        )
        name += f" @ {args.request_rate} req/s (burstiness {args.burstiness})"
    if not reqs:
        raise CliError("the workload selection is empty; check --num-requests/--start-s/--end-s")
    return reqs, name


def _synthetic(args: argparse.Namespace) -> list[Request]:
    overrides: dict[str, Any] = {}
    if args.prompt_tokens is not None:
        overrides["prompt_tokens"] = args.prompt_tokens
    if args.prompt_repeats is not None:
        overrides["prompt_repeats"] = _parse_repeats(args.prompt_repeats)
    if args.output_tokens is not None:
        overrides["output_tokens"] = args.output_tokens
    if args.submit_interval_ms is not None:
        overrides["submit_interval_s"] = args.submit_interval_ms / 1e3
    if args.unique_prompts is not None:
        overrides["unique_prompts"] = args.unique_prompts
    if args.num_requests is not None:
        overrides["num_requests"] = args.num_requests
    overrides["seed"] = args.seed
    if args.workload == "synthetic":
        return workloads.synthetic(**{"num_requests": 32, "output_tokens": 32, **overrides})
    return workloads.seed_workload(args.workload.removeprefix("seed-"), **overrides)


def _parse_repeats(text: str) -> list[int]:
    try:
        repeats = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise CliError(
            f"--prompt-repeats must be comma-separated integers, got {_clip(text)!r}"
        ) from None
    if not repeats or min(repeats) <= 0 or max(repeats) > MAX_INT_FLAG:
        raise CliError(f"--prompt-repeats needs positive integers, got {_clip(text)!r}")
    return repeats


def _check_workload_flags(args: argparse.Namespace) -> None:
    if args.trace is not None and args.workload is not None:
        raise CliError("give either --trace or --workload, not both")
    synthetic_flags = ("prompt_tokens", "prompt_repeats", "output_tokens", "submit_interval_ms")
    is_synthetic = args.workload not in (None, "azure-conv-sample", "two-tenant")
    for flag in synthetic_flags:
        if getattr(args, flag) is not None and not is_synthetic:
            raise CliError(
                f"--{flag.replace('_', '-')} shapes a synthetic workload; add "
                "--workload synthetic (or a seed-* workload), or drop it"
            )
    if args.start_s is not None and args.end_s is not None and args.start_s >= args.end_s:
        raise CliError(f"--start-s {args.start_s} must be before --end-s {args.end_s}")


# -------------------------------------------------------------- scheduler
SCHEDULER_KNOBS = (
    "loop_order",
    "enable_chunked_prefill",
    "max_num_batched_tokens",
    "max_num_seqs",
    "long_prefill_token_threshold",
    "max_num_partial_prefills",
)


def scheduler_knobs(args: argparse.Namespace) -> dict[str, Any]:
    """Loop order, chunking and limits: ``--scheduler-preset`` (default ``seeds``)
    overridden by every flag given explicitly."""
    knobs: dict[str, Any] = {
        "loop_order": "prefill-first",
        "max_num_seqs": DEFAULT_MAX_NUM_SEQS,
        **SCHEDULER_PRESETS[args.scheduler_preset or "seeds"],
    }
    for name in SCHEDULER_KNOBS:
        value = getattr(args, name)
        if value is not None:
            knobs[name] = value
    return knobs


def policy_options(args: argparse.Namespace, registry: Registry) -> PolicyOptions:
    """Policy knobs from the flags, rejecting knobs the chosen policy ignores.

    Raises:
        CliError: e.g. ``--lookahead`` with a policy that reads no lookahead (a knob
            no plugin of the run declares).
        UnknownPolicyError: listing the known policies.
    """
    policy_cls = registry.policy(args.policy)
    if args.prefill_max_tokens is not None and not policy_cls.uses_token_budget:
        users = [n for n, e in sorted(registry.policies.items()) if e.cls.uses_token_budget]
        raise CliError(
            f"policy {args.policy!r} ignores --prefill-max-tokens; policies with a token "
            f"budget: {', '.join(users)}"
        )
    options = PolicyOptions(_plugin_options(args, registry))
    return _checked_plugin_options(args, registry, options)


def _plugin_options(args: argparse.Namespace, registry: Registry) -> dict[str, Any]:
    """Plugin knobs from their flags, then ``--policy-arg`` (strings, converted later)."""
    extra: dict[str, Any] = {}
    for name in registry.all_option_specs():
        value = getattr(args, name, None)
        if value is not None:
            extra[name] = value
    for item in args.policy_arg:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise CliError(f"--policy-arg takes KEY=VALUE, got {_clip(item)!r}")
        extra[key.strip().replace("-", "_")] = value
    return extra


def _checked_plugin_options(
    args: argparse.Namespace, registry: Registry, options: PolicyOptions
) -> PolicyOptions:
    """``options`` with every plugin knob typed; a knob no plugin of the run reads
    is an error naming the knobs it does read."""
    loop_order = scheduler_knobs(args)["loop_order"]
    run_specs = {s.name: s for s in registry.option_specs(args.policy, loop_order, options)}
    typed: dict[str, Any] = {}
    for key, value in options.values.items():
        spec = run_specs.get(key)
        if spec is None:
            known = ", ".join(sorted(run_specs)) or "none"
            raise CliError(
                f"no plugin of this run reads {_clip(key)!r} (a flag or --policy-arg); "
                f"policy {args.policy!r} with loop order {loop_order!r} reads: {known}"
            )
        try:
            typed[key] = spec.convert(value)
        except ValueError as err:
            raise CliError(str(err)) from None
    return PolicyOptions(typed)


def scheduler_config(
    args: argparse.Namespace,
    registry: Registry,
    *,
    num_kv_blocks: int,
    max_model_len: int,
    kv_bytes_per_token: int | None = None,
) -> SchedulerConfig:
    """The scheduler config from the flags; the backend supplies the defaults
    it derives from memory and the model (``num_kv_blocks``, ``max_model_len``,
    and ``kv_bytes_per_token``, K and V bytes of one token over all layers, which
    turns KV tier capacities into blocks).

    Raises:
        CliError: on a non-positive or contradictory value.
    """
    if args.num_kv_blocks is not None and args.kv_cache_memory_gb is not None:
        raise CliError("give either --num-kv-blocks or --kv-cache-memory-gb, not both")
    options = policy_options(args, registry)
    if args.num_kv_blocks is not None:
        num_kv_blocks = args.num_kv_blocks
    elif num_kv_blocks > MAX_NUM_KV_BLOCKS:
        raise CliError(
            f"the KV memory holds {num_kv_blocks} blocks, more than the {MAX_NUM_KV_BLOCKS} the "
            "block manager indexes; set --num-kv-blocks, a smaller --kv-cache-memory-gb or a "
            "larger --block-size"
        )
    kv_tiers = kv_tier_config(args, registry, kv_bytes_per_token, args.block_size)
    try:
        return SchedulerConfig(
            num_kv_blocks=num_kv_blocks,
            kv_tiers=kv_tiers,
            block_size=args.block_size,
            prefill_max_seqs=args.prefill_max_seqs,
            prefill_max_tokens=args.prefill_max_tokens,
            max_model_len=args.max_model_len if args.max_model_len is not None else max_model_len,
            enable_prefix_caching=args.enable_prefix_caching,
            prefix_caching_hash_algo=args.prefix_caching_hash_algo,
            policy=args.policy,
            options=options,
            **scheduler_knobs(args),
        )
    except ValueError as err:
        raise CliError(str(err)) from None


def config_facts(config: SchedulerConfig) -> dict[str, Any]:
    """The scheduler settings a result file records (flat, JSON-ready)."""
    return {
        "num_kv_blocks": config.num_kv_blocks,
        "block_size": config.block_size,
        "max_num_seqs": config.max_num_seqs,
        "prefill_max_tokens": config.prefill_max_tokens,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "enable_chunked_prefill": config.enable_chunked_prefill,
        "long_prefill_token_threshold": config.long_prefill_token_threshold,
        "max_num_partial_prefills": config.max_num_partial_prefills,
        "loop_order": config.loop_order,
        "max_model_len": config.max_model_len,
        "enable_prefix_caching": config.enable_prefix_caching,
        "prefix_caching_hash_algo": config.prefix_caching_hash_algo,
        **_kv_tier_facts(config),
    }


def policy_facts(config: SchedulerConfig, registry: Registry) -> dict[str, Any]:
    """What a result file records about the policy beyond its label: the knob
    values given (``policy_options``) and, for a length-aware policy, the length
    predictor it ran with (``length_predictor``, the default when none was given)."""
    facts: dict[str, Any] = {"policy_options": dict(config.options.values)}
    if registry.policy(config.policy).uses_length_predictor:
        facts["length_predictor"] = str(
            config.options.get("length_predictor", LENGTH_PREDICTOR_OPTION.default)
        )
    return facts


def _kv_tier_facts(config: SchedulerConfig) -> dict[str, Any]:
    """The tier settings of a result file (none without tiers)."""
    tiers = config.kv_tiers
    if tiers is None:
        return {}
    return {
        "kv_tiers": tiers.describe(),
        "kv_tier_policy": tiers.policy_name,
        "kv_offloading_overlap": tiers.overlap,
        "kv_block_bytes": tiers.block_bytes,
    }


def kv_blocks_from_bytes(
    num_bytes: float,
    kv_bytes_per_token: float,
    block_size: int,
    source: str = "--kv-cache-memory-gb",
) -> int:
    """KV blocks that ``num_bytes`` of memory hold.

    Args:
        num_bytes: memory for the KV pool in bytes (finite).
        kv_bytes_per_token: K and V bytes of one token over all layers.
        block_size: tokens per block.
        source: where ``num_bytes`` came from, for the error message.

    Raises:
        CliError: naming ``source`` when the memory holds no whole block.
    """
    block_bytes = kv_bytes_per_token * block_size
    if not num_bytes >= block_bytes:
        raise CliError(
            f"{source} leaves {num_bytes / 2**30:.3g} GiB for the KV cache, less than one "
            f"block of {block_size} tokens ({block_bytes} B); give more memory or --num-kv-blocks"
        )
    return int(num_bytes // block_bytes)


# ----------------------------------------------------------------- checks
def check_args(args: argparse.Namespace, registry: Registry) -> None:
    """Every check of the shared flags that needs no workload, model or run: flag
    combinations, policy knobs, ``--goodput`` and the output paths. Runs before
    any work, so a typo never costs a run.

    Raises:
        CliError: naming the flag and the fix.
        UnknownPolicyError: for an unknown policy or loop order.
    """
    _check_workload_flags(args)
    if args.num_kv_blocks is not None and args.kv_cache_memory_gb is not None:
        raise CliError("give either --num-kv-blocks or --kv-cache-memory-gb, not both")
    policy_options(args, registry)
    if wants_kv_tiers(args):
        registry.kv_tier_policy(args.kv_tier_policy or "lru")
    if args.goodput:
        parse_goodput(args.goodput)
    _check_output_paths(args)


def _check_output_paths(args: argparse.Namespace) -> None:
    try:
        if args.save_result is not None:
            check_output_path(args.save_result, "--save-result")
        if args.save_records is not None:
            check_output_path(args.save_records, "--save-records", RECORD_SUFFIXES)
        if args.save_steps is not None:
            check_output_path(args.save_steps, "--save-steps", (".jsonl",))
    except ValueError as err:
        raise CliError(str(err)) from None
    named = {"--save-result": args.save_result, "--save-records": args.save_records,
             "--save-steps": args.save_steps}  # fmt: skip
    seen: dict[Path, str] = {}
    for flag, path in named.items():
        if path is None:
            continue
        other = seen.setdefault(path.resolve(), flag)
        if other != flag:
            raise CliError(f"{other} and {flag} name the same file; give two paths")


# ---------------------------------------------------------------- outputs
def report(
    args: argparse.Namespace,
    records: pd.DataFrame,
    *,
    duration_s: float,
    title: str,
    extra: dict[str, Any],
    itl: LogHistogram | None = None,
) -> dict[str, Any]:
    """Summarize, print the table (unless ``--no-summary``) and write the files asked for
    (``itl``: the run's ITL histogram when its records carry no token times).

    Returns:
        The flat result dict (what ``--save-result`` writes).
    """
    goodput = parse_goodput(args.goodput) if args.goodput else None
    summary = summarize(records, duration_s=duration_s, goodput=goodput, itl=itl)
    groups, tables = _group_results(records, goodput)
    result: dict[str, Any] = {**summary, **extra, **groups}
    if not args.no_summary:
        tiers = {k: v for k, v in extra.items() if k.startswith("kv_")}  # KV tier lines
        print(format_summary({**summary, **tiers}, title))
        for table in tables:
            print(table)
    if args.save_result is not None:
        write_result(result, args.save_result)
    if args.save_records is not None:
        write_records(records, args.save_records)
    return result


def _group_results(
    records: pd.DataFrame, goodput: dict[str, float] | None
) -> tuple[dict[str, Any], list[str]]:
    """Per-tenant and per-priority-class figures when the run has several: flat
    keys for the result file, and the tables as text."""
    out: dict[str, Any] = {}
    tables: list[str] = []
    if records["tenant"].nunique(dropna=False) > 1:
        table = per_tenant(records)
        out["jain_fair_share"] = fair_share_fairness(records)
        for row in table.itertuples():
            out[f"tenant_{row.tenant}_p99_ttft_ms"] = row.p99_ttft_ms
        tables.append("per tenant:\n" + table.round(1).to_string(index=False))
    has_deadlines = "deadline_s" in records and records["deadline_s"].notna().any()
    if "priority" in records and (records["priority"].nunique() > 1 or has_deadlines):
        table = per_class(records, goodput=goodput)
        for row in table.to_dict("records"):
            for key in ("p99_ttft_ms", "slo_attainment", "request_goodput"):
                if key in row:
                    out[f"class_{row['class']}_{key}"] = row[key]
        tables.append("per priority class:\n" + table.round(3).to_string(index=False))
    return out, tables


# ----------------------------------------------------------------- errors
@contextmanager
def friendly_errors(prog: str) -> Iterator[None]:
    """Turn expected errors into one ``prog: error: ...`` line and exit code 2."""
    try:
        yield
    except (CliError, UnknownPolicyError, PolicyError, workloads.WorkloadError) as err:
        _die(prog, str(err))
    except (ValueError, OSError, ImportError) as err:
        _die(prog, str(err))
    except KeyboardInterrupt:
        _die(prog, "interrupted")


def _die(prog: str, message: str) -> NoReturn:
    line = " ".join(message.splitlines())  # NOTE: one line, even if a library gives several
    print(f"{prog}: error: {line}", file=sys.stderr)
    raise SystemExit(2)


def warn_to(prog: str) -> Callable[[str], None]:
    """A warning sink printing ``prog: warning: message`` on stderr."""
    return _warn(prog)


def _warn(prog: str) -> Callable[[str], None]:
    def warn(message: str) -> None:
        print(f"{prog}: warning: {message}", file=sys.stderr)

    return warn


def run_main(
    prog: str,
    parser: argparse.ArgumentParser,
    body: Callable[..., Any],
    check: Callable[[argparse.Namespace, Registry], None] = check_args,
) -> int:
    """Parse flags, handle ``--list-policies``, run ``check(args, registry)``
    (the checks that need no work), then ``body(args, registry)``.

    A plugin that cannot load is skipped with a ``prog: warning:`` line.
    """
    args = parser.parse_args()
    with friendly_errors(prog), warning_sink(_warn(prog)):  # a skipped plugin once
        registry = load_registry()
        if args.list_policies:
            print(registry.describe())
            return 0
        check(args, registry)
        body(args, registry)
    return 0


# ------------------------------------------------------ embedded in an engine
def parse_policy_args(
    argv: list[str],
    registry: Registry,
    *,
    source: str = "policy flags",
    engine: str = "the engine",
    preset: str = "seeds",
) -> tuple[str, str, PolicyOptions, int | None, int | None]:
    """Parse and check rose-sim's policy flags for a run inside another engine's
    scheduler (vLLM's, through ``ROSEINFER_POLICY_ARGS``), with rose-sim's parser
    pieces, so names, typed options and messages are rose-sim's.

    ``argv`` may hold the policy flags (``--policy``, ``--loop-order``, ``--lookahead``,
    ``--chunk-head``, ``--force-fifo-every``, ``--policy-arg``), every plugin's own
    flags, ``--scheduler-preset`` and the admission limits ``--prefill-max-tokens``
    and ``--prefill-max-seqs``. The other scheduler and KV-cache flags
    (``--max-num-seqs``, ``--block-size``, ...) set the engine's own scheduler and
    are an error here, as are ``--list-policies`` and ``--help``.

    Args:
        argv: the flags, split as a shell splits them (``shlex.split``).
        registry: the loaded plugins.
        source: where the flags came from, for messages (e.g. the variable's name).
        engine: the engine's name, for messages (e.g. ``"vLLM"``).
        preset: the ``--scheduler-preset`` assumed when none is given; its loop
            order is the default one.

    Returns:
        ``(policy, loop_order, options, prefill_max_tokens, prefill_max_seqs)``; the
        two limits (tokens per step, requests per step) are None when not given.

    Raises:
        CliError: a bad flag, value or combination: one line naming it and the fix.
        UnknownPolicyError: an unknown policy, loop order or length predictor.
    """

    class _Parser(ArgumentParser):
        def error(self, message: str) -> NoReturn:
            raise CliError(message)

    parser = _Parser(prog=source, add_help=False)
    _add_policy_args(parser.add_argument_group("policy"))
    _add_plugin_option_args(parser.add_argument_group("policy options"), registry)
    group = parser.add_argument_group("scheduler and KV cache")
    _add_scheduler_args(group)
    policy_facing = ("scheduler_preset", "prefill_max_tokens", "prefill_max_seqs")
    engine_owned = [a for a in group._group_actions if a.dest not in policy_facing]
    for action in engine_owned:
        action.default = None  # so a flag given explicitly is told from its default
    args = parser.parse_args(argv)
    if args.list_policies:
        raise CliError(
            f"--list-policies prints the policies and exits; run `rose-sim --list-policies` "
            f"and drop it from {source}"
        )
    for action in engine_owned:
        if getattr(args, action.dest) is not None:
            raise CliError(
                f"{action.option_strings[0]} sets {engine}'s own scheduler, not the policy: "
                f"give it to {engine} and drop it from {source}"
            )
    if args.scheduler_preset is None:
        args.scheduler_preset = preset
    options = policy_options(args, registry)
    loop_order = str(scheduler_knobs(args)["loop_order"])
    return args.policy, loop_order, options, args.prefill_max_tokens, args.prefill_max_seqs
