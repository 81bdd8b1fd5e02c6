"""One elastic-run of examples/train_tiny.py (or another example), observed through the library's events
(never its stdout).

Each job gets its own event directory (ELASTIC_EVENTS_DIR); faults go in through ELASTIC_FAULTS and
the sample log is turned on with ELASTIC_SAMPLE_LOG_DIR, as the chaos harness does.
"""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from core.events import EVENTS_DIR_ENV, read_events
from core.faults import FAULTS_ENV, Fault, encode
from tests.conftest import TINY, Procs
from trainer.samples import SAMPLE_LOG_ENV


class TinyJob:
    def __init__(self, procs: Procs, work: Path, *args: str, nproc: int = 2, faults: Sequence[Fault] = (),
                 samples: Path | None = None, launcher: Sequence[str] = (), script: Path = TINY,
                 env: Mapping[str, str] | None = None) -> None:
        """elastic-run of `script` (examples/train_tiny.py by default) with `args`; `env` adds variables."""
        self.events_dir = work / "events"
        env = {EVENTS_DIR_ENV: str(self.events_dir), **(env or {})}
        if faults:
            env[FAULTS_ENV] = encode(list(faults))
        if samples is not None:
            env[SAMPLE_LOG_ENV] = str(samples)
        self.nproc = nproc
        self.proc = procs.elastic_run("--nproc-per-node", str(nproc), *launcher, str(script), *args, env=env)
        # Read the output as it comes: a test that runs several jobs and waits for one after another must not
        # leave the others blocked on a full pipe (their agents and workers then stop in a log write).
        self._lines: list[str] = []
        self.log = work / "output.log"
        """The job's whole output, also kept on disk for a failed run's post-mortem (pytest keeps the last runs'
        tmp directories): the agents' and workers' lines, a stuck worker's stacks (elastic/worker.py)."""
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "a", encoding="utf-8") as log:
            for line in self.proc.stdout:
                self._lines.append(line)
                log.write(line)
                log.flush()

    @property
    def out(self) -> str:
        """Everything the job printed so far (for failure messages only)."""
        return "".join(self._lines)

    def finish(self, timeout: float = 120, *, ok: bool = True) -> str:
        """Wait for the job; it must exit 0 (`ok`) or fail. Returns its output (for failure messages only)."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            events = [f"{e['event']}@{e.get('pid')}" for e in self.events()
                      if e["event"] not in ("step", "state_digest")]
            raise AssertionError(f"job still running after {timeout:.0f}s; its last events {events[-25:]}; "
                                 f"its output's end:\n{self.out[-4000:]}") from None
        self._reader.join(timeout=30)
        assert (self.proc.returncode == 0) == ok, self.out[-3000:]
        return self.out

    def events(self, kind: str | None = None, **match: Any) -> list[dict[str, Any]]:
        """The job's events (of `kind`, with the `match` fields), ordered by time."""
        return [e for e in read_events(str(self.events_dir))
                if (kind is None or e["event"] == kind) and all(e.get(k) == v for k, v in match.items())]

    def digest(self) -> str:
        """The final digest: every rank of the last incarnation reports one, all the same."""
        found = self.events("final_digest")
        assert len(found) == self.nproc, (found, self.out[-2000:])
        assert len({e["digest"] for e in found}) == 1, found
        return str(found[0]["digest"])

    def resumed_from(self, *, restart: int | None = None) -> int:
        """The step rank 0 of incarnation `restart` resumed from (0: a fresh start). None: the first
        incarnation after a restart that got as far as its restore (under load a restarted group can
        fail again before it, and the next one resumes)."""
        found = self.events("resumed", rank=0)
        if restart is None:
            found = [e for e in found if e.get("restart", 0) >= 1][:1]
        else:
            found = [e for e in found if e.get("restart", 0) == restart]
        assert len(found) == 1, (found, self.out[-3000:])
        return int(found[0]["step"])

    def losses(self) -> dict[int, float]:
        """Step -> rank 0's loss; a replayed step keeps its last value."""
        return {e["step"]: e["loss"] for e in self.events("step", rank=0)}
