"""The sample log: which sample ids each rank consumed at each step (for exactly-once checks).

Turned on by the environment, not by the training script: with `ELASTIC_SAMPLE_LOG_DIR=<dir>` set
(the chaos harness and tests set it), every rank appends to
`<dir>/samples-w{world}-r{rank}-c{restart}-p{pid}.jsonl` one JSON line per completed step:
`{"step": N, "epoch": E, "rank": R, "ids": [...]}`.

The ids are the ones the sampler handed out (ElasticSampler.micro_batches, or the loader's batch
sampler, which may run ahead of the loop by a few prefetched batches: it keeps them in order and
each completed step takes its `accum_steps` micro-batches off the front).
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

    @staticmethod
    def from_env(*, rank: int, world_size: int) -> SampleLog | None:
        directory = os.environ.get(SAMPLE_LOG_ENV)
        return SampleLog(directory, rank=rank, world_size=world_size) if directory else None

    def handed_out(self, ids: list[int]) -> None:
        self.pending.append(ids)

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
            os.makedirs(self.directory, exist_ok=True)
            restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            name = f"samples-w{self.world_size}-r{self.rank}-c{restart}-p{os.getpid()}.jsonl"
            self._file = open(os.path.join(self.directory, name), "a", encoding="utf-8")  # noqa: SIM115 (kept open)
        self._file.write(json.dumps({"step": step, "epoch": epoch, "rank": self.rank, "ids": ids}) + "\n")
        self._file.flush()  # a SIGKILLed worker's committed steps must already be on disk

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
