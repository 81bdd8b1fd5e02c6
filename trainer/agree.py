"""The ranks agree on the one checkpoint step they all resume from.

Every rank must resume from the same step. Each proposes its newest readable checkpoint (the
checkpointer looks in the local tier, else the shared tier); the group takes the minimum, every rank
loads that step and checks its whole state tree (trainer/validate.py), and the group votes: all
usable, done; any rank that cannot read it or finds it malformed, everyone tries older steps; a
checkpoint of a newer format, or one that does not fit this run, stops the whole group.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ckpt import Checkpointer, CheckpointVersionError, Restored
from core.events import emit
from trainer.errors import InvalidStateError, StateMismatchError
from trainer.topology import Topology

log = logging.getLogger(__name__)

# all_min votes on a checkpoint; the smallest wins.
USABLE = 1
UNREADABLE = 0  # this rank cannot read it, or its state is malformed: try an older step
NEWER_FORMAT = -2  # written by a newer elastic-train: stop
MISMATCH = -3  # does not fit this run's model, optimizer or data settings: stop

Check = Callable[[Restored], None]
"""Raises InvalidStateError (malformed) or StateMismatchError (does not fit this run)."""


def agree_on_checkpoint(checkpointer: Checkpointer, topology: Topology, check: Check, *,
                        where: str) -> Restored | None:
    """The checkpoint every rank loaded and found usable, or None when the group has none.

    `where` names the checkpoint directory in errors. Raises StateMismatchError or
    CheckpointVersionError (on every rank) as the module docstring says."""
    cap: int | None = None
    while True:
        found, problem = _load(checkpointer, max_step=cap)
        mine = found.step if found is not None else -1
        agreed = topology.all_min(NEWER_FORMAT if problem else mine)
        if agreed == NEWER_FORMAT:
            raise _newer(problem, where)
        if agreed < 0:
            return None
        if agreed != mine:
            found, problem = _load(checkpointer, step=agreed)
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
        cap = agreed - 1


def _load(checkpointer: Checkpointer, *, step: int | None = None,
          max_step: int | None = None) -> tuple[Restored | None, CheckpointVersionError | None]:
    try:
        if step is not None:
            return checkpointer.restore(step=step), None
        return checkpointer.restore(max_step=max_step), None
    except CheckpointVersionError as exc:
        return None, exc


def _judge(found: Restored | None, problem: Exception | None, check: Check) -> tuple[int, Exception | None]:
    """This rank's vote on the loaded checkpoint `found`, and the error behind it."""
    if isinstance(problem, CheckpointVersionError):
        return NEWER_FORMAT, problem
    if found is None:
        return UNREADABLE, None
    try:
        check(found)
    except InvalidStateError as exc:
        log.warning("skipping checkpoint step %d: the %s copy %s holds a malformed state (damaged or not "
                    "written by elastic-train): %s; trying an older step", found.step, found.tier, found.path, exc)
        emit("ckpt_skipped", step=found.step, reason=f"malformed state in the {found.tier} copy {found.path}: {exc}")
        return UNREADABLE, exc
    except StateMismatchError as exc:
        return MISMATCH, exc
    return USABLE, None


def _newer(exc: Exception | None, where: str) -> CheckpointVersionError:
    # Falling back to an older step would silently throw away the newer run's progress.
    what = str(exc) if exc else "another rank found a checkpoint written by a newer elastic-train"
    error = CheckpointVersionError(
        f"cannot resume from {where}: {what}. Older checkpoints are not used in its place: "
        "run a newer elastic-train, or start from a fresh checkpoint directory",
        path=exc.path if isinstance(exc, CheckpointVersionError) else where)
    error.__cause__ = exc
    return error
