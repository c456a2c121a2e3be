"""Which steps replay CUDA graphs (calibration/graph_replay.py), and what the
simulator makes of ``--cudagraph-mode``: the roofline's launch roof and the step
jitter's classes follow the rule, in the pure and the compiled core alike."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import run_cli
from hypothesis import given
from hypothesis import strategies as st

from roseinfer.calibration.cost_model import make_cost_model
from roseinfer.calibration.graph_replay import (
    CUDAGRAPH_MODES,
    DECODE_GRAPHS,
    MAX_GRAPH_BATCH_SIZE,
    NO_GRAPHS,
    GraphReplay,
    mixed_graph_token_sizes,
)
from roseinfer.cli.sim import main as sim_main
from roseinfer.config import SchedulerConfig
from roseinfer.simulator import BatchShape
from roseinfer.simulator.engine import CostModelBackend, Simulator
from roseinfer.workloads import synthetic

FULL = GraphReplay.of_mode("FULL")


def test_the_modes_name_what_replays() -> None:
    assert GraphReplay.of_mode("FULL_DECODE_ONLY") == DECODE_GRAPHS == GraphReplay()
    assert GraphReplay(MAX_GRAPH_BATCH_SIZE, 504) == FULL  # the capture sizes end at 504
    assert mixed_graph_token_sizes(511)[:4] == (2, 4, 8, 16) and mixed_graph_token_sizes(1) == ()
    assert [g.mode for g in (FULL, DECODE_GRAPHS, NO_GRAPHS)] == [*CUDAGRAPH_MODES[::-1], "NONE"]
    assert "passes of <= 504 new tokens" in FULL.describe()
    assert NO_GRAPHS.describe() == "every step launched eagerly"
    with pytest.raises(ValueError, match="must be one of FULL_DECODE_ONLY, FULL"):
        GraphReplay.of_mode("PIECEWISE")
    with pytest.raises(ValueError, match=">= 0"):
        GraphReplay(-1)


def test_an_executor_section_says_what_it_captured() -> None:
    """A profile's or step log's ``executor`` facts: decode graphs, token graphs
    under FULL, nothing on a CPU or with --enforce-eager."""
    decode = {"cuda_graph_batch_sizes": [1, 2, 4, 8], "cudagraph_mode": "FULL_DECODE_ONLY"}
    assert GraphReplay.of_executor(decode) == DECODE_GRAPHS
    full = {**decode, "cudagraph_mode": "FULL", "cuda_graph_token_sizes": [2, 4, 8, 16, 24]}
    assert GraphReplay.of_executor(full) == GraphReplay(MAX_GRAPH_BATCH_SIZE, 24)
    assert GraphReplay.of_executor({**full, "enforce_eager": True}) == NO_GRAPHS
    assert GraphReplay.of_executor({"cuda_graph_batch_sizes": []}) == NO_GRAPHS
    assert GraphReplay.of_executor({}) == NO_GRAPHS  # an engine's log without the facts


@given(
    tokens=st.integers(1, 2000), extra_seqs=st.integers(0, 600), mixed=st.integers(0, 600),
    decode=st.sampled_from([0, 8, 512]),
)  # fmt: skip
def test_the_rule_is_one_for_numbers_and_arrays(
    tokens: int, extra_seqs: int, mixed: int, decode: int
) -> None:
    """A pass with prefill tokens is eager past ``max_mixed_tokens``, a decode batch
    past ``max_decode_seqs``; the array form agrees with the scalar one."""
    graphs = GraphReplay(decode, mixed)
    seqs = min(tokens, 1 + extra_seqs)
    eager = bool(graphs.runs_eagerly(tokens, seqs))
    assert eager == ((tokens > mixed) if tokens > seqs else (seqs > decode))
    array = graphs.runs_eagerly(np.array([float(tokens)] * 2), np.array([float(seqs)] * 2))
    assert array.tolist() == [eager, eager]


def test_a_full_roofline_prices_short_prefills_at_their_gpu_time() -> None:
    """On the measured h100-sxm a 32-layer eager pass takes >= ~10 ms to launch; under
    FULL a 200-token prompt is priced without that roof, a 600-token one keeps it,
    and decodes are the same under both rules."""
    eager = make_cost_model("llama-3.1-8b", "h100-sxm")
    full = make_cost_model("llama-3.1-8b", "h100-sxm", graphs=FULL)
    short, long_ = BatchShape([200], [200], []), BatchShape([600], [600], [])
    launch_s = 32 * eager.device.eager_launch_s_per_layer  # type: ignore[attr-defined]
    assert eager.step_time_s(short) >= launch_s > full.step_time_s(short)
    assert full.step_time_s(long_) == eager.step_time_s(long_)
    decode = BatchShape.decode([1000] * 64)
    assert full.step_time_s(decode) == eager.step_time_s(decode)
    assert "passes of <= 504 new tokens from CUDA graphs" in full.describe()


def _p50_ttft_s(cost, jitter: bool) -> float:
    """p50 TTFT (s) of a short-prompt workload on ``cost``."""
    model = cost.with_step_jitter() if jitter else cost
    config = SchedulerConfig(num_kv_blocks=20_000, max_num_seqs=64, max_model_len=4096)
    reqs = synthetic(60, prompt_tokens=200, output_tokens=20, submit_interval_s=0.05, seed=1)
    result = Simulator(config, model).run(reqs)
    ttft = np.asarray(result.columns["first_token_s"]) - np.asarray(result.columns["arrival_s"])
    return float(np.median(ttft))


def test_the_simulator_follows_the_mode_with_and_without_jitter() -> None:
    """A FULL run of short prompts answers sooner than a FULL_DECODE_ONLY one; with
    the spec's measured eager jitter its replayed prefills keep their median time
    (``eager_only``), so the jitter's classes follow the mode too."""
    eager = make_cost_model("llama-3.1-8b", "h100-sxm")
    full = make_cost_model("llama-3.1-8b", "h100-sxm", graphs=FULL)
    eager_ttft, full_ttft = _p50_ttft_s(eager, False), _p50_ttft_s(full, False)
    assert full_ttft < 0.9 * eager_ttft
    assert _p50_ttft_s(full, True) == full_ttft  # nothing eager to stretch
    assert _p50_ttft_s(eager, True) != eager_ttft
    backend = CostModelBackend(full.with_step_jitter())  # type: ignore[attr-defined]
    assert (backend._graph_seqs, backend._graph_tokens) == (512.0, 504.0)


def rose_sim(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    return run_cli(sim_main, "rose-sim", monkeypatch, capsys, *args)


def test_rose_sim_takes_the_mode_and_records_it(monkeypatch, capsys, tmp_path) -> None:
    base = ("--workload", "synthetic", "--prompt-tokens", "200", "--output-tokens", "20",
            "--num-requests", "60", "--request-rate", "20", "--quiet", "--no-summary")  # fmt: skip
    results = {}
    for mode in CUDAGRAPH_MODES:
        path = tmp_path / f"{mode}.json"
        code, _, err = rose_sim(monkeypatch, capsys, *base, "--cudagraph-mode", mode,
                                "--save-result", str(path))  # fmt: skip
        assert code == 0, err
        results[mode] = json.loads(path.read_text())
    assert [results[m]["cudagraph_mode"] for m in CUDAGRAPH_MODES] == list(CUDAGRAPH_MODES)
    assert results["FULL"]["p50_ttft_ms"] < results["FULL_DECODE_ONLY"]["p50_ttft_ms"]


def test_rose_sim_refuses_a_mode_its_calibration_did_not_run(monkeypatch, capsys, tmp_path):
    """A calibration prices the graph rule it ran: naming another is one error line."""
    from tests.test_profiled import linear_price, make_profile, samples_from

    path = tmp_path / "cpu.json"
    make_profile(samples_from(linear_price)).save(path)
    code, out, err = rose_sim(monkeypatch, capsys, "--cost-model", str(path),
                              "--cudagraph-mode", "FULL", "--num-requests", "5")  # fmt: skip
    assert code == 2 and out == ""
    assert "--cudagraph-mode FULL: the calibration ran every step eagerly" in err
    assert len(err.strip().splitlines()) == 1
