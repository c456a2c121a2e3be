"""One contract for plugin answers: roseinfer's scheduler and the scheduler class
inside vLLM check a policy's answer with the same function (``roseinfer.contract``),
and a router's answer is checked the same way (one line naming the router)."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import req, run_cli

from roseinfer import contract
from roseinfer.cli.sim import main as sim_main
from roseinfer.config import SchedulerConfig
from roseinfer.integrations._vllm_bridge import VllmSeq, make_request
from roseinfer.interface import AdmissionPolicy, Budget, ComposedPolicy, PolicyError, PolicyOptions
from roseinfer.registry import load_registry
from roseinfer.routing import ReplicaView, Router, RouterError
from roseinfer.scheduler import Scheduler
from roseinfer.sequence import SeqStatus

ROOT = Path(__file__).resolve().parents[1]
Answer = Callable[[list, list], object]

# (hook, the answer from (waiting, running), what the message says); 3 waiting
# requests of 10 tokens, 2 free seats, a budget of 15 prompt tokens, chunked prefill.
BAD_ANSWERS: list[tuple[str, Answer, str]] = [
    ("admit", lambda w, r: tuple(w[:1]), "returned tuple, expected a list"),
    ("admit", lambda w, r: list(w), "selected 3 requests; at most 2 fit"),
    ("admit", lambda w, r: [w[0], w[0]], "twice"),
    ("admit", lambda w, r: [w[0], w[1]], "selected 20 prompt tokens over a budget of 15"),
    ("admit", lambda w, r: [(w[0], 11)], r"expected 1\.\.10"),
    ("admit", lambda w, r: [(w[0], 1.5)], "expected an int"),
    ("admit", lambda w, r: ["r0"], "which this scheduler does not hold"),
    ("admit", lambda w, r: [r[0]], "which is not waiting"),
    ("drop", lambda w, r: "r1", "drop returned str, expected a list"),
    ("drop", lambda w, r: [w[0], w[0]], "asked to drop .* twice"),
    ("drop", lambda w, r: [r[0]], "asked to drop .*, which is not waiting"),
    ("preempt", lambda w, r: [w[0]], "asked to preempt .*, which is not running"),
    ("preempt", lambda w, r: [None], "asked to preempt None, which this scheduler does not hold"),
]


class Scripted(AdmissionPolicy):
    """FIFO for one request, then the scripted answer on its ``hook``."""

    name = "scripted"
    uses_token_budget = True
    hook = ""
    answer: Answer = staticmethod(lambda w, r: [])

    @property
    def may_drop(self) -> bool:  # type: ignore[override]
        return self.hook == "drop"

    @property
    def may_preempt(self) -> bool:  # type: ignore[override]
        return self.hook == "preempt"

    def admit(self, waiting, budget, ctx):  # type: ignore[no-untyped-def]
        if self.hook == "admit" and len(ctx.running):
            return self.answer(list(waiting), list(ctx.running))
        return [waiting[0]] if not len(ctx.running) else []

    def drop(self, waiting, ctx):  # type: ignore[no-untyped-def]
        return self.answer(list(waiting), list(ctx.running)) if len(ctx.running) else []

    def preempt(self, waiting, ctx):  # type: ignore[no-untyped-def]
        return self.answer(list(waiting), list(ctx.running))


def scheduler_error(hook: str, answer: Answer) -> str:
    """The PolicyError roseinfer's scheduler raises for ``answer`` (4 requests: one
    runs, three of 10 tokens wait)."""
    cls = type("S", (Scripted,), {"hook": hook, "answer": staticmethod(answer)})
    config = SchedulerConfig(num_kv_blocks=64, block_size=4, max_num_seqs=3,
                             prefill_max_tokens=15, max_num_batched_tokens=64,
                             enable_chunked_prefill=True, loop_order="mixed")  # fmt: skip
    ordering = load_registry().loop_order("mixed")(PolicyOptions())
    policy = ComposedPolicy(cls(PolicyOptions()), ordering, ("test", "test"))
    sched = Scheduler(config, policy, "scripted")
    for i, n in enumerate([4, 10, 10, 10]):
        sched.add_request(req(i, n, 8), 0.0)
    with pytest.raises(PolicyError) as err:
        for step in range(3):
            sched.update(sched.schedule(float(step)), step + 1.0)
    return str(err.value)


def bridge_error(hook: str, answer: Answer) -> str:
    """The PolicyError for ``answer`` checked as the vLLM scheduler class checks it:
    its :class:`VllmSeq` by request id, the same budget and chunk setting."""
    seqs = [VllmSeq(i, make_request(f"r{i}", arrival_time_s=0, num_prompt_tokens=n,
                                    max_tokens=8, prompt_token_ids=None, priority=0,
                                    extra_args=None, ignore_eos=True), vllm_request=None)
            for i, n in enumerate([4, 10, 10, 10])]  # fmt: skip
    seqs[0].status = SeqStatus.RUNNING
    live = {s.request_id: s for s in seqs}
    ctx = contract.PolicyContext(0.0, 2, 1, 3, 1024, cost=lambda s: 10)
    budget = Budget(max_tokens=15, max_seqs=2, num_free_blocks=60, max_batched_tokens=63)
    given = answer(seqs[1:], seqs[:1])
    with pytest.raises(PolicyError) as err:
        if hook == "admit":
            list(contract.checked_admission(given, budget, ctx, live=live, chunked_prefill=True,
                                            where="policy 'scripted'"))  # fmt: skip
        else:
            contract.checked_named(given, live=live, where="policy 'scripted'", what=hook)
    return str(err.value)


@pytest.mark.parametrize(("hook", "answer", "expected"), BAD_ANSWERS)
def test_scheduler_and_vllm_bridge_refuse_the_same_answers_alike(hook, answer, expected) -> None:
    from_scheduler = scheduler_error(hook, answer)
    from_bridge = bridge_error(hook, answer)
    for message in (from_scheduler, from_bridge):
        assert message.startswith("policy 'scripted'"), message
        assert "\n" not in message
    assert re.search(expected, from_scheduler), from_scheduler
    assert re.search(expected, from_bridge), from_bridge


@pytest.mark.parametrize("num_named", [0, 1, 2])
def test_a_checked_preempt_answer_is_a_new_list(num_named: int) -> None:
    """The engine appends to the victims it gets; a plugin that keeps and returns
    the same list (an empty constant, say) must never see it change."""
    seqs = [VllmSeq(i, make_request(f"r{i}", arrival_time_s=0, num_prompt_tokens=4,
                                    max_tokens=8, prompt_token_ids=None, priority=0,
                                    extra_args=None, ignore_eos=True), vllm_request=None)
            for i in range(2)]  # fmt: skip
    for seq in seqs:
        seq.status = SeqStatus.RUNNING
    kept = seqs[:num_named]
    got = contract.checked_named(
        kept, live={s.request_id: s for s in seqs}, where="policy 'p'", what="preempt"
    )
    assert got == kept and got is not kept
    got.append(seqs[0])
    assert len(kept) == num_named


def test_the_contract_is_written_once() -> None:
    """Before: the vLLM bridge re-implemented the scheduler's checks (about 110 lines,
    identical messages) and its own copy of the read-only view."""
    phrases = ("which this scheduler does not hold", "only a single request may exceed it",
               "but chunked prefill is off", "class SeqView", "class _ReadOnlyView")  # fmt: skip
    for folder in ("roseinfer", "integrations", "simulator", "executor", "serve"):
        for path in (ROOT / folder).rglob("*.py"):
            if path.name == "contract.py":
                continue
            text = path.read_text()
            for phrase in phrases:
                assert phrase not in text, f"{path.relative_to(ROOT)} repeats {phrase!r}"
    bridge = (ROOT / "integrations" / "vllm.py").read_text()
    assert "checked_admission(" in bridge and "checked_named(" in bridge


# ------------------------------------------------------------------ routers
def views(n: int = 2) -> list[ReplicaView]:
    return [ReplicaView(i, f"r{i}", 0, 0, 0, 100, 100, 16, 4096, lambda r: 0) for i in range(n)]


def router_with(score: Callable[..., object]) -> Router:
    return type("Bad", (Router,), {"name": "bad", "score": score})()


def _raise(err: Exception) -> Callable[..., object]:
    def score(self, request, candidates, now_s):  # type: ignore[no-untyped-def]
        raise err

    return score


@pytest.mark.parametrize(
    ("score", "expected"),
    [
        (lambda self, q, c, t: ["a", 1.0], "router 'bad' gave candidate 0 the score 'a'"),
        (lambda self, q, c, t: [math.nan, 1.0], "router 'bad' gave candidate 0 the score NaN"),
        (lambda self, q, c, t: [True, 1.0], "gave candidate 0 the score True"),
        (lambda self, q, c, t: [1.0], "router 'bad' scored 1 of 2 candidates"),
        (lambda self, q, c, t: 3.0, "router 'bad' score() returned float, expected a list"),
        (lambda self, q, c, t: "ab", "score() returned str"),
        (_raise(KeyError("k")), "router 'bad' raised KeyError: 'k' in score(); a bug in that"),
        (_raise(ValueError("score exploded")), "router 'bad' raised ValueError: score exploded"),
    ],
)
def test_a_bad_router_answer_is_one_line_naming_the_router(score, expected) -> None:
    """Before: a traceback in routing.py (``["a", 1.0]``, KeyError), ``score exploded``
    with no router named, and NaN scores sent every request to replica 0."""
    with pytest.raises(RouterError) as err:
        router_with(score).route(req(0, 10), views(), 0.0)
    message = str(err.value)
    assert expected in message and "\n" not in message, message


def test_infinite_scores_still_rank() -> None:
    router = router_with(lambda self, q, c, t: [-math.inf, math.inf])
    assert router.route(req(0, 10), views(), 0.0) == 1


NAN_ROUTER = """
from roseinfer import hookimpl
from roseinfer.routing import Router


class NanRouter(Router):
    name = "nan-scores"

    def score(self, request, candidates, now_s):
        return [float("nan")] * len(candidates)


@hookimpl
def register_routers():
    return [NanRouter]
"""


def test_nan_scores_fail_rose_sim_in_one_line(tmp_path, monkeypatch, capsys) -> None:
    """Through the CLI, with the router installed as a plugin: one ``error:`` line
    naming the router (exit 2), not every request on replica 0."""
    (tmp_path / "rose_nan_router.py").write_text(NAN_ROUTER)
    dist = tmp_path / "rose_nan-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: rose-nan\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[roseinfer]\nnan = rose_nan_router\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    code, _, err = run_cli(sim_main, "rose-sim", monkeypatch, capsys, "--num-replicas", "2",
                           "--router", "nan-scores", "--num-requests", "5")  # fmt: skip
    lines = err.strip().splitlines()
    assert code == 2 and "Traceback" not in err, err
    assert lines[-1].startswith("rose-sim: error: router 'nan-scores' gave candidate 0"), err
