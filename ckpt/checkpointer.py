"""Synchronous checkpoints of one rank's state in the tier-1 (node-local) directory."""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ckpt.commit import CommitMarker, parse_commit
from ckpt.config import CheckpointConfig
from ckpt.durable import (
    discard_tree,
    fsync_dir,
    publish_dir,
    remove_quietly,
    write_atomic,
    write_new_file,
)
from ckpt.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointVersionError,
    CheckpointWriteError,
)
from ckpt.format import corrupt
from ckpt.layout import MANIFEST_FILE, STATE_FILE, TMP_PREFIX, Layout
from ckpt.manifest import FileEntry, Manifest, TensorEntry, parse_manifest, resolve_file
from ckpt.safetensors_io import check_storable, dtype_name, read_safetensors, write_safetensors
from ckpt.tree import flatten, unflatten

logger = logging.getLogger(__name__)

_HASH_CHUNK = 8 << 20


class Checkpointer:
    """Saves, commits, lists and loads checkpoints of one rank under `config.local_dir`.

    Each rank calls `save(step, state)`; once every rank's save returned, one process per
    local_dir calls `commit(step)`. Only committed steps are listed or loaded.
    """

    def __init__(self, config: CheckpointConfig, *, rank: int, world_size: int) -> None:
        _check_index("world_size", world_size, minimum=1)
        _check_index("rank", rank, minimum=0)
        if rank >= world_size:
            raise ValueError(f"rank {rank} must be below world_size {world_size}")
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self._layout = Layout(Path(config.local_dir))

    # -- writing -------------------------------------------------------------------------

    def save(self, step: int, state: Mapping[str, Any]) -> Path:
        """Write this rank's `state` for `step` atomically; return the rank directory.

        Raises TypeError/ValueError for a state that cannot be stored (before any I/O) and
        CheckpointWriteError when the disk refuses (the partial write is removed first).
        Saving a step that is committed here un-commits it first; commit it again afterwards.
        """
        _check_index("step", step, minimum=0)
        if not isinstance(state, Mapping):
            raise TypeError(f"state must be a Mapping, got {type(state).__name__}")
        tensors, skeleton = flatten(state)
        for name, tensor in tensors.items():
            check_storable(name, tensor)  # TypeError before touching the disk
        step_dir = self._layout.step_dir(step)
        final = self._layout.rank_dir(step, self.rank)
        started = time.monotonic()
        tmp: Path | None = None
        try:
            self._uncommit(step)
            if not step_dir.is_dir():
                step_dir.mkdir(parents=True, exist_ok=True)
                fsync_dir(step_dir.parent)
            tmp = self._layout.temp_rank_dir(step, self.rank)
            tmp.mkdir()
            nbytes, sha256 = write_safetensors(tmp / STATE_FILE, tensors, metadata={"format": "pt"})
            manifest = Manifest(
                step=step,
                rank=self.rank,
                world_size=self.world_size,
                files={STATE_FILE: FileEntry(sha256, nbytes)},
                tensors={
                    name: TensorEntry(STATE_FILE, dtype_name(t.dtype), tuple(t.shape))
                    for name, t in tensors.items()
                },
                state=skeleton,
            )
            write_new_file(tmp / MANIFEST_FILE, manifest.to_bytes())
            fsync_dir(tmp)
            publish_dir(tmp, final)
            tmp = None
        except OSError as exc:
            raise CheckpointWriteError(
                f"could not write rank {self.rank} of step {step} under {step_dir}: "
                f"{_strerror(exc)}; nothing of this attempt is visible. Free disk space or "
                f"fix permissions on {self._layout.root}, then save again",
                path=step_dir,
            ) from exc
        finally:
            if tmp is not None:
                remove_quietly(tmp)
        logger.info(
            "saved rank %d of step %d: %d tensors, %d bytes in %.3fs to %s",
            self.rank,
            step,
            len(tensors),
            nbytes,
            time.monotonic() - started,
            final,
        )
        return final

    def _uncommit(self, step: int) -> None:
        # Saving a step that is already committed here (a group that resumed from an older
        # step because another node lacked this one) replaces it. Remove COMMIT first, so
        # that until the new commit the step is invisible rather than a mix of two saves.
        commit_path = self._layout.commit_path(step)
        if commit_path.exists():
            logger.warning("step %d is committed in %s; replacing it", step, commit_path.parent)
            commit_path.unlink(missing_ok=True)
            fsync_dir(commit_path.parent)

    def commit(self, step: int) -> None:
        """Mark `step` complete in this local_dir, then delete checkpoints beyond retention.

        Call from one process per local_dir, after every rank's `save(step)` returned.
        """
        _check_index("step", step, minimum=0)
        step_dir = self._layout.step_dir(step)
        rank_dirs = self._layout.rank_dirs(step)
        if not any(rank < self.world_size for rank in rank_dirs):
            raise CheckpointNotFoundError(
                f"nothing was saved for step {step} in {step_dir}; call save({step}, ...) on "
                f"every rank before commit({step})",
                path=step_dir,
            )
        marker = CommitMarker(step=step, world_size=self.world_size)
        for rank, path in rank_dirs.items():
            if rank >= self.world_size:  # left by an earlier save with a larger world
                _discard_quietly(path)
        try:
            write_atomic(self._layout.commit_path(step), marker.to_bytes())
        except OSError as exc:
            raise CheckpointWriteError(
                f"could not write {self._layout.commit_path(step)}: {_strerror(exc)}; step "
                f"{step} stays uncommitted. Free disk space or fix permissions, then commit again",
                path=step_dir,
            ) from exc
        logger.info("committed step %d (world size %d) in %s", step, self.world_size, step_dir)
        self._apply_retention()

    def _apply_retention(self) -> None:
        committed = self.committed_steps()
        if not committed:
            return
        newest = committed[0]
        keep = set(committed[: self.config.keep_last])
        for step, path in sorted(self._layout.step_dirs().items()):
            if step in keep:
                for entry in _list_dir(path):
                    if entry.name.startswith(TMP_PREFIX):
                        logger.info("removing stale %s", entry)
                        remove_quietly(entry)
            elif step in committed or step < newest:
                logger.info(
                    "removing %s step %d (%s)",
                    "committed" if step in committed else "uncommitted",
                    step,
                    path,
                )
                _discard_quietly(path)
        for entry in _list_dir(self._layout.root):
            if entry.name.startswith(TMP_PREFIX):
                remove_quietly(entry)

    # -- reading -------------------------------------------------------------------------

    def committed_steps(self) -> list[int]:
        """Committed steps in local_dir, newest first. A step with a damaged COMMIT is skipped."""
        steps = []
        for step in self._layout.step_dirs():
            try:
                if self._read_commit(step) is None:
                    continue
            except CheckpointVersionError:
                pass  # committed by a newer version: listed, so load() says "upgrade"
            except CheckpointCorruptError as exc:
                logger.warning("ignoring step %d: %s", step, exc)
                continue
            steps.append(step)
        return sorted(steps, reverse=True)

    def latest(self) -> int | None:
        """The newest committed step, or None if there is none."""
        steps = self.committed_steps()
        return steps[0] if steps else None

    def has_rank(self, step: int, rank: int) -> bool:
        """Whether `step` is committed here and this local_dir holds rank `rank` of it."""
        try:
            marker = self._read_commit(step)
        except CheckpointCorruptError:
            return False
        return (
            marker is not None
            and rank < marker.world_size
            and self._layout.rank_dir(step, rank).is_dir()
        )

    def saved_world_size(self, step: int) -> int:
        """The world size that wrote committed `step`."""
        return self._require_commit(step).world_size

    def load(self, step: int, *, rank: int | None = None) -> dict[str, Any]:
        """Load rank `rank` (default: this rank) of committed `step`.

        Checks the manifest, then each file's size and sha256, before deserialising.
        Tensors come back on the CPU. Raises CheckpointNotFoundError when the step is not
        committed here or this local_dir lacks that rank, CheckpointCorruptError /
        CheckpointVersionError naming the file at fault.
        """
        _check_index("step", step, minimum=0)
        rank = self.rank if rank is None else rank
        _check_index("rank", rank, minimum=0)
        marker = self._require_commit(step)
        rank_dir = self._layout.rank_dir(step, rank)
        if rank >= marker.world_size or not rank_dir.is_dir():
            raise CheckpointNotFoundError(
                f"rank {rank} of step {step} is not in {self._layout.step_dir(step)} "
                f"(saved by world size {marker.world_size}); this node did not write it: "
                f"fetch it from the node that did or load another step",
                path=rank_dir,
            )
        manifest_path = rank_dir / MANIFEST_FILE
        try:
            data = manifest_path.read_bytes()
        except FileNotFoundError as exc:
            raise corrupt(manifest_path, "manifest is missing") from exc
        except OSError as exc:
            raise corrupt(manifest_path, f"manifest cannot be read ({_strerror(exc)})") from exc
        manifest = parse_manifest(data, path=manifest_path)
        if (manifest.step, manifest.rank) != (step, rank):
            raise corrupt(
                manifest_path,
                f"manifest describes step {manifest.step} rank {manifest.rank}, "
                f"expected step {step} rank {rank}",
            )
        tensors: dict[str, Any] = {}
        for name, entry in manifest.files.items():
            path = resolve_file(rank_dir, name, manifest_path=manifest_path)
            _verify_file(path, entry)
            file_tensors = read_safetensors(path)
            expected = {n: t for n, t in manifest.tensors.items() if t.file == name}
            if set(file_tensors) != set(expected):
                raise corrupt(path, f"its tensors differ from those listed in {manifest_path}")
            for tname, tensor in file_tensors.items():
                want = expected[tname]
                if dtype_name(tensor.dtype) != want.dtype or tuple(tensor.shape) != want.shape:
                    raise corrupt(
                        path,
                        f"tensor {tname!r} is {tensor.dtype}{list(tensor.shape)}, "
                        f"{manifest_path} says {want.dtype}{list(want.shape)}",
                    )
            tensors.update(file_tensors)
        try:
            state = unflatten(manifest.state, tensors)
        except (ValueError, RecursionError) as exc:
            raise corrupt(manifest_path, f"its 'state' cannot be rebuilt: {exc}") from exc
        if not isinstance(state, dict):
            raise corrupt(manifest_path, f"its 'state' is a {type(state).__name__}, not a dict")
        logger.info("loaded rank %d of step %d from %s", rank, step, rank_dir)
        return state

    def _require_commit(self, step: int) -> CommitMarker:
        marker = self._read_commit(step)
        if marker is None:
            path = self._layout.commit_path(step)
            raise CheckpointNotFoundError(
                f"step {step} is not committed in {self._layout.root} (no {path}); "
                f"committed steps: {self.committed_steps() or 'none'}",
                path=path,
            )
        return marker

    def _read_commit(self, step: int) -> CommitMarker | None:
        """The step's COMMIT marker, or None if it has none."""
        path = self._layout.commit_path(step)
        try:
            data = path.read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            raise CheckpointError(f"cannot read {path}: {_strerror(exc)}", path=path) from exc
        return parse_commit(data, path=path, step=step)


def _verify_file(path: Path, entry: FileEntry) -> None:
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size != entry.bytes:
                raise corrupt(
                    path, f"file is {size} bytes, the manifest says {entry.bytes} (truncated?)"
                )
            digest = hashlib.sha256()
            while chunk := f.read(_HASH_CHUNK):
                digest.update(chunk)
    except FileNotFoundError as exc:
        raise corrupt(path, "file listed in the manifest is missing") from exc
    except OSError as exc:
        raise corrupt(path, f"file cannot be read ({_strerror(exc)})") from exc
    if digest.hexdigest() != entry.sha256:
        raise corrupt(path, "sha256 does not match the manifest (bit rot or a partial write)")


def _discard_quietly(path: Path) -> None:
    try:
        discard_tree(path)
    except OSError as exc:
        logger.warning("could not remove %s: %s", path, exc)


def _list_dir(path: Path) -> list[Path]:
    try:
        return list(path.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []


def _check_index(what: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{what} must be an int >= {minimum}, got {value!r}")


def _strerror(exc: OSError) -> str:
    if exc.errno is not None:
        return f"{os.strerror(exc.errno)} ({errno.errorcode.get(exc.errno, exc.errno)})"
    return str(exc)
