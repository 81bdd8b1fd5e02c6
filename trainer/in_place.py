"""In-place re-entry: a sharded run re-forms without a new process by running its training function again.

    from trainer import run_elastic

    def main() -> None:              # builds the model, shards it on a mesh, Resumable, the loop
        ...

    if __name__ == "__main__":
        run_elastic(main)

A replicated (DDP) model re-forms in place by rewrapping it on the new group (trainer/regroup.py). A
sharded one (FSDP2, tensor parallel) cannot: its parameters are laid out on the old group's mesh, and
the new world may need another layout. Under `run_elastic`, `Resumable.reform` ends the incarnation
(hooks, sample log; its checkpoint copies finished) and raises `Reentry`; `run_elastic` drops what the old
incarnation held (its frames' locals, the CUDA cache), joins the new round's process group, closes the old
checkpointer (writes and uploads in flight) and calls `main` again in this process. There
the process group is already the new round's (`dist.is_initialized()`: do not init it again), the
model is built and sharded on the new mesh, and `Resumable.restore` reshards the newest step every
rank can read: this node's tier 0 first (own snapshots, peers' replicas: memory, no disk), then tier
1 and 2. What a restart would cost beyond that (a new process, imports, the CUDA context) is not paid.

Without `run_elastic` (or outside elastic-run's in-process mode) a sharded worker is restarted on a
membership change, as before.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

import torch

from ckpt import Checkpointer
from elastic import fast_exit, reform
from elastic.errors import EXIT_BELOW_MIN
from elastic.reform import Round
from trainer import regroup
from trainer.regroup import release_frames

log = logging.getLogger(__name__)

T = TypeVar("T")


class Reentry(BaseException):  # noqa: N818 - a control-flow signal, like SystemExit: not an error
    """Raised by `Resumable.reform` for a sharded run under `run_elastic` once the agent published a new round:
    the training function ends here and runs again in the new round's group. A BaseException, so that a
    loop's `except Exception` (which hands a failed step to `reform`) does not catch it."""

    def __init__(self, started: float, closing: Checkpointer | None = None) -> None:
        super().__init__("a new round: the training function runs again in this process (trainer/in_place.py)")
        self.started = started
        self.closing = closing
        """The old incarnation's checkpointer, closed once the new group is joined: its writes and uploads in
        flight must not hold up the leave (the agent restarts a worker that has not left within 10 s)."""
        self.joined: Round | None = None
        """The round whose process group run_elastic joined."""


@dataclass
class _State:
    active: bool = False
    pending: Reentry | None = None
    """The re-entry under way, until the new incarnation's restore finishes (`take`)."""
    reentries: int = 0


_state = _State()


def active() -> bool:
    """Whether this process runs its training function under `run_elastic`."""
    return _state.active


def take() -> Reentry | None:
    """The re-entry this incarnation comes from (once): Resumable.restore reports it as a re-formation."""
    pending, _state.pending = _state.pending, None
    return pending


def run_elastic(main: Callable[[], T]) -> T:
    """Run `main`, and run it again in this process whenever a sharded run re-forms in place (see the module
    docstring); return what its last run returns. Outside elastic-run this is just `main()`."""
    if _state.active:
        raise RuntimeError("run_elastic is already running in this process: call it once, around the whole run")
    _state.active = True
    if reform.enabled():
        # What the imports made (torch's modules: most of the heap) is never collected again: a re-entry's
        # collection then scans only what main() made (on 2 cores with torch loaded: 0.16 s -> 0.03-0.04 s).
        gc.freeze()
    try:
        while True:
            try:
                result = main()
                regroup.end_without_finalization_if_kept()
                return result
            except Reentry as reentry:
                release_frames(reentry)  # the old model, optimizer and loader live in those frames' locals
                reentry.__traceback__ = None
                pending = reentry
            except SystemExit as exc:
                if not exc.code:  # a success on its way out ("" is a message: code 1)
                    regroup.end_without_finalization_if_kept(fast_exit.code_of(exc.code))
                raise
            _rejoin(pending)
            _state.pending, _state.reentries = pending, _state.reentries + 1
    finally:
        _state.active = False
        _state.pending = None


def _rejoin(reentry: Reentry) -> None:
    """Free the old incarnation, then leave its process group for the agent's newest round's."""
    # The old model (FSDP's modules and hooks, in cycles) holds the old group: while it lives, that group's
    # connections stay open and a peer still waiting on this rank in one of its collectives is not failed.
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    watcher = regroup.round_watcher()
    joined = regroup.join_next_round(watcher, None) if watcher is not None else None
    if reentry.closing is not None:  # its commits count ranks of the old world (as at a replicated re-formation)
        if not reentry.closing.close(timedelta(minutes=2), world_over=True):
            log.warning("checkpoint work left unfinished at a re-formation: %s", reentry.closing.last_error)
        reentry.closing = None
    if joined is None:
        raise RuntimeError("a re-entry in place without a round to join (the agent's round file is gone)")
    if joined.stop:  # a newer round says the job stops while this one re-entered: its saves in flight are written
        log.error("rank %s: %s; exiting with %d", os.environ.get("RANK", "?"), joined.stop, EXIT_BELOW_MIN)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_BELOW_MIN)
    reentry.joined = joined
    log.info("re-entering the training function in place (%d so far) as rank %d of %d", _state.reentries + 1,
             joined.rank, joined.world_size)
