"""The catch-up decision of an in-process re-formation (trainer/regroup.py), against a fake group.

The fake answers the two collectives `catch_up` makes (all_gather of the live steps, all_min of the
votes) as the whole group would; the real thing over gloo, with real kills, is
tests/integration/test_reform.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from ckpt import Restored
from trainer import regroup
from trainer.topology import Topology


class Group(Topology):
    """Rank `rank` of a group whose other ranks' answers are given."""

    def __init__(self, rank: int, live: list[int], votes: list[list[int]]) -> None:
        super().__init__(rank=rank, world_size=len(live), local_rank=0)
        object.__setattr__(self, "_live", live)
        object.__setattr__(self, "_votes", votes)  # the other ranks' votes, one list per round

    def all_gather(self, value: int) -> list[int]:
        live = list(self._live)  # type: ignore[attr-defined]
        assert live[self.rank] == value
        return live

    def all_min(self, value: int) -> int:
        others = self._votes.pop(0)  # type: ignore[attr-defined]
        return min([value, *others])


def own(step: int) -> Restored:
    return Restored(step=step, state={"step": step}, rank=0, own=True, tier="memory", path=f"/shm/{step}")


def run(group: Group, parts: Mapping[int, Restored]) -> tuple[tuple[int, str] | None, list[int]]:
    applied: list[int] = []

    def apply_peer(_: Mapping[str, Any]) -> None:
        raise AssertionError("no transfer expected")

    caught = regroup.catch_up(group, group._live[group.rank],  # type: ignore[attr-defined]
                              load_own=parts.get, apply_own=lambda r: applied.append(r.step),
                              state=dict, apply_peer=apply_peer, has_own=lambda: bool(parts))
    return caught, applied


def test_no_live_state_anywhere_means_a_restore_from_checkpoints() -> None:
    assert run(Group(0, [-1, -1], []), {}) == (None, [])


def test_everyone_live_at_the_same_step_goes_on_from_memory() -> None:
    assert run(Group(1, [7, 7, 7], []), {}) == ((7, "memory"), [])


def test_a_replaced_rank_with_its_own_snapshot_at_the_newest_step_loads_it_and_survivors_keep_memory() -> None:
    assert run(Group(1, [7, -1], [[2]]), {7: own(7)}) == ((7, "own"), [7])
    assert run(Group(0, [7, -1], [[2]]), {}) == ((7, "memory"), [])


def test_one_step_back_when_the_replaced_rank_only_has_the_step_before() -> None:
    # The newest (7) fails the vote (rank 1 lacks it); at 6 every rank has its own part: survivors reload it.
    assert run(Group(0, [7, -1], [[0], [2]]), {6: own(6)}) == ((6, "own"), [6])
    assert run(Group(1, [7, -1], [[2], [2]]), {6: own(6)}) == ((6, "own"), [6])


def test_survivors_one_step_apart_go_on_exactly_from_the_step_both_completed() -> None:
    # A peer died between the two survivors' ends of step 7's last collective: it completed for rank 0, failed for
    # rank 1 (live at 6). Rank 1 has no part of 7; rank 0 goes back to its own snapshot of 6 (exact RNG streams),
    # rank 1 keeps its memory: the group recomputes nothing it had completed together.
    assert run(Group(0, [7, 6], [[0], [2]]), {6: own(6)}) == ((6, "own"), [6])
    assert run(Group(1, [7, 6], [[2], [2]]), {}) == ((6, "memory"), [])


def test_without_an_exact_step_a_peer_sends_the_newest(monkeypatch: pytest.MonkeyPatch) -> None:
    # Rank 1 is fresh and holds only rank 0's part (not its own): no exact step; rank 0 (live at 7) sends.
    sent: list[int] = []
    monkeypatch.setattr(regroup, "broadcast_state", lambda state, source, topology: sent.append(source) or
                        {"step": 7})
    received: list[Mapping[str, Any]] = []
    not_own = Restored(step=7, state={}, rank=0, own=False, tier="local", path="/ckpt/7/rank0")
    caught = regroup.catch_up(Group(1, [7, -1], [[2]]), -1, load_own={7: not_own}.get,
                              apply_own=lambda r: None, state=dict, apply_peer=received.append)
    assert caught == (7, "peer") and sent == [0] and received == [{"step": 7}]


def test_survivors_one_step_apart_with_a_joiner_go_on_exactly_and_the_joiner_takes_a_peers_state(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # As above, with a new node's rank 2 in the round (nothing live, no part of its own: it can never be exact).
    # The survivors still go on exactly from step 6 (rank 0 from its own snapshot, rank 1 from memory), and rank 1,
    # which holds 6 in memory, sends it to the joiner: not step 7 with rank 1's RNG streams derived (seen in
    # test_reform.py's spare scenario when the kill fell between the survivors' ends of a step).
    sent: list[int] = []
    monkeypatch.setattr(regroup, "broadcast_state", lambda state, source, topology: sent.append(source) or
                        {"step": 6})
    received: list[Mapping[str, Any]] = []
    applied: list[int] = []

    def catch_up(rank: int, votes: list[list[int]], parts: Mapping[int, Restored]) -> tuple[int, str] | None:
        group = Group(rank, [7, 6, -1], votes)
        return regroup.catch_up(group, group._live[rank], load_own=parts.get,  # type: ignore[attr-defined]
                                apply_own=lambda r: applied.append(r.step), state=dict, apply_peer=received.append,
                                has_own=lambda: bool(parts))

    assert catch_up(0, [[0, 1], [2, 1]], {6: own(6)}) == (6, "own") and applied == [6]
    assert catch_up(1, [[2, 1], [2, 1]], {}) == (6, "memory")
    assert catch_up(2, [[2, 0], [2, 2]], {}) == (6, "peer") and received == [{"step": 6}]
    assert sent == [1, 1, 1]  # every rank entered the same broadcast, from rank 1
    assert catch_up(2, [[2, 2], [2, 2]], {}) == (7, "peer")  # both survivors at 7: the newest, nothing recomputed


def test_a_rank_with_an_older_checkpoint_of_its_own_makes_the_group_restore_exactly() -> None:
    # Rank 1 has neither 7 nor 6 of its own, but an older part (say step 5): everyone goes back to the
    # checkpoints, as a restart would, rather than take rank 0's state with derived RNG streams.
    caught = regroup.catch_up(Group(1, [7, -1], [[1], [1], [1]]), -1, load_own={}.get, apply_own=lambda r: None,
                              state=dict, apply_peer=lambda s: None, has_own=lambda: True)
    assert caught is None


def test_a_join_after_a_failed_one_names_its_group_as_a_fresh_worker_does(monkeypatch: pytest.MonkeyPatch) -> None:
    # A kept worker's join of round N fails (the round is abandoned for a newer one while it connects); it joins
    # round N+1, whose fresh workers (env://) name their default group "0": so must it, or their gloo keys never meet.
    from datetime import timedelta

    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):  # join_round sets them: undone after the test
        monkeypatch.setenv(name, "")  # recorded (an absent variable delenv'd is not), so its absence comes back
        monkeypatch.delenv(name)

    import torch.distributed as dist

    from elastic.reform import Round

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    assert not dist.is_initialized()
    try:
        with pytest.raises(Exception):  # noqa: B017 - whatever gloo raises when its peer never comes
            regroup.join_round(Round(2, 0, 2, "127.0.0.1", server.port), backend="gloo", timeout=timedelta(seconds=1))
        assert not dist.is_initialized()
        regroup.join_round(Round(3, 0, 1, "127.0.0.1", server.port), backend="gloo", timeout=timedelta(seconds=5))
        assert dist.distributed_c10d._get_default_group().group_name == "0"
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
