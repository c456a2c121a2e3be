"""Facts about the executor's setup that calibration files record.

A profile (``rose-run profile``) and a step log (``--save-steps``) both carry
the model's shape, the executor's setup (device, dtype, KV pool, limits) and
the environment a step time depends on (torch, threads, load), so that
``rose-sim --cost-model FILE`` simulates the same scheduler on the same pool.
"""

from __future__ import annotations

import dataclasses
import os
import platform
from pathlib import Path
from typing import Any

import torch

from roseinfer.calibration.specs import DeviceSpec, ModelSpec
from roseinfer.calibration.steplog import StepLogWriter, StepRecorder, make_header
from roseinfer.config import SchedulerConfig
from roseinfer.executor.model_runner import ModelRunner


def environment_facts(device: torch.device) -> dict[str, object]:
    """Versions, threads and machine facts that a step time depends on."""
    cuda = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "num_threads": torch.get_num_threads(),
        "num_interop_threads": torch.get_num_interop_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "cuda_device": cuda,
        "load_average": list(load) if load else None,
    }


def builtin_device_spec(device: torch.device) -> DeviceSpec | None:
    """The built-in roofline spec of this device kind (datasheet peaks), if one matches."""
    from roseinfer.calibration.specs import get_device_spec

    if device.type == "cpu":
        return get_device_spec("cpu")
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device).lower()
    for key, spec in (("h200", "h200"), ("h100", "h100-sxm"), ("a100", "a100-80gb")):
        if key in name:
            return get_device_spec(spec)
    return None


def model_spec_of(name: str, hf_config: object, dtype: torch.dtype) -> ModelSpec:
    """The simulator's shape of a transformers config, at the run's dtype."""
    from roseinfer.calibration.specs import model_spec_from_hf_config

    spec = model_spec_from_hf_config(hf_config.to_dict())  # type: ignore[attr-defined]
    return dataclasses.replace(spec, name=name, dtype_bytes=torch.finfo(dtype).bits // 8)


def runner_step_facts(runner: ModelRunner) -> dict[str, Any]:
    """How a runner's steps run, as both result files and profile/step-log headers
    record it: attention backend and the launches its warm-up chose (and where
    from: tuned or the shared cache), ``enforce_eager``, the CUDA graph mode and
    captured sizes, and the KV pool's bytes."""
    return {
        "attention_backend": runner.attention_backend,
        "attention_launches": runner.backend.tuned_launches(),
        "attention_tune_source": runner.attention_tune_source,
        "enforce_eager": runner.enforce_eager,
        "cuda_graph_batch_sizes": list(runner.graph_batch_sizes or ()),
        "cudagraph_mode": runner.cudagraph_mode,
        "cuda_graph_token_sizes": list(runner.graph_token_sizes),
        "kv_cache_bytes": runner.kv_cache_bytes,
    }


def executor_facts(
    runner: ModelRunner,
    config: SchedulerConfig,
    max_num_batched_tokens: int | None,
    kv_cache_budget_bytes: int | None,
    fit_lengths: str = "off",
) -> dict[str, object]:
    """The ``executor`` section of a profile or a step log: what ``rose-sim
    --cost-model FILE`` takes as its defaults (the pool, block size, max model
    length, how a workload's lengths were fitted), and how its steps ran
    (:func:`runner_step_facts`: an eager profile prices a graphed run's decodes
    too high; and the attention's ``decode_split_programs``, for the step model's
    GPU terms)."""
    return {
        "device": str(runner.device),
        "dtype": str(runner.dtype).removeprefix("torch."),
        **runner_step_facts(runner),
        "decode_split_programs": runner.backend.decode_split_programs,
        "num_kv_blocks": config.num_kv_blocks,
        "block_size": config.block_size,
        "kv_cache_budget_bytes": kv_cache_budget_bytes or runner.kv_cache_bytes,
        "max_model_len": config.max_model_len,
        "max_num_seqs": config.max_num_seqs,
        "max_num_batched_tokens": max_num_batched_tokens,
        "fit_lengths": fit_lengths,
    }


def step_log_recorder(
    path: Path,
    *,
    backend: str,
    model_name: str,
    model_spec: ModelSpec,
    runner: ModelRunner,
    config: SchedulerConfig,
    max_num_batched_tokens: int | None,
    fit_lengths: str,
    scheduler_facts: dict[str, Any],
) -> StepRecorder:
    """A step observer writing ``path`` (``--save-steps``), with the run's header.

    Close ``recorder.writer`` when the run ends.
    """
    header = make_header(
        backend,
        model={"name": model_name, "spec": dataclasses.asdict(model_spec)},
        executor=executor_facts(runner, config, max_num_batched_tokens, None, fit_lengths),
        scheduler=scheduler_facts,
        environment=environment_facts(runner.device),
    )
    return StepRecorder(StepLogWriter(path, header))
