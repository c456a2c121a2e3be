"""Built-in loop orderings: ``prefill-first``, ``decode-first`` (seed 032),
``mixed`` (vLLM v1 / Sarathi-Serve) and ``prefill-priority`` (SGLang's default loop)."""

from __future__ import annotations

from roseinfer import hookimpl
from roseinfer.interface import (
    DECODE_FIRST,
    MIXED_ORDER,
    PREFILL_FIRST,
    AdmissionPolicy,
    Phase,
    PolicyContext,
)


class PrefillFirst(AdmissionPolicy):
    """Admit and prefill, then decode every running request (the seeds' default)."""

    name = "prefill-first"
    description = "a prefill step, then a decode step (seeds 027-031)"
    fixed_order = PREFILL_FIRST

    def order(self, ctx: PolicyContext) -> tuple[Phase, ...]:
        """Prefill, then decode."""
        return PREFILL_FIRST


class DecodeFirst(AdmissionPolicy):
    """One decode step before admission whenever something is running (seed 032).

    Keeps running requests' inter-token latency from waiting on a prefill,
    at the cost of a later first token for the admitted ones.
    """

    name = "decode-first"
    description = "a decode step, then a prefill step (seed 032)"
    fixed_order = DECODE_FIRST

    def order(self, ctx: PolicyContext) -> tuple[Phase, ...]:
        """Decode, then prefill."""
        return DECODE_FIRST


class Mixed(AdmissionPolicy):
    """One forward per iteration: every decode, then prefill chunks of running and
    newly admitted requests under ``max_num_batched_tokens``.

    The step order of vLLM v1's scheduler (running requests first, then waiting
    ones, one token budget; vllm/v1/core/sched/scheduler.py) and Sarathi-Serve's
    stall-free batching (Agrawal et al., OSDI 2024): a long prompt, cut into
    chunks, never stalls the decodes that share its steps.
    """

    name = "mixed"
    description = "decodes and prefill chunks in one step (vLLM v1, Sarathi-Serve)"
    fixed_order = MIXED_ORDER

    def order(self, ctx: PolicyContext) -> tuple[Phase, ...]:
        """One mixed step."""
        return MIXED_ORDER


class PrefillPriority(AdmissionPolicy):
    """A prefill step whenever one can be formed; decode only otherwise.

    SGLang's event loop without ``--enable-mixed-chunk`` (python/sglang/srt/
    managers/scheduler.py ``get_next_batch_to_run``): a new prefill batch runs
    if it holds any request, else the running batch decodes. Decodes wait while
    arrivals keep coming and seats are free (lowest TTFT, highest ITL).
    """

    name = "prefill-priority"
    description = "prefill whenever possible, decode otherwise (SGLang's loop)"
    fixed_order = (Phase.PREFILL,)

    def order(self, ctx: PolicyContext) -> tuple[Phase, ...]:
        """Prefill only; the scheduler decodes when the prefill step is empty."""
        return (Phase.PREFILL,)


@hookimpl
def register_loop_orders() -> list[type[AdmissionPolicy]]:
    """The built-in loop orderings."""
    return [PrefillFirst, DecodeFirst, Mixed, PrefillPriority]
