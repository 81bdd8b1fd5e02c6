"""A tier-0 snapshot's bookkeeping, taken off the step boundary (issue J).

A loop that waits for the device at the end of each step (`loss.item()`) leaves the GPU idle while
`Resumable.step_done` runs: every millisecond there is a millisecond of every step. A snapshot has two parts:
- what the next step changes, taken at the boundary: the step, the RNG streams, the data position, the
  schedules, the optimizer's param_groups (StateView.boundary), and an event on each device's training stream
  (Checkpointer.mark: the copies read the state as it was there);
- the rest, which only the optimizer's next step would make wrong: checking that the model's and optimizer's
  tensors are the cached ones, the staging layout, a tier-0 slot, the copies' plan and their launch (~1.3 ms of
  the training thread for a 124M GPT with AdamW on an H200 host; bench/goodput_bench.py).

`DeferredSnapshots` holds the first part and finishes the snapshot from a forward hook, once the next forward
is queued and the device is busy with it; at the latest before the optimizer's next step (Resumable's wait
hook calls `flush`), or at the next save, re-formation or close.

Only where nothing but the optimizer's step changes the saved tensors between two steps: a model without
buffers (BatchNorm's running statistics change in forward), an optimizer to hook, "overlapped" mode (the
optimizer already waits for the copies), replicated state. Elsewhere snapshots are taken at the boundary.
A worker killed between a step's end and the next forward's has the snapshot of the step before: one step
lost. For that, `Resumable.step_done(k)` waits until the snapshot of k-1 (launched in step k's forward) is
published before it defers k's: without the wait, a checksum slower than a step (the CPU under load) lost two.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ckpt.snapshot import StateMark
from trainer.state_view import Boundary


class DeferredSnapshots:
    """The snapshot whose boundary part is taken and whose rest waits for the next forward (see the module)."""

    def __init__(self, model: torch.nn.Module, finish: Callable[[int, Boundary, StateMark], None]) -> None:
        self._finish = finish
        self._pending: tuple[int, Boundary, StateMark] | None = None
        self._hook = model.register_forward_hook(self._on_forward)

    @staticmethod
    def applies(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, *, mode: str, sharded: bool,
                tier0: bool) -> bool:
        return (tier0 and optimizer is not None and mode == "overlapped" and not sharded
                and not any(True for _ in model.buffers()))

    def defer(self, step: int, boundary: Boundary, mark: StateMark) -> None:
        self.flush()
        self._pending = (step, boundary, mark)

    @property
    def pending(self) -> int | None:
        """The step of the snapshot waiting for its rest, if any."""
        return self._pending[0] if self._pending is not None else None

    def drop(self, step: int) -> None:
        """Forget the waiting snapshot if it is of `step` (a save of that same step is about to take its place)."""
        if self._pending is not None and self._pending[0] == step:
            self._pending = None

    def flush(self) -> None:
        """Finish the waiting snapshot now (its errors are the snapshot's: see Resumable.snapshot)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self._finish(*pending)

    def _on_forward(self, *_: Any) -> None:
        # A compiled forward traces its hooks: there this one is a no-op (no graph break, `fullgraph=True` works),
        # and the optimizer's pre-hook finishes the snapshot instead.
        if torch.compiler.is_compiling():
            return
        if self._pending is not None:
            self.flush()

    def close(self) -> None:
        """Remove the hook, then finish the waiting snapshot (which may raise: the hook is gone either way)."""
        self._hook.remove()
        self.flush()
