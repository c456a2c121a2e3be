"""Profiled cost models (no torch): fits recover known step costs, the vectorized
decode runs equal stepping, profiles round-trip through JSON, and ``rose-sim
--cost-model`` takes the profiled scheduler setup as its defaults."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from roseinfer.calibration import (
    PROFILE_SCHEMA,
    OverheadModel,
    OverheadSample,
    Profile,
    ProfiledCostModel,
    ProfileError,
    ProfileSample,
    calibrate_roofline,
    fit_step_model,
    load_profile,
    shape_aggregates,
)
from roseinfer.calibration.cost_model import CostModel, RooflineCostModel, loop_decode_run_times_s
from roseinfer.calibration.specs import DeviceSpec, get_device_spec, get_model_spec
from roseinfer.config import SchedulerConfig
from roseinfer.simulator import BatchShape, simulate
from roseinfer.workloads import synthetic

GPT2 = dataclasses.replace(get_model_spec("gpt2"), dtype_bytes=4)
# A made-up device: 50 GFLOP/s, 10 GB/s achievable, 3 ms per step.
DEVICE = DeviceSpec(
    name="test-cpu", peak_flops=100e9, mem_bandwidth=20e9, mem_bytes=16 << 30, mfu=0.5,
    bandwidth_efficiency=0.5, overhead_s=3e-3, dtype_bytes=4,
)  # fmt: skip
# Seconds per unit of each basis term (step, seqs, tokens, prefill pairs,
# prefill context, prefills, decode context).
TRUE_COEF = np.array([4e-3, 2e-4, 3e-4, 2e-8, 1e-6, 5e-4, 4e-6])


def grid_shapes(seed: int = 0) -> list[tuple[str, BatchShape]]:
    """Prefills, decodes (equal and spread contexts) and mixed steps, as a profile has."""
    rng = np.random.default_rng(seed)
    shapes = []
    for new in (2, 8, 32, 128, 512, 1024):
        for cached in (0, (1024 - new) // 2):
            shapes.append(("prefill", BatchShape([new], [new + cached], [])))
    for batch in (1, 2, 4, 8, 16, 32, 64):
        for ctx in (16, 128, 512):
            shapes.append(("decode", BatchShape.decode([ctx] * batch)))
            shapes.append(("decode", BatchShape.decode(rng.integers(1, 2 * ctx, batch))))
    for num in (4, 16):
        for chunk in (64, 256):
            shapes.append(("mixed", BatchShape([chunk], [chunk], [200] * num)))
    return shapes


def samples_from(price, seed: int = 0, noise: float = 0.0) -> list[ProfileSample]:
    """Samples whose times come from ``price(shape)`` (with relative noise)."""
    rng = np.random.default_rng(seed)
    return [
        ProfileSample(kind, shape, tuple(price(shape) * (1 + noise * rng.standard_normal(3))))
        for kind, shape in grid_shapes(seed)
    ]


def linear_price(shape: BatchShape) -> float:
    return float(shape_aggregates(shape)[: len(TRUE_COEF)] @ TRUE_COEF)


def make_profile(samples: list[ProfileSample]) -> Profile:
    executor = {
        "device": "cpu", "dtype": "float32", "attention_backend": "sdpa", "num_kv_blocks": 910,
        "block_size": 16, "kv_cache_bytes": 910 * 16 * GPT2.kv_bytes_per_token,
        "kv_cache_budget_bytes": 1 << 30, "max_model_len": 1024, "max_num_seqs": 256,
        "max_num_batched_tokens": 2048,
    }  # fmt: skip
    return Profile.create(
        model_name="gpt2", model_spec=GPT2, executor=executor,
        environment={"num_threads": 2}, samples=samples,
        base_device=get_device_spec("cpu"), extra={"grid": {"repetitions": 3}},
    )  # fmt: skip


def test_fit_recovers_a_linear_step_cost_and_reports_held_out_error():
    fit = fit_step_model(samples_from(linear_price))
    assert fit.model.name in ("linear", "hinge")
    assert fit.held_out[fit.model.name].median < 1e-6
    assert fit.held_out[fit.model.name].num_samples == round(0.2 * len(grid_shapes()))
    for _, shape in grid_shapes(seed=1):  # shapes it never saw
        assert ProfiledCostModel(fit.model, "t").step_time_s(shape) == pytest.approx(
            linear_price(shape), rel=1e-6
        )


def test_a_used_candidate_is_kept_whatever_the_held_out_scores():
    samples = samples_from(linear_price)
    plain, used = fit_step_model(samples), fit_step_model(samples, use="interp")
    assert plain.model.name in ("linear", "hinge")  # exact linear data: the basis wins
    assert used.model.name == "interp" and used.held_out.keys() == plain.held_out.keys()
    assert "interp, as step logs use" in used.to_json()["selection"]
    with pytest.raises(ValueError, match="use must be one of"):
        fit_step_model(samples, use="spline")


def test_hinge_fit_follows_a_roofline_bend():
    """A roofline (flat while weight-bound, then linear in tokens) has a knee the
    plain linear basis cannot follow; the hinge terms can."""
    roofline = RooflineCostModel(GPT2, DEVICE)
    fit = fit_step_model(samples_from(roofline.step_time_s))
    assert fit.held_out["hinge"].p90 < fit.held_out["linear"].p90
    assert fit.held_out[fit.model.name].median < 0.05


@pytest.mark.parametrize("candidate", ["linear", "hinge", "interp"])
def test_decode_runs_equal_stepping_bit_for_bit(candidate, monkeypatch):
    import roseinfer.calibration.step_model as profiled

    samples = samples_from(RooflineCostModel(GPT2, DEVICE).step_time_s, noise=0.02)
    agg = np.vstack([shape_aggregates(s.shape) for s in samples])
    targets = np.array([s.target_s for s in samples])
    fit = profiled._candidates(float(agg[:, 2].max()))[candidate]
    model = fit(agg, targets, profiled.eager_draws(samples))
    cost = ProfiledCostModel(model, "t")
    assert isinstance(cost, CostModel)
    context = np.array([3, 17, 400, 90, 1])
    fast = cost.decode_run_times_s(context, 300)
    assert np.array_equal(fast, loop_decode_run_times_s(cost, context, 300))
    assert np.all(fast > 0)
    assert cost.step_time_s(BatchShape()) == 0.0
    assert cost.decode_run_times_s(np.zeros(0, dtype=np.int64), 4).tolist() == [0.0] * 4


def test_simulation_with_a_profiled_model_jumps_to_the_same_records():
    profile = make_profile(samples_from(linear_price, noise=0.01))
    cost = profile.cost_model()
    config = SchedulerConfig(num_kv_blocks=910, max_model_len=1024, max_num_seqs=8)
    reqs = synthetic(num_requests=24, prompt_tokens=64, output_tokens=40, submit_interval_s=0.05)
    fast = simulate(reqs, config, cost)
    slow = simulate(reqs, config, cost, jump=False)
    assert fast.num_steps == slow.num_steps
    for col in ("admitted_s", "first_token_s", "finish_s"):
        np.testing.assert_allclose(fast.records[col], slow.records[col], rtol=1e-9)


def test_calibrated_roofline_recovers_device_constants_and_prices_other_shapes():
    truth = RooflineCostModel(GPT2, DEVICE)
    samples = samples_from(truth.step_time_s)
    calibrated = calibrate_roofline(GPT2, samples, get_device_spec("cpu"))
    dev = calibrated.device
    assert dev.achievable_flops == pytest.approx(DEVICE.achievable_flops, rel=0.05)
    assert dev.achievable_bandwidth == pytest.approx(DEVICE.achievable_bandwidth, rel=0.05)
    assert dev.overhead_s == pytest.approx(DEVICE.overhead_s, rel=0.05)
    assert calibrated.held_out.p90 < 0.05
    other = get_model_spec("llama-3.1-8b")
    shape = BatchShape([300], [300], [500] * 8)
    assert calibrated.cost_model(other).step_time_s(shape) == pytest.approx(
        RooflineCostModel(other, DEVICE).step_time_s(shape), rel=0.05
    )


TRUE_OVERHEAD = OverheadModel(
    per_step_s=1e-3,
    per_layer_s=1.5e-3,
    per_seq_s=1e-4,
    per_seq_layer_s=2e-5,
    per_prefill_layer_s=5e-5,
)
GPT2_MEDIUM = dataclasses.replace(
    GPT2, name="gpt2-medium", num_layers=24, hidden_size=1024, num_attention_heads=16,
    num_kv_heads=16, intermediate_size=4096,
)  # fmt: skip


def overhead_price(model, shape: BatchShape) -> float:
    """A device whose steps cost the roofline plus a per-layer dispatch overhead."""
    roofline = RooflineCostModel(model, dataclasses.replace(DEVICE, overhead_s=0.0))
    extra = TRUE_OVERHEAD.seconds(model.num_layers, shape_aggregates(shape)[None])[0]
    return roofline.step_time_s(shape) + extra


def skeleton_samples() -> list[OverheadSample]:
    shapes = [BatchShape.decode([32] * b) for b in (1, 8, 64)] + [
        BatchShape([32] * n, [32] * n, []) for n in (1, 4)
    ]
    return [
        OverheadSample("gpt2", layers, ProfileSample("s", shape, (float(
            TRUE_OVERHEAD.seconds(layers, shape_aggregates(shape)[None])[0]),)))
        for layers in (1, 12) for shape in shapes
    ]  # fmt: skip


def test_skeleton_overhead_lets_the_roofline_transfer_to_a_deeper_model():
    """One model's steps cannot tell a constant overhead from streaming its weights;
    skeleton steps at two depths can, and then a 24-layer model is priced right."""
    samples = samples_from(lambda shape: overhead_price(GPT2, shape))
    with_skeleton = calibrate_roofline(GPT2, samples, overhead_samples=skeleton_samples())
    without = calibrate_roofline(GPT2, samples)
    assert with_skeleton.overheads["gpt2"].per_layer_s == pytest.approx(1.5e-3, rel=1e-3)
    assert with_skeleton.combine == "max"
    assert with_skeleton.device.achievable_bandwidth == pytest.approx(
        DEVICE.achievable_bandwidth, rel=0.02
    )
    errors = {}
    for name, calibrated in (("with", with_skeleton), ("without", without)):
        cost = calibrated.cost_model(GPT2_MEDIUM)
        errs = [
            abs(cost.step_time_s(shape) / overhead_price(GPT2_MEDIUM, shape) - 1)
            for _, shape in grid_shapes(seed=2)
        ]
        errors[name] = max(errs)
    assert errors["with"] < 0.02 < errors["without"]
    cost = with_skeleton.cost_model(GPT2_MEDIUM)
    context = np.array([5, 300, 77])
    assert np.array_equal(
        cost.decode_run_times_s(context, 50), loop_decode_run_times_s(cost, context, 50)
    )


def test_calibration_picks_sum_when_compute_and_memory_do_not_overlap():
    """On a CPU, eager ops run one after another: step time = compute + memory."""
    compute = RooflineCostModel(GPT2, dataclasses.replace(DEVICE, mem_bandwidth=1e30))
    memory = RooflineCostModel(GPT2, dataclasses.replace(DEVICE, peak_flops=1e30))
    samples = samples_from(lambda sh: compute.step_time_s(sh) + memory.step_time_s(sh) - 3e-3)
    calibrated = calibrate_roofline(GPT2, samples)
    assert calibrated.combine == "sum"
    assert calibrated.held_out_by_combine["sum"].p90 < calibrated.held_out_by_combine["max"].p90
    assert calibrated.device.achievable_bandwidth == pytest.approx(10e9, rel=0.05)
    cost = calibrated.cost_model(GPT2_MEDIUM)
    context = np.array([9, 250])
    assert np.array_equal(
        cost.decode_run_times_s(context, 40), loop_decode_run_times_s(cost, context, 40)
    )


def test_profile_round_trips_through_json(tmp_path):
    profile = make_profile(samples_from(linear_price, noise=0.03))
    path = tmp_path / "p.json"
    profile.save(path)
    doc = json.loads(path.read_text())
    assert doc["schema"] == PROFILE_SCHEMA
    assert {"model", "executor", "environment", "fit", "calibrated_roofline", "samples"} <= set(doc)
    assert set(doc["fit"]["held_out"]) == {"linear", "hinge", "interp"}
    loaded = load_profile(path)
    shape = BatchShape([100], [300], [50, 60, 700])
    for model in (None, get_model_spec("llama-3.1-8b")):
        before = profile.cost_model(model)
        assert loaded.cost_model(model).step_time_s(shape) == before.step_time_s(shape)
    assert loaded.cost_model().describe().startswith("profiled: gpt2 float32 on cpu (2 threads)")
    assert loaded.step_fit.held_out == profile.step_fit.held_out


def test_scheduler_defaults_follow_the_profiled_executor():
    profile = make_profile(samples_from(linear_price))
    assert profile.scheduler_defaults() == {
        "num_kv_blocks": 910,
        "block_size": 16,
        "max_model_len": 1024,
    }
    assert profile.scheduler_defaults(dataclasses.replace(GPT2, name="other-name"))[
        "num_kv_blocks"
    ] == 910  # fmt: skip
    # another model: the same 1 GiB budget over its KV bytes per block, capped like rose-run
    llama = dataclasses.replace(get_model_spec("llama-3.1-8b"), dtype_bytes=4)
    other = profile.scheduler_defaults(llama, max_num_seqs=256)
    assert other["num_kv_blocks"] == (1 << 30) // (llama.kv_bytes_per_token * 16)
    assert other["max_model_len"] == llama.max_model_len
    assert profile.scheduler_defaults(block_size=32)["num_kv_blocks"] == (1 << 30) // (
        GPT2.kv_bytes_per_token * 32
    )


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({"schema": "other/1"}, "not a roseinfer profile"),
        ({"schema": PROFILE_SCHEMA, "model": {}}, "incomplete or damaged"),
    ],
)
def test_bad_profiles_are_refused_with_a_reason(tmp_path, doc, message):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ProfileError, match=message):
        load_profile(path)
    with pytest.raises(ProfileError, match="cannot read profile"):
        load_profile(tmp_path / "missing.json")


def rose_sim(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "roseinfer.cli.sim", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def profile_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("profile") / "p.json"
    make_profile(samples_from(linear_price, noise=0.02)).save(path)
    return path


def test_rose_sim_cost_model_takes_the_profiled_setup(profile_file, tmp_path):
    out = tmp_path / "r.json"
    flags = ["--workload", "synthetic", "--num-requests", "8", "--quiet", "--save-result", str(out)]
    proc = rose_sim("--cost-model", str(profile_file), *flags)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert result["cost_model_kind"] == "profiled"
    assert result["cost_model"].startswith("profiled: gpt2")
    assert result["cost_model_file"] == str(profile_file)
    assert (result["num_kv_blocks"], result["block_size"], result["max_model_len"]) == (
        910,
        16,
        1024,
    )
    assert result["profile_overrides"] == {}
    assert result["model"] == "gpt2"


def test_rose_sim_records_flags_that_override_the_profile(profile_file, tmp_path):
    out = tmp_path / "r.json"
    proc = rose_sim(
        "--cost-model", str(profile_file), "--model", "llama-3.1-8b", "--num-kv-blocks", "500",
        "--max-model-len", "2048", "--workload", "synthetic", "--num-requests", "4", "--quiet",
        "--save-result", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert result["cost_model_kind"] == "calibrated-roofline"
    assert result["cost_model"].startswith("calibrated roofline: llama-3.1-8b")
    overrides = result["profile_overrides"]
    assert overrides["model"] == {"profile": "gpt2", "used": "llama-3.1-8b"}
    assert overrides["num_kv_blocks"] == {"profile": 910, "used": 500}
    assert overrides["max_model_len"] == {"profile": 1024, "used": 2048}
    assert result["num_kv_blocks"] == 500


def test_rose_sim_cost_model_errors_are_one_line(profile_file, tmp_path):
    proc = rose_sim("--cost-model", str(profile_file), "--hardware", "cpu")
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "rose-sim: error: --cost-model prices the profiled device; drop --hardware"
    )
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    proc = rose_sim("--cost-model", str(bad))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert "is not JSON" in proc.stderr


# ------------------------------------------------------ fit range and outliers
def test_a_profiled_run_reports_the_steps_it_priced_outside_the_fit() -> None:
    """Before: a cost model fitted on small steps priced a long queue silently
    (a mean TTFT of 33,697 s with only a held-out error in the summary)."""
    from roseinfer.metrics import format_summary, summarize

    small = [(k, s) for k, s in grid_shapes() if s.totals().num_seqs <= 8 and s.num_tokens <= 600]
    samples = [ProfileSample(k, s, (linear_price(s),)) for k, s in small]
    cost = make_profile(samples).cost_model()
    config = SchedulerConfig(num_kv_blocks=4000, max_model_len=2048, max_num_seqs=32)
    inside = simulate(synthetic(num_requests=4, prompt_tokens=64, output_tokens=8,
                                submit_interval_s=10.0), config, cost)  # fmt: skip
    assert inside.info["cost_model_steps_outside_fit_share"] == 0.0
    assert inside.info["cost_model_max_extrapolation"] == 1.0
    busy = simulate(synthetic(num_requests=64, prompt_tokens=1500, output_tokens=64,
                              submit_interval_s=0.0), config, cost)  # fmt: skip
    share = busy.info["cost_model_steps_outside_fit_share"]
    assert 0 < share <= 1 and busy.info["cost_model_max_extrapolation"] > 2
    assert busy.info["cost_model_max_extrapolation_axis"] in (
        "prefill tokens", "decode sequences", "context tokens")  # fmt: skip
    text = format_summary({**summarize(busy.records), **busy.info}, "t")
    assert f"Warning: {share:.1%} of steps were priced outside the step shapes" in text
    assert "Warning" not in format_summary({**summarize(inside.records), **inside.info}, "t")


def test_extrapolation_counts_the_steps_of_a_decode_run_that_cross_the_range() -> None:
    from roseinfer.calibration.cost_model import StepTotals
    from roseinfer.calibration.step_model import ExtrapolationCounter, SampleRange

    counter = ExtrapolationCounter(SampleRange(100, 4, 1000))
    # 4 decodes at 990 context tokens: steps 0..2 reach 990, 994, 998; 3..9 exceed 1000
    counter.observe(StepTotals(4, 4, 0, 0, 0, 990), num_steps=10)
    assert (counter.num_steps, counter.num_outside) == (10, 7)
    assert counter.max_factor == pytest.approx((990 + 4 * 9) / 1000)
    counter.observe(StepTotals(8, 8, 0, 0, 0, 80))  # twice the decode batch it saw
    assert (counter.num_outside, counter.max_factor, counter.axis) == (8, 2.0, "decode sequences")


def test_one_outlying_step_does_not_dominate_the_fit() -> None:
    """Before: one 2.4 s step among 31 ordinary ones (a pause of the machine) pulled
    the relative-error fit towards it and every price with it."""
    rng = np.random.default_rng(0)
    shapes = [BatchShape.decode(rng.integers(50, 400, int(rng.integers(1, 9)))) for _ in range(31)]
    shapes += [BatchShape([int(n)], [int(n)], []) for n in rng.integers(16, 256, 1)]
    samples = [ProfileSample("decode", s, (linear_price(s) * (1 + 0.02 * rng.standard_normal()),))
               for s in shapes]  # fmt: skip
    samples[5] = ProfileSample("decode", shapes[5], (2.4,))
    fit = fit_step_model(samples)
    cost = ProfiledCostModel(fit.model, "t")
    errors = [
        abs(cost.step_time_s(s) / linear_price(s) - 1) for i, s in enumerate(shapes) if i != 5
    ]
    assert max(errors) < 0.10, max(errors)


# ------------------------------------------------------------- GPU step terms
def gpu_price(shape: BatchShape) -> float:
    """A CUDA-graph executor: the linear cost, 5 ms more for a step that launches
    eagerly, and 1 us per token of the longest decode context's excess, spread
    over at least 66 decodes."""
    t = shape.totals()
    decodes = t.num_seqs - t.num_prefills
    excess = decodes * t.decode_max_context - t.decode_context_tokens
    eager = 5e-3 if t.num_tokens > t.num_seqs or t.num_seqs > 512 else 0.0
    return linear_price(shape) + eager + 1e-6 * excess / max(decodes, 66)


def test_a_gpu_profile_fits_the_eager_launches_and_the_decode_tail() -> None:
    """A profile taken with CUDA graphs and a splitting kernel fits the GPU terms:
    an eager step's launches and a skewed decode batch's tail, which the linear
    basis alone cannot price (it misses the skewed batches by far more)."""
    from roseinfer.calibration.graph_replay import cuda_graph_batch_sizes
    from roseinfer.calibration.profile_grid import GridLimits, profile_grid
    from roseinfer.calibration.step_model import GPU_TERMS, decode_spread_seqs
    from roseinfer.executor.profiler import batch_shape_of

    limits = GridLimits(512, 64, 2048, 64 * 2048, 16, cuda_graph_batch_sizes(64))
    shapes = [batch_shape_of(seqs) for _, seqs in profile_grid(limits)]
    samples = [ProfileSample("x", s, (gpu_price(s),)) for s in shapes]
    spread = decode_spread_seqs({"decode_split_programs": 528, "cuda_graph_batch_sizes": [1]}, 8)
    assert spread == 66.0 and decode_spread_seqs({"decode_split_programs": 528}, 8) == 0.0
    fit = fit_step_model(samples, decode_spread_seqs=spread, use="hinge")
    assert fit.model.feature_names[-2:] == list(GPU_TERMS)
    plain = fit_step_model(samples, use="hinge")
    assert "eager" not in plain.model.feature_names
    skewed = BatchShape.decode([2000] + [100] * 63)
    gpu_error, plain_error = (
        abs(ProfiledCostModel(model, "t").step_time_s(skewed) / gpu_price(skewed) - 1)
        for model in (fit.model, plain.model)
    )
    assert gpu_error < 0.002 and plain_error > 10 * gpu_error
    run = ProfiledCostModel(fit.model, "t").decode_run_times_s(np.array([2000] + [100] * 63), 5)
    one_by_one = [ProfiledCostModel(fit.model, "t").step_time_s(
        BatchShape.decode([2000 + j] + [100 + j] * 63)) for j in range(5)]  # fmt: skip
    assert run.tolist() == one_by_one  # the jump over a decode run prices it bit for bit


def test_the_interpolation_leaves_the_decode_tail_to_the_linear_terms() -> None:
    """Before: the interpolation averaged sample times over (prefill tokens, decode
    sequences, context tokens), axes blind to the longest context, so skewed decode
    batches (a served run's) priced the uniform batches around them high, as on one
    H100 (+13% on a check's uniform decodes). It now interpolates each sample's
    ratio to the linear model, whose GPU terms price the tail."""
    from roseinfer.calibration.step_model import InterpolatedStepModel

    def price(shape: BatchShape) -> float:  # gpu_price's tail, 20x: ~20% on a skewed batch
        t = shape.totals()
        excess = t.num_seqs * t.decode_max_context - t.decode_context_tokens
        return linear_price(shape) + 2e-5 * excess / max(t.num_seqs, 66)

    rng = np.random.default_rng(0)
    shapes = []
    for n in (8, 16, 24, 32, 40, 48, 56, 64):
        for context in (256, 1024, 4096):
            shapes.append(BatchShape.decode([context] * n))
            skewed = rng.integers(context // 4, context, n)  # a served run's batch: one long
            skewed[0] = 4 * context
            shapes.append(BatchShape.decode(skewed))
    for tokens in (64, 512, 2048):  # prefills and mixed steps: a hull with volume
        shapes.append(BatchShape([tokens], [tokens], []))
        shapes.append(BatchShape([tokens], [tokens], [4096] * 64))
    samples = [ProfileSample("decode", s, (price(s),)) for s in shapes]
    fit = fit_step_model(samples, decode_spread_seqs=66.0, use="interp")
    assert isinstance(fit.model, InterpolatedStepModel)
    cost = ProfiledCostModel(fit.model, "t")
    uniform = [BatchShape.decode([c] * n) for n in (12, 20, 36, 44, 60) for c in (600, 2000)]
    errors = [abs(cost.step_time_s(s) / price(s) - 1) for s in uniform]
    assert max(errors) < 0.005, max(errors)
    for s in shapes:  # exact at every sample, as an interpolation of the times was
        assert cost.step_time_s(s) == pytest.approx(price(s), rel=1e-4)
    cpu = fit_step_model(samples, use="interp").model  # no GPU terms: the times themselves
    assert isinstance(cpu, InterpolatedStepModel) and fit.model.relative and not cpu.relative
    assert (
        max(abs(ProfiledCostModel(cpu, "t").step_time_s(s) / price(s) - 1) for s in uniform) > 0.05
    )


def test_a_served_runs_single_eager_draws_are_averaged_not_interpolated() -> None:
    """Before: the ratio interpolation went through every single draw of a served
    run's prefills, so one stretched draw lifted its neighbourhood's price (on one
    H100, 11% on every 1,100-token prompt). Each such draw now holds the mean of its
    nearest draws' ratios: the level stays, the noise of one draw does not."""
    from roseinfer.calibration.step_model import (
        EAGER_DRAW_NEIGHBOURS,
        InterpolatedStepModel,
        eager_draws,
    )

    rng = np.random.default_rng(1)
    samples = [ProfileSample(k, s, (gpu_price(s),) * 3) for k, s in grid_shapes()]
    for new in rng.integers(100, 2000, 240):  # a served run's prompts, each timed once
        shape = BatchShape([int(new)], [int(new)], [])
        stretch = float(np.exp(0.08 * rng.standard_normal()))
        samples.append(ProfileSample("served-prefill", shape, (gpu_price(shape) * stretch,)))
    draws = eager_draws(samples)
    assert draws.sum() == 240 > EAGER_DRAW_NEIGHBOURS  # the grid's repeated shapes are not draws
    fit = fit_step_model(samples, decode_spread_seqs=66.0, use="interp")
    cost = ProfiledCostModel(fit.model, "t")
    prompts = [BatchShape([n], [n], []) for n in range(150, 1950, 25)]
    errors = [abs(cost.step_time_s(s) / gpu_price(s) - 1) for s in prompts]
    assert max(errors) < 0.05, max(errors)
    model = fit.model
    assert isinstance(model, InterpolatedStepModel)
    agg = np.vstack([shape_aggregates(s.shape) for s in samples])
    times = np.array([s.target_s for s in samples])
    raw = InterpolatedStepModel.of_samples("interp", agg, times, model.fallback)  # draws as points
    raw_errors = [
        abs(ProfiledCostModel(raw, "t").step_time_s(s) / gpu_price(s) - 1) for s in prompts
    ]
    assert max(raw_errors) > 2 * max(errors), (max(raw_errors), max(errors))


def test_a_gpu_step_model_round_trips_through_json(tmp_path) -> None:
    from roseinfer.calibration.profile import load_profile

    samples = [ProfileSample("x", s, (gpu_price(s),)) for _, s in grid_shapes()]
    profile = make_profile(samples)
    assert "eager" not in getattr(profile.step_fit.model, "feature_names", ["-"])  # a CPU profile
    gpu = Profile.create(
        model_name="gpt2", model_spec=GPT2, samples=samples, environment={},
        executor={**profile.executor, "cuda_graph_batch_sizes": [1, 2, 4], "decode_split_programs": 528},
    )  # fmt: skip
    path = tmp_path / "p.json"
    gpu.save(path)
    again = load_profile(path)
    shape = BatchShape([40], [40], [900, 30, 30])
    assert again.cost_model().step_time_s(shape) == gpu.cost_model().step_time_s(shape)
    model = getattr(gpu.step_fit.model, "fallback", gpu.step_fit.model)
    assert model.decode_spread_seqs == 528 / GPT2.num_kv_heads


FULL_EXECUTOR = {
    "cuda_graph_batch_sizes": [1, 2, 4, 8], "decode_split_programs": 528,
    "cudagraph_mode": "FULL", "cuda_graph_token_sizes": [2, 4, 8, 16, 24, 32],
}  # fmt: skip


def full_price(shape: BatchShape) -> float:
    """:func:`gpu_price` for an executor that also replays passes of up to 32 new
    tokens from graphs (``--cudagraph-mode FULL``): no launch term for them."""
    t = shape.totals()
    replayed = t.num_tokens > t.num_seqs and t.num_tokens <= 32
    return gpu_price(shape) - (5e-3 if replayed else 0.0)


def test_a_full_mode_profile_prices_its_replayed_prefills_without_launches(tmp_path) -> None:
    """A profile taken with ``--cudagraph-mode FULL`` records the token counts it
    captured; its step model's eager term then covers only longer passes, so a
    short prompt is priced at its GPU time (5 ms less than an eager one) and a long
    one keeps its launches. It round-trips through JSON with the same rule."""
    samples = [ProfileSample("x", s, (full_price(s),) * 3) for _, s in grid_shapes()]
    base = make_profile(samples).executor
    full = Profile.create(
        model_name="gpt2", model_spec=GPT2, samples=samples, environment={},
        executor={**base, **FULL_EXECUTOR}, use="linear",
    )  # fmt: skip
    assert full.graphs.mode == "FULL" and full.graphs.max_mixed_tokens == 32
    cost = full.cost_model()
    assert cost.graphs == full.graphs
    for n in (8, 24, 32, 100, 1000):
        shape = BatchShape([n], [n], [])
        assert cost.step_time_s(shape) == pytest.approx(full_price(shape), rel=1e-3), n
    # the same samples fitted as if every prefill had launched eagerly price short ones high
    decode_only = Profile.create(
        model_name="gpt2", model_spec=GPT2, samples=samples, environment={}, use="linear",
        executor={**base, **FULL_EXECUTOR, "cudagraph_mode": "FULL_DECODE_ONLY",
                  "cuda_graph_token_sizes": []},
    )  # fmt: skip
    short = BatchShape([24], [24], [])
    assert decode_only.cost_model().step_time_s(short) > 1.02 * full_price(short)
    full.save(tmp_path / "full.json")
    again = load_profile(tmp_path / "full.json")
    assert again.cost_model().step_time_s(short) == cost.step_time_s(short)


def test_calibrations_of_two_graph_modes_are_not_pooled(tmp_path) -> None:
    """One step model prices one graph rule: pooling a ``FULL`` profile with a
    ``FULL_DECODE_ONLY`` one (or a CPU one) is refused in one line naming both."""
    from roseinfer.calibration.profile import load_calibration

    samples = samples_from(gpu_price)
    cpu = make_profile(samples)
    decode_only = dataclasses.replace(
        cpu, executor={**cpu.executor, **FULL_EXECUTOR, "cuda_graph_token_sizes": []}
    )
    full = dataclasses.replace(cpu, executor={**cpu.executor, **FULL_EXECUTOR})
    for name, profile in (("cpu", cpu), ("decode", decode_only), ("full", full)):
        profile.save(tmp_path / f"{name}.json")
    assert load_calibration([tmp_path / "full.json", tmp_path / "full.json"]).graphs.mode == "FULL"
    for other in ("cpu", "decode"):
        with pytest.raises(ProfileError, match=r"full\.json ran its CUDA graphs as FULL and"):
            load_calibration([tmp_path / "full.json", tmp_path / f"{other}.json"])
