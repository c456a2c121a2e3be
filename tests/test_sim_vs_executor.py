"""The executor and the simulator make the same decisions for the same workload
when the simulator is fed the executor's measured step times.

The executor records its step log; the simulator, priced by it
(``roseinfer.calibration.replay.ReplayCostModel``), replays the same requests at
their own arrival times. Both backends see an arrival at the first step
boundary at or after it, a step starts where the previous one ended (or at the
arrival that woke an idle engine), and a run starts at t=0, so with every step
lasting what the executor measured the two timelines are the same and every
decision must agree: which requests each step prefills or decodes, prefix-cache
hits, preemptions, token times.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


from roseinfer.calibration.replay import ReplayCostModel  # noqa: E402
from roseinfer.calibration.report import RunOutput, replay_error  # noqa: E402
from roseinfer.calibration.steplog import StepRecorder  # noqa: E402
from roseinfer.config import SchedulerConfig  # noqa: E402
from roseinfer.executor.engine import Engine  # noqa: E402
from roseinfer.executor.model_runner import ModelRunner  # noqa: E402
from roseinfer.interface import PolicyOptions  # noqa: E402
from roseinfer.request import Request  # noqa: E402
from roseinfer.simulator import Simulator, make_cost_model  # noqa: E402

torch.set_num_threads(1)

BLOCK_SIZE = 4


def workload() -> list[Request]:
    """12 requests, prompts of 3..70 tokens (some sharing a 16-token prefix),
    4..12 output tokens, arriving in bursts of 3 every 3 ms."""
    rng = np.random.default_rng(7)
    shared = rng.integers(0, 1000, 16).tolist()
    lengths = [5, 40, 3, 70, 12, 25, 8, 60, 4, 33, 18, 9]
    reqs = []
    for i, n in enumerate(lengths):
        ids = rng.integers(0, 1000, n).tolist()
        if i % 4 == 1:
            ids = shared + ids
        arrival = 0.003 * (i // 3)  # bursts of 3, 3 ms apart
        reqs.append(Request(f"r{i}", arrival, len(ids), 4 + (i * 5) % 9, tuple(ids)))
    return reqs


@pytest.fixture(scope="module")
def model(tiny_gpt2):
    return tiny_gpt2  # conftest's shared tiny model


CASES = {
    "fifo": dict(policy="fifo"),
    "budget": dict(policy="budget", prefill_max_tokens=64),
    "pack+force-fifo": dict(
        policy="pack",
        prefill_max_tokens=48,
        options=PolicyOptions(lookahead=8, force_fifo_every=3),
    ),
    "decode-first": dict(policy="budget", prefill_max_tokens=64, loop_order="decode-first"),
    "fifo-preempting": dict(policy="fifo", num_kv_blocks=20),
    "mixed-chunked": dict(
        policy="fifo",
        loop_order="mixed",
        enable_chunked_prefill=True,
        max_num_batched_tokens=24,
        num_kv_blocks=40,
    ),
    "budget-chunk-head": dict(
        policy="budget",
        prefill_max_tokens=20,
        enable_chunked_prefill=True,
        options=PolicyOptions(chunk_head=True),
    ),
}


def run_executor(model, config: SchedulerConfig, reqs: list[Request]):
    """Run the engine, recording its step log; return the result and the steps."""
    runner = ModelRunner(
        model,
        num_kv_blocks=config.num_kv_blocks,
        block_size=BLOCK_SIZE,
        device="cpu",
        dtype=torch.float32,
    )
    recorder = StepRecorder(keep=True)
    result = Engine(runner, config, on_step=recorder).run(reqs)
    return result, recorder.records


@pytest.mark.parametrize("case", sorted(CASES))
def test_same_admission_decisions_given_the_measured_step_times(model, case):
    cfg = {"num_kv_blocks": 64, "max_num_seqs": 4, "max_model_len": 160, **CASES[case]}
    config = SchedulerConfig(block_size=BLOCK_SIZE, **cfg)
    reqs = workload()
    real, steps = run_executor(model, config, reqs)
    shapes = [step.shape for step in steps]

    # The simulator priced by the executor's own step times, on the same requests
    # at their own arrival times: both see arrivals at the same step boundaries.
    replay = ReplayCostModel(steps, make_cost_model("gpt2", "cpu"))
    sim = Simulator(config, replay, jump=False).run(reqs)

    ends = real.scheduler.step_log.end_s
    assert replay.num_agreed == replay.num_priced == len(ends) == sim.num_steps, replay.describe()
    np.testing.assert_array_equal(
        sim.scheduler.step_log.carries_decodes, real.scheduler.step_log.carries_decodes
    )
    np.testing.assert_allclose(sim.scheduler.step_log.end_s, ends, rtol=0, atol=1e-9)
    a = real.records.set_index("request_id")
    b = sim.records.set_index("request_id").loc[a.index]
    for col in ("num_cached_prompt_tokens", "num_preemptions", "num_output_tokens", "status"):
        assert list(b[col]) == list(a[col]), col
    for col in ("admitted_s", "first_token_s", "finish_s"):
        np.testing.assert_allclose(b[col], a[col], rtol=0, atol=1e-9)
    for rid in a.index:  # every token of every stay at the same step end
        np.testing.assert_allclose(b.token_times_s[rid], a.token_times_s[rid], rtol=0, atol=1e-9)
    error = replay_error(RunOutput(real.records, real.duration_s), RunOutput(sim.records, 0.0))
    assert error["max_abs_rel_error"] < 1e-6 and error["per_request"]["e2el"]["max"] < 1e-6
    prefill_steps = Counter(
        rid for step in steps for rid, dec in zip(step.request_ids, step.is_decode) if not dec
    )
    num_partial_chunks = sum(n - 1 for n in prefill_steps.values())

    # The workload exercised what the case is about.
    admitted_at = sorted(set(a["admitted_s"]))
    assert len(admitted_at) >= 3  # admission spread over several steps
    if case == "fifo-preempting":  # the small pool evicts the shared prefix too
        assert real.scheduler.num_preemptions > 0
    else:
        assert a["num_cached_prompt_tokens"].sum() > 0  # hits on the shared prefix
    if config.enable_chunked_prefill:  # some prompts were cut into chunks
        assert num_partial_chunks > 0
    if config.loop_order == "mixed":
        assert any(s.prefill_new_tokens.size and s.decode_context_tokens.size for s in shapes)
    if config.prefill_max_tokens is not None:
        assert any(
            s.prefill_new_tokens.size > 1
            and s.prefill_new_tokens.sum() <= config.prefill_max_tokens
            for s in shapes
        )
