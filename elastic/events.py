"""Structured event log lines: one JSON object per line on the `elastic.events` logger.

Events: `join`, `leave`, `round_closed`, `restart`, `recovered`, `degraded`. Each carries the run id,
the node id, and timings in seconds, so a log pipeline can reconstruct every recovery.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

log = logging.getLogger("elastic.events")


def emit(event: str, **fields: Any) -> dict[str, Any]:
    record = {"event": event, "ts": round(time.time(), 3), **fields}
    log.info("%s", json.dumps(record, sort_keys=True, default=str))
    return record
