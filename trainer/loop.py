"""`train_loop`: the resumable loop written once, for users who only write the step.

    def train_step(step: int, micro_batches: list) -> None:
        optimizer.zero_grad(set_to_none=True)
        for (x, y), weight, sync in run.accumulate(micro_batches):   # sampler.accum_steps of them
            with sync:                                               # ddp.no_sync() but for the last
                loss = loss_fn(ddp(x), y) * weight
                loss.backward()
        optimizer.step()
        scheduler.step()

    run = Resumable(ResumeConfig.at(ckpt_dir, save_every=100), model=ddp, optimizer=optimizer,
                    scheduler=scheduler, sampler=sampler)
    train_loop(train_step, run, total_steps, loader=sampler.loader(dataset, num_workers=2))
    run.teardown()   # digest, frees the process group
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from trainer.resumable import Resumable


def train_loop(
    train_step: Callable[[int, list[Any]], Any],
    resumable: Resumable,
    total_steps: int,
    *,
    loader: Iterable[Any] | None = None,
) -> int:
    """Restore, run `train_step` for every step up to `total_steps`, save the last step, then close;
    return the step reached.

    `train_step(step, micro_batches)` does one optimizer step. `step` counts the steps completed
    before it (0 on a fresh start); `micro_batches` holds this rank's `sampler.accum_steps`
    micro-batches of the step: items of `loader` (build it with `sampler.loader(dataset)`; it is
    iterated only after the restore, so it starts at the restored data position), or lists of
    sample ids when `loader` is None. After each step `resumable.step_done` advances the data
    position and saves every `save_every` steps. Its return value is ignored. Under elastic-run a
    membership change re-forms the group in place (`Resumable.reform`): the interrupted step is
    discarded and run again by the new group, with a fresh iterator of `loader`. The last step is
    saved too (`Resumable.save_final`), so that the job restarted once finished does not redo it.
    """
    sampler = resumable.sampler
    if sampler is None:
        raise ValueError("train_loop needs a Resumable with a sampler (it hands each step its micro-batches)")
    if total_steps < 0:
        raise ValueError(f"total_steps must be >= 0, got {total_steps}")
    batches = None
    try:
        step = resumable.restore()
        batches = resumable.telemetry.timed(loader) if loader is not None else None  # data wait, for metrics
        while step < total_steps:
            try:
                resumable.check_round()
                if batches is None:
                    micro: list[Any] = list(sampler.micro_batches())
                else:
                    micro = [next(batches) for _ in range(sampler.accum_steps)]
                train_step(step, micro)
            except Exception as exc:  # a lost peer or a new round: re-form in place (re-raises anything else)
                step = resumable.reform(exc)
                del batches  # its prefetched batches belong to the old partition
                batches = resumable.telemetry.timed(loader) if loader is not None else None
                continue
            step += 1
            resumable.step_done(step)
        resumable.save_final()
    finally:
        # Stop DataLoader workers now, not at interpreter exit (where they can outlive the process group).
        del batches
        resumable.close()
    return step
