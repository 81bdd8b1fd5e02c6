"""Work of `Resumable.step_done` taken off the step boundary (issue J).

A loop that waits for the device at the end of each step (`loss.item()`) leaves the GPU idle while
`Resumable.step_done` runs: every millisecond there is a millisecond of every step. What need not happen at
the boundary waits in `NextForward` until the next forward is queued and the device is busy with it (a
forward hook); at the latest until the next step_done, the optimizer's next step (in "overlapped" mode), a
save, a re-formation or close. That is the progress beat and the metrics file's periodic write, and most of a
tier-0 snapshot, which has two parts:
- what the next step changes, taken at the boundary: the step, the RNG streams, the data position, the
  schedules, the extras, the optimizer's param_groups, and an event on each device's training stream
  (Checkpointer.mark: the copies read the state as it was there);
- the rest, which only the optimizer's next step would make wrong: flattening the first part into the
  checkpoint's tree, checking that the model's and optimizer's tensors are the cached ones, the staging layout,
  a tier-0 slot, the copies' plan and their launch (~1.3 ms of the training thread for a 124M GPT with AdamW on
  an H200 host; bench/goodput_bench.py).

`DeferredSaves` holds the first part and finishes the snapshot through `NextForward`. A persist (tier 1,
written from its tier-0 slot) goes the same way: taken whole at the boundary, on one H200 the step after each
tier-1 save was 17-24 ms slower, its training thread waiting (no more CPU time) with the GPU idle, while the
writer thread launched that save's copies (`bench/results/goodput_session36_usage/`). A save's failure that
stops the job (CheckpointSaveError) is then raised by that forward.

Snapshots wait only where nothing but the optimizer's step changes the saved tensors between two steps: a model without
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


class NextForward:
    """Work that waits until the next forward is queued (see the module); `flush` runs it now."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._work: list[Callable[[], object]] = []
        # A TorchScript module takes no hooks: its work waits for the other flush points.
        self._hook = None if isinstance(model, torch.jit.ScriptModule) else model.register_forward_hook(
            self._on_forward)

    def later(self, work: Callable[[], object]) -> None:
        self._work.append(work)

    def flush(self) -> None:
        """Run the waiting work in order; every piece runs, then the first error is raised."""
        error: Exception | None = None
        while self._work:
            work, self._work = self._work, []
            for fn in work:
                try:
                    fn()
                except Exception as exc:  # noqa: BLE001 - raised below, once the rest has run
                    error = error or exc
        if error is not None:
            raise error

    def _on_forward(self, *_: Any) -> None:
        # A compiled forward traces its hooks: there this one is a no-op (no graph break, `fullgraph=True` works),
        # and the next flush point runs the work instead.
        if torch.compiler.is_compiling():
            return
        if self._work:
            with torch.inference_mode(False):  # an evaluation's forward: what a snapshot makes must be normal tensors
                self.flush()

    def close(self) -> None:
        """Remove the hook, then run the waiting work (which may raise: the hook is gone either way)."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self.flush()


class DeferredSaves:
    """The snapshot or persist whose boundary part is taken and whose rest waits for the next forward (see the
    module)."""

    def __init__(self, later: NextForward, finish: Callable[[int, Boundary, StateMark, bool], None]) -> None:
        self._later = later
        self._finish = finish
        self._pending: tuple[int, Callable[[], Boundary], StateMark, bool] | None = None

    @staticmethod
    def applies(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, *, mode: str, sharded: bool,
                tier0: bool) -> bool:
        return (tier0 and optimizer is not None and mode == "overlapped" and not sharded
                and not any(True for _ in model.buffers()))

    def defer(self, step: int, boundary: Callable[[], Boundary], mark: StateMark, *, persist: bool = False) -> None:
        """`boundary()` flattens the boundary part taken at `step`'s end (Resumable._take_boundary). `persist`: a
        save to tier 1 (from tier 0), else a tier-0 snapshot."""
        self.flush()
        self._pending = (step, boundary, mark, persist)
        self._later.later(self.flush)

    @property
    def pending(self) -> int | None:
        """The step of the snapshot waiting for its rest, if any."""
        return self._pending[0] if self._pending is not None else None

    def drop(self, step: int) -> None:
        """Forget the waiting save if it is of `step` (a save of that same step is about to take its place)."""
        if self._pending is not None and self._pending[0] == step:
            self._pending = None

    def flush(self) -> None:
        """Finish the waiting save now (its errors are the save's: see Resumable.save and snapshot)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            step, boundary, mark, persist = pending
            self._finish(step, boundary(), mark, persist)
