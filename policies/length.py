"""Length-aware admission: ``sjf``, ``srpt`` (with preemption), ``hrrn`` (aging).

Each ranks waiting requests on a predicted output length from the run's
length predictor (``--length-predictor``, :mod:`roseinfer.policies.predictors`)
and admits the best-ranked ones under the budget (strict order; ties by
submission). Requests asked for in vLLM RFC #29406 and SGLang #10063.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar

from roseinfer import hookimpl
from roseinfer.interface import CHUNK_HEAD_OPTION, AdmissionPolicy, PolicyContext, PolicyOption
from roseinfer.policies.ranked import preempt_for
from roseinfer.prediction import LENGTH_PREDICTOR_OPTION, LengthPredictor
from roseinfer.sequence import Sequence as Seq


class LengthAware(AdmissionPolicy):
    """Base of the length-aware policies: predictions cached per request; each
    subclass defines its ``rank`` (smaller is admitted first)."""

    uses_token_budget = True
    uses_length_predictor = True
    option_specs: ClassVar[tuple[PolicyOption, ...]] = (LENGTH_PREDICTOR_OPTION, CHUNK_HEAD_OPTION)
    guarantees = ("ranked-prefix",)
    predictor: LengthPredictor

    def __init__(self, options=None) -> None:  # type: ignore[no-untyped-def]
        super().__init__(options)
        self._predicted: dict[int, float] = {}

    def prepare(self, requests: Sequence[Any]) -> None:
        """Fit the predictor on the workload (a ``bucket`` predictor's training slice)."""
        self.predictor.fit(requests)

    def predicted(self, seq: Seq) -> float:
        """Predicted output tokens of ``seq`` (asked once per request)."""
        value = self._predicted.get(seq.seq_id)
        if value is None:
            value = self._predicted[seq.seq_id] = float(self.predictor.predict(seq.request))
        return value


class ShortestJobFirst(LengthAware):
    """Shortest predicted job first, non-preemptive.

    Rank = predicted output tokens (then submission order). Classic SJF
    minimises mean waiting time for known lengths (Conway, Maxwell, Miller,
    "Theory of Scheduling", 1967); for LLM serving, vLLM RFC #29406 and
    "Efficient LLM Scheduling by Learning to Rank" (Fu et al., 2024).
    """

    name = "sjf"
    description = "shortest predicted output first (--length-predictor)"

    def rank(self, seq: Seq, ctx: PolicyContext) -> tuple[float, int]:
        """(predicted output tokens, seq_id)."""
        return (self.predicted(seq), seq.seq_id)


class ShortestRemaining(LengthAware):
    """Shortest remaining predicted tokens, with preemption.

    Rank = predicted output tokens less those already generated (at least 1).
    A waiting request that lacks a seat or KV blocks preempts (by recompute)
    the running request with the most remaining predicted tokens, when its own
    remaining is strictly smaller; the KV-pressure victim is the same. SRPT is
    optimal for mean response time on one server (Schrage, 1968); for LLMs,
    "Fast Distributed Inference Serving for LLMs" (FastServe, Wu et al., 2023)
    and vLLM RFC #29406.
    """

    name = "srpt"
    description = "shortest remaining predicted output first; preempts longer running ones"
    may_preempt = True

    def remaining(self, seq: Seq) -> float:
        """Predicted output tokens still to come (>= 1)."""
        return max(self.predicted(seq) - seq.num_output_tokens, 1.0)

    def rank(self, seq: Seq, ctx: PolicyContext) -> tuple[float, int]:
        """(predicted remaining tokens, seq_id)."""
        return (self.remaining(seq), seq.seq_id)

    def preempt(self, waiting: Sequence[Seq], ctx: PolicyContext) -> list[Seq]:
        """Running requests with more remaining than the waiting ones that need room."""
        return preempt_for(
            waiting,
            ctx,
            lambda s: self.rank(s, ctx),
            lambda a, b: self.remaining(a) < self.remaining(b),
        )

    def quiet_until(self, waiting: Sequence[Seq], ctx: PolicyContext) -> float:
        """Never asks again while requests only decode: their remaining predicted
        tokens only shrink, so a waiting request that outranks none now outranks
        none later."""
        return math.inf

    def select_victim(self, running: Sequence[Seq], ctx: PolicyContext) -> Seq:
        """The running request with the most remaining predicted tokens."""
        return max(running, key=lambda s: self.rank(s, ctx))


class HighestResponseRatio(LengthAware):
    """Highest response ratio next: SJF with aging by waiting time.

    Ratio = (waiting time + predicted service time) / predicted service time,
    with service time = predicted output tokens x ``--hrrn-decode-ms``. A
    request's ratio grows while it waits, so long jobs are not starved: a
    later request overtakes it only with a strictly shorter prediction.
    Source: Brinch Hansen, "Short-term scheduling in multiprogramming
    systems" (SOSP 1971); SGLang #10063 (HRRN for LLM serving).
    """

    name = "hrrn"
    description = "highest (wait + service) / service first: SJF with aging"
    option_specs = (
        LENGTH_PREDICTOR_OPTION,
        CHUNK_HEAD_OPTION,
        PolicyOption(
            "hrrn_decode_ms",
            float,
            20.0,
            "hrrn: assumed time per output token (ms) turning predicted tokens into "
            "service time (default 20)",
        ),
    )

    def __init__(self, options=None) -> None:  # type: ignore[no-untyped-def]
        super().__init__(options)
        self._decode_s = self.opt("hrrn_decode_ms") / 1e3
        if not self._decode_s > 0:
            raise ValueError(f"--hrrn-decode-ms must be > 0, got {self._decode_s * 1e3}")

    def rank(self, seq: Seq, ctx: PolicyContext) -> tuple[float, int]:
        """(-response ratio, seq_id)."""
        service_s = self.predicted(seq) * self._decode_s
        wait_s = max(ctx.now_s - seq.request.arrival_time_s, 0.0)
        return (-(wait_s + service_s) / service_s, seq.seq_id)


@hookimpl
def register_admission_policies() -> list[type[AdmissionPolicy]]:
    """The length-aware policies."""
    return [ShortestJobFirst, ShortestRemaining, HighestResponseRatio]
