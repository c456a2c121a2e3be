"""Shared test helpers: small requests, schedulers, a toy cost model and the tiny model."""

from __future__ import annotations

import importlib.util
import os
import sys
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import pandas as pd
import pytest

# Triton's interpreter runs the kernels on CPU tensors; it must be chosen before
# anything imports triton, and a module collected early (a CLI or benchmark test)
# may import it before the kernel tests' own modules set it.
if importlib.util.find_spec("torch") is not None:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")

from roseinfer.config import SchedulerConfig  # noqa: E402
from roseinfer.interface import Budget, PolicyContext, PolicyOptions
from roseinfer.records import RecordBuilder
from roseinfer.registry import Registry, load_registry
from roseinfer.request import Request
from roseinfer.scheduler import Scheduler
from roseinfer.sequence import Sequence


def req(i: int, prompt: int, output: int = 4, arrival: float = 0.0, **kw) -> Request:
    """A request with id ``r{i}``."""
    return Request(f"r{i}", arrival, prompt, output, **kw)


def seqs(*prompt_lengths: int) -> list[Sequence]:
    """Waiting sequences with the given prompt lengths, ids 0.."""
    return [Sequence(i, req(i, n)) for i, n in enumerate(prompt_lengths)]


def ctx(max_model_len: int = 1024, admission_round: int = 1) -> PolicyContext:
    """A policy context whose cost is the prompt capped at max_model_len (no cache)."""
    return PolicyContext(
        now_s=0.0,
        admission_round=admission_round,
        num_running=0,
        num_waiting=0,
        max_model_len=max_model_len,
        cost=lambda s: min(s.num_tokens, max_model_len),
    )


def budget(max_tokens: int | None, max_seqs: int = 8) -> Budget:
    return Budget(max_tokens=max_tokens, max_seqs=max_seqs, num_free_blocks=1000)


class ToyCostModel:
    """Linear cost: 1 ms per step, 10 us per prefill token, 0.1 ms per decode seq."""

    name = "toy"

    def step_time_s(self, shape) -> float:
        n = int(shape.prefill_new_tokens.sum())
        if n == 0 and len(shape.decode_context_tokens) == 0:
            return 0.0
        return 1e-3 + 1e-5 * n + 1e-4 * len(shape.decode_context_tokens)

    def decode_run_times_s(self, context_tokens, num_steps: int) -> np.ndarray:
        return np.full(num_steps, 1e-3 + 1e-4 * len(context_tokens))

    def describe(self) -> str:
        return "toy linear cost"


@pytest.fixture(scope="session")
def registry() -> Registry:
    return load_registry()


def make_scheduler(registry: Registry, **cfg) -> Scheduler:
    """A scheduler with a roomy default config, overridden by ``cfg``."""
    options = cfg.pop("options", PolicyOptions())
    config = SchedulerConfig(
        **{"num_kv_blocks": 256, "block_size": 4, "max_num_seqs": 8, **cfg}, options=options
    )
    policy = registry.make(config.policy, config.loop_order, config.options)
    return Scheduler(config, policy, policy.label)


_RECORDS: weakref.WeakKeyDictionary[Scheduler, RecordBuilder] = weakref.WeakKeyDictionary()


def records_of(sched: Scheduler) -> pd.DataFrame:
    """Records of every request that ended in ``sched`` so far (pops its ended requests)."""
    builder = _RECORDS.setdefault(sched, RecordBuilder(keep_token_ids=True))
    builder.extend(sched.pop_ended(), sched.step_log)
    return builder.frame()


def drive_unit_steps(
    sched: Scheduler, reqs: list[Request], max_steps: int = 10_000, prepare: bool = False
) -> pd.DataFrame:
    """Drive ``sched`` with steps of 1 s, releasing arrivals on time; its records at
    the end. ``prepare``: start as a replay does (``start_replay``: fit a predictor).

    Raises:
        AssertionError: if the work is not done within ``max_steps`` steps.
    """
    if prepare:
        from roseinfer.driver import start_replay

        start_replay(sched, reqs, warn=lambda message: None)
    now, i = 0.0, 0
    for _ in range(max_steps):
        while i < len(reqs) and reqs[i].arrival_time_s <= now:
            sched.add_request(reqs[i], now)
            i += 1
        out = sched.schedule(now)
        if out.is_empty:
            if i == len(reqs):
                return records_of(sched)
            now = reqs[i].arrival_time_s
            continue
        now += 1.0
        sched.update(out, now)
    raise AssertionError("no progress")


def run_cli(main: Callable[[], int], prog: str, monkeypatch, capsys, *args: str):  # type: ignore[no-untyped-def]
    """Run a console script's ``main`` with ``args``: (exit code, stdout, stderr)."""
    monkeypatch.setattr(sys, "argv", [prog, *args])
    try:
        code = main()
    except SystemExit as exit_:
        code = int(exit_.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err


TINY_MODEL_OVERRIDES: dict[str, Any] = {"initializer_range": 0.5}
"""Varied (large-init) random weights, so greedy outputs differ between prompts."""


def tiny_model(name: str = "tiny-gpt2", **overrides: Any) -> Any:
    """A fresh built-in tiny model (``tiny-gpt2``, ``tiny-llama``, ``tiny-qwen2``: 2
    layers, 64 wide) with varied random weights (seed 0,
    :data:`TINY_MODEL_OVERRIDES`), float32 on the CPU; ``overrides`` change its
    config (e.g. ``vocab_size``). The one tiny-model setup of the test suite.

    Raises:
        ValueError: for an unknown model name.
    """
    import torch

    from roseinfer.executor.models import build_model

    model, _, _ = build_model(
        name,
        seed=0,
        dtype=torch.float32,
        device="cpu",
        config_overrides={**TINY_MODEL_OVERRIDES, **overrides},
    )
    return model


@pytest.fixture(scope="module")
def tiny_gpt2() -> Any:
    """One :func:`tiny_model` ``tiny-gpt2`` per test module (never change its weights)."""
    return tiny_model("tiny-gpt2")
