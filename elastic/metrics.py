"""Optional Prometheus metrics of one agent: members, generation, restarts, last recovery seconds,
degraded mode. Enabled with `elastic-run --metrics-port PORT` when `prometheus_client` is installed
(`pip install 'elastic-train[metrics]'`); otherwise every update is a no-op."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)


@dataclass
class AgentMetrics:
    _gauges: dict[str, Any] = field(default_factory=dict)
    _server: Any = None
    port: int | None = None

    @staticmethod
    def start(port: int | None, addr: str = "0.0.0.0") -> AgentMetrics:
        metrics = AgentMetrics()
        if port is None:
            return metrics
        try:
            import prometheus_client as prom
        except ImportError:
            log.warning(
                "--metrics-port given but prometheus_client is not installed; pip install 'elastic-train[metrics]'"
            )
            return metrics
        registry = prom.CollectorRegistry()
        metrics._gauges = {
            "members": prom.Gauge("elastic_members", "Nodes in the current round", registry=registry),
            "generation": prom.Gauge("elastic_generation", "Current rendezvous round", registry=registry),
            "restarts": prom.Counter("elastic_restarts", "Worker group restarts", registry=registry),
            "last_recovery_seconds": prom.Gauge("elastic_last_recovery_seconds",
                                                "Failure seen to workers running again", registry=registry),
            "degraded": prom.Gauge("elastic_degraded", "1 while etcd is unreachable", registry=registry),
        }
        server, _thread = prom.start_http_server(port, addr=addr, registry=registry)
        metrics._server, metrics.port = server, int(server.server_port)
        log.info("metrics: serving Prometheus metrics on %s:%d", addr, metrics.port)
        return metrics

    def update(self, *, restarts_inc: int = 0, **values: float) -> None:
        if not self._gauges:
            return
        if restarts_inc:
            self._gauges["restarts"].inc(restarts_inc)
        for name, value in values.items():
            self._gauges[name].set(float(value))

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server = None
