"""elastic: etcd v3 membership, the `etcd-v3` rendezvous handler and the `elastic-run` launcher."""

from elastic.errors import (
    ElasticError,
    ElasticRendezvousClosedError,
    ElasticRendezvousTimeoutError,
    EtcdBinaryNotFoundError,
    EtcdStartError,
    EtcdUnavailableError,
    NodeIdConflictError,
)
from elastic.etcd_server import EtcdServer, EtcdServerConfig

__all__ = [
    "ElasticError",
    "ElasticRendezvousClosedError",
    "ElasticRendezvousTimeoutError",
    "EtcdBinaryNotFoundError",
    "EtcdServer",
    "EtcdServerConfig",
    "EtcdStartError",
    "EtcdUnavailableError",
    "NodeIdConflictError",
]
