"""Structured event log lines: one JSON object per line on the `elastic.events` logger.

Events: `join`, `leave`, `round_closed`, `restart`, `recovered`, `degraded`. Each carries the run id,
the node id, and timings in seconds, so a log pipeline can reconstruct every recovery.

The same events also go to torch's event handler (`torch.distributed.elastic.events.record`) as
`elastic.<event>` from source AGENT, to the destination `--event-log-handler` names, next to
torch's own worker events. The agent sets that destination (`route_to_torch`); until then (stock
torchrun loading only the rendezvous handler) it is torch's `null` handler.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

log = logging.getLogger("elastic.events")

_torch_destination = "null"


def route_to_torch(destination: str) -> None:
    """Also record every event to torch's event handler `destination` (`--event-log-handler`)."""
    from torch.distributed.elastic.events.handlers import get_logging_handler

    try:
        get_logging_handler(destination)
    except KeyError as exc:
        raise ValueError(f"--event-log-handler {destination!r} is not a registered torch event handler "
                         "(torch ships 'console' and 'null')") from exc
    global _torch_destination
    _torch_destination = destination


def emit(event: str, **fields: Any) -> dict[str, Any]:
    record = {"event": event, "ts": round(time.time(), 3), **fields}
    log.info("%s", json.dumps(record, sort_keys=True, default=str))
    if _torch_destination != "null":
        _record_in_torch(record)
    return record


def _record_in_torch(record: dict[str, Any]) -> None:
    from torch.distributed.elastic import events as torch_events

    # torch's metadata values are scalars: lists and dicts travel as JSON text.
    metadata = {k: v if v is None or isinstance(v, str | int | float | bool) else json.dumps(v, default=str)
                for k, v in record.items() if k not in ("event", "ts")}
    torch_events.record(
        torch_events.Event(name=f"elastic.{record['event']}", source=torch_events.EventSource.AGENT,
                           timestamp=int(record["ts"] * 1000), metadata=metadata),
        _torch_destination,
    )
