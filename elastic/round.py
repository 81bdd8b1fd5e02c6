"""The rendezvous protocol as a pure state machine: given the shared round state and what this node
knows, decide the next move. No I/O here; `elastic/rendezvous.py` does the reads, the
compare-and-set writes and the waiting.

Shared state (one JSON document per run, written only by compare-and-set on its mod_revision):

    generation    round number, +1 for every new round
    status        "joining" (nodes may join) or "closed" (ranks fixed, the round runs)
    participants  node ids; join order while joining, rank order once closed
    previous      rank order of the last closed round, so survivors keep their relative order
    acked         participants of a closed round that have taken their rank in it
    shutdown      the job ended: every further rendezvous fails with a closed error; only a member of
                  the newest round whose workers succeeded sets it (see `may_close`)
    nnodes        (min, max) of the job that created the run: an agent launched with other
                  --nnodes under the same run id is a different job and is refused

Rules:
- A round closes as soon as every live registered node has joined and there are >= min nodes, or
  at once when it reaches max nodes. Membership is known, so there is no fixed last-call wait;
  the last-call timeout only bounds a live node that never joins.
- Participants whose lease expired are dropped from a joining round.
- A node that arrives while a full round runs with all its members alive waits as a spare.
- No new round opens until every live participant of the closed round has taken its rank (acked).
  Without this, a participant whose watch was a moment late would only ever see the newer round,
  while its peers wait for it in the closed round's store until the store timeout.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from typing import Literal


@dataclass(frozen=True)
class RoundState:
    generation: int
    status: Literal["joining", "closed"]
    participants: tuple[str, ...]
    previous: tuple[str, ...] = ()
    shutdown: bool = False
    acked: tuple[str, ...] = ()
    nnodes: tuple[int, int] | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @staticmethod
    def from_json(raw: str | bytes) -> RoundState:
        """Parse a state document. Raises ValueError saying what is wrong with it (never KeyError/TypeError)."""
        try:
            doc = json.loads(raw)
        except ValueError as exc:  # also UnicodeDecodeError
            raise ValueError(f"not JSON ({exc})") from None
        if not isinstance(doc, dict):
            raise ValueError(f"expected a JSON object, got {type(doc).__name__}")
        generation = doc.get("generation")
        if type(generation) is not int or generation < 0:
            raise ValueError(f"generation must be a non-negative integer, got {generation!r}")
        status = doc.get("status")
        if status not in ("joining", "closed"):
            raise ValueError(f"status must be 'joining' or 'closed', got {status!r}")
        shutdown = doc.get("shutdown", False)
        if type(shutdown) is not bool:
            raise ValueError(f"shutdown must be true or false, got {shutdown!r}")
        nnodes = doc.get("nnodes")
        if nnodes is not None and not (
            isinstance(nnodes, list)
            and len(nnodes) == 2
            and all(type(n) is int for n in nnodes)
            and 0 < nnodes[0] <= nnodes[1]
        ):
            raise ValueError(f"nnodes must be [min, max] with 0 < min <= max, got {nnodes!r}")
        return RoundState(
            generation=generation,
            status=status,
            participants=_node_ids(doc, "participants", required=True),
            previous=_node_ids(doc, "previous"),
            shutdown=shutdown,
            nnodes=(nnodes[0], nnodes[1]) if nnodes else None,
            acked=_node_ids(doc, "acked"),
        )


def _node_ids(doc: dict[str, object], name: str, required: bool = False) -> tuple[str, ...]:
    if name not in doc and not required:
        return ()
    value = doc.get(name)
    if not isinstance(value, list) or not all(isinstance(n, str) and n for n in value):
        raise ValueError(f"{name} must be a list of node ids, got {value!r}")
    return tuple(value)


@dataclass(frozen=True)
class Wait:
    """Nothing to do until the state or the membership changes (or the last call expires)."""

    reason: str
    last_call_armed: bool = False


@dataclass(frozen=True)
class Write:
    """Compare-and-set the shared state to `state`."""

    state: RoundState
    why: str


@dataclass(frozen=True)
class Done:
    """This node is rank `rank` of a closed round of `world_size` nodes."""

    generation: int
    rank: int
    world_size: int
    participants: tuple[str, ...] = field(default=())


@dataclass(frozen=True)
class Closed:
    """The job was shut down; no further rounds."""


@dataclass(frozen=True)
class Conflict:
    """The run id belongs to a job launched with other settings."""

    reason: str


Decision = Wait | Write | Done | Closed | Conflict


@dataclass(frozen=True, kw_only=True)
class Knowledge:
    """What this node knows besides the shared state."""

    node_id: str
    live: frozenset[str]
    """Nodes whose lease is alive (includes this node once registered)."""
    min_nodes: int
    max_nodes: int
    completed_generation: int
    """The last generation this node ran in (0 if none): a closed round at or below it is stale."""
    last_call_expired: bool = False
    """The last-call timer, armed when >= min nodes joined, has run out."""


def rank_order(participants: tuple[str, ...], previous: tuple[str, ...]) -> tuple[str, ...]:
    """Survivors of the previous round keep their relative order; newcomers follow in join order."""
    position = {node: i for i, node in enumerate(previous)}
    joined = {node: i for i, node in enumerate(participants)}
    return tuple(sorted(participants, key=lambda n: (position.get(n, len(previous)), joined[n])))


def _close(state: RoundState, participants: tuple[str, ...], why: str, me: str) -> Write:
    # The closing node takes its rank in the same write.
    return Write(
        replace(state, status="closed", participants=rank_order(participants, state.previous), acked=(me,)), why
    )


def decide(state: RoundState | None, k: Knowledge) -> Decision:
    """The next move of node `k.node_id` given the shared `state` (None: no round yet)."""
    me = k.node_id
    nnodes = (k.min_nodes, k.max_nodes)
    if state is None:
        # Past the rounds this node ran: a run's state is only missing at its start, or after etcd lost its
        # data (restarted empty). A round numbered from 1 again would be at or below the running nodes'
        # completed_generation, stale to them, and the next restart would wait on it until join_timeout.
        first = RoundState(generation=k.completed_generation + 1, status="joining", participants=(me,), nnodes=nnodes)
        if k.max_nodes == 1:
            return _close(first, first.participants, "first round, max 1 node", me)
        return Write(first, "open the first round" if first.generation == 1 else
                     f"open round {first.generation}: the run's state is gone from etcd (restarted without its data?)")
    if state.shutdown:
        return Closed()
    if state.nnodes is not None and state.nnodes != nnodes:
        return Conflict(f"the run is in use by a job with --nnodes {state.nnodes[0]}:{state.nnodes[1]}, "
                        f"this agent has --nnodes {nnodes[0]}:{nnodes[1]}")

    if state.status == "closed":
        # Done comes from the node's own write (see `taken`). A round that already holds this
        # node's ack, read later, was taken by an earlier incarnation of the node: it is stale.
        if me in state.participants and me not in state.acked and state.generation > k.completed_generation:
            rank = state.participants.index(me)
            return Write(replace(state, acked=(*state.acked, me)), f"take rank {rank} in round {state.generation}")
        pending = [p for p in state.participants if p in k.live and p not in state.acked and p != me]
        if pending:
            return Wait(f"round {state.generation} is starting: waiting for {pending} to take their ranks")
        running_full = len(state.participants) >= k.max_nodes and all(p in k.live for p in state.participants)
        if running_full and me not in state.participants:
            return Wait(f"round {state.generation} is full ({k.max_nodes} nodes) and healthy; waiting as a spare")
        # Past this node's own rounds too: a round a newcomer opened after etcd lost its data can be numbered
        # at or below them.
        nxt = RoundState(generation=max(state.generation, k.completed_generation) + 1, status="joining",
                         participants=(me,), previous=state.participants, nnodes=nnodes)
        if k.max_nodes == 1:
            return _close(nxt, nxt.participants, f"round {nxt.generation} with max 1 node", me)
        return Write(nxt, f"open round {nxt.generation} after round {state.generation}")

    # status == "joining"
    if state.generation <= k.completed_generation:
        # Opened at or below the rounds this node ran: by a node that ran none (a spare, a replacement) after etcd
        # lost its data. Its ranks would be taken for stale by the running nodes; with MIN 1 its opener could
        # close it alone, at last call, and train beside them. Renumbered past them, it is the next round of all.
        return Write(replace(state, generation=k.completed_generation + 1),
                     f"renumber round {state.generation} as {k.completed_generation + 1}: it was opened below the "
                     "rounds this node ran (etcd lost the run's state?)")
    alive = tuple(p for p in state.participants if p in k.live or p == me)
    if alive != state.participants:
        gone = sorted(set(state.participants) - set(alive))
        return Write(replace(state, participants=alive), f"drop {gone} from round {state.generation}: lease expired")
    if me not in state.participants:
        if len(state.participants) >= k.max_nodes:
            return Wait(f"round {state.generation} already has max {k.max_nodes} nodes; waiting as a spare")
        joined = (*state.participants, me)
        if len(joined) >= k.max_nodes:
            return _close(state, joined, f"join round {state.generation} and close it at max {k.max_nodes}", me)
        return Write(replace(state, participants=joined), f"join round {state.generation}")
    n = len(state.participants)
    if n < k.min_nodes:
        return Wait(f"round {state.generation} has {n} of min {k.min_nodes} nodes")
    missing = sorted(k.live - set(state.participants))
    if not missing:
        return _close(state, state.participants, f"all {n} live nodes joined round {state.generation}", me)
    if k.last_call_expired:
        return _close(
            state, state.participants, f"last call expired; closing round {state.generation} without {missing}", me
        )
    return Wait(f"round {state.generation}: waiting for live nodes {missing}", last_call_armed=True)


def taken(state: RoundState, me: str) -> Done | None:
    """`Done` if node `me`, by writing `state`, took its rank in that closed round.

    A node that took its rank must run that round even if the state moves on before it reads it
    again (a newcomer may open the next round as soon as every member took its rank): its peers
    already count on it.
    """
    if state.status == "closed" and me in state.acked and me in state.participants:
        return Done(state.generation, state.participants.index(me), len(state.participants), state.participants)
    return None


def nodes_waiting(state: RoundState | None, k: Knowledge, my_round: tuple[str, ...]) -> int:
    """For a node running round `k.completed_generation`: how many reasons there are to re-rendezvous now.

    Counts nodes waiting in a newer round (a newer closed round without us counts once: we must
    rejoin), or in a round that is neither ours nor newer (opened after etcd lost the run's state),
    plus members of our round whose lease expired (their peers would otherwise hang in a collective
    until its timeout). With no readable state (`None`) only the lost members count.
    """
    if state is not None and state.shutdown:
        return 0
    waiting = 0
    # Our round, or the joining state our own write closed it from (a view not yet past that write): a subset.
    ours = state is not None and state.generation == k.completed_generation and set(state.participants) <= set(my_round)
    if state is not None and not ours:
        # A newer round, or one that is neither ours nor newer: opened after etcd lost the run's state (a node that
        # ran none numbers it from 1), or a state restored from an older backup. Ignored, the latter could form a
        # second job beside ours; we re-rendezvous and renumber it past our rounds (`decide`).
        waiting = len(state.participants) if state.status == "joining" else 1
    lost = [p for p in my_round if p not in k.live]
    return waiting + len(lost)


def may_close(state: RoundState | None, me: str, completed_generation: int) -> bool:
    """Whether node `me`, whose workers finished the job in round `completed_generation`, may close the run.

    Only a member of the run's newest round may: that round is the one it ran, or the joining round
    opened right after it (a peer or a spare moved on first; `previous` holds the ranks of our round).
    A node that never took a rank (refused, a duplicate node id, a spare, timed out) has
    `completed_generation` 0 and never closes the run, nor does a member of an older round.
    """
    if state is None or state.shutdown or completed_generation <= 0:
        return False
    if state.status == "closed":
        return state.generation == completed_generation and me in state.participants
    return state.generation == completed_generation + 1 and me in state.previous
