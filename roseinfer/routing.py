"""The router interface: where a cluster of replicas sends each request.

A router is a plugin class (registered through the ``register_routers`` hook)
that picks one replica per arriving request in three steps, the shape of
llm-d's endpoint picker (filters, then weighted scorers, then a picker):

1. :meth:`Router.filter` drops replicas that cannot serve the request (by
   default those whose ``max_model_len`` or KV pool is too small for it);
2. :meth:`Router.score` gives every remaining replica a number (higher is better);
3. :meth:`Router.pick` chooses among them (by default the best score, ties to
   the lowest replica index).

The router sees each replica through a :class:`ReplicaView`, a snapshot of its
load as of the last update (``--router-staleness-s``): real routers read load
from metrics that lag. Prefix-cache contents are read live through
:meth:`ReplicaView.cached_prefix_blocks`, as a router fed by KV-cache events
(NVIDIA Dynamo's KV router) sees them.

With prefill/decode disaggregation a request is routed twice, once per stage
(``stage="prefill"`` when it arrives, ``stage="decode"`` when its prefill
ends): :meth:`Router.route` offers only the replicas whose role serves that
stage (:data:`ROLES`), and a router can tell the stages apart by
:attr:`ReplicaView.role`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field
from typing import Any, ClassVar

from roseinfer.contract import RouterError, checked_scores
from roseinfer.request import Request

ROLES = ("mixed", "prefill", "decode")
"""Replica roles: ``mixed`` serves whole requests (colocated serving),
``prefill`` computes prompts and hands their KV on, ``decode`` generates from
handed-over KV (DistServe's and vLLM's disaggregated prefill). A request is
routed once per stage, and a stage goes to the replicas of the same role."""


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """What a router knows about one replica.

    Attributes:
        index: position in the cluster (0..N-1), the ``replica`` record column.
        name: label, e.g. ``llama-3.1-8b@h100-sxm``.
        num_waiting: requests queued for admission (as of the last update).
        num_running: requests in the running set (as of the last update).
        outstanding_tokens: prompt + output tokens of the requests routed here
            that had not ended as of the last update, plus those routed since
            (the router counts what it sends at once, as Dynamo's router tracks
            its active blocks itself).
        num_kv_blocks: blocks in the replica's KV pool.
        num_free_blocks: free blocks (cached evictable ones included) as of the
            last update.
        block_size: tokens per KV block.
        max_model_len: longest request (prompt + output tokens) it accepts.
        prefix_blocks: callable giving the number of leading full prompt blocks
            of a request that are in the replica's prefix cache now.
        role: ``mixed``, ``prefill`` or ``decode`` (:data:`ROLES`).
    """

    index: int
    name: str
    num_waiting: int
    num_running: int
    outstanding_tokens: int
    num_kv_blocks: int
    num_free_blocks: int
    block_size: int
    max_model_len: int
    prefix_blocks: Callable[[Request], int] = field(repr=False, compare=False)
    role: str = "mixed"

    def cached_prefix_blocks(self, request: Request) -> int:
        """Leading full prompt blocks of ``request`` cached on this replica (0 without
        prefix caching or shared-prefix information)."""
        return self.prefix_blocks(request)

    @property
    def outstanding_blocks(self) -> float:
        """``outstanding_tokens`` in KV blocks (a load term in block units)."""
        return self.outstanding_tokens / self.block_size


class ReadOptions(dict[str, str]):
    """A router's options that remember which keys were looked up."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.read: set[str] = set()

    def __getitem__(self, key: str) -> str:
        self.read.add(key)
        return super().__getitem__(key)

    def get(self, key: str, default: Any = None) -> Any:  # type: ignore[override]
        self.read.add(key)
        return super().get(key, default)

    def __contains__(self, key: object) -> bool:
        if isinstance(key, str):
            self.read.add(key)
        return super().__contains__(key)


class Router:
    """Base class of routing policies (plugins subclass it).

    Class attributes:
        name: the ``--router`` value (unique across plugins).
        description: one line for ``--list-policies``.

    Args:
        seed: random seed for routers that draw (``random``).
        options: extra ``--router-arg KEY=VALUE`` knobs (strings).

    Raises:
        ValueError: from subclasses, on an option they cannot parse.
    """

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""

    def __init__(self, seed: int = 0, options: Mapping[str, str] | None = None) -> None:
        self.seed = seed
        self.options: dict[str, str] = ReadOptions(options or {})

    def unread_options(self) -> list[str]:
        """The ``--router-arg`` keys this router never read (looked up with ``get``,
        ``[]`` or ``in``) while it was built: a router reads its knobs in
        ``__init__``, so these are typos or another router's knobs."""
        options = self.options
        read = options.read if isinstance(options, ReadOptions) else set(options)
        return sorted(set(options) - read)

    def route(
        self,
        request: Request,
        replicas: SequenceABC[ReplicaView],
        now_s: float,
        stage: str = "mixed",
    ) -> int:
        """The index of the replica that serves ``stage`` of ``request`` (filter,
        score, pick among the replicas whose role is ``stage``). When the filter
        leaves none, every replica of that role is a candidate (the chosen one
        rejects the request, recording why).

        Raises:
            RouterError: with no replica of that role, when the router raises, or on
                scores that are not one number per candidate (NaN included) or a pick
                that is not a candidate; one line naming the router.
        """
        pool = [r for r in replicas if r.role == stage]
        if not pool:
            raise RouterError(f"no {stage} replica to route to")
        # A request no replica can hold still goes somewhere: that replica rejects
        # it with its reason, as a single engine does.
        where = f"router {self.name!r}"
        candidates = self._call("filter", self.filter, request, pool) or pool
        answer = self._call("score", self.score, request, candidates, now_s)
        scores = checked_scores(answer, len(candidates), where=where)
        chosen = self._call("pick", self.pick, candidates, scores)
        if chosen not in {c.index for c in candidates}:
            raise RouterError(f"{where} picked replica {chosen!r:.40}, not a candidate")
        return chosen

    def _call(self, method: str, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, with any exception but a RouterError re-raised as one line
        naming the router (a plugin's bug must not look like a user error)."""
        try:
            return fn(*args)
        except RouterError:
            raise
        except Exception as err:
            lines = str(err).strip().splitlines()
            what = f"{type(err).__name__}: {lines[0][:200]}" if lines else type(err).__name__
            raise RouterError(
                f"router {self.name!r} raised {what} in {method}(); a bug in that router, "
                "not in the flags: report it to its authors or pick another router"
            ) from err

    def filter(self, request: Request, replicas: SequenceABC[ReplicaView]) -> list[ReplicaView]:
        """Replicas able to hold the request at all (length and pool size)."""
        return [
            r
            for r in replicas
            if request.max_num_tokens <= r.max_model_len
            and -(-request.max_num_tokens // r.block_size) <= r.num_kv_blocks
        ]

    def score(
        self, request: Request, candidates: SequenceABC[ReplicaView], now_s: float
    ) -> list[float]:
        """One score per candidate, higher is better (base: all equal)."""
        return [0.0] * len(candidates)

    def pick(self, candidates: SequenceABC[ReplicaView], scores: SequenceABC[float]) -> int:
        """The best-scored candidate's index; ties go to the lowest index."""
        best = max(range(len(candidates)), key=lambda k: (scores[k], -candidates[k].index))
        return candidates[best].index


def build_router(
    cls: type[Router], *, seed: int, options: Mapping[str, Any], source: str = "--router-arg"
) -> Router:
    """``cls(seed, options)`` with its knobs checked: a value that is a non-finite number
    (``nan``, ``inf``) or a key the router never reads is an error.

    Args:
        source: where the options came from, for messages (``--router-arg``, a grid's
            ``router_args``).

    Raises:
        ValueError: one line naming the key and ``source``.
    """
    texts = {str(k): str(v) for k, v in options.items()}
    for key, value in texts.items():
        try:
            number = float(value)
        except ValueError:
            continue
        if not math.isfinite(number):
            raise ValueError(f"{source} {key[:40]}: must be a finite number, got {value[:40]!r}")
    router = cls(seed=seed, options=texts)
    unread = router.unread_options()
    if unread:
        raise ValueError(
            f"router {cls.name!r} reads no {source} {', '.join(k[:40] for k in unread)}; check "
            "the name (see --list-policies and the router's docs)"
        )
    return router
