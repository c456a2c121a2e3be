"""The flags more than one command takes, and every command's error contract.

A flag two commands share is defined once here (:data:`FLAGS`: its type, range
and default) and added with :func:`add_flag`. Bad input ends with one
``prog: error: ...`` line and exit status 2 (:class:`ArgumentParser`,
:func:`friendly_errors`), never a traceback; :func:`run_main` is the frame of
``rose-sim``, ``rose-run`` and ``rose-serve``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn

from roseinfer.argtypes import MAX_INT_FLAG, POSITIVE, clip, float_in, int_in
from roseinfer.calibration.graph_replay import (
    CUDAGRAPH_MODES,
    DEFAULT_CUDAGRAPH_MODE,
    MIXED_GRAPH_MAX_TOKENS,
)
from roseinfer.config import DEFAULT_BLOCK_SIZE, DEFAULT_MAX_NUM_SEQS, MAX_NUM_KV_BLOCKS
from roseinfer.interface import PolicyError, PolicyOptions
from roseinfer.registry import Registry, UnknownPolicyError, load_registry, warning_sink
from roseinfer.workloads import WorkloadError

__all__ = [
    "MAX_INT_FLAG", "POSITIVE", "clip", "float_in", "int_in",  # the value types, re-used
]  # fmt: skip

MAX_BLOCK_SIZE = 4096
"""Largest ``--block-size``: 8x Mooncake's 512-token blocks; vLLM allows at most 256."""
MAX_SEED = 2**63 - 1
"""Largest ``--seed``: torch and numpy take any non-negative int64."""
MAX_KV_CACHE_GB = float(2**30)
"""Largest ``--kv-cache-memory-gb`` (1 EiB): a pool size stays a finite number of bytes."""
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
"""vLLM's default ``--gpu-memory-utilization``."""


class CliError(ValueError):
    """A bad flag or flag combination (message names it and the fix)."""


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
        "type": float_in(0, MAX_KV_CACHE_GB, lo_open=True),
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
    "--cudagraph-mode": {
        "choices": CUDAGRAPH_MODES,
        "default": DEFAULT_CUDAGRAPH_MODE,
        "help": f"which steps replay CUDA graphs, by vLLM's names (default {DEFAULT_CUDAGRAPH_MODE}): "
        "FULL_DECODE_ONLY decode batches; FULL also prefill and mixed passes of up to "
        f"{MIXED_GRAPH_MAX_TOKENS} new tokens (triton attention), padded to vLLM's capture "
        "sizes, so a small prefill is not bound by launching its kernels",
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
        die(self.prog, f"{message} (see {self.prog} --help)")


def add_quiet_args(parser: argparse.ArgumentParser, *, summary: bool = True) -> None:
    """``--quiet`` (alias ``--no-progress``): no progress bar and no progress lines,
    in every command; with ``summary``, ``--no-summary``: no summary table. They are
    independent: ``--quiet`` alone still prints the summary."""
    g = parser.add_argument_group("terminal output")
    g.add_argument(
        "--quiet",
        "--no-progress",
        dest="quiet",
        action="store_true",
        help="no progress bar or progress lines (the summary still prints; --no-progress "
        "is the same flag)",
    )
    if summary:
        g.add_argument(
            "--no-summary",
            action="store_true",
            help="print no summary table (the files asked for are still written)",
        )


class DeprecatedAlias(argparse.Action):
    """An old flag name kept for one release: stores into the new flag's ``dest``
    and prints ``prog: warning: OLD is deprecated; use NEW`` once per parse. Both
    names with different values are an error (:func:`check_aliases` catches the
    new name given last)."""

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
        current = getattr(namespace, self.dest, None)
        if current is not None and current != values:
            parser.error(_conflict(self.new, current, str(option_string), values))
        setattr(namespace, self.dest, values)
        aliased = dict(getattr(namespace, ALIASED, {}))
        aliased[self.dest] = (self.new, str(option_string), values)
        setattr(namespace, ALIASED, aliased)


ALIASED = "_given_by_deprecated_alias"
"""Namespace attribute: dest -> (new flag, old flag, value) of each alias given."""


def _conflict(new: str, new_value: Any, old: str, old_value: Any) -> str:
    return (
        f"{new} {clip(str(new_value))} and {old} {clip(str(old_value))} disagree ({old} is the "
        f"deprecated name of {new}); give {new} only"
    )


def check_aliases(args: argparse.Namespace) -> None:
    """A flag given by its new name after its deprecated one, with another value.

    Raises:
        CliError: naming both flags.
    """
    for dest, (new, old, value) in getattr(args, ALIASED, {}).items():
        if getattr(args, dest) != value:
            raise CliError(_conflict(new, getattr(args, dest), old, value))


# ----------------------------------------------------------------- errors
@contextmanager
def friendly_errors(prog: str) -> Iterator[None]:
    """Turn expected errors into one ``prog: error: ...`` line and exit code 2."""
    try:
        yield
    except (CliError, UnknownPolicyError, PolicyError, WorkloadError) as err:
        die(prog, str(err))
    except (ValueError, OSError, ImportError) as err:
        die(prog, str(err))
    except KeyboardInterrupt:
        die(prog, "interrupted")


def die(prog: str, message: str) -> NoReturn:
    """Print ``prog: error: message`` as one line and exit with status 2."""
    line = " ".join(message.splitlines())  # NOTE: one line, even if a library gives several
    print(f"{prog}: error: {line}", file=sys.stderr)
    raise SystemExit(2)


def warn_to(prog: str) -> Callable[[str], None]:
    """A warning sink printing ``prog: warning: message`` on stderr."""

    def warn(message: str) -> None:
        print(f"{prog}: warning: {message}", file=sys.stderr)

    return warn


def say_to(prog: str, quiet: bool) -> Callable[[str], None]:
    """A progress line sink printing ``prog: message`` on stderr (nothing when
    ``quiet``), flushed so it shows before the work it announces."""

    def say(message: str) -> None:
        if not quiet:
            print(f"{prog}: {message}", file=sys.stderr, flush=True)

    return say


Check = Callable[[argparse.Namespace, Registry], PolicyOptions]
"""The checks of a command that need no work; returns the run's policy knobs."""
Body = Callable[[argparse.Namespace, Registry, PolicyOptions], Any]
"""A command's work, given the flags, the plugins and the checked policy knobs."""


def run_main(prog: str, parser: argparse.ArgumentParser, check: Check, body: Body) -> int:
    """Parse flags, handle ``--list-policies``, run ``check(args, registry)`` (the
    checks that need no work, which return the policy knobs, computed once), then
    ``body(args, registry, options)``.

    A plugin that cannot load is skipped with a ``prog: warning:`` line.
    """
    args = parser.parse_args()
    with friendly_errors(prog), warning_sink(warn_to(prog)):  # a skipped plugin once
        registry = load_registry()
        if args.list_policies:
            print(registry.describe())
            return 0
        check_aliases(args)
        options = check(args, registry)
        body(args, registry, options)
    return 0


def parser_registry() -> Registry:
    """The plugins whose options become flags, loaded quietly: :func:`run_main`
    loads them again and reports a broken plugin once, as ``prog: warning:``
    (a warning here too printed every one twice)."""
    return load_registry(warn=lambda message: None)
