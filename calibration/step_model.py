"""Step models fitted to measured steps, and the cost model that prices with them.

A *sample* is one step shape with its measured seconds (:class:`ProfileSample`):
from ``rose-run profile``'s grid, or from the steps a real run logged
(``roseinfer.calibration.steplog``). A step's seconds are a linear combination
of a physically shaped basis of its batch shape (:data:`BASIS_TERMS`: a fixed
cost per step, per sequence, per token, the causal attention pairs and the
context gathered by prefills, the decode contexts read, hinges on the token
count) with non-negative coefficients (``scipy.optimize.nnls``, rows weighted
by ``1 / time`` so every sample counts by its relative error). The shape of
the basis follows the cost models of the field: BLIS's ``beta0 + beta1 *
prefill tokens + beta2 * decode tokens``, DistServe's ``a + b * tokens + c *
tokens^2`` prefill model, and the roofline's FLOP terms (see
``roseinfer.calibration.cost_model``); the token hinges let the fit bend from
the weight-streaming (flat) to the compute-bound (linear) regime, as a roofline
does. A piecewise-linear interpolation of the samples (LLMServingSim's method)
is fitted as well; the candidate with the lowest held-out error is kept
(:func:`fit_step_model`).

Needs numpy and scipy, never torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from roseinfer.calibration.cost_model import BatchShape, StepTotals, split_spread_seqs
from roseinfer.calibration.graph_replay import DECODE_GRAPHS, GraphReplay
from roseinfer.calibration.jitter import StepJitter
from roseinfer.metrics.schema import (
    MAX_EXTRAPOLATION,
    MAX_EXTRAPOLATION_AXIS,
    STEPS_OUTSIDE_FIT_SHARE,
)

BASIS_TERMS = (
    "step",  # 1 per step: op dispatch of every layer, Python, synchronize
    "seqs",  # per sequence: LM head row, sampling, input preparation, bookkeeping
    "tokens",  # per computed token: the linear layers, KV write
    "prefill_attn_pairs",  # causal (query, key) pairs of prefill chunks: attention FLOPs
    "prefill_context_tokens",  # context each prefill gathers from the paged cache
    "prefills",  # per prefill chunk: its own attention call per layer
    "decode_context_tokens",  # context each decode reads: memory-bound attention
)
"""Aggregates of a step's batch shape the linear models use, in column order."""
AGGREGATES = (*BASIS_TERMS, "decode_max_context")
"""The columns of :func:`shape_aggregates`: the basis, then the longest decode
context (read only by the GPU terms)."""
GPU_TERMS = (
    "eager",  # 1 for a step not replayed from a CUDA graph: host launches of every layer
    "decode_imbalance",  # the longest decode context's excess over the mean, spread
)
"""Features a step model of a CUDA-graph executor adds (``decode_spread_seqs`` >
0): a graph-replayed decode and an eager step differ by the launches, which a
linear basis cannot tell from a larger batch, and a decode batch's attention
ends with its longest context (see
:class:`~roseinfer.calibration.cost_model.RooflineCostModel`)."""

TRAIN_FRACTION = 0.8  # share of samples fitted on; the rest measure held-out error
SERVED_KIND_PREFIX = "served-"
"""Kind prefix of the samples a profile's served run logged (``served-decode``, ...):
one time each, host work included (``roseinfer.executor.profiler.served_samples``)."""
TOKEN_KNOT_FRACTIONS = (0.01, 0.03, 0.1, 0.3)  # hinge knots as fractions of the largest step


class ProfileError(ValueError):
    """A profile file that cannot be used (message names the problem and the fix)."""


@dataclass(frozen=True, slots=True)
class HeldOutError:
    """Relative error ``|predicted - measured| / measured`` on held-out samples.

    Attributes:
        median, p90, max: of the relative errors (fractions, 0.05 = 5%).
        num_samples: held-out samples.
    """

    median: float
    p90: float
    max: float
    num_samples: int

    @classmethod
    def of(cls, predicted: np.ndarray, measured: np.ndarray) -> HeldOutError:
        """Errors of ``predicted`` against ``measured`` (same length, seconds)."""
        rel = np.abs(np.asarray(predicted) - measured) / measured
        if rel.size == 0:
            return cls(float("nan"), float("nan"), float("nan"), 0)
        return cls(
            float(np.median(rel)), float(np.quantile(rel, 0.9)), float(rel.max()), int(rel.size)
        )


@dataclass(frozen=True, slots=True)
class ProfileSample:
    """One profiled step shape and its timings.

    Attributes:
        kind: ``prefill``, ``decode`` or ``mixed`` (what the grid meant to cover);
            ``served-`` and the step's kind for a step a served run logged.
        shape: the step's batch shape.
        times_s: seconds of each timed repetition (device part: inputs, forward,
            sampling, synchronize).
        host_s: modelled scheduler bookkeeping of the step (s).
    """

    kind: str
    shape: BatchShape
    times_s: tuple[float, ...]
    host_s: float = 0.0

    @property
    def median_s(self) -> float:
        """Median of the repetitions (s)."""
        return float(np.median(self.times_s))

    @property
    def target_s(self) -> float:
        """What a real step of this shape costs: device median + host bookkeeping (s)."""
        return self.median_s + self.host_s

    def to_json(self) -> dict[str, Any]:
        """The sample as a JSON-able dict (the ``samples`` rows of PROFILE.json)."""
        return {
            "kind": self.kind,
            "prefill_new_tokens": self.shape.prefill_new_tokens.tolist(),
            "prefill_context_tokens": self.shape.prefill_context_tokens.tolist(),
            "decode_context_tokens": self.shape.decode_context_tokens.tolist(),
            "times_s": list(self.times_s),
            "median_s": self.median_s,
            "host_s": self.host_s,
        }

    @classmethod
    def from_json(cls, row: Mapping[str, Any]) -> ProfileSample:
        """The inverse of :meth:`to_json`."""
        shape = BatchShape(
            np.asarray(row["prefill_new_tokens"], dtype=np.int64),
            np.asarray(row["prefill_context_tokens"], dtype=np.int64),
            np.asarray(row["decode_context_tokens"], dtype=np.int64),
        )
        times = tuple(float(t) for t in row["times_s"])
        return cls(str(row["kind"]), shape, times, float(row.get("host_s", 0.0)))


def shape_aggregates(shape: BatchShape) -> np.ndarray:
    """The :data:`AGGREGATES` of one step, float64 ``[len(AGGREGATES)]``.

    Prefill attention pairs count causal attention: a chunk of ``n`` new tokens
    ending at context ``c`` has ``n * c - n * (n - 1) / 2`` (query, key) pairs,
    as in :class:`~roseinfer.calibration.cost_model.RooflineCostModel`.
    """
    t = shape.totals()
    return np.array(
        [
            1.0 if t.num_seqs else 0.0,
            float(t.num_seqs),
            float(t.num_tokens),
            float(t.prefill_attn_pairs),
            float(t.prefill_context_tokens),
            float(t.num_prefills),
            float(t.decode_context_tokens),
            float(t.decode_max_context),
        ]
    )


def _decode_run_aggregates(context_tokens: np.ndarray, num_steps: int) -> np.ndarray:
    """Aggregates ``[num_steps, len(AGGREGATES)]`` of a pure-decode run whose
    contexts grow by one per step (vectorized :func:`shape_aggregates`)."""
    num_seqs = float(len(context_tokens))
    agg = np.zeros((num_steps, len(AGGREGATES)))
    agg[:, 0] = 1.0
    agg[:, 1] = num_seqs
    agg[:, 2] = num_seqs
    agg[:, 6] = float(context_tokens.sum()) + num_seqs * np.arange(num_steps)
    agg[:, 7] = float(context_tokens.max(initial=0)) + np.arange(num_steps)
    return agg


# ------------------------------------------------------------------ step models


@dataclass(frozen=True, slots=True)
class LinearStepModel:
    """``seconds = features(aggregates) @ coefficients``, coefficients >= 0.

    Features are the :data:`BASIS_TERMS` plus hinges ``max(0, tokens - knot)``
    for each knot in ``token_knots`` (a convex, non-decreasing response to the
    token count, like the roofline's ``max(bytes / bw, flops / peak)``), plus the
    :data:`GPU_TERMS` when ``decode_spread_seqs`` is set: 1 for a step that runs
    eagerly (by :attr:`graphs`), and
    ``(decodes x longest - summed decode context) / max(decodes, decode_spread_seqs)``.

    Attributes:
        name: candidate name (``linear``, ``hinge``).
        token_knots: hinge positions (tokens).
        coefficients: one per feature (s per unit).
        decode_spread_seqs: the decode batch at which the executor's attention
            stops splitting keys (0: no GPU terms; a CPU profile).
        graphs: which steps the executor replays from CUDA graphs (the eager
            term's rule; :class:`~roseinfer.calibration.graph_replay.GraphReplay`).
    """

    name: str
    token_knots: tuple[float, ...]
    coefficients: tuple[float, ...]
    decode_spread_seqs: float = 0.0
    graphs: GraphReplay = DECODE_GRAPHS

    @property
    def feature_names(self) -> list[str]:
        """Names of the features, in coefficient order."""
        gpu = GPU_TERMS if self.decode_spread_seqs > 0 else ()
        return [*BASIS_TERMS, *(f"tokens_over_{k:g}" for k in self.token_knots), *gpu]

    def predict(self, aggregates: np.ndarray) -> np.ndarray:
        """Seconds of each row of ``aggregates`` ``[n, len(BASIS_TERMS)]``.

        NOTE: summed column by column, not by a matrix product, so one row and
        a whole decode run give bit-identical seconds (the simulator's jump
        over decode runs must equal stepping one by one).
        """
        features = _features(aggregates, self.token_knots, self.decode_spread_seqs, self.graphs)
        total = np.zeros(len(features))
        for column, coefficient in zip(features.T, self.coefficients):
            total = total + column * coefficient
        return total

    @classmethod
    def fit(
        cls,
        name: str,
        aggregates: np.ndarray,
        targets_s: np.ndarray,
        knots: Sequence[float],
        decode_spread_seqs: float = 0.0,
        graphs: GraphReplay = DECODE_GRAPHS,
    ) -> LinearStepModel:
        """Non-negative least squares on relative error, fitting the *mean* step time,
        robust to a few outlying steps.

        Rows are scaled by ``1 / prediction`` (iteratively reweighted, starting
        from ``1 / target``), so every step counts by its relative error whatever
        its size, and the fit converges to the expected time of a shape: a
        simulation adds step times up, so noise must average out, not pull the
        fit towards the fast repetitions (scaling by ``1 / target`` alone fits
        low by about the spread of the noise). A step whose relative residual is
        far beyond the others' spread (a pause of the machine: one 2.4 s step
        among 20 ms ones) is down-weighted by Huber's weights
        (:func:`huber_weights`), so its pull on the fit is bounded instead of
        growing with its size; steps within the spread keep full weight, so the
        fit stays the mean of ordinary noise.

        Source: ``scipy.optimize.nnls`` (Lawson and Hanson's active-set method);
        iteratively reweighted least squares (Green, JRSS-B 1984); Huber's
        M-estimator (Huber, Ann. Math. Statist. 1964) with a MAD scale.
        """
        from scipy.optimize import nnls

        features = _features(aggregates, tuple(knots), decode_spread_seqs, graphs)
        scale = features.max(axis=0)
        scale[scale == 0] = 1.0  # a term absent from every sample keeps coefficient 0
        unit = features / scale
        weights, robust = targets_s, np.ones(len(targets_s))
        for _ in range(IRLS_ITERATIONS):
            rows = np.sqrt(robust) / weights
            solution, _ = nnls(unit * rows[:, None], targets_s * rows)
            predicted = unit @ solution
            weights = np.where(predicted > 0, predicted, targets_s)
            robust = huber_weights((targets_s - weights) / weights)
        coefficients = tuple((solution / scale).tolist())
        return cls(name, tuple(float(k) for k in knots), coefficients, decode_spread_seqs, graphs)

    def to_json(self) -> dict[str, Any]:
        """Fit description for PROFILE.json: names and coefficients."""
        doc: dict[str, Any] = {
            "kind": "linear",
            "name": self.name,
            "token_knots": list(self.token_knots),
            "coefficients": dict(zip(self.feature_names, self.coefficients)),
        }
        if self.decode_spread_seqs > 0:
            doc["decode_spread_seqs"] = self.decode_spread_seqs
        return doc


def _features(
    aggregates: np.ndarray,
    knots: tuple[float, ...],
    decode_spread_seqs: float = 0.0,
    graphs: GraphReplay = DECODE_GRAPHS,
) -> np.ndarray:
    """``[n, features]``: the basis columns, the token hinges, and the
    :data:`GPU_TERMS` when ``decode_spread_seqs`` > 0 (eager by ``graphs``)."""
    basis = aggregates[:, : len(BASIS_TERMS)]
    tokens = aggregates[:, 2:3]
    columns = [basis, *(np.maximum(0.0, tokens - k) for k in knots)]
    if decode_spread_seqs > 0:
        seqs = aggregates[:, 1]
        eager = graphs.runs_eagerly(aggregates[:, 2], seqs).astype(np.float64)
        decodes = seqs - aggregates[:, 5]
        excess = decodes * aggregates[:, 7] - aggregates[:, 6]
        spread = np.maximum(decodes, decode_spread_seqs)
        imbalance = np.where(excess > 0, excess / spread, 0.0)
        columns += [eager[:, None], imbalance[:, None]]
    return np.hstack(columns) if len(columns) > 1 else basis


@dataclass(frozen=True)
class InterpolatedStepModel:
    """Piecewise-linear interpolation of the samples (LLMServingSim's method), of
    their times, or of their ratios to a linear model with the :data:`GPU_TERMS`.

    The interpolation runs over three axes that carry most of a step's cost:
    prefill tokens, decode sequences and context tokens attended (prefill +
    decode), so a prefill and a decode batch never share a point; each axis is
    scaled to [0, 1] by its largest sample, and values are interpolated
    linearly (not in log space: LLMServingSim found log-space interpolation
    over-predicts by 9-14%) on a Delaunay triangulation. Shapes outside the
    samples' hull take ``fallback``'s price.

    When ``fallback`` has the GPU terms (a profile of a CUDA-graph executor),
    what is interpolated is each sample's time over ``fallback``'s price of the
    same shape, and a prediction is ``fallback``'s price times the interpolated
    ratio: exact at a sample, like an interpolation of the times, but what the
    three axes cannot see (the longest decode context, eager launches) stays with
    the linear terms instead of leaking from a sample to its neighbours. On one
    H100, interpolating the times priced the evenly spread decode batches of
    ``20-gpu-fidelity``'s runs at 60% load above the runs, because the profile's
    served run put skewed, slower decode batches at the same coordinates: p50
    TPOT +16% / +18% against the real runs, +3% / +5% with ratios
    (``benchmarks/gpu/results/h100-2026-11-27-checks``). Without GPU terms the
    linear basis sees nothing the axes miss, and the times are interpolated: a
    CPU step log of prefill-only and decode-only steps priced another policy's
    mixed steps closer that way (GPT-2 with 4 layers, 60 Azure conv requests at
    60% load, ``benchmarks/fidelity.py``'s case: p50 TPOT 131 ms simulated with
    times, 168 ms with ratios, about 104 ms measured).

    A ratio interpolation does not pass through single draws of eager steps (a
    served run's prefill and mixed steps, timed once): each holds the mean ratio
    of its :data:`EAGER_DRAW_NEIGHBOURS` nearest such draws. One draw spreads to
    1.8x its median on an H100 (the profile's jitter, priced apart), and a lone
    stretched prefill of 1,107 tokens had lifted a profile's price of a
    1,100-token prompt 11% above its linear model (``benchmarks/gpu/step_classes.py
    --draw-neighbours 1 --prompts 1100`` on ``h100-2026-11-27-checks/check20/p.json``).

    Attributes:
        name: ``interp``.
        points: ``[n, 3]`` sample coordinates; values: ``[n]`` seconds, or ratios
            to ``fallback`` when :attr:`relative` (mean per point).
        fallback: the linear model outside the hull (and the ratios' base).
    """

    name: str
    points: np.ndarray
    values: np.ndarray
    fallback: LinearStepModel

    def __post_init__(self) -> None:
        from scipy.interpolate import LinearNDInterpolator

        scale = self.points.max(axis=0) if len(self.points) else np.ones(3)
        scale[scale == 0] = 1.0
        object.__setattr__(self, "_scale", scale)
        try:
            interp = LinearNDInterpolator(self.points / scale, self.values, rescale=False)
        except Exception:  # noqa: BLE001 -- Qhull: too few or degenerate (coplanar) samples
            interp = None
        object.__setattr__(self, "_interp", interp)

    @staticmethod
    def interpolates_ratios(fallback: LinearStepModel) -> bool:
        """Whether an interpolation over ``fallback`` holds ratios to it: when it
        has the :data:`GPU_TERMS` (see the class)."""
        return fallback.decode_spread_seqs > 0

    @property
    def relative(self) -> bool:
        """Whether the values are ratios to ``fallback``."""
        return self.interpolates_ratios(self.fallback)

    @classmethod
    def of_samples(
        cls,
        name: str,
        aggregates: np.ndarray,
        targets_s: np.ndarray,
        fallback: LinearStepModel,
        eager_draws: np.ndarray | None = None,
    ) -> InterpolatedStepModel:
        """The interpolation of samples ``[n, len(AGGREGATES)]`` and their seconds:
        one point per distinct coordinate, holding the mean of its samples' times
        (or ratios, see the class). Gross outliers against ``fallback``
        (:func:`outliers`) are left out, and shapes it prices at zero when the
        values are ratios: a point's mean has no other way to ignore a pause of
        the machine. ``eager_draws`` (mask ``[n]``, :func:`eager_draws`) marks the
        samples whose ratios are averaged over their neighbours (see the class);
        None averages none. Times (no GPU terms) are never averaged."""
        keep = ~outliers(fallback, aggregates, targets_s)
        values = targets_s
        if cls.interpolates_ratios(fallback):
            base = fallback.predict(aggregates)
            keep &= base > 0
            values = targets_s / np.where(base > 0, base, 1.0)
            if eager_draws is not None:
                values = _neighbour_means(cls.coordinates(aggregates), values, eager_draws & keep)
        points, means = _mean_per_point(cls.coordinates(aggregates[keep]), values[keep])
        return cls(name, points, means, fallback)

    @staticmethod
    def coordinates(aggregates: np.ndarray) -> np.ndarray:
        """``[n, 3]``: prefill tokens, decode sequences, context tokens attended."""
        decodes = aggregates[:, 1] - aggregates[:, 5]  # sequences - prefill chunks
        prefill_tokens = aggregates[:, 2] - decodes
        return np.column_stack([prefill_tokens, decodes, aggregates[:, 4] + aggregates[:, 6]])

    def predict(self, aggregates: np.ndarray) -> np.ndarray:
        """Seconds of each row of ``aggregates``; ``fallback``'s price outside the hull."""
        interp = self._interp  # type: ignore[attr-defined]
        if interp is None:
            return self.fallback.predict(aggregates)
        values = interp(self.coordinates(aggregates) / self._scale)  # type: ignore[attr-defined]
        outside = np.isnan(values)
        if self.relative:
            base = self.fallback.predict(aggregates)
            return np.asarray(base * np.where(outside, 1.0, values), dtype=np.float64)
        if outside.any():
            values[outside] = self.fallback.predict(aggregates[outside])
        return np.asarray(values, dtype=np.float64)

    def to_json(self) -> dict[str, Any]:
        """Fit description for PROFILE.json (the samples themselves are the model)."""
        axes = ["prefill_tokens", "decode_seqs", "context_tokens"]
        values = "ratio to fallback" if self.relative else "seconds"
        return {"kind": "interp", "name": self.name, "axes": axes, "values": values}


StepModel = LinearStepModel | InterpolatedStepModel

IRLS_ITERATIONS = 6  # reweightings of the linear fits (converged to < 0.1% on step logs)
HUBER_K = 3.0
"""Residuals within this many robust standard deviations keep full weight: wide, so
ordinary step noise is averaged as a mean, and only gross outliers are damped."""
MIN_RELATIVE_NOISE = 0.01
"""Floor of the robust spread of relative residuals: a near-exact fit (synthetic
samples) must not turn 1% deviations into outliers."""
OUTLIER_SIGMAS = 10.0
"""A sample this many robust standard deviations off the robust linear fit is left
out of the interpolation (which has no other way to ignore it)."""


def _robust_sigma(relative_residuals: np.ndarray) -> float:
    """1.4826 x the median absolute deviation (a standard deviation for normal
    noise), at least :data:`MIN_RELATIVE_NOISE`."""
    r = relative_residuals
    mad = float(np.median(np.abs(r - np.median(r)))) if r.size else 0.0
    return max(1.4826 * mad, MIN_RELATIVE_NOISE)


def huber_weights(relative_residuals: np.ndarray) -> np.ndarray:
    """Huber's IRLS weights of residuals: 1 within ``HUBER_K`` robust standard
    deviations, ``limit / |r|`` beyond (so an outlier pulls like one at the limit)."""
    limit = HUBER_K * _robust_sigma(relative_residuals)
    size = np.abs(relative_residuals)
    return np.where(size <= limit, 1.0, limit / np.maximum(size, limit))


def outliers(model: LinearStepModel, aggregates: np.ndarray, targets_s: np.ndarray) -> np.ndarray:
    """Mask of the samples more than :data:`OUTLIER_SIGMAS` robust standard deviations
    off ``model``'s prediction (relative residuals)."""
    predicted = model.predict(aggregates)
    rel = (targets_s - predicted) / np.where(predicted > 0, predicted, targets_s)
    return np.abs(rel) > OUTLIER_SIGMAS * _robust_sigma(rel)


EAGER_DRAW_NEIGHBOURS = 30
"""How many eager single draws (:func:`eager_draws`) a ratio interpolation averages
per draw (:meth:`InterpolatedStepModel.of_samples`).

On the two H100 runs of ``20-gpu-fidelity`` of 2026-11-27, each priced by its own
profile under 4 step-jitter seeds (``python benchmarks/gpu/jitter_seeds.py
benchmarks/gpu/results/h100-2026-11-27-checks
benchmarks/gpu/results/h100-2026-11-27b-checks --seeds 4 --draw-neighbours 1,30``),
averaging took the mean |error| of the p50 metrics from 2.49% to 2.15% and of the
p99 metrics from 3.28% to 2.86%, but one p99 (TTFT of budget at 60% load in the
second run, set by a few stretched prefills) from -1.5% to -11.2%; 15 and 60
neighbours gave 2.16% / 3.27% and 2.17% / 2.89% (``--draw-neighbours 1,15,30,60``)."""


def _neighbour_means(points: np.ndarray, values: np.ndarray, draws: np.ndarray) -> np.ndarray:
    """``values`` with each of the ``draws`` (mask ``[n]``) replaced by the mean over
    its :data:`EAGER_DRAW_NEIGHBOURS` nearest draws (itself included), nearness in
    ``points`` ``[n, 3]`` scaled to [0, 1] per axis; unchanged with too few draws."""
    from scipy.spatial import cKDTree

    idx = np.flatnonzero(draws)
    if idx.size <= EAGER_DRAW_NEIGHBOURS:
        return values
    scale = points[idx].max(axis=0)
    scale[scale == 0] = 1.0
    scaled = points[idx] / scale
    _, nearest = cKDTree(scaled).query(scaled, k=EAGER_DRAW_NEIGHBOURS)
    out = values.copy()
    out[idx] = values[idx][nearest.reshape(idx.size, -1)].mean(axis=1)
    return out


def _mean_per_point(points: np.ndarray, values_s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One point per distinct coordinate, holding the mean of its values (a step
    log repeats a shape many times; an interpolation needs one value per point,
    and the mean, as the simulator sums step times)."""
    unique, inverse = np.unique(points, axis=0, return_inverse=True)
    inverse = inverse.reshape(-1)
    sums = np.bincount(inverse, weights=values_s, minlength=len(unique))
    counts = np.bincount(inverse, minlength=len(unique))
    return unique, sums / counts


CandidateFit = Callable[[np.ndarray, np.ndarray, np.ndarray], StepModel]


def _candidates(
    max_tokens: float, decode_spread_seqs: float = 0.0, graphs: GraphReplay = DECODE_GRAPHS
) -> dict[str, CandidateFit]:
    """The step-model candidates, each a function ``(aggregates, targets) -> model``
    (``decode_spread_seqs``, ``graphs``: :class:`LinearStepModel`'s)."""
    knots = tuple(
        sorted({round(f * max_tokens) for f in TOKEN_KNOT_FRACTIONS if f * max_tokens > 1})
    )

    def linear(agg: np.ndarray, y: np.ndarray, draws: np.ndarray) -> StepModel:
        return LinearStepModel.fit("linear", agg, y, (), decode_spread_seqs, graphs)

    def hinge(agg: np.ndarray, y: np.ndarray, draws: np.ndarray) -> StepModel:
        return LinearStepModel.fit("hinge", agg, y, knots, decode_spread_seqs, graphs)

    def interp(agg: np.ndarray, y: np.ndarray, draws: np.ndarray) -> StepModel:
        fallback = LinearStepModel.fit("hinge", agg, y, knots, decode_spread_seqs, graphs)
        return InterpolatedStepModel.of_samples("interp", agg, y, fallback, draws)

    return {"linear": linear, "hinge": hinge, "interp": interp}


@dataclass(frozen=True)
class StepFit:
    """The chosen step model and how every candidate did on held-out samples.

    Attributes:
        model: the chosen candidate, refitted on all samples.
        held_out: per candidate, its error on the held-out split.
        seed: seed of the random split; train_fraction: share fitted on.
        used: the candidate kept whatever the scores (``fit_step_model``'s ``use``).
        held_out_groups: the chosen candidate's held-out error on the grid's shapes
            and on a served run's steps apart (``grid``, ``served``), when the
            samples have both (:data:`SERVED_KIND_PREFIX`); else empty.
    """

    model: StepModel
    held_out: dict[str, HeldOutError]
    seed: int
    train_fraction: float = TRAIN_FRACTION
    used: str | None = None
    held_out_groups: dict[str, HeldOutError] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The ``fit`` section of PROFILE.json."""
        return {
            "chosen": self.model.name,
            "model": self.model.to_json(),
            "held_out": {k: dataclasses.asdict(v) for k, v in self.held_out.items()},
            "split_seed": self.seed,
            "train_fraction": self.train_fraction,
            "selection": f"{self.used}, as step logs use (held-out errors reported)"
            if self.used
            else "lowest median + p90 held-out relative error; a simpler "
            f"candidate wins unless beaten by {SIMPLER_WINS_WITHIN:.0%}",
            **(
                {
                    "held_out_groups": {
                        k: dataclasses.asdict(v) for k, v in self.held_out_groups.items()
                    }
                }
                if self.held_out_groups
                else {}
            ),
        }


def _split(num_samples: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    order = np.random.default_rng(seed).permutation(num_samples)
    num_train = max(1, int(round(TRAIN_FRACTION * num_samples)))
    return np.sort(order[:num_train]), np.sort(order[num_train:])


STEP_LOG_MODEL = "interp"
"""The candidate a calibration from step logs alone keeps (:func:`fit_step_model`'s
``use``); every candidate's held-out error is still measured and reported.

A step log samples the shapes a real run took, densely (hundreds of steps), so the
interpolation prices a logged shape by the mean of its own steps and a new shape
from its neighbours, where a linear basis must bend one line through a GEMM's
kernel choices by row count. The held-out rule does not see this: a random 20%
of a noisy run's steps scores every candidate mostly by the noise. What counts
is the simulation:
``benchmarks/steplog_candidates.py --rounds 3`` (the 16-request GPT-2 runs of
``../shared/checks/11-fidelity-steplog``, fifo and pack/decode-first, on this
project's 2-core VM) priced each run from its own log within a mean 1.0% (worst
4.2%) over p50/p99 TTFT, TPOT and E2EL with the interpolation, against 3.1%
(12.1%) as the held-out rule chose, and the other policy's run within 5.0%
(13.3%) against 5.7% (28.3%)."""


def fit_step_model(
    samples: Sequence[ProfileSample],
    seed: int = 0,
    use: str | None = None,
    decode_spread_seqs: float = 0.0,
    graphs: GraphReplay = DECODE_GRAPHS,
) -> StepFit:
    """Fit every candidate on a random split, keep the best, refit it on all samples.

    The score is median + p90 relative error on the held-out samples (20%):
    the median tracks typical steps (p50 metrics), the p90 the tails (p99).

    Args:
        samples: the measured steps.
        seed: of the random split.
        use: a candidate to keep whatever the scores (they are still measured);
            ``None``: the best score. Step logs pass :data:`STEP_LOG_MODEL`.
        decode_spread_seqs: > 0 adds the :data:`GPU_TERMS` to the linear models
            (:func:`decode_spread_seqs` of the profile's executor).
        graphs: which steps the profiled executor replayed from CUDA graphs
            (``GraphReplay.of_executor`` of its executor section).

    Raises:
        ProfileError: with fewer than 10 samples.
        ValueError: if ``use`` names no candidate.
    """
    if len(samples) < 10:
        raise ProfileError(f"a fit needs >= 10 profiled steps, got {len(samples)}")
    agg = np.vstack([shape_aggregates(s.shape) for s in samples])
    targets = np.array([s.target_s for s in samples])
    draws = eager_draws(samples, graphs)
    train, test = _split(len(samples), seed)
    candidates = _candidates(float(agg[:, 2].max()), decode_spread_seqs, graphs)
    if use is not None and use not in candidates:
        raise ValueError(f"use must be one of {', '.join(candidates)}, got {use!r}")
    held_out, predicted = {}, {}
    for name, fit in candidates.items():
        model = fit(agg[train], targets[train], draws[train])
        predicted[name] = model.predict(agg[test])
        held_out[name] = HeldOutError.of(predicted[name], targets[test])
    best = use or _select(held_out)
    served = np.array([s.kind.startswith(SERVED_KIND_PREFIX) for s in samples])[test]
    groups = {}
    if served.any() and not served.all():
        for group, mask in (("grid", ~served), ("served", served)):
            groups[group] = HeldOutError.of(predicted[best][mask], targets[test][mask])
    return StepFit(
        candidates[best](agg, targets, draws), held_out, seed, used=use, held_out_groups=groups
    )


def eager_draws(
    samples: Sequence[ProfileSample], graphs: GraphReplay = DECODE_GRAPHS
) -> np.ndarray:
    """Mask ``[n]`` of the samples timed once that ran eagerly by ``graphs`` (a
    served run's or a step log's prefill and mixed steps, under rose-run's default)."""
    out = np.zeros(len(samples), dtype=bool)
    for i, s in enumerate(samples):
        if len(s.times_s) == 1:
            t = s.shape.totals()
            out[i] = bool(graphs.runs_eagerly(t.num_tokens, t.num_seqs))
    return out


def decode_spread_seqs(executor: Mapping[str, Any], num_kv_heads: int | None) -> float:
    """The decode batch at which a profiled executor's attention stops splitting
    keys: its ``decode_split_programs`` (recorded on CUDA with CUDA graphs) over
    the model's KV heads; 0.0 when either is unknown (a CPU profile, an old file),
    so the step model has no :data:`GPU_TERMS`."""
    programs = executor.get("decode_split_programs") or 0
    graphs = executor.get("cuda_graph_batch_sizes") or ()
    if not (programs and graphs and num_kv_heads):
        return 0.0
    return split_spread_seqs(float(programs), num_kv_heads)


SIMPLER_WINS_WITHIN = 0.10  # a more complex candidate must beat a simpler one by 10%


def _select(held_out: dict[str, HeldOutError]) -> str:
    """The candidate with the lowest median + p90 held-out error; a simpler one
    (earlier in ``held_out``) wins unless beaten by :data:`SIMPLER_WINS_WITHIN`.

    NOTE: the held-out split is ~20 noisy shapes, so small score gaps are noise,
    and a parametric model extrapolates beyond the grid where interpolation
    cannot.
    """
    best = None
    for name, err in held_out.items():
        score = err.median + err.p90
        if best is None or score < (1 - SIMPLER_WINS_WITHIN) * best[1]:
            best = (name, score)
    assert best is not None
    return best[0]


# ------------------------------------------------------------------ fit range

RANGE_AXES = ("prefill tokens", "decode sequences", "context tokens")
"""The axes of :meth:`InterpolatedStepModel.coordinates`, as a warning names them."""


@dataclass(frozen=True, slots=True)
class SampleRange:
    """The largest step a fit saw on each of :data:`RANGE_AXES`: prefill tokens,
    decode sequences and context tokens attended in one step.

    A step beyond it on any axis is priced by extrapolating the fitted model, which
    can be far off (a model fitted on 32 small steps priced a queue of long ones at
    thousands of seconds).
    """

    max_prefill_tokens: float
    max_decode_seqs: float
    max_context_tokens: float

    @classmethod
    def of(cls, samples: Sequence[ProfileSample]) -> SampleRange:
        """The range of ``samples`` (at least one)."""
        agg = np.vstack([shape_aggregates(s.shape) for s in samples])
        top = InterpolatedStepModel.coordinates(agg).max(axis=0)
        return cls(float(top[0]), float(top[1]), float(top[2]))

    def counter(self) -> ExtrapolationCounter:
        """A fresh counter of one run's steps against this range."""
        return ExtrapolationCounter(self)


class ExtrapolationCounter:
    """Counts the steps one run priced outside a :class:`SampleRange`, and the largest
    factor by which a step exceeded it (a cost model stays immutable; the simulator
    keeps one counter per run).

    Args:
        sample_range: what the cost model was fitted on.
    """

    __slots__ = ("_limits", "num_steps", "num_outside", "max_factor", "axis")

    def __init__(self, sample_range: SampleRange) -> None:
        r = sample_range
        self._limits = (r.max_prefill_tokens, r.max_decode_seqs, r.max_context_tokens)
        self.num_steps = 0
        self.num_outside = 0
        self.max_factor = 1.0
        self.axis = ""

    def observe(self, totals: StepTotals, num_steps: int = 1) -> None:
        """Count ``num_steps`` steps starting with ``totals`` (the scheduler's
        :class:`~roseinfer.scheduler.StepTotals`); in a multi-step decode run each
        step's context grows by one token per sequence."""
        decodes = totals.num_seqs - totals.num_prefills
        prefill = totals.num_tokens - decodes
        context = totals.prefill_context_tokens + totals.decode_context_tokens
        growth = decodes if num_steps > 1 else 0
        last = context + growth * (num_steps - 1)
        max_prefill, max_decodes, max_context = self._limits
        self.num_steps += num_steps
        if prefill <= max_prefill and decodes <= max_decodes and last <= max_context:
            return
        if prefill > max_prefill or decodes > max_decodes or context > max_context:
            self.num_outside += num_steps
        else:  # the run crosses the context limit part-way
            self.num_outside += num_steps - int((max_context - context) // growth) - 1
        for value, limit, axis in zip((prefill, decodes, last), self._limits, RANGE_AXES):
            factor = value / max(limit, 1.0)
            if factor > self.max_factor:
                self.max_factor, self.axis = factor, axis

    def facts(self) -> dict[str, Any]:
        """The run's figures under the result keys of :mod:`roseinfer.metrics.summary`
        (share 0.0 when every step was in range)."""
        share = self.num_outside / self.num_steps if self.num_steps else 0.0
        return {
            STEPS_OUTSIDE_FIT_SHARE: share,
            MAX_EXTRAPOLATION: self.max_factor,
            MAX_EXTRAPOLATION_AXIS: self.axis or None,
        }


# ------------------------------------------------------------------ cost models


class ProfiledCostModel:
    """A :class:`~roseinfer.calibration.cost_model.CostModel` fitted from a profile.

    Prices steps of the profiled model on the profiled device. Vectorized for
    multi-step decode runs (one matrix product over the run's aggregates).

    Args:
        model: the fitted step model (see :func:`fit_step_model`).
        label: what was profiled, e.g. ``gpt2 float32 on cpu (2 threads)``.
        held_out: the chosen fit's held-out error, shown by :meth:`describe`.
        source: what the fit stands on, e.g. ``profile FILE, held-out median
            step error 4.6%`` (default: ``profile of LABEL``).
        sample_range: the largest steps it was fitted on; the simulator counts the
            steps it prices beyond them (:class:`ExtrapolationCounter`).
        jitter: the measured spread of step times around the fitted medians, which
            the simulator applies step by step (None: every step at its median).
            :meth:`step_time_s` and :meth:`decode_run_times_s` stay the medians.
    """

    name = "profiled"

    def __init__(
        self,
        model: StepModel,
        label: str,
        held_out: HeldOutError | None = None,
        source: str | None = None,
        sample_range: SampleRange | None = None,
        jitter: StepJitter | None = None,
    ) -> None:
        self.model = model
        self.label = label
        self.held_out = held_out
        self.fit_source = source or f"profile of {label}"
        self.sample_range = sample_range
        self.jitter = jitter

    @property
    def source(self) -> str:
        """What its numbers stand on: the fit's source, then the step jitter's summary."""
        jitter = f"; {self.jitter.summary()}" if self.jitter is not None else ""
        return self.fit_source + jitter

    @property
    def graphs(self) -> GraphReplay:
        """Which steps it prices as replayed from CUDA graphs (its step model's rule)."""
        model = self.model
        return model.graphs if isinstance(model, LinearStepModel) else model.fallback.graphs

    def without_jitter(self) -> ProfiledCostModel:
        """The same model pricing every step at its fitted median."""
        return ProfiledCostModel(
            self.model, self.label, self.held_out, self.fit_source, self.sample_range
        )

    def step_time_s(self, shape: BatchShape) -> float:
        """Seconds one step with this batch takes; 0.0 for an empty batch."""
        if shape.is_empty:
            return 0.0
        return float(self.model.predict(shape_aggregates(shape)[None, :])[0])

    def decode_run_times_s(self, context_tokens: np.ndarray, num_steps: int) -> np.ndarray:
        """Seconds of ``num_steps`` pure-decode steps; step ``j`` sees ``context_tokens + j``.

        Raises:
            ValueError: if ``num_steps < 0`` or a context is < 1.
        """
        context = BatchShape.decode(context_tokens).decode_context_tokens
        if num_steps < 0:
            raise ValueError(f"num_steps must be >= 0, got {num_steps}")
        if context.size == 0 or num_steps == 0:
            return np.zeros(num_steps, dtype=np.float64)
        return self.model.predict(_decode_run_aggregates(context, num_steps))

    def describe(self) -> str:
        """One line: what was profiled, the chosen fit and its held-out error."""
        err = self.held_out
        tail = (
            f"; held-out error median {err.median:.1%}, p90 {err.p90:.1%}"
            if err is not None and err.num_samples
            else ""
        )
        jitter = f"; {self.jitter.summary()}" if self.jitter is not None else ""
        return f"profiled: {self.label}; fit {self.model.name}{tail}{jitter}"

    def __repr__(self) -> str:
        return f"ProfiledCostModel({self.describe()})"
