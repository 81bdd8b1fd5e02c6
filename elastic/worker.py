"""The worker side of the agent-worker contract, in one bootstrap.

`bootstrap()` is called once by every worker that `trainer` runs in (it is idempotent). Under a
torch elastic agent (elastic-run or torchrun) it:
- ends the worker when its agent dies (`elastic.orphan`), so no orphan holds ports or GPU memory;
- turns a lost peer's collective error into one line (`elastic.peer_loss`);
- skips the interpreter's last full garbage collection at exit (`elastic.fast_exit`: ~1.5 s of CPU);
- prints every thread's stack on SIGUSR1 (faulthandler), which the agent sends before it kills a
  worker it judged stuck, unless the script handles SIGUSR1 itself.
`beat(step)` and `finish()` report progress to the agent's hang detector (`elastic.progress`).
"""

from __future__ import annotations

import faulthandler
import signal

from elastic import fast_exit, orphan, peer_loss, progress

STACKS_SIGNAL = signal.SIGUSR1

beat = progress.beat
finish = progress.finish


def bootstrap() -> bool:
    """Start the worker-side services; returns whether this process runs under an elastic agent."""
    if not orphan.under_agent():
        return False
    if signal.getsignal(STACKS_SIGNAL) == signal.SIG_DFL:
        # The agent asks for every thread's stack before it kills a worker it judged stuck.
        faulthandler.register(STACKS_SIGNAL, all_threads=True)
    fast_exit.install()
    orphan.exit_with_parent()  # a worker whose agent was SIGKILLed must not linger
    peer_loss.install()  # a lost peer's traceback gives way to the agent's one line
    return True
