"""elastic: etcd v3 membership, the `etcd-v3` rendezvous handler and the `elastic-run` launcher.

The names below load on first use (PEP 562), not with the package: `elastic.errors` imports torch, and
the launcher starts its workers' interpreters (elastic/prestart.py) before it imports torch itself.
"""

from __future__ import annotations

import importlib
from typing import Any

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

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'elastic' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
