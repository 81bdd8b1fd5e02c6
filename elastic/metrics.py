"""Optional Prometheus metrics of one agent: members, generation, restarts by cause, re-formations,
recovery times, degraded mode, and its workers' training series (elastic/job_metrics.py). Enabled with
`elastic-run --metrics-port PORT` when `prometheus_client` is installed
(`pip install 'elastic-train[metrics]'`); otherwise every update is a no-op."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

RESTART_CAUSES = ("worker_failure", "peer_lost", "membership_change", "other")
_RECOVERY_BUCKETS = (1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)


@dataclass
class AgentMetrics:
    _gauges: dict[str, Any] = field(default_factory=dict)
    _registry: Any = None
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
            "restarts": prom.Counter("elastic_restarts", "Worker group restarts by cause", ["cause"],
                                     registry=registry),
            "reformations": prom.Counter("elastic_reformations", "Restarts and re-formations with other members",
                                         registry=registry),
            "failure_to_step": prom.Histogram("elastic_failure_to_step_seconds",
                                              "Failure seen to the first training step after it",
                                              buckets=_RECOVERY_BUCKETS, registry=registry),
            "last_recovery_seconds": prom.Gauge("elastic_last_recovery_seconds",
                                                "Failure seen to workers running again", registry=registry),
            "degraded": prom.Gauge("elastic_degraded", "1 while etcd is unreachable", registry=registry),
        }
        for cause in RESTART_CAUSES:  # zeros, so that increase() sees the first restart of each cause
            metrics._gauges["restarts"].labels(cause)
        metrics._registry = registry
        server, _thread = prom.start_http_server(port, addr=addr, registry=registry)
        metrics._server, metrics.port = server, int(server.server_port)
        log.info("metrics: serving Prometheus metrics on %s:%d", addr, metrics.port)
        return metrics

    def update(self, *, restarts_inc: int = 0, **values: float) -> None:
        if not self._gauges:
            return
        if restarts_inc:
            self._gauges["restarts"].labels("other").inc(restarts_inc)
        for name, value in values.items():
            self._gauges[name].set(float(value))

    def restarted(self, cause: str) -> None:
        if self._gauges:
            self._gauges["restarts"].labels(cause).inc()

    def reformed(self) -> None:
        if self._gauges:
            self._gauges["reformations"].inc()

    def failure_to_step(self, seconds: float) -> None:
        if self._gauges:
            self._gauges["failure_to_step"].observe(seconds)

    def serve_workers(self, collector: Any) -> None:
        """Serve the series of `collector` (a prometheus_client collector, read at each scrape) too."""
        if self._registry is not None:
            self._registry.register(collector)

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server = None
