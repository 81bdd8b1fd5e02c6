"""The node's checkpoint helper: a process that finishes the node's workers' checkpoints off their
training processes (the protocol and the worker's side; the process: ckpt/helper_process.py).

    elastic-run's agent:  python -m ckpt.helper_process --socket <tier0 dir>/helper.sock --parent <agent pid>
    a worker (writer):    HelperClient(<tier0 dir>).publish(...)   -> the tier-0 slot's manifest is written
                          HelperClient(<tier0 dir>).persist(...)   -> the slot is written and committed in tier 1

Why a process: a snapshot every step leaves work after its copy (a sum64 checksum of the whole slot,
the manifest, its atomic write), and a checkpoint every N steps writes and hashes the whole state.
Done on threads of the training process, the first took ~6% of a GPT's throughput on one H200, the
second ~4% at every 10 steps (bench/results/goodput_cuda_h200_tier0_probe_*): those threads and the
training thread share the GIL and the CPUs that launch the kernels. The helper reads the slot through
its own mapping of the tmpfs file (the slot lives in the node's shared memory, ckpt/tier0.py), so the
worker only sends a few hundred bytes and waits on a socket, without the GIL.

Protocol: a Unix stream socket in the node's tier-0 directory (private to the node, mode 0700); one
connection per worker; request, then reply, framed as [u32 header length][header JSON][u32 body
length][body]. Requests:
  template  header {"op", "id"}; body: a manifest of the layout (its tensors and shards) — sent once
            per layout and connection, as the tensors' entries are hundreds of lines
  publish   header {"op", "template", "path" (the slot directory), "size" (bytes of its file image),
            "step", "rank", "world_size", "generation", "run", "run_uid", "chunk_bytes", "replicate",
            optionally "sums" (the chunk sums in hex, when the worker's GPU summed the slot: ckpt/device_image.py)};
            body: the state skeleton's JSON. The helper checksums the slot's file image (unless given), writes its
            manifest (atomically) and replies; the slot is then the rank's newest snapshot. With
            "replicate" N > 0 and peers to send to, the reply says {"held": true}: the helper keeps the
            slot's lock until it has copied the slot, to send it to N peer nodes (ckpt/replica.py).
  persist   the same, plus "root" (the tier-1 directory), "local_world_size", "checksum": the helper
            writes the slot as the rank's directory of the step (ckpt/persist.py: fsynced, renamed) and
            writes COMMIT when the node's ranks are all there; the reply says where and whether. Before
            it, once the slot's bytes are written (before the fsync), a frame {"released": true}: the
            worker may reuse the slot from then on (and can no longer write that step itself).
  map       header {"op", "path", "size"}: map the slot's file now and fault its pages in (at start).
  upload    header {"op", "step", "local" (a file of a committed tier-1 rank directory), "url" and
            "storage_options" (the shared tier's, JSON), "path" (the file's path in that file system)}:
            the helper puts the file there (tier 2, ckpt/shared.py) and checks its size. Only the bytes
            move here: retries, markers, COMMIT and retention stay with the worker's replicator thread.
Replies: {"ok": true, ...} or {"ok": false, "error": "..."}.

Failure: the worker gives the helper `timeout` seconds (a tier-1 write `persist_timeout`); on no
answer, a broken connection or an error it does the work itself, as without a helper, and tries the
helper again `RETRY_S` later, twice as late after each failure in a row (a restarted helper: the agent
starts a new one when the old one died or stopped answering, elastic/node_helper.py). The helper holds
the slot's lock (ckpt/tier0.py, SlotLock) while it works on it and checks, before it writes the
manifest or renames the rank directory, that the worker still waits: a worker that gave up closed the
connection first and takes the lock before it touches the slot, so a late helper never writes a
manifest over bytes the worker replaced, nor a second copy of a rank directory; while the helper still
holds the lock the worker leaves the slot alone.

The process itself: ckpt/helper_process.py.
"""

from __future__ import annotations

import logging
import random
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ckpt.checksum import Checksum
from core.events import emit
from core.frames import recv_frame, send_frame

logger = logging.getLogger(__name__)

SOCKET_NAME = "helper.sock"
"""The helper's socket, in the node's tier-0 directory."""


class HelperError(Exception):
    """The helper did not finish a request (the caller does the work itself)."""


class HelperRequestFailed(HelperError):
    """The helper answered: the request itself failed there."""



def socket_path(tier0_dir: str | Path) -> Path:
    return Path(tier0_dir) / SOCKET_NAME


# -- the worker's side -----------------------------------------------------------------------------


class HelperClient:
    """A worker's connection to its node's helper (one per rank; used from one thread at a time)."""

    RETRY_S = 5.0
    """After a failure, the helper is tried again this much later (meanwhile the worker publishes), doubled after
    each failure in a row up to RETRY_MAX_S, with jitter: a helper that stops answering (stopped, wedged) cost a
    `timeout` wait, and the snapshots skipped meanwhile, every few seconds until its agent replaced it."""
    RETRY_MAX_S = 300.0

    def __init__(self, tier0_dir: str | Path, *, timeout: float = 30.0, persist_timeout: float = 600.0) -> None:
        self.path = socket_path(tier0_dir)
        self.timeout = timeout
        """Seconds a publish (a checksum of the slot in memory) may take before the worker does it itself."""
        self.persist_timeout = persist_timeout
        """Seconds a tier-1 write (the disk) may take before the worker gives up on it."""
        self._sock: socket.socket | None = None
        self._templates: dict[int, int] = {}  # id(template bytes' owner) -> template id sent on this connection
        self._next_id = 0
        self._retry_at = 0.0
        self._failures = 0  # in a row
        self._warned = False
        self.published = 0
        """Snapshots the helper published (for metrics and tests)."""
        self.persisted = 0
        """Steps the helper wrote to tier 1 for this worker."""
        self.mapped = 0
        """Slots the helper mapped ahead of the loop (prepare)."""
        self.uploaded = 0
        """Files the helper uploaded to tier 2 for this worker."""

    def available(self) -> bool:
        """Whether to try the helper now: its socket exists and no failure is recent."""
        return time.monotonic() >= self._retry_at and (self._sock is not None or self.path.exists())

    def publish(self, *, template_key: int, template: bytes, path: Path, size: int, step: int, rank: int,
                world_size: int, generation: str, run: str, run_uid: str, chunk_bytes: int,
                state_json: bytes, replicate: int = 0, checksum: Checksum | None = None) -> bool:
        """Have the helper checksum the slot at `path` and write its manifest (and, `replicate` > 0, send
        it to that many peer nodes: ckpt/replica.py); with `checksum` (summed on the GPU) it does not read the
        slot for it. Raises HelperError (the caller then publishes the slot
        itself, without a replica). True: the helper still holds the slot's lock (it copies the slot for a
        replica): the caller must not reuse the slot before the lock is free (HostSlots.hold)."""
        request = {"op": "publish", "path": str(path), "size": size, "step": step, "rank": rank,
                   "world_size": world_size, "generation": generation, "run": run, "run_uid": run_uid,
                   "chunk_bytes": chunk_bytes, "replicate": replicate}
        if checksum is not None:
            request["sums"] = checksum.chunks.hex()
        reply = self._request(request, template_key, template, state_json)
        self.published += 1
        return bool(reply.get("held"))

    def map(self, path: Path, size: int) -> bool:
        """Have the helper map the slot at `path` now (at start), not in its first request inside the loop
        (1.2 GB: ~0.4 s, which held up a save on one H200). False when the helper did not answer."""
        try:
            self._call(self._connect(), {"op": "map", "path": str(path), "size": size}, b"")
            self._answered()
            self.mapped += 1
            return True
        except (OSError, ValueError, HelperError):
            self.close()
            return False

    def persist(self, *, template_key: int, template: bytes, path: Path, size: int, step: int, rank: int,
                world_size: int, local_world_size: int, generation: str, run: str, run_uid: str,
                root: Path, checksum: str, chunk_bytes: int, state_json: bytes,
                on_released: Callable[[], None]) -> dict[str, Any]:
        """Have the helper write the slot at `path` as rank `rank` of `step` into the tier-1 directory
        `root` and commit the step there if it is complete (ckpt/persist.py, as the writer would).
        `on_released` runs once the helper no longer reads the slot (its bytes written, before the fsync).
        Returns {"path", "nbytes", "manifest_sha256", "committed"}. Raises HelperError."""
        request = {"op": "persist", "path": str(path), "size": size, "step": step, "rank": rank,
                   "world_size": world_size, "local_world_size": local_world_size, "generation": generation,
                   "run": run, "run_uid": run_uid, "root": str(root), "checksum": checksum,
                   "chunk_bytes": chunk_bytes}
        reply = self._request(request, template_key, template, state_json, timeout=self.persist_timeout,
                              on_released=on_released)
        self.persisted += 1
        return reply

    def upload(self, *, local: Path, url: str, storage_options: dict[str, Any], path: str, step: int,
               timeout: float) -> None:
        """Have the helper put the file `local` at `path` of the file system of `url` (tier 2) and check its
        size, within `timeout` seconds. Raises HelperRequestFailed when the helper tried and failed (the
        connection is kept), HelperError when it cannot be asked or does not answer in time."""
        request = {"op": "upload", "step": step, "local": str(local), "url": url,
                   "storage_options": storage_options, "path": path}
        self._request(request, None, b"", b"", timeout=timeout, remote_errors=True)
        self.uploaded += 1

    def _request(self, request: dict[str, Any], template_key: int | None, template: bytes, body: bytes, *,
                 timeout: float | None = None, on_released: Callable[[], None] | None = None,
                 remote_errors: bool = False) -> dict[str, Any]:
        """One request (after its layout's template, once per connection). `remote_errors`: a failure the helper
        reports is raised as HelperRequestFailed and the connection kept (it is the request's, not the helper's)."""
        step = request["step"]
        try:
            sock = self._connect()
            tid = None if template_key is None else self._templates.get(template_key)
            if tid is None and template_key is not None:
                tid = self._next_id = self._next_id + 1
                self._call(sock, {"op": "template", "id": tid}, template)
                self._templates = {template_key: tid}  # one layout at a time: the old one is not reused
            sock.settimeout(timeout or self.timeout)
            try:
                reply = self._call(sock, {**request, "template": tid}, body, on_released)
            finally:
                sock.settimeout(self.timeout)
            self._answered()
            return reply
        except (OSError, ValueError, HelperError) as exc:
            if remote_errors and isinstance(exc, HelperRequestFailed):
                self._answered()
                raise
            self.close()
            self._failures += 1
            delay = min(self.RETRY_S * 2 ** min(self._failures - 1, 16), self.RETRY_MAX_S)
            self._retry_at = time.monotonic() + delay * random.uniform(0.8, 1.2)
            if not self._warned:
                self._warned = True
                emit("ckpt_helper", state="lost", step=step, error=str(exc))
                logger.warning("the node's checkpoint helper (%s) did not %s step %d: %s; this worker does that "
                               "work itself until the helper answers again", self.path, request["op"], step, exc)
            raise HelperError(str(exc)) from exc

    def _connect(self) -> socket.socket:
        if self._sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.timeout)
            try:
                sock.connect(str(self.path))
            except OSError:
                sock.close()
                raise
            self._sock, self._templates = sock, {}
        return self._sock

    def _answered(self) -> None:
        """The helper answered a request: "back" only now (a stopped helper's socket still takes connections)."""
        self._failures = 0
        if self._warned:
            logger.info("the node's checkpoint helper answers again (%s)", self.path)
            emit("ckpt_helper", state="back")
            self._warned = False

    @staticmethod
    def _call(sock: socket.socket, header: dict[str, Any], body: bytes,
              on_released: Callable[[], None] | None = None) -> dict[str, Any]:
        send_frame(sock, header, body)
        reply, _ = recv_frame(sock)
        while reply.get("released"):  # a tier-1 write done reading the slot; its reply follows
            if on_released is not None:
                on_released()
            reply, _ = recv_frame(sock)
        if not reply.get("ok"):
            raise HelperRequestFailed(str(reply.get("error", "no reason given")))
        return reply

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def interrupt(self) -> None:
        """From another thread: end the request in flight (its wait fails at once: HelperError) and close."""
        sock = self._sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
