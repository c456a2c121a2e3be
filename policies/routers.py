"""Built-in routers: ``round-robin``, ``least-loaded``, ``prefix-aware``, ``random``.

Each is a filter -> score -> pick :class:`~roseinfer.routing.Router` (the shape
of llm-d's endpoint picker); the default filter drops replicas too small for
the request.
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence as SequenceABC

import numpy as np

from roseinfer import hookimpl
from roseinfer.request import Request
from roseinfer.routing import ReplicaView, Router


class RoundRobin(Router):
    """Send each request to the next replica in turn (skipping filtered ones)."""

    name = "round-robin"
    description = "each replica in turn (vLLM production-stack / Dynamo default)"

    def __init__(self, seed: int = 0, options: Mapping[str, str] | None = None) -> None:
        super().__init__(seed, options)
        self._next = 0

    def pick(self, candidates: SequenceABC[ReplicaView], scores: SequenceABC[float]) -> int:
        """The first candidate at or after the cursor (cyclically); moves the cursor past it."""
        after = [c.index for c in candidates if c.index >= self._next]
        chosen = after[0] if after else candidates[0].index
        self._next = chosen + 1
        return chosen


class LeastLoaded(Router):
    """Join the shortest queue, measured in outstanding tokens (JSQ by work).

    Score = -(outstanding prompt + output tokens); ties go to fewer waiting
    requests, then the lower index. Join-the-shortest-queue is the classic
    load balancer (Winston 1977); counting tokens rather than requests weighs
    a long prompt as the work it is.
    """

    name = "least-loaded"
    description = "fewest outstanding tokens (join-the-shortest-queue by work)"

    def score(
        self, request: Request, candidates: SequenceABC[ReplicaView], now_s: float
    ) -> list[float]:
        """Minus outstanding tokens, with a small tie-break on waiting requests."""
        return [-(c.outstanding_tokens + 1e-3 * c.num_waiting) for c in candidates]


class PrefixAware(Router):
    """Prefer the replica that already caches the longest prefix of the prompt,
    unless its load outweighs the saving.

    Score = cached prefix blocks - ``load_weight`` x outstanding blocks. This is
    NVIDIA Dynamo's KV-router cost with the sign flipped (Dynamo minimizes
    ``overlap_score_weight`` x new prefill blocks + active blocks; prefill blocks
    are prompt blocks minus cached ones, so the prompt's own size cancels across
    replicas), and the balance llm-d's scheduler strikes by weighting its
    prefix-cache scorer against its load scorers. Both source routers: Dynamo
    docs "KV Router" (docs.nvidia.com/dynamo, router design) and llm-d's
    inference-scheduler ``prefix-cache-scorer``.

    Options (``--router-arg``): ``load_weight`` (default 1.0; 0 = prefix only).
    """

    name = "prefix-aware"
    description = "cached prefix blocks minus a load term (Dynamo KV router, llm-d prefix scorer)"

    def __init__(self, seed: int = 0, options: Mapping[str, str] | None = None) -> None:
        super().__init__(seed, options)
        try:
            self.load_weight = float(self.options.get("load_weight", 1.0))
        except ValueError:
            raise ValueError(
                f"--router-arg load_weight must be a number, got {self.options['load_weight']!r}"
            ) from None

    def score(
        self, request: Request, candidates: SequenceABC[ReplicaView], now_s: float
    ) -> list[float]:
        """Cached prefix blocks minus ``load_weight`` x outstanding blocks."""
        return [
            c.cached_prefix_blocks(request) - self.load_weight * c.outstanding_blocks
            for c in candidates
        ]


class RandomRouter(Router):
    """A uniformly random candidate, from a generator seeded with ``--seed``."""

    name = "random"
    description = "a uniformly random replica (seeded by --seed)"

    def __init__(self, seed: int = 0, options: Mapping[str, str] | None = None) -> None:
        super().__init__(seed, options)
        self._rng = np.random.default_rng(seed)

    def pick(self, candidates: SequenceABC[ReplicaView], scores: SequenceABC[float]) -> int:
        """A seeded uniform draw among the candidates."""
        return candidates[int(self._rng.integers(len(candidates)))].index


@hookimpl
def register_routers() -> list[type[Router]]:
    """The built-in routers."""
    return [RoundRobin, LeastLoaded, PrefixAware, RandomRouter]
