"""The sample log: which sample ids each rank consumed at each step (for exactly-once checks).

Turned on by the environment, not by the training script: with `ELASTIC_SAMPLE_LOG_DIR=<dir>` set
(the chaos harness and tests set it), every rank appends to
`<dir>/samples-w{world}-r{rank}-c{restart}-p{pid}.jsonl` one JSON line per completed step:
`{"step": N, "epoch": E, "rank": R, "ids": [...]}`.

The ids are the ones the sampler handed out (ElasticSampler.micro_batches, or the loader's batch
sampler, which may run ahead of the loop by a few prefetched batches: it keeps them in order and
each completed step takes its `accum_steps` micro-batches off the front).

Each micro-batch is also written as it is handed out, before the step uses it, to
`<dir>/drawn-w{world}-r{rank}-c{restart}-p{pid}.jsonl`: `{"step": N, "micro": M, "rank": R, "ids": [...]}`.
A rank killed after its gradients entered the step's all-reduce but before it completed the step
never writes the step's line above, though its peers complete the step with its samples; its drawn
lines are then the record of what it consumed (chaos/samples.py).
"""

from __future__ import annotations

import json
import os
from collections import deque
from typing import IO

SAMPLE_LOG_ENV = "ELASTIC_SAMPLE_LOG_DIR"


class SampleLog:
    """This process's sample log file, opened on the first step it records."""

    def __init__(self, directory: str, *, rank: int, world_size: int) -> None:
        self.directory = directory
        self.rank = rank
        self.world_size = world_size
        self.pending: deque[list[int]] = deque()
        """Micro-batches handed out and not yet taken by a completed step, oldest first."""
        self._file: IO[str] | None = None
        self._drawn: IO[str] | None = None

    @staticmethod
    def from_env(*, rank: int, world_size: int) -> SampleLog | None:
        directory = os.environ.get(SAMPLE_LOG_ENV)
        return SampleLog(directory, rank=rank, world_size=world_size) if directory else None

    def handed_out(self, ids: list[int], *, step: int, micro: int) -> None:
        """Micro-batch `micro` of the step that completes as `step` was handed out: written at once (drawn-*)."""
        self.pending.append(ids)
        if self._drawn is None:
            self._drawn = self._open("drawn")
        self._drawn.write(json.dumps({"step": step, "micro": micro, "rank": self.rank, "ids": ids}) + "\n")
        self._drawn.flush()  # on disk before the step's collectives use it: a SIGKILL may come right after

    def restart(self) -> None:
        """A new iteration starts at the committed position: what was handed out before is void."""
        self.pending.clear()

    def record(self, *, step: int, epoch: int, micro_batches: int, fallback: list[int]) -> None:
        """Write `step`'s line: its `micro_batches` oldest pending micro-batches, or `fallback`
        when nothing was handed out through the sampler's iterators (the loop indexed it itself)."""
        ids: list[int] = []
        if self.pending:
            for _ in range(min(micro_batches, len(self.pending))):
                ids += self.pending.popleft()
        else:
            ids = fallback
        if self._file is None:
            self._file = self._open("samples")
        self._file.write(json.dumps({"step": step, "epoch": epoch, "rank": self.rank, "ids": ids}) + "\n")
        self._file.flush()  # a SIGKILLed worker's committed steps must already be on disk

    def _open(self, kind: str) -> IO[str]:
        os.makedirs(self.directory, exist_ok=True)
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        name = f"{kind}-w{self.world_size}-r{self.rank}-c{restart}-p{os.getpid()}.jsonl"
        return open(os.path.join(self.directory, name), "a", encoding="utf-8")  # noqa: SIM115 (kept open)

    def close(self) -> None:
        for f in (self._file, self._drawn):
            if f is not None:
                f.close()
        self._file = self._drawn = None
