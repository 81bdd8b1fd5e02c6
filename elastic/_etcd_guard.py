"""Guard process for the embedded etcd: `python -m elastic._etcd_guard --parent PID [--remove-dir D] -- etcd ...`.

Why a guard: when the process that wanted etcd dies (even by SIGKILL), etcd and its temporary data
dir must go too. The guard notices that its parent is gone (it is re-parented, so getppid() changes;
checked twice a second), then stops etcd gracefully and removes the data dir and log. etcd itself
gets SIGKILL through prctl(PR_SET_PDEATHSIG) if the guard dies. (The guard does not use a
parent-death signal for itself: Linux sends it when the *thread* that started the guard exits,
which would kill an etcd started from a short-lived thread.)

It imports only the standard library and is started by file path, so it does not pay for torch.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import signal
import subprocess
import sys
from types import FrameType

_PR_SET_PDEATHSIG = 1


def _set_parent_death_signal(sig: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


def _child_setup() -> None:
    # Runs in etcd's process before exec: die if the guard dies.
    _set_parent_death_signal(signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m elastic._etcd_guard")
    parser.add_argument("--parent", type=int, required=True, help="pid whose death stops etcd")
    parser.add_argument("--remove-dir", default=None, help="directory to delete once etcd has stopped")
    parser.add_argument("--remove-file", default=None, help="file (etcd's log) to delete once etcd has stopped")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("missing the etcd command after --")

    stopping = False

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)

    proc = subprocess.Popen(command, preexec_fn=_child_setup)  # noqa: PLW1509 - prctl must run in the child
    try:
        while proc.poll() is None and not stopping and os.getppid() == args.parent:
            try:
                proc.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                pass
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    finally:
        if args.remove_dir:
            shutil.rmtree(args.remove_dir, ignore_errors=True)
        if args.remove_file and os.getppid() != args.parent:  # a live parent still wants to read the log
            try:
                os.unlink(args.remove_file)
            except OSError:
                pass
    return proc.returncode if proc.returncode and proc.returncode > 0 else 0


if __name__ == "__main__":
    sys.exit(main())
