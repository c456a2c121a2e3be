"""Step-time jitter: how much an executor's steps vary around their shape's median.

A fitted step model prices a shape by the *median* of its profiled repetitions
(:attr:`~roseinfer.calibration.step_model.ProfileSample.target_s`). Real steps
scatter around it. On one H100 (``benchmarks/gpu/results/h100-2026-11-26-checks``,
the four runs of ``20-gpu-fidelity``), 3-12% of the eager steps (any prefill
token) took over 1.25x what the run's own step log fits for their shape, 1.7-2.6x
at the 99th percentile, while CUDA-graph decodes stayed within 1.1-1.4x; the
profile's repetitions scatter alike (eager: 10% over 1.25x, p99 2.6-4x; graph
decodes: 0.5%, p99 1.14x). The stretch behaves like a host hiccup: it shows on
launch-bound steps (an eager prefill of a few hundred tokens: a 12 ms launch
roof, up to +35 ms) and hides behind GPU-bound ones (a 4,096-token prefill:
within 1.1x). Priced at medians, the runs at 60% load came out 28-33% low in p99
inter-token latency (a decode that waited for a stretched prefill), and 13% low
even priced by the run's own step log; with this jitter, 5-7% low.

:class:`StepJitter` keeps the measured ratios ``repetition / median`` of every
profiled shape, split into eager steps and graph-replayed decodes (one class for
an executor without CUDA graphs), and gives the simulator a factor per executed
step: step ``i`` of a run draws from the ratios of the :data:`NEIGHBOURS` profiled
shapes of its class whose medians are nearest its fitted time, with a random
number that depends only on ``(seed, stream, i)``. So a multi-step decode run
priced at once and the same steps priced one by one get the same factors (the
simulator's jump stays bit-identical), and a run is reproducible. The factors are
not normalized: their mean is the measured mean over the median, so a simulated
run's expected step times are the profile's means.

Needs numpy only.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from roseinfer.calibration.graph_replay import DECODE_GRAPHS, GraphReplay

MIN_REPETITIONS = 20
"""Fewest measured ratios (repetitions of shapes timed at least twice) a jitter is
built from; fewer give no jitter."""
CHUNK_STEPS = 4096
"""Steps whose random numbers are drawn together (one generator per chunk)."""


@functools.lru_cache(maxsize=64)
def _uniforms(seed: int, stream: int, chunk: int) -> np.ndarray:
    """``[CHUNK_STEPS]`` uniforms in [0, 1) of steps ``chunk * CHUNK_STEPS`` onward."""
    return np.random.default_rng([seed, stream, chunk]).random(CHUNK_STEPS)


NEIGHBOURS = 12
"""Profiled shapes whose repetitions make the ratio pool of a step: those of its
class whose medians are nearest its own fitted time (on a log scale)."""


@dataclass(frozen=True)
class _Pools:
    """One class's ratio pools: the medians of anchors ``k`` (sorted), the ratios
    of their :data:`NEIGHBOURS` nearest shapes ``ratios[k, :counts[k]]`` and their
    mean ``means_[k]``. A time belongs to the anchor whose median is nearest on a
    log scale: below ``thresholds[k]`` (the geometric mean of medians ``k`` and
    ``k + 1``; a tie goes to ``k``), so the array and the one-step lookups compare
    the same floats and agree bit for bit."""

    thresholds: np.ndarray
    ratios: np.ndarray
    counts: np.ndarray
    means_: np.ndarray
    thresholds_list: list[float]
    ratios_lists: list[list[float]]

    @classmethod
    def of(cls, shapes: list[tuple[float, np.ndarray]]) -> _Pools:
        shapes = sorted(shapes, key=lambda s: s[0])
        logs = np.log(np.array([m for m, _ in shapes]))
        pools = []
        for k in range(len(shapes)):
            nearest = np.argsort(np.abs(logs - logs[k]), kind="stable")[:NEIGHBOURS]
            pools.append(np.sort(np.concatenate([shapes[j][1] for j in nearest])))
        counts = np.array([len(p) for p in pools])
        ratios = np.ones((len(pools), int(counts.max())))
        for k, pool in enumerate(pools):
            ratios[k, : len(pool)] = pool
        thresholds = np.exp((logs[:-1] + logs[1:]) / 2)
        return cls(thresholds, ratios, counts, np.array([p.mean() for p in pools]),
                   thresholds.tolist(), [p.tolist() for p in pools])  # fmt: skip

    def anchors(self, times_s: np.ndarray) -> np.ndarray:
        """Index of the pool whose median is nearest each time (log scale)."""
        return np.searchsorted(self.thresholds, times_s, side="left")

    def pick(self, times_s: np.ndarray, u: np.ndarray) -> np.ndarray:
        """The ratio drawn by ``u`` (in [0, 1)) from the pool nearest each time."""
        anchor = self.anchors(times_s)
        return self.ratios[anchor, (u * self.counts[anchor]).astype(np.int64)]

    def pick_one(self, time_s: float, u: float) -> float:
        """:meth:`pick` of one step, without numpy (a few hundred ns)."""
        pool = self.ratios_lists[bisect.bisect_left(self.thresholds_list, time_s)]
        return pool[int(u * len(pool))]

    def means(self, times_s: np.ndarray) -> np.ndarray:
        """The mean ratio of the pool nearest each time."""
        return self.means_[self.anchors(times_s)]


@dataclass(frozen=True)
class StepJitter:
    """Measured step-time ratios and the seeded factor of every simulated step.

    A step's factor is drawn from the ratios ``repetition / median`` of the
    profiled shapes of its class (eager or graph-replayed) whose medians are
    nearest its fitted time: host hiccups stretch a launch-bound step (an eager
    12 ms prefill: up to 3x on the H100) and vanish behind a GPU-bound one (a
    110 ms prefill: within 1.1x), so one pool for all sizes would be wrong at both.

    Attributes:
        eager, graph: ``(median_s, ratios)`` of each profiled shape timed at least
            twice, per class; one may be empty (no CUDA graphs: every step draws
            from the eager pools, and the other way round).
        seed: of the factors.
        eager_only: graph-replayed steps keep their median (factor 1.0; ``graph``
            must be empty): a measured roofline carries only the eager spread
            (:data:`~roseinfer.calibration.specs.MEASURED_JITTER_FILE`).
        graphs: which steps are of the graph class
            (:class:`~roseinfer.calibration.graph_replay.GraphReplay`): those the
            repetitions were classified by, and the simulator classifies its steps by.
    """

    eager: tuple[tuple[float, tuple[float, ...]], ...]
    graph: tuple[tuple[float, tuple[float, ...]], ...]
    seed: int = 0
    eager_only: bool = False
    graphs: GraphReplay = DECODE_GRAPHS

    def __post_init__(self) -> None:
        if not self.eager and not self.graph:
            raise ValueError("a step jitter needs profiled repetitions")
        if self.eager_only and (self.graph or not self.eager):
            raise ValueError("an eager-only step jitter has eager shapes and no graph ones")
        pools = {}
        for name, shapes in (("eager", self.eager), ("graph", self.graph)):
            for median, ratios in shapes:
                if not median > 0 or not ratios or min(ratios) <= 0:
                    raise ValueError(f"{name} shape: median and ratios must be > 0")
            if shapes:
                pools[name] = _Pools.of([(m, np.asarray(r, dtype=np.float64)) for m, r in shapes])
        if "eager" not in pools:  # only graph decodes were timed more than once
            pools["eager"] = pools["graph"]
        pools.setdefault("graph", pools["eager"])
        object.__setattr__(self, "_pools", pools)

    @classmethod
    def of_repetitions(
        cls,
        shapes: Iterable[tuple[float, float, tuple[float, ...]]],
        graphs: GraphReplay,
        seed: int = 0,
    ) -> StepJitter | None:
        """The jitter of profiled shapes, each ``(num_tokens, num_seqs, times_s)``.

        Shapes timed once carry no spread and are skipped. ``graphs``: which steps
        the executor replayed from CUDA graphs (none: one class for all steps).
        Returns None with fewer than :data:`MIN_REPETITIONS` ratios.
        """
        eager: list[tuple[float, tuple[float, ...]]] = []
        graph: list[tuple[float, tuple[float, ...]]] = []
        for num_tokens, num_seqs, times_s in shapes:
            if len(times_s) < 2:
                continue
            times = np.asarray(times_s, dtype=np.float64)
            median = float(np.median(times))
            if median <= 0:
                continue
            pool = eager if graphs.runs_eagerly(num_tokens, num_seqs) else graph
            pool.append((median, tuple((times / median).tolist())))
        if sum(len(r) for _, r in eager + graph) < MIN_REPETITIONS:
            return None
        return cls(tuple(eager), tuple(graph), seed, graphs=graphs)

    def factors(
        self, first_step: int, eager: np.ndarray, times_s: np.ndarray, stream: int = 0
    ) -> np.ndarray:
        """Factors of steps ``first_step .. first_step + n - 1`` of one run.

        Args:
            first_step: index of the first step in its run (0-based).
            eager: per step, whether it runs eagerly (bool ``[n]``).
            times_s: per step, its fitted (median) time (s, ``[n]``).
            stream: which run of a simulation (a cluster's replica index).

        Returns:
            float64 ``[n]``: each step's ratio.
        """
        n = len(eager)
        if n == 0:
            return np.zeros(0)
        first_chunk, last_chunk = first_step // CHUNK_STEPS, (first_step + n - 1) // CHUNK_STEPS
        u = np.concatenate(
            [_uniforms(self.seed, stream, c) for c in range(first_chunk, last_chunk + 1)]
        )
        offset = first_step - first_chunk * CHUNK_STEPS
        u = u[offset : offset + n]
        times = np.asarray(times_s, dtype=np.float64)
        pools = self._pools  # type: ignore[attr-defined]
        graph = 1.0 if self.eager_only else pools["graph"].pick(times, u)
        return np.where(np.asarray(eager, dtype=bool), pools["eager"].pick(times, u), graph)

    def mean_factors(self, eager: np.ndarray, times_s: np.ndarray) -> np.ndarray:
        """The expected factor of steps of these classes and times: the mean ratio
        of the pool each would draw from (float64 ``[n]``)."""
        times = np.asarray(times_s, dtype=np.float64)
        pools = self._pools  # type: ignore[attr-defined]
        graph = 1.0 if self.eager_only else pools["graph"].means(times)
        return np.where(np.asarray(eager, dtype=bool), pools["eager"].means(times), graph)

    def factor(self, step: int, eager: bool, time_s: float, stream: int = 0) -> float:
        """The factor of one step: :meth:`factors` of one, bit for bit, without
        building arrays (the simulator calls it once per executed step)."""
        if self.eager_only and not eager:
            return 1.0
        u = float(_uniforms(self.seed, stream, step // CHUNK_STEPS)[step % CHUNK_STEPS])
        pools = self._pools  # type: ignore[attr-defined]
        return pools["eager" if eager else "graph"].pick_one(time_s, u)

    def summary(self) -> str:
        """``step jitter of N repetitions (eager: mean x1.09, p99 x2.6; graph: ...)``."""
        parts, count = [], 0
        for name, shapes in (("eager", self.eager), ("graph", self.graph)):
            if shapes:
                a = np.concatenate([np.asarray(r) for _, r in shapes])
                count += len(a)
                parts.append(f"{name} mean x{a.mean():.2f}, p99 x{np.quantile(a, 0.99):.2f}")
        graphs = "; graph-replayed steps at medians" if self.eager_only else ""
        return f"step jitter of {count} repetitions ({'; '.join(parts)}{graphs})"

    def to_json(self) -> dict[str, Any]:
        """The profiled shapes' medians and ratios, and the seed, as JSON."""
        return {
            "eager": [[m, list(r)] for m, r in self.eager],
            "graph": [[m, list(r)] for m, r in self.graph],
            "seed": self.seed,
            "eager_only": self.eager_only,
            "graphs": self.graphs.mode,
        }
