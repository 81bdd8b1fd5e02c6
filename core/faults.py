"""The one fault injector: deterministic faults keyed by (node, rank, restart, step, point).

Tests and the chaos harness configure it through one environment variable, which workers inherit
from their agent; examples and user code carry no crash flags. The library calls `fire(point, step)`
at its fault points:
- `step`: before the loop runs step `step + 1`, i.e. `step` steps are done (trainer);
- `save`: in the save of `step`, after this rank's files are written and before the group
  commits it (trainer, through the checkpointer's per-rank hook);
- `join`: in an in-place re-formation, before a kept worker that had completed `step` steps joins
  the agent's new round (trainer).

`ELASTIC_FAULTS` holds a JSON list of faults, e.g.
    [{"point": "step", "step": 12, "rank": 2, "action": "sigkill"}]
Keys: `point` and `step` (required); `rank` (global rank; omitted: any), `node` (ELASTIC_NODE_ID;
omitted: any), `restart` (TORCHELASTIC_RESTART_COUNT; default 0 so a restarted worker does not
crash again; null: every restart), `action` (`sigkill` default, `exit` with status 1, `raise`
InjectedFault, `hang` for `seconds`, default 3600). A `fault` event is emitted before acting.
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass
from typing import Any, Literal

from core.events import NODE_ID_ENV, emit

FAULTS_ENV = "ELASTIC_FAULTS"
Point = Literal["step", "save", "join"]
Action = Literal["sigkill", "exit", "raise", "hang"]
_POINTS = ("step", "save", "join")
_ACTIONS = ("sigkill", "exit", "raise", "hang")


class InjectedFault(RuntimeError):
    """Raised by a fault whose action is `raise`."""


@dataclass(frozen=True, kw_only=True)
class Fault:
    point: Point
    step: int
    rank: int | None = None
    node: str | None = None
    restart: int | None = 0
    action: Action = "sigkill"
    seconds: float = 3600.0

    def __post_init__(self) -> None:
        if self.point not in _POINTS:
            raise ValueError(f"{FAULTS_ENV}: point {self.point!r} is not one of {', '.join(_POINTS)}")
        if self.action not in _ACTIONS:
            raise ValueError(f"{FAULTS_ENV}: action {self.action!r} is not one of {', '.join(_ACTIONS)}")

    def matches(self, point: str, step: int, *, rank: int, node: str | None, restart: int) -> bool:
        return (self.point == point and self.step == step
                and (self.rank is None or self.rank == rank)
                and (self.node is None or self.node == node)
                and (self.restart is None or self.restart == restart))

    def to_json(self) -> dict[str, Any]:
        # `restart` stays even when None: omitted, it would mean restart 0.
        return {k: v for k, v in self.__dict__.items() if v is not None or k == "restart"}


def encode(faults: list[Fault]) -> str:
    """The `ELASTIC_FAULTS` value for `faults` (what a test or the harness puts in the env)."""
    return json.dumps([f.to_json() for f in faults])


def parse(raw: str) -> list[Fault]:
    try:
        items = json.loads(raw)
        if not isinstance(items, list):
            raise TypeError("not a list")
        return [Fault(**item) for item in items]
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{FAULTS_ENV} must be a JSON list of faults such as "
                         f'[{{"point": "step", "step": 12, "rank": 0}}]; got {raw!r}: {exc}') from exc


_cache: tuple[str, list[Fault]] | None = None


def configured() -> list[Fault]:
    """The faults in this process's environment (parsed once per value)."""
    global _cache
    raw = os.environ.get(FAULTS_ENV, "")
    if _cache is None or _cache[0] != raw:
        _cache = (raw, parse(raw) if raw else [])
    return _cache[1]


def fire(point: Point, step: int) -> None:
    """Act on the first configured fault that matches this process at `point` of `step`."""
    faults = configured()
    if not faults:
        return
    rank = int(os.environ.get("RANK", "0"))
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    node = os.environ.get(NODE_ID_ENV)
    for fault in faults:
        if fault.matches(point, step, rank=rank, node=node, restart=restart):
            emit("fault", point=point, step=step, action=fault.action)
            _act(fault)
            return


def _act(fault: Fault) -> None:
    if fault.action == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault.action == "exit":
        os._exit(1)
    elif fault.action == "raise":
        raise InjectedFault(f"injected fault at {fault.point} of step {fault.step}")
    else:
        time.sleep(fault.seconds)
