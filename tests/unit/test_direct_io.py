"""ckpt/direct_io.py: a tier-1 file's whole blocks written around the page cache, the rest through it, on the
test machine's real file system (ext4 on the dev and CI machines)."""

from __future__ import annotations

import errno
import fcntl
import json
import mmap
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import ckpt.direct_io as direct_io
import ckpt.persist
from ckpt.checksum import digest_parts
from ckpt.direct_io import ALIGN, direct_plan, write_parts
from ckpt.errors import CheckpointWriteError
from ckpt.helper_process import SlotImages
from ckpt.layout import MANIFEST_FILE, STATE_FILE, Layout
from ckpt.persist import persist_rank, write_all
from tests.conftest import REPO

pytestmark = pytest.mark.timeout(60)


def direct_supported(where: Path) -> bool:
    probe = where / "probe"
    probe.write_bytes(b"")
    try:
        os.close(os.open(probe, os.O_WRONLY | direct_io.O_DIRECT))
        return bool(direct_io.O_DIRECT)
    except OSError:
        return False
    finally:
        probe.unlink()


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(direct_io, "_refused", set())  # no earlier test's refusal carries over


def aligned(data: bytes) -> memoryview:
    """`data` in page-aligned, writable memory (as a tier-0 slot's mapping is)."""
    region = mmap.mmap(-1, len(data))
    region[:] = data
    return memoryview(region)


class Recorder:
    """persist.write_all, recording each call's length and whether its fd writes direct."""

    def __init__(self) -> None:
        self.calls: list[tuple[bool, int]] = []

    def __call__(self, fd: int, data: memoryview) -> None:
        self.calls.append((bool(fcntl.fcntl(fd, fcntl.F_GETFL) & direct_io.O_DIRECT), len(data)))
        write_all(fd, data)


def write(path: Path, parts: list[memoryview], recorder: Recorder) -> bool:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        return write_parts(fd, path, parts, recorder, direct_plan(parts, path.parent))
    finally:
        os.close(fd)


def test_an_aligned_parts_whole_blocks_go_direct_and_its_tail_through_the_page_cache(tmp_path: Path,
                                                                                    fresh: None) -> None:
    if not direct_supported(tmp_path):
        pytest.skip(f"the file system of {tmp_path} refuses O_DIRECT")
    data = os.urandom(3 * ALIGN + 123)
    recorder = Recorder()
    assert write(tmp_path / "f", [aligned(data)], recorder) is True
    assert recorder.calls == [(True, 3 * ALIGN), (False, 123)]
    assert (tmp_path / "f").read_bytes() == data


def test_parts_that_are_not_aligned_are_written_through_the_page_cache(tmp_path: Path, fresh: None) -> None:
    header, body = os.urandom(100), os.urandom(2 * ALIGN)
    recorder = Recorder()
    # the worker's own file: a header, then the staging buffer at an offset that is not a block's
    assert direct_plan([memoryview(header), aligned(body)], tmp_path) == [0, 0]
    assert write(tmp_path / "f", [memoryview(header), aligned(body)], recorder) is False
    assert recorder.calls == [(False, 100), (False, 2 * ALIGN)]
    assert (tmp_path / "f").read_bytes() == header + body
    assert direct_plan([memoryview(bytes(body))], tmp_path) == [0]  # read-only memory: no address to hand over


def test_a_file_system_that_refuses_direct_writes_gets_buffered_ones_and_is_not_asked_again(
        tmp_path: Path, fresh: None, caplog: pytest.LogCaptureFixture) -> None:
    data = os.urandom(2 * ALIGN + 7)
    calls: list[bool] = []

    def refusing(fd: int, view: memoryview) -> None:
        is_direct = bool(fcntl.fcntl(fd, fcntl.F_GETFL) & direct_io.O_DIRECT)
        calls.append(is_direct)
        if is_direct:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        write_all(fd, view)

    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        with caplog.at_level("INFO", logger="ckpt.direct_io"):
            used = write_parts(fd, tmp_path / "f", [aligned(data)], refusing, [2 * ALIGN])
    finally:
        os.close(fd)
    if not direct_supported(tmp_path):  # refused at open already: the same outcome, without the first call
        assert calls == [False]
    else:
        assert calls == [True, False]  # the blocks again through the page cache, the tail with them
    assert used is False and (tmp_path / "f").read_bytes() == data
    assert "refuses O_DIRECT" in caplog.text and str(tmp_path) in caplog.text
    assert os.stat(tmp_path / "f").st_dev in direct_io._refused
    assert direct_plan([aligned(data)], tmp_path) == [0]  # not tried again on that device
    recorder = Recorder()
    assert write(tmp_path / "g", [aligned(data)], recorder) is False
    assert recorder.calls == [(False, len(data))]


def test_a_write_cut_short_after_blocks_went_direct_is_finished_through_the_page_cache(
        tmp_path: Path, fresh: None) -> None:
    if not direct_supported(tmp_path):
        pytest.skip(f"the file system of {tmp_path} refuses O_DIRECT")
    first, second = os.urandom(2 * ALIGN), os.urandom(3 * ALIGN)
    calls: list[tuple[bool, int]] = []

    def short_then_refused(fd: int, view: memoryview) -> None:
        is_direct = bool(fcntl.fcntl(fd, fcntl.F_GETFL) & direct_io.O_DIRECT)
        calls.append((is_direct, len(view)))
        if is_direct and len(calls) > 1:  # the second part's direct write stops at an unaligned byte count
            write_all(fd, view[:100])
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        write_all(fd, view)

    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        parts = [aligned(first), aligned(second)]
        assert write_parts(fd, tmp_path / "f", parts, short_then_refused, direct_plan(parts, tmp_path)) is True
    finally:
        os.close(fd)
    assert calls == [(True, 2 * ALIGN), (True, 3 * ALIGN), (False, 3 * ALIGN)]
    assert (tmp_path / "f").read_bytes() == first + second
    assert not direct_io._refused  # the file system took direct writes: not marked as refusing them


def slot_in_shm(shm: Path, data: bytes) -> tuple[Path, memoryview]:
    """A tier-0 slot file and the helper's view of it (ckpt/helper_process.py: private, writable, unwritten)."""
    path = shm / "state.safetensors"
    path.write_bytes(data)
    return path, SlotImages().view(path, len(data))


def verify(written_dir: Path, data: bytes) -> None:
    assert (written_dir / STATE_FILE).read_bytes() == data
    entry = json.loads((written_dir / MANIFEST_FILE).read_text())["files"][STATE_FILE]
    checksum = entry["checksum"]
    expected = digest_parts([memoryview(data)], algorithm=checksum["algorithm"], chunk_bytes=checksum["chunk_bytes"])
    assert entry["bytes"] == len(data) and checksum["digest"] == expected.digest


@pytest.mark.parametrize("threads", [0, 2], ids=["no-pool", "pool"])
def test_the_helpers_persist_goes_direct_verifies_and_gives_the_slot_back_only_when_done_with_it(
        tmp_path: Path, shm: Path, fresh: None, monkeypatch: pytest.MonkeyPatch, threads: int) -> None:
    if not direct_supported(tmp_path):
        pytest.skip(f"the file system of {tmp_path} refuses O_DIRECT")
    data = os.urandom(5 * ALIGN + 1000)
    path, slot = slot_in_shm(shm, data)
    recorder = Recorder()
    monkeypatch.setattr(ckpt.persist, "write_all", recorder)
    mapped: list[str] = []
    real_mmap = mmap.mmap

    def mapping(fd: int, *args: object, **kwargs: object) -> mmap.mmap:
        if fd >= 0:
            mapped.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real_mmap(fd, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(mmap, "mmap", mapping)
    released: list[bool] = []

    def release() -> None:  # the worker writes its next snapshot into the slot at once
        released.append(True)
        with open(path, "r+b") as f, mmap.mmap(f.fileno(), len(data)) as shared:
            shared[:] = b"\1" * len(data)

    pool = ThreadPoolExecutor(threads) if threads else None
    try:
        written = persist_rank(Layout(tmp_path / "ckpt"), step=3, rank=0, world_size=1, generation="g",
                               parts=[slot], tensors={}, skeleton={}, checksum="sha256", pool=pool, release=release)
    finally:
        if pool is not None:
            pool.shutdown()
    assert released == [True]
    assert recorder.calls == [(True, 5 * ALIGN), (False, 1000)]
    assert [m for m in mapped if ".tmp-rank" in m] == []  # hashed from the slot, not read back from the disk
    verify(written.path, data)
    assert bytes(slot[:4]) == b"\1" * 4  # the direct write did not copy the helper's view of the slot


def test_a_full_disk_during_a_direct_write_fails_the_persist_and_leaves_nothing(
        tmp_path: Path, shm: Path, fresh: None, monkeypatch: pytest.MonkeyPatch) -> None:
    if not direct_supported(tmp_path):
        pytest.skip(f"the file system of {tmp_path} refuses O_DIRECT")
    _, slot = slot_in_shm(shm, os.urandom(4 * ALIGN))

    def full(fd: int, view: memoryview) -> None:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & direct_io.O_DIRECT:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        write_all(fd, view)

    monkeypatch.setattr(ckpt.persist, "write_all", full)
    released: list[bool] = []
    layout = Layout(tmp_path / "ckpt")
    with pytest.raises(CheckpointWriteError, match="step 4.*No space left"):
        persist_rank(layout, step=4, rank=0, world_size=1, generation="g", parts=[slot], tensors={}, skeleton={},
                     checksum="sha256", pool=None, release=lambda: released.append(True))
    assert released == []  # the caller still holds the slot, and frees it
    assert list(layout.step_dir(4).iterdir()) == []  # no partial rank directory
    assert not direct_io._refused


def test_direct_writes_can_be_turned_off_from_the_environment() -> None:
    code = "import ckpt.direct_io as d; print(d.O_DIRECT)"
    for value, on in (("0", False), ("1", True)):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True,
                             cwd=REPO, env={**os.environ, "ELASTIC_DIRECT_IO": value}).stdout
        assert (int(out) != 0) == (on and bool(getattr(os, "O_DIRECT", 0)))


def test_the_writers_chunks_are_whole_blocks() -> None:
    assert ckpt.persist.WRITE_CHUNK % ALIGN == 0  # else every direct write past the first chunk is refused
