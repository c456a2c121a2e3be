"""Command-line options shared by ``rose-sim`` and ``rose-run``.

Both front ends take the same workload, policy, scheduler and output flags
(vLLM's names where the concept is the same; the seeds' names where it
differs), so a policy tried in the simulator runs for real by changing the
command name. Bad input ends with one ``error:`` line, never a traceback.
"""

from __future__ import annotations

import argparse
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
    SCHEDULER_PRESETS,
    SchedulerConfig,
)
from roseinfer.interface import PolicyError, PolicyOptions
from roseinfer.metrics import (
    format_summary,
    parse_goodput,
    summarize,
    write_records,
    write_result,
)
from roseinfer.registry import Registry, UnknownPolicyError, load_registry
from roseinfer.request import Request

WORKLOADS = ("azure-conv-sample", "synthetic", *(f"seed-{n}" for n in workloads.SEED_WORKLOADS))


class CliError(ValueError):
    """A bad flag or flag combination (message names it and the fix)."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse with the project's error contract: one ``prog: error: ...`` line on
    stderr and exit code 2 (no usage block; ``--help`` shows it)."""

    def error(self, message: str) -> NoReturn:
        """Print ``message`` as one line and exit with status 2."""
        _die(self.prog, f"{message} (see {self.prog} --help)")


def add_common_args(parser: argparse.ArgumentParser) -> None:
    """Add the workload, policy, scheduler and output flags to ``parser``."""
    _add_workload_args(parser.add_argument_group("workload"))
    _add_policy_args(parser.add_argument_group("policy"))
    _add_scheduler_args(parser.add_argument_group("scheduler and KV cache"))
    _add_output_args(parser.add_argument_group("output"))


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Add only the policy and scheduler flags (a server: no workload, no summary)."""
    _add_policy_args(parser.add_argument_group("policy"))
    _add_scheduler_args(parser.add_argument_group("scheduler and KV cache"))


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
        "(default), a seed experiment, or 'synthetic' (the knobs below)",
    )
    g.add_argument("--num-requests", type=int, help="use the first N requests")
    g.add_argument("--start-s", type=float, help="skip requests arriving before this time (s)")
    g.add_argument("--end-s", type=float, help="drop requests arriving after this time (s)")
    g.add_argument(
        "--request-rate",
        type=float,
        help="re-draw arrivals at this rate (req/s; 'inf' = all at t=0), as vLLM bench; "
        "default: keep the trace's times",
    )
    g.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of inter-arrival gaps with --request-rate (default 1 = Poisson), as vLLM bench",
    )
    g.add_argument(
        "--seed",
        type=int,
        default=0,
        help="random seed: arrivals, made-up tokens, sampling (default 0)",
    )
    g.add_argument("--prompt-tokens", type=int, help="synthetic: base prompt length in tokens")
    g.add_argument(
        "--prompt-repeats",
        help="synthetic: comma-separated repeat counts of the base prompt, cycled per "
        "request (seed 031: '1,1,1,64')",
    )
    g.add_argument("--output-tokens", type=int, help="synthetic: output tokens per request")
    g.add_argument("--submit-interval-ms", type=float, help="synthetic: gap between arrivals (ms)")
    g.add_argument(
        "--unique-prompts",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="synthetic: a distinct suffix per prompt (no prefix-cache hits across requests)",
    )


def _add_policy_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--policy", default="fifo", help="admission policy (default fifo; see --list-policies)"
    )
    g.add_argument(
        "--loop-order",
        help="loop ordering: prefill-first (default), decode-first, mixed, prefill-priority",
    )
    g.add_argument("--lookahead", type=int, help="pack: waiting requests looked at (default 64)")
    g.add_argument(
        "--chunk-head",
        action="store_true",
        help="budget/pack: admit a head that does not fit the token budget with a chunk "
        "that fills it, instead of alone with its whole prompt (needs chunked prefill)",
    )
    g.add_argument(
        "--force-fifo-every",
        type=int,
        default=0,
        help="strict FIFO every N-th admission round (default 0 = off)",
    )
    g.add_argument(
        "--policy-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra knob for a third-party policy (repeatable)",
    )
    g.add_argument(
        "--list-policies", action="store_true", help="list every registered policy and exit"
    )


def _add_scheduler_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--scheduler-preset",
        choices=sorted(SCHEDULER_PRESETS),
        help="an engine's scheduler defaults (loop order, chunked prefill, token and seat "
        "limits): vllm-v1, sglang or seeds (default); explicit flags win",
    )
    g.add_argument(
        "--prefill-max-tokens",
        type=int,
        help="prompt tokens prefilled per step, running chunks first (the seeds' token "
        "budget; admission honours it with budget/pack)",
    )
    g.add_argument(
        "--prefill-max-seqs",
        type=int,
        help="requests admitted per step (default: --max-num-seqs)",
    )
    g.add_argument(
        "--max-num-seqs",
        type=int,
        help=f"running-set cap = decode batch (default {DEFAULT_MAX_NUM_SEQS}, as vLLM)",
    )
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        help="tokens computed per step, decodes included, as vLLM (default: no limit)",
    )
    g.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="cut a prefill that does not fit a step into chunks (default off; on in the "
        "vllm-v1 and sglang presets)",
    )
    g.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        help="cap on one request's prefill chunk per step (chunked prefill; default none)",
    )
    g.add_argument(
        "--max-num-partial-prefills",
        type=int,
        help="most requests with an unfinished prefill at once (chunked prefill; default none)",
    )
    g.add_argument(
        "--block-size",
        type=int,
        default=DEFAULT_BLOCK_SIZE,
        help=f"tokens per KV block (default {DEFAULT_BLOCK_SIZE})",
    )
    g.add_argument("--num-kv-blocks", type=int, help="KV blocks in the pool (default: from memory)")
    g.add_argument(
        "--kv-cache-memory-gb",
        type=float,
        help="KV pool size in GiB (alternative to --num-kv-blocks)",
    )
    g.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse KV blocks by hashes of full prompt blocks (default on)",
    )
    g.add_argument("--max-model-len", type=int, help="longest request in tokens (default: model's)")


def _add_output_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--save-result", type=Path, help="write the summary as flat JSON (vLLM bench keys)"
    )
    g.add_argument("--save-records", type=Path, help="write per-request records (.csv or .parquet)")
    g.add_argument(
        "--goodput",
        nargs="+",
        metavar="METRIC:MS",
        help="SLOs for goodput, e.g. ttft:200 tpot:50 e2el:2000",
    )
    g.add_argument("--quiet", action="store_true", help="print no summary table")


# ----------------------------------------------------------------- workload
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
        raise CliError(f"--prompt-repeats must be comma-separated integers, got {text!r}") from None
    if not repeats or min(repeats) <= 0:
        raise CliError(f"--prompt-repeats needs positive integers, got {text!r}")
    return repeats


def _check_workload_flags(args: argparse.Namespace) -> None:
    if args.trace is not None and args.workload is not None:
        raise CliError("give either --trace or --workload, not both")
    synthetic_flags = ("prompt_tokens", "prompt_repeats", "output_tokens", "submit_interval_ms")
    is_synthetic = args.workload not in (None, "azure-conv-sample")
    for flag in synthetic_flags:
        if getattr(args, flag) is not None and not is_synthetic:
            raise CliError(
                f"--{flag.replace('_', '-')} shapes a synthetic workload; add "
                "--workload synthetic (or a seed-* workload), or drop it"
            )
    if args.request_rate is not None and args.request_rate <= 0:
        raise CliError(f"--request-rate must be > 0 (or inf), got {args.request_rate}")
    if args.burstiness <= 0:
        raise CliError(f"--burstiness must be > 0, got {args.burstiness}")
    if args.num_requests is not None and args.num_requests <= 0:
        raise CliError(f"--num-requests must be > 0, got {args.num_requests}")
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
        CliError: e.g. ``--lookahead`` with a policy that has no lookahead.
        UnknownPolicyError: listing the known policies.
    """
    policy_cls = registry.policy(args.policy)
    registry.loop_order(scheduler_knobs(args)["loop_order"])
    for flag, given, attr in (
        ("--lookahead", args.lookahead is not None, "uses_lookahead"),
        ("--chunk-head", args.chunk_head, "uses_chunk_head"),
    ):
        if given and not getattr(policy_cls, attr):
            users = [n for n, e in sorted(registry.policies.items()) if getattr(e.cls, attr)]
            raise CliError(
                f"{flag} is read only by: {', '.join(users)}; policy {args.policy!r} ignores it"
            )
    if args.prefill_max_tokens is not None and not policy_cls.uses_token_budget:
        users = [n for n, e in sorted(registry.policies.items()) if e.cls.uses_token_budget]
        raise CliError(
            f"policy {args.policy!r} ignores --prefill-max-tokens; policies with a token "
            f"budget: {', '.join(users)}"
        )
    extra = {}
    for item in args.policy_arg:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise CliError(f"--policy-arg takes KEY=VALUE, got {item!r}")
        extra[key] = value
    return PolicyOptions(
        lookahead=args.lookahead if args.lookahead is not None else 64,
        force_fifo_every=args.force_fifo_every,
        chunk_head=args.chunk_head,
        extra=extra,
    )


def scheduler_config(
    args: argparse.Namespace,
    registry: Registry,
    *,
    num_kv_blocks: int,
    max_model_len: int,
) -> SchedulerConfig:
    """The scheduler config from the flags; the backend supplies the defaults
    it derives from memory and the model (``num_kv_blocks``, ``max_model_len``).

    Raises:
        CliError: on a non-positive or contradictory value.
    """
    if args.num_kv_blocks is not None and args.kv_cache_memory_gb is not None:
        raise CliError("give either --num-kv-blocks or --kv-cache-memory-gb, not both")
    if args.force_fifo_every < 0:
        raise CliError(f"--force-fifo-every must be >= 0 (0 disables), got {args.force_fifo_every}")
    options = policy_options(args, registry)
    try:
        return SchedulerConfig(
            num_kv_blocks=args.num_kv_blocks or num_kv_blocks,
            block_size=args.block_size,
            prefill_max_seqs=args.prefill_max_seqs,
            prefill_max_tokens=args.prefill_max_tokens,
            max_model_len=args.max_model_len or max_model_len,
            enable_prefix_caching=args.enable_prefix_caching,
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
    }


def kv_blocks_from_bytes(num_bytes: float, kv_bytes_per_token: int, block_size: int) -> int:
    """KV blocks that ``num_bytes`` of memory hold."""
    return max(1, int(num_bytes // (kv_bytes_per_token * block_size)))


# ---------------------------------------------------------------- outputs
def report(
    args: argparse.Namespace,
    records: pd.DataFrame,
    *,
    duration_s: float,
    title: str,
    extra: dict[str, Any],
) -> dict[str, Any]:
    """Summarize, print the table (unless ``--quiet``) and write the files asked for.

    Returns:
        The flat result dict (what ``--save-result`` writes).
    """
    goodput = parse_goodput(args.goodput) if args.goodput else None
    summary = summarize(records, duration_s=duration_s, goodput=goodput)
    result: dict[str, Any] = {**summary, **extra}
    if not args.quiet:
        print(format_summary(summary, title))
    if args.save_result is not None:
        write_result(result, args.save_result)
    if args.save_records is not None:
        write_records(records, args.save_records)
    return result


# ----------------------------------------------------------------- errors
@contextmanager
def friendly_errors(prog: str) -> Iterator[None]:
    """Turn expected errors into one ``prog: error: ...`` line and exit code 2."""
    try:
        yield
    except (CliError, UnknownPolicyError, PolicyError, workloads.WorkloadError) as err:
        _die(prog, str(err))
    except (ValueError, FileNotFoundError, ImportError) as err:
        _die(prog, str(err))
    except KeyboardInterrupt:
        _die(prog, "interrupted")


def _die(prog: str, message: str) -> NoReturn:
    print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def run_main(prog: str, parser: argparse.ArgumentParser, body: Callable[..., Any]) -> int:
    """Parse flags, handle ``--list-policies``, run ``body(args, registry)``."""
    args = parser.parse_args()
    with friendly_errors(prog):
        registry = load_registry()
        if args.list_policies:
            print(registry.describe())
            return 0
        body(args, registry)
    return 0
