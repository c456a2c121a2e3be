"""Step jitter (calibration/jitter.py): factors drawn by step index from the
profiled repetitions nearest a step's size, the same whether a decode run is
priced at once or step by step, and what ``rose-sim --step-jitter`` turns on."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from roseinfer.calibration import ProfileSample
from roseinfer.calibration.graph_replay import DECODE_GRAPHS, NO_GRAPHS
from roseinfer.calibration.jitter import CHUNK_STEPS, MIN_REPETITIONS, StepJitter
from roseinfer.config import SchedulerConfig
from roseinfer.simulator import BatchShape, simulate
from roseinfer.workloads import synthetic
from tests.test_profiled import linear_price, make_profile, samples_from

# (num_tokens, num_seqs, times_s): small launch-bound eager steps that spike 3x,
# large eager steps that never do, and graph-replayed decodes within 2%.
SMALL = [(64.0, 1.0, (0.010, 0.010, 0.030, 0.010)) for _ in range(20)]
LARGE = [(4096.0, 1.0, (0.100, 0.100, 0.100, 0.100)) for _ in range(20)]
DECODES = [(32.0, 32.0, (0.008, 0.00816, 0.00784)) for _ in range(20)]


def test_shapes_timed_once_carry_no_jitter() -> None:
    once = [(64.0, 1.0, (0.01,))] * 100
    assert StepJitter.of_repetitions(once, NO_GRAPHS) is None
    few = [(64.0, 1.0, (0.01, 0.02))] * (MIN_REPETITIONS // 2 - 1)
    assert StepJitter.of_repetitions(few, NO_GRAPHS) is None


def test_eager_steps_and_graph_decodes_draw_from_their_own_pools() -> None:
    jitter = StepJitter.of_repetitions(SMALL + DECODES, DECODE_GRAPHS)
    assert jitter is not None
    n = 4000
    eager = jitter.factors(0, np.ones(n, bool), np.full(n, 0.01))
    graph = jitter.factors(0, np.zeros(n, bool), np.full(n, 0.01))
    assert set(np.unique(eager)) == {1.0, 3.0}
    assert graph.min() > 0.97 and graph.max() < 1.03
    # the 3x repetition is one in four of the small shapes: drawn about that often
    assert 0.2 < float(np.mean(eager == 3.0)) < 0.3
    # without CUDA graphs one pool prices every step
    flat = StepJitter.of_repetitions(SMALL + DECODES, NO_GRAPHS)
    assert flat is not None and not flat.graph and len(flat.eager) == 40


def test_a_step_draws_from_the_shapes_of_its_own_size() -> None:
    """A host hiccup stretches a launch-bound step, not a GPU-bound one."""
    jitter = StepJitter.of_repetitions(SMALL + LARGE, NO_GRAPHS)
    assert jitter is not None
    n = 2000
    small = jitter.factors(0, np.ones(n, bool), np.full(n, 0.012))
    large = jitter.factors(0, np.ones(n, bool), np.full(n, 0.09))
    assert small.max() == 3.0
    assert np.all(large == 1.0)


@settings(max_examples=60, deadline=None)
@given(
    first=st.integers(0, 3 * CHUNK_STEPS),
    n=st.integers(1, 2 * CHUNK_STEPS),
    seed=st.integers(0, 3),
    stream=st.integers(0, 3),
)
def test_factors_depend_only_on_the_step_index(first: int, n: int, seed: int, stream: int) -> None:
    """A run priced at once gets, step for step, the factors of one-by-one pricing
    (across chunk boundaries), and every factor is a measured ratio."""
    base = StepJitter.of_repetitions(SMALL + LARGE + DECODES, DECODE_GRAPHS)
    assert base is not None
    jitter = StepJitter(base.eager, base.graph, seed)
    rng = np.random.default_rng(first + n)
    eager = rng.random(n) < 0.5
    times = rng.choice([0.008, 0.011, 0.1], n)
    whole = jitter.factors(first, eager, times, stream)
    steps = [first, first + n // 2, first + n - 1]
    for j in steps:
        i = j - first
        assert whole[i] == jitter.factor(j, bool(eager[i]), float(times[i]), stream)
    measured = {r for _, ratios in base.eager + base.graph for r in ratios}
    assert set(np.unique(whole)) <= measured


def test_seed_and_stream_change_the_draws() -> None:
    base = StepJitter.of_repetitions(SMALL + DECODES, DECODE_GRAPHS)
    assert base is not None
    n = 500
    eager, times = np.ones(n, bool), np.full(n, 0.01)
    a = base.factors(0, eager, times)
    assert not np.array_equal(a, base.factors(0, eager, times, stream=1))
    assert not np.array_equal(a, StepJitter(base.eager, base.graph, 1).factors(0, eager, times))
    assert np.array_equal(a, base.factors(0, eager, times))


def test_bad_ratios_are_refused() -> None:
    with pytest.raises(ValueError, match="must be > 0"):
        StepJitter(((0.01, (1.0, -1.0)),), ())
    with pytest.raises(ValueError, match="needs profiled repetitions"):
        StepJitter((), ())


def spiky_samples() -> list[ProfileSample]:
    """Linear-priced samples whose every fourth repetition takes twice as long."""
    out = []
    for s in samples_from(linear_price):
        t = s.times_s[0]
        out.append(ProfileSample(s.kind, s.shape, (t, t, 2 * t, t)))
    return out


def test_a_profile_prices_its_measured_spread_and_jumps_stay_exact() -> None:
    profile = make_profile(spiky_samples())
    cost = profile.cost_model()
    assert cost.jitter is not None and "step jitter of" in cost.source
    median = cost.without_jitter()
    assert median.jitter is None and "step jitter" not in median.source
    shape = BatchShape([128], [128], [])
    assert cost.step_time_s(shape) == median.step_time_s(shape)  # medians; the simulator jitters
    config = SchedulerConfig(num_kv_blocks=910, max_model_len=1024, max_num_seqs=8)
    reqs = synthetic(num_requests=40, prompt_tokens=64, output_tokens=60, submit_interval_s=0.03)
    fast, slow = simulate(reqs, config, cost), simulate(reqs, config, cost, jump=False)
    assert fast.num_steps == slow.num_steps
    for col in ("admitted_s", "first_token_s", "finish_s"):
        assert np.array_equal(fast.records[col], slow.records[col])
    plain = simulate(reqs, config, median)
    # a quarter of the steps take twice their median: the run takes longer
    assert fast.duration_s > 1.1 * plain.duration_s
    assert simulate(reqs, config, cost).duration_s == fast.duration_s  # seeded


def test_rose_sim_step_jitter_flag(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    make_profile(spiky_samples()).save(path)
    durations, sources = {}, {}
    for mode in ("profile", "measured", "off"):
        out = tmp_path / f"{mode}.json"
        cmd = [sys.executable, "-m", "roseinfer.cli.sim", "--cost-model", str(path),
               "--workload", "synthetic", "--num-requests", "30", "--prompt-tokens", "64",
               "--output-tokens", "30", "--step-jitter", mode, "--quiet", "--no-summary",
               "--save-result", str(out)]  # fmt: skip
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        doc = json.loads(out.read_text())
        durations[mode], sources[mode] = doc["duration"], doc["cost_model_source"]
    assert durations["profile"] == durations["measured"] > durations["off"]
    assert "step jitter of" in sources["profile"] and "step jitter" not in sources["off"]


def test_served_steps_are_fitted_as_medians() -> None:
    """A served step (one draw) is divided by the mean stretch of its class and size
    before the fit, so the simulator's jitter does not count it twice; the grid's
    samples (their medians) and a calibration without jitter are left alone."""
    from roseinfer.calibration.profile import served_medians, step_jitter

    grid = spiky_samples()
    jitter = step_jitter(grid, {})
    assert jitter is not None
    served = [ProfileSample("served-" + s.kind, s.shape, (s.times_s[0] * 1.25,)) for s in grid]
    fitted = served_medians(grid + served, jitter)
    assert fitted[: len(grid)] == grid
    # every ratio pool is (1, 1, 2, 1): a mean stretch of 1.25
    assert all(
        f.times_s[0] == pytest.approx(s.times_s[0] / 1.25)
        for f, s in zip(fitted[len(grid) :], served)
    )
    assert served_medians(served, None) == served
    assert make_profile(grid + served).cost_model().step_time_s(grid[5].shape) == pytest.approx(
        make_profile(grid).cost_model().step_time_s(grid[5].shape), rel=0.02
    )


def test_jumps_stay_exact_with_jitter_in_a_cluster(tmp_path: Path) -> None:
    """Two replicas, each drawing from its own stream (its index): planning decode
    runs at once or step by step gives the same run."""
    path = tmp_path / "p.json"
    make_profile(spiky_samples()).save(path)
    docs = {}
    for mode in ("jump", "no-jump"):
        out = tmp_path / f"{mode}.json"
        cmd = [sys.executable, "-m", "roseinfer.cli.sim", "--cost-model", str(path),
               "--workload", "synthetic", "--num-requests", "40", "--prompt-tokens", "64",
               "--output-tokens", "30", "--request-rate", "20", "--num-replicas", "2",
               "--quiet", "--no-summary", "--save-result", str(out),
               *(["--no-jump"] if mode == "no-jump" else [])]  # fmt: skip
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        docs[mode] = json.loads(out.read_text())
    for key in ("duration", "p99_ttft_ms", "p99_itl_ms", "mean_e2el_ms"):
        assert docs["jump"][key] == docs["no-jump"][key], key


@settings(max_examples=40, deadline=None)
@given(step=st.integers(0, 3 * CHUNK_STEPS), seed=st.integers(0, 3), pick=st.integers(0, 10**6))
def test_one_step_lookup_equals_the_array_one_on_pool_boundaries(
    step: int, seed: int, pick: int
) -> None:
    """:meth:`StepJitter.factor` (no numpy) and :meth:`StepJitter.factors` pick the
    same ratio, also for times exactly on a boundary between two pools."""
    base = StepJitter.of_repetitions(SMALL + LARGE + DECODES + MIDDLE, DECODE_GRAPHS)
    assert base is not None
    jitter = StepJitter(base.eager, base.graph, seed)
    bounds = [float(t) for pools in jitter._pools.values() for t in pools.thresholds]
    rng = np.random.default_rng(pick)
    times = [*bounds, *(b * (1 + 1e-16) for b in bounds), *rng.uniform(0.001, 0.2, 8)]
    for eager in (True, False):
        whole = jitter.factors(step, np.full(len(times), eager), np.array(times))
        for i, t in enumerate(times):
            assert jitter.factor(step + i, eager, t) == whole[i]


MIDDLE = [(512.0, 2.0, (0.020, 0.022, 0.020, 0.025)) for _ in range(5)]


def test_an_eager_only_jitter_leaves_graph_decodes_at_their_median() -> None:
    base = StepJitter.of_repetitions(SMALL + LARGE + DECODES, DECODE_GRAPHS)
    assert base is not None
    jitter = StepJitter(base.eager, (), eager_only=True)
    n = 400
    times = np.full(n, 0.01)
    assert np.all(jitter.factors(0, np.zeros(n, bool), times) == 1.0)
    assert jitter.factor(7, False, 0.01) == 1.0
    eager = jitter.factors(0, np.ones(n, bool), times)
    assert np.array_equal(eager, base.factors(0, np.ones(n, bool), times))
    assert np.array_equal(
        jitter.mean_factors(np.array([False, True]), np.array([0.01, 0.01])),
        [1.0, base.mean_factors(np.array([True]), np.array([0.01]))[0]],
    )
    assert "graph-replayed steps at medians" in jitter.summary()
    with pytest.raises(ValueError, match="eager-only"):
        StepJitter(base.eager, base.graph, eager_only=True)


def test_the_measured_h100_roofline_jitters_its_eager_steps_on_request() -> None:
    """h100-sxm carries its fitted profiles' eager repetitions: with them, prefill
    steps draw factors and decode runs inside the CUDA-graph sizes keep their
    roofline time; by default, and for a datasheet spec, every step is at its
    roofline time; the source says which."""
    from roseinfer.calibration.specs import MEASURED_JITTER_FILE
    from roseinfer.simulator import make_cost_model

    medians = make_cost_model("llama-3.1-8b", "h100-sxm")
    cost = medians.with_step_jitter()
    assert MEASURED_JITTER_FILE.exists() and cost.jitter is not None
    assert cost.jitter.eager_only and "eager step jitter of" in cost.source
    assert make_cost_model("llama-3.1-8b", "a100").with_step_jitter().jitter is None
    assert medians.jitter is None and "jitter" not in medians.source  # the copy left it
    decodes = synthetic(num_requests=8, prompt_tokens=64, output_tokens=200, submit_interval_s=0)
    config = SchedulerConfig(num_kv_blocks=4000, max_model_len=4096, max_num_seqs=64)
    jittered, plain = simulate(decodes, config, cost), simulate(decodes, config, medians)
    first = np.asarray(plain.records["first_token_s"])
    shift = np.asarray(jittered.records["first_token_s"]) - first
    # one prefill step, then decodes at their roofline time: every later token
    # moves by exactly what the prefill's factor moved the first one
    assert np.allclose(
        np.asarray(jittered.records["finish_s"]) - np.asarray(plain.records["finish_s"]), shift
    )
    reqs = synthetic(num_requests=60, prompt_tokens=300, output_tokens=20, submit_interval_s=0.02)
    assert simulate(reqs, config, cost).duration_s != simulate(reqs, config, medians).duration_s


def test_eager_decode_runs_jump_exactly_with_a_measured_roofline(tmp_path: Path) -> None:
    """Decode batches past the largest CUDA-graph size run eagerly, so the roofline
    jitters them: planned as one run or step by step, on the compiled core or the
    pure-Python one, the same run."""
    import os

    from roseinfer import _core

    docs = {}
    for mode in ("jump", "no-jump", "pure"):
        out = tmp_path / f"{mode}.json"
        cmd = [sys.executable, "-m", "roseinfer.cli.sim", "--workload", "synthetic",
               "--num-requests", "320", "--prompt-tokens", "16", "--output-tokens", "40",
               "--request-rate", "inf", "--max-num-seqs", "320", "--step-jitter", "measured",
               "--quiet", "--no-summary",
               "--save-result", str(out), *(["--no-jump"] if mode == "no-jump" else [])]  # fmt: skip
        env = {**os.environ, _core.PURE_ENV: "1"} if mode == "pure" else None
        subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
        docs[mode] = json.loads(out.read_text())
    assert "eager step jitter" in docs["jump"]["cost_model_source"]
    for key in ("duration", "p99_ttft_ms", "p99_itl_ms", "mean_e2el_ms", "p50_tpot_ms"):
        assert docs["jump"][key] == docs["no-jump"][key] == docs["pure"][key], key
