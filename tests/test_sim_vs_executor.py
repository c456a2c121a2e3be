"""The executor and the simulator make the same admission decisions for the same
workload when the simulator is fed the executor's measured iteration times.

Arrivals: the executor replays staggered arrival times on the real clock but
only sees an arrival at the next step boundary, after the step in flight; which
boundary that is depends on how long the steps took, which is jitter. Feeding the
simulator the trace times would make the comparison flaky (an arrival a few
microseconds either side of a boundary joins a different step). So the test
records, for every request, how many steps the executor had completed when it
submitted the request, and gives the simulator that boundary as the arrival
time: the simulator, with every step lasting exactly what the executor measured
(``ReplayCostModel``), reaches the same boundary at the same (bit-identical)
time and submits the request there too. Everything else the two backends decide
themselves with the shared scheduler, and must agree on: which requests each
step prefills or decodes, prefix-cache hits, preemptions, token times.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from roseinfer.config import SchedulerConfig  # noqa: E402
from roseinfer.executor.engine import Engine  # noqa: E402
from roseinfer.executor.model_runner import ModelRunner  # noqa: E402
from roseinfer.executor.models import build_model  # noqa: E402
from roseinfer.interface import PolicyOptions  # noqa: E402
from roseinfer.request import Request  # noqa: E402
from roseinfer.simulator import BatchShape, Simulator  # noqa: E402
from roseinfer.simulator.engine import batch_shape  # noqa: E402

torch.set_num_threads(1)

BLOCK_SIZE = 4


class ReplayCostModel:
    """Replays measured step durations in order; checks each step's batch shape.

    For ``Simulator(jump=False)`` only (one ``step_time_s`` call per step). A
    shape that differs from the executor's step is a divergence: it raises at
    the first differing step instead of letting the timelines drift apart.
    """

    name = "replay"

    def __init__(self, shapes: list[BatchShape], durations_s: list[float]) -> None:
        self.shapes, self.durations_s = shapes, durations_s
        self.num_steps = 0

    def step_time_s(self, shape: BatchShape) -> float:
        k = self.num_steps
        assert k < len(self.durations_s), "the simulator ran more steps than the executor"
        want = self.shapes[k]
        for field in ("prefill_new_tokens", "prefill_context_tokens", "decode_context_tokens"):
            got, expected = getattr(shape, field).tolist(), getattr(want, field).tolist()
            assert got == expected, f"step {k}: {field} {got} != executor's {expected}"
        self.num_steps += 1
        return self.durations_s[k]

    def decode_run_times_s(self, context_tokens: np.ndarray, num_steps: int) -> np.ndarray:
        raise AssertionError("ReplayCostModel replays single steps: use jump=False")

    def describe(self) -> str:
        return f"replay of {len(self.durations_s)} measured steps"


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
def model():
    m, _, _ = build_model(
        "tiny-gpt2",
        seed=0,
        dtype=torch.float32,
        device="cpu",
        config_overrides={"initializer_range": 0.5},
    )
    return m


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
    """Run the engine; return it, the shape of each step, and for each request
    the number of steps completed when the engine submitted it."""
    runner = ModelRunner(
        model,
        num_kv_blocks=config.num_kv_blocks,
        block_size=BLOCK_SIZE,
        device="cpu",
        dtype=torch.float32,
    )
    engine = Engine(runner, config)
    sched = engine.scheduler
    shapes: list[BatchShape] = []
    num_partial_chunks: list[int] = []
    submitted_after: dict[str, int] = {}
    schedule, add_request = sched.schedule, sched.add_request

    def logged_schedule(*args, **kwargs):
        out = schedule(*args, **kwargs)
        if not out.is_empty:
            shapes.append(batch_shape(out))
            num_partial_chunks.append(sum(not item.samples for item in out.scheduled))
        return out

    def logged_add(request, now_s):
        submitted_after[request.request_id] = sched.step_log.num_steps
        return add_request(request, now_s)

    sched.schedule, sched.add_request = logged_schedule, logged_add
    result = engine.run(reqs)
    return result, shapes, submitted_after, sum(num_partial_chunks)


@pytest.mark.parametrize("case", sorted(CASES))
def test_same_admission_decisions_given_the_measured_step_times(model, case):
    cfg = {"num_kv_blocks": 64, "max_num_seqs": 4, "max_model_len": 160, **CASES[case]}
    config = SchedulerConfig(block_size=BLOCK_SIZE, **cfg)
    reqs = workload()
    real, shapes, submitted_after, num_partial_chunks = run_executor(model, config, reqs)

    # Step k lasts end_k - end_{k-1}: the executor's idle waits for arrivals fold
    # into the next step, so the simulator's step ends equal the executor's.
    ends = real.scheduler.step_log.end_s
    durations = list(np.diff([0.0, *ends]))
    boundary = [0.0]  # the simulator's clock at each boundary, with its own float sums
    for d in durations:
        boundary.append(boundary[-1] + d)
    sim_reqs = [
        Request(
            r.request_id,
            boundary[submitted_after[r.request_id]],
            r.num_prompt_tokens,
            r.max_output_tokens,
            r.prompt_token_ids,
        )
        for r in reqs
    ]
    replay = ReplayCostModel(shapes, durations)
    sim = Simulator(config, replay, jump=False).run(sim_reqs)

    assert replay.num_steps == len(ends) == sim.num_steps
    np.testing.assert_array_equal(
        sim.scheduler.step_log.carries_decodes, real.scheduler.step_log.carries_decodes
    )
    np.testing.assert_allclose(sim.scheduler.step_log.end_s, ends, rtol=0, atol=1e-9)
    a = real.records.set_index("request_id")
    b = sim.records.set_index("request_id").loc[a.index]
    for col in ("num_cached_prompt_tokens", "num_preemptions", "num_output_tokens", "status"):
        assert list(b[col]) == list(a[col]), col
    for col in ("first_token_s", "finish_s"):  # admitted_s is the planning time: not replayed
        np.testing.assert_allclose(b[col], a[col], rtol=0, atol=1e-9)
    for rid in a.index:  # every token of every stay at the same step end
        np.testing.assert_allclose(b.token_times_s[rid], a.token_times_s[rid], rtol=0, atol=1e-9)

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
