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
  and the roofline's FLOP terms (see ``roseinfer.calibration.cost_model``); the
  token hinges let the fit bend from the weight-streaming (flat) to the
  compute-bound (linear) regime, as a roofline does. A piecewise-linear
  interpolation of the samples (LLMServingSim's method; of their ratios to the
  linear model when it has the CUDA terms) is fitted as well;
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
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from roseinfer.calibration.graph_replay import GraphReplay
from roseinfer.calibration.jitter import StepJitter
from roseinfer.calibration.roofline_fit import (
    CalibratedRoofline,
    CalibratedRooflineCostModel,
    OverheadSample,
    calibrate_roofline,
)
from roseinfer.calibration.specs import DeviceSpec, ModelSpec
from roseinfer.calibration.step_model import (
    SERVED_KIND_PREFIX,
    STEP_LOG_MODEL,
    HeldOutError,
    InterpolatedStepModel,
    LinearStepModel,
    ProfiledCostModel,
    ProfileError,
    ProfileSample,
    SampleRange,
    StepFit,
    StepModel,
    decode_spread_seqs,
    eager_draws,
    fit_step_model,
    shape_aggregates,
)
from roseinfer.calibration.steplog import (
    STEP_LOG_SCHEMA,
    StepLogError,
    StepLogFile,
    StepRecord,
    first_line_schema,
    is_step_log,
    load_step_log,
)

__all__ = [
    "PROFILE_SCHEMA",
    "Profile",
    "cost_model_from_steps",
    "load_calibration",
    "load_profile",
    "step_samples",
]

PROFILE_SCHEMA = "roseinfer-profile/1"

# ------------------------------------------------------------------ the profile


def _step_model_from_json(
    doc: Mapping[str, Any], samples: Sequence[ProfileSample], graphs: GraphReplay
) -> StepModel:
    """Rebuild a stored step model (``graphs``: what the profiled executor replayed,
    from its executor section); an interpolation is rebuilt from the samples."""
    if doc["kind"] == "interp":
        agg = np.vstack([shape_aggregates(s.shape) for s in samples])
        targets = np.array([s.target_s for s in samples])
        fallback = _step_model_from_json(doc["fallback"], samples, graphs)
        assert isinstance(fallback, LinearStepModel)
        draws = eager_draws(samples, graphs)
        return InterpolatedStepModel.of_samples(str(doc["name"]), agg, targets, fallback, draws)
    knots = tuple(float(k) for k in doc["token_knots"])
    spread = float(doc.get("decode_spread_seqs", 0.0))
    model = LinearStepModel(str(doc["name"]), knots, (), spread, graphs)
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
        model_spec: the profiled model's shape (``dtype_bytes`` = profiled dtype),
            or None when the source did not record it (an engine's step log).
        executor: the executor setup: device, dtype, attention_backend,
            num_kv_blocks, block_size, kv_cache_bytes, kv_cache_budget_bytes
            (memory the pool was sized from, before the cap rose-run applies),
            max_model_len, max_num_seqs, max_num_batched_tokens.
        environment: torch version, threads, platform facts.
        samples: the profiled steps.
        step_fit: the chosen step model and every candidate's held-out error.
        roofline: the calibrated roofline constants (None without a model shape).
        overhead_samples: skeleton steps the roofline's overhead was fitted on.
        extra: the other top-level sections (grid, host, timings), kept as read.
    """

    model_name: str
    model_spec: ModelSpec | None
    executor: dict[str, Any]
    environment: dict[str, Any]
    samples: list[ProfileSample]
    step_fit: StepFit
    roofline: CalibratedRoofline | None
    overhead_samples: list[OverheadSample] = dataclasses.field(default_factory=list)
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    path: str | None = None  # the file it was read from (not stored in it)

    @classmethod
    def create(
        cls,
        *,
        model_name: str,
        model_spec: ModelSpec | None,
        executor: dict[str, Any],
        environment: dict[str, Any],
        samples: Sequence[ProfileSample],
        base_device: DeviceSpec | None = None,
        seed: int = 0,
        overhead_samples: Sequence[OverheadSample] = (),
        extra: dict[str, Any] | None = None,
        use: str | None = None,
    ) -> Profile:
        """Fit both models to freshly measured ``samples`` (see the module doc);
        ``use`` is :func:`fit_step_model`'s.

        Raises:
            ProfileError: with fewer than 10 samples.
        """
        samples = list(samples)
        spread = decode_spread_seqs(executor, model_spec.num_kv_heads if model_spec else None)
        medians = served_medians(samples, step_jitter(samples, executor))
        graphs = GraphReplay.of_executor(executor)
        return cls(
            model_name=model_name,
            model_spec=model_spec,
            executor=dict(executor),
            environment=dict(environment),
            samples=samples,
            step_fit=fit_step_model(medians, seed, use, spread, graphs),
            roofline=None
            if model_spec is None
            else calibrate_roofline(model_spec, samples, base_device, seed, overhead_samples),
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

    @property
    def source(self) -> str:
        """What it was calibrated from: ``profile FILE``, ``step log FILE (N steps)``,
        ``profile A + step logs B, C (N steps)``, or ``unsaved profile of LABEL``."""
        sources = self.extra.get("sources")
        if not sources:
            return f"profile {self.path}" if self.path else f"unsaved profile of {self.label}"
        kinds: dict[str, list[str]] = {}
        for src in sources:
            kinds.setdefault(str(src.get("kind")), []).append(str(src.get("path")))
        parts = [
            f"{kind}{'s' if len(paths) > 1 else ''} {', '.join(paths)}"
            for kind, paths in kinds.items()
        ]
        steps = self.extra.get("num_logged_steps")
        return " + ".join(parts) + (f" ({steps} steps)" if steps else "")

    def same_shape(self, model: ModelSpec) -> bool:
        """True when ``model`` computes what the profiled model computes (names aside)."""
        if self.model_spec is None:
            return False
        mine = dataclasses.replace(self.model_spec, name="")
        return dataclasses.replace(model, name="") == mine

    @property
    def graphs(self) -> GraphReplay:
        """Which steps the profiled executor replayed from CUDA graphs (its
        ``executor`` section: ``cudagraph_mode`` and the captured sizes)."""
        return GraphReplay.of_executor(self.executor)

    def cost_model(
        self, model: ModelSpec | None = None
    ) -> ProfiledCostModel | CalibratedRooflineCostModel:
        """The profiled cost model for the profiled shape (``model`` None or the same
        shape); the calibrated roofline of ``model`` for any other shape.

        Raises:
            ProfileError: for another shape when the source recorded no model shape.
        """
        if model is None or self.same_shape(model):
            held_out = self.step_fit.held_out.get(self.step_fit.model.name)
            error = f", held-out median step error {held_out.median:.1%}" if held_out else ""
            return ProfiledCostModel(
                self.step_fit.model, self.label, held_out, source=self.source + error,
                sample_range=SampleRange.of(self.samples), jitter=self.jitter(),
            )  # fmt: skip
        if self.roofline is None or self.model_spec is None:
            raise ProfileError(
                f"{self.label} recorded no model shape, so it prices only its own model; "
                "drop --model (or calibrate from a rose-run profile or step log)"
            )
        return self.roofline.cost_model(model, f"calibrated roofline from {self.source}")

    def jitter(self) -> StepJitter | None:
        """The spread of the profiled shapes' repetitions around their medians
        (:func:`step_jitter`)."""
        return step_jitter(self.samples, self.executor)

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

        Raises:
            ProfileError: when the source records no executor ``block_size``,
                ``num_kv_blocks`` or ``max_model_len`` (an engine's header without
                them), or cannot resize its pool for another model or block size.
        """
        ex = self.executor
        missing = [k for k in ("block_size", "num_kv_blocks", "max_model_len") if k not in ex]
        if missing:
            raise ProfileError(
                f"{self.source} records no executor {', '.join(missing)} (the KV pool and "
                "lengths rose-sim takes as its defaults); record the run with --save-steps "
                "(or ROSEINFER_STEP_LOG in vLLM), whose header holds them"
            )
        same_model = model is None or self.same_shape(model)
        block_size = block_size or int(ex["block_size"])
        spec = model if model is not None else self.model_spec
        max_len = int(ex["max_model_len"]) if same_model or spec is None else spec.max_model_len
        if same_model and block_size == ex["block_size"]:
            num_blocks = int(ex["num_kv_blocks"])
        elif spec is None or "kv_cache_bytes" not in ex:
            raise ProfileError(
                f"{self.label} recorded no model shape or KV pool bytes, so its pool cannot be "
                f"resized for block size {block_size}; pass --num-kv-blocks"
            )
        else:
            budget = int(ex.get("kv_cache_budget_bytes", ex["kv_cache_bytes"]))
            num_blocks = max(1, budget // (spec.kv_bytes_per_token * block_size))
            max_seqs = max_num_seqs or int(ex.get("max_num_seqs", 1 << 30))
            num_blocks = min(num_blocks, max_seqs * -(-max_len // block_size))
        return {"num_kv_blocks": num_blocks, "block_size": block_size, "max_model_len": max_len}

    @property
    def fit_lengths(self) -> str:
        """How the calibrated run fitted requests longer than its ``max_model_len``
        (``clip``, ``scale`` or ``off``; ``clip``, rose-run's default, when unrecorded)."""
        return str(self.executor.get("fit_lengths", "clip"))

    # ------------------------------------------------------------ files
    def to_json(self) -> dict[str, Any]:
        """The PROFILE.json document."""
        fit = self.step_fit.to_json()
        fit["model"] = _step_model_json(self.step_fit.model)
        return {
            "schema": PROFILE_SCHEMA,
            **{k: v for k, v in self.extra.items() if k not in ("samples",)},
            "model": {
                "name": self.model_name,
                "spec": None if self.model_spec is None else dataclasses.asdict(self.model_spec),
            },
            "executor": self.executor,
            "environment": self.environment,
            "fit": fit,
            "calibrated_roofline": None if self.roofline is None else self.roofline.to_json(),
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
                f"not a roseinfer profile (schema {str(doc.get('schema'))[:40]!r}, expected "
                f"{PROFILE_SCHEMA!r}); make one with `rose-run profile --output FILE`"
            )
        _check_numbers(doc, "profile")
        _check_chosen(doc.get("fit"))
        try:
            samples = [ProfileSample.from_json(row) for row in doc["samples"]]
            fit = doc["fit"]
            graphs = GraphReplay.of_executor(doc["executor"])
            step_fit = StepFit(
                _step_model_from_json(fit["model"], samples, graphs),
                {k: HeldOutError(**v) for k, v in fit["held_out"].items()},
                int(fit["split_seed"]),
                float(fit["train_fraction"]),
                held_out_groups={
                    k: HeldOutError(**v) for k, v in (fit.get("held_out_groups") or {}).items()
                },
            )
            spec = doc["model"]["spec"]
            roof = doc["calibrated_roofline"]
            roofline = None if roof is None else CalibratedRoofline.from_json(roof)
            overhead = [OverheadSample.from_json(r) for r in doc.get("overhead_samples", [])]
            known = {"schema", "model", "executor", "environment", "fit", "calibrated_roofline"}
            extra = {
                k: v for k, v in doc.items() if k not in known | {"samples", "overhead_samples"}
            }
            return cls(
                model_name=str(doc["model"]["name"]),
                model_spec=None if spec is None else ModelSpec(**spec),
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


MAX_PROFILE_NUMBER = 1e18
"""Largest number a profile may hold: above any byte count, FLOP rate or step time a
profile records (an H100's 1e15 FLOP/s, 1e11 bytes); 1e308 overflowed the pricing."""


def _check_numbers(value: Any, where: str) -> None:
    """Every number in a profile document is finite, >= 0 and at most
    :data:`MAX_PROFILE_NUMBER` (times, sizes, rates and the fitted coefficients, which
    are non-negative least squares, are all so).

    Raises:
        ProfileError: naming the first bad number's place (``fit.model.coefficients.step``).
    """
    stack: list[tuple[Any, str]] = [(value, where)]
    while stack:
        item, place = stack.pop()
        if isinstance(item, dict):
            stack += [(v, f"{place}.{str(k)[:40]}") for k, v in item.items()]
        elif isinstance(item, list):
            stack += [(v, f"{place}[{i}]") for i, v in enumerate(item)]
        elif (
            isinstance(item, (int, float))
            and not isinstance(item, bool)
            and not (math.isfinite(item) and 0 <= item <= MAX_PROFILE_NUMBER)
        ):
            raise ProfileError(
                f"{place} is {str(item)[:40]}: a profile's numbers are finite, >= 0 and at "
                f"most {MAX_PROFILE_NUMBER:g}; the file is damaged, re-run `rose-run profile`"
            )


def _check_chosen(fit: Any) -> None:
    """``fit.chosen`` names the stored model, one of the candidates with a held-out error.

    Raises:
        ProfileError: on another name (it was silently ignored before).
    """
    if not isinstance(fit, dict) or "chosen" not in fit:
        return  # a missing section is reported as incomplete
    model_doc, held_doc = fit.get("model"), fit.get("held_out")
    model: dict[str, Any] = model_doc if isinstance(model_doc, dict) else {}
    held_out: dict[str, Any] = held_doc if isinstance(held_doc, dict) else {}
    chosen = fit["chosen"]
    if chosen != model.get("name") or chosen not in held_out:
        raise ProfileError(
            f"fit.chosen is {str(chosen)[:40]!r}, but the stored step model is "
            f"{str(model.get('name'))[:40]!r} (candidates: {', '.join(map(str, held_out)) or 'none'}); "
            "the file is damaged or edited, re-run `rose-run profile`"
        )


def load_profile(path: str | Path) -> Profile:
    """Read ``PROFILE.json`` written by ``rose-run profile``.

    Raises:
        ProfileError: if the file is missing, not JSON, or not a profile.
    """
    if Path(path).exists() and not Path(path).is_file():  # /dev/zero: read until memory runs out
        raise ProfileError(
            f"{path}: not a file; give a profile (rose-run profile --output) or a step log"
        )
    try:
        doc = json.loads(Path(path).read_text())
    except OSError as err:
        raise ProfileError(f"cannot read profile {path}: {err.strerror}") from None
    except UnicodeDecodeError:
        raise ProfileError(f"{path} is not a text file; give a profile or a step log") from None
    except json.JSONDecodeError as err:
        schema = first_line_schema(path)
        if schema is not None:  # JSON lines whose header names another schema
            raise ProfileError(
                f"{path} is JSON lines of schema {schema[:60]!r}, neither a roseinfer profile "
                f"({PROFILE_SCHEMA!r}) nor a step log ({STEP_LOG_SCHEMA!r}); re-record it "
                "with this roseinfer (--save-steps, rose-run profile)"
            ) from None
        raise ProfileError(f"profile {path} is not JSON ({err})") from None
    except RecursionError:
        raise ProfileError(f"profile {path} nests JSON too deep to read; it is damaged") from None
    if not isinstance(doc, dict):
        raise ProfileError(f"profile {path} is not a JSON object")
    return dataclasses.replace(Profile.from_json(doc), path=str(path))


def step_jitter(samples: Sequence[ProfileSample], executor: Mapping[str, Any]) -> StepJitter | None:
    """The spread of the samples' repetitions around their medians
    (:class:`~roseinfer.calibration.jitter.StepJitter`; eager and graph steps apart
    when the executor replayed CUDA graphs); None when too few shapes were timed
    more than once (step logs and served runs time each step once)."""
    graphs = GraphReplay.of_executor(executor)
    shapes = []
    for s in samples:
        t = s.shape.totals()
        shapes.append((float(t.num_tokens), float(t.num_seqs), s.times_s))
    return StepJitter.of_repetitions(shapes, graphs)


def served_medians(
    samples: Sequence[ProfileSample], jitter: StepJitter | None
) -> list[ProfileSample]:
    """``samples`` with each served step's time (one draw of its shape) divided by
    the mean stretch ``jitter`` gives a step of its class and time, so the step
    model fits medians throughout and the simulator's jitter is not counted twice.
    Unchanged without a jitter.

    On the shipped H100 runs of ``20-gpu-fidelity`` (a profile pooled with a served
    run's log, priced with jitter), this took the worst error from 8.9% to 5.7%
    at p50 and from 8.4% to 7.5% at p99 (``benchmarks/gpu/sim_vs_check20.sh``)."""
    if jitter is None:
        return list(samples)
    served = [i for i, s in enumerate(samples) if s.kind.startswith(SERVED_KIND_PREFIX)]
    if not served:
        return list(samples)
    totals = [samples[i].shape.totals() for i in served]
    eager = np.array([bool(jitter.graphs.runs_eagerly(t.num_tokens, t.num_seqs)) for t in totals])
    times = np.array([samples[i].target_s for i in served])
    stretch = jitter.mean_factors(eager, times)
    out = list(samples)
    for i, factor in zip(served, stretch):
        s = out[i]
        out[i] = dataclasses.replace(s, times_s=tuple(t / float(factor) for t in s.times_s))
    return out


def step_samples(log: StepLogFile | Sequence[StepRecord]) -> list[ProfileSample]:
    """One sample per logged step: its shape and measured duration (host work
    included, so ``host_s`` is 0), of kind ``served-`` + the step's kind (a served
    run's step, as a profile's served run logs them). Steps of zero duration are
    skipped."""
    records = log.records if isinstance(log, StepLogFile) else log
    return [
        ProfileSample(SERVED_KIND_PREFIX + r.kind, r.shape, (r.duration_s,))
        for r in records
        if r.duration_s > 0
    ]


def cost_model_from_steps(
    records: Sequence[StepRecord], label: str, seed: int = 0
) -> ProfiledCostModel:
    """The step model fitted to logged steps in memory (as ``rose-sim --cost-model
    STEPLOG`` fits a file), its held-out error measured on steps it did not see.

    Raises:
        ProfileError: with fewer than 10 steps.
    """
    samples = step_samples(records)
    fit = fit_step_model(samples, seed, STEP_LOG_MODEL)
    held_out = fit.held_out.get(fit.model.name)
    return ProfiledCostModel(fit.model, label, held_out, sample_range=SampleRange.of(samples))


def check_one_graph_mode(executors: Sequence[tuple[str | Path, Mapping[str, Any]]]) -> None:
    """Refuse to pool calibrations whose executors replayed different steps from CUDA
    graphs (``--cudagraph-mode FULL`` beside ``FULL_DECODE_ONLY``, or
    ``--enforce-eager``): one step model prices one rule, and a small prefill costs
    its launches in one file and its GPU time in the other.

    Raises:
        ProfileError: naming two such files and the fix.
    """
    first_path, first = None, ""
    for path, executor in executors:
        mode = GraphReplay.of_executor(executor).mode
        if first_path is None:
            first_path, first = path, mode
        elif mode != first:
            raise ProfileError(
                f"{first_path} ran its CUDA graphs as {first} and {path} as {mode}: pool "
                "calibrations of one --cudagraph-mode (and --enforce-eager setting)"
            )


def load_calibration(paths: Sequence[str | Path], seed: int = 0) -> Profile:
    """One calibration from ``rose-run profile`` files and step logs (``--save-steps``).

    A single profile is used as it was fitted. Otherwise every sample is pooled
    (the profile's grid shapes and each logged step) and the step model and the
    calibrated roofline are fitted again, with held-out errors measured on
    samples (steps) the fit did not see. The setup (KV pool, block size, max
    model length, model shape) is the first profile's, else the first log's.

    Raises:
        ProfileError: if a file cannot be read, the files replayed different
            steps from CUDA graphs (:func:`check_one_graph_mode`), or fewer than 10
            samples remain.
    """
    if not paths:
        raise ProfileError("no calibration file given")
    profiles: list[Profile] = []
    logs: list[StepLogFile] = []
    executors: list[tuple[str | Path, Mapping[str, Any]]] = []
    for path in paths:
        if is_step_log(path):
            try:
                logs.append(load_step_log(path))
            except StepLogError as err:
                raise ProfileError(str(err)) from None
            executors.append((path, logs[-1].header.get("executor") or {}))
        else:
            profiles.append(load_profile(path))
            executors.append((path, profiles[-1].executor))
    check_one_graph_mode(executors)
    if len(paths) == 1 and profiles:
        return profiles[0]
    base = profiles[0] if profiles else None
    head = logs[0].header if logs else {}
    samples = [s for p in profiles for s in p.samples] + [s for g in logs for s in step_samples(g)]
    sources = [{"path": str(p), "kind": "step log" if is_step_log(p) else "profile"} for p in paths]
    spec_doc = (head.get("model") or {}).get("spec")
    return Profile.create(
        model_name=base.model_name if base else str((head.get("model") or {}).get("name", "?")),
        model_spec=base.model_spec if base else (None if not spec_doc else ModelSpec(**spec_doc)),
        executor=base.executor if base else dict(head.get("executor") or {}),
        environment=base.environment if base else dict(head.get("environment") or {}),
        samples=samples,
        base_device=base.roofline.device if base and base.roofline else None,
        seed=seed,
        overhead_samples=[o for p in profiles for o in p.overhead_samples],
        extra={"sources": sources, "num_logged_steps": sum(len(g.records) for g in logs)},
        use=None if profiles else STEP_LOG_MODEL,  # a profile's grid: the held-out rule
    )
