"""ckpt/direct_io.py: a tier-1 file's whole blocks written around the page cache, the rest through it, on the
test machine's real file system (ext4 on the dev and CI machines)."""

from __future__ import annotations

import errno
import fcntl
import json
import mmap
import os
from pathlib import Path

import pytest

import ckpt.direct_io as direct_io
from ckpt.checksum import digest_parts
from ckpt.direct_io import ALIGN, direct_plan, write_parts
from ckpt.layout import MANIFEST_FILE, STATE_FILE, Layout
from ckpt.persist import persist_rank, write_all

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
        assert calls == [False, False] or calls == [False]
    else:
        assert calls == [True, False]  # the blocks again through the page cache, the tail with them
    assert used is False and (tmp_path / "f").read_bytes() == data
    assert "refuses O_DIRECT" in caplog.text and str(tmp_path) in caplog.text
    assert os.stat(tmp_path / "f").st_dev in direct_io._refused
    assert direct_plan([aligned(data)], tmp_path) == [0]  # not tried again on that device
    recorder = Recorder()
    assert write(tmp_path / "g", [aligned(data)], recorder) is False
    assert recorder.calls == [(False, len(data))]


def test_a_persist_whose_blocks_went_direct_is_whole_and_verifies_though_its_slot_is_reused_at_once(
        tmp_path: Path, fresh: None) -> None:
    data = os.urandom(5 * ALIGN + 1000)
    slot = aligned(data)
    released: list[bytes] = []

    def release() -> None:  # the next snapshot overwrites the slot at once
        released.append(bytes(slot[:16]))
        slot[:] = b"\0" * len(slot)

    written = persist_rank(Layout(tmp_path / "ckpt"), step=3, rank=0, world_size=1, generation="g", parts=[slot],
                           tensors={}, skeleton={}, checksum="sha256", pool=None, release=release)
    assert released == [data[:16]]
    assert (written.path / STATE_FILE).read_bytes() == data
    entry = json.loads((written.path / MANIFEST_FILE).read_text())["files"][STATE_FILE]
    checksum = entry["checksum"]
    expected = digest_parts([memoryview(data)], algorithm=checksum["algorithm"], chunk_bytes=checksum["chunk_bytes"])
    assert entry["bytes"] == len(data) and checksum["digest"] == expected.digest
