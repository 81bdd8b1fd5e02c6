"""A worker's traceback for a lost peer node, replaced by the agent's one line.

When a node dies, every surviving worker's next collective fails ("Connection closed by peer" from
gloo, a store connection reset, an NCCL remote error) and, a moment before its agent stops it for
the re-formation already under way, prints a traceback that looks like a crash. `install()` makes
a worker that dies of such an error wait, up to `ELASTIC_PEER_LOSS_GRACE_S` seconds, to be stopped
by its agent: an `etcd-v3` agent sees the membership change within the lease TTL, stops the group
and prints one line for it ("peer node ... lost; re-forming the group"). Waiting also keeps the
worker from being counted as failed, so stock torchrun on `etcd-v3` does not consume a restart for
a peer's loss either. If the agent does not stop the worker within the grace period, the failure
was not a membership change and the traceback is printed as usual. With LOGLEVEL=DEBUG the
full text is printed at once as well.

A KeyboardInterrupt (elastic-run forwards a Ctrl-C to its workers) is one line too, not a traceback per worker.

The agent sets `ELASTIC_PEER_LOSS_GRACE_S` only for a rendezvous that watches membership; without
it `install()` does nothing. `trainer.Resumable` installs it; other scripts may call it themselves
after `init_process_group`.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from types import TracebackType

from core.deadline import Deadline
from core.exc_chain import chain

ENV_GRACE = "ELASTIC_PEER_LOSS_GRACE_S"

# Words of the errors a collective or the store raises when the other end went away.
_PEER_GONE = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "connection refused",
    "remote process exited",
    "nccl communicator was aborted",
)


def looks_like_peer_loss(exc: BaseException) -> bool:
    """Whether `exc` (or what it was raised from) reads like a lost peer rather than a bug."""
    return any(isinstance(e, RuntimeError | ConnectionError) and any(words in str(e).lower() for words in _PEER_GONE)
               for e in chain(exc, limit=8))


def install() -> bool:
    """Hold back lost-peer and KeyboardInterrupt tracebacks of this worker (once per process). True if installed."""
    raw = os.environ.get(ENV_GRACE)
    if not raw or getattr(sys.excepthook, "_elastic_peer_loss", False):
        return False
    grace = float(raw)
    previous = sys.excepthook

    def hook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        if issubclass(kind, KeyboardInterrupt) and os.environ.get("LOGLEVEL", "").upper() != "DEBUG":
            # The agent forwards a Ctrl-C (SIGINT) to its workers, as torchrun's does, and prints one line for the
            # stop itself: a traceback from every worker would bury it. Python still exits as killed by SIGINT.
            last = traceback.extract_tb(tb)[-1:] if tb is not None else []
            at = f" in {os.path.basename(last[0].filename)}:{last[0].lineno}" if last else ""
            sys.stderr.write(f"elastic: rank {os.environ.get('RANK', '?')}: stopped by SIGINT{at}\n")
            return
        if grace > 0 and looks_like_peer_loss(exc):
            if os.environ.get("LOGLEVEL", "").upper() == "DEBUG":
                sys.stderr.write("".join(traceback.format_exception(kind, exc, tb)))
            stopped_by = Deadline.after(grace)
            while not stopped_by.expired():  # the agent stops us here when a peer was lost
                time.sleep(stopped_by.capped(0.05))
            sys.stderr.write(f"elastic: rank {os.environ.get('RANK', '?')}: the error below was not followed by a "
                             f"membership change within {grace:g}s\n")
        previous(kind, exc, tb)

    hook._elastic_peer_loss = True  # type: ignore[attr-defined]
    sys.excepthook = hook
    return True
