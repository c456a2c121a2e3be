"""roseinfer's policies inside vLLM: ``roseinfer.integrations.vllm.Scheduler``.

Fast tests (this venv, no vLLM): ``ROSEINFER_POLICY_ARGS`` parsing and its
errors, request fields, the check of a policy's answer, the import guard.

vLLM tests: this file, run as a script in vLLM's own venv (``ROSEINFER_VLLM_PYTHON``,
default ``~/.cache/rose-checks/vllm-venv/bin/python``; skipped with the reason
when absent), starts vLLM in-process with a tiny random GPT-2 through the
scheduler class, once per policy, on a workload that arrives in waves (tenants,
priorities, deadlines, shared prefixes, a KV pool small enough to preempt). It
records every policy call (the waiting set, budget and context handed to the
policy, and its answer) and what vLLM then admitted, and replays the calls on a
fresh roseinfer policy built from the same flags with equivalent sequences. The
tests here check: (a) every answer equals the fresh policy's, and vLLM admitted
a prefix of it; (b) no request is lost; (c) greedy outputs equal vLLM's default
scheduler's; the step log's schema; a setting vLLM cannot honour stops it at start.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

try:
    import pytest
except ImportError:  # the child half of this file runs in vLLM's venv, without pytest
    pytest = None  # type: ignore[assignment]

SCENARIOS: dict[str, str] = {
    "fifo": "",
    "budget": "--policy budget --prefill-max-tokens 48",
    "pack": "--policy pack --prefill-max-tokens 64 --lookahead 6 --force-fifo-every 3",
    "sjf": "--policy sjf --length-predictor oracle",
    "srpt": "--policy srpt",
    "hrrn": "--policy hrrn --hrrn-decode-ms 5",
    "priority": "--policy priority",
    "edf": "--policy edf --drop-late",
    "vtc": "--policy vtc --vtc-output-weight 2",
    "lpm": "--policy lpm --lpm-aging-s 30",
}
"""ROSEINFER_POLICY_ARGS of each vLLM run (the README's examples and every family)."""

ENGINE: dict[str, Any] = {
    "skip_tokenizer_init": True,
    "dtype": "float32",
    "enforce_eager": True,
    "max_model_len": 256,
    "max_num_seqs": 4,
    "max_num_batched_tokens": 64,
    "block_size": 32,
    "num_gpu_blocks_override": 10,
    "enable_prefix_caching": True,
    "seed": 0,
}
"""vLLM settings: chunked prefill (64-token steps), 4 seats, a 320-token KV pool."""


# =============================================================== fast tests
if pytest is not None:
    from roseinfer.integrations._vllm_bridge import (
        ConfigError,
        make_request,
        parse_policy_env,
        request_fields,
    )
    from roseinfer.registry import load_registry

    @pytest.fixture(scope="module")
    def registry():
        return load_registry()

    def test_unset_means_fifo(registry) -> None:
        for text in (None, "", "  "):
            settings = parse_policy_env(text, registry)
            assert (settings.policy, settings.loop_order) == ("fifo", "mixed")
            assert settings.prefill_max_tokens is None and settings.prefill_max_seqs is None

    def test_policy_args_as_rose_sim_reads_them(registry) -> None:
        s = parse_policy_env(
            "--policy pack --prefill-max-tokens 256 --force-fifo-every 8 --lookahead 16", registry
        )
        assert (s.policy, s.prefill_max_tokens) == ("pack", 256)
        assert (s.options.get("force_fifo_every"), s.options.get("lookahead")) == (8, 16)
        assert s.make(registry).label == "pack+force-fifo+mixed"
        s = parse_policy_env("--policy sjf --length-predictor oracle", registry)
        assert s.options.values == {"length_predictor": "oracle"}
        s = parse_policy_env("--policy vtc --vtc-output-weight 2", registry)
        assert s.options.values == {"vtc_output_weight": 2.0}
        s = parse_policy_env("--policy vtc --policy-arg vtc_input_weight=0.5", registry)
        assert s.options.values == {"vtc_input_weight": 0.5}
        s = parse_policy_env(
            "--policy budget --prefill-max-tokens 64 --prefill-max-seqs 2", registry
        )
        assert (s.prefill_max_tokens, s.prefill_max_seqs) == (64, 2)
        s = parse_policy_env("--policy edf --drop-late --loop-order mixed", registry)
        assert s.options.values == {"drop_late": True}
        assert parse_policy_env("--scheduler-preset vllm-v1", registry).loop_order == "mixed"

    @pytest.mark.parametrize(
        ("text", "expected"),
        [
            ("--policy nope", "unknown policy 'nope' for --policy; known: budget"),
            ("--lookahead 8", "no plugin of this run reads 'lookahead'"),
            ("--prefill-max-tokens 64", "policy 'fifo' ignores --prefill-max-tokens"),
            ("--policy pack --lookahead x", "--lookahead takes an integer, got 'x'"),
            ("--policy vtc --vtc-output-weight heavy", "--vtc-output-weight takes a number"),
            ("--policy sjf --length-predictor psychic", "unknown length predictor 'psychic'"),
            ("--policy-arg nothing=1", "no plugin of this run reads 'nothing'"),
            ("--bogus", "unrecognized arguments: --bogus"),
            ("--help", "unrecognized arguments: --help"),
            ("--list-policies", "run `rose-sim --list-policies`"),
            ("--loop-order prefill-first", "loop order 'prefill-first' cannot run inside vLLM"),
            ("--loop-order decode-first", "drop --loop-order"),
            ("--loop-order prefill-priority", "vLLM v1 runs every step mixed"),
            ("--scheduler-preset seeds", "drop --scheduler-preset"),
            ("--policy budget --prefill-max-tokens 8 --chunk-head", "drop --chunk-head"),
            ("--max-num-seqs 8", "--max-num-seqs sets vLLM's own scheduler, not the policy"),
            ("--block-size 32", "--block-size sets vLLM's own scheduler"),
            ("--max-num-batched-tokens 512", "give it to vLLM and drop it from"),
            ("--policy 'pack", "cannot split it as a shell would"),
            ("--policy hrrn --hrrn-decode-ms 0", "--hrrn-decode-ms must be > 0"),
            ("--force-fifo-every -1", "--force-fifo-every must be >= 0, got -1"),  # wrapper's own
            ("--policy pack --force-fifo-every 1.5", "--force-fifo-every takes an integer"),
        ],
    )
    def test_policy_args_errors_are_one_line(registry, text: str, expected: str) -> None:
        with pytest.raises(ConfigError) as err:
            parse_policy_env(text, registry)
        message = str(err.value)
        assert expected in message
        assert message.startswith("ROSEINFER_POLICY_ARGS=") and "\n" not in message

    def test_parsing_does_not_import_vllm(registry) -> None:
        code = (
            "import sys\n"
            "from roseinfer.integrations._vllm_bridge import parse_policy_env\n"
            "from roseinfer.registry import load_registry\n"
            "parse_policy_env('--policy sjf', load_registry())\n"
            "assert 'vllm' not in sys.modules, 'vllm imported'\n"
        )
        subprocess.run([sys.executable, "-c", code], check=True)

    @pytest.mark.parametrize("version", [None, "0.31.0", "0.33.0+cpu"])
    def test_import_names_the_supported_versions(version: str | None) -> None:
        fake = "" if version is None else (
            f"import sys, types; sys.modules['vllm'] = types.SimpleNamespace(__version__={version!r})\n"
        )  # fmt: skip
        code = fake + "import roseinfer.integrations.vllm"
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        if done.returncode == 0:
            pytest.skip("vLLM is installed in this venv")
        last = done.stderr.strip().splitlines()[-1]
        assert last.startswith("ImportError") and "vLLM 0.32.0" in last, last
        if version is not None:
            assert f"this is vLLM {version}" in last, last

    def test_request_fields_from_vllm_xargs() -> None:
        assert request_fields(None) == (None, None)
        assert request_fields({"tenant": "a", "deadline_s": "0.5"}) == ("a", 0.5)
        assert request_fields({"tenant": 7, "deadline_s": 2}) == ("7", 2.0)
        for bad in ({"tenant": ["a"]}, {"deadline_s": 0}, {"deadline_s": "soon"},
                    {"deadline_s": float("inf")}, {"deadline_s": True}):  # fmt: skip
            with pytest.raises(ValueError, match="vllm_xargs"):
                request_fields(bad)
        r = make_request("x", arrival_time_s=-0.1, num_prompt_tokens=3, max_tokens=5,
                         prompt_token_ids=[1, 2, 3], priority=2, ignore_eos=True,
                         extra_args={"tenant": "t", "deadline_s": 1.5})  # fmt: skip
        assert (r.arrival_time_s, r.max_output_tokens, r.priority) == (0.0, 5, 2)
        assert (r.tenant, r.deadline_s, r.prompt_token_ids) == ("t", 1.5, (1, 2, 3))

    @pytest.mark.parametrize("reserve_full", [False, True])
    def test_reserve_full_isl_admits_only_whole_sequences(reserve_full: bool) -> None:
        """vLLM's scheduler_reserve_full_isl: a chunk that fits is not enough, the
        whole prompt's blocks must be free (the vllm-v1 presets turn it on)."""
        from conftest import make_scheduler, req

        from roseinfer.config import SCHEDULER_PRESETS

        assert SCHEDULER_PRESETS["vllm-v1"]["scheduler_reserve_full_isl"] is True
        assert SCHEDULER_PRESETS["vllm-v1-cpu"]["scheduler_reserve_full_isl"] is True
        sched = make_scheduler(load_registry(), loop_order="mixed", enable_chunked_prefill=True,
                               max_num_batched_tokens=8, num_kv_blocks=6, block_size=4,
                               scheduler_reserve_full_isl=reserve_full)  # fmt: skip
        sched.add_request(req(0, 12, 8), 0.0)
        sched.add_request(req(1, 16, 4), 0.0)
        steps = []
        for now in range(2):
            out = sched.schedule(float(now))
            steps.append([(i.seq.request_id, i.num_new_tokens) for i in out.scheduled])
            sched.update(out, now + 1.0)
        # step 2: r0's last 4 prompt tokens leave 4 of the budget and 3 free blocks:
        # r1's first chunk needs 1, its whole 16-token prompt 4
        assert steps[0] == [("r0", 8)]
        assert steps[1] == ([("r0", 4)] if reserve_full else [("r0", 4), ("r1", 4)])
        sched.check_invariants()

    def test_says_when_a_length_predictor_cannot_be_fitted(registry) -> None:
        """As rose-serve: inside vLLM a predictor fitted on a workload (bucket) has none,
        so the length-aware policy would run as FIFO; without --length-predictor the
        policy ranks by each request's max_tokens (oracle), and vLLM logs which."""
        from roseinfer.integrations._vllm_bridge import unfitted_predictor_warning

        given = {"--policy fifo": None, "--policy sjf --length-predictor oracle": None,
                 "--policy sjf --length-predictor bucket": "runs as FIFO",
                 "--policy vtc": None, "--policy srpt": "the default inside a server"}  # fmt: skip
        for text, says in given.items():
            settings = parse_policy_env(text, registry)
            line = unfitted_predictor_warning(settings, registry)
            assert (line is None) is (says is None), text
            if says is not None:
                assert line is not None and says in line
        srpt = parse_policy_env("--policy srpt", registry)
        assert srpt.options.get("length_predictor") == "oracle"

    def test_lab_simulates_what_rose_sim_builds(registry) -> None:
        """The benchmarks' simulated side (no vLLM): the vllm-v1 preset with the engine's
        limits and the policy flags; the workload's tenants, classes and token ids; the
        effect table's ratios."""
        import pandas as pd

        from roseinfer.config import SCHEDULER_PRESETS
        from roseinfer.integrations.vllm_lab import (
            EFFECTS,
            WorkloadSpec,
            conv_workload,
            effect_markdown,
            effect_table,
        )
        from roseinfer.integrations.vllm_replay import EngineSettings, rose_sim_command, sim_config

        settings = EngineSettings(model="tiny-gpt2", max_num_seqs=6, max_num_batched_tokens=256)
        config = sim_config(settings, "--policy sjf --length-predictor oracle", registry)
        assert (config.policy, config.max_num_seqs, config.max_num_batched_tokens) == (
            "sjf",
            6,
            256,
        )
        assert config.options.get("length_predictor") == "oracle"
        for key, value in SCHEDULER_PRESETS["vllm-v1"].items():
            if key not in ("max_num_seqs", "max_num_batched_tokens"):
                assert getattr(config, key) == value, key
        assert (config.num_kv_blocks, config.block_size) == (1024, 32)
        with pytest.raises(ConfigError, match="cannot run inside vLLM"):
            sim_config(settings, "--loop-order prefill-first", registry)
        line = rose_sim_command(settings, None, "s.jsonl", "t.csv")
        assert line.startswith("rose-sim --scheduler-preset vllm-v1 --cost-model s.jsonl")
        assert "--max-num-seqs 6 --max-num-batched-tokens 256 --policy fifo" in line
        with pytest.raises(ValueError, match="max_num_seqs must be > 0"):
            EngineSettings(max_num_seqs=0)

        requests, note = conv_workload(WorkloadSpec(num_requests=33), vocab_size=1000)
        assert len(requests) == 33 and "10:1" in note
        assert [r.tenant for r in requests].count("light") == 3
        assert {r.priority for r in requests} <= {0, 1}
        assert all(max(r.prompt_token_ids) < 1000 for r in requests)
        assert all(8 <= r.num_prompt_tokens <= 512 and 2 <= r.max_output_tokens <= 64
                   for r in requests)  # fmt: skip

        def fig(x: float) -> dict[str, float]:
            return {e.figure: x for e in EFFECTS}

        runs = {"vllm": {"fifo": [fig(100.0), fig(200.0)], **{e.name: [fig(50.0), fig(300.0)]
                                                                for e in EFFECTS}},
                "sim": {"fifo": [fig(100.0)], **{e.name: [fig(90.0)] for e in EFFECTS}}}  # fmt: skip
        table = effect_table(runs)
        assert isinstance(table, pd.DataFrame) and len(table) == 2 * len(EFFECTS)
        real = table[table.backend == "vllm"].iloc[0]
        assert (real.ratio_min, real.ratio_max, real.ratio) == (0.5, 1.5, 1.0)
        assert not real.holds and table[table.backend == "sim"].holds.all()
        assert "| vtc | light tenant p99 TTFT |" in effect_markdown(table)

    # ======================================================== vLLM tests
    def _vllm_python() -> Path | None:
        given = os.environ.get("ROSEINFER_VLLM_PYTHON")
        path = Path(given) if given else Path.home() / ".cache/rose-checks/vllm-venv/bin/python"
        return path if path.is_file() and os.access(path, os.X_OK) else None

    @pytest.fixture(scope="module")
    def vllm_report(tmp_path_factory) -> dict[str, Any]:
        python = _vllm_python()
        if python is None:
            reason = (
                "no vLLM interpreter: set ROSEINFER_VLLM_PYTHON or create "
                "~/.cache/rose-checks/vllm-venv (see .ci/run)"
            )
            print(f"skipped: {reason}")
            pytest.skip(reason)
        work = tmp_path_factory.mktemp("vllm")
        env = {**os.environ, "OMP_NUM_THREADS": "2", "VLLM_CPU_KVCACHE_SPACE": "1",
               "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip
        env.pop("ROSEINFER_POLICY_ARGS", None)
        env.pop("ROSEINFER_STEP_LOG", None)
        done = subprocess.run(
            [str(python), __file__, "child", str(work)],
            env=env,
            capture_output=True,
            text=True,
            timeout=1500,
        )
        report = work / "report.json"
        if done.returncode != 0 or not report.is_file():
            tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-25:])
            pytest.fail(f"the vLLM child failed (exit {done.returncode}):\n{tail}")
        return json.loads(report.read_text())

    def test_vllm_decisions_equal_a_fresh_roseinfer_policy(vllm_report) -> None:
        for name, run in vllm_report["runs"].items():
            replay = run["replay"]
            assert not replay["mismatches"], (name, replay["mismatches"][:3])
            assert replay["compared"]["admit"] >= 5, (name, replay["compared"])
            assert not run["not_a_prefix"], (name, run["not_a_prefix"][:3])
        runs = vllm_report["runs"]
        acted = {n: r["replay"]["acted"] for n, r in runs.items()}
        assert acted["vtc"]["observe_step"] > 0, acted["vtc"]
        # priority preempts for an urgent arrival; srpt is asked every step (its
        # answers compared above) but may rightly decline: its swap must pay for the
        # victim's recompute
        assert (
            acted["priority"]["preempt"] > 0 and runs["srpt"]["replay"]["compared"]["preempt"] > 0
        )
        assert acted["edf"]["drop"] > 0, acted["edf"]
        assert acted["srpt"]["select_victim"] > 0 and acted["priority"]["select_victim"] > 0
        assert runs["lpm"]["num_cache_hits"] > 0, "lpm saw no prefix-cache hit"
        for name in ("fifo", "srpt", "priority"):  # KV pressure, and srpt/priority's own
            assert runs[name]["num_preempted"] > 0, (name, "preempted nothing")

    def test_vllm_loses_no_request(vllm_report) -> None:
        workload = vllm_report["workload"]
        wanted = {r["id"]: r["max_tokens"] for wave in workload for r in wave["requests"]}
        for name, run in vllm_report["runs"].items():
            finish = run["finish"]
            expected = set(wanted) | ({"malformed"} if name == "fifo" else set())
            assert set(finish) == expected, (name, expected ^ set(finish))
            for rid, reason in finish.items():
                if reason == "length":
                    assert len(run["outputs"][rid]) == wanted[rid], (name, rid)
                else:
                    assert reason == "abort" and rid in run["aborted_by_roseinfer"], (name, rid)
        assert vllm_report["runs"]["edf"]["aborted_by_roseinfer"], "edf --drop-late dropped none"
        assert vllm_report["runs"]["fifo"]["aborted_by_roseinfer"] == ["malformed"]

    def test_vllm_greedy_outputs_equal_the_default_scheduler(vllm_report) -> None:
        default = vllm_report["default"]["outputs"]
        for name, run in vllm_report["runs"].items():
            same = [rid for rid, tokens in run["outputs"].items() if default.get(rid) == tokens]
            finished = [rid for rid, reason in run["finish"].items() if reason == "length"]
            assert sorted(same) == sorted(finished), (name, set(finished) - set(same))

    def test_vllm_step_log(vllm_report) -> None:
        from roseinfer.calibration.steplog import load_step_log

        run = vllm_report["runs"]["fifo"]
        log = load_step_log(run["step_log"])
        assert log.header["backend"] == "vllm"
        spec = log.header["model"]["spec"]  # the shape rose-sim --cost-model needs
        assert log.header["model"]["name"] and (spec["num_layers"], spec["hidden_size"]) == (2, 64)
        assert spec["dtype_bytes"] == 4
        executor = log.header["executor"]
        for key in ("device", "dtype", "num_kv_blocks", "block_size", "max_model_len",
                    "max_num_seqs", "max_num_batched_tokens"):  # fmt: skip
            assert executor[key] is not None, key
        assert (executor["block_size"], executor["num_kv_blocks"]) == (32, 9)  # + a null block
        assert executor["max_num_batched_tokens"] == 64 and executor["dtype"] == "float32"
        last: dict[str, int] = {}
        for record in log.records:
            assert record.forward_s is None and record.end_s >= record.start_s >= 0
            assert sum(record.num_new_tokens) <= 64 and record.num_seqs <= 4
            kinds = set(record.is_decode)
            assert record.phase == {frozenset({True}): "decode", frozenset({False}): "prefill"}.get(
                frozenset(kinds), "mixed"
            )
            for rid, new, context, decode in zip(record.request_ids, record.num_new_tokens,
                                                 record.num_context_tokens, record.is_decode):  # fmt: skip
                assert not decode or new == 1
                last[rid] = context
        prompts = {r["id"]: (r["prompt_len"], r["max_tokens"])
                   for wave in vllm_report["workload"] for r in wave["requests"]}  # fmt: skip
        for rid, reason in run["finish"].items():
            if reason == "length":  # its context ends one short of prompt + output
                (internal,) = [k for k in last if k == rid or k.startswith(rid + "-")]
                assert last[internal] == sum(prompts[rid]) - 1, rid

    def test_vllm_fails_at_start_on_what_it_cannot_honour(vllm_report) -> None:
        errors = vllm_report["start_errors"]
        assert (
            "loop order 'prefill-first' cannot run inside vLLM"
            in errors["--loop-order prefill-first"]
        )
        assert "vLLM --scheduling-policy priority" in errors["scheduling_policy=priority"]
        # a knob only the force-fifo wrapper checks: the same one line, logged as roseinfer's
        bad = errors["--force-fifo-every -1"]
        assert "ROSEINFER_POLICY_ARGS='--force-fifo-every -1': --force-fifo-every must be" in bad
        assert "logged: roseinfer: ROSEINFER_POLICY_ARGS=" in bad


# ============================================================== the child
def _workload() -> list[dict[str, Any]]:
    """Requests in waves: ``steps`` engine steps run after each wave arrives.

    Prompts share prefixes (prefix-cache hits for ``lpm``), outputs vary (``sjf``),
    tenants are uneven (``vtc``), priorities and deadlines mixed (``priority``,
    ``edf``: some deadlines too tight to meet, so ``--drop-late`` drops them).
    """
    import random

    rng = random.Random(7)
    shared = [rng.randrange(50257) for _ in range(48)]
    waves = []
    for wave, (count, steps) in enumerate([(12, 3), (8, 4), (6, 0)]):
        requests = []
        for i in range(count):
            own = [rng.randrange(50257) for _ in range(rng.randrange(9, 80))]
            prompt = (shared[: rng.choice([0, 16, 32, 48])] + own)[:120]
            requests.append(
                {
                    "id": f"w{wave}r{i}",
                    "prompt": prompt,
                    "prompt_len": len(prompt),
                    "max_tokens": rng.choice([3, 6, 12, 20, 28]),
                    "priority": rng.choice([0, 1, 1, 2]),
                    "tenant": "light" if i % 4 == 0 else "heavy",
                    "deadline_s": rng.choice([None, 0.001, 0.02, 0.5, 30.0]),
                }
            )
        waves.append({"requests": requests, "steps": steps})
    return waves


def _snap(seq: Any, cost: int | None = None) -> dict[str, Any]:
    r = seq.request
    return {
        "id": seq.seq_id, "rid": r.request_id, "arrival": r.arrival_time_s,
        "prompt": r.num_prompt_tokens, "max_out": r.max_output_tokens, "tenant": r.tenant,
        "priority": r.priority, "deadline": r.deadline_s, "ignore_eos": r.sampling.ignore_eos,
        "out": seq.num_output_tokens, "computed": seq.num_computed_tokens,
        "status": seq.status.value, "preemptions": seq.num_preemptions, "cost": cost,
    }  # fmt: skip


def _ctx_snap(ctx: Any) -> dict[str, Any]:
    keys = ("now_s", "admission_round", "num_running", "num_waiting", "max_model_len",
            "num_free_blocks", "block_size", "max_num_seqs", "free_seats")  # fmt: skip
    return {k: getattr(ctx, k) for k in keys} | {"running": [_snap(s) for s in ctx.running]}


def _ids(answer: Any) -> list[Any]:
    return [[c[0].seq_id, c[1]] if isinstance(c, tuple) else c.seq_id for c in answer]


class _Recorder:
    """Stands in for the scheduler's policy: records every call and its answer,
    and every step's admissions (wrapping the scheduler's ``schedule``)."""

    def __init__(self, scheduler: Any) -> None:
        self.driver = scheduler.roseinfer
        self.inner = self.driver.policy
        self.driver.policy = self
        self.events: list[dict[str, Any]] = []
        self.step = 0
        plan = scheduler.schedule

        def schedule(*args: Any, **kwargs: Any) -> Any:
            self.step += 1
            out = plan(*args, **kwargs)
            new = [r.req_id for r in out.scheduled_new_reqs]
            resumed = sorted(out.scheduled_cached_reqs.resumed_req_ids)
            preempted = sorted(out.preempted_req_ids or ())
            self.events.append({"kind": "step", "step": self.step, "new": new, "resumed": resumed,
                                "preempted": preempted})  # fmt: skip
            return out

        scheduler.schedule = schedule

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _record(self, kind: str, waiting: Any, ctx: Any, answer: Any, **extra: Any) -> None:
        snap = [_snap(s, ctx.cost(s)) for s in waiting] if waiting is not None else None
        event = {"kind": kind, "step": self.step, "waiting": snap, "ctx": _ctx_snap(ctx)}
        self.events.append(event | extra | {"answer": answer})

    def admit(self, waiting: Any, budget: Any, ctx: Any) -> Any:
        answer = self.inner.admit(waiting, budget, ctx)
        limits = ("max_tokens", "max_seqs", "num_free_blocks", "max_batched_tokens")
        self._record("admit", waiting, ctx, _ids(answer),
                     budget={k: getattr(budget, k) for k in limits})  # fmt: skip
        return answer

    def preempt(self, waiting: Any, ctx: Any) -> Any:
        answer = self.inner.preempt(waiting, ctx)
        self._record("preempt", waiting, ctx, _ids(answer))
        return answer

    def drop(self, waiting: Any, ctx: Any) -> Any:
        answer = self.inner.drop(waiting, ctx)
        self._record("drop", waiting, ctx, _ids(answer))
        return answer

    def select_victim(self, running: Any, ctx: Any) -> Any:
        answer = self.inner.select_victim(running, ctx)
        self._record("select_victim", None, ctx, answer.seq_id,
                     pool=[_snap(s) for s in running])  # fmt: skip
        return answer

    def observe_step(self, report: Any) -> None:
        self.inner.observe_step(report)
        items = [[i.seq.seq_id, _snap(i.seq), i.num_tokens, i.is_decode] for i in report.items]
        self.events.append({"kind": "observe_step", "end_s": report.end_s, "items": items})


def _replay(policy_args: str, events: list[dict[str, Any]]) -> dict[str, Any]:
    """Every recorded call made again on a fresh policy with equivalent sequences."""
    from roseinfer.integrations._vllm_bridge import parse_policy_env
    from roseinfer.interface import Budget, PolicyContext, StepItem, StepReport
    from roseinfer.registry import load_registry
    from roseinfer.request import Request, SamplingParams
    from roseinfer.sequence import SeqStatus, Sequence

    registry = load_registry()
    policy = parse_policy_env(policy_args, registry).make(registry)
    seqs: dict[int, Sequence] = {}

    def seq_of(s: dict[str, Any]) -> Sequence:
        seq = seqs.get(s["id"])
        if seq is None:
            request = Request(s["rid"], s["arrival"], s["prompt"], s["max_out"], tenant=s["tenant"],
                              priority=s["priority"], deadline_s=s["deadline"],
                              sampling=SamplingParams(ignore_eos=s["ignore_eos"]))  # fmt: skip
            seq = seqs[s["id"]] = Sequence(s["id"], request)
        seq.num_output_tokens, seq.num_computed_tokens = s["out"], s["computed"]
        seq.status, seq.num_preemptions = SeqStatus(s["status"]), s["preemptions"]
        return seq

    kinds = ("admit", "preempt", "drop", "select_victim", "observe_step")
    compared, acted = dict.fromkeys(kinds, 0), dict.fromkeys(kinds, 0)
    mismatches = []
    for event in events:
        kind = event["kind"]
        if kind == "step":
            continue
        if kind == "observe_step":
            items = tuple(StepItem(seq_of(s), s["tenant"], n, d) for _, s, n, d in event["items"])
            policy.observe_step(StepReport(event["end_s"], 1, items))
            compared[kind] += 1
            acted[kind] += bool(items)
            continue
        c = event["ctx"]
        costs = {s["id"]: s["cost"] for s in event["waiting"] or ()}
        running = [seq_of(s) for s in c["running"]]
        ctx = PolicyContext(
            now_s=c["now_s"], admission_round=c["admission_round"], num_running=c["num_running"],
            num_waiting=c["num_waiting"], max_model_len=c["max_model_len"],
            cost=lambda q, costs=costs: costs[q.seq_id], running=running,
            num_free_blocks=c["num_free_blocks"], block_size=c["block_size"],
            max_num_seqs=c["max_num_seqs"], free_seats=c["free_seats"],
        )  # fmt: skip
        if kind == "select_victim":
            answer: Any = policy.select_victim([seq_of(s) for s in event["pool"]], ctx).seq_id
        else:
            waiting = [seq_of(s) for s in event["waiting"]]
            if kind == "admit":
                answer = _ids(policy.admit(waiting, Budget(**event["budget"]), ctx))
            else:
                answer = _ids(getattr(policy, kind)(waiting, ctx))
        compared[kind] += 1
        acted[kind] += bool(answer) or kind == "select_victim"
        if answer != event["answer"]:
            mismatches.append({"kind": kind, "step": event.get("step"), "vllm": event["answer"],
                               "fresh": answer})  # fmt: skip
    return {"compared": compared, "acted": acted, "mismatches": mismatches}


def _admitted_prefix_errors(events: list[dict[str, Any]]) -> list[Any]:
    """Steps where vLLM admitted anything but a prefix of the policy's answer."""
    answers: dict[int, list[str]] = {}
    errors = []
    for event in events:
        if event["kind"] == "admit":
            rid = {s["id"]: s["rid"] for s in event["waiting"]}
            answers[event["step"]] = [
                rid[a[0] if isinstance(a, list) else a] for a in event["answer"]
            ]
        elif event["kind"] == "step":
            answer = answers.get(event["step"], [])
            admitted = event["new"] + event["resumed"]
            head = answer[: len(admitted)]
            new_in_order = [r for r in head if r in event["new"]]
            if set(admitted) != set(head) or new_in_order != event["new"]:
                errors.append({"step": event["step"], "answer": answer, "admitted": admitted})
    return errors


def _run(model: str, work: Path, name: str, policy_args: str | None) -> dict[str, Any]:
    import gc

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = dict(ENGINE, model=model)
    os.environ.pop("ROSEINFER_POLICY_ARGS", None)
    os.environ.pop("ROSEINFER_STEP_LOG", None)
    step_log = work / f"{name}.steps.jsonl"
    if policy_args is not None:
        kwargs["scheduler_cls"] = "roseinfer.integrations.vllm.Scheduler"
        os.environ["ROSEINFER_POLICY_ARGS"] = policy_args
        os.environ["ROSEINFER_STEP_LOG"] = str(step_log)
    llm = LLM(**kwargs)
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    recorder = _Recorder(scheduler) if policy_args is not None else None
    outputs: dict[str, list[int]] = {}
    finish: dict[str, str] = {}

    def collect(results: list[Any]) -> None:
        for out in results:
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)
                finish[out.request_id] = str(out.outputs[0].finish_reason)

    def add(
        rid: str, prompt: list[int], max_tokens: int, extra: dict[str, Any], priority: int
    ) -> None:
        params = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True,
                                temperature=0, detokenize=False, extra_args=extra)  # fmt: skip
        engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt), params, priority=priority)

    for number, wave in enumerate(_workload()):
        for r in wave["requests"]:
            extra = {"tenant": r["tenant"]}
            if r["deadline_s"] is not None:
                extra["deadline_s"] = r["deadline_s"]
            add(r["id"], r["prompt"], r["max_tokens"], extra, r["priority"])
        if name == "fifo" and number == 0:  # roseinfer aborts it, with a warning
            add("malformed", [1, 2, 3], 4, {"deadline_s": "soon"}, 0)
        for _ in range(wave["steps"]):
            collect(engine.step())
    while engine.has_unfinished_requests():
        collect(engine.step())
    result: dict[str, Any] = {"outputs": outputs, "finish": finish}
    if recorder is not None:
        events = recorder.events
        result["replay"] = _replay(policy_args or "", events)
        result["num_preempted"] = sum(len(e["preempted"]) for e in events if e["kind"] == "step")
        result["num_cache_hits"] = sum(  # waiting requests the policy saw with cached tokens
            s["cost"] < s["prompt"] + s["out"] for e in events if e["kind"] == "admit"
            for s in e["waiting"]
        )  # fmt: skip
        result["not_a_prefix"] = _admitted_prefix_errors(events)
        result["aborted_by_roseinfer"] = sorted(r for r, why in finish.items() if why == "abort")
        result["step_log"] = str(step_log)
        scheduler.roseinfer.close()
    engine.engine_core.shutdown()
    del llm, scheduler, recorder
    gc.collect()
    return result


def _start_error(model: str, policy_args: str, **engine: Any) -> str:
    """What ``LLM(...)`` raised, then the lines the scheduler logged."""
    import logging

    from vllm import LLM

    logged: list[str] = []

    def keep(record: logging.LogRecord) -> bool:
        logged.append(record.getMessage())
        return True

    # NOTE: a filter, not a handler: vLLM's logging config empties its child loggers' handlers
    log = logging.getLogger("vllm.roseinfer")
    os.environ["ROSEINFER_POLICY_ARGS"] = policy_args
    os.environ.pop("ROSEINFER_STEP_LOG", None)
    log.addFilter(keep)
    try:
        LLM(**(ENGINE | engine), model=model, scheduler_cls="roseinfer.integrations.vllm.Scheduler")
    except Exception as err:  # noqa: BLE001 - what vLLM raises is the point
        return f"{type(err).__name__}: {err}" + "".join(f"\nlogged: {m}" for m in logged)
    finally:
        log.removeFilter(keep)
    return "started"


def _child(work: Path) -> None:
    """Run every scenario in vLLM and write ``work/report.json``."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = str(work / "tiny-gpt2")
    config = GPT2Config(n_layer=2, n_embd=64, n_head=2, n_positions=256, initializer_range=0.5)
    GPT2LMHeadModel(config).save_pretrained(model)
    report: dict[str, Any] = {"workload": _workload(), "runs": {}}
    report["default"] = _run(model, work, "default", None)
    for name, policy_args in SCENARIOS.items():
        report["runs"][name] = _run(model, work, name, policy_args)
    report["start_errors"] = {
        "--loop-order prefill-first": _start_error(model, "--loop-order prefill-first"),
        "scheduling_policy=priority": _start_error(model, "", scheduling_policy="priority"),
        "--force-fifo-every -1": _start_error(model, "--force-fifo-every -1"),
    }
    (work / "report.json").write_text(json.dumps(report))


if __name__ == "__main__" and sys.argv[1:2] == ["child"]:
    _child(Path(sys.argv[2]))
