"""Typed errors of the trainer package."""

from __future__ import annotations


class TrainerError(Exception):
    """Base class for errors raised by `trainer`."""


class StateMismatchError(TrainerError, ValueError):
    """A checkpoint does not fit the model, optimizer or data being resumed; the message lists what differs."""
