"""From a run's flags to its scheduler config: checks, policy knobs, KV pool and tiers.

:func:`check_args` runs every check that needs no workload, model or run, so a
typo never costs a run, and returns the policy knobs, computed once per run;
:func:`scheduler_config` then takes the defaults the backend derives (KV pool,
model length) and builds the :class:`~roseinfer.config.SchedulerConfig`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from roseinfer import policy_args
from roseinfer.cli.flags import CliError, warn_to
from roseinfer.config import MAX_NUM_KV_BLOCKS, SchedulerConfig
from roseinfer.interface import PolicyOptions
from roseinfer.kv_tiers import (
    HOST_TIER_NAME,
    PCIE5_X16_BYTES_PER_S,
    KVTierConfig,
    KVTierError,
    tier_from_gib,
)
from roseinfer.metrics import RECORD_SUFFIXES, check_output_path, parse_goodput
from roseinfer.policy_args import scheduler_knobs
from roseinfer.prediction import LENGTH_PREDICTOR_OPTION
from roseinfer.registry import Registry, current_warning_sink


def check_args(args: argparse.Namespace, registry: Registry) -> PolicyOptions:
    """Every check of the shared flags that needs no workload, model or run: flag
    combinations, policy knobs, ``--goodput`` and the output paths.

    Returns:
        The run's typed policy knobs (:func:`policy_options`).

    Raises:
        CliError: naming the flag and the fix.
        UnknownPolicyError: for an unknown policy or loop order.
    """
    check_workload_flags(args)
    if args.burstiness is not None and args.request_rate is None:
        raise CliError(
            "--burstiness shapes the arrivals --request-rate re-draws; add --request-rate "
            "or drop --burstiness (the trace's own times have no burstiness knob)"
        )
    options = check_engine_args(args, registry)
    if args.goodput:
        parse_goodput(args.goodput)
    check_output_paths(args, ("save_result", "save_records", "save_steps"))
    return options


def check_engine_args(args: argparse.Namespace, registry: Registry) -> PolicyOptions:
    """The checks of the policy, scheduler and KV cache flags (:func:`add_engine_args
    <roseinfer.cli.groups.add_engine_args>`); returns the policy knobs.

    Raises:
        CliError: naming the flag and the fix.
        UnknownPolicyError: for an unknown policy, loop order or tier policy.
    """
    check_pool_flags(args)
    options = policy_options(args, registry)
    if wants_kv_tiers(args):
        registry.kv_tier_policy(args.kv_tier_policy or "lru")
    return options


def check_pool_flags(args: argparse.Namespace) -> None:
    """The KV pool is sized one way: blocks or GiB.

    Raises:
        CliError: with both ``--num-kv-blocks`` and ``--kv-cache-memory-gb``.
    """
    if args.num_kv_blocks is not None and args.kv_cache_memory_gb is not None:
        raise CliError("give either --num-kv-blocks or --kv-cache-memory-gb, not both")


def check_workload_flags(args: argparse.Namespace) -> None:
    """Workload flags that contradict each other or need another flag.

    Raises:
        CliError: naming the flags and the fix.
    """
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


def policy_options(args: argparse.Namespace, registry: Registry) -> PolicyOptions:
    """The typed policy knobs of the flags. A knob no plugin of the run reads is a
    ``prog: warning:`` and dropped, or an error with ``--strict-options``.

    Raises:
        CliError: a bad knob (type, range, given twice), or ``--prefill-max-tokens``
            with a policy without a token budget.
        UnknownPolicyError: listing the known policies.
    """
    warn = current_warning_sink() or warn_to("roseinfer")  # run_main sets `prog: warning:`
    try:
        return policy_args.policy_options(
            args, registry, strict=bool(getattr(args, "strict_options", True)), warn=warn
        )
    except policy_args.PolicyArgsError as err:
        raise CliError(str(err)) from None


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


def scheduler_config(
    args: argparse.Namespace,
    registry: Registry,
    options: PolicyOptions,
    *,
    num_kv_blocks: int,
    max_model_len: int,
    kv_bytes_per_token: int | None = None,
    block_size: int | None = None,
) -> SchedulerConfig:
    """The scheduler config from the flags and the run's policy knobs (``options``,
    from :func:`check_args`); the backend supplies the defaults it derives from
    memory and the model (``num_kv_blocks``, ``max_model_len``, and
    ``kv_bytes_per_token``, K and V bytes of one token over all layers, which turns
    KV tier capacities into blocks), and ``block_size`` when it chose one (a
    calibration's; default ``--block-size``).

    Raises:
        CliError: on a non-positive or contradictory value.
    """
    if args.num_kv_blocks is not None:
        num_kv_blocks = args.num_kv_blocks
    elif num_kv_blocks > MAX_NUM_KV_BLOCKS:
        raise CliError(
            f"the KV memory holds {num_kv_blocks} blocks, more than the {MAX_NUM_KV_BLOCKS} the "
            "block manager indexes; set --num-kv-blocks, a smaller --kv-cache-memory-gb or a "
            "larger --block-size"
        )
    block_size = args.block_size if block_size is None else block_size
    kv_tiers = kv_tier_config(args, registry, kv_bytes_per_token, block_size)
    try:
        return SchedulerConfig(
            num_kv_blocks=num_kv_blocks,
            kv_tiers=kv_tiers,
            block_size=block_size,
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


def check_output_paths(args: argparse.Namespace, dests: tuple[str, ...]) -> None:
    """The output files named by the flags ``dests`` (``save_records``, ...): each
    writable, in a folder that exists (a command creates no folders), with an
    extension it can write, and no two the same file.

    Raises:
        CliError: naming the flag and the fix.
    """
    suffixes = {"save_records": RECORD_SUFFIXES, "save_steps": (".jsonl",)}
    seen: dict[Path, str] = {}
    for dest in dests:
        path, flag = getattr(args, dest, None), "--" + dest.replace("_", "-")
        if path is None:
            continue
        path = Path(path)
        try:
            check_output_path(path, flag, suffixes.get(dest, ()))
        except ValueError as err:
            raise CliError(str(err)) from None
        if not path.parent.is_dir():
            raise CliError(
                f"{flag} {path}: folder {path.parent} does not exist; create it or give "
                "another path"
            )
        other = seen.setdefault(path.resolve(), flag)
        if other != flag:
            raise CliError(f"{other} and {flag} name the same file; give two paths")


def config_facts(config: SchedulerConfig) -> dict[str, Any]:
    """The scheduler settings a result file records (flat, JSON-ready)."""
    facts = {
        name: getattr(config, name)
        for name in (
            "num_kv_blocks", "block_size", "max_num_seqs", "prefill_max_tokens",
            "max_num_batched_tokens", "enable_chunked_prefill", "long_prefill_token_threshold",
            "max_num_partial_prefills", "loop_order", "max_model_len", "enable_prefix_caching",
            "prefix_caching_hash_algo",
        )
    }  # fmt: skip
    tiers = config.kv_tiers
    if tiers is not None:
        facts |= {
            "kv_tiers": tiers.describe(),
            "kv_tier_policy": tiers.policy_name,
            "kv_offloading_overlap": tiers.overlap,
            "kv_block_bytes": tiers.block_bytes,
        }
    return facts


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
