"""`RendezvousConfig`: what one etcd-v3 rendezvous handler is given, built from torch's
`RendezvousParameters` and the parsed `--rdzv-conf` (`elastic/rdzv_settings.py`)."""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass, field
from datetime import timedelta

from torch.distributed.elastic.rendezvous.api import RendezvousParameters

from elastic.admission import load_join_token
from elastic.etcd_client import EtcdClientConfig, resolve_password
from elastic.keys import DEFAULT_PREFIX
from elastic.rdzv_settings import TORCH_KEYS, RendezvousSettings, parse_conf


@dataclass(frozen=True, kw_only=True)
class RendezvousConfig:
    run_id: str
    """The job's run id (`--rdzv-id`); runs with different ids never mix."""
    node_id: str
    """This agent's id (`--rdzv-conf node_id=`); default `<hostname>-<pid>-<random>`."""
    min_nodes: int
    """Fewest nodes a round may close with (`--nnodes MIN:MAX`)."""
    max_nodes: int
    """Most nodes in a round; more wait as spares."""
    local_addr: str
    """Address other nodes reach this node's TCPStore at (`--local-addr`)."""
    etcd: EtcdClientConfig
    """How to reach etcd (`--rdzv-endpoint` plus TLS/auth from `--rdzv-conf`)."""
    prefix: str = DEFAULT_PREFIX
    """etcd key prefix shared by all runs (`--rdzv-conf prefix=`)."""
    lease_ttl: timedelta = timedelta(seconds=3)
    """Membership lease TTL (`--rdzv-conf lease_ttl=`)."""
    join_timeout: timedelta = timedelta(seconds=600)
    """Deadline for one rendezvous round (`--rdzv-conf join_timeout=`)."""
    last_call_timeout: timedelta = timedelta(seconds=30)
    """How long a round with >= min nodes waits for a live node that does not join (`last_call_timeout=`)."""
    bind_addr: str | None = None
    """Host this node's listening sockets (beacon, rank 0's TCPStore) bind to: `--local-addr` when given; None: all."""
    join_token: bytes | None = field(default=None, repr=False)
    """The run's join token (`$ELASTIC_JOIN_TOKEN` or `join_token_file=`); None: no admission (elastic/admission.py)."""

    def __post_init__(self) -> None:
        if not 0 < self.min_nodes <= self.max_nodes:
            raise ValueError(f"--nnodes {self.min_nodes}:{self.max_nodes}: need 0 < min <= max")
        for name in ("lease_ttl", "join_timeout", "last_call_timeout"):
            if getattr(self, name) <= timedelta(0):
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @staticmethod
    def from_parameters(params: RendezvousParameters) -> RendezvousConfig:
        # The same parser as elastic-run's up-front check, so stock torchrun rejects the same mistakes.
        try:
            settings = parse_conf({k: v for k, v in params.config.items() if k not in TORCH_KEYS})
        except ValueError as exc:
            raise ValueError(f"--rdzv-conf: {exc}") from exc
        return RendezvousConfig.from_settings(params, settings)

    @staticmethod
    def from_settings(params: RendezvousParameters, settings: RendezvousSettings) -> RendezvousConfig:
        default_node = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        return RendezvousConfig(
            run_id=params.run_id,
            node_id=settings.node_id or default_node,
            min_nodes=params.min_nodes,
            max_nodes=params.max_nodes,
            local_addr=params.local_addr or socket.getfqdn(),
            etcd=EtcdClientConfig(
                endpoints=params.endpoint,
                ca_cert=settings.ca_cert,
                cert=settings.cert,
                key=settings.key,
                user=settings.user,
                password=resolve_password(settings.user, settings.password, settings.password_file),
                retry_deadline=settings.etcd_timeout,
            ),
            prefix=settings.prefix,
            lease_ttl=settings.lease_ttl,
            join_timeout=settings.join_timeout,
            last_call_timeout=settings.last_call_timeout,
            bind_addr=params.local_addr or None,
            join_token=load_join_token(settings.join_token_file),
        )
