"""Typed errors of the trainer package."""

from __future__ import annotations


class TrainerError(Exception):
    """Base class for errors raised by `trainer`."""


class StateMismatchError(TrainerError, ValueError):
    """A checkpoint does not fit the model, optimizer or data being resumed; the message lists what differs."""


class InvalidStateError(TrainerError, ValueError):
    """A checkpoint's state tree is malformed (damaged or crafted): not what `Resumable` writes.

    `Resumable.restore` treats it like a damaged file: it warns, naming the checkpoint, and falls
    back to an older step; when none is usable and no rank has a state to send, it raises StateMismatchError
    naming the steps rather than starting over (trainer/agree.py). The message names the entry at fault.
    """


class RoundChanged(TrainerError):
    """The agent published a new rendezvous round: this worker re-forms in place (`Resumable.reform`)
    before its next step. Raised at a step boundary, caught by the loop like a failed step."""


class StateUnreachableError(TrainerError):
    """Some rank of a sharded run holds checkpoints, but no step can be read by every rank (a new or empty node
    without a shared tier): starting over from step 0 would throw that state away, so the run stops instead."""


class UsageError(TrainerError, RuntimeError):
    """`Resumable` called out of order: a step count that is not the next one, a save before `restore()`, a call
    after `close()`. Refused before anything is written: such a checkpoint would record a state its step does not
    match, and a restart would refuse it (and overwrite it, starting over). The message says the call expected."""


class ExtrasError(TrainerError, ValueError):
    """`extras` holds what a checkpoint cannot carry as it is (JSON with str keys); the message names the entry."""


class StaleIteratorError(TrainerError, RuntimeError):
    """A data iterator made before a restore or a re-formation moved the data position: it would replay or skip
    samples. Make the iterator after `Resumable.restore()` (and anew after a re-formation)."""
