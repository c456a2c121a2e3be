"""The calibrated roofline: the roofline's device rates fitted to measured steps.

The same samples that fit a step model (:mod:`roseinfer.calibration.step_model`)
fit the roofline's device constants (achievable FLOP/s, achievable bandwidth)
plus a dispatch overhead measured on *skeletons* (tiny-width models of each
architecture family at two depths), so a profile of one model prices
*another* model shape on the same device (``rose-sim --cost-model PROFILE.json
--model OTHER``).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from roseinfer.calibration.cost_model import BatchShape, RooflineCostModel
from roseinfer.calibration.graph_replay import DECODE_GRAPHS, runs_eagerly
from roseinfer.calibration.specs import (
    DeviceSpec,
    Measurement,
    ModelSpec,
    Provenance,
)
from roseinfer.calibration.step_model import (
    HeldOutError,
    ProfileError,
    ProfileSample,
    _decode_run_aggregates,
    _split,
    shape_aggregates,
)

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
    model's shape (:class:`~roseinfer.calibration.cost_model.RooflineCostModel`),
    so rates fitted on one model price another shape on the same device. The
    overhead is added, not overlapped: on a CPU every op runs synchronously
    after its dispatch (on a GPU launches overlap long kernels, so this
    over-predicts large steps there).

    Args:
        model: the shape to price; device: achieved rates (its ``overhead_s``
            is ignored); overhead: the fitted overhead model of the model's
            architecture family; combine: ``max`` or ``sum``; source: what the
            rates stand on (``calibrated roofline from FILE``).

    Raises:
        ValueError: on another ``combine``.
    """

    name = "calibrated-roofline"

    def __init__(
        self,
        model: ModelSpec,
        device: DeviceSpec,
        overhead: OverheadModel,
        combine: str = "max",
        source: str = "calibrated roofline",
    ) -> None:
        if combine not in COMBINES:
            raise ValueError(f"combine must be one of {COMBINES}, got {combine!r}")
        self.model, self.device, self.overhead, self.combine = model, device, overhead, combine
        self.source = source
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

    def cost_model(
        self, model: ModelSpec, source: str = "calibrated roofline"
    ) -> CalibratedRooflineCostModel:
        """The calibrated roofline of ``model`` on this device (``source``: what it
        was calibrated from)."""
        return CalibratedRooflineCostModel(
            model, self.device, self.overhead_of(model), self.combine, source
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
        device = dict(doc["device"])
        if device.get("provenance") is not None:
            prov = dict(device["provenance"])
            device["provenance"] = Provenance(**{**prov, "models": tuple(prov.get("models", ()))})
        return cls(
            DeviceSpec(**device),
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
    *,
    refine: bool = False,
) -> tuple[float, float, float]:
    """``(s per FLOP, s per byte, extra s per step)`` minimizing squared relative
    error of ``combine(flops * a, bytes * b) + overhead (+ intercept)``.

    ``sum`` is one non-negative least squares. For ``max`` and a fixed ridge
    ``r = b / a`` the model is linear in ``a`` (and the intercept), so each ridge
    of :data:`RIDGE_GRID` is one non-negative least squares; the best ridge wins,
    and with ``refine`` it is then searched between its grid neighbours (bounded
    scalar minimization on log ridge), which recovers the rates of exact data.
    """
    from scipy.optimize import minimize_scalar, nnls

    rest = (targets_s - overhead_s) / targets_s
    ones = [np.ones(len(targets_s))] if fit_intercept else []
    if combine == "sum":
        scale = terms.max(axis=0)
        design = np.column_stack([*(terms / scale).T, *ones]) / targets_s[:, None]
        coef, _ = nnls(design, rest)
        return coef[0] / scale[0], coef[1] / scale[1], float(coef[2]) if fit_intercept else 0.0

    def at(ridge: float) -> tuple[float, float, float, float]:
        work = np.maximum(terms[:, 0], terms[:, 1] * ridge)
        design = np.column_stack([work / work.max(), *ones]) / targets_s[:, None]
        coef, residual = nnls(design, rest)
        a = coef[0] / work.max()
        return residual, a, a * ridge, float(coef[1]) if fit_intercept else 0.0

    fits = [at(ridge) for ridge in RIDGE_GRID]
    best = min(range(len(fits)), key=lambda i: fits[i][0])
    if refine:
        low, high = (
            np.log(RIDGE_GRID[max(0, best - 1)]),
            np.log(RIDGE_GRID[min(best + 1, len(RIDGE_GRID) - 1)]),
        )
        found = minimize_scalar(lambda x: at(float(np.exp(x)))[0], bounds=(low, high),
                                method="bounded", options={"xatol": 1e-6})  # fmt: skip
        refined = at(float(np.exp(found.x)))
        if refined[0] <= fits[best][0]:
            return refined[1:]
    return fits[best][1:]


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


# --------------------------------------------------- a built-in device, measured

ModelSteps = tuple[ModelSpec, Sequence[ProfileSample]]
"""Measured steps of one model shape (its ``dtype_bytes`` = the run's dtype)."""


@dataclass(frozen=True)
class DeviceFit:
    """A built-in device's roofline constants fitted to measured steps of several
    model shapes (:func:`fit_device_constants`).

    Attributes:
        device: the datasheet spec with the fitted :data:`DEVICE_CONSTANTS`
            (peaks unchanged).
        held_out: the roofline's error on a random 20% of the pooled
            steps, fitted on the other 80%.
        per_model: the final fit's error on each fitted model's steps.
        checks: its error on each check model's steps (shapes not fitted).
        num_steps: steps fitted.
        clamped: efficiencies the fit held at their bound of 1 (no step was
            bound by that term, so the data do not pin it down).
    """

    device: DeviceSpec
    held_out: HeldOutError
    per_model: dict[str, HeldOutError]
    checks: dict[str, HeldOutError]
    num_steps: int
    clamped: tuple[str, ...] = ()

    def measurement(self, **facts: Any) -> Measurement:
        """The :class:`~roseinfer.calibration.specs.Measurement` to record in
        ``specs.py``. ``facts``: :class:`~roseinfer.calibration.specs.Provenance`
        fields (``source``, ``gpu``, ``driver``, ``torch``, ``date``, ``command``).
        """
        check = next(iter(self.checks.items()), None)
        provenance = Provenance(
            kind="measured", models=tuple(self.per_model), num_steps=self.num_steps,
            median_step_error=round(self.held_out.median, 4),
            p90_step_error=round(self.held_out.p90, 4),
            check_model=check[0] if check else "",
            check_median_step_error=round(check[1].median, 4) if check else None, **facts,
        )  # fmt: skip
        d = self.device
        kv = d.kv_bandwidth_efficiency
        return Measurement(
            mfu=round(d.mfu, 4), bandwidth_efficiency=round(d.bandwidth_efficiency, 4),
            overhead_s=round(d.overhead_s, 7), provenance=provenance,
            kv_bandwidth_efficiency=None if kv is None else round(kv, 4),
            overhead_per_seq_s=round(d.overhead_per_seq_s, 9),
            eager_launch_s_per_layer=round(d.eager_launch_s_per_layer, 8),
            decode_imbalance_s_per_token=round(d.decode_imbalance_s_per_token, 10),
        )  # fmt: skip


DEVICE_CONSTANTS = (
    "mfu", "bandwidth_efficiency", "kv_bandwidth_efficiency", "overhead_s",
    "overhead_per_seq_s", "eager_launch_s_per_layer", "decode_imbalance_s_per_token",
)  # fmt: skip
"""The constants :func:`fit_device_constants` fits, in its parameter order."""
_STARTS = ((0.6, 0.8, 0.6, 1e-3, 1e-5, 3e-4, 1e-6), (0.4, 0.6, 0.9, 3e-3, 0.0, 0.0, 0.0))
"""Starting points of the fit (the ``max`` roofs make the error non-convex; the
best of these wins). Units as :data:`DEVICE_CONSTANTS`."""
_SCALE = np.array([1.0, 1.0, 1.0, 1e-3, 1e-6, 1e-4, 1e-6])  # parameters fitted near 1


def fit_device_constants(
    base: DeviceSpec,
    fitted: Sequence[ModelSteps],
    checks: Sequence[ModelSteps] = (),
    seed: int = 0,
    imbalance_steps: Sequence[ModelSteps] = (),
) -> DeviceFit:
    """Fit the roofline constants of ``base`` (:data:`DEVICE_CONSTANTS`) to
    measured steps of the ``fitted`` model shapes.

    The roofline :class:`~roseinfer.calibration.cost_model.RooflineCostModel`
    prices with (what ``rose-sim --hardware`` uses)::

        max(FLOPs / (peak x mfu),
            weight bytes / (bandwidth x bandwidth_efficiency)
              + KV bytes / (bandwidth x kv_bandwidth_efficiency)
              + decode_imbalance_s_per_token x (decodes x longest - summed context)
                / max(decodes, base.decode_split_programs / KV heads),
            eager x num_layers x eager_launch_s_per_layer)
        + overhead_s + overhead_per_seq_s x sequences

    is fitted by minimizing the squared relative error over every step of every
    shape (``scipy.optimize.least_squares``, bounded, from each of
    :data:`_STARTS`; the lowest cost wins). Two shapes of different widths keep
    the per-step overhead apart from streaming one model's weights (the same
    bytes every step of one model); decodes at several contexts keep KV apart
    from weights; small prefills, which run eagerly, pin the launch roof;
    decode batches of spread contexts (one long among short ones) pin the
    imbalance (0 when ``base.decode_split_programs`` is 0).
    ``checks`` are shapes left out, priced with the result.

    A profile's spread decode batches have evenly spread contexts; a served
    workload's are skewed (a few long contexts among many short ones), which
    unbalances a step more per token of ``longest - mean``. With
    ``imbalance_steps`` (real runs' step logs), the imbalance is fitted to their
    decode steps instead, in a second stage: the other six constants are fitted
    first with no imbalance term, then ``decode_imbalance_s_per_token`` alone
    minimizes the squared relative error of those steps (closed form, >= 0).

    Args:
        base: the datasheet spec (its peaks stay).
        fitted: ``(model, steps)`` per fitted shape; steps' ``target_s`` is what
            a step costs (a profile's median plus host time, or a logged duration).
        checks: ``(model, steps)`` per shape to check.
        seed: the held-out split.
        imbalance_steps: ``(model, steps)`` of served runs to fit the decode
            imbalance to (empty: fit it with the rest, from ``fitted``).

    Raises:
        ProfileError: with fewer than 10 steps.
    """
    samples = [s for _, steps in fitted for s in steps]
    if len(samples) < 10:
        raise ProfileError(f"a device fit needs >= 10 measured steps, got {len(samples)}")
    terms = np.vstack([_device_terms(model, steps, base) for model, steps in fitted if steps])
    targets = np.array([s.target_s for s in samples])
    imbalance = _decode_terms(imbalance_steps, base)
    fit_terms = terms.copy()
    if imbalance is not None:
        fit_terms[:, 6] = 0.0  # the profiles' evenly spread batches do not set it
    train, test = _split(len(samples), seed)
    held = _with_imbalance(_fit_constants(fit_terms[train], targets[train]), imbalance)
    held_out = HeldOutError.of(_price(terms[test], held), targets[test])
    constants = _with_imbalance(_fit_constants(fit_terms, targets), imbalance)
    device, clamped = _with_constants(base, constants)
    return DeviceFit(
        device, held_out, {m.name: _roofline_error(m, device, s) for m, s in fitted},
        {m.name: _roofline_error(m, device, s) for m, s in checks}, len(samples), clamped,
    )  # fmt: skip


def _decode_terms(
    runs: Sequence[ModelSteps], base: DeviceSpec
) -> tuple[np.ndarray, np.ndarray] | None:
    """:func:`_device_terms` and targets of the pure-decode steps of ``runs``
    (None without runs).

    Raises:
        ProfileError: when the runs hold fewer than 10 decode steps.
    """
    if not runs:
        return None
    pairs = [(m, [s for s in steps if s.shape.totals().num_prefills == 0]) for m, steps in runs]
    decodes = [s for _, steps in pairs for s in steps]
    if len(decodes) < 10:
        raise ProfileError(f"the imbalance fit needs >= 10 decode steps, got {len(decodes)}")
    terms = np.vstack([_device_terms(m, steps, base) for m, steps in pairs if steps])
    return terms, np.array([s.target_s for s in decodes])


def _with_imbalance(
    constants: np.ndarray, imbalance: tuple[np.ndarray, np.ndarray] | None
) -> np.ndarray:
    """``constants`` with ``decode_imbalance_s_per_token`` fitted alone to the
    decode steps of ``imbalance`` (unchanged when None): the ``c >= 0`` that
    minimizes the squared relative error of ``price(c = 0) + c x``."""
    if imbalance is None:
        return constants
    terms, targets = imbalance
    out = constants.copy()
    out[6] = 0.0
    base = _price(terms, out) / targets
    x = terms[:, 6] / targets
    out[6] = max(0.0, float(x @ (1.0 - base) / (x @ x))) if x @ x > 0 else 0.0
    return out


def _device_terms(model: ModelSpec, steps: Sequence[ProfileSample], base: DeviceSpec) -> np.ndarray:
    """``[n, 7]`` per step: seconds of its FLOPs at ``base``'s peak, of its weight
    bytes and its KV bytes at ``base``'s peak bandwidth, its sequences, its
    layers if it runs eagerly (else 0), 1 (the per-step overhead), and its decode
    imbalance at 1 s per token (0 when ``base`` has no split rule)."""
    probe = RooflineCostModel(model, _UNIT_DEVICE)
    unit = RooflineCostModel(model, dataclasses.replace(base, decode_imbalance_s_per_token=1.0))
    weight_bytes = float(model.streamed_weight_bytes)
    rows = []
    for step in steps:
        totals = step.shape.totals()
        tokens, seqs = float(totals.num_tokens), float(totals.num_seqs)
        eager = runs_eagerly(tokens, seqs)
        decodes = totals.num_seqs - totals.num_prefills
        excess = decodes * totals.decode_max_context - totals.decode_context_tokens
        imbalance = (
            unit.imbalance_s(float(decodes), float(excess)) if base.decode_split_programs else 0.0
        )
        rows.append((
            probe.flops(step.shape) / base.peak_flops,
            weight_bytes / base.mem_bandwidth,
            (probe.memory_bytes(step.shape) - weight_bytes) / base.mem_bandwidth,
            seqs, float(model.num_layers) if eager else 0.0, 1.0, imbalance,
        ))  # fmt: skip
    return np.array(rows)


def _price(terms: np.ndarray, constants: np.ndarray) -> np.ndarray:
    """Seconds of each step of ``terms`` (:func:`_device_terms`) at ``constants``
    (:data:`DEVICE_CONSTANTS` order)."""
    mfu, bandwidth, kv_bandwidth, overhead_s, per_seq_s, launch_s, imbalance_s = constants
    compute = terms[:, 0] / mfu
    memory = terms[:, 1] / bandwidth + terms[:, 2] / kv_bandwidth + imbalance_s * terms[:, 6]
    launch = terms[:, 4] * launch_s
    return np.maximum(np.maximum(compute, memory), launch) + overhead_s + per_seq_s * terms[:, 3]


def _fit_constants(terms: np.ndarray, targets_s: np.ndarray) -> np.ndarray:
    """Least-squares relative error of :func:`_price` over ``targets_s``; the
    efficiencies bounded to (0, 1], the seconds to >= 0."""
    from scipy.optimize import least_squares

    low = np.array([1e-3, 1e-3, 1e-3, 0.0, 0.0, 0.0, 0.0])
    high = np.array([1.0, 1.0, 1.0, np.inf, np.inf, np.inf, np.inf])

    def residuals(x: np.ndarray) -> np.ndarray:
        return _price(terms, x * _SCALE) / targets_s - 1.0

    best = None
    for start in _STARTS:
        x0 = np.clip(np.array(start) / _SCALE, low, high)
        found = least_squares(residuals, x0, bounds=(low, high), x_scale="jac",
                              xtol=1e-12, ftol=1e-12, gtol=1e-12)  # fmt: skip
        if best is None or found.cost < best.cost:
            best = found
    assert best is not None
    return best.x * _SCALE


def _with_constants(base: DeviceSpec, constants: np.ndarray) -> tuple[DeviceSpec, tuple[str, ...]]:
    """``base`` with the fitted constants (its peaks stay), and the names of the
    efficiencies the fit pushed to their bound of 1 (no step was bound by that
    term, so the data do not pin it down)."""
    values = dict(zip(DEVICE_CONSTANTS, (float(v) for v in constants), strict=True))
    clamped = tuple(n for n in DEVICE_CONSTANTS[:3] if values[n] >= 1.0 - 1e-9)
    values.update(dict.fromkeys(clamped, 1.0))
    device = dataclasses.replace(
        base, mfu=values["mfu"], bandwidth_efficiency=values["bandwidth_efficiency"],
        kv_bandwidth_efficiency=values["kv_bandwidth_efficiency"], overhead_s=values["overhead_s"],
        overhead_per_seq_s=values["overhead_per_seq_s"],
        eager_launch_s_per_layer=values["eager_launch_s_per_layer"],
        decode_imbalance_s_per_token=values["decode_imbalance_s_per_token"], provenance=None,
    )  # fmt: skip
    return device, clamped


def _roofline_error(
    model: ModelSpec, device: DeviceSpec, steps: Sequence[ProfileSample]
) -> HeldOutError:
    """The roofline of ``model`` on ``device`` against measured ``steps``."""
    cost = RooflineCostModel(model, device)
    predicted = np.array([cost.step_time_s(s.shape) for s in steps])
    return HeldOutError.of(predicted, np.array([s.target_s for s in steps]))


MEASURED_BEGIN, MEASURED_END = "# BEGIN MEASURED", "# END MEASURED"
_FIRST_FIELDS = ("mfu", "bandwidth_efficiency", "overhead_s", "provenance")


def measured_source(entries: Mapping[str, Measurement]) -> str:
    """The ``MEASURED = {...}`` assignment of ``calibration/specs.py`` holding
    ``entries`` (device name -> measurement), as Python source that evaluates
    back to equal :class:`~roseinfer.calibration.specs.Measurement` s, in the
    repository's format (``ruff format`` leaves it as written)."""
    lines = ["MEASURED: dict[str, Measurement] = {"]
    for name, m in sorted(entries.items()):
        lines += [f"    {_literal(name)}: Measurement(", f"        mfu={m.mfu!r},",
                  f"        bandwidth_efficiency={m.bandwidth_efficiency!r},",
                  f"        overhead_s={m.overhead_s!r},"]  # fmt: skip
        for field in dataclasses.fields(Measurement):
            value = getattr(m, field.name)
            if field.name not in _FIRST_FIELDS and value != field.default:
                lines.append(f"        {field.name}={_literal(value)},")
        lines.append("        provenance=Provenance(")
        for field in dataclasses.fields(Provenance):
            value = getattr(m.provenance, field.name)
            if value != field.default:
                lines.append(f"            {field.name}={_literal(value)},")
        lines += ["        ),", "    ),"]
    return "\n".join([*lines, "}"]) if entries else "MEASURED: dict[str, Measurement] = {}"


def _literal(value: Any) -> str:
    """``value`` as Python source with double-quoted strings (as ``ruff format`` writes)."""
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string of printable text is a Python literal
    if isinstance(value, tuple):
        return "(" + ", ".join(_literal(v) for v in value) + ("," if len(value) == 1 else "") + ")"
    return repr(value)


def eager_step_ratios(
    samples: Sequence[ProfileSample],
) -> tuple[tuple[float, tuple[float, ...]], ...]:
    """``(median_s, ratios)`` of the eager step shapes among ``samples`` timed at
    least twice (prefills, mixed steps, decodes past the CUDA-graph sizes), each
    ratio a repetition over its shape's median, rounded to 5 decimals (medians
    to 0.1 us): what :data:`~roseinfer.calibration.specs.MEASURED_JITTER_FILE`
    keeps of a device's fitted profiles. ``()`` with too few repetitions."""
    from roseinfer.calibration.jitter import StepJitter

    shapes = []
    for s in samples:
        t = s.shape.totals()
        shapes.append((float(t.num_tokens), float(t.num_seqs), s.times_s))
    jitter = StepJitter.of_repetitions(shapes, DECODE_GRAPHS)
    if jitter is None:
        return ()
    return tuple((round(m, 7), tuple(round(r, 5) for r in ratios)) for m, ratios in jitter.eager)


def replace_measured_jitter(
    doc: Mapping[str, Any], device: str, source: str,
    ratios: tuple[tuple[float, tuple[float, ...]], ...],
) -> dict[str, Any]:  # fmt: skip
    """:data:`~roseinfer.calibration.specs.MEASURED_JITTER_FILE`'s document
    ``doc`` with ``device``'s entry replaced (removed when ``ratios`` is empty)."""
    out = {k: v for k, v in doc.items() if k != device}
    if ratios:
        out[device] = {"source": source, "eager": [[m, list(r)] for m, r in ratios]}
    return dict(sorted(out.items()))


def replace_measured_block(specs_text: str, entries: Mapping[str, Measurement]) -> str:
    """``specs_text`` (the source of ``calibration/specs.py``) with the lines between
    :data:`MEASURED_BEGIN` and :data:`MEASURED_END` replaced by ``entries``.

    Raises:
        ValueError: if the markers are missing or out of order.
    """
    begin, end = specs_text.find(MEASURED_BEGIN), specs_text.find(MEASURED_END)
    if begin < 0 or end < begin:
        raise ValueError(f"no {MEASURED_BEGIN} ... {MEASURED_END} block in the specs source")
    head = specs_text[: begin + len(MEASURED_BEGIN)]
    return f"{head}\n{measured_source(entries)}\n{specs_text[end:]}"
