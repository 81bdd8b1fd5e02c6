"""Typed errors of the elastic package. Messages name the endpoint, key or node and say what to do."""

from __future__ import annotations

from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousTimeoutError,
)


class ElasticError(Exception):
    """Base class for errors raised by `elastic`."""


class EtcdBinaryNotFoundError(ElasticError):
    """No etcd server binary could be found for the embedded etcd."""


class EtcdStartError(ElasticError):
    """The embedded etcd did not start or did not become healthy in time."""


class EtcdUnavailableError(RendezvousConnectionError, ElasticError):
    """etcd could not be reached within the deadline (`transient`), or refused a call that no retry mends."""

    def __init__(self, message: str, *, transient: bool = False) -> None:
        super().__init__(message)
        self.transient = transient


class NodeIdConflictError(RendezvousError, ElasticError):
    """Another live agent already registered the same node id in the same run."""


class EtcdRecordError(RendezvousError, ElasticError):
    """A value under a run's etcd prefix is malformed (not what an agent of this run writes)."""

    def __init__(self, key: str, problem: str, advice: str | None = None, mod_revision: int = 0) -> None:
        self.key = key
        self.problem = problem
        self.mod_revision = mod_revision
        """The value's mod_revision, so a warning about it is given once per write."""
        advice = advice or f"Delete it with `etcdctl del {key}`, or use another --rdzv-id"
        super().__init__(f"etcd key {key} is malformed: {problem}. {advice}.")


class RunIdConflictError(RendezvousError, ElasticError):
    """The run id is in use by a job launched with different settings."""


class AdmissionError(RendezvousError, ElasticError):
    """This agent may not join the run: it lacks the run's join token, or holds another one."""


class ElasticRendezvousTimeoutError(RendezvousTimeoutError, ElasticError):
    """A rendezvous round did not complete within its deadline."""


class ElasticRendezvousClosedError(RendezvousClosedError, ElasticError):
    """The run's rendezvous is closed: the job finished or was shut down."""


class LeaseGoneError(ElasticError):
    """A write under a lease etcd no longer has (it lapsed, or etcd lost its data): the node registers again."""


__all__ = [
    "AdmissionError",
    "ElasticError",
    "ElasticRendezvousClosedError",
    "ElasticRendezvousTimeoutError",
    "EtcdBinaryNotFoundError",
    "EtcdRecordError",
    "EtcdStartError",
    "EtcdUnavailableError",
    "LeaseGoneError",
    "NodeIdConflictError",
    "RunIdConflictError",
]


EXIT_BELOW_MIN = 75
"""elastic-run's exit status when the live nodes fell below --nnodes MIN (sysexits' EX_TEMPFAIL: try again later).
The survivors persisted their newest state first, so a requeued job with the same --rdzv-id resumes from it."""


class BelowMinimumError(ElasticError):
    """Fewer live nodes than --nnodes MIN: no round can form, so the job stops instead of waiting."""

    live: int | None = None
    minimum: int | None = None

    @classmethod
    def of(cls, live: int, minimum: int) -> BelowMinimumError:
        error = cls(f"the job needs {minimum} node{'s' if minimum != 1 else ''} (--nnodes {minimum}:...) and has "
                    f"{live}: it stops now; a requeue with the same --rdzv-id resumes from the state persisted")
        error.live, error.minimum = live, minimum
        return error
