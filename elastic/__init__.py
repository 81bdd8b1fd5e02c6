"""elastic: etcd v3 membership, the `etcd-v3` rendezvous handler and the `elastic-run` launcher.

The names below load on first use (PEP 562), not with the package: `elastic.errors` imports torch, and
the launcher starts its workers' interpreters (elastic/prestart.py) before it imports torch itself.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what type checkers see; at run time __getattr__ loads them
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

_LAZY = {
    "ElasticError": "elastic.errors",
    "ElasticRendezvousClosedError": "elastic.errors",
    "ElasticRendezvousTimeoutError": "elastic.errors",
    "EtcdBinaryNotFoundError": "elastic.errors",
    "EtcdStartError": "elastic.errors",
    "EtcdUnavailableError": "elastic.errors",
    "NodeIdConflictError": "elastic.errors",
    "EtcdServer": "elastic.etcd_server",
    "EtcdServerConfig": "elastic.etcd_server",
}

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


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'elastic' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
