"""``benchmarks/steplog_candidates.py`` runs end to end at tiny size on CPU; its
figures mean nothing there, only that every model prices every log and prints."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "steplog_candidates.py"


@pytest.mark.slow
def test_steplog_candidates_prices_each_log_with_every_model():
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--rounds", "1", "--model", "tiny-gpt2",
         "--num-requests", "12", "--request-rate", "20"],
        capture_output=True, text=True, timeout=600, check=True,
    ).stdout  # fmt: skip
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| ")]
    names = [r[0].strip() for r in rows[1:]]
    assert names == ["plain rule", "shipped", "linear", "hinge", "interp"]
    for row in rows[1:]:
        assert row[2].strip().endswith("/2")  # both policies priced by their own log
        for cell in (row[1], row[3]):
            mean, worst = (float(x.strip().rstrip("%")) for x in cell.split("/"))
            assert 0 <= mean <= worst
