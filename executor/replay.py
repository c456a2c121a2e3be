"""The executor side of the fidelity report: replay a request list as ``rose-run`` does.

:class:`ExecutorReplay` is a ``roseinfer.experiments.fidelity.RealRun``: each
call builds a fresh :class:`~roseinfer.executor.engine.Engine` (fresh scheduler,
empty prefix cache) on one model and KV pool kept across calls, warms up with
the configuration's largest step shapes before the clock starts
(:mod:`roseinfer.executor.warmup`, as ``rose-run`` does), and replays the
requests open-loop on the real clock, recording its step log. Reusing the pool is safe: every block is
written before it is read, so one run's K/V never reaches another's outputs.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

import torch

from roseinfer.calibration.report import RunOutput
from roseinfer.calibration.steplog import StepRecorder
from roseinfer.config import SchedulerConfig
from roseinfer.executor.builder import RunnerChoice, new_runner, pass_tokens, warm_up
from roseinfer.executor.engine import Engine
from roseinfer.executor.model_runner import ModelRunner
from roseinfer.registry import Registry
from roseinfer.request import Request


class ExecutorReplay:
    """Runs request lists for real on one model (a ``RealRun`` callable).

    Args:
        model: the torch model, on ``device`` in ``dtype``
            (``roseinfer.executor.models.build_model``).
        device: where it runs; dtype: weights and KV dtype.
        seed: sampling seed of every engine.
        warmup: warm up before each run's clock starts (as ``rose-run``).
        registry: plugin registry (default: built-ins plus entry points).
        attention_backend: as ``rose-run --attention-backend``.
        enforce_eager: no CUDA graphs (``--enforce-eager``); otherwise the
            warm-up captures them where the backend can.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        device: torch.device | str,
        dtype: torch.dtype,
        seed: int = 0,
        warmup: bool = True,
        registry: Registry | None = None,
        attention_backend: str = "auto",
        enforce_eager: bool = False,
    ) -> None:
        self.model, self.device, self.dtype = model, torch.device(device), dtype
        self.seed, self.warmup, self.registry = seed, warmup, registry
        self.attention_backend, self.enforce_eager = attention_backend, enforce_eager
        self._runner: ModelRunner | None = None
        self._pool: tuple[int, int, int | None] | None = None

    def runner_for(self, config: SchedulerConfig) -> ModelRunner:
        """The model runner with ``config``'s KV pool and pass size (made again only
        when they change),
        built as ``rose-run`` builds one (:func:`~roseinfer.executor.builder.new_runner`).

        Raises:
            BuildError: on a pool the device's memory cannot hold.
        """
        runner = self._runner
        pool = (
            config.num_kv_blocks,
            config.block_size,
            pass_tokens(self.device, config.max_num_batched_tokens),
        )
        if runner is None or pool != self._pool:
            self._runner = None  # free the old pool before allocating the new one
            runner = new_runner(
                self.model, config, device=self.device, dtype=self.dtype,
                choice=RunnerChoice(self.attention_backend, self.enforce_eager),
            )  # fmt: skip
            self._runner, self._pool = runner, pool
        return runner

    def __call__(self, requests: Sequence[Request], config: SchedulerConfig) -> RunOutput:
        """Replay ``requests`` under ``config``; records and steps hold real seconds.

        Raises:
            ValueError: if a request does not fit the model (see ``Engine.run``).
        """
        runner = self.runner_for(config)
        start = time.perf_counter()
        if self.warmup:
            warm_up(runner, config)
        warmup_s = time.perf_counter() - start
        recorder = StepRecorder(keep=True)
        engine = Engine(runner, config, self.registry, seed=self.seed, on_step=recorder)
        result = engine.run(requests)
        info = {
            "warmup_s": warmup_s,
            "wall_s": result.wall_s,
            "num_steps": result.scheduler.step_log.num_steps,
            "load_average_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
            **result.gc.facts(),
        }
        return RunOutput(result.records, result.duration_s, info, recorder.records)
