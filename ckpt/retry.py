"""Bounded retries of the shared store's calls (tenacity): which errors are worth retrying, and
the message once the retries are spent."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    stop_after_delay,
    wait_exponential,
    wait_random,
)

from ckpt.config import RetryConfig
from ckpt.errors import CheckpointError, SharedStorageError
from ckpt.safe_io import run_within

logger = logging.getLogger(__name__)

T = TypeVar("T")

_PERMANENT = (
    CheckpointError,
    FileExistsError,  # e.g. a mounted store's path through a dangling link: 10 tries took 40 s at start
    FileNotFoundError,
    IsADirectoryError,
    NotADirectoryError,
    PermissionError,
    TypeError,
    ValueError,
)
"""Errors that a retry cannot fix: raised at once."""


def call_with_retries(
    what: str,
    url: str,
    retry: RetryConfig,
    stop: threading.Event,
    fn: Callable[..., T],
    *args: Any,
    bounded: bool = True,
    **kwargs: Any,
) -> T:
    """Run `fn` with bounded retries (given up early once `stop` is set); raise SharedStorageError
    once they are spent. CheckpointError and FileNotFoundError pass through unchanged.

    `bounded`: each try, too, ends by `retry.deadline` (run on a thread that is left behind if the store never
    answers: a store that takes connections and never replies held a job's start for many minutes, since the
    client's own timeouts and retries apply inside one try). Off for the transfers of whole files, whose one
    try may rightly outlast the deadline on a slow link."""
    started = time.monotonic()
    limit = retry.deadline.total_seconds()

    def sleep(seconds: float) -> None:
        stop.wait(seconds)  # close() sets `stop`: a pause between tries ends at once

    def attempt(*a: Any, **kw: Any) -> T:
        if not bounded:
            return fn(*a, **kw)
        left = limit - (time.monotonic() - started)
        if left < 0.05:  # no time for a try: not one more thread left behind
            raise TimeoutError(f"no time left of shared.retry.deadline ({limit:.1f}s) for another try")
        return run_within(lambda: fn(*a, **kw), left, name="ckpt-store-call",
                          late=f"no answer within {left:.1f}s (the rest of shared.retry.deadline)")

    retrying = Retrying(
        stop=(
            stop_after_attempt(retry.attempts)
            | stop_after_delay(retry.deadline.total_seconds())
            | (lambda _state: stop.is_set())  # type: ignore[operator]  # tenacity accepts callables
        ),
        wait=wait_exponential(multiplier=retry.initial.total_seconds(), max=retry.maximum.total_seconds())
        + wait_random(0, retry.jitter.total_seconds()),
        retry=retry_if_exception(_transient),
        sleep=sleep,
        before_sleep=lambda state: _log_retry(what, url, state),
        reraise=True,
    )
    try:
        return retrying(attempt, *args, **kwargs)
    except (CheckpointError, FileNotFoundError):
        raise
    except Exception as exc:
        tried = (f"retried up to {retry.attempts} times within {retry.deadline}" if _transient(exc)
                 else "not retried (an error no retry mends)")
        raise SharedStorageError(
            f"{what} at {url} failed ({type(exc).__name__}: {exc}); {tried}. Check that the store is "
            f"reachable, the credentials in shared.storage_options, and the local disk's free space",
        ) from exc


def _transient(exc: BaseException) -> bool:
    return not isinstance(exc, _PERMANENT)


def _log_retry(what: str, url: str, state: RetryCallState) -> None:
    exc = state.outcome.exception() if state.outcome is not None else None
    wait = state.next_action.sleep if state.next_action is not None else 0.0
    logger.warning(
        "%s at %s failed (try %d: %s: %s); retrying in %.2fs",
        what,
        url,
        state.attempt_number,
        type(exc).__name__,
        exc,
        wait,
    )
