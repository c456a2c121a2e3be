"""The policy flags: one table, read the same way by every command and by an
engine that embeds the policies.

``rose-sim``, ``rose-run`` and ``rose-serve`` add these flags to their parsers;
an engine running the policies inside its own scheduler (vLLM, through
``ROSEINFER_POLICY_ARGS``) parses a flag string with :func:`parse_policy_args`,
so names, typed options and messages are the commands'. The scheduler and
KV-cache flags an embedding engine sets itself are listed explicitly
(:data:`ENGINE_OWNED_FLAGS`) and refused there.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, NoReturn

from roseinfer.argtypes import POSITIVE, clip
from roseinfer.config import DEFAULT_MAX_NUM_SEQS, SCHEDULER_PRESETS
from roseinfer.interface import PolicyOption, PolicyOptions
from roseinfer.registry import Registry, UnknownPolicyError

DEFAULT_PRESET = "seeds"
"""The ``--scheduler-preset`` of a command when none is given."""


class PolicyArgsError(ValueError):
    """A bad policy flag, value or combination (the message names it and the fix)."""


POLICY_FLAGS: dict[str, dict[str, Any]] = {
    "--policy": {
        "default": "fifo",
        "help": "admission policy (default fifo; see --list-policies)",
    },
    "--loop-order": {
        "help": "loop ordering: prefill-first (default), decode-first, mixed, prefill-priority",
    },
    "--policy-arg": {
        "action": "append",
        "default": [],
        "metavar": "KEY=VALUE",
        "help": "a knob a plugin declares, as KEY=VALUE (repeatable; the same knob as a flag "
        "too is an error)",
    },
}
"""The flags that choose the policy and pass its knobs."""

ADMISSION_FLAGS: dict[str, dict[str, Any]] = {
    "--scheduler-preset": {
        "choices": sorted(SCHEDULER_PRESETS),
        "help": "an engine's scheduler defaults (loop order, chunked prefill, token and seat "
        "limits): vllm-v1, sglang or seeds (default); explicit flags win",
    },
    "--prefill-max-tokens": {
        "type": POSITIVE,
        "help": "prompt tokens prefilled per step, running chunks first (the seeds' token "
        "budget; admission honours it with budget/pack)",
    },
    "--prefill-max-seqs": {
        "type": POSITIVE,
        "help": "requests admitted per step (default: --max-num-seqs)",
    },
}
"""The scheduler flags that shape admission (an embedding engine takes them too)."""

ENGINE_OWNED_FLAGS: tuple[str, ...] = (
    "--max-num-seqs",
    "--max-num-batched-tokens",
    "--enable-chunked-prefill",
    "--no-enable-chunked-prefill",
    "--long-prefill-token-threshold",
    "--max-num-partial-prefills",
    "--block-size",
    "--num-kv-blocks",
    "--kv-cache-memory-gb",
    "--enable-prefix-caching",
    "--no-enable-prefix-caching",
    "--prefix-caching-hash-algo",
    "--max-model-len",
    "--kv-offloading-size",
    "--kv-tier",
    "--kv-tier-policy",
    "--kv-offloading-overlap",
    "--no-kv-offloading-overlap",
)
"""The commands' scheduler and KV-cache flags that are not :data:`ADMISSION_FLAGS`:
an embedding engine sets these itself, so :func:`parse_policy_args` refuses them."""

SCHEDULER_KNOBS = (
    "loop_order",
    "enable_chunked_prefill",
    "max_num_batched_tokens",
    "max_num_seqs",
    "long_prefill_token_threshold",
    "max_num_partial_prefills",
)
"""The scheduler fields a ``--scheduler-preset`` sets and an explicit flag overrides."""


def add_flags(group: argparse._ActionsContainer, table: Mapping[str, Mapping[str, Any]]) -> None:
    """Add every flag of ``table`` (:data:`POLICY_FLAGS`, :data:`ADMISSION_FLAGS`)."""
    for flag, kwargs in table.items():
        group.add_argument(flag, **kwargs)


def add_plugin_option_flags(group: argparse._ActionsContainer, registry: Registry) -> None:
    """One flag per typed option a registered plugin declares (``--lookahead``, ...);
    its value stays None unless given. A name that clashes with another flag stays
    reachable through ``--policy-arg``."""
    for spec in registry.all_option_specs().values():
        choices = f" ({', '.join(map(str, spec.choices))})" if spec.choices else ""
        kwargs: dict[str, Any] = {"dest": spec.name, "default": None, "help": spec.help + choices}
        if spec.type is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["metavar"] = spec.type.__name__.upper()
        with contextlib.suppress(argparse.ArgumentError):
            group.add_argument(spec.flag, **kwargs)


def scheduler_knobs(args: argparse.Namespace) -> dict[str, Any]:
    """Loop order, chunking and limits: ``--scheduler-preset`` (default ``seeds``)
    overridden by every flag given explicitly (a flag missing from ``args`` counts
    as not given)."""
    knobs: dict[str, Any] = {
        "loop_order": "prefill-first",
        "max_num_seqs": DEFAULT_MAX_NUM_SEQS,
        **SCHEDULER_PRESETS[args.scheduler_preset or DEFAULT_PRESET],
    }
    for name in SCHEDULER_KNOBS:
        value = getattr(args, name, None)
        if value is not None:
            knobs[name] = value
    return knobs


def knob_values(args: argparse.Namespace, registry: Registry) -> dict[str, Any]:
    """Plugin knobs from their flags and ``--policy-arg`` (strings, typed later).

    Raises:
        PolicyArgsError: on a malformed ``--policy-arg``, or one knob given twice
            (as a flag and a ``--policy-arg``, or in two ``--policy-arg``).
    """
    values: dict[str, Any] = {}
    for name, spec in registry.all_option_specs().items():
        value = getattr(args, name, None)
        if value is not None:
            values[name] = (spec.flag, value)
    for item in args.policy_arg:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise PolicyArgsError(f"--policy-arg takes KEY=VALUE, got {clip(item)!r}")
        name = key.strip().replace("-", "_")
        if name in values:
            raise PolicyArgsError(
                f"knob {clip(name)!r} is given twice ({values[name][0]} and --policy-arg "
                f"{clip(item)}); give it once"
            )
        values[name] = (f"--policy-arg {clip(name)}", value)
    return {name: value for name, (_, value) in values.items()}


def policy_options(
    args: argparse.Namespace,
    registry: Registry,
    *,
    strict: bool = True,
    warn: Callable[[str], None] | None = None,
) -> PolicyOptions:
    """The run's typed policy knobs from the flags in ``args``.

    A knob no plugin of the run reads (``--length-predictor`` with ``--policy
    fifo``) is an error with ``strict``; otherwise it is dropped and reported
    through ``warn``, so one flag set can drive a comparison over policies.

    Raises:
        PolicyArgsError: a knob given twice, a value of the wrong type or range,
            ``--prefill-max-tokens`` with a policy without a token budget, or
            (``strict``) a knob no plugin of the run reads.
        UnknownPolicyError: an unknown policy, loop order or length predictor.
    """
    policy_cls = registry.policy(args.policy)
    if getattr(args, "prefill_max_tokens", None) is not None and not policy_cls.uses_token_budget:
        users = [n for n, e in sorted(registry.policies.items()) if e.cls.uses_token_budget]
        raise PolicyArgsError(
            f"policy {args.policy!r} ignores --prefill-max-tokens; policies with a token "
            f"budget: {', '.join(users)}"
        )
    values = knob_values(args, registry)
    loop_order = str(scheduler_knobs(args)["loop_order"])
    run_specs = {s.name: s for s in _run_specs(args.policy, loop_order, values, registry)}
    typed: dict[str, Any] = {}
    for key, value in values.items():
        spec = run_specs.get(key)
        if spec is None:
            message = (
                f"no plugin of this run reads {clip(key)!r} (a flag or --policy-arg); policy "
                f"{args.policy!r} with loop order {loop_order!r} reads: "
                f"{', '.join(sorted(run_specs)) or 'none'}"
            )
            if strict:
                raise PolicyArgsError(message)
            if warn is not None:
                warn(f"{message}; ignored (--strict-options makes this an error)")
            continue
        try:
            typed[key] = spec.convert(value)
        except ValueError as err:
            raise PolicyArgsError(str(err)) from None
    return PolicyOptions(typed)


def _run_specs(
    policy: str, loop_order: str, values: dict[str, Any], registry: Registry
) -> list[PolicyOption]:
    """The options the run's plugins read; a plugin refusing a raw knob while it
    decides (a wrapper's ``enabled`` on ``--force-fifo-every -1``) is a
    :class:`PolicyArgsError`, an unknown name stays an :class:`UnknownPolicyError`."""
    try:
        return registry.option_specs(policy, loop_order, PolicyOptions(values))
    except UnknownPolicyError:
        raise
    except ValueError as err:
        raise PolicyArgsError(str(err)) from None


class PolicyArgs(NamedTuple):
    """What :func:`parse_policy_args` read (a tuple in this order, or by name).

    Attributes:
        policy: the admission policy's name; loop_order: the loop order's name.
        options: the typed knobs.
        prefill_max_tokens: tokens per step (None: not given).
        prefill_max_seqs: requests admitted per step (None: not given).
    """

    policy: str
    loop_order: str
    options: PolicyOptions
    prefill_max_tokens: int | None
    prefill_max_seqs: int | None


class _RaisingParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise PolicyArgsError(message)


def parse_policy_args(
    argv: list[str],
    registry: Registry,
    *,
    source: str = "policy flags",
    engine: str = "the engine",
    preset: str = DEFAULT_PRESET,
) -> PolicyArgs:
    """Parse and check the policy flags for a run inside another engine's scheduler
    (vLLM's, through ``ROSEINFER_POLICY_ARGS``).

    ``argv`` may hold :data:`POLICY_FLAGS`, every plugin's own flags and
    :data:`ADMISSION_FLAGS`. :data:`ENGINE_OWNED_FLAGS` set the engine's own
    scheduler and are an error here, as are ``--list-policies`` and ``--help``.
    A knob no plugin of the run reads is an error (an engine has no warning line).

    Args:
        argv: the flags, split as a shell splits them (``shlex.split``).
        registry: the loaded plugins.
        source: where the flags came from, for messages (e.g. the variable's name).
        engine: the engine's name, for messages (e.g. ``"vLLM"``).
        preset: the ``--scheduler-preset`` assumed when none is given; its loop
            order is the default one.

    Raises:
        PolicyArgsError: a bad flag, value or combination: one line naming it and the fix.
        UnknownPolicyError: an unknown policy, loop order or length predictor.
    """
    for token in argv:
        flag = token.partition("=")[0]
        if flag in ENGINE_OWNED_FLAGS:
            raise PolicyArgsError(
                f"{flag} sets {engine}'s own scheduler, not the policy: give it to {engine} "
                f"and drop it from {source}"
            )
        if flag == "--list-policies":
            raise PolicyArgsError(
                "--list-policies prints the policies and exits; run `rose-sim --list-policies` "
                f"and drop it from {source}"
            )
    parser = _RaisingParser(prog=source, add_help=False)
    add_flags(parser, POLICY_FLAGS)
    add_flags(parser, ADMISSION_FLAGS)
    add_plugin_option_flags(parser, registry)
    args = parser.parse_args(argv)
    args.scheduler_preset = args.scheduler_preset or preset
    options = policy_options(args, registry)
    loop_order = str(scheduler_knobs(args)["loop_order"])
    return PolicyArgs(
        args.policy, loop_order, options, args.prefill_max_tokens, args.prefill_max_seqs
    )
