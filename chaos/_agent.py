"""Start one simulated node's `elastic-run` agent at a common barrier.

    python -m chaos._agent --ready FILE --barrier FILE -- <elastic-run arguments>

The slow part of an agent's start (importing torch) happens before the barrier; the harness opens
the barrier once every node is ready, so the nodes register in etcd within milliseconds of one
another and the first round holds them all. (Started seconds apart, the first node closes a round
alone and the others arrive while it starts its workers: a legitimate but different scenario.)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(prog="python -m chaos._agent")
    parser.add_argument("--ready", type=Path, required=True, help="touched once the agent's imports are done")
    parser.add_argument("--barrier", type=Path, required=True, help="the agent starts once this file exists")
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args(argv[:split])
    _die_with_parent()
    from elastic import prestart  # no torch

    prestart.begin(argv[split + 1:])  # the workers' interpreters import torch beside us (elastic/prestart.py)
    from elastic import launcher  # torch and friends: the slow imports

    args.ready.touch()
    deadline = time.monotonic() + args.timeout
    while not args.barrier.exists():
        if time.monotonic() > deadline:
            print(f"elastic-chaos: the start barrier {args.barrier} did not open within {args.timeout:.0f} s",
                  file=sys.stderr)
            return 1
        time.sleep(0.005)
    return launcher.cli(argv[split + 1:])


def _die_with_parent() -> None:
    """SIGTERM when the harness dies, even by SIGKILL: torch's agent then stops its workers."""
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


if __name__ == "__main__":
    sys.exit(main())
