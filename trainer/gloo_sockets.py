"""Failing a gloo group's collectives in flight when this rank leaves it (trainer/regroup.py).

Gloo has no way to fail a collective in progress from its own side: `abort()` and `shutdown()` leave
it waiting, and `destroy_process_group` waits for gloo's worker threads, so for the collective to end
(torch 2.13). Only the sockets closing ends it. Two survivors of a lost peer can each hold a collective
that waits on the other (one's bucket all-reduce failed on the dead peer's connection before it sent
the other its part, and the other's likewise): both then wait in `destroy_process_group` until the
group's timeout (30 min by default), miss the agent's leave deadline and are restarted.

So every gloo group's sockets are noted when it is created (the sockets that appear while torch builds
the backend: its listener and one connection per peer; the store's connection exists before), and
`fail_in_flight` shuts the connections down (`shutdown(2)` on a duplicate descriptor: gloo still owns and closes
its own) when the rank leaves: its own collectives in flight fail at once, and so do its peers' that wait on it.
Each duplicate is checked against the socket's inode first, so a descriptor number reused since is never touched.

`shut_down` serves trainer/regroup.py's join too: a newer round shuts down the connection to the store of
the round being joined, so a join waiting there for a peer that is gone ends at once.

`record_new_groups` hooks torch's process-group constructor once per process; `import trainer` calls it,
before the user's script creates its group. A group created before that is not noted, and leaving it
behaves as before (the agent's leave deadline restarts a worker stuck there).
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import threading
from typing import Any

import torch.distributed as dist

log = logging.getLogger(__name__)

_lock = threading.Lock()
_noted: list[tuple[int, int]] = []
"""(descriptor, socket inode) of every gloo group created since the last `fail_in_flight`."""
_installed = False


def record_new_groups() -> None:
    """Note the sockets of every process group created from now on (idempotent)."""
    global _installed
    if _installed or not dist.is_available():
        return
    c10d = dist.distributed_c10d
    create = c10d._new_process_group_helper

    @functools.wraps(create)
    def noting(*args: Any, **kwargs: Any) -> Any:
        before = sockets()
        made = create(*args, **kwargs)
        new = opened_since(before)
        with _lock:
            _noted.extend(new)
        return made

    c10d._new_process_group_helper = noting
    _installed = True


def fail_in_flight() -> int:
    """Shut down the noted sockets still open; returns how many. Call only when leaving every group."""
    with _lock:
        noted, _noted[:] = list(_noted), []
    return shut_down(noted)


def shut_down(noted: list[tuple[int, int]]) -> int:
    """Shut down the connections among `noted` (descriptor, inode) that are still open; returns how many.

    Through a duplicate: the owner's thread (gloo's, a store's) closes a connection whose peer went away at any
    moment, and its number may be reused at once; the duplicate holds the socket it names while it is checked."""
    done = 0
    for fd, inode in noted:
        try:
            mine = os.dup(fd)
        except OSError:
            continue  # closed with its group
        try:
            if os.fstat(mine).st_ino != inode:
                continue  # the number now names something else
            with socket.socket(fileno=os.dup(mine)) as sock:  # closes its own duplicate, never the owner's
                # Not a listener: gloo's accept() then fails an enforce and the process aborts.
                if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    sock.shutdown(socket.SHUT_RDWR)
                    done += 1
        except OSError as exc:  # a connection the peer closed already
            log.debug("shutdown of socket %d: %s", fd, exc)
        finally:
            os.close(mine)
    return done


def opened_since(before: dict[int, int], *, peer_port: int | None = None) -> list[tuple[int, int]]:
    """(descriptor, inode) of this process's sockets that are not in `before` (a `sockets()` taken earlier); with
    `peer_port`, only connections to that port (not a socket another thread opened meanwhile)."""
    new = [(fd, inode) for fd, inode in sockets().items() if before.get(fd) != inode]
    return new if peer_port is None else [(fd, inode) for fd, inode in new if _peer_port(fd) == peer_port]


def _peer_port(fd: int) -> int | None:
    try:
        with socket.socket(fileno=os.dup(fd)) as sock:  # a duplicate: closing it leaves the owner's open
            return int(sock.getpeername()[1])
    except (OSError, IndexError, TypeError, ValueError):  # closed, not connected, or not an inet socket
        return None


def sockets() -> dict[int, int]:
    """This process's open sockets: descriptor -> inode."""
    found: dict[int, int] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:  # no procfs: nothing is noted, leaving behaves as without this module
        return found
    for name in names:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue  # closed meanwhile (or the listing's own descriptor)
        if target.startswith("socket:["):
            found[int(name)] = int(target[len("socket:["):-1])
    return found
