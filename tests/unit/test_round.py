"""Unit tests of the pure rendezvous state machine in `elastic/round.py`: no etcd, no clock."""

from __future__ import annotations

import pytest

from elastic.round import (
    Closed,
    Conflict,
    Done,
    Knowledge,
    RoundState,
    Wait,
    Write,
    decide,
    may_close,
    nodes_waiting,
    rank_order,
    taken,
)

pytestmark = pytest.mark.timeout(10)


def know(
    me: str,
    live: str,
    *,
    min_nodes: int = 1,
    max_nodes: int = 4,
    completed: int = 0,
    expired: bool = False,
) -> Knowledge:
    """Knowledge of node `me`; `live` lists the live node ids as one string, e.g. "abc"."""
    return Knowledge(
        node_id=me,
        live=frozenset(live),
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        completed_generation=completed,
        last_call_expired=expired,
    )


def joining(
    participants: str, generation: int = 1, previous: str = "", nnodes: tuple[int, int] | None = None
) -> RoundState:
    return RoundState(generation, "joining", tuple(participants), tuple(previous), nnodes=nnodes)


def closed(
    participants: str,
    generation: int = 1,
    previous: str = "",
    nnodes: tuple[int, int] | None = None,
    acked: str | None = None,
) -> RoundState:
    """A closed round; by default every participant has taken its rank (the round is running)."""
    return RoundState(generation, "closed", tuple(participants), tuple(previous), nnodes=nnodes,
                      acked=tuple(participants if acked is None else acked))


def test_no_state_opens_round_one() -> None:
    decision = decide(None, know("a", "ab", min_nodes=2, max_nodes=3))
    assert isinstance(decision, Write)
    assert decision.state == joining("a", nnodes=(2, 3))


def test_no_state_with_max_one_closes_the_first_round_at_once() -> None:
    decision = decide(None, know("a", "a", min_nodes=1, max_nodes=1))
    assert isinstance(decision, Write)
    assert decision.state == closed("a", nnodes=(1, 1), acked="a")


def test_joining_round_waits_for_live_nodes_with_last_call_armed() -> None:
    decision = decide(joining("a"), know("a", "ab", min_nodes=1, max_nodes=3))
    assert isinstance(decision, Wait)
    assert decision.last_call_armed
    assert "b" in decision.reason


def test_joining_round_below_min_waits_without_last_call() -> None:
    decision = decide(joining("a"), know("a", "a", min_nodes=2, max_nodes=3))
    assert isinstance(decision, Wait)
    assert not decision.last_call_armed


def test_all_live_joined_closes_in_rank_order() -> None:
    # b and c survive from round 1 (b before c); newcomer d joined first but ranks last.
    state = joining("dcb", generation=2, previous="bac")
    decision = decide(state, know("c", "bcd", min_nodes=2, max_nodes=4, completed=1))
    assert isinstance(decision, Write)
    assert decision.state == RoundState(2, "closed", ("b", "c", "d"), ("b", "a", "c"), acked=("c",))


def test_reaching_max_closes_immediately_without_waiting_for_other_live_nodes() -> None:
    decision = decide(joining("ab"), know("c", "abcd", min_nodes=1, max_nodes=3))
    assert isinstance(decision, Write)
    assert decision.state == closed("abc", acked="c")


def test_joining_below_max_adds_me_to_the_round() -> None:
    decision = decide(joining("a"), know("b", "abc", min_nodes=1, max_nodes=3))
    assert isinstance(decision, Write)
    assert decision.state == joining("ab")


@pytest.mark.parametrize(
    "state",
    [joining("ab"), closed("ab")],
    ids=["joining-full", "closed-full-healthy"],
)
def test_node_beyond_max_waits_as_spare(state: RoundState) -> None:
    decision = decide(state, know("c", "abc", min_nodes=2, max_nodes=2))
    assert isinstance(decision, Wait)
    assert "spare" in decision.reason


def test_closed_full_round_with_a_dead_member_lets_the_spare_open_the_next_round() -> None:
    decision = decide(closed("ab"), know("c", "ac", min_nodes=2, max_nodes=2))
    assert isinstance(decision, Write)
    assert decision.state == joining("c", generation=2, previous="ab", nnodes=(2, 2))


def test_dead_participant_is_dropped_from_a_joining_round() -> None:
    decision = decide(joining("abc"), know("a", "ac", min_nodes=1, max_nodes=4))
    assert isinstance(decision, Write)
    assert decision.state == joining("ac")
    assert "b" in decision.why


def test_last_call_expired_closes_without_the_missing_live_node() -> None:
    state = joining("ab")
    assert isinstance(decide(state, know("a", "abc", min_nodes=2, max_nodes=4)), Wait)
    decision = decide(state, know("a", "abc", min_nodes=2, max_nodes=4, expired=True))
    assert isinstance(decision, Write)
    assert decision.state == closed("ab", acked="a")


def test_closed_round_i_am_in_is_taken_then_done_with_my_rank() -> None:
    state = closed("abc", generation=3, acked="a")
    take = decide(state, know("b", "abc", completed=2))
    assert isinstance(take, Write)
    assert take.state == closed("abc", generation=3, acked="ab")
    assert taken(take.state, "b") == Done(3, 1, 3, ("a", "b", "c"))


def test_no_new_round_opens_before_every_live_participant_took_its_rank() -> None:
    # c closed round 1 with a and b; b has not read it yet. d arrives: opening round 2 now would
    # leave a and c waiting for b in round 1's store, so d waits.
    state = closed("abc", acked="ac")
    decision = decide(state, know("d", "abcd", min_nodes=1, max_nodes=4))
    assert isinstance(decision, Wait)
    assert "b" in decision.reason
    # a participant that died before taking its rank does not hold the next round up
    assert isinstance(decide(state, know("d", "acd", min_nodes=1, max_nodes=4)), Write)


def test_a_node_that_took_its_rank_runs_that_round_even_if_the_state_moves_on() -> None:
    take = decide(closed("ab", acked="b"), know("a", "abc", completed=0))
    assert isinstance(take, Write)
    # Right after a's write every member has taken its rank, so c may open round 2 at once; a must
    # not re-read and follow c (b would wait for a in round 1's store): its own write says Done.
    assert taken(take.state, "a") == Done(1, 0, 2, ("a", "b"))
    assert taken(joining("ab"), "a") is None
    assert taken(closed("ab", acked="b"), "a") is None


def test_ack_from_an_earlier_incarnation_of_my_node_id_is_not_mine() -> None:
    # Node b was restarted under the same id: the rank b took in round 2 belonged to the old process.
    decision = decide(closed("ab", generation=2), know("b", "ab", min_nodes=1, max_nodes=2))
    assert isinstance(decision, Write)
    assert decision.state == joining("b", generation=3, previous="ab", nnodes=(1, 2))


def test_stale_closed_round_opens_the_next_round_with_previous_participants() -> None:
    state = closed("ab", generation=3)
    decision = decide(state, know("b", "ab", min_nodes=2, max_nodes=2, completed=3))
    assert isinstance(decision, Write)
    assert decision.state == joining("b", generation=4, previous="ab", nnodes=(2, 2))


def test_rank_order_keeps_survivors_relative_order_and_appends_newcomers() -> None:
    assert rank_order(("e", "c", "a", "d"), ("a", "b", "c")) == ("a", "c", "e", "d")
    assert rank_order(("b", "a"), ()) == ("b", "a")


@pytest.mark.parametrize(
    "state",
    [
        RoundState(2, "joining", ("a",), shutdown=True),
        RoundState(2, "closed", ("a", "b"), shutdown=True),
    ],
    ids=["joining", "closed"],
)
def test_shutdown_state_is_closed(state: RoundState) -> None:
    assert decide(state, know("a", "ab", completed=1)) == Closed()


def test_nodes_waiting_counts_newer_round_participants_and_lost_members() -> None:
    mine = ("a", "b")
    k = know("a", "abcd", completed=1)
    assert nodes_waiting(closed("ab", generation=1), k, mine) == 0
    assert nodes_waiting(joining("cd", generation=2, previous="ab"), k, mine) == 2
    # A newer closed round without us counts once: we must rejoin.
    assert nodes_waiting(closed("cd", generation=2), k, mine) == 1
    # b's lease expired: one lost member of our round.
    assert nodes_waiting(closed("ab", generation=1), know("a", "a", completed=1), mine) == 1
    assert nodes_waiting(None, k, mine) == 0


def test_nodes_waiting_is_zero_when_shut_down() -> None:
    state = RoundState(2, "joining", ("c", "d"), ("a", "b"), shutdown=True)
    assert nodes_waiting(state, know("a", "a", completed=1), ("a", "b")) == 0


def test_round_state_json_roundtrip() -> None:
    state = RoundState(7, "closed", ("n1", "n0"), ("n0", "n1", "n2"), shutdown=True)
    assert RoundState.from_json(state.to_json()) == state
    assert RoundState.from_json(state.to_json().encode()) == state
    # Older documents without the optional fields still parse.
    assert RoundState.from_json('{"generation": 1, "status": "joining", "participants": ["a"]}') == joining("a")


def test_agent_with_other_nnodes_under_the_same_run_id_is_refused() -> None:
    state = joining("a", nnodes=(2, 4))
    decision = decide(state, know("b", "ab", min_nodes=1, max_nodes=2))
    assert isinstance(decision, Conflict)
    assert "2:4" in decision.reason and "1:2" in decision.reason
    assert isinstance(decide(state, know("b", "ab", min_nodes=2, max_nodes=4)), Write)


@pytest.mark.parametrize(
    "raw",
    [
        '{"hello": 1}',
        "[1, 2]",
        "not json",
        b"\xff\xfe",
        '{"generation": "1", "status": "joining", "participants": ["a"]}',
        '{"generation": true, "status": "joining", "participants": ["a"]}',
        '{"generation": 1, "status": "open", "participants": ["a"]}',
        '{"generation": 1, "status": "joining", "participants": "ab"}',
        '{"generation": 1, "status": "joining", "participants": [1]}',
        '{"generation": 1, "status": "closed", "participants": ["a"], "acked": null}',
        '{"generation": 1, "status": "closed", "participants": ["a"], "shutdown": "yes"}',
        '{"generation": 1, "status": "closed", "participants": ["a"], "nnodes": [3, 1]}',
    ],
)
def test_malformed_state_is_a_value_error_saying_what_is_wrong(raw: str | bytes) -> None:
    with pytest.raises(ValueError) as err:
        RoundState.from_json(raw)
    assert type(err.value) in (ValueError,), "never a raw KeyError/TypeError"
    assert str(err.value)


def test_only_a_member_of_the_newest_round_may_close_the_run() -> None:
    # The round this node ran (generation 3) is the newest: it may close.
    assert may_close(closed("ab", generation=3), "a", 3)
    # A peer or spare opened the next round already; our round is its `previous`.
    assert may_close(joining("c", generation=4, previous="ab"), "a", 3)
    # Never took a rank (refused, duplicate node id, spare, timed out): completed generation 0.
    assert not may_close(closed("ab", generation=3), "a", 0)
    assert not may_close(closed("ab", generation=3), "c", 0)
    # A member of an older round, or not a member of the newest one.
    assert not may_close(closed("bc", generation=5), "a", 3)
    assert not may_close(joining("c", generation=6, previous="bc"), "a", 3)
    assert not may_close(closed("bc", generation=3), "a", 3)
    assert not may_close(None, "a", 3)
    assert not may_close(RoundState(3, "closed", ("a",), shutdown=True), "a", 3)


def test_lost_members_count_even_without_a_readable_state() -> None:
    assert nodes_waiting(None, know("a", "a", completed=2), ("a", "b")) == 1


def test_after_etcd_lost_the_runs_state_rounds_are_numbered_past_the_ones_the_nodes_ran() -> None:
    # etcd restarted without its data while the job ran round 3: a round numbered 1 again was stale to the
    # running nodes (at or below their completed generation), and the next restart waited on it until join_timeout.
    first = decide(None, know("a", "ab", min_nodes=2, max_nodes=2, completed=3))
    assert isinstance(first, Write) and first.state.generation == 4 and first.state.participants == ("a",)
    joined = decide(first.state, know("b", "ab", min_nodes=2, max_nodes=2, completed=3))
    assert isinstance(joined, Write) and joined.state.status == "closed"
    assert taken(joined.state, "b") is not None  # the other running node takes its rank in it
    # A newcomer (no rounds run) opened round 1 and closed it alone; a node that ran round 3 opens round 4.
    stale = decide(closed("c", generation=1), know("a", "ac", min_nodes=1, completed=3))
    assert isinstance(stale, Write) and stale.state.generation == 4
    assert decide(None, know("a", "a")).state.generation == 1  # type: ignore[union-attr] # a new run starts at 1


def test_a_round_a_newcomer_opened_below_the_running_ones_is_joined_and_renumbered_past_them() -> None:
    # etcd lost its data while a and b ran round 3; a spare c (no rounds run) opened round 1. The running nodes
    # ignored it, and with MIN 1 c closed it alone at last call and trained beside them: two jobs on one run.
    opened = joining("c", generation=1, nnodes=(1, 4))
    assert nodes_waiting(opened, know("a", "abc", completed=3), ("a", "b")) == 1  # a re-rendezvous now
    renumbered = decide(opened, know("a", "abc", completed=3))
    assert isinstance(renumbered, Write) and renumbered.state.generation == 4
    assert renumbered.state.participants == ("c",)
    joined = decide(renumbered.state, know("a", "abc", completed=3))
    assert isinstance(joined, Write) and joined.state.participants == ("c", "a") and joined.state.generation == 4
    # Our own round, running, is no reason to move; a newer one is, as before.
    assert nodes_waiting(closed("ab", generation=3), know("a", "abc", completed=3), ("a", "b")) == 0
    assert nodes_waiting(joining("c", generation=4), know("a", "abc", completed=3), ("a", "b")) == 1
    # The joining state our own write closed (a view not yet past it) is ours too.
    assert nodes_waiting(joining("cb", generation=3), know("a", "abc", completed=3), ("c", "b", "a")) == 0
    # An older closed round (etcd restored from a backup) is not ours either.
    assert nodes_waiting(closed("ab", generation=2), know("a", "ab", completed=3), ("a", "b")) == 1
