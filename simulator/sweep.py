"""Sweep a grid of policies x request rates into one DataFrame.

Example (a notebook cell)::

    from roseinfer.simulator import sweep, make_cost_model
    df = sweep.run_grid(
        requests,
        base=SchedulerConfig(num_kv_blocks=20_000, max_model_len=16_384),
        cost_model=make_cost_model("llama-3.1-8b", "h100-sxm"),
        variants={
            "fifo": {"policy": "fifo"},
            "budget-2048": {"policy": "budget", "prefill_max_tokens": 2048},
            "pack-2048+ff8": {"policy": "pack", "prefill_max_tokens": 2048,
                              "lookahead": 64, "force_fifo_every": 8},
        },
        request_rates=[2, 4, 8, 16],
    )
    roseinfer.metrics.plot_p99_vs_rate(df, metric="ttft", by="variant")
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import pandas as pd

from roseinfer import workloads
from roseinfer.config import SchedulerConfig
from roseinfer.interface import PolicyOptions
from roseinfer.metrics import summarize
from roseinfer.registry import Registry, load_registry
from roseinfer.request import Request
from roseinfer.simulator.cost_model import CostModel
from roseinfer.simulator.engine import simulate

_OPTION_FIELDS = {f.name for f in dataclasses.fields(PolicyOptions)}


def apply_overrides(base: SchedulerConfig, overrides: Mapping[str, Any]) -> SchedulerConfig:
    """``base`` with scheduler fields and policy options (``lookahead``,
    ``force_fifo_every``, ``extra``) replaced.

    Raises:
        ValueError: on a key that is neither a config field nor a policy option.
    """
    config_fields = {f.name for f in dataclasses.fields(SchedulerConfig)}
    opts = {k: v for k, v in overrides.items() if k in _OPTION_FIELDS}
    cfg = {k: v for k, v in overrides.items() if k in config_fields}
    unknown = set(overrides) - set(opts) - set(cfg)
    if unknown:
        known = sorted(config_fields | _OPTION_FIELDS)
        raise ValueError(f"unknown sweep keys {sorted(unknown)}; known: {known}")
    if opts:
        cfg["options"] = dataclasses.replace(base.options, **opts)
    return dataclasses.replace(base, **cfg)


def run_grid(
    requests: Sequence[Request],
    *,
    base: SchedulerConfig,
    cost_model: CostModel,
    variants: Mapping[str, Mapping[str, Any]],
    request_rates: Iterable[float] | None = None,
    burstiness: float = 1.0,
    seed: int = 0,
    registry: Registry | None = None,
) -> pd.DataFrame:
    """Simulate every variant at every request rate.

    Args:
        requests: the workload (lengths are kept; arrivals are re-drawn per rate).
        base: the shared scheduler config.
        cost_model: the simulator's cost model.
        variants: label -> overrides of ``base`` (see :func:`apply_overrides`).
        request_rates: req/s values (vLLM bench semantics; ``inf`` = all at once);
            None keeps the workload's own arrival times.
        burstiness: gamma shape of inter-arrival gaps (1 = Poisson).
        seed: arrival seed, the same for every variant (common random numbers).

    Returns:
        One row per (variant, rate): ``variant``, ``policy`` (composed label),
        ``request_rate``, every summary key (``p99_ttft_ms``...), ``sim_wall_s``.
    """
    registry = registry if registry is not None else load_registry()
    rates: list[float | None] = list(request_rates) if request_rates is not None else [None]
    rows: list[dict[str, Any]] = []
    for rate in rates:
        reqs = list(requests)
        if rate is not None:
            reqs = workloads.rescale_arrivals(
                reqs, request_rate=rate, burstiness=burstiness, seed=seed
            )
        for label, overrides in variants.items():
            config = apply_overrides(base, overrides)
            result = simulate(reqs, config, cost_model, registry=registry)
            summary = summarize(result.records, duration_s=result.duration_s)
            rows.append(
                {
                    "variant": label,
                    "policy": result.policy,
                    "request_rate": rate,
                    **summary,
                    "sim_wall_s": result.wall_s,
                }
            )
    return pd.DataFrame(rows)
