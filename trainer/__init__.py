"""trainer: make a user's own training loop resumable, exactly.

Public surface: `Resumable` and `ResumeConfig` (restore at start, save every N steps),
`ElasticSampler` and `DataConfig` (the global data position), `training_digest`, and the errors.
"""

from trainer.data import DataConfig, ElasticSampler
from trainer.digest import state_digest, training_digest
from trainer.errors import StateMismatchError, TrainerError
from trainer.resumable import Resumable, ResumeConfig
from trainer.topology import Topology

__all__ = [
    "DataConfig",
    "ElasticSampler",
    "ResumeConfig",
    "Resumable",
    "StateMismatchError",
    "Topology",
    "TrainerError",
    "state_digest",
    "training_digest",
]
