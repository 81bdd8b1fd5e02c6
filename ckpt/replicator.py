"""The background thread that replicates published tier-1 rank directories to tier 2.

Each rank runs one. Where the node's checkpoint helper runs (ckpt/helper.py), the files' bytes move in
that process (SharedTier._put_file asks it; this thread waits on a socket); the rest stays here. Jobs
are uploaded in step order. An upload whose bounded retries are spent
stays at the head of the queue and is tried again after a pause of `retry.maximum`: training never
waits for tier 2. A queued step with a newer step queued behind it is superseded and not uploaded
(unless the shared tier keeps it forever): after an outage the backlog catches up by uploading the
newest step only. Ranks may disagree on which steps they skipped; rank 0 gives up waiting for a
step once a newer one commits, so a step some rank skipped never blocks a commit.

Rank 0 also commits: after uploading step s it polls the step directory for every rank's
marker (same run, generation and world size) and then writes COMMIT, then applies shared
retention. A step is given up when `commit_timeout` passes first, or when a newer step is
committed before it (unless the shared tier keeps it forever).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path

from ckpt.commit import CommitMarker, RankMarker
from ckpt.errors import CheckpointError, SharedStorageError
from ckpt.identity import foreign
from ckpt.metrics import MetricsLog, SaveMetrics
from ckpt.retention import abandoned_steps, select_deletions
from ckpt.shared import SharedTier
from core.deadline import Deadline
from core.events import emit

logger = logging.getLogger(__name__)


@dataclass
class UploadJob:
    """One published rank directory to replicate."""

    step: int
    rank_dir: Path
    files: list[str]
    """Names to upload, in order: data files first, manifest.json last."""
    manifest_sha256: str
    nbytes: int
    metrics: SaveMetrics
    published_at: float
    done: threading.Event = field(default_factory=threading.Event)
    """Set when the job is finished: uploaded (rank 0: committed) or given up."""


@dataclass
class _Awaiting:
    job: UploadJob
    deadline: Deadline
    missing: list[int] = field(default_factory=list)


class Replicator:
    """Uploads this rank's checkpoints in the background; on rank 0, commits them too."""

    def __init__(
        self,
        tier: SharedTier,
        *,
        rank: int,
        world_size: int,
        generation: str,
        metrics: MetricsLog,
        stop: threading.Event,
        after_progress: Callable[[Collection[int] | None], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.tier = tier
        self.rank = rank
        self.world_size = world_size
        self.generation = generation
        self._metrics = metrics
        self._stop = stop
        self._after_progress = after_progress
        self._clock = clock
        self._cond = threading.Condition()
        self._queue: list[UploadJob] = []
        self._current: UploadJob | None = None
        self._working = False  # the thread is inside one round (upload, commit, retention)
        self._awaiting: dict[int, _Awaiting] = {}
        self._closing = False
        self._world_over = False
        """Set by `close(world_over=True)`: no rank of this world uploads anything more than it already has."""
        self._thread: threading.Thread | None = None
        self.last_replicated: int | None = None
        """The newest step whose upload (rank 0: commit) this rank finished."""
        self.last_error: str | None = None
        """The latest tier-2 failure, cleared by the next success."""
        self.saved: set[int] = set()
        """Steps this rank enqueued (its saves); see ckpt/retention.py on abandoned steps."""

    # -- API -----------------------------------------------------------------------------

    def enqueue(self, job: UploadJob) -> None:
        with self._cond:
            if self._closing:
                raise RuntimeError("the replicator is closed")
            self._queue.append(job)
            self.saved.add(job.step)
            self._queue.sort(key=lambda j: j.step)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name=f"ckpt-replicator-r{self.rank}", daemon=True
                )
                self._thread.start()
            self._cond.notify_all()

    def pending_steps(self) -> list[int]:
        """Steps queued, uploading, or (rank 0) waiting for the other ranks."""
        with self._cond:
            steps = {j.step for j in self._queue} | set(self._awaiting)
            if self._current is not None:
                steps.add(self._current.step)
            return sorted(steps)

    def uploading(self) -> int | None:
        """The step whose files are being uploaded now, if any (its local copy must stay: ckpt/retention.py)."""
        with self._cond:
            return self._current.step if self._current is not None else None

    def wait_idle(self, timeout: float | None) -> bool:
        deadline = Deadline.after(timeout, clock=self._clock)
        with self._cond:
            while self._queue or self._current is not None or self._awaiting or self._working:
                if deadline.expired():
                    return False
                self._cond.wait(deadline.capped(0.5))
            return True

    def close(self, timeout: float | None, *, world_over: bool = False) -> bool:
        """Finish pending uploads for up to `timeout` s, then stop the thread and join it.

        `world_over`: the world this replicator saves for has ended (an in-place re-formation, trainer/regroup.py):
        its other ranks are gone or are closing their own replicators, so rank 0 commits the steps every rank
        has uploaded by the time its own uploads are done and gives up the others at once, instead of waiting
        for a lost rank's marker that can never come (`commit_timeout`, or all of `timeout` on the re-formation's
        critical path)."""
        if world_over:
            with self._cond:
                self._world_over = True
                self._cond.notify_all()
        idle = self.wait_idle(timeout)
        with self._cond:
            self._closing = True
            pending = self.pending_steps_locked()
            self._cond.notify_all()
        if not idle:
            logger.warning(
                "rank %d: closing with steps %s not replicated to %s (last error: %s); their "
                "local copies stay",
                self.rank,
                pending,
                self.tier.url,
                self.last_error,
            )
        self._stop.set()  # interrupts retry sleeps
        thread = self._thread
        if thread is not None:
            thread.join(30.0)
            if thread.is_alive():
                logger.error("rank %d: replicator thread did not stop within 30s", self.rank)
                return False
        return idle

    def pending_steps_locked(self) -> list[int]:
        steps = {j.step for j in self._queue} | set(self._awaiting)
        if self._current is not None:
            steps.add(self._current.step)
        return sorted(steps)

    # -- thread --------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException:  # thread boundary
            logger.exception("rank %d: replicator thread failed", self.rank)
            raise

    def _loop(self) -> None:
        poll = min(0.5, self.tier.config.retry.initial.total_seconds())
        while not self._stop.is_set():
            with self._cond:
                while not self._queue and not self._awaiting and not self._stop.is_set():
                    if self._closing:
                        return
                    self._cond.wait()
                if self._stop.is_set():
                    return
                superseded = self._drop_superseded_locked()
                job = self._queue.pop(0) if self._queue else None
                self._current = job
                self._working = True
            for old in superseded:
                self._supersede(old, by=job.step if job is not None else None)
            retry_later = False
            try:
                retry_later = self._round(job)
            except Exception:  # thread boundary: log, keep the job, keep replicating
                logger.exception("rank %d: replication round failed; retrying later", self.rank)
                retry_later = job is not None
                self.last_error = "replication round failed (see the log)"
            finally:
                with self._cond:
                    self._current = None
                    if retry_later:
                        assert job is not None
                        self._queue.insert(0, job)
                    self._working = False
                    self._cond.notify_all()
            if retry_later:
                self._stop.wait(self.tier.config.retry.maximum.total_seconds())
            else:
                with self._cond:
                    if job is None and self._awaiting and not self._queue:
                        self._cond.wait(poll)

    def _round(self, job: UploadJob | None) -> bool:
        """Upload `job`, then (rank 0) try to commit, then local retention; True: retry `job` later."""
        if job is not None and not self._upload(job):
            # Tier 2 is failing: tier-1 retention runs all the same, taking nothing there as committed (it keeps the
            # step being uploaded and those tier 2 keeps forever). Skipped, a long outage filled the disk.
            self._progress(frozenset())
            return True
        committed = self._poll_commits() if self.rank == 0 else None
        self._progress(committed)
        return False

    def _progress(self, committed: Collection[int] | None) -> None:
        try:
            self._after_progress(committed)
        except Exception:  # thread boundary: retention must not stop replication
            logger.exception("rank %d: local retention failed", self.rank)

    def _upload(self, job: UploadJob) -> bool:
        """Upload one job; False if it should be tried again later."""
        started = self._clock()
        self._metrics.update(job.metrics, status="uploading")
        if self.tier.fence is not None:
            self._give_up(job, f"not uploading step {job.step}: {self.tier.fence}")
            return True
        try:
            self.tier.ensure_identity()
            existing = self.tier.read_commit(job.step)
            other = None if existing is None else foreign(existing, self.tier.identity, name=self.tier.run_name)
            if other is not None:
                self._give_up(
                    job,
                    f"{self.tier.describe(self.tier.commit_path(job.step))} is committed by "
                    f"{other}, not by this run; not replacing it (move it away)",
                )
                return True
            if existing is not None:
                if (
                    existing.generation == self.generation
                    and existing.manifests is not None
                    and existing.manifests.get(self.rank) == job.manifest_sha256
                ):
                    self._finish(job, started, committed=self.rank == 0)
                    return True
                logger.warning(
                    "%s is committed by another attempt; un-committing it before re-uploading",
                    self.tier.describe(self.tier.commit_path(job.step)),
                )
                self.tier.uncommit(job.step)
            for name in job.files:
                self.tier.upload_file(job.rank_dir / name, job.step, self.rank, name)
            self.tier.write_marker(
                RankMarker(
                    step=job.step,
                    rank=self.rank,
                    world_size=self.world_size,
                    run=self.tier.run_name,
                    generation=self.generation,
                    manifest_sha256=job.manifest_sha256,
                    bytes=job.nbytes,
                )
            )
        except SharedStorageError as exc:
            self.last_error = str(exc)
            self._metrics.update(job.metrics, error=str(exc))
            logger.warning("rank %d: upload of step %d failed: %s", self.rank, job.step, exc)
            return False
        except (CheckpointError, OSError) as exc:
            # The local copy is gone or damaged (e.g. deleted by hand): nothing to retry.
            self._give_up(job, f"upload of step {job.step} from {job.rank_dir} failed: {exc}")
            return True
        self.last_error = None
        if self.rank == 0:
            deadline = Deadline.after(self.tier.config.commit_timeout, clock=self._clock)
            with self._cond:
                self._awaiting[job.step] = _Awaiting(job, deadline)
        else:
            self._finish(job, started, committed=False)
        return True

    def _finish(self, job: UploadJob, started: float, *, committed: bool) -> None:
        self.last_replicated = max(job.step, self.last_replicated or job.step)
        tier2_s = self._clock() - job.published_at
        self._metrics.update(
            job.metrics,
            log=True,
            status="committed" if committed else "uploaded",
            tier2_s=tier2_s,
            error=None,
        )
        if committed:
            emit("ckpt_saved", step=job.step, tier="shared", seconds=round(tier2_s, 3))
        job.done.set()

    def _drop_superseded_locked(self) -> list[UploadJob]:
        """Take the queued steps that have a newer step queued behind them off the queue."""
        keep_every = self.tier.config.keep_every
        if len(self._queue) < 2:
            return []
        newest = self._queue[-1].step
        dropped = [j for j in self._queue[:-1] if j.step < newest and (keep_every is None or j.step % keep_every)]
        self._queue = [j for j in self._queue if all(j is not d for d in dropped)]
        return dropped

    def _supersede(self, job: UploadJob, *, by: int | None) -> None:
        logger.info("rank %d: not uploading step %d: superseded by step %s", self.rank, job.step, by)
        self._metrics.update(job.metrics, log=True, status="superseded", error=None)
        job.done.set()

    def _give_up(self, job: UploadJob, why: str) -> None:
        self.last_error = why
        self._metrics.update(job.metrics, log=True, status="abandoned", error=why)
        emit("ckpt_failed", step=job.step, tier="shared", error=why)
        job.done.set()

    def _poll_commits(self) -> set[int] | None:
        """Commit every awaited step whose ranks all uploaded; the shared committed steps if known."""
        with self._cond:
            awaiting = sorted(self._awaiting.items())
        if not awaiting:
            return None
        with self._cond:
            final = self._world_over and not self._queue  # this rank's own uploads are done: no marker comes later
        committed_now: set[int] | None = None
        for step, item in awaiting:
            newest = self.last_replicated
            keep_every = self.tier.config.keep_every
            if newest is not None and newest > step and (keep_every is None or step % keep_every):
                self._drop_awaiting(step)
                self._give_up(
                    item.job,
                    f"step {step} was superseded by step {newest} before "
                    f"every rank had uploaded it",
                )
                continue
            try:
                markers = self.tier.read_markers(step)
            except SharedStorageError as exc:
                self.last_error = str(exc)
                logger.warning("rank 0: cannot check the markers of step %d: %s", step, exc)
                continue
            good = {
                r: m
                for r, m in markers.items()
                if m.step == step
                and m.run == self.tier.run_name
                and m.generation == self.generation
                and m.world_size == self.world_size
            }
            missing = [r for r in range(self.world_size) if r not in good]
            if missing:
                item.missing = missing
                if final:
                    self._drop_awaiting(step)
                    self._give_up(
                        item.job,
                        f"ranks {missing} had not uploaded step {step} to {self.tier.url} when the world of "
                        f"{self.world_size} ranks ended (a re-formation); the step stays uncommitted there",
                    )
                elif item.deadline.expired():
                    self._drop_awaiting(step)
                    self._give_up(
                        item.job,
                        f"ranks {missing} did not upload step {step} to {self.tier.url} within "
                        f"{self.tier.config.commit_timeout}; the step stays uncommitted there",
                    )
                continue
            if self.tier.fence is not None:
                self._drop_awaiting(step)
                self._give_up(item.job, f"not committing step {step}: {self.tier.fence}")
                continue
            assert self.tier.identity is not None  # claimed before the upload
            marker = CommitMarker(
                step=step,
                world_size=self.world_size,
                generation=self.generation,
                run=self.tier.run_name,
                manifests={r: m.manifest_sha256 for r, m in good.items()},
                run_uid=self.tier.identity.uid,
            )
            try:
                self.tier.write_commit(marker)
            except SharedStorageError as exc:
                self.last_error = str(exc)
                logger.warning("rank 0: cannot commit step %d: %s", step, exc)
                continue
            logger.info(
                "committed step %d in %s (world size %d)", step, self.tier.url, self.world_size
            )
            self._drop_awaiting(step)
            self._finish(item.job, item.job.published_at, committed=True)
            committed_now = self._shared_retention()
        return committed_now

    def _drop_awaiting(self, step: int) -> None:
        with self._cond:
            self._awaiting.pop(step, None)
            self._cond.notify_all()

    def _shared_retention(self) -> set[int] | None:
        """Delete shared steps beyond retention; return the committed steps that remain."""
        config = self.tier.config
        try:
            steps = self.tier.steps()
            committed = set(self.tier.committed(steps))
            with self._cond:
                protected = set(self._awaiting) | {j.step for j in self._queue}
            with self._cond:
                saved = set(self.saved)
            abandoned = abandoned_steps(committed, saved=saved, unreadable=self.tier.unreadable)
            doomed = select_deletions(
                committed=committed,
                present=steps,
                keep_last=config.keep_last,
                keep_every=config.keep_every,
                protected=protected | self.tier.foreign_steps,
                abandoned=abandoned,
            )
            kept: set[int] = set()
            for step in doomed:
                why = "abandoned: unreadable, or newer than this run's restart" if step in abandoned else "retention"
                logger.info("removing step %d from %s (%s)", step, self.tier.url, why)
                try:
                    self.tier.delete_step(step)
                except CheckpointError as exc:  # e.g. a link out of the tree there: the other steps still go
                    if isinstance(exc, SharedStorageError):
                        raise  # the store failing: this round of retention ends
                    logger.warning("shared retention: step %d not removed: %s", step, exc)
                    kept.add(step)
        except CheckpointError as exc:
            logger.warning("shared retention skipped: %s", exc)
            return None
        return committed - (set(doomed) - kept)
