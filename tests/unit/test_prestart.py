"""elastic/prestart.py: which command lines get their workers' interpreters started before the launcher's imports.

A wrong "yes" costs a torch import the agent then dismisses; a wrong "no" costs only the overlap. So the rule follows
the launcher's: warm spares on, in-process re-formation, the etcd-v3 backend, a numeric --nproc-per-node.
"""

from __future__ import annotations

import pytest

from elastic.prestart import ENV_PRESTART, ENV_WARM_SPARE, planned_workers

ON = {ENV_WARM_SPARE: "1"}


@pytest.mark.parametrize(("argv", "environ", "expected"), [
    (["train.py"], ON, 1),
    (["--nproc-per-node", "2", "train.py", "--lr", "1"], ON, 2),
    (["--nproc_per_node=4", "--standalone", "train.py"], ON, 4),
    (["--nnodes", "2", "--rdzv-endpoint", "h:2379", "--nproc-per-node", "2", "train.py"], ON, 2),
    (["--rdzv-backend", "etcd-v3", "--rdzv-endpoint", "h:2379", "train.py"], ON, 1),
    (["--nproc-per-node", "3", "train.py"], {ENV_WARM_SPARE: "0"}, 0),  # the suite's default: no spares
    (["--warm-spare", "--nproc-per-node", "3", "train.py"], {ENV_WARM_SPARE: "0"}, 3),  # the flag wins
    (["--no-warm-spare", "train.py"], ON, 0),
    (["--reform", "restart", "train.py"], ON, 0),
    (["--reform=restart", "train.py"], ON, 0),
    (["--rdzv-backend", "c10d", "--rdzv-endpoint", "h:29400", "train.py"], ON, 0),
    (["--nnodes", "2", "--master-addr", "h", "train.py"], ON, 0),  # torchrun's static rendezvous
    (["--master-port", "29500", "train.py"], ON, 0),
    (["--nproc-per-node", "gpu", "train.py"], ON, 0),  # counted by torch, after the imports
    (["--nproc-per-node", "0", "train.py"], ON, 0),
    (["--nproc-per-node", "\u00b2", "train.py"], ON, 0),  # isdigit() is true of it: int() raised in the launcher
    (["--no-python", "/bin/true"], ON, 0),
    (["--help"], ON, 0),
    (["train.py"], {**ON, ENV_PRESTART: "0"}, 0),
])
def test_planned_workers(argv: list[str], environ: dict[str, str], expected: int) -> None:
    assert planned_workers(argv, environ) == expected


class _Started:
    """A process started ahead, as `take` sees it (the real ones: tests/integration/test_reform.py)."""

    def __init__(self, alive: bool = True) -> None:
        self.running, self.stopped = alive, False

    def alive(self) -> bool:
        return self.running

    def release(self) -> None:
        pass

    def stop(self, timeout_s: float = 5.0) -> None:
        self.running, self.stopped = False, True


@pytest.mark.parametrize(("started", "count", "workers", "spare"), [
    ([True, True, True], 2, 2, True),  # the workers, and the node's warm spare started with them
    ([True, True, False], 2, 2, False),  # the spare is gone: the workers all the same
    ([True, True], 2, 2, False),  # one fewer than planned: no spare
    ([True, True, True, True], 2, 0, False),  # more than planned: a wrong guess, all ended
    ([True], 2, 0, False),
    ([True, False, True], 2, 0, False),  # a worker is gone: the agent starts its workers itself
    ([True, True], -1, 0, False),  # dismissed
])
def test_take_hands_over_the_workers_and_the_spare_started_ahead(
        monkeypatch: pytest.MonkeyPatch, started: list[bool], count: int, workers: int, spare: bool) -> None:
    from elastic import prestart

    made = [_Started(alive) for alive in started]
    monkeypatch.setattr(prestart, "_spares", list(made))
    got, extra = prestart.take(count)
    assert got == made[:workers] and extra is (made[count] if spare else None)
    handed = [*got, *([extra] if extra is not None else [])]
    assert all(not p.stopped for p in handed) and all(p.stopped or not p.alive() for p in made if p not in handed)
    assert not prestart._spares
