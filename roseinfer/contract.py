"""What a plugin may answer: one check per hook, shared by every engine that calls it.

roseinfer's :class:`~roseinfer.scheduler.Scheduler` and the scheduler class inside
vLLM (:mod:`roseinfer.integrations.vllm`) hand a policy the same read-only views
and check its answers here, so a bad answer gets the same one-line
:class:`~roseinfer.interface.PolicyError` from both. A router's scores are checked
here too (:func:`checked_scores`), with a :class:`RouterError` naming the router.

Every message names the plugin (``where``, e.g. ``"policy 'pack'"``) and what was
wrong: not a list, a request it does not hold or that is not waiting (running),
a request named twice, more requests than seats, prompt tokens over the budget,
a chunk that is not an int in ``1..uncached tokens``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from collections.abc import Sequence as SequenceABC
from itertools import repeat
from numbers import Real

from roseinfer.interface import Budget, PolicyContext, PolicyError
from roseinfer.sequence import SeqStatus, Sequence


class RouterError(ValueError):
    """A router answered something invalid or raised, or no replica can take a request
    (one line naming the router and what was wrong)."""


class ReadOnlyView(SequenceABC[Sequence]):
    """Read-only view of a waiting queue or running set handed to a policy (no copy).

    Args:
        items: the engine's deque or list; a slice of a deque is built item by item.
    """

    __slots__ = ("_items",)

    def __init__(self, items: SequenceABC[Sequence]) -> None:
        self._items = items

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, index):  # type: ignore[no-untyped-def, override]
        if isinstance(index, slice):  # a deque takes no slices
            return [self._items[i] for i in range(*index.indices(len(self._items)))]
        return self._items[index]

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self._items)


def checked_admission(
    selection: object,
    budget: Budget,
    ctx: PolicyContext,
    *,
    live: Mapping[str, Sequence],
    chunked_prefill: bool,
    where: str,
) -> Iterator[tuple[Sequence, int | None]]:
    """A policy's ``admit`` answer as ``(seq, chunk or None)`` pairs, checked.

    Admission stops at the first request that cannot start, so without a
    prompt-token budget each choice is checked as it is taken and the ones after
    the stop are never walked (a round costs what it admits). With a budget or
    explicit chunks the whole answer is checked first: costs must be read before
    admissions change the prefix cache (an eviction raises a later request's
    cost, a new cached block lowers it), and such an answer is short anyway
    (every cost is >= 1 token).

    Args:
        selection: what ``admit`` returned: a list of waiting sequences, each
            optionally as ``(seq, num_tokens)`` to prefill a chunk.
        budget: the budget the policy was given.
        ctx: the context the policy was given (``ctx.cost`` prices a request).
        live: the waiting and running sequences by request id.
        chunked_prefill: whether explicit chunks are allowed.
        where: names the plugin in messages (``"policy 'fifo'"``).

    Raises:
        PolicyError: naming the plugin and what is wrong.
    """
    if not isinstance(selection, list):
        raise PolicyError(f"{where} returned {type(selection).__name__}, expected a list")
    if len(selection) > budget.max_seqs:
        raise PolicyError(
            f"{where} selected {len(selection)} requests; at most {budget.max_seqs} fit"
        )
    checked = _checked_choices(where, selection, budget, ctx, live, chunked_prefill)
    if budget.max_tokens is None and not any(map(isinstance, selection, repeat(tuple))):
        return checked
    choices = list(checked)
    if len(choices) > 1 and budget.max_tokens is not None:
        total = sum(ctx.cost(seq) if n is None else n for seq, n in choices)
        if total > budget.max_tokens:
            raise PolicyError(
                f"{where} selected {total} prompt tokens over a budget of "
                f"{budget.max_tokens} (only a single request may exceed it)"
            )
    return iter(choices)


def _checked_choices(
    where: str,
    selection: list,
    budget: Budget,
    ctx: PolicyContext,
    live: Mapping[str, Sequence],
    chunked_prefill: bool,
) -> Iterator[tuple[Sequence, int | None]]:
    seen: set[int] = set()
    explicit = 0
    room = budget.max_batched_tokens
    for choice in selection:
        seq, num_tokens = _choice(where, choice, seen, ctx, live, chunked_prefill)
        seen.add(seq.seq_id)
        if num_tokens is not None:
            explicit += num_tokens
            if room is not None and explicit > room:
                raise PolicyError(
                    f"{where} asked for {explicit} chunk tokens; the step has "
                    f"{room} left (max_num_batched_tokens)"
                )
        yield seq, num_tokens


def _choice(
    where: str,
    choice: object,
    seen: set[int],
    ctx: PolicyContext,
    live: Mapping[str, Sequence],
    chunked_prefill: bool,
) -> tuple[Sequence, int | None]:
    given, num_tokens = choice if isinstance(choice, tuple) and len(choice) == 2 else (choice, None)
    seq = _held(given, live, where, "selected")
    if seq.seq_id in seen:
        raise PolicyError(f"{where} selected {seq!r} twice")
    if seq.status is not SeqStatus.WAITING:
        raise PolicyError(f"{where} selected {seq!r}, which is not waiting")
    if num_tokens is None:
        return seq, None
    if not isinstance(num_tokens, int) or isinstance(num_tokens, bool):
        raise PolicyError(f"{where} gave {seq!r} a chunk of {num_tokens!r}; expected an int")
    if not chunked_prefill:
        raise PolicyError(f"{where} asked for a chunk of {seq!r} but chunked prefill is off")
    cost = ctx.cost(seq)
    if not 0 < num_tokens <= cost:
        raise PolicyError(
            f"{where} gave {seq!r} a chunk of {num_tokens} tokens; expected 1..{cost} "
            "(its uncached tokens)"
        )
    return seq, num_tokens


def _held(seq: object, live: Mapping[str, Sequence], where: str, verb: str) -> Sequence:
    """``seq`` when it is a sequence ``live`` holds; else PolicyError ("``where``
    ``verb`` SEQ, which this scheduler does not hold")."""
    if not isinstance(seq, Sequence) or live.get(seq.request_id) is not seq:
        raise PolicyError(f"{where} {verb} {seq!r}, which this scheduler does not hold")
    return seq


_STATE = {"drop": SeqStatus.WAITING, "preempt": SeqStatus.RUNNING}


def checked_named(
    answer: object,
    *,
    live: Mapping[str, Sequence],
    where: str,
    what: str,
    status_of: Callable[[Sequence], SeqStatus] | None = None,
) -> list[Sequence]:
    """A ``drop`` or ``preempt`` answer, checked: a list of distinct sequences the
    engine holds, each waiting (``drop``) or running (``preempt``).

    Args:
        answer: what the hook returned.
        live: the waiting and running sequences by request id.
        where: names the plugin in messages.
        what: ``"drop"`` or ``"preempt"``.
        status_of: a sequence's state as the engine knows it (default ``seq.status``;
            inside vLLM the vLLM request's state is the truth).

    Returns:
        A new list of those sequences, in the answer's order (never the
        answer itself, which the plugin may keep and return again).

    Raises:
        PolicyError: naming the plugin and what is wrong.
    """
    if not isinstance(answer, list):
        raise PolicyError(f"{where} {what} returned {type(answer).__name__}, expected a list")
    if not answer:  # the usual answer: a new list, as below
        return []
    state, verb = _STATE[what], f"asked to {what}"
    seen: set[int] = set()
    for given in answer:
        seq = _held(given, live, where, verb)
        if seq.seq_id in seen:
            raise PolicyError(f"{where} asked to {what} {seq!r} twice")
        seen.add(seq.seq_id)
        if (status_of(seq) if status_of else seq.status) is not state:
            raise PolicyError(f"{where} asked to {what} {seq!r}, which is not {state.value}")
    return list(answer)  # the engine's own: it appends to it, the plugin may keep its list


def checked_scores(scores: object, num_candidates: int, *, where: str) -> list[float]:
    """A router's ``score`` answer, checked: one real number per candidate, none NaN
    (``inf`` and ``-inf`` are allowed: always or never this replica).

    Raises:
        RouterError: naming the router (``where``) and the bad score.
    """
    if not isinstance(scores, SequenceABC) or isinstance(scores, (str, bytes)):
        raise RouterError(f"{where} score() returned {type(scores).__name__}, expected a list")
    if len(scores) != num_candidates:
        raise RouterError(f"{where} scored {len(scores)} of {num_candidates} candidates")
    for k, value in enumerate(scores):
        if isinstance(value, bool) or not isinstance(value, Real):
            raise RouterError(
                f"{where} gave candidate {k} the score {value!r:.40}; expected a number"
            )
        if math.isnan(value):
            raise RouterError(f"{where} gave candidate {k} the score NaN; expected a number")
    return [float(v) for v in scores]
