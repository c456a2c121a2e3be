"""The compiled simulator core equals the pure-Python core it is compiled from.

``setup.py`` compiles the scheduler, the block manager, the step log, the drive
loop and the simulator's cost-model backend with Cython (``roseinfer._core``);
their ``.py`` files are the reference. These tests replay random workloads in
this process (the compiled core, when built) and in a worker process running
the pure-Python core (``ROSEINFER_PURE_PYTHON=1``), and assert identical
results: every record column (every token time, bit for bit), the step log,
preemptions, prefix-cache hit counts, KV tier counters, the ITL histogram of
runs that keep no token times, and every call the scheduler makes to the policy
with what it was shown. Workloads cover every registered policy and loop order,
chunked prefill, prefix caching (shared prefixes), KV tiers, pools small enough
to preempt, ``--no-jump``, and clusters behind each router.

Skips when no compiled core is built: both sides would run the same code.
``ROSE_EQUALITY_EXAMPLES`` scales the hypothesis examples (default 1x).
"""

from __future__ import annotations

import math
import os
import pickle
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import POLICIES, REGISTRY, configs, workloads

from roseinfer import _core
from roseinfer.calibration.graph_replay import GraphReplay
from roseinfer.config import SchedulerConfig
from roseinfer.interface import PolicyOptions
from roseinfer.request import Request
from roseinfer.simulator import make_cost_model
from roseinfer.simulator.cluster import ReplicaSpec, simulate_cluster
from roseinfer.simulator.engine import Simulator

ROUTERS = sorted(REGISTRY.routers)
COST = make_cost_model("llama-3.1-8b", "h100-sxm")
COSTS = {
    "roofline": COST,
    # --cudagraph-mode FULL with the spec's measured eager jitter: the launch roof and
    # the jitter's classes by the other graph rule, in C and in Python
    "full+jitter": make_cost_model(
        "llama-3.1-8b", "h100-sxm", graphs=GraphReplay.of_mode("FULL")
    ).with_step_jitter(),  # type: ignore[attr-defined]
}
SCALE = float(os.environ.get("ROSE_EQUALITY_EXAMPLES", "1"))

pytestmark = pytest.mark.skipif(
    not _core.COMPILED, reason=f"no compiled core to compare ({_core.core_info()})"
)


# ------------------------------------------------------------------ a run's facts
def _exact(value: Any) -> Any:
    """``value`` made comparable bit for bit (floats by their hex, arrays by bytes)."""
    if isinstance(value, float):
        return "nan" if math.isnan(value) else value.hex()
    if isinstance(value, np.ndarray):
        return (str(value.dtype), value.tobytes())
    if isinstance(value, dict):
        return {k: _exact(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_exact(v) for v in value]
    return value


def _frame(frame: Any) -> dict[str, Any]:
    """Every column of a records frame, exactly."""
    out: dict[str, Any] = {}
    for name in frame.columns:
        column = frame[name]
        if column.dtype.kind in "fiub":
            out[name] = (str(column.dtype), column.to_numpy().tobytes())
        else:
            out[name] = [_exact(v) for v in column.tolist()]
    return out


def _scheduler(sched: Any) -> dict[str, Any]:
    log, bm = sched.step_log, sched.block_manager
    return _exact({
        "end_s": np.asarray(log.end_s), "decodes": log.carries_decodes,
        "num_steps": log.num_steps, "first_kept_step": log.first_kept_step,
        "preemptions": sched.num_preemptions, "max_used_blocks": sched.max_used_blocks,
        "queried": bm.num_queried_tokens, "hit": bm.num_hit_tokens,
        "device_hit": bm.num_device_hit_tokens, "load_s": float(bm.kv_load_s),
        "free_blocks": bm.num_free_blocks, "tiers": bm.kv_tier_counters(),
    })  # fmt: skip


def _histogram(itl: Any) -> Any:
    if itl is None:
        return None
    return _exact({"counts": itl._counts, "n": itl.count, "mean": itl._mean, "m2": itl._m2})


class Spy:
    """The run's composed policy, delegating every call and logging it with what
    the scheduler showed (ids of the waiting and running requests, the budget and
    context figures) and what the policy answered."""

    def __init__(self, inner: Any, log: list) -> None:
        self._inner, self._log = inner, log

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._inner, name)
        if not callable(value) or name.startswith("_"):
            return value

        def logged(*args: Any, **kwargs: Any) -> Any:
            answer = value(*args, **kwargs)
            self._log.append((name, [_shown(a) for a in args], _shown(answer)))
            return answer

        return logged


def _shown(value: Any) -> Any:
    from roseinfer.interface import Budget, PolicyContext, StepReport
    from roseinfer.sequence import Sequence

    if isinstance(value, Sequence):
        return ("seq", value.seq_id)
    if isinstance(value, PolicyContext):
        return _exact((
            value.now_s, value.admission_round, value.num_running, value.num_waiting,
            value.num_free_blocks, value.free_seats, _ids(value.running),
        ))  # fmt: skip
    if isinstance(value, Budget):
        return (value.max_tokens, value.max_seqs, value.num_free_blocks, value.max_batched_tokens)
    if isinstance(value, StepReport):
        items = [(i.seq.seq_id, i.num_tokens, i.is_decode) for i in value.items]
        return _exact((value.end_s, value.num_steps, items))
    if type(value).__name__ == "ReadOnlyView":
        return _ids(value)
    if isinstance(value, (list, tuple)):
        return [_shown(v) for v in value]
    return _exact(value) if isinstance(value, (float, int, str, type(None))) else repr(value)


def _ids(seqs: Any) -> tuple[int, int]:
    """A queue or running set as its length and the hash of its ids, in order."""
    ids = tuple(s.seq_id for s in seqs)
    return len(ids), hash(ids)


def outcome(job: dict[str, Any]) -> dict[str, Any]:
    """Run ``job`` (a single simulation or a cluster) and return its facts."""
    from roseinfer import scheduler

    held = scheduler.RELEASE_MIN_HELD
    scheduler.RELEASE_MIN_HELD = job.get("release_min_held", held)
    try:
        return _outcome(job)
    finally:  # the module global is shared with every later test of this process
        scheduler.RELEASE_MIN_HELD = held


def _outcome(job: dict[str, Any]) -> dict[str, Any]:
    reqs, config = job["requests"], job["config"]
    cost = COSTS[job.get("cost", "roofline")]
    calls: list = []
    if job.get("replicas"):
        router = REGISTRY.router(job["router"])(seed=0, options={})
        specs = [ReplicaSpec(f"r{i}", config, cost) for i in range(job["replicas"])]
        result = simulate_cluster(
            reqs, specs, router, jump=job["jump"], keep_token_times=job["keep_token_times"]
        )
        schedulers, itls = result.schedulers, result.replica_itl
    else:
        sim = Simulator(config, cost, jump=job["jump"], keep_token_times=job["keep_token_times"])
        sim.policy = Spy(sim.policy, calls)  # type: ignore[assignment]
        result = sim.run(reqs)
        schedulers, itls = [result.scheduler], [result.itl]
    return {
        "compiled": _core.COMPILED,
        "records": _frame(result.records),
        "schedulers": [_scheduler(s) for s in schedulers],
        "itl": [_histogram(h) for h in itls],
        "num_steps": result.num_steps,
        "calls": calls,
    }


# ------------------------------------------------- the pure-Python core, alongside
_WORKER = r"""
import os, pickle, struct, sys
sys.path.insert(0, os.environ["ROSE_EQUALITY_TESTS"])
from test_core_equality import outcome
read, write = sys.stdin.buffer, sys.stdout.buffer
while True:
    head = read.read(8)
    if len(head) < 8:
        break
    job = pickle.loads(read.read(struct.unpack("<Q", head)[0]))
    try:
        answer = outcome(job)
    except Exception as err:  # report it to the test, which fails naming it
        answer = {"error": f"{type(err).__name__}: {err}"}
    data = pickle.dumps(answer)
    write.write(struct.pack("<Q", len(data)) + data)
    write.flush()
"""


class PureCore:
    """A worker process running :func:`outcome` on the pure-Python core."""

    def __init__(self) -> None:
        env = {**os.environ, _core.PURE_ENV: "1", "ROSE_EQUALITY_TESTS": str(Path(__file__).parent)}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
        )

    def run(self, job: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        data = pickle.dumps(job)
        self.proc.stdin.write(struct.pack("<Q", len(data)) + data)
        self.proc.stdin.flush()
        head = self.proc.stdout.read(8)
        assert len(head) == 8, "the pure-Python worker died"
        return pickle.loads(self.proc.stdout.read(struct.unpack("<Q", head)[0]))

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def pure() -> Any:
    worker = PureCore()
    yield worker
    worker.close()


def assert_same(job: dict[str, Any], pure: PureCore) -> None:
    """The compiled core (here) and the pure one (the worker) give the same facts."""
    compiled, reference = outcome(job), pure.run(job)
    assert "error" not in reference, reference.get("error")
    assert compiled.pop("compiled") and not reference.pop("compiled"), "both ran one core"
    for key in compiled:
        assert compiled[key] == reference[key], f"compiled and pure-Python cores differ in {key}"


# ---------------------------------------------------------------- workloads
def _examples(n: int) -> settings:
    return settings(
        max_examples=max(1, int(n * SCALE)),
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )


# --------------------------------------------------------------------- tests
def test_every_core_module_is_compiled_with_its_types() -> None:
    """Each compiled module was built with its ``.pxd``: its classes are extension
    types, and its C-only functions are no Python attributes (a module compiled
    without its ``.pxd``, as a ``package-dir`` path once made happen, runs as
    slowly as the pure-Python one and still passes)."""
    import importlib

    heap_type = 1 << 9  # Py_TPFLAGS_HEAPTYPE: a class made at run time
    typed = {
        "roseinfer.sequence": "Sequence", "roseinfer.records": "StepLog",
        "roseinfer.block_manager": "BlockManager", "roseinfer.scheduler": "Scheduler",
        "roseinfer.driver": "StepResult", "roseinfer.simulator.engine": "CostModelBackend",
    }  # fmt: skip
    c_only = {"roseinfer.contract": ("_choice", "_held")}
    assert set(typed) | set(c_only) == set(_core.CORE_SOURCES)
    for name in _core.CORE_SOURCES:
        module = importlib.import_module(name)
        assert not module.__file__.endswith(".py"), f"{name} runs from {module.__file__}"
        if name in typed:
            cls = getattr(module, typed[name])
            assert not cls.__flags__ & heap_type, f"{name}.{typed[name]} is untyped"
        for function in c_only.get(name, ()):
            assert not hasattr(module, function), f"{name}.{function} is a Python function"


@pytest.mark.slow
@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_runs_the_same_on_both_cores(policy: str, pure: PureCore) -> None:
    @_examples(12)
    @given(reqs=workloads(), config=configs(policy), jump=st.booleans(), lean=st.booleans())
    def check(reqs: list[Request], config: SchedulerConfig, jump: bool, lean: bool) -> None:
        job = {"requests": reqs, "config": config, "jump": jump, "keep_token_times": not lean}
        assert_same(job, pure)

    check()


@pytest.mark.slow
@_examples(24)
@given(reqs=workloads(max_requests=40), config=configs(), router=st.sampled_from(ROUTERS),
       replicas=st.integers(2, 4), lean=st.booleans())  # fmt: skip
def test_clusters_run_the_same_on_both_cores(
    reqs: list[Request], config: SchedulerConfig, router: str, replicas: int, lean: bool,
    pure: PureCore,
) -> None:  # fmt: skip
    job = {"requests": reqs, "config": config, "jump": True, "keep_token_times": not lean,
           "replicas": replicas, "router": router}  # fmt: skip
    assert_same(job, pure)


def test_a_long_run_releasing_steps_is_the_same_on_both_cores(pure: PureCore) -> None:
    """300 requests with shared prefixes through a pool that preempts and
    evicts, the step log released as it goes, without token times: the figures a
    rose-sim run reports."""
    rng = np.random.default_rng(7)
    reqs = [
        Request(f"r{i}", i * 0.01, int(n), int(m),
                prefix_hash_ids=tuple(int(h) for h in rng.integers(0, 4, -(-int(n) // 64))),
                prefix_hash_block_tokens=64)
        for i, (n, m) in enumerate(zip(rng.integers(50, 1500, 300), rng.integers(1, 300, 300)))
    ]  # fmt: skip
    for policy, order in [("fifo", "decode-first"), ("srpt", "mixed"), ("pack", "prefill-first")]:
        chunked = order == "mixed"
        config = SchedulerConfig(
            num_kv_blocks=400, max_num_seqs=32, max_model_len=2048, policy=policy,
            loop_order=order, enable_chunked_prefill=chunked,
            max_num_batched_tokens=512 if chunked else None,
            options=PolicyOptions({"length_predictor": "oracle"} if policy == "srpt" else {}),
        )  # fmt: skip
        for lean, cost in ((False, "roofline"), (True, "roofline"), (False, "full+jitter")):
            job = {"requests": reqs, "config": config, "jump": True, "keep_token_times": not lean,
                   "release_min_held": 64, "cost": cost}  # fmt: skip
            assert_same(job, pure)
