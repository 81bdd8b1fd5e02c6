"""Entry point of the `torchrun.handlers` group (`etcd-v3`).

torch loads this while its rendezvous package is still importing, so this module imports nothing
at load time; the real handler module is imported on first use.
"""

from __future__ import annotations

from typing import Any


def torchrun_plugin() -> Any:
    """Called by torch with no arguments; returns the creator it registers for `etcd-v3`."""

    def create_handler(params: Any) -> Any:
        from elastic.rendezvous import create_handler as create

        return create(params)

    return create_handler
