"""Profiled cost models: step times fitted from the executor's own measurements.

``rose-run profile`` times real steps of one model on one device over a grid
of batch shapes and writes ``PROFILE.json`` (schema below). This module reads
it and prices the simulator's steps with it; it needs numpy and scipy, never
torch, so ``rose-sim --cost-model PROFILE.json`` runs without the executor.

Two models come out of one profile:

* :class:`ProfiledCostModel` (same model shape as profiled): a step's seconds
  are a linear combination of a physically shaped basis of the batch shape
  (:data:`BASIS_TERMS`: a fixed cost per step, per sequence, per token, the
  causal attention pairs and the context gathered by prefills, the decode
  contexts read, hinges on the token count) with non-negative coefficients
  (``scipy.optimize.nnls``, rows weighted by ``1 / time`` so every sample
  counts by its relative error). The shape of the basis follows the cost
  models of the field: BLIS's ``beta0 + beta1 * prefill tokens + beta2 *
  decode tokens``, DistServe's ``a + b * tokens + c * tokens^2`` prefill model,
  and the roofline's FLOP terms (see ``roseinfer.simulator.cost_model``); the
  token hinges let the fit bend from the weight-streaming (flat) to the
  compute-bound (linear) regime, as a roofline does. A piecewise-linear
  interpolation of the samples (LLMServingSim's method) is fitted as well;
  the candidate with the lowest held-out error is kept (:func:`fit_step_model`).
* the calibrated roofline (:func:`calibrate_roofline`): the same samples fit
  the roofline's device constants (achievable FLOP/s, achievable bandwidth,
  per-step overhead), so the profile prices *another* model shape on the same
  device (``rose-sim --cost-model PROFILE.json --model OTHER``).

PROFILE.json (``"schema": "roseinfer-profile/1"``)::

    schema, created, profile_wall_s
    model:        {name, spec: ModelSpec fields (dtype_bytes = profiled dtype)}
    executor:     {device, dtype, attention_backend, num_kv_blocks, block_size,
                   kv_cache_bytes, kv_cache_budget_bytes, max_model_len, max_num_seqs,
                   max_num_batched_tokens}                  rose-sim's defaults
    environment:  {torch, python, platform, processor, cpu_count, num_threads,
                   num_interop_threads, omp_wait_policy, cuda_device,
                   load_average_before, load_average}
    grid:         {repetitions, seed, num_samples}
    host:         {per_step_s, per_seq_s, per_token_s, num_steps}   scheduler bookkeeping
    warmup:       [{name, num_seqs, num_tokens, times_s}]
    fit:          {chosen, model: {kind, name, token_knots, coefficients | fallback},
                   held_out: {candidate: {median, p90, max, num_samples}},
                   split_seed, train_fraction, selection}
    calibrated_roofline: {device: DeviceSpec fields, overhead: OverheadModel fields,
                   achievable_flops, achievable_bandwidth, held_out}
    samples:      [{kind, prefill_new_tokens, prefill_context_tokens,
                    decode_context_tokens, times_s, median_s, host_s}]
    overhead_samples: [{num_layers, ...same as samples}]   skeleton steps

A sample's target is ``median_s + host_s``: the measured device part (input
preparation, forward, sampling, synchronize) plus the modelled scheduler
bookkeeping of a step with that many sequences.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from roseinfer.simulator.cost_model import BatchShape, RooflineCostModel
from roseinfer.simulator.specs import DeviceSpec, ModelSpec

__all__ = [
    "BASIS_TERMS",
    "PROFILE_SCHEMA",
    "CalibratedRoofline",
    "CalibratedRooflineCostModel",
    "OverheadModel",
    "OverheadSample",
    "family_of",
    "HeldOutError",
    "Profile",
    "ProfileError",
    "ProfiledCostModel",
    "ProfileSample",
    "calibrate_roofline",
    "fit_step_model",
    "load_profile",
    "shape_aggregates",
]

PROFILE_SCHEMA = "roseinfer-profile/1"

BASIS_TERMS = (
    "step",  # 1 per step: op dispatch of every layer, Python, synchronize
    "seqs",  # per sequence: LM head row, sampling, input preparation, bookkeeping
    "tokens",  # per computed token: the linear layers, KV write
    "prefill_attn_pairs",  # causal (query, key) pairs of prefill chunks: attention FLOPs
    "prefill_context_tokens",  # context each prefill gathers from the paged cache
    "prefills",  # per prefill chunk: its own attention call per layer
    "decode_context_tokens",  # context each decode reads: memory-bound attention
)
"""Aggregates of a step's batch shape the fitted models use, in column order."""

TRAIN_FRACTION = 0.8  # share of samples fitted on; the rest measure held-out error
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
        kind: ``prefill``, ``decode`` or ``mixed`` (what the grid meant to cover).
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
    """The :data:`BASIS_TERMS` of one step, float64 ``[len(BASIS_TERMS)]``.

    Prefill attention pairs count causal attention: a chunk of ``n`` new tokens
    ending at context ``c`` has ``n * c - n * (n - 1) / 2`` (query, key) pairs,
    as in :class:`~roseinfer.simulator.cost_model.RooflineCostModel`.
    """
    new, context = shape.prefill_new_tokens, shape.prefill_context_tokens
    decode = shape.decode_context_tokens
    pairs = int((new * context - new * (new - 1) // 2).sum())
    return np.array(
        [
            1.0 if shape.num_seqs else 0.0,
            float(shape.num_seqs),
            float(shape.num_tokens),
            float(pairs),
            float(context.sum()),
            float(len(new)),
            float(decode.sum()),
        ]
    )


def _decode_run_aggregates(context_tokens: np.ndarray, num_steps: int) -> np.ndarray:
    """Aggregates ``[num_steps, len(BASIS_TERMS)]`` of a pure-decode run whose
    contexts grow by one per step (vectorized :func:`shape_aggregates`)."""
    num_seqs = float(len(context_tokens))
    agg = np.zeros((num_steps, len(BASIS_TERMS)))
    agg[:, 0] = 1.0
    agg[:, 1] = num_seqs
    agg[:, 2] = num_seqs
    agg[:, 6] = float(context_tokens.sum()) + num_seqs * np.arange(num_steps)
    return agg


# ------------------------------------------------------------------ step models


@dataclass(frozen=True, slots=True)
class LinearStepModel:
    """``seconds = features(aggregates) @ coefficients``, coefficients >= 0.

    Features are the :data:`BASIS_TERMS` plus hinges ``max(0, tokens - knot)``
    for each knot in ``token_knots`` (a convex, non-decreasing response to the
    token count, like the roofline's ``max(bytes / bw, flops / peak)``).

    Attributes:
        name: candidate name (``linear``, ``hinge``).
        token_knots: hinge positions (tokens).
        coefficients: one per feature (s per unit).
    """

    name: str
    token_knots: tuple[float, ...]
    coefficients: tuple[float, ...]

    @property
    def feature_names(self) -> list[str]:
        """Names of the features, in coefficient order."""
        return [*BASIS_TERMS, *(f"tokens_over_{k:g}" for k in self.token_knots)]

    def predict(self, aggregates: np.ndarray) -> np.ndarray:
        """Seconds of each row of ``aggregates`` ``[n, len(BASIS_TERMS)]``.

        NOTE: summed column by column, not by a matrix product, so one row and
        a whole decode run give bit-identical seconds (the simulator's jump
        over decode runs must equal stepping one by one).
        """
        features = _features(aggregates, self.token_knots)
        total = np.zeros(len(features))
        for column, coefficient in zip(features.T, self.coefficients):
            total = total + column * coefficient
        return total

    @classmethod
    def fit(
        cls, name: str, aggregates: np.ndarray, targets_s: np.ndarray, knots: Sequence[float]
    ) -> LinearStepModel:
        """Non-negative least squares on relative error (rows scaled by ``1 / target``).

        Source: ``scipy.optimize.nnls`` (Lawson and Hanson's active-set method).
        """
        from scipy.optimize import nnls

        features = _features(aggregates, tuple(knots))
        scale = features.max(axis=0)
        scale[scale == 0] = 1.0  # a term absent from every sample keeps coefficient 0
        weighted = features / scale / targets_s[:, None]
        solution, _ = nnls(weighted, np.ones(len(targets_s)))
        return cls(name, tuple(float(k) for k in knots), tuple((solution / scale).tolist()))

    def to_json(self) -> dict[str, Any]:
        """Fit description for PROFILE.json: names and coefficients."""
        return {
            "kind": "linear",
            "name": self.name,
            "token_knots": list(self.token_knots),
            "coefficients": dict(zip(self.feature_names, self.coefficients)),
        }


def _features(aggregates: np.ndarray, knots: tuple[float, ...]) -> np.ndarray:
    tokens = aggregates[:, 2:3]
    hinges = [np.maximum(0.0, tokens - k) for k in knots]
    return np.hstack([aggregates, *hinges]) if hinges else aggregates


@dataclass(frozen=True)
class InterpolatedStepModel:
    """Piecewise-linear interpolation of the samples (LLMServingSim's method).

    Over three axes that carry most of a step's cost: prefill tokens, decode
    sequences and context tokens attended (prefill + decode), so a prefill and a
    decode batch never share a point; each axis is scaled to [0, 1] by its
    largest sample, and values are interpolated linearly (not in log space:
    LLMServingSim found log-space interpolation over-predicts by 9-14%) on a
    Delaunay triangulation. Shapes outside the samples' hull take ``fallback``.

    Attributes:
        name: ``interp``.
        points: ``[n, 3]`` sample coordinates; values_s: ``[n]`` seconds.
        fallback: the linear model used outside the hull.
    """

    name: str
    points: np.ndarray
    values_s: np.ndarray
    fallback: LinearStepModel

    def __post_init__(self) -> None:
        from scipy.interpolate import LinearNDInterpolator

        scale = self.points.max(axis=0)
        scale[scale == 0] = 1.0
        object.__setattr__(self, "_scale", scale)
        try:
            interp = LinearNDInterpolator(self.points / scale, self.values_s, rescale=False)
        except Exception:  # noqa: BLE001 -- Qhull: too few or degenerate (coplanar) samples
            interp = None
        object.__setattr__(self, "_interp", interp)

    @staticmethod
    def coordinates(aggregates: np.ndarray) -> np.ndarray:
        """``[n, 3]``: prefill tokens, decode sequences, context tokens attended."""
        decodes = aggregates[:, 1] - aggregates[:, 5]  # sequences - prefill chunks
        prefill_tokens = aggregates[:, 2] - decodes
        return np.column_stack([prefill_tokens, decodes, aggregates[:, 4] + aggregates[:, 6]])

    def predict(self, aggregates: np.ndarray) -> np.ndarray:
        """Seconds of each row of ``aggregates``; the fallback outside the hull."""
        interp = self._interp  # type: ignore[attr-defined]
        if interp is None:
            return self.fallback.predict(aggregates)
        values = interp(self.coordinates(aggregates) / self._scale)  # type: ignore[attr-defined]
        outside = np.isnan(values)
        if outside.any():
            values[outside] = self.fallback.predict(aggregates[outside])
        return np.asarray(values, dtype=np.float64)

    def to_json(self) -> dict[str, Any]:
        """Fit description for PROFILE.json (the samples themselves are the model)."""
        axes = ["prefill_tokens", "decode_seqs", "context_tokens"]
        return {"kind": "interp", "name": self.name, "axes": axes}


StepModel = LinearStepModel | InterpolatedStepModel

CandidateFit = Callable[[np.ndarray, np.ndarray], StepModel]


def _candidates(max_tokens: float) -> dict[str, CandidateFit]:
    """The step-model candidates, each a function ``(aggregates, targets) -> model``."""
    knots = tuple(
        sorted({round(f * max_tokens) for f in TOKEN_KNOT_FRACTIONS if f * max_tokens > 1})
    )

    def linear(agg: np.ndarray, y: np.ndarray) -> StepModel:
        return LinearStepModel.fit("linear", agg, y, ())

    def hinge(agg: np.ndarray, y: np.ndarray) -> StepModel:
        return LinearStepModel.fit("hinge", agg, y, knots)

    def interp(agg: np.ndarray, y: np.ndarray) -> StepModel:
        fallback = LinearStepModel.fit("hinge", agg, y, knots)
        return InterpolatedStepModel("interp", InterpolatedStepModel.coordinates(agg), y, fallback)

    return {"linear": linear, "hinge": hinge, "interp": interp}


@dataclass(frozen=True)
class StepFit:
    """The chosen step model and how every candidate did on held-out samples.

    Attributes:
        model: the chosen candidate, refitted on all samples.
        held_out: per candidate, its error on the held-out split.
        seed: seed of the random split; train_fraction: share fitted on.
    """

    model: StepModel
    held_out: dict[str, HeldOutError]
    seed: int
    train_fraction: float = TRAIN_FRACTION

    def to_json(self) -> dict[str, Any]:
        """The ``fit`` section of PROFILE.json."""
        return {
            "chosen": self.model.name,
            "model": self.model.to_json(),
            "held_out": {k: dataclasses.asdict(v) for k, v in self.held_out.items()},
            "split_seed": self.seed,
            "train_fraction": self.train_fraction,
            "selection": "lowest median + p90 held-out relative error; a simpler "
            f"candidate wins unless beaten by {SIMPLER_WINS_WITHIN:.0%}",
        }


def _split(num_samples: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    order = np.random.default_rng(seed).permutation(num_samples)
    num_train = max(1, int(round(TRAIN_FRACTION * num_samples)))
    return np.sort(order[:num_train]), np.sort(order[num_train:])


def fit_step_model(samples: Sequence[ProfileSample], seed: int = 0) -> StepFit:
    """Fit every candidate on a random split, keep the best, refit it on all samples.

    The score is median + p90 relative error on the held-out samples (20%):
    the median tracks typical steps (p50 metrics), the p90 the tails (p99).

    Raises:
        ProfileError: with fewer than 10 samples.
    """
    if len(samples) < 10:
        raise ProfileError(f"a fit needs >= 10 profiled steps, got {len(samples)}")
    agg = np.vstack([shape_aggregates(s.shape) for s in samples])
    targets = np.array([s.target_s for s in samples])
    train, test = _split(len(samples), seed)
    candidates = _candidates(float(agg[:, 2].max()))
    held_out = {}
    for name, fit in candidates.items():
        model = fit(agg[train], targets[train])
        held_out[name] = HeldOutError.of(model.predict(agg[test]), targets[test])
    best = _select(held_out)
    return StepFit(candidates[best](agg, targets), held_out, seed)


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


# ------------------------------------------------------------------ cost models


class ProfiledCostModel:
    """A :class:`~roseinfer.simulator.cost_model.CostModel` fitted from a profile.

    Prices steps of the profiled model on the profiled device. Vectorized for
    multi-step decode runs (one matrix product over the run's aggregates).

    Args:
        model: the fitted step model (see :func:`fit_step_model`).
        label: what was profiled, e.g. ``gpt2 float32 on cpu (2 threads)``.
        held_out: the chosen fit's held-out error, shown by :meth:`describe`.
    """

    name = "profiled"

    def __init__(self, model: StepModel, label: str, held_out: HeldOutError | None = None) -> None:
        self.model = model
        self.label = label
        self.held_out = held_out

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
        return f"profiled: {self.label}; fit {self.model.name}{tail}"

    def __repr__(self) -> str:
        return f"ProfiledCostModel({self.describe()})"


# ------------------------------------------------------------- calibrated roofline

RIDGE_GRID = np.geomspace(1e-2, 1e4, 241)  # FLOPs per byte scanned by the roofline fit
OVERHEAD_TERMS = (
    "per_step_s",
    "per_layer_s",
    "per_seq_s",
    "per_seq_layer_s",
    "per_prefill_layer_s",
)


FAMILIES = ("gpt2", "llama")  # architecture families the executor runs (skeletons of each)
COMBINES = ("max", "sum")  # how compute and memory time add up in a step


def family_of(model: ModelSpec) -> str:
    """``llama`` for gated-MLP models (Llama, Qwen2, Mistral), else ``gpt2``."""
    return "llama" if model.gated_mlp else "gpt2"


@dataclass(frozen=True, slots=True)
class OverheadSample:
    """A step timed on a *skeleton*: an architecture with tiny widths.

    Its time is what a step costs besides FLOPs and bytes (op dispatch per
    layer, input preparation, sampling, Python), measured at ``num_layers``.

    Attributes:
        family: ``gpt2`` or ``llama`` (see :func:`family_of`).
        num_layers: skeleton depth; sample: its shape and timings.
    """

    family: str
    num_layers: int
    sample: ProfileSample

    def to_json(self) -> dict[str, Any]:
        """``{family, num_layers, **sample}`` for PROFILE.json's ``overhead_samples``."""
        return {"family": self.family, "num_layers": self.num_layers, **self.sample.to_json()}

    @classmethod
    def from_json(cls, row: Mapping[str, Any]) -> OverheadSample:
        """The inverse of :meth:`to_json`."""
        return cls(str(row["family"]), int(row["num_layers"]), ProfileSample.from_json(row))


@dataclass(frozen=True, slots=True)
class OverheadModel:
    """Seconds a step costs besides the roofline: ``per_step + per_layer * layers +
    per_seq * seqs + per_seq_layer * seqs * layers + per_prefill_layer * layers *
    prefills`` (each prefill chunk makes its own attention call in every layer;
    each decode its share of the context gather and masking in every layer).

    Attributes:
        per_step_s, per_layer_s, per_seq_s, per_seq_layer_s, per_prefill_layer_s:
            fitted seconds (>= 0).
    """

    per_step_s: float = 0.0
    per_layer_s: float = 0.0
    per_seq_s: float = 0.0
    per_seq_layer_s: float = 0.0
    per_prefill_layer_s: float = 0.0

    def seconds(self, num_layers: int, aggregates: np.ndarray) -> np.ndarray:
        """Overhead of each row of ``aggregates`` ``[n, len(BASIS_TERMS)]`` (s)."""
        return _overhead_design(num_layers, aggregates) @ np.array(
            [getattr(self, name) for name in OVERHEAD_TERMS]
        )

    @classmethod
    def fit(cls, samples: Sequence[OverheadSample]) -> OverheadModel:
        """Non-negative least squares on relative error over skeleton steps."""
        from scipy.optimize import nnls

        design = np.vstack(
            [
                _overhead_design(o.num_layers, shape_aggregates(o.sample.shape)[None])
                for o in samples
            ]
        )
        targets = np.array([o.sample.target_s for o in samples])
        scale = design.max(axis=0)
        scale[scale == 0] = 1.0
        coef, _ = nnls(design / scale / targets[:, None], np.ones(len(targets)))
        return cls(*(coef / scale).tolist())


def _overhead_design(num_layers: int, aggregates: np.ndarray) -> np.ndarray:
    """``[n, 5]``: step, layers, seqs, seqs x layers, prefills x layers."""
    ones, seqs = np.ones(len(aggregates)), aggregates[:, 1]
    return np.column_stack(
        [ones, num_layers * ones, seqs, num_layers * seqs, num_layers * aggregates[:, 5]]
    )


_HUGE = 1e30  # a peak that never binds: the roofline then returns its other term


class CalibratedRooflineCostModel:
    """The roofline with fitted device rates plus a fitted dispatch overhead.

    ``combine(FLOPs / achieved FLOP/s, bytes / achieved B/s) + overhead(layers,
    seqs, prefills)``, where ``combine`` is ``max`` (compute and memory traffic
    overlap, the classic roofline) or ``sum`` (they do not: eager ops on a CPU
    run one after another, each bound by one or the other); the profile picks
    the one with the lower held-out error. The FLOPs and bytes come from the
    model's shape (:class:`~roseinfer.simulator.cost_model.RooflineCostModel`),
    so rates fitted on one model price another shape on the same device. The
    overhead is added, not overlapped: on a CPU every op runs synchronously
    after its dispatch (on a GPU launches overlap long kernels, so this
    over-predicts large steps there).

    Args:
        model: the shape to price; device: achieved rates (its ``overhead_s``
            is ignored); overhead: the fitted overhead model of the model's
            architecture family; combine: ``max`` or ``sum``.

    Raises:
        ValueError: on another ``combine``.
    """

    name = "calibrated-roofline"

    def __init__(
        self, model: ModelSpec, device: DeviceSpec, overhead: OverheadModel, combine: str = "max"
    ) -> None:
        if combine not in COMBINES:
            raise ValueError(f"combine must be one of {COMBINES}, got {combine!r}")
        self.model, self.device, self.overhead, self.combine = model, device, overhead, combine
        free = dataclasses.replace(device, overhead_s=0.0)
        if combine == "max":
            self._terms = [RooflineCostModel(model, free)]
        else:  # one roofline per term: the other term's peak never binds
            compute = dataclasses.replace(free, mem_bandwidth=_HUGE)
            memory = dataclasses.replace(free, peak_flops=_HUGE)
            self._terms = [RooflineCostModel(model, compute), RooflineCostModel(model, memory)]

    def step_time_s(self, shape: BatchShape) -> float:
        """Seconds one step with this batch takes; 0.0 for an empty batch."""
        if shape.is_empty:
            return 0.0
        extra = self.overhead.seconds(self.model.num_layers, shape_aggregates(shape)[None])
        return sum(t.step_time_s(shape) for t in self._terms) + float(extra[0])

    def decode_run_times_s(self, context_tokens: np.ndarray, num_steps: int) -> np.ndarray:
        """Seconds of ``num_steps`` pure-decode steps; step ``j`` sees ``context_tokens + j``.

        Raises:
            ValueError: if ``num_steps < 0`` or a context is < 1.
        """
        runs = [t.decode_run_times_s(context_tokens, num_steps) for t in self._terms]
        times = runs[0] if len(runs) == 1 else runs[0] + runs[1]
        if len(context_tokens) == 0 or num_steps == 0:
            return times
        agg = _decode_run_aggregates(np.asarray(context_tokens, dtype=np.int64), 1)
        return times + float(self.overhead.seconds(self.model.num_layers, agg)[0])

    def describe(self) -> str:
        """One line: model, achieved rates, how they combine, the overhead terms."""
        d, o = self.device, self.overhead
        return (
            f"calibrated roofline: {self.model.name} ({self.model.dtype_bytes}-byte weights) "
            f"on {d.name}; {self.combine}({d.achievable_flops / 1e9:.4g} GFLOP/s, "
            f"{d.achievable_bandwidth / 1e9:.4g} GB/s); overhead {o.per_step_s * 1e3:.3g} ms "
            f"+ {o.per_layer_s * 1e3:.3g} ms/layer + {o.per_seq_s * 1e3:.3g} ms/seq "
            f"+ {o.per_seq_layer_s * 1e3:.3g} ms/seq/layer "
            f"+ {o.per_prefill_layer_s * 1e3:.3g} ms/prefill/layer"
        )

    def __repr__(self) -> str:
        return f"CalibratedRooflineCostModel({self.describe()})"


@dataclass(frozen=True)
class CalibratedRoofline:
    """Roofline device rates and overheads fitted to a profile, and their held-out error.

    Attributes:
        device: a :class:`DeviceSpec` whose ``achievable_flops`` and
            ``achievable_bandwidth`` are the fitted rates (``mfu`` and
            ``bandwidth_efficiency`` relative to the datasheet peaks of the
            matching built-in device when one matches and the fit stays below
            its peak; else the peak is the achieved rate and the efficiency 1);
            ``overhead_s`` is the overhead of a one-sequence step of the
            profiled model.
        overheads: the fitted overhead model per architecture family; a family
            without skeleton samples takes the profiled model's.
        combine: ``max`` or ``sum`` (see :class:`CalibratedRooflineCostModel`).
        held_out: error on the held-out samples of the chosen combine, fitted
            on the training split; held_out_by_combine: both combines' errors.
    """

    device: DeviceSpec
    overheads: dict[str, OverheadModel]
    combine: str
    held_out: HeldOutError
    held_out_by_combine: dict[str, HeldOutError] = dataclasses.field(default_factory=dict)
    profiled_family: str = "gpt2"

    def overhead_of(self, model: ModelSpec) -> OverheadModel:
        """The overhead model of ``model``'s family (else the profiled model's)."""
        default = self.overheads.get(self.profiled_family, OverheadModel())
        return self.overheads.get(family_of(model), default)

    def cost_model(self, model: ModelSpec) -> CalibratedRooflineCostModel:
        """The calibrated roofline of ``model`` on this device."""
        return CalibratedRooflineCostModel(
            model, self.device, self.overhead_of(model), self.combine
        )

    def to_json(self) -> dict[str, Any]:
        """The ``calibrated_roofline`` section of PROFILE.json."""
        device = self.device
        return {
            "device": dataclasses.asdict(device),
            "combine": self.combine,
            "overheads": {k: dataclasses.asdict(v) for k, v in self.overheads.items()},
            "profiled_family": self.profiled_family,
            "achievable_flops": device.achievable_flops,
            "achievable_bandwidth": device.achievable_bandwidth,
            "held_out": dataclasses.asdict(self.held_out),
            "held_out_by_combine": {
                k: dataclasses.asdict(v) for k, v in self.held_out_by_combine.items()
            },
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> CalibratedRoofline:
        """The inverse of :meth:`to_json`."""
        return cls(
            DeviceSpec(**doc["device"]),
            {k: OverheadModel(**v) for k, v in doc["overheads"].items()},
            str(doc["combine"]),
            HeldOutError(**doc["held_out"]),
            {k: HeldOutError(**v) for k, v in doc.get("held_out_by_combine", {}).items()},
            str(doc.get("profiled_family", "gpt2")),
        )


def _roofline_terms(model: ModelSpec, samples: Sequence[ProfileSample]) -> np.ndarray:
    """``[n, 2]``: FLOPs and bytes of each sample's step under ``model``."""
    probe = RooflineCostModel(model, _UNIT_DEVICE)
    return np.array([[probe.flops(s.shape), probe.memory_bytes(s.shape)] for s in samples])


_UNIT_DEVICE = DeviceSpec(
    name="unit", peak_flops=1.0, mem_bandwidth=1.0, mem_bytes=1, mfu=1.0,
    bandwidth_efficiency=1.0, overhead_s=0.0,
)  # fmt: skip


def _fit_rates(
    terms: np.ndarray,
    targets_s: np.ndarray,
    overhead_s: np.ndarray,
    combine: str,
    fit_intercept: bool,
) -> tuple[float, float, float]:
    """``(s per FLOP, s per byte, extra s per step)`` minimizing squared relative
    error of ``combine(flops * a, bytes * b) + overhead (+ intercept)``.

    ``sum`` is one non-negative least squares. For ``max`` and a fixed ridge
    ``r = b / a`` the model is linear in ``a`` (and the intercept), so each ridge
    of :data:`RIDGE_GRID` is one non-negative least squares; the best ridge wins.
    """
    from scipy.optimize import nnls

    rest = (targets_s - overhead_s) / targets_s
    ones = [np.ones(len(targets_s))] if fit_intercept else []
    if combine == "sum":
        scale = terms.max(axis=0)
        design = np.column_stack([*(terms / scale).T, *ones]) / targets_s[:, None]
        coef, _ = nnls(design, rest)
        return coef[0] / scale[0], coef[1] / scale[1], float(coef[2]) if fit_intercept else 0.0
    best: tuple[float, float, float, float] | None = None
    for ridge in RIDGE_GRID:
        work = np.maximum(terms[:, 0], terms[:, 1] * ridge)
        design = np.column_stack([work / work.max(), *ones]) / targets_s[:, None]
        coef, residual = nnls(design, rest)
        if best is None or residual < best[0]:
            a = coef[0] / work.max()
            best = (residual, a, a * ridge, float(coef[1]) if fit_intercept else 0.0)
    assert best is not None
    return best[1], best[2], best[3]


def _predict_rates(
    terms: np.ndarray, rates: tuple[float, float, float], combine: str
) -> np.ndarray:
    a, b, c = rates
    joined = np.maximum if combine == "max" else np.add
    return joined(terms[:, 0] * a, terms[:, 1] * b) + c


def calibrate_roofline(
    model: ModelSpec,
    samples: Sequence[ProfileSample],
    base: DeviceSpec | None = None,
    seed: int = 0,
    overhead_samples: Sequence[OverheadSample] = (),
) -> CalibratedRoofline:
    """Fit the roofline's device rates and overheads to profiled steps of ``model``.

    The overheads come from ``overhead_samples`` (skeleton steps at two depths
    per architecture family separate a per-layer from a per-step cost); without
    them the overhead is one constant per step fitted with the rates, which
    cannot tell a constant overhead from streaming the weights (both are the
    same every step of one model), so it transfers worse to other shapes. Both
    combines (``max``, ``sum``) are fitted on a random 80% of ``samples``; the
    one with the lower median + p90 error on the other 20% is refitted on all.

    Args:
        model: the profiled model's shape (``dtype_bytes`` = the profiled dtype).
        samples: profiled steps of ``model``.
        base: the built-in spec of this device kind (datasheet peaks), or None.
        seed: seed of the held-out split.
        overhead_samples: skeleton steps (see :class:`OverheadSample`).

    Raises:
        ProfileError: with fewer than 10 samples.
    """
    if len(samples) < 10:
        raise ProfileError(f"a fit needs >= 10 profiled steps, got {len(samples)}")
    overheads = {
        fam: OverheadModel.fit([o for o in overhead_samples if o.family == fam])
        for fam in FAMILIES
        if any(o.family == fam for o in overhead_samples)
    }
    family = family_of(model)
    own = overheads.get(family, OverheadModel())
    agg = np.vstack([shape_aggregates(s.shape) for s in samples])
    over = own.seconds(model.num_layers, agg)
    terms = _roofline_terms(model, samples)
    targets = np.array([s.target_s for s in samples])
    intercept = not overheads
    train, test = _split(len(samples), seed)
    held_out = {}
    for combine in COMBINES:
        rates = _fit_rates(terms[train], targets[train], over[train], combine, intercept)
        predicted = _predict_rates(terms[test], rates, combine) + over[test]
        held_out[combine] = HeldOutError.of(predicted, targets[test])
    combine = min(held_out, key=lambda k: held_out[k].median + held_out[k].p90)
    a, b, c = _fit_rates(terms, targets, over, combine, intercept)
    if intercept:
        overheads[family] = own = dataclasses.replace(own, per_step_s=c)
    one_seq = own.seconds(model.num_layers, shape_aggregates(BatchShape.decode([1]))[None])
    device = _device_spec(a, b, float(one_seq[0]), base)
    return CalibratedRoofline(device, overheads, combine, held_out[combine], held_out, family)


def _device_spec(
    s_per_flop: float, s_per_byte: float, overhead_s: float, base: DeviceSpec | None
) -> DeviceSpec:
    """A DeviceSpec reaching ``1 / s_per_flop`` FLOP/s and ``1 / s_per_byte`` B/s."""
    # NOTE: a term no sample was bound by fits to 0 s/unit; cap it at 1e18 per s.
    flops = 1.0 / max(s_per_flop, 1e-18)
    bandwidth = 1.0 / max(s_per_byte, 1e-18)
    peak_flops = max(base.peak_flops, flops) if base else flops
    peak_bw = max(base.mem_bandwidth, bandwidth) if base else bandwidth
    return DeviceSpec(
        name=f"{base.name if base else 'device'} (calibrated)",
        peak_flops=peak_flops,
        mem_bandwidth=peak_bw,
        mem_bytes=base.mem_bytes if base else 1,
        mfu=flops / peak_flops,
        bandwidth_efficiency=bandwidth / peak_bw,
        overhead_s=overhead_s,
        dtype_bytes=base.dtype_bytes if base else 4,
    )


# ------------------------------------------------------------------ the profile


def _step_model_from_json(doc: Mapping[str, Any], samples: Sequence[ProfileSample]) -> StepModel:
    """Rebuild a stored step model; an interpolation is rebuilt from the samples."""
    if doc["kind"] == "interp":
        agg = np.vstack([shape_aggregates(s.shape) for s in samples])
        targets = np.array([s.target_s for s in samples])
        fallback = _step_model_from_json(doc["fallback"], samples)
        assert isinstance(fallback, LinearStepModel)
        return InterpolatedStepModel(
            str(doc["name"]), InterpolatedStepModel.coordinates(agg), targets, fallback
        )
    knots = tuple(float(k) for k in doc["token_knots"])
    model = LinearStepModel(str(doc["name"]), knots, ())
    coefficients = tuple(float(doc["coefficients"][n]) for n in model.feature_names)
    return dataclasses.replace(model, coefficients=coefficients)


def _step_model_json(model: StepModel) -> dict[str, Any]:
    doc = model.to_json()
    if isinstance(model, InterpolatedStepModel):
        doc["fallback"] = model.fallback.to_json()
    return doc


@dataclass(frozen=True)
class Profile:
    """A loaded (or freshly measured) PROFILE.json with its fitted models.

    Attributes:
        model_name: what ``--model`` named when profiling.
        model_spec: the profiled model's shape (``dtype_bytes`` = profiled dtype).
        executor: the executor setup: device, dtype, attention_backend,
            num_kv_blocks, block_size, kv_cache_bytes, kv_cache_budget_bytes
            (memory the pool was sized from, before the cap rose-run applies),
            max_model_len, max_num_seqs, max_num_batched_tokens.
        environment: torch version, threads, platform facts.
        samples: the profiled steps.
        step_fit: the chosen step model and every candidate's held-out error.
        roofline: the calibrated roofline constants.
        overhead_samples: skeleton steps the roofline's overhead was fitted on.
        extra: the other top-level sections (grid, host, timings), kept as read.
    """

    model_name: str
    model_spec: ModelSpec
    executor: dict[str, Any]
    environment: dict[str, Any]
    samples: list[ProfileSample]
    step_fit: StepFit
    roofline: CalibratedRoofline
    overhead_samples: list[OverheadSample] = dataclasses.field(default_factory=list)
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def create(
        cls,
        *,
        model_name: str,
        model_spec: ModelSpec,
        executor: dict[str, Any],
        environment: dict[str, Any],
        samples: Sequence[ProfileSample],
        base_device: DeviceSpec | None = None,
        seed: int = 0,
        overhead_samples: Sequence[OverheadSample] = (),
        extra: dict[str, Any] | None = None,
    ) -> Profile:
        """Fit both models to freshly measured ``samples`` (see the module doc).

        Raises:
            ProfileError: with fewer than 10 samples.
        """
        samples = list(samples)
        return cls(
            model_name=model_name,
            model_spec=model_spec,
            executor=dict(executor),
            environment=dict(environment),
            samples=samples,
            step_fit=fit_step_model(samples, seed),
            roofline=calibrate_roofline(model_spec, samples, base_device, seed, overhead_samples),
            overhead_samples=list(overhead_samples),
            extra=dict(extra or {}),
        )

    # ----------------------------------------------------------- pricing
    @property
    def label(self) -> str:
        """``gpt2 float32 on cpu (2 threads)``: what the profile measured."""
        env, ex = self.environment, self.executor
        threads = f" ({env['num_threads']} threads)" if env.get("num_threads") else ""
        return f"{self.model_name} {ex.get('dtype', '')} on {ex.get('device', '?')}{threads}"

    def same_shape(self, model: ModelSpec) -> bool:
        """True when ``model`` computes what the profiled model computes (names aside)."""
        mine = dataclasses.replace(self.model_spec, name="")
        return dataclasses.replace(model, name="") == mine

    def cost_model(
        self, model: ModelSpec | None = None
    ) -> ProfiledCostModel | CalibratedRooflineCostModel:
        """The profiled cost model for the profiled shape (``model`` None or the same
        shape); the calibrated roofline of ``model`` for any other shape."""
        if model is None or self.same_shape(model):
            held_out = self.step_fit.held_out.get(self.step_fit.model.name)
            return ProfiledCostModel(self.step_fit.model, self.label, held_out)
        return self.roofline.cost_model(model)

    def scheduler_defaults(
        self,
        model: ModelSpec | None = None,
        block_size: int | None = None,
        max_num_seqs: int | None = None,
    ) -> dict[str, int]:
        """``num_kv_blocks``, ``block_size`` and ``max_model_len`` the executor used.

        For another model or block size the pool is sized as ``rose-run`` sizes it:
        the profiled pool's memory budget (``kv_cache_budget_bytes``: 1 GiB on
        CPU, the free share on CUDA) over the KV bytes of a block, capped at
        ``max_num_seqs`` requests of ``max_model_len``. On a GPU another model's
        weights change what is free: pass ``--num-kv-blocks`` there.
        """
        ex = self.executor
        same_model = model is None or self.same_shape(model)
        block_size = block_size or int(ex["block_size"])
        spec = model if model is not None else self.model_spec
        max_len = int(ex["max_model_len"]) if same_model else spec.max_model_len
        if same_model and block_size == ex["block_size"]:
            num_blocks = int(ex["num_kv_blocks"])
        else:
            budget = int(ex.get("kv_cache_budget_bytes", ex["kv_cache_bytes"]))
            num_blocks = max(1, budget // (spec.kv_bytes_per_token * block_size))
            max_seqs = max_num_seqs or int(ex.get("max_num_seqs", 1 << 30))
            num_blocks = min(num_blocks, max_seqs * -(-max_len // block_size))
        return {"num_kv_blocks": num_blocks, "block_size": block_size, "max_model_len": max_len}

    # ------------------------------------------------------------ files
    def to_json(self) -> dict[str, Any]:
        """The PROFILE.json document."""
        fit = self.step_fit.to_json()
        fit["model"] = _step_model_json(self.step_fit.model)
        return {
            "schema": PROFILE_SCHEMA,
            **{k: v for k, v in self.extra.items() if k not in ("samples",)},
            "model": {"name": self.model_name, "spec": dataclasses.asdict(self.model_spec)},
            "executor": self.executor,
            "environment": self.environment,
            "fit": fit,
            "calibrated_roofline": self.roofline.to_json(),
            "samples": [s.to_json() for s in self.samples],
            "overhead_samples": [o.to_json() for o in self.overhead_samples],
        }

    def save(self, path: str | Path) -> None:
        """Write :meth:`to_json` to ``path`` (parents created)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Profile:
        """Read a PROFILE.json document (fits as stored, not refitted).

        Raises:
            ProfileError: on another schema or a missing section.
        """
        if doc.get("schema") != PROFILE_SCHEMA:
            raise ProfileError(
                f"not a roseinfer profile (schema {doc.get('schema')!r}, expected "
                f"{PROFILE_SCHEMA!r}); make one with `rose-run profile --output FILE`"
            )
        try:
            samples = [ProfileSample.from_json(row) for row in doc["samples"]]
            fit = doc["fit"]
            step_fit = StepFit(
                _step_model_from_json(fit["model"], samples),
                {k: HeldOutError(**v) for k, v in fit["held_out"].items()},
                int(fit["split_seed"]),
                float(fit["train_fraction"]),
            )
            roofline = CalibratedRoofline.from_json(doc["calibrated_roofline"])
            overhead = [OverheadSample.from_json(r) for r in doc.get("overhead_samples", [])]
            known = {"schema", "model", "executor", "environment", "fit", "calibrated_roofline"}
            extra = {
                k: v for k, v in doc.items() if k not in known | {"samples", "overhead_samples"}
            }
            return cls(
                model_name=str(doc["model"]["name"]),
                model_spec=ModelSpec(**doc["model"]["spec"]),
                executor=dict(doc["executor"]),
                environment=dict(doc["environment"]),
                samples=samples,
                step_fit=step_fit,
                roofline=roofline,
                overhead_samples=overhead,
                extra=extra,
            )
        except (KeyError, TypeError, ValueError) as err:
            raise ProfileError(
                f"profile is incomplete or damaged ({err!r}); re-run `rose-run profile`"
            ) from None


def load_profile(path: str | Path) -> Profile:
    """Read ``PROFILE.json`` written by ``rose-run profile``.

    Raises:
        ProfileError: if the file is missing, not JSON, or not a profile.
    """
    try:
        doc = json.loads(Path(path).read_text())
    except OSError as err:
        raise ProfileError(f"cannot read profile {path}: {err.strerror}") from None
    except json.JSONDecodeError as err:
        raise ProfileError(f"profile {path} is not JSON ({err})") from None
    if not isinstance(doc, dict):
        raise ProfileError(f"profile {path} is not a JSON object")
    return Profile.from_json(doc)
