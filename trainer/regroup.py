"""Re-forming the process group in place: the trainer's side of elastic/reform.py.

A worker kept over a membership change leaves its aborted process group, joins the new round's
(`join_round`), rebuilds its DDP wrapper on it (`rewrap_ddp`), and then the whole new group agrees
on the step it continues from (`catch_up`, also the first collective of every `Resumable.restore`,
so that a freshly started worker of the new round takes part in the same exchange):

1. Every rank says which step it holds live in memory: the last completed step, unless the
   optimizer has stepped since (a step interrupted after `optimizer.step()`), else -1 (a fresh
   process). No rank holds one: restore from checkpoints as usual.
2. Every rank holds the newest, M: go on from memory. Nothing is read, nothing recomputed.
3. Otherwise, exactly if possible: the newest step of M, M-1 that every rank either holds live or
   can load its own checkpoint part of (tier 0 first: a replaced worker's snapshots outlive it).
   Own parts keep each rank's RNG streams, so the run stays bitwise equal to an uninterrupted one;
   at most one step is recomputed. New ranks (a joining node's: nothing live, no checkpoint part of
   their own) do not stand in the way: they take that step's state from a rank holding it in memory,
   as in 5, while the others stay exact (two survivors one step apart with a joiner in the round go on
   from the step both completed, not from the newer one with the lagging survivor's RNG derived).
4. Else, when every rank that lacks M has an own checkpoint part of some step, restore from checkpoints
   (exact, as a restart would; the steps since are recomputed).
5. Else the lowest rank holding M sends its state to the others over the process group (replicated
   state only), verified with a sum64 checksum; a receiving rank's RNG streams are derived from the
   sender's and its rank, as a restore does for a rank without a checkpoint part of its own.

The same transfer serves a restore from checkpoints in which not every rank can read one (a
replacement node with an empty local tier and no shared tier): `peer_checkpoint` sends the newest
step some rank can read, instead of the group starting over from step 0.
"""

from __future__ import annotations

import ctypes
import functools
import json
import logging
import os
import socket
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from datetime import timedelta
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ckpt import Restored, tree
from ckpt.checksum import digest_parts
from core import faults
from core.deadline import Deadline
from elastic import fast_exit, peer_loss, reform
from elastic.reform import Round, RoundWatcher
from trainer import gloo_sockets
from trainer.ddp import release_process_group
from trainer.errors import InvalidStateError, StateMismatchError, TrainerError
from trainer.topology import Topology, collective_device

log = logging.getLogger(__name__)

_CHUNK = 4 << 20


class CatchUpError(TrainerError):
    """The state a peer sent did not arrive intact."""


def join_next_round(watcher: RoundWatcher, error: BaseException | None, *, step: int = -1) -> Round | None:
    """Leave this process group for the agent's newest round and join that round's; None when there is
    none (after `error`, one that may come from the group changing, it waits the lost-peer grace for the
    agent to publish one). A newer round published while joining (a peer of this one lost too) is
    joined instead; a stop round is returned. `step`: the steps this worker completed (the fault point)."""
    round_ = next_round(watcher, error)
    if round_ is None or round_.stop:
        return round_
    faults.fire("join", step)
    if error is not None:
        release_frames(error)
    backend = str(dist.get_backend())
    while True:
        try:
            # "Left" is said once the old group is gone: a worker stuck destroying it (a gloo op that waits on a
            # peer) misses the agent's leave deadline and is restarted, instead of holding the new group up.
            join_round(round_, backend=backend, timeout=reform.join_timeout(), left=partial(watcher.leaving, round_),
                       superseded=partial(_superseded, watcher, round_))
            break
        except Exception as exc:  # noqa: BLE001 - a newer round is the way out; else the error stands
            # A peer of the round lost while joining it (its store's host, say): the agent's next round follows.
            newer = (await_round(watcher, newer_than=round_.generation) if may_be_peer_loss(exc)
                     else watcher.wait(Deadline.after(0), newer_than=round_.generation))
            if newer is None:
                raise
            round_ = newer
            if round_.stop:  # a peer of the round lost while joining it, below the minimum: no group to join
                return round_
    watcher.joined(round_)
    return round_


def _superseded(watcher: RoundWatcher, round_: Round) -> bool:
    newer = watcher.newest()
    return newer is not None and newer.generation > round_.generation


def next_round(watcher: RoundWatcher, error: BaseException | None) -> Round | None:
    """The agent's newest round; after `error`, one that may come from the group changing, waiting the
    lost-peer grace for the agent to publish one. None when there is none."""
    round_ = watcher.newest()
    if round_ is None and error is not None and may_be_peer_loss(error):
        round_ = await_round(watcher)
    return round_


def await_round(watcher: RoundWatcher, *, newer_than: int | None = None) -> Round | None:
    """The agent's next round (newer than generation `newer_than`, if given), waiting the lost-peer grace for it,
    and past the grace while the agent says one is forming (its rendezvous waiting on etcd, say), until the time it
    gave. None: no round came."""
    round_ = watcher.wait(Deadline.after(float(os.environ.get(peer_loss.ENV_GRACE, "0") or 0)), newer_than=newer_than)
    if round_ is None and watcher.coming():
        while round_ is None and watcher.coming():
            round_ = watcher.wait(Deadline.after(1.0), newer_than=newer_than)
        if round_ is None:  # the announcement just ended: its round may be published, not yet seen (20 ms polls)
            round_ = watcher.wait(Deadline.after(1.0), newer_than=newer_than)
    return round_


def release_frames(error: BaseException) -> None:
    """Clear the locals of the finished frames `error` (and the errors it chains) was raised through.

    Before leaving the group: the frame of a failed collective holds the group (torch's `all_reduce` keeps
    `group` and `work`; c10d's logging wrapper keeps the error, a cycle). While they live the group survives
    `destroy_process_group`: its gloo connections stay open, so a peer waiting on this rank in the same
    collective is not failed by our leaving; it waits out the gloo timeout, misses the agent's leave
    deadline and is restarted (`reform_fallback`)."""
    pending: list[BaseException | None] = [error]
    seen: set[int] = set()
    while pending and len(seen) < 16:
        e = pending.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)  # skips the frames still running (the caller's)
        pending += [e.__cause__, e.__context__]


_watcher: RoundWatcher | None = None


def round_watcher() -> RoundWatcher | None:
    """This process's watcher of the agent's rounds (one for the process: a run re-entered in place,
    trainer/in_place.py, keeps watching from the round it joined); None outside an in-process agent."""
    global _watcher
    if _watcher is None:
        _watcher = RoundWatcher.start(_on_new_round)
    return _watcher


def stop_round_watcher() -> None:
    """The run is over: the agent restarts this process on a membership change from now on."""
    global _watcher
    if _watcher is not None:
        _watcher.withdraw()
        _watcher.stop()
        _watcher = None


def _on_new_round(round_: Round) -> None:
    interrupt_join(round_)
    abort_process_group(round_)


def abort_process_group(round_: reform.Round) -> None:
    # On the round watcher's thread: an NCCL collective waiting on a peer of the old round fails now.
    # Not gloo: its abort() does not fail the collectives in flight (a lost peer's closed sockets do), and
    # can block on the group's lock while the training thread destroys the group. There the training
    # thread sees the round at its next step boundary (`check_round`), or the agent restarts a worker that
    # does not leave in time (`AgentConfig.reform_leave_timeout`).
    if not (dist.is_available() and dist.is_initialized()):
        return
    if dist.get_backend() == "nccl":
        dist.distributed_c10d._get_default_group().abort()
    elif round_.stop:
        # The job stops, and no restart can save what this worker holds: a collective waiting on a peer that is
        # alive but silent (its node frozen) would keep it from persisting until the agent gives up. Its sockets
        # shut down, the collective fails now (the other groups' sockets too: the process is leaving them all).
        gloo_sockets.fail_in_flight()


def may_be_peer_loss(error: BaseException) -> bool:
    """Whether `error` may come from the group changing (worth waiting for the agent's round)."""
    text = str(error).lower()
    return peer_loss.looks_like_peer_loss(error) or any(w in text for w in ("gloo", "nccl", "store", "abort"))


class RoundSuperseded(TrainerError):
    """The agent published a newer round while this worker was joining one: join that one instead."""


_STORE_CONNECT_S = 2.0
"""The longest attempt to reach a round's store: between attempts, a newer round is looked for."""

_joining_lock = threading.Lock()
_joining: tuple[int, list[tuple[int, int]]] | None = None
"""The generation of the round being joined and its store connection, (descriptor, inode)."""


def join_round(round_: Round, *, backend: str, timeout: timedelta, left: Callable[[], None] = lambda: None,
               superseded: Callable[[], bool] = lambda: False) -> None:
    """Leave the current (aborted) process group, call `left`, and join `round_`'s, as rank `round_.rank`.

    Raises RoundSuperseded (or the failed wait's error) once `superseded()` says a newer round is out: a peer of
    `round_` lost before it joined would otherwise hold this worker in the join until `timeout`, and below the
    minimum of nodes the agent would wait that long for the job's newest step to be persisted."""
    global _joining
    if dist.is_initialized():
        gloo = dist.get_backend() == "gloo"
        if gloo:
            # Gloo's collectives in flight (a peer's that waits on this rank, and this rank's that waits on
            # a peer leaving too) end only when sockets close: without this, destroying waits on them.
            gloo_sockets.fail_in_flight()
        try:
            dist.distributed_c10d._get_default_group().abort()
        except RuntimeError as exc:  # already aborted by the round watcher
            log.debug("abort of the old process group: %s", exc)
        if gloo:
            _destroy_default_group()
        else:  # NCCL's abort() above has failed its collectives in flight
            dist.destroy_process_group()
    left()
    # The round's TCPStore is new (elastic/rendezvous.py). A worker started for the round joins through
    # env://, which puts the group's keys under "default_pg": so do we, to land in the same group.
    tcp, connection = _connect_store(round_, timeout, superseded)
    # ... and under the group's name, which torch takes from a process-wide counter: advanced before the group
    # connects, reset only when a default group is destroyed. After a join that failed (its round abandoned for a
    # newer one, see join_next_round) it would name this group "1", whose keys a fresh worker of the round (group
    # "0") never meets: both would wait out the timeout. Name it as a fresh process does.
    dist.distributed_c10d._world.group_count = 0
    with _joining_lock:
        _joining = (round_.generation, connection)
    try:
        if superseded():  # published before the watcher could see a join to interrupt
            raise RoundSuperseded(f"a round newer than {round_.generation} was published")
        # Waits on the store for every peer of the round: a newer round shuts that connection down (interrupt_join).
        dist.init_process_group(backend, store=dist.PrefixStore("default_pg", tcp), rank=round_.rank,
                                world_size=round_.world_size, timeout=timeout)
    finally:
        with _joining_lock:
            _joining = None
    os.environ.update(RANK=str(round_.rank), WORLD_SIZE=str(round_.world_size), MASTER_ADDR=round_.master_addr,
                      MASTER_PORT=str(round_.master_port))


def _connect_store(round_: Round, timeout: timedelta,
                   superseded: Callable[[], bool]) -> tuple[dist.TCPStore, list[tuple[int, int]]]:
    """A client of `round_`'s store and its connection's sockets. Until `timeout`, the store's address is tried with
    a plain connect (`_STORE_CONNECT_S` at most each, quietly: torch's client logs a traceback per failed attempt),
    looking for a newer round in between: a store whose host died before this worker reached it is given up."""
    deadline = Deadline.after(timeout)
    address = (round_.master_addr, round_.master_port)
    while True:
        if superseded():
            raise RoundSuperseded(f"a round newer than {round_.generation} was published")
        try:
            socket.create_connection(address, timeout=deadline.capped(_STORE_CONNECT_S)).close()
            break
        except OSError as exc:
            if deadline.expired():
                raise ConnectionError(f"round {round_.generation}'s store at {address[0]}:{address[1]} could not be "
                                      f"reached within {timeout.total_seconds():.0f}s: {exc}") from exc
            time.sleep(deadline.capped(0.1))
    before = gloo_sockets.sockets()
    tcp = dist.TCPStore(round_.master_addr, round_.master_port, is_master=False,
                        timeout=timedelta(seconds=max(1.0, deadline.remaining() or 0.0)))
    tcp.set_timeout(timeout)
    return tcp, gloo_sockets.opened_since(before, peer_port=round_.master_port)


def interrupt_join(newer: Round) -> None:
    """On the round watcher's thread: a join of a round older than `newer`, waiting on its store for a peer that
    may be gone, fails now (its store connection is shut down) instead of at the join timeout."""
    with _joining_lock:
        if _joining is not None and newer.generation > _joining[0]:
            shut = gloo_sockets.shut_down(_joining[1])
            log.info("round %d published while joining round %d: left that join (%d connection(s) shut down)",
                     newer.generation, _joining[0], shut)


def _destroy_default_group() -> None:
    """`dist.destroy_process_group()` of a gloo group whose object is then kept for the life of the process.

    Freeing a gloo group joins its worker threads, so it waits for the collective one of them runs, and a
    send queued on a connection that closed meanwhile is never failed (gloo's `UnboundBuffer::waitSend`,
    seen on this project's 2-core host under load, about 1 in 25 runs of test_reform's warm-spare scenario
    with every socket of the group already closed): it waits out the group's timeout, 30 min by default.
    The training thread must not wait with it (the agent restarts a worker that has not left the group within
    10 s). Nor may another thread free it: torch runs that destructor without the GIL, and a daemon thread that
    comes back for the GIL once the interpreter is finalizing is ended inside C++, which aborts the process
    ("terminate called without an active exception", exit -6: the survivor of a re-formation that then finished
    its job). So the group is never freed: its sockets are shut down already (gloo_sockets), its threads idle or
    stuck, a few per re-formation, and they go with the process: a run under trainer.run_elastic that succeeds after
    a re-formation ends without the interpreter's finalization, which aborted on them too (an FSDP survivor; a
    replicated run's survivor exits as Python does: never seen to abort)."""
    global _kept
    group = dist.distributed_c10d._get_default_group()
    dist.destroy_process_group()
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))  # a reference nothing releases, not even finalization
    _kept += 1


_kept = 0
"""How many old gloo groups this process keeps (`_destroy_default_group`)."""


def end_without_finalization_if_kept(code: int | None = None) -> None:
    """A run that re-formed in place (under elastic-run) and then succeeded: the process keeps old gloo groups,
    whose threads Python's finalization can abort on, turning the success into a crash its agent restarts the node
    for. It ends after its atexit handlers instead, with the code Python would use (elastic/fast_exit.py: `code`,
    else 0, or that of an uncaught exception or sys.exit after this; not that of a bare `raise SystemExit`)."""
    if _kept and reform.enabled():
        fast_exit.end_without_finalization(code)


def rewrap_ddp(ddp: DistributedDataParallel) -> None:
    """Rebuild `ddp` on the new default process group, in place: the caller's reference keeps working.

    DDP's constructor broadcasts rank 0's parameters and buffers; a freshly started rank 0 of the new
    round would overwrite this rank's live state with its initial one, so the state is put back after.
    """
    settings: dict[str, Any] = dict(
        device_ids=ddp.device_ids, output_device=ddp.output_device, dim=ddp.dim,
        broadcast_buffers=ddp.broadcast_buffers, find_unused_parameters=ddp.find_unused_parameters,
        bucket_cap_mb=ddp.bucket_bytes_cap / (1024 * 1024), gradient_as_bucket_view=ddp.gradient_as_bucket_view,
        static_graph=bool(getattr(ddp, "static_graph", False)))
    if getattr(ddp, "_comm_hooks", None):
        log.warning("the DDP wrapper had communication hooks; the rebuilt one has none: register them again")
    module = ddp.module
    live = {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict(keep_vars=True).items()
            if isinstance(v, torch.Tensor)}
    release_process_group(ddp)
    fresh = DistributedDataParallel(module, **settings)
    ddp.__dict__.update(fresh.__dict__)  # the old reducer goes with the old dict: its hooks are removed
    del fresh
    with torch.no_grad():
        for key, value in module.state_dict(keep_vars=True).items():
            if key in live:
                value.copy_(live[key])
    for p in module.parameters():
        p.grad = None  # gradients of the interrupted step


# catch_up's vote on a step (the group's minimum wins): every rank holds it exactly (live, or its own checkpoint
# part); some ranks are new and take it from a peer, the others hold it exactly; some rank lacks it.
_EXACT, _FRESH, _LACKING = 2, 1, 0


def catch_up(topology: Topology, live_step: int, *, load_own: Callable[[int], Restored | None],
             apply_own: Callable[[Restored], None], state: Callable[[], Mapping[str, Any]],
             apply_peer: Callable[[Mapping[str, Any]], None],
             has_own: Callable[[], bool] = lambda: False) -> tuple[int, str] | None:
    """Collective: the step the group goes on from and where this rank's state came from ("memory",
    "own" checkpoint part, "peer"), or None when no rank holds a live state (see the module docstring).

    `load_own(step)` loads this rank's own checkpoint part of `step` (None: none); `apply_own` applies
    it; `state()` is this rank's state tree; `apply_peer` applies another rank's; `has_own()` says
    whether this rank has an own checkpoint part of any step (then an exact restore from checkpoints,
    as a restart would do, is preferred to a peer's state with derived RNG streams: None)."""
    live = topology.all_gather(live_step)
    newest = max(live)
    if newest < 0:
        return None
    mine = live[topology.rank]
    if all(s == newest for s in live):
        return newest, "memory"
    own_part = functools.cache(has_own)  # a restore: once at most, and only on a rank that needs the answer
    for step in (newest, newest - 1):
        if step < 0:
            break
        loaded = load_own(step) if mine != step else None
        ok = mine == step or (loaded is not None and loaded.own and loaded.step == step)
        fresh = not ok and mine < 0 and not own_part()  # a new rank (a joining node's): never exact
        vote = topology.all_min(_EXACT if ok else _FRESH if fresh else _LACKING)
        holders = [rank for rank, held in enumerate(live) if held == step]
        if vote == _EXACT or (vote == _FRESH and holders):
            if loaded is not None:
                apply_own(loaded)
            if vote == _FRESH:  # the new ranks take the state of `step` from a rank holding it in memory
                received = broadcast_state(state() if topology.rank == holders[0] else None, holders[0], topology)
                if not ok:
                    apply_peer(received)
                    return step, "peer"
            return step, "own" if loaded is not None else "memory"
    if topology.all_min(int(mine == newest or own_part())) == 1:
        return None  # every rank can resume exactly from a checkpoint of its own: go back to it
    source = live.index(newest)
    received = broadcast_state(state() if topology.rank == source else None, source, topology)
    if mine != newest:
        apply_peer(received)
        return newest, "peer"
    return newest, "memory"


def peer_checkpoint(topology: Topology, found: Restored | None, *, check: Callable[[Restored], None],
                    apply_own: Callable[[Restored], None],
                    apply_peer: Callable[[Mapping[str, Any]], None]) -> tuple[int, str] | None:
    """Collective, after the group found no checkpoint that every rank can read: the newest that some rank
    can (`found`, this rank's newest readable one), sent by the lowest such rank to the others (replicated
    state). Returns (step, "own" | "peer") as `catch_up` does, or None when no rank has one."""
    if found is not None:
        try:
            check(found)
        except (InvalidStateError, StateMismatchError) as exc:
            log.warning("not offering step %d from %s to the group: %s", found.step, found.path, exc)
            found = None
    steps = topology.all_gather(found.step if found is not None else -1)
    newest = max(steps)
    if newest < 0:
        return None
    source = steps.index(newest)
    log.info("rank %d sends step %d to the ranks that cannot read it", source, newest)
    received = broadcast_state(found.state if topology.rank == source and found is not None else None, source,
                               topology)
    if found is not None and found.step == newest and found.own:
        apply_own(found)
        return newest, "own"
    apply_peer(received)
    return newest, "peer"


def broadcast_state(state: Mapping[str, Any] | None, source: int, topology: Topology) -> Mapping[str, Any]:
    """`source`'s state tree on every rank: a JSON header (the tree's skeleton, each tensor's dtype and
    shape, the checksum), then all tensors in one byte buffer. No pickle."""
    device = collective_device()
    if topology.rank == source:
        assert state is not None
        tensors, skeleton = tree.flatten(state)
        parts = [t.detach().contiguous().view(-1).view(torch.uint8).cpu() for t in tensors.values()]
        buffer = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
        header = json.dumps({"skeleton": skeleton, "checksum": _checksum(buffer),
                             "tensors": [[k, str(t.dtype).removeprefix("torch."), list(t.shape)]
                                         for k, t in tensors.items()]}).encode()
        size = torch.tensor([len(header), buffer.numel()], dtype=torch.int64, device=device)
    else:
        size = torch.zeros(2, dtype=torch.int64, device=device)
    dist.broadcast(size, source)
    head_len, body_len = (int(x) for x in size.tolist())
    head = (torch.frombuffer(bytearray(header), dtype=torch.uint8).to(device) if topology.rank == source
            else torch.empty(head_len, dtype=torch.uint8, device=device))
    dist.broadcast(head, source)
    body = buffer.to(device) if topology.rank == source else torch.empty(body_len, dtype=torch.uint8, device=device)
    dist.broadcast(body, source)
    if topology.rank == source:
        assert state is not None
        return state
    doc = json.loads(bytes(head.cpu().numpy()))
    body = body.cpu()
    if _checksum(body) != doc["checksum"]:
        raise CatchUpError(f"the state rank {source} sent ({body_len} bytes) does not match its checksum; "
                           "the transfer was damaged: restart the job (it resumes from its checkpoints)")
    out: dict[str, torch.Tensor] = {}
    offset = 0
    for key, dtype_name, shape in doc["tensors"]:
        dtype = getattr(torch, dtype_name)
        count = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
        out[key] = body[offset:offset + count].view(dtype).reshape(shape).clone()
        offset += count
    restored: Mapping[str, Any] = tree.unflatten(doc["skeleton"], out)
    return restored


def _checksum(buffer: torch.Tensor) -> str:
    view = memoryview(buffer.numpy())  # type: ignore[arg-type]
    return digest_parts([view], algorithm="sum64", chunk_bytes=_CHUNK).digest
