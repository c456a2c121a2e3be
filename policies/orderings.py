"""Built-in loop orderings: ``prefill-first`` and ``decode-first`` (seed 032)."""

from __future__ import annotations

from roseinfer import hookimpl
from roseinfer.interface import (
    DECODE_FIRST,
    PREFILL_FIRST,
    AdmissionPolicy,
    Phase,
    PolicyContext,
)


class PrefillFirst(AdmissionPolicy):
    """Admit and prefill, then decode every running request (the seeds' default)."""

    name = "prefill-first"
    description = "admission step, then one decode step (seeds 027-031)"

    def order(self, ctx: PolicyContext) -> tuple[Phase, ...]:
        """Prefill, then decode."""
        return PREFILL_FIRST


class DecodeFirst(AdmissionPolicy):
    """One decode step before admission whenever something is running (seed 032).

    Keeps running requests' inter-token latency from waiting on a prefill,
    at the cost of a later first token for the admitted ones.
    """

    name = "decode-first"
    description = "one decode step, then the admission step (seed 032)"

    def order(self, ctx: PolicyContext) -> tuple[Phase, ...]:
        """Decode, then prefill."""
        return DECODE_FIRST


@hookimpl
def register_loop_orders() -> list[type[AdmissionPolicy]]:
    """The built-in loop orderings."""
    return [PrefillFirst, DecodeFirst]
