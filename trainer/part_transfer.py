"""A sharded step's missing parts, sent over the process group to the ranks that lack them (issue K, a node
joining or replacing a lost one).

A sharded restore into the new layout needs the parts of every rank that saved the step. When the group can
agree on no step (trainer/agree.py) because some ranks hold no part of any (a new node's empty tiers 0 and 1,
no shared tier), `send_missing_parts` runs, on every rank alike:

1. every rank says which parts of which committed steps its node's tiers 0 and 1 hold (ckpt/peer_parts.py),
   and whether it has a tier 0 to keep received parts in (one all-gather of a small JSON document);
2. `plan` takes the newest step whose parts the group holds between them, every part somewhere; for each part,
   the lowest rank holding it sends it, to every rank lacking it;
3. the part's manifest and data go over the group (broadcasts, in chunks); each receiving rank keeps them in
   its tier 0 as a replica, verified against the manifest's checksum before the manifest is written.

Then the agreement runs again and finds the step. Nothing is sent when some rank that lacks a part has no tier
0, or when no step is covered: the caller stops then (Resumable: StateUnreachableError), never starting over.
A replicated state does not come here: a peer's whole state goes over the group (trainer/regroup.py).
"""

from __future__ import annotations

import json
import logging
import mmap
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ckpt import Checkpointer, CheckpointError
from ckpt.peer_parts import Part
from core.events import emit
from trainer.errors import StateUnreachableError
from trainer.topology import Topology, collective_device

log = logging.getLogger(__name__)

_CHUNK = 16 << 20


@dataclass(frozen=True)
class Send:
    part: int
    """The saving rank whose part this is."""
    holder: int
    """The rank of this group that sends it."""
    receivers: tuple[int, ...]


def plan(held: Sequence[Mapping[str, Any]]) -> tuple[int, list[Send]] | None:
    """Pure: from every rank's {"tier0": bool, "held": {step: [world size, [part ranks]]}} (in rank order), the
    step to send and its sends, or None (nothing to send, or it cannot be done)."""
    steps = sorted({int(s) for doc in held for s in doc["held"]}, reverse=True)
    for step in steps:
        worlds = {doc["held"][str(step)][0] for doc in held if str(step) in doc["held"]}
        if len(worlds) != 1:
            continue  # two saving worlds under one step number: not one step
        world = worlds.pop()
        holders = {p: [g for g, doc in enumerate(held) if p in doc["held"].get(str(step), [0, []])[1]]
                   for p in range(world)}
        if not all(holders.values()):
            continue  # a part no rank holds: an older step may be whole
        sends = [Send(p, hs[0], tuple(g for g in range(len(held)) if g not in hs)) for p, hs in holders.items()]
        sends = [s for s in sends if s.receivers]
        if not sends or any(not held[g]["tier0"] for s in sends for g in s.receivers):
            return None
        return step, sends
    return None


def send_missing_parts(checkpointer: Checkpointer, topology: Topology) -> bool:
    """Collective (see the module docstring). True when parts were sent: agree on a step again."""
    if topology.world_size < 2:
        return False
    mine = {"tier0": checkpointer.has_tier0,
            "held": {str(step): [world, ranks] for step, (world, ranks) in checkpointer.parts_held().items()}}
    decided = plan([json.loads(doc) for doc in _all_gather_bytes(json.dumps(mine).encode())])
    if decided is None:
        return False
    step, sends = decided
    kept = 0
    for send in sends:
        kept += _send(checkpointer, topology.rank, step, send)
    if kept:
        log.info("rank %d: kept %d part(s) of step %d sent by other ranks (tier 0)", topology.rank, kept, step)
        emit("ckpt_parts_received", step=step, parts=kept)
    return True


def refuse_to_start_over(checkpointer: Checkpointer, topology: Topology, where: str) -> None:
    """Collective. A sharded group that can agree on no step while some rank holds one (a node that joined,
    or replaced a lost one, with an empty tier 1 and no shared tier) must not start over from step 0: that
    would discard the state the others hold, and its new saves would mix with the old ones. Called once the
    parts could not be sent over the group either (send_missing_parts). `where`: the checkpoint directory."""
    steps = checkpointer.available_steps()
    mine = steps[0] if steps else -1
    newest = -topology.all_min(-mine)
    if newest < 0:
        return  # a fresh run
    raise StateUnreachableError(
        f"rank {topology.rank} of {topology.world_size}: no checkpoint step can be read by every rank "
        f"(the newest some rank holds is step {newest}; this rank's newest is "
        f"{'none' if mine < 0 else f'step {mine}'}, in {where} and this node's tier 0). The parts "
        "a rank lacks go over the process group only when the group holds every part of a step between its "
        "ranks and the ranks lacking them have a tier 0 to keep them in (elastic-run gives each node one); else "
        "a new or replacement node reads them from the shared tier. Configure one (ResumeConfig.at(..., "
        "shared_url=...)), or resume on the nodes that hold the parts; nothing was deleted")


def _send(checkpointer: Checkpointer, me: int, step: int, send: Send) -> int:
    """One part from its holder to its receivers (every rank takes part in the broadcasts); 1 if kept here."""
    device = collective_device()
    with ExitStack() as stack:
        part: Part | None = None
        source: mmap.mmap | None = None
        if me == send.holder:
            try:  # opened and mapped whole before the header goes out: past it, the receivers wait for every chunk
                part = stack.enter_context(checkpointer.open_part(step, send.part))
                source = stack.enter_context(_mapped(part.state, part.nbytes))
            except (CheckpointError, OSError, ValueError) as exc:  # ValueError: a file shorter than its manifest
                log.warning("rank %d: cannot send part %d of step %d: %s", me, send.part, step, exc)
                part = None
        header = torch.tensor([len(part.manifest), part.nbytes] if part is not None else [-1, -1], dtype=torch.int64)
        manifest_len, size = (int(v) for v in _broadcast(header, send.holder, device).tolist())
        if manifest_len < 0:
            return 0  # the holder could not open it: the agreement will not find the step
        sent = _bytes(part.manifest) if part is not None else torch.empty(manifest_len, dtype=torch.uint8)
        manifest = _broadcast(sent, send.holder, device).numpy().tobytes()
        if me not in send.receivers:
            _chunks(send.holder, size, device, source, None)
            return 0
        filled = False

        def fill(view: memoryview) -> None:
            nonlocal filled
            filled = True
            _chunks(send.holder, size, device, None, view)

        try:
            checkpointer.keep_part(step, send.part, manifest=manifest, size=size, fill=fill)
            return 1
        except (CheckpointError, OSError, ValueError) as exc:
            if not filled:  # refused before the data came (its manifest, no room): its chunks still go by
                _chunks(send.holder, size, device, None, None)
            # The group stays in step; this rank will not find the step, and the agreement goes on without it.
            log.warning("rank %d: part %d of step %d sent by rank %d not kept: %s", me, send.part, step,
                        send.holder, exc)
            return 0


def _chunks(holder: int, size: int, device: torch.device, source: mmap.mmap | None, view: memoryview | None) -> None:
    for start in range(0, size, _CHUNK):
        n = min(_CHUNK, size - start)
        buf = _bytes(source[start:start + n]) if source is not None else torch.empty(n, dtype=torch.uint8)
        buf = _broadcast(buf, holder, device)
        if view is not None:
            torch.frombuffer(view[start:start + n], dtype=torch.uint8).copy_(buf)


def _broadcast(tensor: torch.Tensor, src: int, device: torch.device) -> torch.Tensor:
    on_device = tensor.to(device)
    dist.broadcast(on_device, src=src)
    return on_device.cpu()


def _bytes(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


@contextmanager
def _mapped(path: Path, size: int) -> Iterator[mmap.mmap]:
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) as mapped:
        yield mapped


def _all_gather_bytes(data: bytes) -> list[bytes]:
    """`data` of every rank, in rank order (a length all-gather, then one of the padded bytes)."""
    device = collective_device()
    world = dist.get_world_size()
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    lengths = [torch.empty_like(length) for _ in range(world)]
    dist.all_gather(lengths, length)
    sizes = [int(t.item()) for t in lengths]
    padded = torch.zeros(max(sizes), dtype=torch.uint8)
    padded[:len(data)] = _bytes(data)
    padded = padded.to(device)
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded)
    return [g.cpu().numpy().tobytes()[:n] for g, n in zip(gathered, sizes, strict=True)]
