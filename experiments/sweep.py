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

A variant may also name a ``router`` (and ``router_args``) for its cluster
points; ``num_replicas=[1, 4, 8]`` adds the replica count as a grid axis, and
an entry ``"P:D"`` there is a disaggregated cluster of P prefill and D decode
replicas (``num_replicas=[2, "1:1"]`` compares two GPUs colocated and split).
Every point is independent: ``backend="ray"`` runs each as a Ray task
(``ray.init()`` on this machine, or ``ray_address`` for a running cluster),
``"serial"`` in this process, ``"auto"`` (default) Ray when it is installed
(``pip install roseinfer[ray]``), else serial. Both give the same rows
(tested): a point's result depends only on its inputs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import logging
import math
import sys
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import pandas as pd
from tqdm.auto import tqdm

from roseinfer import workloads
from roseinfer.calibration.cost_model import CostModel
from roseinfer.calibration.specs import LinkSpec
from roseinfer.config import SchedulerConfig
from roseinfer.metrics import summarize
from roseinfer.registry import Registry, load_registry
from roseinfer.request import Request
from roseinfer.routing import Router, build_router
from roseinfer.simulator.cluster import ReplicaSpec, simulate_cluster
from roseinfer.simulator.engine import simulate
from roseinfer.simulator.setup import MAX_REPLICAS

ROUTER_KEYS = ("router", "router_args", "router_staleness_s")
BACKENDS = ("auto", "serial", "ray")


def apply_overrides(
    base: SchedulerConfig, overrides: Mapping[str, Any], registry: Registry | None = None
) -> SchedulerConfig:
    """``base`` with scheduler fields and policy knobs replaced: a key is a
    :class:`SchedulerConfig` field or a knob some registered plugin declares
    (``lookahead``, ``force_fifo_every``, ``chunk_head``, ``length_predictor``,
    ``vtc_output_weight``, ...). Values are checked as the flags check them: a knob
    by its declared :class:`~roseinfer.interface.PolicyOption` (type, range,
    choices), a config field by its type, then the config's own rules.

    Raises:
        ValueError: on a key that is neither a config field nor a declared knob, or a
            value of the wrong type or out of range (naming the key).
    """
    specs = (registry or load_registry()).all_option_specs()
    config_fields = {f.name for f in dataclasses.fields(SchedulerConfig)}
    overrides = {k: v for k, v in overrides.items() if k not in ROUTER_KEYS}
    knobs = {k: _knob(specs[k], v) for k, v in overrides.items() if k in specs}
    cfg = {k: _config_value(k, v) for k, v in overrides.items() if k in config_fields}
    unknown = set(overrides) - set(knobs) - set(cfg)
    if unknown:
        known = sorted(config_fields | set(specs))
        raise ValueError(
            f"unknown sweep keys {sorted(unknown)}; known: {known + list(ROUTER_KEYS)}"
        )
    if knobs:
        cfg["options"] = base.options.replace(**knobs)
    return dataclasses.replace(base, **cfg)


_NOT_IN_VARIANTS = ("options", "kv_tiers")  # set through knobs / the command line


def _knob(spec: Any, value: Any) -> Any:
    """``value`` converted by the knob's declared option; ValueError naming the key."""
    try:
        return spec.convert(value)
    except ValueError as err:
        raise ValueError(f"{spec.name} = {_echo(value)}: {err}") from None


def _config_value(name: str, value: Any) -> Any:
    """``value`` when it has the type of :class:`SchedulerConfig` field ``name``."""
    if name in _NOT_IN_VARIANTS:
        raise ValueError(f"{name} cannot be set by a sweep variant; give the knobs themselves")
    hint = typing.get_type_hints(SchedulerConfig)[name]
    kinds = typing.get_args(hint) or (hint,)
    if value is None and type(None) in kinds:
        return None
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        str: isinstance(value, str),
    }
    if any(ok.get(kind, False) for kind in kinds):
        return value
    what = " or ".join("null" if k is type(None) else _KIND_WORDS[k] for k in kinds)
    raise ValueError(f"{name} must be {what}, got {_echo(value)}")


_KIND_WORDS = {bool: "true or false", int: "an integer", str: "a string"}


def _echo(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:40] + "..."


def check_variants(
    variants: Mapping[str, Mapping[str, Any]], base: SchedulerConfig, registry: Registry
) -> None:
    """Check every variant before anything runs: its keys and values
    (:func:`apply_overrides`) and the policy they build (a knob only the policy
    checks), so a bad grid fails at once and names the variant, never at some load
    as a fault of the plugin.

    Raises:
        ValueError: ``variant 'LABEL': ...``, one line.
    """
    for label, overrides in variants.items():
        try:
            config = apply_overrides(base, overrides, registry)
            registry.make(config.policy, config.loop_order, config.options)
        except (ValueError, KeyError) as err:
            detail = err.args[0] if isinstance(err, KeyError) and err.args else err
            raise ValueError(f"variant {str(label)[:40]!r}: {detail}") from None


@dataclasses.dataclass(frozen=True)
class GridPoint:
    """One simulation of a sweep.

    Attributes:
        index: position in the grid (rows come back in this order).
        variant: the variant's label.
        overrides: its overrides of the base config (router keys included).
        request_rate: req/s for re-drawn arrivals, or None for the trace's times.
        num_replicas: replicas behind the variant's router (1: a single engine).
        seed: arrival seed.
        pd_ratio: ``(prefill, decode)`` replica counts of a disaggregated
            cluster (their sum is ``num_replicas``), or None for colocated replicas.
    """

    index: int
    variant: str
    overrides: Mapping[str, Any]
    request_rate: float | None
    num_replicas: int
    seed: int
    pd_ratio: tuple[int, int] | None = None

    @property
    def layout(self) -> str:
        """``"4"`` for 4 colocated replicas, ``"1P+3D"`` for a disaggregated cluster."""
        if self.pd_ratio is None:
            return str(self.num_replicas)
        return f"{self.pd_ratio[0]}P+{self.pd_ratio[1]}D"


def parse_replicas(entry: int | str) -> tuple[int, tuple[int, int] | None]:
    """A replica-axis entry: ``N`` (colocated) or ``"P:D"`` (P prefill + D decode).

    Returns:
        ``(num_replicas, pd_ratio or None)``.

    Raises:
        ValueError: on anything else, or a count < 1.
    """
    text = str(entry).strip()
    prefill, sep, decode = text.partition(":")
    counts: tuple[int, ...] = ()
    with contextlib.suppress(ValueError):
        counts = (int(prefill), int(decode)) if sep else (int(text),)
    if not counts or min(counts) < 1 or sum(counts) > MAX_REPLICAS:
        raise ValueError(
            f"num_replicas must be in [1, {MAX_REPLICAS}]: an entry is N (colocated replicas) "
            f"or 'P:D' (prefill:decode replicas); got {str(entry)[:40]!r}"
        )
    if len(counts) == 1:
        return counts[0], None
    return counts[0] + counts[1], (counts[0], counts[1])


@dataclasses.dataclass(frozen=True)
class GridInputs:
    """What every point shares (sent once to Ray's object store)."""

    requests: Sequence[Request]
    base: SchedulerConfig
    cost_model: CostModel
    burstiness: float = 1.0
    goodput: Mapping[str, float] | None = None
    kv_bytes_per_token: float = 0.0  # disaggregated points: prices the KV handoffs
    kv_transfer_link: LinkSpec | None = None
    num_gpus_per_replica: int = 1
    replicas: tuple[ReplicaSpec, ...] = ()  # explicit replicas (a replica config), or ()


MAX_GRID_POINTS = 10_000
"""Most points in one sweep or capacity grid: a 25,000-point grid was accepted and ran for
hours; split a larger study into sweeps."""


def _is_rate(value: Any) -> bool:
    """A request rate: a number > 0, ``inf`` allowed (all at t=0), never NaN or a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def grid_points(
    variants: Mapping[str, Mapping[str, Any]],
    request_rates: Iterable[float] | None = None,
    num_replicas: Iterable[int | str] = (1,),
    seeds: Iterable[int] = (0,),
) -> list[GridPoint]:
    """Every (seed, replicas, rate, variant) combination, in that nesting order.
    A replica entry is ``N`` or ``"P:D"`` (see :func:`parse_replicas`).

    Raises:
        ValueError: on an empty axis or a bad replica entry.
    """
    rates: list[float | None] = list(request_rates) if request_rates is not None else [None]
    seed_list, replica_list = list(seeds), list(num_replicas)
    size = len(variants) * len(rates) * len(replica_list) * len(seed_list)
    if size > MAX_GRID_POINTS:
        raise ValueError(
            f"the grid has {size} points (variants x rates x replica counts x seeds), more than "
            f"{MAX_GRID_POINTS}; split it into several sweeps"
        )
    for rate in rates:
        if rate is not None and not _is_rate(rate):
            raise ValueError(
                f"request_rates: each must be a number > 0 (or inf), got {rate!r}"[:160]
            )
    for seed in seed_list:
        if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63:
            raise ValueError(f"seeds: each must be an integer >= 0, got {seed!r}"[:160])
    replicas = [parse_replicas(n) for n in replica_list]
    if not variants or not rates or not replicas or not seed_list:
        raise ValueError("a sweep needs at least one variant, rate, replica count and seed")
    points: list[GridPoint] = []
    for seed in seed_list:
        for n, ratio in replicas:
            for rate in rates:
                for label, overrides in variants.items():
                    points.append(GridPoint(len(points), label, overrides, rate, n, seed, ratio))
    return points


def run_point(point: GridPoint, inputs: GridInputs, registry: Registry | None = None) -> dict:
    """Simulate one grid point and summarize it (one DataFrame row).

    Returns:
        ``variant``, ``policy``, ``router``, ``num_replicas``, ``replicas``
        (the layout, ``"4"`` or ``"1P+3D"``), ``num_gpus``, ``request_rate``,
        ``seed``, every summary key, ``sim_wall_s``.

    Raises:
        ValueError: on unknown override keys, or a disaggregated point without
            the inputs' KV size and link; PolicyError from the run.
    """
    reqs = list(inputs.requests)
    if point.request_rate is not None:
        reqs = workloads.rescale_arrivals(
            reqs, request_rate=point.request_rate, burstiness=inputs.burstiness, seed=point.seed
        )
    result = simulate_point(point, inputs, reqs, registry)
    router_name = result.router if hasattr(result, "router") else ""
    summary = summarize(
        result.records, duration_s=result.duration_s, goodput=inputs.goodput, itl=result.itl
    )
    return {
        "variant": point.variant,
        "policy": result.policy,
        "router": router_name,
        "num_replicas": point.num_replicas,
        "replicas": point_layout(point, inputs),
        "num_gpus": sum(s.num_gpus for s in point_replicas(point, inputs)),
        "request_rate": point.request_rate,
        "seed": point.seed,
        **summary,
        "sim_wall_s": result.wall_s,
    }


def simulate_point(
    point: GridPoint,
    inputs: GridInputs,
    requests: Sequence[Request],
    registry: Registry | None = None,
) -> Any:
    """Simulate ``requests`` (their own arrival times) on the point's setup: one
    engine, or its replicas behind its router.

    Returns:
        The ``SimulationResult`` or ``ClusterResult`` (``records`` without token
        times, ``itl`` as a histogram, ``duration_s``, ``policy``, ``wall_s``; a
        cluster's also ``router``).

    Raises:
        ValueError: on unknown override keys; PolicyError from the run.
    """
    registry = registry if registry is not None else load_registry()
    if point.num_replicas == 1 and "router" not in point.overrides and not inputs.replicas:
        config = apply_overrides(inputs.base, point.overrides)
        return simulate(
            requests, config, inputs.cost_model, registry=registry, keep_token_times=False
        )
    router, staleness = point_router(point, registry)
    return simulate_cluster(
        requests, point_replicas(point, inputs), router, registry=registry,
        router_staleness_s=staleness, kv_transfer_link=inputs.kv_transfer_link,
        keep_token_times=False,
    )  # fmt: skip


def point_router(point: GridPoint, registry: Registry) -> tuple[Router, float]:
    """The point's router (its variant's ``router`` and ``router_args``, checked by
    :func:`roseinfer.routing.build_router`) and ``router_staleness_s``.

    Raises:
        ValueError: on a non-finite or unknown router knob, or a bad staleness.
    """
    router_name = str(point.overrides.get("router", "round-robin"))
    router = build_router(
        registry.router(router_name), seed=point.seed,
        options=dict(point.overrides.get("router_args", {})),
        source=f"variant {point.variant!r} router_args",
    )  # fmt: skip
    staleness = point.overrides.get("router_staleness_s", 0.0)
    if isinstance(staleness, bool) or not (isinstance(staleness, (int, float)) and staleness >= 0):
        raise ValueError(
            f"variant {point.variant!r}: router_staleness_s must be a number >= 0, got "
            f"{str(staleness)[:40]!r}"
        )
    if math.isinf(staleness):
        raise ValueError(f"variant {point.variant!r}: router_staleness_s must be finite")
    return router, float(staleness)


def point_replicas(point: GridPoint, inputs: GridInputs) -> list[ReplicaSpec]:
    """The point's replicas, each with the point's scheduler overrides: the inputs'
    explicit replicas, or colocated copies of the base setup, or its prefill and
    decode replicas (``pd_ratio``)."""
    if inputs.replicas:
        return [
            dataclasses.replace(s, config=apply_overrides(s.config, point.overrides))
            for s in inputs.replicas
        ]
    config = apply_overrides(inputs.base, point.overrides)
    kv, gpus = inputs.kv_bytes_per_token, inputs.num_gpus_per_replica
    if point.pd_ratio is None:
        spec = ReplicaSpec("replica", config, inputs.cost_model, "mixed", kv, gpus)
        return [spec] * point.num_replicas
    num_p, num_d = point.pd_ratio
    prefill = ReplicaSpec("prefill", config, inputs.cost_model, "prefill", kv, gpus)
    decode = ReplicaSpec("decode", config, inputs.cost_model, "decode", kv, gpus)
    return [prefill] * num_p + [decode] * num_d


def point_layout(point: GridPoint, inputs: GridInputs) -> str:
    """The point's replica layout: ``"4"``, ``"1P+3D"``, or for explicit replicas
    their roles and GPUs, e.g. ``"P(2 GPUs)+D"``."""
    if not inputs.replicas:
        return point.layout
    parts = []
    for s in inputs.replicas:
        role = {"prefill": "P", "decode": "D", "mixed": "R"}[s.role]
        parts.append(role if s.num_gpus == 1 else f"{role}({s.num_gpus} GPUs)")
    return "+".join(parts)


def run_grid(
    requests: Sequence[Request],
    *,
    base: SchedulerConfig,
    cost_model: CostModel,
    variants: Mapping[str, Mapping[str, Any]],
    request_rates: Iterable[float] | None = None,
    num_replicas: Iterable[int | str] = (1,),
    seeds: Iterable[int] | None = None,
    burstiness: float = 1.0,
    seed: int = 0,
    goodput: Mapping[str, float] | None = None,
    registry: Registry | None = None,
    backend: str = "auto",
    ray_address: str | None = None,
    progress: bool = True,
    kv_bytes_per_token: float = 0.0,
    kv_transfer_link: LinkSpec | None = None,
    num_gpus_per_replica: int = 1,
) -> pd.DataFrame:
    """Simulate every variant at every request rate (and replica count, seed).

    Args:
        requests: the workload (lengths are kept; arrivals are re-drawn per rate).
        base: the shared scheduler config.
        cost_model: the simulator's cost model.
        variants: label -> overrides of ``base`` (see :func:`apply_overrides`),
            plus optional ``router``/``router_args``/``router_staleness_s``.
        request_rates: req/s values (vLLM bench semantics; ``inf`` = all at once);
            None keeps the workload's own arrival times.
        num_replicas: replica counts (homogeneous copies of ``base``); an entry
            ``"P:D"`` is P prefill + D decode replicas (then ``kv_bytes_per_token``
            and ``kv_transfer_link`` price the handoffs).
        seeds: arrival seeds (default ``[seed]``), the same for every variant
            (common random numbers).
        burstiness: gamma shape of inter-arrival gaps (1 = Poisson).
        goodput: SLOs in ms for ``request_goodput`` (e.g. ``{"ttft": 2000}``).
        backend: ``auto``, ``serial`` or ``ray`` (see the module docstring).
        ray_address: a running Ray cluster's address (default: start one locally).
        progress: show a tqdm bar on stderr.

    Returns:
        One row per point in grid order (see :func:`run_point`).

    Raises:
        ValueError: on an unknown backend or sweep key; ImportError when
            ``backend="ray"`` and Ray is not installed.
    """
    points = grid_points(
        variants, request_rates, num_replicas, list(seeds) if seeds is not None else [seed]
    )
    inputs = GridInputs(list(requests), base, cost_model, burstiness, goodput,
                        kv_bytes_per_token, kv_transfer_link, num_gpus_per_replica)  # fmt: skip
    checked = registry if registry is not None else load_registry()
    check_variants(variants, base, checked)  # fail fast, before any task starts
    for point in points:
        if point.num_replicas > 1 or "router" in point.overrides:
            point_router(point, checked)
    rows = map_points(
        lambda p, i: run_point(p, i, registry), points, inputs, backend, ray_address, progress
    )
    return pd.DataFrame(rows)


def resolve_backend(backend: str) -> str:
    """``auto`` becomes ``ray`` when Ray is importable, else ``serial``.

    Raises:
        ValueError: on an unknown name; ImportError for ``ray`` without Ray.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown sweep backend {backend!r}; known: {', '.join(BACKENDS)}")
    has_ray = importlib.util.find_spec("ray") is not None
    if backend == "ray" and not has_ray:
        raise ImportError("backend 'ray' needs Ray: pip install 'roseinfer[ray]'")
    if backend == "auto":
        return "ray" if has_ray else "serial"
    return backend


def map_points(
    fn: Callable[[Any, GridInputs], dict],
    items: Sequence[Any],
    inputs: GridInputs,
    backend: str = "auto",
    ray_address: str | None = None,
    progress: bool = True,
) -> list[dict]:
    """``[fn(item, inputs) for item in items]``, serially or as Ray tasks, with
    a progress bar; results keep the order of ``items``. With ``progress``, one
    line on stderr first says which backend runs them (``auto`` picks Ray when
    it is installed); Ray's own logging stays at warnings, in this process only.

    Raises:
        ValueError / ImportError: see :func:`resolve_backend`.
    """
    chosen = resolve_backend(backend)
    if progress:
        where = "this process" if chosen == "serial" else (ray_address or "a local Ray cluster")
        print(f"sweep: {len(items)} points, backend {chosen} ({where})", file=sys.stderr)
    bar = tqdm(total=len(items), disable=not progress, desc="sweep", unit="point")
    if chosen == "serial":
        out = []
        for item in items:
            out.append(fn(item, inputs))
            bar.update()
        bar.close()
        return out
    import ray

    if not ray.is_initialized():
        ray.init(
            address=ray_address, ignore_reinit_error=True, log_to_driver=False,
            logging_level=logging.WARNING,
        )  # fmt: skip
    remote = ray.remote(fn)
    shared = ray.put(inputs)
    futures = [remote.remote(item, shared) for item in items]
    pending = list(futures)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        bar.update(len(done))
    bar.close()
    return list(ray.get(futures))
