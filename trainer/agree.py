"""The ranks agree on the one checkpoint step they all resume from.

Every rank must resume from the same step. Each proposes its newest readable checkpoint (the
checkpointer looks in the local tier, else the shared tier); the group takes the minimum, every rank
loads that step and checks its whole state tree (trainer/validate.py), and the group votes: all
usable, done; any rank that cannot read it or finds it malformed, everyone tries older steps; a
checkpoint of a newer format, or one that does not fit this run, stops the whole group.

The steps the group judged malformed are collected (`rejected`): when none is usable and no peer has a state
to send either, the caller stops (`all_rejected`, StateMismatchError naming them) rather than starting over, whose
first save would remove them. Every step judged malformed is more likely this run's code changed than damage
(damaged bytes fail their checksums before this judgment), and a start over from step 0 had thrown a whole run away
for an optimizer's `fused=True`.

A sharded run passes `into` (its own state tree: the layout its DTensors are restored into). A
sharded tensor whose saved global shape differs from this run's (ckpt's ShardMismatchError) does not
fit this run: StateMismatchError on every rank.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from ckpt import Checkpointer, CheckpointVersionError, Restored, ShardMismatchError
from core.events import emit
from trainer.errors import InvalidStateError, StateMismatchError
from trainer.topology import Topology

log = logging.getLogger(__name__)

# all_min votes on a checkpoint; the smallest wins.
USABLE = 1
UNREADABLE = 0  # this rank cannot read it: try an older step
MALFORMED = -1  # its state is malformed (trainer/validate.py): try an older step, never start over for it
NEWER_FORMAT = -2  # written by a newer elastic-train: stop
MISMATCH = -3  # does not fit this run's model, optimizer or data settings: stop

Check = Callable[[Restored], None]
"""Raises InvalidStateError (malformed) or StateMismatchError (does not fit this run)."""


def agree_on_checkpoint(checkpointer: Checkpointer, topology: Topology, check: Check, *,
                        where: str, into: Mapping[str, Any] | None = None,
                        rejected: dict[int, Exception | None] | None = None) -> Restored | None:
    """The checkpoint every rank loaded and found usable, or None when the group has none.

    `where` names the checkpoint directory in errors; `into` goes to `Checkpointer.restore`; `rejected` gets the
    steps the group judged malformed (the same steps on every rank), with this rank's reason. Raises
    StateMismatchError or CheckpointVersionError (on every rank) as the module docstring says."""
    cap: int | None = None
    rejected = {} if rejected is None else rejected
    while True:
        found, problem = _load(checkpointer, max_step=cap, into=into)
        mine = found.step if found is not None else -1
        agreed = topology.all_min(_first_vote(problem, mine))
        if agreed == MISMATCH:
            raise _mismatch(problem, where, cap)
        if agreed == NEWER_FORMAT:
            raise _newer(problem, where)
        if agreed < 0:
            return None
        if agreed != mine:
            found, problem = _load(checkpointer, step=agreed, into=into)
        vote, error = _judge(found, problem, check)
        verdict = topology.all_min(vote)
        if verdict == NEWER_FORMAT:
            raise _newer(error, where)
        if verdict == MISMATCH:
            if isinstance(error, StateMismatchError):
                raise error
            raise StateMismatchError(f"another rank found that step {agreed} in {where} does not fit its model, "
                                     "optimizer or data settings; its log says what differs")
        if verdict == USABLE:
            assert found is not None
            return found
        if verdict == MALFORMED:
            rejected[agreed] = error
        if agreed == 0:  # nothing older than a step-0 checkpoint (restore(max_step=-1) is no question to ask)
            return None
        cap = agreed - 1


Problem = CheckpointVersionError | ShardMismatchError


def _load(checkpointer: Checkpointer, *, step: int | None = None, max_step: int | None = None,
          into: Mapping[str, Any] | None = None) -> tuple[Restored | None, Problem | None]:
    try:
        # Not copied out of tier 0: the trainer copies the state into its model and optimizer at once (Resumable).
        if into is not None:  # only a sharded run passes it
            return checkpointer.restore(step=step, max_step=max_step, into=into, detach=False, if_unsure="none"), None
        if step is not None:
            return checkpointer.restore(step=step, detach=False, if_unsure="none"), None
        return checkpointer.restore(max_step=max_step, detach=False, if_unsure="none"), None
    except (CheckpointVersionError, ShardMismatchError) as exc:
        return None, exc


def _first_vote(problem: Problem | None, mine: int) -> int:
    if isinstance(problem, ShardMismatchError):
        return MISMATCH
    return NEWER_FORMAT if problem is not None else mine


def _mismatch(problem: Exception | None, where: str, cap: int | None) -> StateMismatchError:
    which = f"the newest checkpoint in {where}" + (f" at or below step {cap}" if cap is not None else "")
    if isinstance(problem, ShardMismatchError):
        error = StateMismatchError(f"{which} does not fit this run's model: {problem}. Resume with the same model "
                                   "sizes, or start from a fresh --ckpt-dir")
    else:
        error = StateMismatchError(f"another rank found that {which} does not fit its model (a sharded tensor of "
                                   "another global shape); its error says which")
    error.__cause__ = problem
    return error


def _judge(found: Restored | None, problem: Exception | None, check: Check) -> tuple[int, Exception | None]:
    """This rank's vote on the loaded checkpoint `found`, and the error behind it."""
    if isinstance(problem, CheckpointVersionError):
        return NEWER_FORMAT, problem
    if isinstance(problem, ShardMismatchError):
        return MISMATCH, _mismatch(problem, "the checkpoint directory", None)
    if found is None:
        return UNREADABLE, None
    try:
        check(found)
    except InvalidStateError as exc:
        log.warning("skipping checkpoint step %d: the %s copy %s holds a malformed state (damaged or not "
                    "written by elastic-train): %s; trying an older step", found.step, found.tier, found.path, exc)
        emit("ckpt_skipped", step=found.step, reason=f"malformed state in the {found.tier} copy {found.path}: {exc}")
        return MALFORMED, exc
    except StateMismatchError as exc:
        return MISMATCH, exc
    return USABLE, None


def all_rejected(rejected: dict[int, Exception | None], where: str) -> StateMismatchError:
    """The error of a group that judged `rejected` malformed and found no state to go on from."""
    steps = sorted(rejected, reverse=True)
    why = "; ".join(f"step {s}: {rejected[s]}" for s in steps[:3] if rejected[s] is not None) or \
        "another rank's log says why"
    return StateMismatchError(
        f"no checkpoint in {where} can be resumed: step{'s' if len(steps) > 1 else ''} "
        f"{', '.join(map(str, steps))} {'were' if len(steps) > 1 else 'was'} judged malformed ({why}). Nothing was "
        "loaded and nothing is removed. If this run's code changed since they were written (the optimizer, its "
        "options, the scheduler), run it as it was to resume; to start over instead, move that directory away or "
        "use a fresh --ckpt-dir")


def _newer(exc: Exception | None, where: str) -> CheckpointVersionError:
    # Falling back to an older step would silently throw away the newer run's progress.
    what = str(exc) if exc else "another rank found a checkpoint written by a newer elastic-train"
    error = CheckpointVersionError(
        f"cannot resume from {where}: {what}. Older checkpoints are not used in its place: "
        "run a newer elastic-train, or start from a fresh checkpoint directory",
        path=exc.path if isinstance(exc, CheckpointVersionError) else where)
    error.__cause__ = exc
    return error
