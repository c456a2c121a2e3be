"""Seed behaviours of the built-in policies (seeds 031 and 033 test cases)."""

from __future__ import annotations

import pytest
from conftest import budget, ctx, drive_unit_steps, make_scheduler, req, seqs

from roseinfer.interface import (
    DECODE_FIRST,
    PREFILL_FIRST,
    AdmissionPolicy,
    ComposedPolicy,
    Phase,
    PolicyError,
    PolicyOptions,
)
from roseinfer.policies.admission import Fifo, Pack, TokenBudget
from roseinfer.policies.orderings import DecodeFirst, PrefillFirst
from roseinfer.policies.wrappers import ForceFifo
from roseinfer.registry import load_registry
from roseinfer.scheduler import Scheduler


def ids(selection) -> list[int]:
    return [s.seq_id for s in selection]


def test_budget_cuts_at_first_misfit_and_keeps_order() -> None:
    waiting = seqs(2, 2, 2)
    assert ids(TokenBudget().admit(waiting, budget(4), ctx())) == [0, 1]


def test_budget_lets_an_oversize_head_go_alone() -> None:
    waiting = seqs(100, 1)
    assert ids(TokenBudget().admit(waiting, budget(4), ctx())) == [0]


def test_budget_does_not_skip_a_misfit_for_a_later_fit() -> None:
    waiting = seqs(3, 5, 1)
    assert ids(TokenBudget().admit(waiting, budget(4), ctx())) == [0]


def test_cost_is_capped_at_max_context() -> None:
    waiting = seqs(100, 100)
    assert ids(TokenBudget().admit(waiting, budget(16), ctx(max_model_len=8))) == [0, 1]


def test_budget_respects_max_seqs() -> None:
    waiting = seqs(1, 1, 1, 1)
    assert ids(TokenBudget().admit(waiting, budget(100, max_seqs=3), ctx())) == [0, 1, 2]


def test_fifo_ignores_the_token_budget() -> None:
    waiting = seqs(100, 100, 100)
    assert ids(Fifo().admit(waiting, budget(4, max_seqs=2), ctx())) == [0, 1]


def test_pack_skips_an_oversize_head() -> None:
    waiting = seqs(100, 2, 2)
    assert ids(Pack().admit(waiting, budget(4), ctx())) == [1, 2]


def test_pack_sends_the_head_alone_when_nothing_fits() -> None:
    waiting = seqs(100, 100)
    assert ids(Pack().admit(waiting, budget(4), ctx())) == [0]


def test_pack_is_greedy_by_cost_and_returns_arrival_order() -> None:
    waiting = seqs(3, 5, 1, 2, 9)
    # by (cost, index): 1(#2), 2(#3), 3(#0) -> 6 tokens; 5 would exceed 8
    assert ids(Pack().admit(waiting, budget(8), ctx())) == [0, 2, 3]


def test_pack_only_looks_inside_the_lookahead_window() -> None:
    waiting = seqs(100, 100, 1)
    pack = Pack(PolicyOptions(lookahead=2))
    assert ids(pack.admit(waiting, budget(4), ctx())) == [0]


def test_pack_caps_the_number_of_requests() -> None:
    waiting = seqs(1, 1, 1, 1)
    assert ids(Pack().admit(waiting, budget(100, max_seqs=2), ctx())) == [0, 1]


def test_pack_without_a_budget_is_fifo() -> None:
    waiting = seqs(100, 1, 1)
    assert ids(Pack().admit(waiting, budget(None, max_seqs=2), ctx())) == [0, 1]


@pytest.mark.parametrize("round_index, expected", [(1, [1, 2]), (2, [1, 2]), (3, [0])])
def test_force_fifo_admits_fifo_every_nth_round(round_index: int, expected: list[int]) -> None:
    options = PolicyOptions(force_fifo_every=3)
    policy = ForceFifo(Pack(options), options)
    waiting = seqs(100, 2, 2)
    assert ids(policy.admit(waiting, budget(4), ctx(admission_round=round_index))) == expected


def test_orderings() -> None:
    assert PrefillFirst().order(ctx()) == PREFILL_FIRST
    assert DecodeFirst().order(ctx()) == DECODE_FIRST


def test_every_declared_fixed_order_is_what_order_answers() -> None:
    registry = load_registry()
    declared = 0
    for name in registry.loop_orders:
        ordering = registry.loop_order(name)(PolicyOptions())
        if ordering.fixed_order is not None:
            declared += 1
            for round_index in (1, 2, 7):
                assert ordering.order(ctx(admission_round=round_index)) == ordering.fixed_order
    assert declared >= 4  # the built-ins: prefill-first, decode-first, mixed, prefill-priority


class _DeclaredDecodeFirst(AdmissionPolicy):
    """decode-first by declaration only: ``order`` must never be called."""

    name = "declared-decode-first"
    fixed_order = DECODE_FIRST

    def order(self, ctx):  # type: ignore[no-untyped-def]
        raise AssertionError("order() called although fixed_order is declared")


def test_a_declared_fixed_order_runs_as_order_would(registry) -> None:
    reqs = [req(i, 3 + i % 4, 2 + i % 3, arrival=0.5 * i) for i in range(12)]
    by_order = drive_unit_steps(make_scheduler(registry, loop_order="decode-first"), reqs)
    config = make_scheduler(registry, loop_order="decode-first").config
    policy = ComposedPolicy(registry.make("fifo", "prefill-first", PolicyOptions()).admission,
                            _DeclaredDecodeFirst(), ("test", "test"))  # fmt: skip
    by_declaration = drive_unit_steps(Scheduler(config, policy, "declared"), reqs)
    columns = ["request_id", "first_token_s", "finish_s", "num_output_tokens"]
    assert by_declaration[columns].equals(by_order[columns])


@pytest.mark.parametrize("declared", [(), ("prefill",), [Phase.DECODE, 2]])
def test_a_bad_fixed_order_is_refused_when_the_scheduler_starts(registry, declared) -> None:
    bad = type("Bad", (_DeclaredDecodeFirst,), {"fixed_order": declared})
    policy = ComposedPolicy(registry.make("fifo", "prefill-first", PolicyOptions()).admission,
                            bad(), ("test", "test"))  # fmt: skip
    config = make_scheduler(registry).config
    with pytest.raises(PolicyError, match="loop order of policy 'bad' declares"):
        Scheduler(config, policy, "bad")


@pytest.mark.parametrize("free_seats, expected_victims", [(1, []), (0, [2])])
def test_preempt_for_ranks_the_running_set_only_when_room_is_short(
    free_seats, expected_victims
) -> None:
    """Requests are ranked (the running set sorted) only once a waiting request
    lacks a seat or blocks; with room for every waiting request nobody is ranked."""
    import dataclasses

    from roseinfer.policies.ranked import preempt_for

    running, waiting = seqs(5, 6, 7), seqs(1)
    waiting[0].seq_id = 9
    ranked: list[int] = []

    def key(seq):
        ranked.append(seq.seq_id)
        return (seq.num_tokens, seq.seq_id)

    context = dataclasses.replace(ctx(), running=running, free_seats=free_seats,
                                  num_free_blocks=100, max_num_seqs=4)  # fmt: skip
    victims = preempt_for(waiting, context, key, lambda a, b: key(a) < key(b))
    assert [v.seq_id for v in victims] == expected_victims
    assert set(ranked) == (set() if free_seats else {0, 1, 2, 9})
