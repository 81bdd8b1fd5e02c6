"""trainer: make a user's own training loop resumable, exactly.

Public surface: `Resumable` and `ResumeConfig` (restore at start, save every N steps, the
micro-batch loop, teardown), `train_loop` (the same loop written once: you write the step),
`run_elastic` (a sharded run re-formed in place by running its training function again),
`ElasticSampler` and `DataConfig` (the global data position, the per-rank batch and gradient
accumulation), `training_digest` / `state_digest`, `Topology`, `wrap_ddp` (DDP with one
gradient-bucket layout, for bitwise resume at any world size), and the errors.
"""

# Dynamo first, before the caller creates a process group: imported afterwards (every torch.optim
# constructor imports it), it keeps the default group alive past destroy_process_group (torch 2.13),
# so gloo's worker threads outlive it, and one freeing a collective's tensors while the interpreter
# shuts down aborts the process (SIGABRT at exit, after a finished run). It costs no time: the
# optimizer would import it anyway.
import torch._dynamo  # noqa: F401  (import order: see above)

from trainer import gloo_sockets
from trainer.config import ResumeConfig
from trainer.data import DataConfig, ElasticSampler
from trainer.ddp import wrap_ddp
from trainer.digest import state_digest, training_digest
from trainer.errors import ExtrasError, StaleIteratorError, StateMismatchError, TrainerError, UsageError
from trainer.in_place import run_elastic
from trainer.loop import train_loop
from trainer.resumable import Resumable
from trainer.topology import Topology

# Before the caller creates a process group too: its gloo sockets are noted, so that a rank leaving it in a
# re-formation can fail the collectives in flight (trainer/gloo_sockets.py).
gloo_sockets.record_new_groups()

__all__ = [
    "DataConfig",
    "ElasticSampler",
    "ExtrasError",
    "ResumeConfig",
    "Resumable",
    "StaleIteratorError",
    "StateMismatchError",
    "Topology",
    "TrainerError",
    "UsageError",
    "run_elastic",
    "state_digest",
    "train_loop",
    "training_digest",
    "wrap_ddp",
]
