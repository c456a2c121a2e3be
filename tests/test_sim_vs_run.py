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
    assert labels[1] == "roofline h100-sxm, datasheet constants"
    replay = rows[labels[2]]
    assert labels[2].startswith("step log") and len(replay) == 10
    assert max(abs(e) for e in replay.values()) < 0.02  # the run's own steps: replay
    measured, datasheet = rows[labels[0]], rows[labels[1]]
    assert abs(measured["duration"]) < abs(datasheet["duration"])  # the fit moved it closer
