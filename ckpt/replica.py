"""Tier 0's peer replica: each node's newest snapshots copied to the next node(s) of the ring, over TCP.

A node's tier 0 (ckpt/tier0.py) outlives its workers but not the node. So every `replica_every` steps
the node's checkpoint helper (ckpt/helper_process.py) copies a snapshot it has just published to the
next `replicas` nodes of the round (ring order; the agent tells it who: core/replica_targets.py), and those
nodes' helpers keep it in their own tier 0:

    <tier0 dir>/peers/<source node>/rank_00003/slot_0/state.safetensors   the slot's file image
    <tier0 dir>/peers/<source node>/rank_00003/slot_0/manifest.json       the source's manifest, written last

After the source node is lost, the restore policy finds those slots with the node's own
(HostTier scans both), so the lost ranks' newest state is read from host memory, not from an older
tier-1/tier-2 step.

Sending (`ReplicaSender`): the snapshot is first copied into the sender's buffer for that rank (a memcpy,
under the slot's lock: the worker rewrites its slot two snapshots later, sooner than the network would
send it), then a thread sends it; while a rank's copy is being taken or sent, that rank's next replicated
snapshot is not taken (never queued): the one after it goes. Every connect, send and reply has a
deadline; a failed push is logged (once per target until it works again) and the next snapshot tries
again.

Receiving (`ReplicaReceiver`): one push per connection: header {"op": "replica", "node", "rank",
"step", "size", "job", "mac"}, body: the source's manifest; then `size` raw bytes. The receiver writes them into the
(node, rank)'s older slot (its manifest removed first), checks the bytes against the manifest's
checksum, and only then writes the manifest: a torn or damaged transfer leaves no manifest, and the
other slot, the previous replica, whole. Reply {"ok": true} or {"ok": false, "error"}. A manifest that
does not describe the pushed bytes (rank, step, size) is refused. The restore reads a replica as it
reads the node's own slots: verified again, and only this run's (by run name: each node's tier 1 mints its
own run uid).

Who may push: in a run with a join token every helper holds the run's replica key (elastic/admission.py) and
signs each push: `mac` is an HMAC-SHA256 of the header's fields and the manifest's sha256, and a receiver with
a key refuses a push without a valid one before it reads a byte of the state. The manifest holds the
state's checksum, so a push is only kept whole as its signer sent it, as far as that checksum tells (tier 0's
default sum64 detects damage, not a forger on the path: keep the job's network closed, as for torch's own
sockets). A replayed push of this run is an older step of this run: it takes the older slot, never the newer.
Without a join token pushes are unsigned and only the job's run id (`job`) is checked: the rendezvous then
trusts whoever can reach etcd, and these sockets trust whoever can reach them.

A lost node's replicas are kept until this node has published a newer snapshot of its own in a later
incarnation (`prune_departed`, called by the helper): by then its ranks' state is in that newer step. Kept for the
agent's life, each node that left held 2 x its ranks' state of this node's host memory.

Simulated nodes on one machine each have their own tier-0 directory, so a replica always travels over
the socket, never through a shared path.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import mmap
import os
import re
import shutil
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpt.checksum import digest_parts
from ckpt.durable import write_atomic
from ckpt.errors import CheckpointError
from ckpt.layout import MANIFEST_FILE, STATE_FILE, is_real_dir, list_dir, rank_dir_name
from ckpt.manifest import parse_manifest
from ckpt.safe_io import open_own_file
from ckpt.tier0 import PEERS_DIR, SLOTS, SlotLock
from core.deadline import Deadline
from core.events import emit
from core.frames import check_before, recv_frame, send_frame
from core.replica_targets import read_job, read_targets

logger = logging.getLogger(__name__)

CONNECT_S = 5.0
IO_TIMEOUT_S = 60.0
"""Deadline of each socket operation of a push (a peer that stops reading)."""
MIN_RATE = 10e6
"""Bytes a second below which a push is given up: its whole deadline is IO_TIMEOUT_S + size / MIN_RATE (a peer
that sends a byte now and then would otherwise hold the receiver, or the sender's one thread, for ever)."""


def push_deadline(size: int, timeout: float | None = None) -> Deadline:
    return Deadline.after((IO_TIMEOUT_S if timeout is None else timeout) + size / MIN_RATE)
_CHUNK = 8 << 20
_SAFE = re.compile(r"[^A-Za-z0-9._-]")


class ReplicaError(CheckpointError):
    """A push (or a part sent over the process group) was refused or did not complete."""


def push_mac(key: bytes, *, job: str, node: str, rank: int, step: int, size: int, manifest: bytes) -> str:
    """The signature of a push (see the module docstring): its fields and its manifest, keyed by the run's key."""
    message = json.dumps(["replica-push", 1, job, node, rank, step, size, hashlib.sha256(manifest).hexdigest()],
                         separators=(",", ":")).encode()
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def node_dir_name(node: str) -> str:
    """A directory name for node id `node` (node ids may hold ':' or '/'); never "." or ".." (a push naming
    node ".." wrote into this node's own tier-0 slots) nor hidden."""
    safe = _SAFE.sub("_", node)[:100].lstrip(".") or "_"
    return safe if safe == node else f"{safe}-{hashlib.sha256(node.encode()).hexdigest()[:8]}"


def peer_slot_dir(tier0: Path, node: str, rank: int, index: int) -> Path:
    return tier0 / PEERS_DIR / node_dir_name(node) / rank_dir_name(rank) / f"slot_{index}"


def _split_addr(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return host.strip("[]"), int(port)


# -- sending --------------------------------------------------------------------------------------


@dataclass
class _Buffered:
    step: int
    rank: int
    manifest: bytes
    size: int
    copies: int
    buffer: mmap.mmap


class ReplicaSender:
    """The helper's side that sends its node's snapshots to the ring (see the module docstring)."""

    def __init__(self, tier0: Path, key: bytes | None = None) -> None:
        self.tier0 = tier0
        self.key = key  # signs each push (a run with a join token)
        self._buffers: dict[int, mmap.mmap] = {}  # rank -> its copy buffer
        self._pending: dict[int, _Buffered] = {}  # rank -> copied, not yet sent
        self._busy: set[int] = set()  # ranks whose buffer is being filled or sent
        self._cond = threading.Condition()
        self._failing: set[str] = set()
        self._copier = ThreadPoolExecutor(max_workers=2, thread_name_prefix="replica-copy")
        self.sent = 0
        threading.Thread(target=self._run, name="replica-send", daemon=True).start()

    def offer(self, *, rank: int, step: int, image: memoryview, manifest: bytes, copies: int,
              lock: SlotLock) -> bool:
        """Take a published slot (its file image, its manifest) to send to `copies` peers. True: it is taken,
        with `lock` (the slot's, held), which is let go once the slot is copied, on another thread: the
        worker's publish is answered at once, and the worker leaves the slot alone until the lock is free.
        False: not taken, the lock is the caller's (no peer to send to, or this rank's previous copy is still
        being sent: the next replicated snapshot goes instead)."""
        if not read_targets(self.tier0)[1]:
            return False
        with self._cond:
            if rank in self._busy:
                return False
            self._busy.add(rank)
        item = _Buffered(step, rank, manifest, len(image), copies, self._buffer(rank, len(image)))
        self._copier.submit(self._copy, item, image, lock)
        return True

    def _buffer(self, rank: int, size: int) -> mmap.mmap:
        buffer = self._buffers.get(rank)
        if buffer is None or len(buffer) != size:
            buffer = self._buffers[rank] = mmap.mmap(-1, max(1, size))
        return buffer

    def _copy(self, item: _Buffered, image: memoryview, lock: SlotLock) -> None:
        try:
            item.buffer[: item.size] = image
        except Exception:  # a thread boundary: this replica is skipped, the next one tries again
            logger.exception("copying rank %d's snapshot of step %d for its replica failed", item.rank, item.step)
            with self._cond:
                self._busy.discard(item.rank)
            return
        finally:
            lock.release()
        with self._cond:
            self._pending[item.rank] = item
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending:
                    self._cond.wait()
                rank = min(self._pending, key=lambda r: self._pending[r].step)
                item = self._pending.pop(rank)
            sent: list[dict[str, Any]] = []
            try:
                sent = self._send_all(item)
            except Exception:  # noqa: BLE001 - a thread boundary: this replica is lost, the thread serves the next
                logger.exception("sending rank %d's replica of step %d failed", item.rank, item.step)
            finally:
                with self._cond:
                    self._busy.discard(rank)
            for fields in sent:  # once the buffer is free: this rank's next snapshot can be taken
                emit("ckpt_replica", state="sent", **fields)

    def _send_all(self, item: _Buffered) -> list[dict[str, Any]]:
        """Push `item` to its targets; the fields of a "sent" event for each that took it."""
        sent = []
        node, targets = read_targets(self.tier0)
        for target in targets[: item.copies]:
            started = time.monotonic()
            try:
                push(target.addr, node=node, rank=item.rank, step=item.step, manifest=item.manifest,
                     data=memoryview(item.buffer)[: item.size], job=read_job(self.tier0), key=self.key)
            except (OSError, ReplicaError, ValueError) as exc:
                if target.node not in self._failing:
                    self._failing.add(target.node)
                    logger.warning("replica of rank %d step %d to node %s (%s) failed: %s; later snapshots try "
                                   "again", item.rank, item.step, target.node, target.addr, exc)
                    emit("ckpt_replica", state="failed", rank=item.rank, step=item.step, to=target.node,
                         error=str(exc))
                continue
            self.sent += 1
            if target.node in self._failing:
                self._failing.discard(target.node)
                logger.info("replicas to node %s go through again", target.node)
            sent.append({"rank": item.rank, "step": item.step, "to": target.node, "bytes": item.size,
                         "seconds": round(time.monotonic() - started, 3)})
        return sent


def push(addr: str, *, node: str, rank: int, step: int, manifest: bytes, data: memoryview,
         timeout: float = IO_TIMEOUT_S, job: str = "", key: bytes | None = None) -> None:
    """Send one snapshot (its file image `data` and `manifest`) of job `job` to the replica listener at `addr`,
    signed with `key` if given."""
    deadline = push_deadline(len(data), timeout)
    header: dict[str, Any] = {"op": "replica", "node": node, "rank": rank, "step": step, "size": len(data),
                              "job": job}
    if key is not None:
        header["mac"] = push_mac(key, job=job, node=node, rank=rank, step=step, size=len(data), manifest=manifest)
    with socket.create_connection(_split_addr(addr), timeout=CONNECT_S) as sock:
        sock.settimeout(timeout)
        send_frame(sock, header, manifest)
        for offset in range(0, len(data), _CHUNK):
            check_before(deadline, sock, f"a reply, {len(data) - offset} bytes still to send")
            sock.sendall(data[offset: offset + _CHUNK])
        reply, _ = recv_frame(sock, deadline)
    if not reply.get("ok"):
        raise ReplicaError(str(reply.get("error", "refused")))


# -- receiving ------------------------------------------------------------------------------------


class ReplicaReceiver:
    """The helper's side that keeps other nodes' snapshots (see the module docstring)."""

    def __init__(self, tier0: Path, pool: Executor | None, key: bytes | None = None) -> None:
        self.tier0 = tier0
        self.pool = pool
        self.key = key  # with a key, only pushes signed with it are kept
        self._locks: dict[tuple[str, int], threading.Lock] = {}
        self._guard = threading.Lock()
        self.received = 0

    def serve(self, listener: socket.socket) -> None:
        """Accept pushes on `listener` (one thread each) until it is closed."""
        while True:
            try:
                conn, peer = listener.accept()
            except OSError:
                return
            threading.Thread(target=self._connection, args=(conn, peer), daemon=True, name="replica-recv").start()

    def _connection(self, conn: socket.socket, peer: Any) -> None:
        with conn:
            conn.settimeout(IO_TIMEOUT_S)
            try:
                header, body = recv_frame(conn, Deadline.after(IO_TIMEOUT_S))
            except (OSError, ValueError):
                return
            try:
                self.receive(conn, header, body)
                reply: dict[str, Any] = {"ok": True}
            except (ReplicaError, CheckpointError, OSError, ValueError) as exc:
                logger.warning("refused a replica from %s (node %.100s, rank %.20s, step %.20s): %s", peer,
                               header.get("node"), header.get("rank"), header.get("step"), exc)
                reply = {"ok": False, "error": str(exc)}
            try:
                send_frame(conn, reply)
            except OSError:
                pass

    def receive(self, conn: socket.socket, header: dict[str, Any], body: bytes) -> Path:
        if header.get("op") != "replica":
            raise ReplicaError(f"unknown request {str(header.get('op'))[:40]!r}")
        node, rank, step, size = (header.get(k) for k in ("node", "rank", "step", "size"))
        if not (isinstance(node, str) and 0 < len(node) <= 1024 and type(rank) is int and 0 <= rank < 1 << 31
                and type(step) is int and 0 <= step < 1 << 63 and type(size) is int and 0 < size < 1 << 48):
            raise ReplicaError(f"a push without a valid node, rank, step or size: {str(header)[:200]}")
        job, mine = header.get("job", ""), read_job(self.tier0)
        if self.key is not None:
            mac = header.get("mac")
            expected = push_mac(self.key, job=job if isinstance(job, str) else "", node=node, rank=rank, step=step,
                                size=size, manifest=body)
            if not (isinstance(job, str) and isinstance(mac, str) and hmac.compare_digest(mac, expected)):
                raise ReplicaError("a push not signed with this run's replica key: its sender does not hold this "
                                   "job's join token (another job, or not one of this run's nodes)")
        if mine and job != mine:  # mine unknown until the agent's first tick (a node that just joined): taken
            raise ReplicaError(f"a push of job {str(job)[:100]!r}; this node runs job {mine!r}")
        deadline = push_deadline(size)
        lock = self._lock(node, rank)
        if not lock.acquire(timeout=deadline.capped(IO_TIMEOUT_S)):
            raise ReplicaError(f"another push of node {node[:100]!r} rank {rank} is still being received")
        try:
            slot = keep_replica(self.tier0, node=node, rank=rank, step=step, size=size, manifest=body,
                                fill=lambda view: _recv_into(conn, view, size, deadline), pool=self.pool)
        finally:
            lock.release()
        self.received += 1
        return slot

    def _lock(self, node: str, rank: int) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault((node, rank), threading.Lock())


def keep_replica(tier0: Path, *, node: str, rank: int, step: int, size: int, manifest: bytes,
                 fill: Callable[[memoryview], None], pool: Executor | None) -> Path:
    """Write rank `rank`'s part of `step` (a slot's file image of `size` bytes, which `fill` writes into the view
    it gets, and the source's `manifest`) as a replica from `node` in this node's tier 0: into the older slot, its
    manifest removed first and written last, once the bytes match the manifest's checksum. Raises ReplicaError
    (nothing of the part visible). The caller keeps other writers of the same (node, rank) out."""
    parsed = parse_manifest(manifest, path=Path(f"<replica of {node} rank {rank}>"))
    entry = parsed.files.get(STATE_FILE)
    if parsed.rank != rank or parsed.step != step or entry is None or entry.bytes != size:
        raise ReplicaError(f"the manifest (rank {parsed.rank}, step {parsed.step}, "
                           f"{entry.bytes if entry else 'no'} bytes) does not describe the push")
    slot = _older_slot(tier0, node, rank)
    (slot / MANIFEST_FILE).unlink(missing_ok=True)
    slot.mkdir(parents=True, exist_ok=True)
    try:
        image = _map_file(slot / STATE_FILE, size)
        try:
            with memoryview(image) as view:
                fill(view)
                checksum = digest_parts([view], algorithm=entry.algorithm, chunk_bytes=entry.chunk_bytes,
                                        pool=pool)
        finally:
            image.close()
        if checksum.digest != entry.digest:
            raise ReplicaError(f"the bytes received do not match the manifest's {entry.algorithm} checksum")
    except BaseException:
        with contextlib.suppress(OSError):
            (slot / STATE_FILE).unlink(missing_ok=True)  # a push that failed holds no host memory
        raise
    write_atomic(slot / MANIFEST_FILE, manifest)
    return slot


def _older_slot(tier0: Path, node: str, rank: int) -> Path:
    """The slot to write: one without a manifest, else the one holding the older step."""
    def step_of(index: int) -> int:
        try:
            return parse_manifest((peer_slot_dir(tier0, node, rank, index) / MANIFEST_FILE).read_bytes(),
                                  path=Path("<replica>")).step
        except (OSError, CheckpointError):
            return -1
    index = min(range(SLOTS), key=step_of)
    return peer_slot_dir(tier0, node, rank, index)


def _recv_into(conn: socket.socket, view: memoryview, size: int, deadline: Deadline) -> None:
    got = 0
    while got < size:
        check_before(deadline, conn, f"{size - got} of the push's {size} bytes")
        n = conn.recv_into(view[got:], min(_CHUNK, size - got))
        if n == 0:
            raise ReplicaError(f"the connection closed after {got} of {size} bytes")
        got += n


def _map_file(path: Path, size: int) -> mmap.mmap:
    fd = open_own_file(path)
    try:
        os.ftruncate(fd, size)
        try:
            os.posix_fallocate(fd, 0, size)  # ENOSPC now (refused), not SIGBUS while receiving
        except OSError as exc:
            raise ReplicaError(f"no room for a replica of {size / 2**20:.1f} MiB in {path.parent} "
                               f"({os.strerror(exc.errno or 0)})") from exc
        return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


def prune_departed(tier0: Path, newer_than: int, generation: str) -> list[str]:
    """Remove the replicas of nodes that are not in the round any more (not among this node's replica targets,
    core/replica_targets.py) once this node has published a snapshot of a newer step (`newer_than`) in a later
    incarnation (`generation`, a new one at every re-formation and restart): its ranks' state is in that step.
    Within the incarnation a replica was made in, the restore after that node's loss may still need it. Returns
    the node directories removed (nothing before the agent named the round: no targets file yet)."""
    node, targets = read_targets(tier0)
    if not node:
        return []
    members = {node_dir_name(n) for n in (node, *(t.node for t in targets))}
    removed = []
    for found in list_dir(tier0 / PEERS_DIR):
        if found.name in members or not is_real_dir(found):
            continue
        kept = []
        for manifest in found.glob(f"rank_*/slot_*/{MANIFEST_FILE}"):
            with contextlib.suppress(OSError, CheckpointError):
                parsed = parse_manifest(manifest.read_bytes(), path=manifest)
                kept.append((parsed.step, parsed.generation))
        if any(step >= newer_than or made_in == generation for step, made_in in kept):
            continue  # it may still be the newest state of its ranks (this node's worker restores from it)
        shutil.rmtree(found, ignore_errors=True)
        removed.append(found.name)
        emit("ckpt_replica", state="dropped", node=found.name, newest=max((k[0] for k in kept), default=None),
             newer=newer_than)
    return removed
