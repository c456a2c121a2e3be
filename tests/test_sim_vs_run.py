"""benchmarks/gpu/sim_vs_run.py on the shipped H100 run: the run's own step log replays
it, and the cost models are named and compared on every metric (no torch)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "benchmarks" / "gpu" / "results" / "h100-2026-11-26"

pytestmark = pytest.mark.skipif(not RUN.is_dir(), reason="no shipped H100 results")


def test_the_runs_step_log_replays_it_and_every_cost_model_is_compared(tmp_path):
    out = tmp_path / "errors.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu" / "sim_vs_run.py"),
           str(RUN / "run-budget.json"), "--calibration", str(RUN / "steps-budget.jsonl"),
           "--output", str(out), "--", "--model", "llama-3.1-8b", "--hardware", "h100-sxm",
           "--policy", "budget", "--prefill-max-tokens", "8192", "--num-requests", "400",
           "--request-rate", "inf", "--max-model-len", "8192", "--num-kv-blocks", "27643"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())["errors"]
    labels = list(rows)
    assert labels[0].startswith("roofline h100-sxm, measured 2026-11 on NVIDIA H100 80GB HBM3")
    assert "; eager step jitter of" in labels[1] and labels[1].endswith("--step-jitter measured)")
    assert labels[2] == "roofline h100-sxm, datasheet constants"
    replay = rows[labels[3]]
    assert labels[3].startswith("step log") and len(replay) == 10
    assert max(abs(e) for e in replay.values()) < 0.02  # the run's own steps: replay
    measured, datasheet = rows[labels[0]], rows[labels[2]]
    assert abs(measured["duration"]) < abs(datasheet["duration"])  # the fit moved it closer


CHECKS = ROOT / "benchmarks" / "gpu" / "results" / "h100-2026-11-26-checks"
CHECKS_27 = ROOT / "benchmarks" / "gpu" / "results" / "h100-2026-11-27-checks"
CHECKS_27B = ROOT / "benchmarks" / "gpu" / "results" / "h100-2026-11-27b-checks"
CHECKS_FULL = ROOT / "benchmarks" / "gpu" / "results" / "h100-2026-11-27d-full"
"""The check's runs of 2026-11-26 (clipped requests, a profile without a served run),
of 2026-11-27 (this version's rose-run profile; requests beyond the limit rejected),
and of 2026-11-27 with ``--cudagraph-mode FULL`` as the default (``-full``)."""
COMBOS = {
    "1": ["--policy", "budget", "--prefill-max-tokens", "2048"],
    "2": ["--policy", "pack", "--prefill-max-tokens", "2048", "--force-fifo-every", "8",
          "--loop-order", "decode-first"],
}  # fmt: skip
"""The GPU fidelity check's two combinations, by the digit of its result files."""


def check20_errors(
    tmp_path: Path, run: str, calibration: list[str], checks: Path = CHECKS
) -> dict[str, dict[str, float]]:
    """sim_vs_run.py's errors, by cost model, on check 20's run ``run`` (``1s``, ``2l``,
    ...: combination, then saturated or 60% load) in ``checks``, as the check simulated it."""
    i, load = run[0], run[1]
    saturated = json.loads((checks / "check20" / f"r{i}s.json").read_text())
    rate = "inf" if load == "s" else repr(0.6 * saturated["completed"] / saturated["duration"])
    real = checks / "check20" / f"r{run}.json"
    doc = json.loads(real.read_text())
    blocks = doc["num_kv_blocks"]
    clip = ["--fit-lengths", "clip"] if doc["fit_lengths"].startswith("clip") else []
    mode = doc.get("cudagraph_mode") or "FULL_DECODE_ONLY"
    out = tmp_path / f"{run}.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu" / "sim_vs_run.py"), str(real),
           *(["--calibration", *calibration] if calibration else []), "--output", str(out),
           "--", "--model", "llama-3.1-8b", "--hardware", "h100-sxm", "--num-requests", "500",
           "--max-model-len", "4096", "--seed", "0", *COMBOS[i], "--request-rate", rate,
           "--num-kv-blocks", str(blocks), "--cudagraph-mode", mode, *clip]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    return json.loads(out.read_text())["errors"]


def roofline_worst(tmp_path: Path, checks: Path) -> dict[str, float]:
    """The built-in h100-sxm's worst |error| over check 20's four runs in ``checks``:
    ``p50`` (duration and the p50s) and ``p99``."""
    worst = {"p50": 0.0, "p99": 0.0}
    for run in ("1s", "1l", "2s", "2l"):
        rows = check20_errors(tmp_path, run, [], checks)
        measured = next(v for k, v in rows.items() if k.startswith("roofline h100-sxm, measured"))
        for key, error in measured.items():
            if key.startswith(("p50", "p99")) or key == "duration":
                q = "p99" if key.startswith("p99") else "p50"
                worst[q] = max(worst[q], abs(error))
    return worst


@pytest.mark.skipif(not CHECKS.is_dir(), reason="no shipped H100 check results")
def test_the_measured_spec_replays_the_fidelity_checks_runs_within_its_targets(tmp_path):
    """The GPU fidelity check's four real runs (budget 2048; pack 2048 + force-FIFO 8 +
    decode-first; saturated and at 60%), replayed by rose-sim with the built-in
    h100-sxm: worst p50 error <= 10% and p99 <= 15% (the check's targets). Its
    decode imbalance was fitted to another run, so this guards the spec, not a fit."""
    worst = roofline_worst(tmp_path, CHECKS)
    assert worst["p50"] <= 0.10 and worst["p99"] <= 0.15, worst


@pytest.mark.skipif(not CHECKS_FULL.is_dir(), reason="no shipped H100 check results")
def test_the_measured_spec_prices_the_checks_full_mode_runs_within_its_targets(tmp_path):
    """The same check run with ``--cudagraph-mode FULL`` as the default (small prefills
    replayed, so the roofline drops their launch roof by ``graph_replay``'s rule): the
    built-in h100-sxm stays within the check's targets (10% / 15%; on the GPU it gave
    7% / 14%)."""
    worst = roofline_worst(tmp_path, CHECKS_FULL)
    assert worst["p50"] <= 0.10 and worst["p99"] <= 0.15, worst


@pytest.mark.skipif(not CHECKS.is_dir(), reason="no shipped H100 check results")
def test_the_profiles_step_jitter_gives_the_tail_its_medians_miss(tmp_path):
    """At 60% load the p99 inter-token latency of the check's runs is a prefill step
    that a host hiccup stretched: the profile priced at its medians misses it by
    over 25%, its measured step jitter (the profile's own repetitions) within 8%."""
    for run in ("1l", "2l"):
        rows = check20_errors(tmp_path, run, [str(CHECKS / "check20" / "p-refit.json")])
        medians = next(v for k, v in rows.items() if k.endswith("(medians, --step-jitter off)"))
        jittered = next(v for k, v in rows.items() if "; step jitter of" in k)
        assert medians["p99_itl_ms"] < -0.25, medians
        assert abs(jittered["p99_itl_ms"]) < 0.08, jittered


@pytest.mark.skipif(not CHECKS.is_dir(), reason="no shipped H100 check results")
def test_the_measured_specs_eager_jitter_gives_the_tail_its_roofline_times_miss(tmp_path):
    """The budget run at 60% load: at its roofline times h100-sxm misses the p99
    inter-token latency by almost 15%; with its fitted profiles' eager repetitions
    (--step-jitter measured) within 8%, and p50 ITL moves by under a point."""
    rows = check20_errors(tmp_path, "1l", [])
    plain = next(v for k, v in rows.items() if k.startswith("roofline h100-sxm, measured"))
    jittered = next(v for k, v in rows.items() if k.endswith("(--step-jitter measured)"))
    assert plain["p99_itl_ms"] < -0.12, plain
    assert abs(jittered["p99_itl_ms"]) < 0.08, jittered
    assert abs(jittered["p50_itl_ms"] - plain["p50_itl_ms"]) < 0.01


@pytest.mark.skipif(not CHECKS_27.is_dir(), reason="no shipped H100 check results")
def test_the_checks_own_profile_prices_its_runs_decodes(tmp_path):
    """The check's second H100 run (2026-11-27), priced with the GPU profile it took
    (grid and served run, as ``rose-sim --cost-model`` prices it). Before: the
    interpolation of step times put the served run's skewed decode batches onto the
    runs' evenly spread ones, and p50 TPOT at 60% load came out +16% / +18%; with
    ratios to the linear model (whose terms price the tail) within 5%. Every p99
    within the check's 10%. The measured roofline stays within its 10% / 15%."""
    profile = str(CHECKS_27 / "check20" / "p.json")
    for run in ("1s", "1l", "2s", "2l"):
        rows = check20_errors(tmp_path, run, [profile], CHECKS_27)
        jittered = next(v for k, v in rows.items() if "; step jitter of" in k)
        roofline = next(v for k, v in rows.items() if k.startswith("roofline h100-sxm, measured"))
        worst = {
            q: max(abs(v) for k, v in roofline.items() if k.startswith(q)) for q in ("p50", "p99")
        }
        assert abs(jittered["p50_tpot_ms"]) < 0.05, (run, jittered)
        assert max(abs(v) for k, v in jittered.items() if k.startswith("p99")) < 0.10, jittered
        assert worst["p50"] < 0.10 and worst["p99"] < 0.15, (run, roofline)


@pytest.mark.skipif(not CHECKS_27B.is_dir(), reason="no shipped H100 check results")
def test_over_jitter_seeds_the_profile_prices_the_second_checks_p50s_within_5_percent():
    """The check's second H100 run of 2026-11-27, priced by its own profile under two
    jitter seeds (``benchmarks/gpu/jitter_seeds.py``): every run's p50 metrics and
    duration within 5% on average over the seeds, and the seeds move the p99s (the
    check's single seed is one draw of that spread)."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu" / "jitter_seeds.py"),
           str(CHECKS_27B), "--seeds", "2"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    worst_p50 = float(last.split("worst run mean p50 ")[1].split("%")[0])
    assert worst_p50 < 5.0, last
    lines = [line for line in proc.stdout.splitlines() if line.startswith(CHECKS_27B.name)]
    assert len(lines) == 4
    spread = [c for c in lines[1].split("; ") if c.startswith("p99_ttft")][0]  # 1l
    low, high = (float(v.strip("%")) for v in spread.split("[")[1].rstrip("]").split(", "))
    assert high - low > 0.5, spread


@pytest.mark.skipif(not CHECKS_27.is_dir(), reason="no shipped H100 check results")
def test_the_first_checks_profile_prices_1100_token_prompts_near_its_linear_model():
    """On the first check run's GPU profile, one stretched served prefill of 1,107
    tokens lifted the price of a 1,100-token prompt 11% above the linear model when
    every served draw was an interpolation point; averaged with its neighbours,
    within 5% (``benchmarks/gpu/step_classes.py --prompts``)."""
    script = ROOT / "benchmarks" / "gpu" / "step_classes.py"
    profile = str(CHECKS_27 / "check20" / "p.json")

    def ratio(*flags: str) -> float:
        cmd = [sys.executable, str(script), "--prompts", "1100", "--calibration", profile, *flags]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr
        line = next(x for x in proc.stdout.splitlines() if "1100-token prompt" in x)
        return float(line.split(", ")[1].split("x")[0])

    assert ratio("--draw-neighbours", "1") > 1.08  # the draw itself, as before
    assert abs(ratio() - 1) < 0.05


PROBE = ROOT / "benchmarks" / "gpu" / "results" / "h100-2026-11-27c-probe"


@pytest.mark.skipif(not PROBE.is_dir() or not CHECKS_27B.is_dir(), reason="no shipped H100 runs")
def test_several_real_runs_are_compared_by_their_mean_and_range(tmp_path):
    """Three eager budget runs at 60% load on two H100 leases of 2026-11-27 (the same command):
    errors are against their mean, and the check's profile with its jitter puts p99 TTFT
    inside the runs' range, which spans over 5% (the noise one run cannot show)."""
    reals = [PROBE / "call1" / "run-probe.json", PROBE / "call2" / "run-probe.json",
             PROBE / "call2" / "run-probe-omp1.json"]  # fmt: skip
    out = tmp_path / "e.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu" / "sim_vs_run.py"), *map(str, reals),
           "--calibration", str(CHECKS_27B / "check20" / "p.json"), "--output", str(out), "--",
           "--model", "llama-3.1-8b", "--hardware", "h100-sxm", "--num-requests", "500",
           "--max-model-len", "4096", "--seed", "0", *COMBOS["1"], "--request-rate", "10.4",
           "--num-kv-blocks", "27678"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    runs = [json.loads(p.read_text()) for p in reals]
    ttft = [r["p99_ttft_ms"] for r in runs]
    assert doc["real_mean"]["p99_ttft_ms"] == pytest.approx(sum(ttft) / 3)
    assert (max(ttft) - min(ttft)) / doc["real_mean"]["p99_ttft_ms"] > 0.05
    jittered = next(v for k, v in doc["errors"].items() if "; step jitter of" in k)
    simulated = (1 + jittered["p99_ttft_ms"]) * doc["real_mean"]["p99_ttft_ms"]
    assert min(ttft) <= simulated <= max(ttft)
    assert "real runs" in proc.stdout and "errors against the mean of 3 real runs" in proc.stdout
