"""The node's checkpoint helper process (the protocol and the worker's side: ckpt/helper.py).

    python -m ckpt.helper_process --socket <tier0 dir>/helper.sock --parent <agent pid> [--replica-fd N]

elastic-run's agent starts it beside the node's tier-0 directory (elastic/node_helper.py) and starts it
again when it dies. One thread per worker connection; the checksums run on two small pools (a snapshot's
sum64 on one, tier-1 files and replicas on the other), without the GIL. It exits when its agent is gone
(parent death signal, and a check of the parent pid once a second). With `--replica-fd` (a listening TCP
socket the agent made and advertises to its peers) it also keeps other nodes' replicas and sends this
node's (ckpt/replica.py). It also uploads the files of the node's committed tier-1 steps to tier 2 for the
workers' replicators ("upload"), so those bytes do not move in the training processes either.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import mmap
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import fsspec
from fsspec import AbstractFileSystem

from ckpt.checksum import CHUNK_BYTES, Checksum, digest_parts, sum64_from_chunks
from ckpt.durable import write_atomic
from ckpt.identity import RunIdentity
from ckpt.layout import MANIFEST_FILE, STATE_FILE, Layout
from ckpt.manifest import Manifest, parse_manifest
from ckpt.persist import commit_if_complete, persist_rank
from ckpt.replica import ReplicaReceiver, ReplicaSender, prune_departed
from ckpt.safe_io import check_regular, open_regular
from ckpt.shared import put_file
from ckpt.tier0 import PEERS_DIR, SlotLock, snapshot_manifest
from core.frames import recv_frame, send_frame
from core.heap import freeze_now
from core.numbers import decimal

logger = logging.getLogger("ckpt.helper_process")


class SlotImages:
    """Mappings of slot files, kept while their file (inode) and size stay the same."""

    def __init__(self) -> None:
        self._maps: dict[str, tuple[tuple[int, int], mmap.mmap]] = {}
        self._lock = threading.Lock()

    def view(self, path: Path, size: int) -> memoryview:
        if size <= 0:
            raise ValueError(f"a snapshot of {size} bytes in {path}")
        st = check_regular(path)  # a FIFO's open would block, here with the lock held: every worker's map waits
        if st.st_size < size:
            raise ValueError(f"{path} holds {st.st_size} bytes, fewer than the snapshot's {size}")
        key = (st.st_ino, size)
        with self._lock:
            found = self._maps.get(str(path))
            if found is None or found[0] != key:
                fd = open_regular(path)
                try:
                    # Private and writable, though never written: the checksum's readers (numpy, torch)
                    # copy read-only buffers first (50x slower). Unwritten private pages are the file's
                    # own, so they show what the worker writes later.
                    mapping = mmap.mmap(fd, size, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
                finally:
                    os.close(fd)
                self._maps[str(path)] = (key, mapping)  # the old mapping goes with its last view
                found = self._maps[str(path)]
            return memoryview(found[1])[:size]


class Helper:
    """Serves the node's workers (one thread per connection)."""

    def __init__(self, path: Path, *, threads: int | None = None, replica_key: bytes | None = None) -> None:
        self.path = path
        self.replica_key = replica_key
        threads = threads or default_threads()
        # Two pools: a snapshot's publish (the next snapshot and any tier-1 save wait for it) never queues
        # behind a tier-1 file's sha256 or a replica's verification.
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="helper-sum")
        self.persist_pool = ThreadPoolExecutor(max_workers=persist_threads(threads),
                                               thread_name_prefix="helper-persist", initializer=_lower_priority,
                                               initargs=(persist_nice(),))
        self.images = SlotImages()
        self.sender = ReplicaSender(path.parent, replica_key)
        self._pruned_at = 0.0
        self._filesystems: dict[tuple[str, str], AbstractFileSystem] = {}
        self._fs_lock = threading.Lock()

    def serve_replicas(self, listener: socket.socket) -> None:
        """Keep the replicas other nodes' helpers push to `listener` (a thread)."""
        receiver = ReplicaReceiver(self.path.parent, self.persist_pool, self.replica_key)
        threading.Thread(target=receiver.serve, args=(listener,), daemon=True, name="replica-accept").start()

    def serve(self, listener: socket.socket, parent: int | None) -> None:
        listener.settimeout(1.0)
        while parent is None or os.getppid() == parent:
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            threading.Thread(target=self._connection, args=(conn,), daemon=True, name="helper-conn").start()
        logger.info("the agent (pid %s) is gone: the checkpoint helper stops", parent)

    def _connection(self, conn: socket.socket) -> None:
        templates: dict[int, Manifest] = {}
        with conn:
            while True:
                try:
                    header, body = recv_frame(conn)
                except (ConnectionError, OSError, ValueError):
                    return  # the worker closed (or died): its requests end with it
                try:
                    reply = self._handle(header, body, templates, conn)
                except _GaveUp as exc:
                    logger.info("%s", exc)
                    return
                except Exception as exc:  # a process boundary: the worker does the work itself and logs it
                    logger.exception("request %s failed", header.get("op"))
                    reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
                try:
                    send_frame(conn, reply)
                except OSError:
                    return

    def _handle(self, header: dict[str, Any], body: bytes, templates: dict[int, Manifest],
                conn: socket.socket) -> dict[str, Any]:
        op = header.get("op")
        if op == "ping":  # the agent's: is this helper answering (elastic/node_helper.py)
            return {"ok": True}
        if op == "template":
            templates[int(header["id"])] = parse_manifest(body, path=Path("<template>"))
            return {"ok": True}
        if op == "publish":
            return {"ok": True, "held": self.publish(header, templates[int(header["template"])], body, conn)}
        if op == "persist":
            return self.persist(header, templates[int(header["template"])], body, conn)
        if op == "upload":
            self.upload(header)
            return {"ok": True}
        if op == "map":
            # Read every page once (read faults map the file's own pages; MAP_POPULATE on this writable
            # private mapping would copy them instead, and the helper would then checksum stale bytes).
            image = self.images.view(Path(header["path"]) / STATE_FILE, int(header["size"]))
            digest_parts([image], algorithm="sum64", chunk_bytes=CHUNK_BYTES, pool=self.pool)
            return {"ok": True}
        raise ValueError(f"unknown request {op!r}")

    def upload(self, header: dict[str, Any]) -> None:
        """Put one file of a committed tier-1 rank directory into tier 2 (the worker's replicator retries,
        writes the rank's marker and commits: ckpt/replicator.py)."""
        options = header["storage_options"]
        key = (str(header["url"]), json.dumps(options, sort_keys=True))
        with self._fs_lock:  # one file system object per store and options, as fsspec's own cache would keep
            fs = self._filesystems.get(key)
            if fs is None:
                if len(self._filesystems) >= 8:  # options that change (rotating tokens): keep the newest few
                    self._filesystems.pop(next(iter(self._filesystems)))
                fs = self._filesystems[key] = fsspec.core.url_to_fs(key[0], **options)[0]
        put_file(fs, Path(header["local"]), str(header["path"]))

    def publish(self, header: dict[str, Any], template: Manifest, body: bytes, conn: socket.socket) -> bool:
        """Checksum the slot and write its manifest. True: the replica sender took the slot's lock with it (the
        worker then leaves the slot alone until the lock is free: ckpt/tier0.py, HostSlots.hold)."""
        slot = Path(header["path"])
        lock = SlotLock(slot / STATE_FILE, wait=True)
        handed = False
        try:
            image = self.images.view(slot / STATE_FILE, int(header["size"]))
            manifest = snapshot_manifest(
                image, step=int(header["step"]), rank=int(header["rank"]), world_size=int(header["world_size"]),
                generation=str(header["generation"]), run=str(header["run"]), run_uid=str(header["run_uid"]),
                chunk_bytes=int(header["chunk_bytes"]), tensors=template.tensors, shards=template.shards,
                skeleton=json.loads(body), pool=self.pool, checksum=_given_sums(header))
            # A worker that gave up on this request closed the connection before it took the lock (to
            # publish or reuse the slot itself): its slot's bytes may be another step's by now.
            _require_open(conn)
            write_atomic(slot / MANIFEST_FILE, manifest)
            self._prune_later(int(header["step"]), str(header["generation"]))
            copies = int(header.get("replicate", 0))
            if copies > 0 and self.sender.offer(rank=int(header["rank"]), step=int(header["step"]), image=image,
                                                manifest=manifest, copies=copies, lock=lock):
                handed = True  # copied on the sender's thread, which then lets it go
            return handed
        finally:
            if not handed:
                lock.release()

    def _prune_later(self, step: int, generation: str) -> None:
        """Now and then (not every snapshot), on the persist pool: drop the replicas of nodes that left the round,
        now that this node published a newer step (ckpt/replica.py, prune_departed)."""
        now = time.monotonic()
        if now - self._pruned_at < PRUNE_EVERY_S:
            return
        self._pruned_at = now  # also without replicas: the directory is looked at once an interval, not every step
        if (self.path.parent / PEERS_DIR).is_dir():
            self.persist_pool.submit(prune_departed, self.path.parent, step, generation)

    def persist(self, header: dict[str, Any], template: Manifest, body: bytes, conn: socket.socket) -> dict[str, Any]:
        slot = Path(header["path"])
        layout = Layout(Path(header["root"]))
        step, world_size, generation = int(header["step"]), int(header["world_size"]), str(header["generation"])
        identity = RunIdentity(str(header["run"]), str(header["run_uid"])) if header["run"] else None
        lock = SlotLock(slot / STATE_FILE, wait=True)
        rank = int(header["rank"])
        try:
            _require_open(conn)  # persist_rank uncommits the step: not for a worker that gave up
            image = self.images.view(slot / STATE_FILE, int(header["size"]))

            def release() -> None:  # the slot's bytes are all written (before the fsync): the worker may reuse it
                lock.release()
                try:
                    send_frame(conn, {"released": True})
                except OSError:
                    pass  # the worker is gone: the check before the rename ends this request

            written = persist_rank(
                layout, step=step, rank=rank, world_size=world_size, generation=generation,
                parts=[image], tensors=template.tensors, skeleton=json.loads(body), checksum=str(header["checksum"]),
                chunk_bytes=int(header["chunk_bytes"]), shards=template.shards, pool=self.persist_pool,
                identity=identity, before_publish=lambda: _require_open(conn), release=release)
        finally:
            lock.release()
        committed = commit_if_complete(layout, step=step, world_size=world_size,
                                       local_world_size=int(header["local_world_size"]), generation=generation,
                                       identity=identity)
        return {"ok": True, "path": str(written.path), "nbytes": written.nbytes,
                "manifest_sha256": written.manifest_sha256, "committed": committed is not None}


def _given_sums(header: dict[str, Any]) -> Checksum | None:
    """The slot's sum64 checksum the worker's GPU computed (a publish request's "sums"), if it sent one."""
    sums = header.get("sums")
    return None if sums is None else sum64_from_chunks(bytes.fromhex(str(sums)), int(header["chunk_bytes"]))


PRUNE_EVERY_S = 10.0
"""How often (at most) a publish looks for replicas of nodes that left the round (ckpt/replica.py)."""

NICE = 10
"""The helper's CPU niceness: its checksums and writes take the cores the training processes leave. On one
H200 host (16 cores) its two pools of 8 threads, summing a 1.2 GB snapshot every step while hashing a tier-1
write, held up the training thread's kernel launches: episodes of steps 20-45% slower."""


def default_threads() -> int:
    """Checksum threads per pool: 4, and up to 8 on hosts with the cores (a 1.2 GB snapshot's sum64 took
    45 ms with 4 and 30 ms with 8 on an H200 host's 16 cores; it runs every step, beside training)."""
    return max(4, min(8, (os.cpu_count() or 1) // 2))


def env_count(name: str, default: int, *, minimum: int = 1) -> int:
    """$name when it is a whole number >= `minimum`, else `default`: the probes of bench/goodput_bench.py
    ($ELASTIC_HELPER_THREADS, $ELASTIC_HELPER_PERSIST_THREADS, $ELASTIC_HELPER_NICE) reach the helper through
    the agent's environment."""
    value = decimal(os.environ.get(name, ""))
    return value if value is not None and value >= minimum else default


def persist_threads(threads: int) -> int:
    """Threads of the tier-1 and replica pool: $ELASTIC_HELPER_PERSIST_THREADS, else `threads` (a tier-1 write has
    the steps until the next persist to finish)."""
    return env_count("ELASTIC_HELPER_PERSIST_THREADS", threads)


PERSIST_NICE = 9
"""Added to the niceness of the tier-1 and replica pool's threads, over the helper's own (to 19 at most): a tier-1
write has the steps until the next persist to finish, a snapshot's publish one step (step_done waits for it)."""


def persist_nice() -> int:
    """$ELASTIC_HELPER_PERSIST_NICE, else PERSIST_NICE (0: the pool at the helper's own niceness)."""
    return env_count("ELASTIC_HELPER_PERSIST_NICE", PERSIST_NICE, minimum=0)


KEEP_CORES = 0
"""Whole cores (with their SMT siblings) the helper leaves to the training processes: its threads run only on the
other CPUs the agent may use. 0: the helper may run anywhere (niceness alone keeps it behind training). Measured
with 2 in 10 paired rounds on an H200 and an H100 host (sessions 49-50, no SMT siblings in either guest): no
consistent effect, so it stays off."""


def keep_cores() -> int:
    """$ELASTIC_HELPER_KEEP_CORES, else KEEP_CORES."""
    return env_count("ELASTIC_HELPER_KEEP_CORES", KEEP_CORES, minimum=0)


def cpus_without_cores(allowed: set[int], keep: int, siblings_of: Callable[[int], set[int]]) -> set[int]:
    """`allowed` less its `keep` lowest-numbered whole cores (each CPU with its SMT siblings); `allowed` itself when
    that would leave nothing."""
    left, kept = set(allowed), 0
    for cpu in sorted(allowed):
        if kept >= keep or cpu not in left:
            continue
        left -= siblings_of(cpu) | {cpu}
        kept += 1
    return left or set(allowed)


def _siblings(cpu: int) -> set[int]:
    """The CPUs that share `cpu`'s core (Linux sysfs; just `cpu` where the topology is not readable)."""
    try:
        text = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text()
    except OSError:
        return {cpu}
    return cpulist(text)


def cpulist(text: str) -> set[int]:
    """A Linux CPU list ("0-3,8,10-11") as a set."""
    cpus: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        low, _, high = part.partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    return cpus


def _leave_cores(keep: int) -> None:
    """Move this process (before its threads start: they inherit it) off `keep` whole cores."""
    if keep <= 0 or not hasattr(os, "sched_setaffinity"):
        return
    allowed = os.sched_getaffinity(0)
    left = cpus_without_cores(allowed, keep, _siblings)
    if left != allowed:
        os.sched_setaffinity(0, left)
        logger.info("on CPUs %s, leaving %d cores to training", sorted(left), keep)


def _lower_priority(extra: int) -> None:
    """A pool thread's initializer: this thread only `extra` nicer (Linux: a thread id is a PRIO_PROCESS target)."""
    if extra <= 0 or not sys.platform.startswith("linux"):  # elsewhere a thread id is no PRIO_PROCESS target
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + extra))
    except OSError as exc:  # never a reason to fail a write
        logging.getLogger(__name__).warning("could not lower the priority of %s: %s",
                                            threading.current_thread().name, exc)


class _GaveUp(Exception):
    """The worker closed the connection while its request ran: nothing of it may become visible."""


def _require_open(conn: socket.socket) -> None:
    if _closed(conn):
        raise _GaveUp("the worker gave up on this request")


def _closed(conn: socket.socket) -> bool:
    """Whether the peer closed `conn` (nothing it sends while it waits for a reply can be pending)."""
    try:
        return conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def _die_with_parent() -> None:
    """SIGTERM this process when its parent (the agent) exits (Linux prctl PR_SET_PDEATHSIG)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the parent pid check of the accept loop ends it


MAX_KEY_BYTES = 64


def read_key(fd: int) -> bytes:
    """The replica key the agent wrote into the pipe `fd` (elastic/node_helper.py), to its end."""
    data = b""
    with os.fdopen(fd, "rb") as pipe:
        while len(data) <= MAX_KEY_BYTES and (chunk := pipe.read(MAX_KEY_BYTES + 1 - len(data))):
            data += chunk
    if not 16 <= len(data) <= MAX_KEY_BYTES:
        raise ValueError(f"--replica-key-fd {fd}: a key of {len(data)} bytes (16 to {MAX_KEY_BYTES} expected)")
    return data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ckpt.helper_process", description=__doc__.split("\n")[0])
    parser.add_argument("--socket", type=Path, required=True, help="the socket to listen on")
    parser.add_argument("--parent", type=int, default=None, help="exit when this process is no longer our parent")
    parser.add_argument("--threads", type=int, default=env_count("ELASTIC_HELPER_THREADS", 0) or None,
                        help="checksum threads per pool (default: $ELASTIC_HELPER_THREADS, else 4-8 by cores)")
    parser.add_argument("--replica-fd", type=int, default=None,
                        help="an inherited listening TCP socket for other nodes' replicas (ckpt/replica.py)")
    parser.add_argument("--replica-key-fd", type=int, default=None,
                        help="an inherited pipe holding the key that signs replica pushes (a run with a join token)")
    parser.add_argument("--nice", type=int, default=env_count("ELASTIC_HELPER_NICE", NICE, minimum=0),
                        help=f"added to the CPU niceness (default: $ELASTIC_HELPER_NICE, else {NICE})")
    parser.add_argument("--keep-cores", type=int, default=keep_cores(),
                        help=f"whole cores left to training (default: $ELASTIC_HELPER_KEEP_CORES, else {KEEP_CORES})")
    args = parser.parse_args(argv)
    if args.nice > 0:
        os.nice(args.nice)
    logging.basicConfig(level=logging.INFO, format="[ckpt-helper] %(asctime)s %(levelname)s %(message)s")
    _leave_cores(args.keep_cores)
    _die_with_parent()
    if args.parent is not None and os.getppid() != args.parent:
        return 0
    # At once: nothing here needs cleaning up (a half-written rank directory is a temp one, swept later), and
    # sys.exit() from a handler while the interpreter joins the checksum threads only prints a traceback.
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    # A terminal's Ctrl-C reaches the agent's whole process group, this process too. The agent decides what
    # follows and stops the helper itself (SIGTERM); a KeyboardInterrupt here only printed a traceback and
    # took the helper away from the workers' last snapshots.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    tmp = args.socket.with_name(f".{args.socket.name}.{os.getpid()}")
    tmp.unlink(missing_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(str(tmp))
        listener.listen(64)
        key = read_key(args.replica_key_fd) if args.replica_key_fd is not None else None
        helper = Helper(args.socket, threads=args.threads, replica_key=key)
        # The start-up objects (torch's, ~170k) out of the cyclic collector's reach, before any request: a full
        # collection walked them all (~70 ms on the 2-core host) every so many requests, and on one H200 host a
        # snapshot's publish waited behind one, and step_done with it, 20-56 ms once a run
        # (bench/results/goodput_cuda_h200_session38.json). Before the socket is published: no request waits.
        frozen = freeze_now()
        logging.getLogger(__name__).info("serving %s (%d objects of the start-up frozen)", args.socket, frozen)
        os.replace(tmp, args.socket)  # a worker that sees the path can connect
        if args.replica_fd is not None:
            helper.serve_replicas(socket.socket(fileno=args.replica_fd))
        helper.serve(listener, args.parent)
    finally:
        listener.close()
        tmp.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
