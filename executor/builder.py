"""Build a model runner: load the model, size the KV pool, allocate it, warm up.

Every entry point that runs a real model (``rose-run``, ``rose-serve``,
``rose-run profile``, the benchmarks) builds it here, in this order:

1. :func:`load_model`: device, dtype, threads, weights; the model's adapter,
   context and shape (:class:`~roseinfer.calibration.specs.ModelSpec`, whose
   ``kv_bytes_per_token`` prices the pool) are made once.
2. :func:`resolve_max_model_len`: the run's longest request.
3. :func:`size_kv_pool`: blocks from an explicit size (``--num-kv-blocks``,
   ``--kv-cache-memory-gb``), 1 GiB on a CPU, or, on CUDA, "the memory planner's"
   (:mod:`~roseinfer.executor.memory`: a profile pass decides it in step 4).
4. :func:`build_runner`: the runner, whose passes hold at most
   :func:`pass_tokens` new tokens; on CUDA from memory, the profile pass (the
   largest pass, the sampler, the CUDA-graph pool) and the pool the planner
   leaves; else the pool the memory is checked to hold. Then it is allocated.
5. :func:`warm_up`: CUDA graphs captured (unless ``enforce_eager``), then the
   largest step shapes, before the clock starts.

The scheduler config between 3 and 4 comes from the caller (a command's flags);
step 4 returns it with the pool's size. A benchmark with a pool of its own builds
its runner with :func:`new_runner`. Errors are :class:`BuildError` lines naming
the setting and the fix.
"""

from __future__ import annotations

import dataclasses
import os
import resource
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from roseinfer import workloads
from roseinfer.calibration.graph_replay import DEFAULT_CUDAGRAPH_MODE
from roseinfer.calibration.specs import ModelSpec
from roseinfer.config import (
    DEFAULT_BLOCK_SIZE,
    MAX_NUM_KV_BLOCKS,
    SchedulerConfig,
    kv_blocks_from_bytes,
)
from roseinfer.executor import memory
from roseinfer.executor.adapters import ModelAdapter
from roseinfer.executor.facts import model_spec_of, runner_step_facts
from roseinfer.executor.kv_cache import block_bytes as kv_block_bytes
from roseinfer.executor.model_runner import ModelRunner
from roseinfer.executor.models import build_model, make_adapter
from roseinfer.executor.warmup import warm_up as warm_up_shapes
from roseinfer.request import Request

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
"""``--dtype`` names and their torch dtypes."""
CPU_KV_CACHE_GB = 1.0
"""Default KV pool on a CPU (GiB): host memory is shared with everything else."""
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
"""vLLM's default ``--gpu-memory-utilization``."""


class BuildError(ValueError):
    """A setting the executor cannot be built with (names the setting and the fix)."""


@dataclass(frozen=True, slots=True)
class ModelChoice:
    """Which model to load, and where.

    Attributes:
        model: a local transformers directory or a built-in config name.
        device: ``cpu`` or ``cuda[:N]``; None: CUDA when available.
        dtype: a :data:`DTYPES` name; None: float32 on CPU, bfloat16 on CUDA.
        seed: seeds a built-in model's random weights.
        num_threads: torch CPU threads; None keeps torch's default.
    """

    model: str = "gpt2"
    device: str | None = None
    dtype: str | None = None
    seed: int = 0
    num_threads: int | None = None


@dataclass(frozen=True, slots=True)
class KVPoolChoice:
    """How to size the KV pool: explicitly (blocks or GiB) or from memory.

    Attributes:
        block_size: tokens per block.
        num_kv_blocks: the pool in blocks (wins over the rest).
        kv_cache_memory_gb: the pool in GiB.
        gpu_memory_utilization: share of a CUDA device's total memory for the
            weights, activations and the pool, in (0, 1].
    """

    block_size: int = DEFAULT_BLOCK_SIZE
    num_kv_blocks: int | None = None
    kv_cache_memory_gb: float | None = None
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION


@dataclass(frozen=True, slots=True)
class RunnerChoice:
    """How the runner runs.

    Attributes:
        attention_backend: ``--attention-backend`` (``auto``: the best the
            device runs; see :mod:`roseinfer.executor.attention`).
        enforce_eager: ``--enforce-eager`` (vLLM's flag): never capture CUDA
            graphs; decode passes run eagerly.
        cudagraph_mode: ``--cudagraph-mode`` (vLLM's ``CUDAGraphMode`` names):
            ``FULL_DECODE_ONLY`` or ``FULL`` (small prefill and mixed passes too;
            see :mod:`~roseinfer.executor.graph_runner`).
    """

    attention_backend: str = "auto"
    enforce_eager: bool = False
    cudagraph_mode: str = DEFAULT_CUDAGRAPH_MODE


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """A loaded model and what is derived from it once.

    Attributes:
        name: what ``ModelChoice.model`` said.
        model: the torch module, in eval mode on ``device`` in ``dtype``.
        hf_config: its transformers config.
        tokenizer: the directory's tokenizer, or None (built-in models).
        device: where it lives; dtype: its parameter dtype.
        max_context: positions the model attends over (its trained context, or
            its sliding window if smaller: the runner attends over whole contexts).
        spec: its shape at ``dtype`` (``spec.kv_bytes_per_token`` sizes the pool).
        adapter: the runner's view of it (``make_adapter``), made once per run.
    """

    name: str
    model: torch.nn.Module
    hf_config: Any
    tokenizer: Any
    device: torch.device
    dtype: torch.dtype
    max_context: int
    spec: ModelSpec
    adapter: ModelAdapter

    @property
    def vocab_size(self) -> int:
        """Token ids the model embeds."""
        return int(self.hf_config.vocab_size)


@dataclass(frozen=True, slots=True)
class KVPoolSize:
    """What :func:`size_kv_pool` chose (and, after :func:`build_runner`, what the
    memory planner sized).

    Attributes:
        num_blocks: blocks to allocate; with ``planner_utilization``, at most
            this many (the cap) until :func:`build_runner` plans the pool.
        budget_bytes: the whole blocks the memory holds, in bytes, before any cap
            (what ``rose-sim`` needs to size another model's pool alike; 0 until
            planned).
        source: where the size came from, for messages.
        planner_utilization: set when the memory planner sizes the pool (when
            the runner is built), with this ``gpu_memory_utilization``.
        plan: the planner's numbers, once it ran.
    """

    num_blocks: int
    budget_bytes: int
    source: str
    planner_utilization: float | None = None
    plan: memory.MemoryPlan | None = None


@dataclass(frozen=True, slots=True)
class BuiltRunner:
    """What :func:`build_runner` built.

    Attributes:
        runner: the model runner over the run's KV pool.
        config: the caller's scheduler config with the pool's ``num_kv_blocks``.
        pool: how the pool was sized (with the planner's numbers on CUDA).
    """

    runner: ModelRunner
    config: SchedulerConfig
    pool: KVPoolSize


PLAN_FACTS = (
    "total_bytes", "weights_bytes", "activation_peak_bytes", "non_torch_bytes",
    "cuda_graph_bytes", "kv_cache_bytes", "kv_budget_bytes", "profiled_tokens",
)  # fmt: skip
"""The memory plan's numbers a result file records (``memory_<name>``)."""


def runner_facts(runner: ModelRunner, pool: KVPoolSize) -> dict[str, Any]:
    """What a result file records about the runner and its KV pool (flat,
    JSON-ready): how its steps run (:func:`~roseinfer.executor.facts.runner_step_facts`),
    ``cuda_graph_capture_s`` (0 before the warm-up), whether the warm-up's tuning
    kept balanced key splits for large decode batches
    (``attention_balanced_splits``, triton), pass size, where the pool's size
    came from, and the memory plan's :data:`PLAN_FACTS` on CUDA."""
    facts: dict[str, Any] = {
        **runner_step_facts(runner),
        "attention_balanced_splits": bool(getattr(runner.backend, "balanced", None)),
        "cuda_graph_capture_s": runner.cuda_graph_capture_s,
        "max_tokens_per_pass": runner.max_tokens_per_pass,
        "kv_pool_source": pool.source,
    }
    if pool.plan is not None:
        facts |= {f"memory_{name}": getattr(pool.plan, name) for name in PLAN_FACTS}
    return facts


def resolve_device(name: str | None) -> torch.device:
    """``--device`` as a torch device; CUDA asked for but absent is an error.

    Raises:
        BuildError: for cuda without a CUDA device (or a missing index), another
            device type (meta, mps, ...: the runner supports cpu and cuda), or an
            unknown device string.
    """
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise BuildError(f"unknown --device {name[:40]!r}; use cpu or cuda[:N]") from None
    if device.type not in ("cpu", "cuda"):
        raise BuildError(
            f"--device {device.type} is not supported by the model runner; use cpu or cuda[:N]"
        )
    if device.type == "cuda" and not torch.cuda.is_available():
        raise BuildError("--device cuda but torch sees no CUDA device; use --device cpu")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise BuildError(
            f"--device {name} but torch sees {torch.cuda.device_count()} CUDA device(s); "
            "use cuda:0 .. cuda:N-1"
        )
    return device


def resolve_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """A :data:`DTYPES` name, or the device's default (bfloat16 on CUDA, else float32)."""
    return DTYPES[name or ("bfloat16" if device.type == "cuda" else "float32")]


def check_attention_backend(name: str) -> None:
    """Refuse an attention backend the runner does not have, before any model work.

    Raises:
        BuildError: naming ``--attention-backend`` and the known names.
    """
    from roseinfer.executor.model_runner import ATTENTION_BACKENDS

    if name not in ATTENTION_BACKENDS:
        raise BuildError(
            f"unknown --attention-backend {name[:40]!r}; the runner has: "
            f"{', '.join(ATTENTION_BACKENDS)}"
        )


def load_model(choice: ModelChoice, say: Callable[[str], None] | None = None) -> LoadedModel:
    """Resolve the device and dtype, set the CPU threads, and load the model (``say``
    gets one line first: what loads where).

    Raises:
        BuildError: on a bad device.
        ValueError: on a model that cannot be loaded (see ``build_model``).
    """
    device = resolve_device(choice.device)
    if choice.num_threads is not None:
        torch.set_num_threads(choice.num_threads)
    dtype = resolve_dtype(choice.dtype, device)
    if say is not None:
        say(f"loading {choice.model} on {device} ({str(dtype).removeprefix('torch.')})...")
    model, hf_config, tokenizer = build_model(
        choice.model, seed=choice.seed, dtype=dtype, device=device
    )
    context = int(getattr(hf_config, "max_position_embeddings", None) or hf_config.n_positions)
    adapter = make_adapter(model)
    window = adapter.shape.max_context_tokens
    return LoadedModel(
        name=choice.model, model=model, hf_config=hf_config, tokenizer=tokenizer,
        device=device, dtype=dtype, max_context=context if window is None else min(context, window),
        spec=model_spec_of(choice.model, hf_config, dtype), adapter=adapter,
    )  # fmt: skip


def resolve_max_model_len(requested: int | None, loaded: LoadedModel) -> int:
    """``requested`` (``--max-model-len``), or the model's context.

    Raises:
        BuildError: when ``requested`` exceeds the model's context.
    """
    if requested is None:
        return loaded.max_context
    if requested > loaded.max_context:
        raise BuildError(
            f"--max-model-len {requested} exceeds the {loaded.max_context}-token context of "
            f"{loaded.name}; use at most {loaded.max_context}"
        )
    return requested


def max_useful_blocks(max_num_seqs: int, max_model_len: int, block_size: int) -> int:
    """Blocks for ``max_num_seqs`` sequences of ``max_model_len`` tokens (at most
    what the block manager indexes): the most a pool sized from memory gets.

    NOTE: the cap only bites for tiny models, whose memory-derived pool would be
    millions of blocks: seconds to allocate and to index, for nothing but cache
    retention.
    """
    return min(max_num_seqs * -(-max_model_len // block_size), MAX_NUM_KV_BLOCKS)


def memory_reader(device: torch.device) -> memory.MemoryReader | None:
    """The device memory readings the planner takes on ``device``: ``torch.cuda``'s
    on CUDA; None on a CPU, whose pool is not planned (its memory is shared with
    everything else). Tests replace it with a scripted reader."""
    return memory.CudaMemoryReader(device) if device.type == "cuda" else None


def size_kv_pool(
    pool: KVPoolChoice, loaded: LoadedModel, cap_blocks: int | None = None
) -> KVPoolSize:
    """The KV pool: ``num_kv_blocks``, else ``kv_cache_memory_gb``, else on CUDA the
    memory planner's (:mod:`~roseinfer.executor.memory`, vLLM's rule: a share of the
    device's total memory less weights, profiled activations and the CUDA-graph
    pool; planned by :func:`build_runner`), else 1 GiB on a CPU; a pool sized from
    memory is capped at ``cap_blocks`` (e.g. :func:`max_useful_blocks`).

    Raises:
        BuildError: when the memory holds no block.
    """
    block_bytes = loaded.spec.kv_bytes_per_token * pool.block_size
    if pool.num_kv_blocks is not None:
        return KVPoolSize(pool.num_kv_blocks, pool.num_kv_blocks * block_bytes, "--num-kv-blocks")
    if pool.kv_cache_memory_gb is not None:
        num_bytes, source = pool.kv_cache_memory_gb * 2**30, "--kv-cache-memory-gb"
    elif memory_reader(loaded.device) is not None:
        source = (
            f"the memory planner (--gpu-memory-utilization {pool.gpu_memory_utilization:g} of "
            f"{loaded.device})"
        )
        cap = cap_blocks or MAX_NUM_KV_BLOCKS
        return KVPoolSize(cap, 0, source, planner_utilization=pool.gpu_memory_utilization)
    else:
        num_bytes = CPU_KV_CACHE_GB * 2**30
        source = f"the default CPU KV pool ({CPU_KV_CACHE_GB:g} GiB)"
    try:
        num_blocks = kv_blocks_from_bytes(
            num_bytes, loaded.spec.kv_bytes_per_token, pool.block_size, source
        )
    except ValueError as err:
        raise BuildError(str(err)) from None
    budget_bytes = num_blocks * block_bytes
    if pool.kv_cache_memory_gb is None and cap_blocks is not None:
        num_blocks = min(num_blocks, cap_blocks)
    return KVPoolSize(num_blocks, budget_bytes, source)


def check_pool_holds_a_request(config: SchedulerConfig, source: str) -> None:
    """Refuse a KV pool that cannot hold one request of ``max_model_len`` tokens: a
    server would start and then reject every long request (vLLM refuses to start
    then too, naming the largest model length the pool holds).

    Raises:
        BuildError: naming the pool, where its size came from (``source``) and the fix.
    """
    tokens = config.num_kv_blocks * config.block_size
    if tokens < config.max_model_len:
        raise BuildError(
            f"the KV pool ({config.num_kv_blocks} blocks of {config.block_size} tokens, from "
            f"{source}) holds {tokens} tokens, less than one request of max model length "
            f"{config.max_model_len}; give a larger pool (--num-kv-blocks, "
            f"--kv-cache-memory-gb) or --max-model-len {tokens} or less"
        )


def available_memory_bytes(device: torch.device) -> int:
    """Bytes a new allocation can take on ``device``: free CUDA memory, or the
    host's ``MemAvailable`` (``/proc/meminfo``; free pages where that is absent)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_pool_fits(num_kv_blocks: int, block_bytes: int, device: torch.device) -> None:
    """Refuse a KV pool larger than the memory ``device`` has left, before allocating it.

    Raises:
        BuildError: naming the pool size, the memory available and the flags to lower.
    """
    need, have = num_kv_blocks * block_bytes, available_memory_bytes(device)
    if need > have:
        raise BuildError(
            f"a KV pool of {num_kv_blocks} blocks needs {need / 2**30:.3g} GiB but {device} "
            f"has {have / 2**30:.3g} GiB available; lower --num-kv-blocks or "
            "--kv-cache-memory-gb (or --block-size)"
        )


def host_tier_blocks(config: SchedulerConfig, loaded: LoadedModel) -> int:
    """Blocks of the host KV tier (0 without tiers), checked against host memory.

    Raises:
        BuildError: with more than one tier (the executor implements one), or a
            tier larger than the host memory left (after a CPU device pool).
    """
    tiers = config.kv_tiers
    if tiers is None:
        return 0
    if len(tiers.tiers) > 1:
        raise BuildError(
            f"the executor implements one host KV tier, got {len(tiers.tiers)} "
            "(--kv-offloading-size or one --kv-tier); simulate more with rose-sim"
        )
    need = tiers.tiers[0].num_blocks * tiers.block_bytes
    have = available_memory_bytes(torch.device("cpu"))
    if loaded.device.type == "cpu":  # the device pool takes its share first
        have -= config.num_kv_blocks * loaded.spec.kv_bytes_per_token * config.block_size
    if need > have:
        raise BuildError(
            f"the host KV tier needs {need / 2**30:.3g} GiB but the host has "
            f"{max(have, 0) / 2**30:.3g} GiB available; lower --kv-offloading-size (or the "
            "--kv-tier capacity)"
        )
    return tiers.tiers[0].num_blocks


def pass_tokens(device: torch.device, max_num_batched_tokens: int | None) -> int | None:
    """New tokens per pass through the model (the runner's ``max_tokens_per_pass``).

    On CUDA the step's token budget, else vLLM's default budget for the device
    (:func:`~roseinfer.executor.memory.default_max_num_batched_tokens`: 8192 on
    GPUs of 70 GiB or more other than the A100, else 2048): the memory planner
    profiles one such pass, and the runner cuts any larger step (fifo has no
    budget) into passes of at most that many, so no step needs more activation
    memory than was profiled. On a CPU None: the runner's CPU pass size.
    """
    reader = memory_reader(device)
    if reader is None:
        return None
    if max_num_batched_tokens is not None:
        return max_num_batched_tokens
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
    return memory.default_max_num_batched_tokens(reader.mem_get_info()[1], name)


def new_runner(
    model: torch.nn.Module,
    config: SchedulerConfig,
    *,
    device: torch.device | str,
    dtype: torch.dtype,
    choice: RunnerChoice = RunnerChoice(),
    adapter: ModelAdapter | None = None,
    num_tier_blocks: int = 0,
) -> ModelRunner:
    """A model runner over ``config``'s pool (``num_kv_blocks`` of ``block_size``),
    whose passes hold at most :func:`pass_tokens` new tokens, after checking that
    the device's memory holds the pool: every runner of a run is made here (a
    benchmark with a pool of its own calls this; :func:`build_runner` sizes one).

    Args:
        model: a supported model already on ``device`` in ``dtype`` (as
            ``build_model`` leaves it).
        adapter: ``make_adapter(model)`` when the caller has it (None: made here).

    Raises:
        BuildError: on a pool the memory cannot hold.
        ValueError: as :class:`~roseinfer.executor.model_runner.ModelRunner`
            (and for a model not on ``device`` in ``dtype``).
    """
    device = torch.device(device)
    if adapter is None:
        adapter = make_adapter(model)
    check_pool_fits(
        config.num_kv_blocks, kv_block_bytes(adapter.shape, config.block_size, dtype), device
    )
    return ModelRunner(
        model, num_kv_blocks=config.num_kv_blocks, block_size=config.block_size, device=device,
        dtype=dtype, attention_backend=choice.attention_backend,
        max_tokens_per_pass=pass_tokens(device, config.max_num_batched_tokens),
        num_tier_blocks=num_tier_blocks, enforce_eager=choice.enforce_eager, adapter=adapter,
        cudagraph_mode=choice.cudagraph_mode,
    )  # fmt: skip


def build_runner(
    loaded: LoadedModel,
    config: SchedulerConfig,
    pool: KVPoolSize,
    choice: RunnerChoice = RunnerChoice(),
    say: Callable[[str], None] | None = None,
) -> BuiltRunner:
    """The run's model runner over the pool :func:`size_kv_pool` chose (and its
    host tier): with ``pool.planner_utilization``, a runner whose pool the memory
    planner sized after a profile pass of its largest pass (``say`` gets the plan
    in one line); else the pool ``config`` holds, checked against the memory.

    Args:
        config: the scheduler config; its ``num_kv_blocks`` is ``pool.num_blocks``
            (when planned: the cap).

    Returns:
        the runner, ``config`` with the pool's ``num_kv_blocks``, and the pool.

    Raises:
        BuildError: on a pool or tier the memory cannot hold, a planned pool too
            small for one ``max_model_len`` sequence, or a profile pass that ran
            out of memory (each naming the flags to change).
    """
    utilization = pool.planner_utilization
    first = config if utilization is None else dataclasses.replace(config, num_kv_blocks=1)
    runner = new_runner(
        loaded.model, first, device=loaded.device, dtype=loaded.dtype, choice=choice,
        adapter=loaded.adapter, num_tier_blocks=host_tier_blocks(config, loaded),
    )  # fmt: skip
    if utilization is None:
        return BuiltRunner(runner, config, pool)
    plan = _plan(runner, config, utilization, pool.num_blocks)
    if say is not None:
        say(plan.describe())
    planned = dataclasses.replace(
        pool, num_blocks=plan.num_kv_blocks, budget_bytes=plan.kv_budget_bytes, plan=plan
    )
    return BuiltRunner(
        runner, dataclasses.replace(config, num_kv_blocks=plan.num_kv_blocks), planned
    )


def _plan(
    runner: ModelRunner, config: SchedulerConfig, utilization: float, cap: int
) -> memory.MemoryPlan:
    """The memory planner over ``runner``: a pool of at most ``cap`` blocks.

    Raises:
        BuildError: see :func:`build_runner`.
    """
    try:
        return memory.plan_kv_cache(
            runner, max_num_seqs=config.max_num_seqs, max_model_len=config.max_model_len,
            gpu_memory_utilization=utilization, reader=memory_reader(runner.device),
            max_num_kv_blocks=cap,
        )  # fmt: skip
    except torch.cuda.OutOfMemoryError:
        raise BuildError(
            f"the memory planner's profile pass ({runner.max_tokens_per_pass} tokens, the "
            f"largest pass) ran out of {runner.device} memory; lower --max-num-batched-tokens "
            "(or --max-model-len, --max-num-seqs)"
        ) from None
    except ValueError as err:
        raise BuildError(str(err)) from None


def warm_up(runner: ModelRunner, config: SchedulerConfig, *, shapes: bool = True) -> float:
    """Before the clock starts: tune the attention launches (CUDA), capture the
    decode CUDA graphs unless captured
    (none with ``enforce_eager`` or a backend without graphs;
    ``runner.cuda_graph_capture_s`` says how long), then, with ``shapes``, run the
    largest step shapes (:mod:`~roseinfer.executor.warmup`). Returns the seconds
    spent."""
    start = time.perf_counter()
    runner.tune_attention(config.max_num_seqs, config.max_model_len)
    if runner.graphs is None:
        runner.capture_cuda_graphs(config.max_num_seqs, config.max_model_len)
    if shapes:
        warm_up_shapes(runner, config)
    return time.perf_counter() - start


def peak_memory_gb(device: torch.device) -> float:
    """The run's peak memory (GiB): CUDA's allocator peak, or the process's max RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB


def allocator_retries(device: torch.device) -> int | None:
    """CUDA's caching allocator: allocations that failed and were retried after it
    released its cached blocks (``num_alloc_retries`` of ``torch.cuda.memory_stats``).
    Each retry synchronizes the device and frees memory back to the driver, so a
    step that makes one stalls; none is expected when the KV pool is sized by the
    memory planner. None off CUDA."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0))


def fit_requests(
    requests: Sequence[Request], max_model_len: int, vocab_size: int, fit_mode: str, seed: int
) -> tuple[list[Request], str, str]:
    """Requests a model can replay: lengths fitted (``fit_mode``: a
    ``workloads.FIT_MODES`` mode, or ``off``), missing token ids made up, and ids
    outside the vocabulary folded into it (a seed workload has GPT-2 ids; a tiny
    model has a small vocab).

    Returns:
        The requests, the fit note and the vocabulary note (for the result file).

    Raises:
        WorkloadError: an unknown ``fit_mode``, or a request too long to make
            ids for (:func:`roseinfer.workloads.fit.with_token_ids`). With
            ``fit_mode`` ``off`` a request longer than ``max_model_len`` keeps no ids
            and the scheduler rejects it.
    """
    fitted, fit_note = workloads.fit_lengths(requests, max_model_len, mode=fit_mode)
    fitted = workloads.with_token_ids(
        fitted, vocab_size=vocab_size, seed=seed, max_model_len=max_model_len
    )
    num_folded = 0
    for i, r in enumerate(fitted):
        ids = r.prompt_token_ids or ()
        if any(t >= vocab_size for t in ids):
            # NOTE: id % vocab keeps equal prompts (and prefixes) equal.
            folded = tuple(t % vocab_size for t in ids)
            fitted[i] = dataclasses.replace(r, prompt_token_ids=folded)
            num_folded += 1
    vocab_note = (
        f"token ids of {num_folded} requests folded into the vocab ({vocab_size}) as id % vocab"
        if num_folded
        else "none"
    )
    return fitted, fit_note, vocab_note
