"""``benchmarks/gpu/decode_skew.py``: large decode steps of real runs grouped by context skew."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu" / "decode_skew.py"
CHECKS = ROOT / "benchmarks" / "gpu" / "results" / "h100-2026-11-26-checks"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, check=False)  # fmt: skip


@pytest.mark.skipif(not CHECKS.is_dir(), reason="no shipped H100 runs")
def test_the_h100_check_runs_skewed_decodes_sit_further_above_their_floor():
    """The saturated check runs of 2026-11-26 (before balanced splits): each skew group
    past 2x sits above the least-skewed one's ratio to the floor, and the time beyond
    it is a positive share of these steps."""
    done = run(str(CHECKS / "steps-1s.jsonl.gz"), str(CHECKS / "steps-2s.jsonl.gz"))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    ratios = [float(x.split()[-1]) for x in lines if x.strip()[:1].isdigit() or ">=" in x[:11]]
    assert len(ratios) >= 3 and all(r > ratios[0] * 1.1 for r in ratios[1:]), lines
    assert "balanced splits not recorded" in done.stdout
    beyond = lines[-1].split(": ")[-1]
    assert float(beyond.split(" s")[0]) > 0, lines[-1]


def test_a_log_without_large_decodes_says_so(tmp_path):
    header = {"schema": "roseinfer-steplog/1", "backend": "rose-run", "created": "",
              "model": {"name": "llama-3.1-8b", "spec": None},
              "executor": {"attention_launches": {"launch": [[4, 1, 32, 4, 3]],
                                                  "balanced": [[4, 1]]}}}  # fmt: skip
    step = {"step": 0, "start_s": 0.0, "end_s": 0.01, "forward_s": 0.009, "host_s": 0.001,
            "phase": "decode", "request_ids": ["a", "b"], "num_new_tokens": [1, 1],
            "num_context_tokens": [100, 400], "is_decode": [True, True]}  # fmt: skip
    path = tmp_path / "s.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write(json.dumps(header) + "\n" + json.dumps(step) + "\n")
    done = run(str(path))
    assert done.returncode == 1 and "no decode step of >= 128" in done.stderr
    assert "balanced splits [[4, 1]]" in done.stdout
    done = run(str(path), "--min-seqs", "2")  # skew 400 / 250 = 1.6: one group, nothing beyond
    assert done.returncode == 0, done.stderr
    (row,) = [x.split() for x in done.stdout.splitlines() if x.strip().startswith("1-2")]
    assert row[1:3] == ["1", "250"]
    assert done.stdout.splitlines()[-1].endswith(": 0.00 s (0%)")
    done = run(str(tmp_path / "missing.jsonl"))
    assert done.returncode == 2 and done.stderr.startswith("decode_skew: error: cannot read")


@pytest.mark.skipif(not CHECKS.is_dir(), reason="no shipped H100 runs")
def test_step_floor_splits_a_runs_loss_by_step_class():
    """``benchmarks/gpu/step_floor.py``: per class of step, time over the floor and its
    share of the run's loss; the shares add up, the total's floor / wall is the run's."""
    done = subprocess.run(
        [sys.executable, str(SCRIPT.parent / "step_floor.py"), str(CHECKS / "steps-1s.jsonl.gz")],
        capture_output=True, text=True, timeout=300, cwd=ROOT, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = [x.split() for x in done.stdout.splitlines()[2:] if x.startswith("  ") and "%" in x]
    shares = [int(r[-1].rstrip("%")) for r in rows if r[0] != "total"]
    assert 97 <= sum(shares) <= 103 and len(shares) >= 5
    large = next(r for r in rows if r[:2] == ["decode", "192-256"])
    assert float(large[-2]) > 1.5 and max(shares) == int(large[-1].rstrip("%"))
    assert "floor / wall: 0.63" in done.stdout
