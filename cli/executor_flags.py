"""The model, device and runner flags of ``rose-run``, ``rose-serve`` and ``rose-run
profile``, and the steps they share to build a model runner with
:mod:`roseinfer.executor.builder`.

Nothing here imports torch at import time: a command parses and checks every
flag first (``--help`` and a bad flag answer at once), and imports torch only to
build. Without torch it says which extra to install, in one line.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from roseinfer.cli.config import config_facts, scheduler_config, scheduler_knobs
from roseinfer.cli.flags import FLAGS, CliError, add_flag, int_in
from roseinfer.config import SchedulerConfig
from roseinfer.interface import PolicyOptions
from roseinfer.registry import Registry

if TYPE_CHECKING:
    from roseinfer.calibration.steplog import StepRecorder
    from roseinfer.executor.builder import KVPoolChoice, KVPoolSize, LoadedModel, RunnerChoice
    from roseinfer.executor.model_runner import ModelRunner

DTYPE_NAMES = ("bfloat16", "float16", "float32")
"""``--dtype`` choices (:data:`roseinfer.executor.builder.DTYPES`)."""
_DEVICE = re.compile(r"(cpu|cuda)(:\d{1,4})?\Z")
EXECUTOR_HELP = (
    "On CUDA the KV pool is sized by a profile pass of the largest pass, and every step "
    "runs in passes of at most --max-num-batched-tokens new tokens (without one, vLLM's "
    "default for the GPU: 8192 from 70 GiB except the A100, else 2048), so no policy can "
    "make a step run out of memory."
)
"""The executor group's description (``rose-run``, ``rose-serve``, ``rose-run profile``)."""


def add_model_args(g: argparse._ArgumentGroup, *, warmup: bool = True) -> None:
    """The model, device and runner flags (``warmup``: add ``--no-warmup``; a profile
    warms up every shape)."""
    g.add_argument(
        "--model",
        default="gpt2",
        help="a local transformers directory, or a built-in config with random weights "
        "(gpt2, gpt2-4l, tiny-gpt2, tiny-llama, tiny-qwen2, llama-3.1-8b, qwen2.5-7b, "
        "llama-3.2-3b; an "
        "unknown name lists them)",
    )
    g.add_argument(
        "--device",
        default=None,
        help="torch device: cpu or cuda[:N] (default: cuda if available). rose-sim's "
        "simulated hardware is its --hardware",
    )
    g.add_argument(
        "--dtype",
        choices=DTYPE_NAMES,
        help="weights/KV dtype (default: float32 on CPU, bfloat16 on CUDA)",
    )
    g.add_argument(
        "--attention-backend",
        default="auto",
        help="attention kernel (default auto: triton on CUDA, flex or sdpa on CPU; an "
        "unknown name lists the runner's)",
    )
    g.add_argument(
        "--enforce-eager",
        action="store_true",
        help="never capture CUDA graphs: decode steps run eagerly, as vLLM's flag (default: "
        "decode batches replay graphs captured before the clock starts)",
    )
    add_flag(
        g,
        "--cudagraph-mode",
        help=FLAGS["--cudagraph-mode"]["help"]
        + " (on an H100 with Llama-3.1-8B shapes: 9.7 ms against 13-14 ms eager, and no "
        "stretched launches). A profile or step log records the mode, and rose-sim prices "
        "its steps by it (rose-sim --cudagraph-mode for the roofline)",
    )
    add_flag(
        g,
        "--gpu-memory-utilization",
        help=FLAGS["--gpu-memory-utilization"]["help"]
        + "; on CUDA the KV pool gets what is left after the weights, a profile pass's peak "
        "activations and the CUDA graphs (vLLM's rule)",
    )
    g.add_argument(
        "--num-threads",
        type=int_in(1, 4096),
        help="CPU threads for torch (torch.set_num_threads; default: torch's, one per "
        "core). On a CPU shared with other jobs 1 keeps step times steady",
    )
    if warmup:
        g.add_argument(
            "--no-warmup",
            action="store_true",
            help="skip the warm-up with the largest step shapes before the clock starts "
            "(CUDA graphs are still captured; --enforce-eager skips them)",
        )


def check_device_name(name: str | None) -> None:
    """``--device``'s spelling (cpu, cuda, cuda:N), checked without torch; whether
    the device exists is checked when torch loads.

    Raises:
        CliError: naming the flag and the devices the runner supports.
    """
    if name is not None and not _DEVICE.match(name):
        raise CliError(f"unknown --device {name[:40]!r}; use cpu or cuda[:N]")


def require_extra(prog: str, extra: str, modules: tuple[str, ...]) -> None:
    """Refuse to run without ``modules`` (torch, ...), naming the extra that installs them.

    Raises:
        CliError: one line: ``pip install 'roseinfer[EXTRA]'``.
    """
    missing = [m for m in modules if not _installed(m)]
    if missing:
        raise CliError(
            f"{prog} runs a real model and needs {', '.join(missing)}, which is not installed: "
            f"install the extra roseinfer[{extra}] (from a checkout: pip install -e '.[{extra}]'; "
            "rose-sim needs none of it)"
        )


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent missing, or a module blanked in sys.modules
        return False


def prepare_torch() -> None:
    """Settings that must precede torch's first import.

    NOTE: OMP_WAIT_POLICY is read once when torch loads libgomp. With the default
    (active) policy an idle OpenMP worker keeps spinning after every parallel
    region; on a CPU shared with other busy processes it then steals the main
    thread's core: a GPT-2 decode step of one sequence with 2 threads took 1.6 s
    instead of 0.09 s (passive) on a 2-core machine while other jobs ran. Passive
    workers sleep instead (the benchmarks do the same). An explicit
    OMP_WAIT_POLICY in the environment wins.
    """
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def load(args: argparse.Namespace, say: Callable[[str], None]) -> LoadedModel:
    """Load ``--model`` on ``--device`` (one progress line first).

    Raises:
        BuildError: on a device torch does not see; ValueError: on a model that
            cannot be loaded.
    """
    from roseinfer.executor import builder

    builder.check_attention_backend(args.attention_backend)
    choice = builder.ModelChoice(args.model, args.device, args.dtype, args.seed, args.num_threads)
    return builder.load_model(choice, say)


def pool_choice(args: argparse.Namespace) -> KVPoolChoice:
    """``--block-size``, ``--num-kv-blocks``, ``--kv-cache-memory-gb`` and
    ``--gpu-memory-utilization`` as the builder's pool choice."""
    from roseinfer.executor import builder

    return builder.KVPoolChoice(
        args.block_size, args.num_kv_blocks, args.kv_cache_memory_gb, args.gpu_memory_utilization
    )


def runner_choice(args: argparse.Namespace) -> RunnerChoice:
    """``--attention-backend``, ``--enforce-eager`` and ``--cudagraph-mode`` as the
    builder's runner choice."""
    from roseinfer.executor import builder

    return builder.RunnerChoice(args.attention_backend, args.enforce_eager, args.cudagraph_mode)


def engine_config(
    args: argparse.Namespace,
    registry: Registry,
    options: PolicyOptions,
    loaded: LoadedModel,
    max_model_len: int,
) -> tuple[SchedulerConfig, KVPoolSize]:
    """The scheduler config over a KV pool sized by the flags (or from memory,
    capped at ``max_num_seqs`` requests of ``max_model_len``; on CUDA the memory
    planner sizes it when the runner is built, and the config holds the cap until
    then), refused when it cannot hold one request of ``max_model_len`` tokens, as
    vLLM refuses to start; and the pool's size.

    Raises:
        CliError / BuildError: naming the flags to change.
    """
    from roseinfer.executor import builder

    cap = builder.max_useful_blocks(
        scheduler_knobs(args)["max_num_seqs"], max_model_len, args.block_size
    )
    size = builder.size_kv_pool(pool_choice(args), loaded, cap)
    config = scheduler_config(
        args, registry, options, num_kv_blocks=size.num_blocks, max_model_len=max_model_len,
        kv_bytes_per_token=loaded.spec.kv_bytes_per_token,
    )  # fmt: skip
    builder.check_pool_holds_a_request(config, size.source)
    return config, size


@dataclass(frozen=True, slots=True)
class Built:
    """A model runner built from the flags, and what came with it.

    Attributes:
        loaded: the model and what is derived from it once.
        config: the scheduler config over the runner's KV pool.
        runner: the model runner.
        pool: how its KV pool was sized (the memory plan on CUDA).
        warmup_s: seconds the warm-up took (CUDA graphs only with ``--no-warmup``).
    """

    loaded: LoadedModel
    config: SchedulerConfig
    runner: ModelRunner
    pool: KVPoolSize
    warmup_s: float


def build(
    args: argparse.Namespace,
    registry: Registry,
    options: PolicyOptions,
    say: Callable[[str], None],
) -> Built:
    """Load the model, size the pool, build the scheduler config and the runner (on
    CUDA from memory: profile, plan, allocate), and warm up (CUDA graphs unless
    ``--enforce-eager``, the step shapes unless ``--no-warmup``), with a progress
    line for each slow step (and the memory plan): what ``rose-run`` and
    ``rose-serve`` share.

    Raises:
        CliError / BuildError: naming the flags to change.
    """
    prepare_torch()
    from roseinfer.executor import builder

    loaded = load(args, say)
    max_model_len = builder.resolve_max_model_len(args.max_model_len, loaded)
    config, size = engine_config(args, registry, options, loaded, max_model_len)
    if size.planner_utilization is not None:
        say("profiling the largest step to size the KV pool...")
    built = builder.build_runner(loaded, config, size, runner_choice(args), say)
    if not args.no_warmup:
        say("warming up with the largest step shapes...")
    warmup_s = builder.warm_up(built.runner, built.config, shapes=not args.no_warmup)
    return Built(loaded, built.config, built.runner, built.pool, warmup_s)


def step_recorder(
    args: argparse.Namespace, built: Built, backend: str, fit_lengths: str
) -> StepRecorder | None:
    """``--save-steps``: a step log of the executed steps (None without the flag)."""
    if args.save_steps is None:
        return None
    from roseinfer.executor.facts import step_log_recorder

    config = built.config
    return step_log_recorder(
        args.save_steps, backend=backend, model_name=args.model, model_spec=built.loaded.spec,
        runner=built.runner, config=config, max_num_batched_tokens=config.max_num_batched_tokens,
        fit_lengths=fit_lengths, scheduler_facts=config_facts(config),
    )  # fmt: skip
